//===- SetLayout.cpp - The layout the passes compile for ------------------===//
//
// The frontend records the spec's layout on the module; this pass lets a
// pipeline (or tessel-opt) choose another one for the same graph. See
// Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

namespace tessel {
#define GEN_PASS_DEF_SETLAYOUT
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;

namespace {

struct SetLayoutPass : tessel::impl::SetLayoutBase<SetLayoutPass> {
  using SetLayoutBase::SetLayoutBase;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    MeshShape mesh = dist::meshOf(module);
    for (auto [axis, size] : {std::make_pair(MeshAxis::DP, (int64_t)dp),
                              std::make_pair(MeshAxis::TP, (int64_t)tp),
                              std::make_pair(MeshAxis::PP, (int64_t)pp)}) {
      if (size < 0) {
        module.emitError("tessel-set-layout: ")
            << meshAxisName(axis) << " must be >= 1, got " << size;
        return signalPassFailure();
      }
      if (size > 0)
        mesh[axis] = size;
    }
    dist::setMesh(module, mesh);

    if (sp == "true")
      module->setAttr("dist.sequence_parallel", UnitAttr::get(&getContext()));
    else if (sp == "false")
      module->removeAttr("dist.sequence_parallel");
    else if (!sp.empty()) {
      module.emitError("tessel-set-layout: sp must be true or false, got '")
          << sp << "'";
      return signalPassFailure();
    }

    pipe::LayoutAttr layout = pipe::layoutOf(module);
    if (microbatches > 0 && microbatches != layout.getMicrobatches()) {
      module.emitError("tessel-set-layout: the graph was built for ")
          << layout.getMicrobatches()
          << " microbatches (its inputs hold one microbatch); compile the "
             "spec with parallel.microbatches = "
          << (int64_t)microbatches << " instead";
      return signalPassFailure();
    }
    int64_t chunks =
        virtualStages > 0 ? (int64_t)virtualStages : layout.getVirtualStages();
    std::string order = schedule.empty() ? layout.getSchedule().str()
                                         : std::string(schedule);
    auto updated = pipe::LayoutAttr::getChecked(
        [&] { return module.emitError("tessel-set-layout: "); },
        &getContext(), layout.getMicrobatches(), StringRef(order), chunks,
        layout.getLayerStages());
    if (!updated)
      return signalPassFailure();
    pipe::setLayout(module, updated);
  }
};

} // namespace

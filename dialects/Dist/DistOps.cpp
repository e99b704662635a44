//===- DistOps.cpp - The dist dialect: meshes, shardings, collectives -----===//

#include "dialects/Dist/DistOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace tessel::dist;

#include "dialects/Dist/DistDialect.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Dist/DistAttrs.cpp.inc"
#define GET_TYPEDEF_CLASSES
#include "dialects/Dist/DistTypes.cpp.inc"

void DistDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/Dist/DistAttrs.cpp.inc"
      >();
  addTypes<
#define GET_TYPEDEF_LIST
#include "dialects/Dist/DistTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Dist/DistOps.cpp.inc"
      >();
}

#define GET_OP_CLASSES
#include "dialects/Dist/DistOps.cpp.inc"

int tessel::dist::axisId(StringRef name) {
  for (int i = 0; i < kNumAxes; ++i)
    if (name == kAxisNames[i])
      return i;
  return -1;
}

ArrayAttr tessel::dist::axesAttr(MLIRContext *ctx, unsigned axes) {
  SmallVector<Attribute> names;
  for (int i = 0; i < kNumAxes; ++i)
    if (axes & (1u << i))
      names.push_back(StringAttr::get(ctx, kAxisNames[i]));
  return ArrayAttr::get(ctx, names);
}

unsigned tessel::dist::axesMask(ArrayAttr axes) {
  unsigned mask = 0;
  for (Attribute a : axes)
    if (auto s = dyn_cast<StringAttr>(a); s && axisId(s.getValue()) >= 0)
      mask |= 1u << axisId(s.getValue());
  return mask;
}

std::string tessel::dist::axesString(unsigned axes) {
  std::string s;
  for (int i = 0; i < kNumAxes; ++i)
    if (axes & (1u << i))
      s += (s.empty() ? "" : ",") + std::string(kAxisNames[i]);
  return s.empty() ? "-" : s;
}

Sharding Sharding::fromAttr(ShardingAttr attr) {
  Sharding s;
  for (Attribute dim : attr.getDims())
    s.dims.push_back(axesMask(cast<ArrayAttr>(dim)));
  s.partial = axesMask(attr.getPartial());
  if (attr.getBlocks())
    for (auto [d, count] : llvm::enumerate(attr.getBlocks().asArrayRef()))
      s.setBlocks(d, count);
  return s;
}

ShardingAttr Sharding::toAttr(MLIRContext *ctx) const {
  SmallVector<Attribute> dimAttrs;
  for (unsigned d : dims)
    dimAttrs.push_back(axesAttr(ctx, d));
  return ShardingAttr::get(ctx, ArrayAttr::get(ctx, dimAttrs),
                           axesAttr(ctx, partial),
                           blocks.empty() ? DenseI64ArrayAttr()
                                          : DenseI64ArrayAttr::get(ctx, blocks));
}

unsigned Sharding::allAxes() const {
  unsigned all = partial;
  for (unsigned d : dims)
    all |= d;
  return all;
}

Mesh Mesh::of(Operation *op) {
  Mesh mesh;
  auto module = isa<ModuleOp>(op) ? cast<ModuleOp>(op)
                                   : op->getParentOfType<ModuleOp>();
  if (!module)
    return mesh;
  for (auto meshOp : module.getOps<MeshOp>())
    for (auto [name, size] : llvm::zip(meshOp.getAxes(), meshOp.getShape()))
      mesh.size[axisId(cast<StringAttr>(name).getValue())] = size;
  return mesh;
}

int64_t Mesh::groupSize(unsigned axes) const {
  int64_t g = 1;
  for (int i = 0; i < kNumAxes; ++i)
    if (axes & (1u << i))
      g *= size[i];
  return g;
}

static LogicalResult verifyAxes(function_ref<InFlightDiagnostic()> emitError,
                                ArrayAttr axes, bool allowEmpty) {
  unsigned seen = 0;
  for (Attribute a : axes) {
    auto name = dyn_cast<StringAttr>(a);
    if (!name || axisId(name.getValue()) < 0)
      return emitError() << "unknown mesh axis " << a
                         << " (axes: dp, tp, pp, cp, ep)";
    unsigned bit = 1u << axisId(name.getValue());
    if (seen & bit)
      return emitError() << "mesh axis " << a << " appears twice";
    seen |= bit;
  }
  if (!allowEmpty && axes.empty())
    return emitError() << "needs at least one mesh axis";
  return success();
}

LogicalResult ShardingAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                   ArrayAttr dims, ArrayAttr partial,
                                   DenseI64ArrayAttr blocks) {
  if (blocks && (blocks.size() != (int64_t)dims.size() ||
                 llvm::any_of(blocks.asArrayRef(),
                              [](int64_t b) { return b < 1; })))
    return emitError() << "blocks must give a count >= 1 for each dimension";
  unsigned seen = 0;
  auto check = [&](ArrayAttr axes) -> LogicalResult {
    if (failed(verifyAxes(emitError, axes, true)))
      return failure();
    unsigned mask = axesMask(axes);
    if (seen & mask)
      return emitError() << "a mesh axis is used twice in one sharding";
    seen |= mask;
    return success();
  };
  for (Attribute dim : dims) {
    auto axes = dyn_cast<ArrayAttr>(dim);
    if (!axes)
      return emitError() << "each dimension's entry must be a list of axes";
    if (failed(check(axes)))
      return failure();
  }
  return check(partial);
}

LogicalResult MeshOp::verify() {
  if (getAxes().size() != getShape().size())
    return emitOpError("has ") << getAxes().size() << " axes but "
                               << getShape().size() << " sizes";
  if (failed(verifyAxes([&] { return emitOpError(); }, getAxes(), false)))
    return failure();
  for (int64_t s : getShape())
    if (s < 1)
      return emitOpError("axis sizes must be >= 1");
  return success();
}

// Checks the axes and returns the group size of the collective.
static FailureOr<int64_t> groupOf(Operation *op, ArrayAttr axes) {
  if (failed(verifyAxes([&] { return op->emitOpError(); }, axes, false)))
    return failure();
  return Mesh::of(op).groupSize(axesMask(axes));
}

LogicalResult AllReduceOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  if (getInputs().getTypes() != getResults().getTypes())
    return emitOpError("result types must equal the operand types");
  return success();
}

LogicalResult AllReduceStartOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  if (getInputs().getTypes() != getResults().getTypes())
    return emitOpError("result types must equal the operand types");
  return success();
}

// `big` is `small` scaled by `group` along `dim`, equal elsewhere.
static LogicalResult checkScaled(Operation *op, RankedTensorType small,
                                 RankedTensorType big, int64_t dim,
                                 int64_t group, StringRef what) {
  if (dim < 0 || dim >= small.getRank() || small.getRank() != big.getRank())
    return op->emitOpError("dim ") << dim << " out of range";
  for (int64_t d = 0; d < small.getRank(); ++d) {
    int64_t expect = small.getDimSize(d) * (d == dim ? group : 1);
    if (big.getDimSize(d) != expect)
      return op->emitOpError(what) << " dimension " << d << " must be "
                                   << expect << " for a group of " << group
                                   << ", got " << big.getDimSize(d);
  }
  return success();
}

LogicalResult AllGatherOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  return checkScaled(*this, getInput().getType(), getResult().getType(),
                     getDim(), *group, "result");
}

LogicalResult ReduceScatterOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  return checkScaled(*this, getResult().getType(), getInput().getType(),
                     getDim(), *group, "input");
}

LogicalResult AllToAllOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  auto in = getInput().getType(), out = getResult().getType();
  int64_t s = getSplitDim(), c = getConcatDim();
  if (s < 0 || c < 0 || s >= in.getRank() || c >= in.getRank() ||
      in.getRank() != out.getRank())
    return emitOpError("split_dim and concat_dim must be dimensions");
  for (int64_t d = 0; d < in.getRank(); ++d) {
    int64_t expect = in.getDimSize(d);
    if (d == s && d != c)
      expect /= *group;
    if (d == c && d != s)
      expect *= *group;
    if (out.getDimSize(d) != expect || (d == s && d != c &&
                                        in.getDimSize(d) % *group != 0))
      return emitOpError("result dimension ")
             << d << " must be " << expect << ", got " << out.getDimSize(d);
  }
  return success();
}

LogicalResult BroadcastOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  if (getInput().getType() != getResult().getType())
    return emitOpError("result type must equal the operand type");
  if (getRoot() < 0 || getRoot() >= *group)
    return emitOpError("root ") << getRoot() << " is outside the group of "
                                << *group;
  return success();
}

// The piece along `dim` has `small`'s length and lies inside `big`.
static LogicalResult checkPiece(Operation *op, RankedTensorType small,
                                RankedTensorType big, int64_t dim,
                                int64_t denominator) {
  if (dim < 0 || dim >= big.getRank() || small.getRank() != big.getRank())
    return op->emitOpError("dim ") << dim << " out of range";
  if (denominator < 1)
    return op->emitOpError("denominator must be >= 1");
  for (int64_t d = 0; d < big.getRank(); ++d)
    if (d != dim && small.getDimSize(d) != big.getDimSize(d))
      return op->emitOpError("shapes may differ only along dim ") << dim;
  if (small.getDimSize(dim) > big.getDimSize(dim))
    return op->emitOpError("the piece is longer than the whole");
  return success();
}

LogicalResult LocalSliceOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  return checkPiece(*this, getResult().getType(), getInput().getType(),
                    getDim(), getDenominator());
}

LogicalResult LocalInsertOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  return checkPiece(*this, getInput().getType(), getResult().getType(),
                    getDim(), getDenominator());
}

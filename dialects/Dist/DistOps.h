//===- DistOps.h - The dist dialect -----------------------------*- C++ -*-===//
#ifndef TESSEL_DIALECTS_DIST_DISTOPS_H
#define TESSEL_DIALECTS_DIST_DISTOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialects/Dist/DistDialect.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/Dist/DistAttrs.h.inc"
#define GET_TYPEDEF_CLASSES
#include "dialects/Dist/DistTypes.h.inc"
#define GET_OP_CLASSES
#include "dialects/Dist/DistOps.h.inc"

namespace tessel::dist {

// Mesh axes in rank order, innermost last: the runtime's MeshAxis numbering
// (dp=0, tp=1, pp=2, cp=3, ep=4) is used for bit masks.
constexpr const char *kAxisNames[] = {"dp", "tp", "pp", "cp", "ep"};
constexpr int kNumAxes = 5;
// The axis id of `name`, or -1.
int axisId(llvm::StringRef name);

// A sharding in C++ form: per dimension a bit mask of axes, plus partial axes.
struct Sharding {
  llvm::SmallVector<unsigned> dims;
  unsigned partial = 0;
  // Per dimension, the number of separately split blocks; empty when all 1.
  llvm::SmallVector<int64_t> blocks;

  int64_t blocksOf(size_t dim) const {
    return dim < blocks.size() ? blocks[dim] : 1;
  }
  void setBlocks(size_t dim, int64_t count) {
    if (count == blocksOf(dim))
      return;
    blocks.resize(dims.size(), 1);
    blocks[dim] = count;
    if (llvm::all_of(blocks, [](int64_t b) { return b == 1; }))
      blocks.clear();
  }

  static Sharding replicated(int64_t rank) {
    return Sharding{llvm::SmallVector<unsigned>(rank, 0u), 0};
  }
  static Sharding fromAttr(ShardingAttr attr);
  ShardingAttr toAttr(mlir::MLIRContext *ctx) const;
  unsigned allAxes() const;
  bool operator==(const Sharding &o) const {
    return dims == o.dims && partial == o.partial && blocks == o.blocks;
  }
  bool operator!=(const Sharding &o) const { return !(*this == o); }
};

// The mesh sizes of the module (from its dist.mesh op), all 1 when absent.
struct Mesh {
  int64_t size[kNumAxes] = {1, 1, 1, 1, 1};
  static Mesh of(mlir::Operation *op);
  int64_t groupSize(unsigned axes) const;
  int64_t worldSize() const { return groupSize((1u << kNumAxes) - 1); }
};

mlir::ArrayAttr axesAttr(mlir::MLIRContext *ctx, unsigned axes);
unsigned axesMask(mlir::ArrayAttr axes);
std::string axesString(unsigned axes);

} // namespace tessel::dist

#endif // TESSEL_DIALECTS_DIST_DISTOPS_H

//===- DistOps.h - The dist dialect -----------------------------*- C++ -*-===//
#ifndef TESSEL_DIALECTS_DIST_DISTOPS_H
#define TESSEL_DIALECTS_DIST_DISTOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "tessel/Support/MeshLayout.h"
#include "llvm/ADT/Hashing.h"

namespace tessel {
// Attribute parameters are hashed and compared.
inline llvm::hash_code hash_value(AxisSet axes) {
  return llvm::hash_value(axes.bits());
}
inline llvm::hash_code hash_value(const MeshShape &shape) {
  return llvm::hash_combine(
      llvm::hash_combine_range(shape.size, shape.size + kNumMeshAxes),
      shape.hybrid() ? shape.dpShard : 0, shape.orderName());
}
} // namespace tessel

#include "dialects/Dist/DistDialect.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialects/Dist/DistAttrs.h.inc"
#define GET_TYPEDEF_CLASSES
#include "dialects/Dist/DistTypes.h.inc"
#define GET_OP_CLASSES
#include "dialects/Dist/DistOps.h.inc"

namespace tessel::dist {

// A sharding in C++ form: per dimension the axes splitting it, plus the
// axes over which the value is a partial sum.
struct Sharding {
  llvm::SmallVector<AxisSet> dims;
  AxisSet partial;
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
    return Sharding{llvm::SmallVector<AxisSet>(rank), AxisSet(), {}};
  }
  static Sharding fromAttr(ShardingAttr attr);
  ShardingAttr toAttr(mlir::MLIRContext *ctx) const;
  // Every axis that splits a dimension or is partial.
  AxisSet allAxes() const;
  // The axes splitting one of the first `count` dimensions.
  AxisSet leadingAxes(size_t count) const;
  bool operator==(const Sharding &o) const {
    return dims == o.dims && partial == o.partial && blocks == o.blocks;
  }
  bool operator!=(const Sharding &o) const { return !(*this == o); }
};

// The mesh of the innermost module around `op` that has a dist.mesh
// attribute (a rank program's own module may not); one rank when none has.
MeshShape meshOf(mlir::Operation *op);
void setMesh(mlir::ModuleOp module, const MeshShape &shape);

} // namespace tessel::dist

#endif // TESSEL_DIALECTS_DIST_DISTOPS_H

//===- ShardingContext.h - What sharding rules see of the passes -*- C++ -*-===//
//
// The graph ops carry their own sharding rules (ShardingRuleOpInterface in
// dialects/Graph/GraphInterfaces.td). A rule talks to the pass that runs it
// only through these two small interfaces: propagation (what shardings the
// operands have, which ones the op needs, which ones it produces) and
// partition (local types are set; make the op compute this rank's piece).
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_DIALECTS_DIST_SHARDINGCONTEXT_H
#define TESSEL_DIALECTS_DIST_SHARDINGCONTEXT_H

#include "dialects/Dist/DistOps.h"

#include "mlir/IR/Builders.h"

#include <initializer_list>

namespace tessel::dist {

class ShardingContext {
public:
  virtual ~ShardingContext() = default;

  // The sharding `v` has so far (replicated when nothing set one).
  virtual Sharding get(mlir::Value v) = 0;
  // Records the sharding of a result of the op being visited.
  virtual void set(mlir::Value v, Sharding sharding) = 0;
  // States that `op` needs operand `i` with `sharding`; the pass inserts a
  // dist.reshard in front of the use when the operand has another.
  virtual void require(mlir::Operation *op, unsigned i,
                       const Sharding &sharding) = 0;
  // The sharding a consumer that needs `v` summed sees: its partial axes
  // reduced, and under sequence parallelism a [batch, seq, hidden]
  // activation summed over tp split along the sequence instead of
  // replicated (a reduce-scatter).
  virtual Sharding reduced(mlir::Value v) = 0;
  // Whether an earlier consumer already needs `v` as `reduced(v)` (so
  // reducing it for another costs nothing more).
  virtual bool isReducedAnyway(mlir::Value v) = 0;

  virtual const MeshShape &mesh() const = 0;
  // The axes with more than one rank; a plan's other axes split nothing.
  virtual AxisSet activeAxes() const = 0;
  // Whether the routed experts are split over tp (parallel.expert_tp), so
  // that every tp rank routes the same tokens.
  virtual bool expertTensorParallel() const = 0;

  // `s` with the given dimensions whole (negative: from the end).
  static Sharding whole(Sharding s, std::initializer_list<int64_t> dims) {
    for (int64_t d : dims)
      s.dims[d < 0 ? (int64_t)s.dims.size() + d : d] = {};
    return s;
  }
};

class PartitionContext {
public:
  virtual ~PartitionContext() = default;

  // The (global) sharding propagation gave `v`.
  virtual Sharding shardingOf(mlir::Value v) = 0;
  virtual const MeshShape &mesh() const = 0;
  // Microbatches per step: they split the batch in time as dp splits it in
  // space.
  virtual int64_t microbatches() const = 0;
  // Builds ops that carry the placement (layer, phase) of `anchor` and a
  // sharding annotation, before or after it.
  virtual mlir::OpBuilder builderBefore(mlir::Operation *anchor) = 0;
  virtual mlir::OpBuilder builderAfter(mlir::Operation *anchor) = 0;
  // Records the sharding of a value a rule created.
  virtual void annotate(mlir::Operation *op,
                        llvm::ArrayRef<Sharding> shardings) = 0;
};

} // namespace tessel::dist

#endif // TESSEL_DIALECTS_DIST_SHARDINGCONTEXT_H

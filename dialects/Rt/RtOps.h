//===- RtOps.h - The rt dialect ---------------------------------*- C++ -*-===//
#ifndef TESSEL_DIALECTS_RT_RTOPS_H
#define TESSEL_DIALECTS_RT_RTOPS_H

#include <tuple>

#include "dialects/Dist/DistOps.h"

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include <string>

namespace tessel::rtir {

// One collective call as the runtime counts it (tessel/Runtime/Comm.h) and
// plan.json predicts it.
struct CollectiveRecord {
  std::string kind; // all_reduce, all_gather, reduce_scatter, send_recv
  AxisSet axes;
  int64_t groupSize;
  int64_t elements;     // as counted by the runtime
  int64_t elementBytes; // 4 (fp32), 2 (bf16), 8 (fp64)
  int64_t bytesSent;    // the textbook volume (CommVolume.h)
};

// One argument of a runtime call (KernelCallOpInterface): an operand, a
// null value for an absent optional operand, or an attribute.
struct CallArgument {
  mlir::Value value;
  mlir::Attribute attr;
};

// Elements, element type and bytes per element of a buffer.
int64_t elementsOf(mlir::Value buffer);
mlir::Type elementTypeOf(mlir::Value buffer);
int64_t elementBytesOf(mlir::Value buffer);

// The buffer `v` views (through rt.view and rt.group_block), or `v` when it
// is not a view.
mlir::Value rootBuffer(mlir::Value v);
// Whether operand `index` of `op` is one the kernel only reads. Only the
// matmul family, rt.reduce_sum_leading, rt.slice_axis, rt.add_broadcast,
// rt.mul_broadcast and rt.swiglu_backward are known; any other access counts
// as a write.
bool onlyReadsOperand(mlir::Operation *op, unsigned index);

// The bytes of a rank program's activation slots: rt.arena_bytes per
// microbatch in flight (rt.arena_slots), or with an arena per chunk
// (rt.chunk_arena_offsets) the chunks' places (rt.chunk_arena_total); for
// pipeline rank `variant` of a program shared by several (-1: a program of
// its own).
int64_t arenaSlotsBytes(mlir::Operation *program, int64_t variant = -1);

// The buffers a rank program's pipeline sends are copied into (both
// runtimes copy, as the arena a send reads is reused at once): the slots
// of the send ring that the forward and backward sends take in turn
// (rt.send_ring_slots of rt.send_slot_bytes, tessel-order-messages), and a
// buffer for each other send until the step waits for its sends: per step
// function, its own sends once and a part's each time it runs the part (a
// call, or an entry of an rt.schedule table: the largest table), the
// larger of the training and evaluation steps, which never run at once.
// Each buffer is rounded up to `align` bytes.
struct SendBuffers {
  int64_t ringSlots = 0, slotBytes = 0;
  int64_t otherBytes = 0;
  int64_t total() const { return ringSlots * slotBytes + otherBytes; }
};
SendBuffers sendBuffersOf(mlir::ModuleOp program, int64_t align);

// The pipeline message an rt.send or rt.recv takes part in: (sender,
// receiver, tag), tags being numbered per channel. The ranks are those of
// the enclosing program (`pipe.rank`, 0 without one).
std::tuple<int64_t, int64_t, int64_t> messageOf(mlir::Operation *sendOrRecv);

} // namespace tessel::rtir

#include "dialects/Rt/RtDialect.h.inc"
#include "dialects/Rt/RtEnums.h.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Rt/RtAttrs.h.inc"
#define GET_TYPEDEF_CLASSES
#include "dialects/Rt/RtTypes.h.inc"
#include "dialects/Rt/RtInterfaces.h.inc"
#define GET_OP_CLASSES
#include "dialects/Rt/RtOps.h.inc"

#endif // TESSEL_DIALECTS_RT_RTOPS_H

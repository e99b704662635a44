//===- RtOps.cpp - The rt dialect: buffers, kernels, communication --------===//

#include "dialects/Rt/RtOps.h"

#include "tessel/Runtime/CommVolume.h"
#include "tessel/Runtime/Pieces.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace tessel;
using namespace tessel::rtir;

#include "dialects/Rt/RtDialect.cpp.inc"
#include "dialects/Rt/RtEnums.cpp.inc"
#include "dialects/Rt/RtInterfaces.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Rt/RtAttrs.cpp.inc"
#define GET_TYPEDEF_CLASSES
#include "dialects/Rt/RtTypes.cpp.inc"

void RtDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/Rt/RtAttrs.cpp.inc"
      >();
  addTypes<
#define GET_TYPEDEF_LIST
#include "dialects/Rt/RtTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Rt/RtOps.cpp.inc"
      >();
}

#define GET_OP_CLASSES
#include "dialects/Rt/RtOps.cpp.inc"

int64_t tessel::rtir::elementsOf(Value buffer) {
  return cast<MemRefType>(buffer.getType()).getNumElements();
}

Type tessel::rtir::elementTypeOf(Value buffer) {
  return cast<MemRefType>(buffer.getType()).getElementType();
}

int64_t tessel::rtir::elementBytesOf(Value buffer) {
  return elementTypeOf(buffer).getIntOrFloatBitWidth() / 8;
}

Value tessel::rtir::rootBuffer(Value v) {
  while (true) {
    if (auto view = v.getDefiningOp<ViewOp>())
      v = view.getSource();
    else if (auto block = v.getDefiningOp<GroupBlockOp>())
      v = block.getSource();
    else
      return v;
  }
}

bool tessel::rtir::onlyReadsOperand(Operation *op, unsigned index) {
  if (isa<MatmulOp, MatmulBiasGradOp, MatmulAccumulateOp,
          MatmulBiasGradAccumulateOp>(op))
    return index < 2;
  if (isa<GroupedMatmulWeightGradAccumulateOp>(op))
    return index != 2;
  if (isa<MatmulBiasOp, MatmulGeluGradOp, MatmulAddOp, SwigluBackwardOp>(op))
    return index < 3;
  if (isa<ReduceSumLeadingOp, SliceAxisOp>(op))
    return index < 1;
  if (isa<AddBroadcastOp, MulBroadcastOp>(op))
    return index < 2;
  return false;
}

int64_t tessel::rtir::arenaSlotsBytes(Operation *program, int64_t variant) {
  auto intAttr = [&](StringRef name) -> int64_t {
    auto a = program->getAttrOfType<IntegerAttr>(name);
    return a ? a.getInt() : 0;
  };
  int64_t bytes = intAttr("rt.arena_bytes");
  if (variant >= 0) {
    if (auto totals = program->getAttrOfType<DenseI64ArrayAttr>(
            "rt.variant_chunk_arena_total"))
      return totals[variant];
    auto slots =
        program->getAttrOfType<DenseI64ArrayAttr>("rt.variant_arena_slots");
    return bytes * (slots ? slots[variant] : 1);
  }
  if (program->hasAttr("rt.chunk_arena_offsets"))
    return intAttr("rt.chunk_arena_total");
  return bytes * std::max<int64_t>(1, intAttr("rt.arena_slots"));
}

tessel::rtir::SendBuffers tessel::rtir::sendBuffersOf(ModuleOp program,
                                                      int64_t align) {
  auto rounded = [&](int64_t bytes) {
    return align > 1 ? (bytes + align - 1) / align * align : bytes;
  };
  SendBuffers out;
  if (auto slots = program->getAttrOfType<IntegerAttr>("rt.send_ring_slots"))
    out.ringSlots = slots.getInt();
  if (auto bytes = program->getAttrOfType<IntegerAttr>("rt.send_slot_bytes"))
    out.slotBytes = rounded(bytes.getInt());
  auto sendsOf = [&](Operation *scope) {
    int64_t total = 0;
    scope->walk([&](SendOp send) {
      if (!send.getRing())
        total += rounded(elementsOf(send.getBuffer()) *
                         elementBytesOf(send.getBuffer()));
    });
    return total;
  };
  auto partSends = [&](StringRef callee) -> int64_t {
    auto part = program.lookupSymbol<func::FuncOp>(callee);
    return part ? sendsOf(part) : 0;
  };
  for (StringRef name : {"train_step", "eval_step"}) {
    auto step = program.lookupSymbol<func::FuncOp>(name);
    if (!step)
      continue;
    int64_t bytes = 0;
    for (Operation &op : step.getBody().getOps()) {
      if (auto call = dyn_cast<func::CallOp>(op)) {
        bytes += partSends(call.getCallee());
      } else if (auto schedule = dyn_cast<ScheduleOp>(op)) {
        int64_t most = 0;
        auto parts = schedule.getParts();
        for (Attribute t : schedule.getTables()) {
          auto table = dyn_cast<DenseI64ArrayAttr>(t);
          if (!table)
            continue;
          int64_t sum = 0;
          for (int64_t k = 0; k + 2 < (int64_t)table.size(); k += 3)
            if (table[k] >= 0 && table[k] < (int64_t)parts.size())
              sum += partSends(
                  cast<FlatSymbolRefAttr>(parts[table[k]]).getValue());
          most = std::max(most, sum);
        }
        bytes += most;
      } else {
        bytes += sendsOf(&op);
      }
    }
    out.otherBytes = std::max(out.otherBytes, bytes);
  }
  return out;
}

std::tuple<int64_t, int64_t, int64_t>
tessel::rtir::messageOf(Operation *sendOrRecv) {
  int64_t rank = 0;
  for (Operation *p = sendOrRecv->getParentOp(); p; p = p->getParentOp())
    if (auto r = p->getAttrOfType<IntegerAttr>("pipe.rank")) {
      rank = r.getInt();
      break;
    }
  if (auto send = dyn_cast<SendOp>(sendOrRecv))
    return {rank, rank + send.getOffset(), send.getTag()};
  auto recv = cast<RecvOp>(sendOrRecv);
  return {rank + recv.getOffset(), rank, recv.getTag()};
}

LogicalResult BatchOp::verify() {
  if (getName() != "tokens" && getName() != "targets" &&
      getName() != "positions")
    return emitOpError(
        "name must be \"tokens\", \"targets\" or \"positions\"");
  return success();
}

LogicalResult RecordMetricOp::verify() {
  // The name is written into the program's source as a string literal.
  StringRef name = getName();
  if (name.empty() || !llvm::all_of(name, [](char c) {
        return llvm::isAlnum(c) || c == '_' || c == '.';
      }))
    return emitOpError("name must be letters, digits, '_' and '.', got \"")
           << name << "\"";
  return success();
}

LogicalResult ScheduleOp::verify() {
  auto module = (*this)->getParentOfType<ModuleOp>();
  auto variants =
      module ? module->getAttrOfType<DenseI64ArrayAttr>("rt.variants")
             : DenseI64ArrayAttr();
  if (!variants)
    return emitOpError("is only meaningful in a program with rt.variants");
  if ((int64_t)getTables().size() != variants.size())
    return emitOpError("has ")
           << getTables().size() << " tables for " << variants.size()
           << " variants";
  int64_t parts = getParts().size();
  for (auto [k, table] : llvm::enumerate(getTables())) {
    auto entries = dyn_cast<DenseI64ArrayAttr>(table);
    if (!entries || entries.size() % 3 != 0)
      return emitOpError("table ")
             << k << " is not a list of (part, microbatch, first) triples";
    for (int64_t i = 0; i < entries.size(); i += 3)
      if (entries[i] < 0 || entries[i] >= parts || entries[i + 1] < 0 ||
          (entries[i + 2] != 0 && entries[i + 2] != 1))
        return emitOpError("table ") << k << " entry " << i / 3
                                     << " is out of range";
  }
  for (Attribute part : getParts()) {
    auto fn = module.lookupSymbol<func::FuncOp>(
        cast<FlatSymbolRefAttr>(part).getValue());
    if (!fn || fn.getNumArguments() != 2 || fn.getNumResults() != 0)
      return emitOpError("part ")
             << part << " is not a function of (microbatch, first)";
  }
  return success();
}

// A started gather or reduce-scatter along a dimension: the piece is
// outer x length x inner elements of the tensor's outer x (g length) x
// inner, and `blocks` (the ranks' pieces side by side) is there exactly
// when the dimension is not the outermost.
template <typename Op> static LogicalResult verifyStartedAlong(Op op) {
  Value piece = isa<AllGatherStartOp>(op.getOperation()) ? op.getInput()
                                                         : op.getOutput();
  Value whole = isa<AllGatherStartOp>(op.getOperation()) ? op.getOutput()
                                                          : op.getInput();
  int64_t n = op.getOuter() * op.getLength() * op.getInner();
  if (op.getOuter() < 1 || op.getLength() < 1 || op.getInner() < 1 ||
      elementsOf(piece) != n || elementsOf(whole) % n != 0)
    return op.emitOpError("outer x length x inner = ")
           << n << " does not describe a piece of " << elementsOf(piece)
           << " elements of a " << elementsOf(whole) << "-element tensor";
  if (elementTypeOf(piece) != elementTypeOf(whole))
    return op.emitOpError("gathers between element types");
  if ((op.getOuter() > 1) != (op.getBlocks() != nullptr))
    return op.emitOpError(op.getOuter() > 1
                              ? "needs `blocks` (the gathered dimension is "
                                "not the outermost)"
                              : "takes `blocks` only when outer > 1");
  if (op.getBlocks() && (elementsOf(op.getBlocks()) != elementsOf(whole) ||
                         elementTypeOf(op.getBlocks()) != elementTypeOf(whole)))
    return op.emitOpError("`blocks` must hold the whole tensor's elements, "
                          "of its element type");
  return success();
}

LogicalResult AllGatherStartOp::verify() { return verifyStartedAlong(*this); }
LogicalResult ReduceScatterStartOp::verify() {
  return verifyStartedAlong(*this);
}

LogicalResult StateOfOp::verify() {
  int64_t offset = getOffset().value_or(0);
  if (offset < 0 || offset + elementsOf(getBuffer()) > elementsOf(getParam()))
    return emitOpError("elements [")
           << offset << ", " << offset + elementsOf(getBuffer())
           << ") lie outside the parameter's " << elementsOf(getParam());
  return success();
}

LogicalResult GroupBlockOp::verify() {
  auto from = cast<MemRefType>(getSource().getType());
  auto to = cast<MemRefType>(getResult().getType());
  if (getBlocks() < 1 || getShift() < 0 || getShift() >= getBlocks())
    return emitOpError("shift ")
           << getShift() << " is not a block of " << getBlocks();
  if (from.getElementType() != to.getElementType() ||
      from.getNumElements() != to.getNumElements() * getBlocks())
    return emitOpError("cuts ")
           << from << " into " << getBlocks() << " blocks of " << to
           << ": the element type and count must agree";
  return success();
}

LogicalResult ShiftStartOp::verify() {
  if (getInput().getType() != getOutput().getType())
    return emitOpError("sends ")
           << getInput().getType() << " but receives " << getOutput().getType();
  if (getShift() < 1)
    return emitOpError("shift must be at least 1, got ") << getShift();
  return success();
}

// The product's columns [col, col + n) of rows of ldc elements: c holds m
// such rows and db one.
template <typename BiasGradOp>
static LogicalResult verifyColumnBlock(BiasGradOp op) {
  int64_t m = op.getM(), n = op.getN(), ldc = op.getLdc(), col = op.getCol();
  if (n < 0 || col < 0 || ldc < col + n)
    return op.emitOpError("columns [")
           << col << ", " << col + n << ") do not fit rows of " << ldc;
  if (elementsOf(op.getC()) != m * ldc || elementsOf(op.getDb()) != ldc)
    return op.emitOpError("writes ")
           << m << " rows of " << ldc << " and a row of " << ldc
           << ", but c has " << elementsOf(op.getC()) << " elements and db "
           << elementsOf(op.getDb());
  return success();
}

LogicalResult MatmulBiasGradOp::verify() { return verifyColumnBlock(*this); }
LogicalResult MatmulBiasGradAccumulateOp::verify() {
  return verifyColumnBlock(*this);
}

LogicalResult ViewOp::verify() {
  auto from = cast<MemRefType>(getSource().getType());
  auto to = cast<MemRefType>(getResult().getType());
  if (from.getNumElements() != to.getNumElements() ||
      from.getElementType() != to.getElementType())
    return emitOpError("views ") << from << " as " << to
                                 << ": the element count and type must agree";
  return success();
}

//===----------------------------------------------------------------------===//
// What each communication op counts
//===----------------------------------------------------------------------===//

static CollectiveRecord record(StringRef kind, AxisSet axes,
                               const MeshShape &mesh, int64_t elements,
                               int64_t elementBytes, int64_t bytesSent) {
  return {kind.str(), axes, mesh.groupSize(axes), elements, elementBytes,
          bytesSent};
}

void AllReduceOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  for (Value b : getBuffers())
    records.push_back(record("all_reduce", getAxes(), mesh, elementsOf(b),
                             elementBytesOf(b),
                             rt::allReduceBytesSent(
                                 elementsOf(b), mesh.groupSize(getAxes()),
                                 elementBytesOf(b))));
}

void AllReduceStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  for (Value b : getBuffers())
    records.push_back(record("all_reduce", getAxes(), mesh, elementsOf(b),
                             elementBytesOf(b),
                             rt::allReduceBytesSent(
                                 elementsOf(b), mesh.groupSize(getAxes()),
                                 elementBytesOf(b))));
}

// A gather or reduce-scatter along a dimension, blocking or started: the
// piece's n elements gathered, or g x n reduced into it.
static CollectiveRecord gatherAlong(Value input, AxisSet axes,
                                    const MeshShape &mesh) {
  int64_t n = elementsOf(input), bytes = elementBytesOf(input);
  return record("all_gather", axes, mesh, n, bytes,
                rt::allGatherBytesSent(n, mesh.groupSize(axes), bytes));
}
static CollectiveRecord reduceScatterAlong(Value input, Value output,
                                           AxisSet axes,
                                           const MeshShape &mesh) {
  int64_t n = elementsOf(output), bytes = elementBytesOf(input);
  int64_t g = mesh.groupSize(axes);
  return record("reduce_scatter", axes, mesh, g * n, bytes,
                rt::reduceScatterBytesSent(n, g, bytes));
}

void AllGatherOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  records.push_back(gatherAlong(getInput(), getAxes(), mesh));
}

void ReduceScatterOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  records.push_back(reduceScatterAlong(getInput(), getOutput(), getAxes(), mesh));
}

void AllGatherStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  records.push_back(gatherAlong(getInput(), getAxes(), mesh));
}

void ReduceScatterStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  records.push_back(reduceScatterAlong(getInput(), getOutput(), getAxes(), mesh));
}

// One step of a gather piece by piece: the piece sent, point to point, to
// one rank of the group (as the runtime counts a pipeline message).
void ShiftStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  int64_t n = elementsOf(getInput()), bytes = elementBytesOf(getInput());
  records.push_back(record("send_recv", getAxes(), mesh, n, bytes, n * bytes));
}

// A run cut into ceil(n / g)-element pieces (tessel/Runtime/Pieces.h)
// moves, per rank, the ring volume of a piece-sized reduce-scatter or
// all-gather.
using rt::pieceSize;

// A reduce-scatter of an n-element run's pieces over `axes`; under hybrid
// sharding `axes` may hold the shard group's replicas too, over which each
// piece is then all-reduced (as the runtime does).
static void shardsReduced(const MeshShape &mesh, AxisSet axes, int64_t n,
                          SmallVectorImpl<CollectiveRecord> &records) {
  AxisSet replicas = axes & AxisSet::dpReplica();
  axes -= replicas;
  int64_t g = mesh.groupSize(axes), c = pieceSize(n, g);
  records.push_back(record("reduce_scatter", axes, mesh, n, 4,
                           rt::reduceScatterBytesSent(c, g, 4)));
  if (!replicas.empty())
    records.push_back(
        record("all_reduce", replicas, mesh, c, 4,
               rt::allReduceBytesSent(c, mesh.groupSize(replicas), 4)));
}

void ReduceScatterShardsOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  shardsReduced(mesh, getAxes(), getN(), records);
}

void ReduceScatterShardsStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  for (Value b : getBuffers())
    shardsReduced(mesh, getAxes(), elementsOf(b), records);
}

void ReduceScatterPieceStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  shardsReduced(mesh, getAxes(), getN(), records);
}

// The gather of a run's pieces: in fp32, or in bf16 for a bf16 buffer (the
// copy of a run whose master weights are pieces and only matmuls read).
static void shardsGathered(const MeshShape &mesh, AxisSet axes, int64_t n,
                           Value buffer,
                           SmallVectorImpl<CollectiveRecord> &records) {
  int64_t g = mesh.groupSize(axes), bytes = elementBytesOf(buffer);
  records.push_back(record("all_gather", axes, mesh, pieceSize(n, g), bytes,
                           rt::allGatherBytesSent(pieceSize(n, g), g, bytes)));
}

void AllGatherShardsOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  shardsGathered(mesh, getAxes(), getN(), getBuffer(), records);
}

void AllGatherShardsStartOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  shardsGathered(mesh, getAxes(), getN(), getBuffer(), records);
}

void SendOp::describeCommunication(const MeshShape &mesh,
                                   SmallVectorImpl<CollectiveRecord> &records) {
  int64_t n = elementsOf(getBuffer()), bytes = elementBytesOf(getBuffer());
  records.push_back(record("send_recv", AxisSet(MeshAxis::PP), mesh, n, bytes,
                           n * bytes));
}

void RecvOp::describeCommunication(const MeshShape &,
                                   SmallVectorImpl<CollectiveRecord> &) {
  // Counted once, by the sender.
}

// The vocabulary-parallel loss combines row statistics over its group: two
// all-reduces in the forward, of `rows` values and of two values per row
// (the sums of exponentials and the target logits), and two of `rows`
// values in the backward unless it reads the forward's (`stats`).
void CrossEntropyVocabParallelForwardOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  int64_t rows = getRows(), g = mesh.groupSize(getAxes());
  records.push_back(record("all_reduce", getAxes(), mesh, rows, 4,
                           rt::allReduceBytesSent(rows, g)));
  records.push_back(record("all_reduce", getAxes(), mesh, 2 * rows, 4,
                           rt::allReduceBytesSent(2 * rows, g)));
}

void CrossEntropyVocabParallelBackwardOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  if (getStats())
    return;
  int64_t rows = getRows(), g = mesh.groupSize(getAxes());
  for (int k = 0; k < 2; ++k)
    records.push_back(record("all_reduce", getAxes(), mesh, rows, 4,
                             rt::allReduceBytesSent(rows, g)));
}

void MoeDispatchOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  int64_t g = mesh.groupSize(getAxes()), E = getNumExperts();
  // Counts per expert; with the sequence split (over cp or tp), per row as
  // well.
  bool perRow = getAxes().contains(MeshAxis::TP) ||
                getAxes().contains(MeshAxis::CP);
  int64_t n = perRow ? getRows() * E : E;
  if (g > 1 && getCapacity() > 0)
    records.push_back(record("all_gather", getAxes(), mesh, n, 4,
                             rt::allGatherBytesSent(n, g)));
}

// The rows an expert-parallel exchange moves depend on the routing: what
// is counted here is the most a rank can send (all its rows to other
// ranks), after the counts.
void MoeExchangeOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  int64_t g = mesh.groupSize(getAxes()), E = getNumExperts();
  if (g == 1)
    return;
  int64_t rows = elementsOf(getRows()) / getHidden();
  records.push_back(
      record("all_to_all", getAxes(), mesh, E, 4, E / g * (g - 1) * 4));
  records.push_back(record("all_to_all", getAxes(), mesh,
                           rows * getHidden(), 4, rows * getHidden() * 4));
}

void MoeCombineOp::describeCommunication(
    const MeshShape &mesh, SmallVectorImpl<CollectiveRecord> &records) {
  int64_t g = mesh.groupSize(getAxes());
  if (g == 1)
    return;
  // At most every row of the other ranks came here and goes back.
  int64_t rows = getRows();
  records.push_back(record("all_to_all", getAxes(), mesh,
                           g * rows * getHidden(),
                           4, (g - 1) * rows * getHidden() * 4));
}

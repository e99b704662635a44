//===- PlanMemory.cpp - Static memory plan of a rank program --------------===//
//
// Gives every buffer of a bufferized rank program (rt) its place, once and
// for all: parameters are packed in the parameter store; their gradients,
// AdamW moments and bf16 shadow sit at the same offsets in stores of their
// own; a parameter's final gradient is produced straight into the gradient
// store; the update's inputs accumulated over microbatches get
// accumulators; every other buffer gets an offset in the activation arena of
// its microbatch, reused as soon as the value is dead (first fit by
// liveness, a free block at the top growing when none fits, in the order
// the parts run within a microbatch, or greedy by size where that needs
// less; under the
// interleaved schedule an arena per chunk, placed per chunk of a microbatch
// in flight over the rank's schedule); a parameter
// received from another rank for the step is held after the arena slots
// (`received`). Values handed
// from one part to another keep one place. Afterwards each part refers only
// to its own ops (views of planned places), and collectives over buffers
// laid out side by side are one call. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

#include <map>

namespace tessel {
#define GEN_PASS_DEF_PLANMEMORY
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

constexpr int64_t kAlignment = 64;

int64_t bytesOf(Value v) {
  auto type = cast<MemRefType>(v.getType());
  return type.getNumElements() * type.getElementTypeBitWidth() / 8;
}

// First-fit allocator over one arena, merging neighbours on free.
class ArenaAllocator {
public:
  int64_t allocate(int64_t bytes) {
    bytes = llvm::alignTo(bytes, kAlignment);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes)
        continue;
      int64_t offset = it->first, size = it->second;
      free_.erase(it);
      if (size > bytes)
        free_[offset + bytes] = size - bytes;
      return offset;
    }
    // None fits: a free block at the top grows into the new space, rather
    // than being left below it.
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) {
        int64_t offset = last->first;
        free_.erase(last);
        top_ = offset + bytes;
        return offset;
      }
    }
    int64_t offset = top_;
    top_ += bytes;
    return offset;
  }
  void release(int64_t offset, int64_t bytes) {
    bytes = llvm::alignTo(bytes, kAlignment);
    auto it = free_.emplace(offset, bytes).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }
  int64_t size() const { return top_; }

private:
  std::map<int64_t, int64_t> free_;
  int64_t top_ = 0;
};

// A planned place: a store and an offset (bytes in the arena, elements
// elsewhere).
struct Place {
  rt::Space space;
  int64_t offset;
};

// One compute step of a rank's pipeline schedule: the forward (or backward)
// of one of its chunks on one microbatch.
struct ChunkStep {
  bool forward;
  int64_t chunk, microbatch;
};

class Planner {
public:
  Planner(func::FuncOp func, int64_t microbatches, int64_t slots,
          ArrayRef<ChunkStep> schedule, bool fuseAccumulation)
      : func(func), ctx(func.getContext()), microbatches(microbatches),
        fuseAccumulation(fuseAccumulation), accumulates(microbatches > 1),
        split(slots > 1), slots(slots), schedule(schedule) {}

  LogicalResult run();

private:
  void numberOps();
  Value rootOf(Value v);
  void placeParams();
  void placeGradients();
  void sumTermsInPlace();
  void placeAccumulators(pipe::UpdateOp update);
  void accumulateEarly(pipe::UpdateOp update);
  void placeArena();
  bool placeChunkSlots(ArrayRef<int64_t> chunkBytes);
  void placeStates();
  void materialize();
  void coalesceCollectives();
  void placeRequests();
  Value view(OpBuilder &b, Location loc, Type type, const Place &place) {
    return rt::BufferOp::create(b, loc, type, place.space, place.offset);
  }

  func::FuncOp func;
  MLIRContext *ctx;
  int64_t microbatches;
  // Weight gradients summed over microbatches by their GEMMs.
  bool fuseAccumulation;
  bool accumulates;
  // With several microbatches in flight, only what crosses from one part to
  // another needs a slot per microbatch; what lives within one run of a
  // part goes to one region all parts share (they run one at a time).
  bool split;
  // The microbatches in flight at once (whole-stage slots) and the rank's
  // schedule, by chunk.
  int64_t slots;
  SmallVector<ChunkStep> schedule;
  // With several chunks per rank (the interleaved schedule), where each
  // chunk's microbatch keeps what crosses its parts: a byte offset in the
  // arena per (chunk, microbatch), chunk-major; empty otherwise.
  SmallVector<int64_t> chunkOffsets;
  int64_t chunkArenaTotal = 0, chunksInFlight = 0;
  // Whether the step is cut into parts (a training step); an inference
  // step is one part of its own.
  bool hasParts = false;
  DenseMap<Operation *, int64_t> position;
  // A value that shares the storage of another (views, values handed on by
  // parts, the update's inputs without accumulation).
  DenseMap<Value, Value> aliasOf;
  DenseMap<Value, Place> placeOf; // of roots
  DenseMap<Value, int64_t> paramOffset;
  // Yield operands that only an accumulation reads (it is inserted where
  // the value is complete): they do not keep the value alive.
  DenseSet<std::pair<Operation *, unsigned>> accumulatedOnly;
  int64_t paramElems = 0, accumulatorElems = 0, arenaBytes = 0;
  int64_t normSums = 0, requests = 0, receivedBytes = 0, transientBytes = 0;
  int64_t kvCacheElems = 0;
  bool hadError = false;
};

void Planner::numberOps() {
  func.walk<WalkOrder::PreOrder>(
      [&](Operation *op) { position[op] = position.size(); });
}

Value Planner::rootOf(Value v) {
  while (true) {
    auto it = aliasOf.find(v);
    if (it == aliasOf.end())
      return v;
    v = it->second;
  }
}

void Planner::placeParams() {
  for (auto param : func.getBody().getOps<rt::ParamOp>()) {
    param.setOffsetAttr(
        IntegerAttr::get(IntegerType::get(ctx, 64), paramElems));
    paramOffset[param.getResult()] = paramElems;
    placeOf[param.getResult()] = {rt::Space::Params, paramElems};
    paramElems += cast<MemRefType>(param.getType()).getNumElements();
  }
  // An inference step's KV caches, one after the other in their store.
  for (auto cache : func.getBody().getOps<rt::KvCacheOp>()) {
    placeOf[cache.getResult()] = {rt::Space::KvCache, kvCacheElems};
    kvCacheElems += cast<MemRefType>(cache.getType()).getNumElements();
  }
}

// A parameter's final gradient (what its update reads) is produced straight
// into the gradient store at the parameter's offset.
void Planner::placeGradients() {
  func.walk([&](rt::AdamWOp adamw) {
    Value grad = rootOf(adamw.getGrad());
    int64_t offset = paramOffset.lookup(adamw.getParam());
    if (placeOf.count(grad))
      return;
    bool working = isa<BlockArgument>(grad) ||
                   (grad.getDefiningOp() &&
                    isa<rt::AllocOp>(grad.getDefiningOp()));
    if (working)
      placeOf[grad] = {rt::Space::Grads, offset};
  });
}

// Whether `op` is a kernel that writes all of its output operand (#2) as
// one product that an accumulating form can add instead (a GEMM of one
// product, an embedding table's gradient), with that output.
static bool wholeProduct(Operation *op, Value out) {
  if (!op || op->getNumOperands() < 3 || op->getOperand(2) != out ||
      llvm::count(op->getOperands(), out) != 1)
    return false;
  int64_t n = rt::elementsOf(out);
  if (auto mm = dyn_cast<rt::MatmulOp>(op))
    return mm.getBatch() == 1 && mm.getM() * mm.getN() == n;
  if (auto eb = dyn_cast<rt::EmbeddingBackwardOp>(op))
    return eb.getVocab() * eb.getHidden() == n;
  if (auto er = dyn_cast<rt::EmbeddingBackwardRangeOp>(op))
    return er.getLocalVocab() * er.getHidden() == n;
  return false;
}

// `product` (see wholeProduct) adding into `out` instead of writing it:
// its accumulating form, whose first run is `first`.
static void accumulateInto(OpBuilder &b, Operation *product, Value out,
                           Value first) {
  b.setInsertionPoint(product);
  if (auto mm = dyn_cast<rt::MatmulOp>(product))
    rt::MatmulAccumulateOp::create(
        b, mm.getLoc(), mm.getA(), mm.getB(), out, first, mm.getMAttr(),
        mm.getNAttr(), mm.getKAttr(), mm.getTransAAttr(), mm.getTransBAttr());
  else if (auto eb = dyn_cast<rt::EmbeddingBackwardOp>(product))
    rt::EmbeddingBackwardAccumulateOp::create(
        b, eb.getLoc(), eb.getIds(), eb.getDout(), out, first, eb.getNAttr(),
        eb.getVocabAttr(), eb.getHiddenAttr());
  else if (auto er = dyn_cast<rt::EmbeddingBackwardRangeOp>(product))
    rt::EmbeddingBackwardRangeAccumulateOp::create(
        b, er.getLoc(), er.getIds(), er.getDout(), out, first, er.getNAttr(),
        er.getVocabStartAttr(), er.getLocalVocabAttr(), er.getHiddenAttr());
  else
    llvm_unreachable("not a whole product");
  product->erase();
}

// Whether `op` only adds a product into its output operand (#2), on every
// run: an accumulating form whose first run is the constant false.
static bool addsOnly(Operation *op) {
  Value first;
  if (auto mm = dyn_cast<rt::MatmulAccumulateOp>(op))
    first = mm.getFirst();
  else if (auto eb = dyn_cast<rt::EmbeddingBackwardAccumulateOp>(op))
    first = eb.getFirst();
  else if (auto er = dyn_cast<rt::EmbeddingBackwardRangeAccumulateOp>(op))
    first = er.getFirst();
  else
    return false;
  auto c = first.getDefiningOp<arith::ConstantOp>();
  auto v = c ? dyn_cast<IntegerAttr>(c.getValue()) : IntegerAttr();
  return v && v.getInt() == 0;
}

// The kernels that write all of `value` as their product (rt.matmul of one
// product, rt.matmul_bias_grad, an experts' rt.grouped_matmul_weight_grad,
// an embedding table's gradient;
// several rt.matmul_bias_grad when each writes a column block of it, the
// q, k and v pieces of a fused projection's gradient), an allocation of its
// own that nothing but those GEMMs and the part's `yield` touches; empty
// otherwise.
static SmallVector<Operation *> productsOf(Value value, Operation *yield) {
  if (!value.getDefiningOp<rt::AllocOp>())
    return {};
  SmallVector<Operation *> products;
  // Columns the column blocks cover, and their rows' width (0: no blocks).
  int64_t columns = 0, width = 0;
  for (OpOperand &use : value.getUses()) {
    Operation *user = use.getOwner();
    if (user == yield)
      continue;
    // A second term that adds itself on every run (sumTermsInPlace) keeps
    // adding into the place the first term now sums into.
    if (use.getOperandNumber() == 2 && addsOnly(user) &&
        llvm::count(user->getOperands(), value) == 1)
      continue;
    if (use.getOperandNumber() != 2 ||
        llvm::count(user->getOperands(), value) != 1)
      return {};
    auto mm = dyn_cast<rt::MatmulOp>(user);
    auto bg = dyn_cast<rt::MatmulBiasGradOp>(user);
    auto gw = dyn_cast<rt::GroupedMatmulWeightGradOp>(user);
    auto eb = dyn_cast<rt::EmbeddingBackwardOp>(user);
    auto er = dyn_cast<rt::EmbeddingBackwardRangeOp>(user);
    // Column blocks go only with other column blocks of the same rows.
    if (bg && bg.getM() * bg.getLdc() == rt::elementsOf(value) &&
        (products.empty() || width == bg.getLdc())) {
      width = bg.getLdc();
      columns += bg.getN();
    } else if (!products.empty()) {
      return {};
    } else if (!(mm && mm.getBatch() == 1 &&
                 mm.getM() * mm.getN() == rt::elementsOf(value)) &&
               !(gw && gw.getNumExperts() * gw.getK() * gw.getN() ==
                           rt::elementsOf(value)) &&
               !(eb &&
                 eb.getVocab() * eb.getHidden() == rt::elementsOf(value)) &&
               !(er && er.getLocalVocab() * er.getHidden() ==
                           rt::elementsOf(value))) {
      return {};
    }
    products.push_back(user);
  }
  if (width) {
    // The blocks tile the rows: none overlaps another, together all.
    SmallVector<std::pair<int64_t, int64_t>> blocks;
    for (Operation *p : products) {
      auto bg = cast<rt::MatmulBiasGradOp>(p);
      blocks.push_back({bg.getCol(), bg.getCol() + bg.getN()});
    }
    llvm::sort(blocks);
    for (size_t i = 1; i < blocks.size(); ++i)
      if (blocks[i].first < blocks[i - 1].second)
        return {};
    if (columns != width)
      return {};
  }
  return products;
}

// A gradient that is the sum of two products, each written whole into a
// buffer of its own that only the sum reads (a tied embedding table's: the
// LM head's weight gradient and the embedding's scatter), is written by the
// first product and added to by the second (its accumulating form, on
// every run): no buffers for the terms, no pass to add them. With
// microbatches the first then sums into the gradient's place as a single
// product does (accumulateEarly).
void Planner::sumTermsInPlace() {
  SmallVector<rt::AddBroadcastOp> sums;
  func.walk([&](rt::AddBroadcastOp add) { sums.push_back(add); });
  for (rt::AddBroadcastOp add : sums) {
    Value out = add.getOut();
    int64_t n = rt::elementsOf(out);
    if (add.getN() != n || add.getNb() != n || add.getA() == add.getB() ||
        rt::elementTypeOf(add.getA()) != rt::elementTypeOf(out) ||
        rt::elementTypeOf(add.getB()) != rt::elementTypeOf(out))
      continue;
    // Each term: an allocation of its own, written by one whole product and
    // read by the sum only, in the sum's block.
    SmallVector<Operation *> products;
    for (Value term : {add.getA(), add.getB()}) {
      auto alloc = term.getDefiningOp<rt::AllocOp>();
      SmallVector<Operation *> users(term.getUsers());
      if (!alloc || alloc->getBlock() != add->getBlock() ||
          rt::elementsOf(term) != n || users.size() != 2 ||
          !llvm::is_contained(users, add.getOperation()))
        break;
      Operation *product = users[0] == add.getOperation() ? users[1] : users[0];
      if (product == add.getOperation() || !wholeProduct(product, term) ||
          product->getBlock() != add->getBlock() ||
          llvm::is_contained(product->getOperands(), out))
        break;
      products.push_back(product);
    }
    if (products.size() != 2)
      continue;
    // Nothing between the first product and the sum may touch the sum.
    llvm::sort(products, [](Operation *a, Operation *b) {
      return a->isBeforeInBlock(b);
    });
    bool touched = llvm::any_of(out.getUsers(), [&](Operation *user) {
      Operation *top = add->getBlock()->findAncestorOpInBlock(*user);
      return user != add.getOperation() &&
             (!top ||
              (products[0]->isBeforeInBlock(top) && top->isBeforeInBlock(add)));
    });
    Operation *def = out.getDefiningOp();
    if (touched || (def && def->getBlock() != add->getBlock() &&
                    !def->getBlock()->findAncestorOpInBlock(*add)))
      continue;
    // The sum's storage is named before the first product writes it.
    if (def && def->getBlock() == add->getBlock() &&
        products[0]->isBeforeInBlock(def)) {
      if (!isa<rt::AllocOp, rt::BufferOp>(def) || def->getNumOperands())
        continue;
      def->moveBefore(products[0]);
    }
    Value a = add.getA(), bTerm = add.getB();
    products[0]->setOperand(2, out);
    OpBuilder b(products[1]);
    Value never = arith::ConstantOp::create(b, add.getLoc(), b.getI1Type(),
                                            b.getBoolAttr(false));
    accumulateInto(b, products[1], out, never);
    add->erase();
    for (Value term : {a, bTerm})
      if (term.use_empty())
        term.getDefiningOp()->erase();
  }
}

// Each input of the update is summed into its place right after the last
// op of its part that reads or writes it, so that a weight gradient's
// buffer is free again for the rest of the backward pass rather than held
// to its end.
void Planner::accumulateEarly(pipe::UpdateOp update) {
  DenseMap<Operation *, Value> firstRun; // part -> its rt.first_run
  for (auto [input, arg] : llvm::zip(update.getInputs(),
                                      update.getBody().getArguments())) {
    auto result = dyn_cast<OpResult>(input);
    if (!result ||
        !isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(result.getOwner()))
      continue;
    Operation *part = result.getOwner();
    Block &body = part->getRegion(0).front();
    Operation *yield = body.getTerminator();
    Value value = yield->getOperand(result.getResultNumber());
    Value root = rootOf(value);
    Operation *after = nullptr;
    body.walk([&](Operation *op) {
      if (op == yield)
        return;
      for (Value operand : op->getOperands())
        if (isa<MemRefType>(operand.getType()) && rootOf(operand) == root) {
          Operation *top = body.findAncestorOpInBlock(*op);
          if (!after || after->isBeforeInBlock(top))
            after = top;
        }
    });
    OpBuilder b(ctx);
    Value &first = firstRun[part];
    if (!first) {
      b.setInsertionPointToStart(&body);
      first = rt::FirstRunOp::create(b, part->getLoc(), b.getI1Type());
    }
    // Only the accumulation reads it now, unless a later part takes it too.
    if (result.hasOneUse())
      accumulatedOnly.insert({yield, result.getResultNumber()});
    // A weight gradient that one GEMM writes whole (or GEMMs their column
    // blocks of it), and that nothing else in the part touches, is summed by
    // the GEMM in its place (beta = 1 after the first run): no buffer of its
    // own, no pass to add it. So is an embedding table's gradient, by the
    // scatter that writes it (the table zeroed on the first run only).
    SmallVector<Operation *> products;
    if (fuseAccumulation && result.hasOneUse() &&
        rt::elementTypeOf(value) == rt::elementTypeOf(arg))
      products = productsOf(value, yield);
    if (!products.empty()) {
      placeOf[value] = placeOf.lookup(arg);
      for (Operation *product : products) {
        if (wholeProduct(product, value)) {
          accumulateInto(b, product, value, first);
          continue;
        }
        b.setInsertionPoint(product);
        if (auto bg = dyn_cast<rt::MatmulBiasGradOp>(product))
          rt::MatmulBiasGradAccumulateOp::create(
              b, bg.getLoc(), bg.getA(), bg.getB(), value, bg.getDb(), first,
              bg.getMAttr(), bg.getNAttr(), bg.getKAttr(), bg.getLdcAttr(),
              bg.getColAttr());
        else if (auto gw = dyn_cast<rt::GroupedMatmulWeightGradOp>(product))
          rt::GroupedMatmulWeightGradAccumulateOp::create(
              b, gw.getLoc(), gw.getX(), gw.getDout(), value, gw.getOffsets(),
              first, gw.getSegmentsAttr(), gw.getNumExpertsAttr(),
              gw.getKAttr(), gw.getNAttr(), gw.getTransWAttr());
        product->erase();
      }
      continue;
    }
    if (after)
      b.setInsertionPointAfter(after);
    else
      b.setInsertionPoint(yield);
    Location loc = value.getLoc();
    Value place = view(b, loc, arg.getType(), placeOf.lookup(arg));
    rt::AccumulateOp::create(b, loc, value, place, first,
                             b.getI64IntegerAttr(rt::elementsOf(value)));
  }
}

// With several microbatches, each input of the update is accumulated into
// a place of its own (a gradient: its slot of the gradient store), which the
// update reads.
void Planner::placeAccumulators(pipe::UpdateOp update) {
  for (auto [input, arg] : llvm::zip(update.getInputs(),
                                      update.getBody().getArguments())) {
    if (!isa<MemRefType>(arg.getType())) {
      hadError = true;
      update.emitOpError("takes a request started in a part that runs once "
                         "per microbatch; it cannot be summed over "
                         "microbatches (wait for it in that part)");
      return;
    }
    if (!placeOf.count(arg)) {
      placeOf[arg] = {rt::Space::Accumulators, accumulatorElems};
      accumulatorElems += cast<MemRefType>(arg.getType()).getNumElements();
    }
  }
}

// The chunk a part runs (-1: the update, or an op outside every part).
static int64_t chunkOfPart(Operation *part) {
  if (auto f = dyn_cast_or_null<pipe::ForwardPassOp>(part))
    return f.getChunk();
  if (auto b = dyn_cast_or_null<pipe::BackwardPassOp>(part))
    return b.getChunk();
  return -1;
}

// Whether every wait for the collective `start` began is in its block (a
// tensor-parallel collective in flight under a GEMM, not a gradient bucket
// waited for by the update).
static bool waitedInPart(Operation *start) {
  return llvm::all_of(start->getResult(0).getUsers(), [&](Operation *user) {
    return isa<rt::WaitOp>(user) && user->getBlock() == start->getBlock();
  });
}

// Arena offsets by liveness: a buffer lives from its rt.alloc to the last op
// that reads it or any of its aliases.
//
// With several chunks per rank (the interleaved schedule), a microbatch is
// in flight on a chunk from the chunk's forward to its backward, and the
// chunks of a rank start and finish a microbatch at different times. When
// everything that crosses parts is read by one chunk's parts only, each
// chunk gets an arena of its own, and each (chunk, microbatch) its place
// over the schedule (placeChunkSlots): the rank holds the chunks in flight,
// not whole stages.
void Planner::placeArena() {
  DenseMap<Value, int64_t> lastUse;
  // The parts (ops of the function's body) that touch each buffer.
  DenseMap<Value, Operation *> firstPart;
  DenseSet<Value> crosses;
  // The one chunk whose parts touch each buffer (-1: several, or another
  // part).
  DenseMap<Value, int64_t> chunkOf;
  // Buffers of a collective that may still run after its part: their
  // microbatch's place must outlive the part.
  DenseSet<Value> started;
  int64_t chunks = 0;
  Block &top = func.getBody().front();
  auto touch = [&](Value root, Operation *part) {
    int64_t chunk = chunkOfPart(part);
    auto [it, inserted] = chunkOf.try_emplace(root, chunk);
    if (!inserted && it->second != chunk)
      it->second = -1;
  };
  func.walk([&](Operation *op) {
    chunks = std::max(chunks, chunkOfPart(op) + 1);
    if (auto alloc = dyn_cast<rt::AllocOp>(op))
      touch(alloc.getResult(), top.findAncestorOpInBlock(*op));
    // With accumulation, the update's operands are read where they are
    // yielded (the accumulation), not by the update.
    if (accumulates && isa<pipe::UpdateOp>(op))
      return;
    // A collective started and waited for in one part holds its buffers
    // until the wait.
    if (auto wait = dyn_cast<rt::WaitOp>(op)) {
      Operation *start = wait.getRequest().getDefiningOp();
      if (start && start->getBlock() == op->getBlock())
        for (Value operand : start->getOperands())
          if (isa<MemRefType>(operand.getType())) {
            int64_t &last = lastUse[rootOf(operand)];
            last = std::max(last, position[op]);
          }
      return;
    }
    for (OpOperand &use : op->getOpOperands()) {
      Value operand = use.get();
      if (!isa<MemRefType>(operand.getType()) ||
          accumulatedOnly.contains({op, use.getOperandNumber()}))
        continue;
      Value root = rootOf(operand);
      int64_t &last = lastUse[root];
      last = std::max(last, position[op]);
      Operation *part = top.findAncestorOpInBlock(*op);
      touch(root, part);
      auto [it, inserted] = firstPart.try_emplace(root, part);
      // A collective still running when its part ends keeps its buffer too.
      bool outlives = isa<rt::AllReduceStartOp>(op) && !waitedInPart(op);
      if ((!inserted && it->second != part) || outlives)
        crosses.insert(root);
      if (outlives)
        started.insert(root);
    }
  });
  // Allocations and deaths in program order.
  std::map<int64_t, SmallVector<Value>> dying;
  SmallVector<Value> allocs, beforeParts;
  Operation *partsStart = nullptr;
  for (Operation &op : top)
    if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp, pipe::UpdateOp>(op)) {
      partsStart = &op;
      break;
    }
  // Whether only ops of the step's top before its first part touch
  // `buffer` (through views).
  auto usedBeforeParts = [&](Value buffer) {
    SmallVector<Value> values{buffer};
    while (!values.empty())
      for (Operation *user : values.pop_back_val().getUsers()) {
        if (user->getBlock() != &top || !partsStart ||
            !user->isBeforeInBlock(partsStart))
          return false;
        if (auto view = dyn_cast<rt::ViewOp>(user))
          values.push_back(view.getResult());
      }
    return true;
  };
  func.walk([&](rt::AllocOp alloc) {
    Value buffer = alloc.getResult();
    if (placeOf.count(buffer))
      return;
    // Outside every part: held for the whole step (a parameter received
    // from another rank), after the microbatches' arena slots; but what
    // the step uses before its first part only takes the parts' places,
    // which nothing holds yet (see below). (A step without parts, an
    // inference step, is all in the arena.)
    if (alloc->getParentOp() == func.getOperation() && hasParts &&
        usedBeforeParts(buffer)) {
      beforeParts.push_back(buffer);
      return;
    }
    if (alloc->getParentOp() == func.getOperation() && hasParts) {
      placeOf[buffer] = {rt::Space::Received, receivedBytes};
      receivedBytes += llvm::alignTo(bytesOf(buffer), kAlignment);
      return;
    }
    allocs.push_back(buffer);
    int64_t last = lastUse.count(buffer) ? lastUse[buffer] : position[alloc];
    dying[last].push_back(buffer);
  });
  // An arena per chunk when every buffer that crosses parts belongs to one
  // chunk (and no collective on it outlives its part); else one arena for
  // all.
  bool byChunk = split && chunks > 1 && !schedule.empty() &&
                 llvm::all_of(allocs, [&](Value buffer) {
                   return !crosses.contains(buffer) ||
                          (chunkOf.lookup(buffer) >= 0 &&
                           !started.contains(buffer));
                 });
  // Places every buffer; returns each arena's size.
  auto place = [&](bool byChunk) {
    SmallVector<ArenaAllocator> arenas(byChunk ? chunks : 1);
    ArenaAllocator transient;
    auto allocatorOf = [&](Value buffer) -> ArenaAllocator & {
      if (split && !crosses.contains(buffer))
        return transient;
      return arenas[byChunk ? chunkOf.lookup(buffer) : 0];
    };
    auto nextDeath = dying.begin();
    for (Value buffer : allocs) {
      int64_t here = position[buffer.getDefiningOp()];
      // Free what died before this allocation.
      for (; nextDeath != dying.end() && nextDeath->first < here; ++nextDeath)
        for (Value dead : nextDeath->second)
          allocatorOf(dead).release(placeOf[dead].offset, bytesOf(dead));
      ArenaAllocator &into = allocatorOf(buffer);
      placeOf[buffer] = {&into == &transient ? rt::Space::Transient
                                             : rt::Space::Arena,
                         into.allocate(bytesOf(buffer))};
    }
    // Each region again, greedy by size: the largest buffer first, each
    // at the lowest offset clear of the buffers already placed whose
    // lifetimes overlap its own; kept where it needs less than first fit.
    SmallVector<int64_t> sizes;
    for (ArenaAllocator &arena : arenas)
      sizes.push_back(arena.size());
    int64_t transientSize = transient.size();
    auto regionOf = [&](Value buffer) -> int64_t {
      if (split && !crosses.contains(buffer))
        return -1;
      return byChunk ? chunkOf.lookup(buffer) : 0;
    };
    for (int64_t region = -1; region < (int64_t)arenas.size(); ++region) {
      int64_t &size = region < 0 ? transientSize : sizes[region];
      if (size == 0)
        continue;
      struct Lifetime {
        Value buffer;
        int64_t start, end, bytes, offset;
      };
      SmallVector<Lifetime> lifetimes;
      for (Value buffer : allocs)
        if (regionOf(buffer) == region) {
          int64_t start = position[buffer.getDefiningOp()];
          int64_t end = lastUse.count(buffer) ? lastUse[buffer] : start;
          lifetimes.push_back({buffer, start, std::max(start, end),
                               llvm::alignTo(bytesOf(buffer), kAlignment), 0});
        }
      llvm::stable_sort(lifetimes, [](const Lifetime &a, const Lifetime &b) {
        return a.bytes > b.bytes;
      });
      SmallVector<Lifetime *> placed;
      SmallVector<std::pair<int64_t, int64_t>> taken;
      int64_t greedy = 0;
      for (Lifetime &l : lifetimes) {
        taken.clear();
        for (Lifetime *p : placed)
          if (p->start <= l.end && l.start <= p->end)
            taken.push_back({p->offset, p->offset + p->bytes});
        llvm::sort(taken);
        int64_t offset = 0;
        for (auto [begin, end] : taken) {
          if (begin >= offset + l.bytes)
            break;
          offset = std::max(offset, end);
        }
        l.offset = offset;
        greedy = std::max(greedy, offset + l.bytes);
        placed.push_back(&l);
      }
      if (greedy >= size)
        continue;
      size = greedy;
      for (const Lifetime &l : lifetimes)
        placeOf[l.buffer].offset = l.offset;
    }
    transientBytes = transientSize;
    arenaBytes = 0;
    for (int64_t size : sizes)
      arenaBytes += size;
    return sizes;
  };
  // Each chunk's places over the schedule, unless slots of the whole stage
  // would hold less: then one arena for all.
  if (byChunk && !placeChunkSlots(place(true))) {
    chunkOffsets.clear();
    place(false);
  } else if (!byChunk) {
    place(false);
  }
  // Buffers of the step's top used before its first part (a weight's
  // slices cut from its bf16 copy on their way into its slot): no part
  // has run yet and the last step's are done, so they take the places of
  // a part's buffers (the transient space, or with one slot the arena),
  // each freed after its last use.
  if (beforeParts.empty())
    return;
  ArenaAllocator before;
  rt::Space space = split ? rt::Space::Transient : rt::Space::Arena;
  SmallVector<Value> live;
  for (Value buffer : beforeParts) {
    int64_t here = position[buffer.getDefiningOp()];
    llvm::erase_if(live, [&](Value dead) {
      if (lastUse.lookup(dead) >= here)
        return false;
      before.release(placeOf[dead].offset, bytesOf(dead));
      return true;
    });
    placeOf[buffer] = {space, before.allocate(bytesOf(buffer))};
    live.push_back(buffer);
  }
  if (split)
    transientBytes = std::max(transientBytes, before.size());
  else
    arenaBytes = std::max(arenaBytes, before.size());
}

// Each (chunk, microbatch) of the rank's schedule takes a place for what
// crosses the chunk's parts at its forward and gives it back after its
// backward, first fit: as many chunks' worth as are in flight at once
// (Narayanan et al.'s 2(p - r - 1) + (v - 1)p + 1 at rank r), where slots of
// the whole stage would hold every chunk of every microbatch with any chunk
// in flight. Kept only if smaller than those slots. Returns whether it is.
bool Planner::placeChunkSlots(ArrayRef<int64_t> chunkBytes) {
  int64_t chunks = chunkBytes.size();
  std::map<std::pair<int64_t, int64_t>, int64_t> backwardsLeft, offset;
  for (const ChunkStep &step : schedule)
    if (step.chunk < chunks)
      backwardsLeft[{step.chunk, step.microbatch}] += !step.forward;
  ArenaAllocator places;
  int64_t live = 0;
  for (const ChunkStep &step : schedule) {
    if (step.chunk >= chunks || step.microbatch >= microbatches)
      return false;
    std::pair<int64_t, int64_t> key{step.chunk, step.microbatch};
    int64_t bytes = chunkBytes[step.chunk];
    if (step.forward) {
      if (offset.count(key))
        continue;
      offset[key] = bytes ? places.allocate(bytes) : 0;
      chunksInFlight = std::max(chunksInFlight, ++live);
    } else if (auto it = backwardsLeft.find(key);
               it != backwardsLeft.end() && offset.count(key) &&
               --it->second == 0) {
      if (bytes)
        places.release(offset[key], bytes);
      --live;
    }
  }
  if (places.size() >= slots * arenaBytes)
    return false;
  chunkOffsets.assign(chunks * microbatches, 0);
  for (auto [key, at] : offset)
    chunkOffsets[key.first * microbatches + key.second] = at;
  chunkArenaTotal = places.size();
  return true;
}

// Every use of a planned buffer, a parameter or a value handed on becomes a
// view of its place next to the use, so that each part refers only to its
// own ops.
void Planner::materialize() {
  SmallVector<Operation *> users;
  func.walk([&](Operation *op) {
    if (!isa<rt::ParamOp>(op))
      users.push_back(op);
  });
  for (Operation *op : users) {
    if (isa<pipe::UpdateOp>(op))
      continue; // its inputs name the parts' results it accumulates
    for (OpOperand &use : op->getOpOperands()) {
      Value v = use.get();
      if (!isa<MemRefType>(v.getType()))
        continue;
      if (isa_and_nonnull<rt::ViewOp, rt::GroupBlockOp>(v.getDefiningOp()))
        continue; // a view of a value of its own part
      Value root = rootOf(v);
      auto it = placeOf.find(root);
      if (it == placeOf.end())
        continue;
      Operation *def = v.getDefiningOp();
      bool local = def && def->getParentRegion() == op->getParentRegion() &&
                   !isa<rt::ParamOp, rt::KvCacheOp>(def) && root == v;
      if (local)
        continue;
      OpBuilder b(op);
      use.set(view(b, op->getLoc(), v.getType(), it->second));
    }
  }
  // The allocations themselves become views of their places.
  SmallVector<rt::AllocOp> allocs;
  func.walk([&](rt::AllocOp alloc) { allocs.push_back(alloc); });
  for (rt::AllocOp alloc : allocs) {
    OpBuilder b(alloc);
    Value placed = view(b, alloc.getLoc(), alloc.getType(),
                        placeOf.lookup(alloc.getResult()));
    alloc.getResult().replaceAllUsesWith(placed);
    alloc.erase();
  }
}

// A parameter's state lives at the parameter's offset.
void Planner::placeStates() {
  SmallVector<rt::StateOfOp> states;
  func.walk([&](rt::StateOfOp state) { states.push_back(state); });
  for (rt::StateOfOp state : states) {
    OpBuilder b(state);
    Value placed =
        view(b, state.getLoc(), state.getType(),
             {state.getSpace(), paramOffset.lookup(rootOf(state.getParam())) +
                                    state.getOffset().value_or(0)});
    state.getResult().replaceAllUsesWith(placed);
    state.erase();
  }
}

// Started collectives keep their requests in the program's request table,
// one slot per started buffer: those waited for in their own part, and
// those started in one part and waited for in another.
void Planner::placeRequests() {
  DenseMap<Value, std::pair<int64_t, int64_t>> slots; // request -> first, count
  auto slotType = IntegerType::get(ctx, 64);
  func.walk([&](Operation *op) {
    int64_t count = 1;
    if (auto start = dyn_cast<rt::AllReduceStartOp>(op))
      count = start.getBuffers().size();
    else if (!isa<rt::AllGatherStartOp, rt::ReduceScatterStartOp,
                  rt::ShiftStartOp>(op))
      return;
    op->setAttr("slot", IntegerAttr::get(slotType, requests));
    slots[op->getResult(0)] = {requests, count};
    requests += count;
  });
  SmallVector<rt::WaitOp> waits;
  func.walk([&](rt::WaitOp wait) { waits.push_back(wait); });
  // Where a request comes from: through the yields of the parts and the
  // update's inputs to the start op (coalescing has replaced some, so the
  // aliases recorded before it do not serve).
  auto sourceOf = [](Value v) {
    while (true) {
      if (auto arg = dyn_cast<BlockArgument>(v)) {
        auto update = dyn_cast<pipe::UpdateOp>(arg.getOwner()->getParentOp());
        if (!update)
          return v;
        v = update.getInputs()[arg.getArgNumber()];
        continue;
      }
      Operation *def = v.getDefiningOp();
      if (!isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(def))
        return v;
      auto yield =
          cast<pipe::YieldOp>(def->getRegion(0).front().getTerminator());
      v = yield.getValues()[cast<OpResult>(v).getResultNumber()];
    }
  };
  for (rt::WaitOp wait : waits) {
    auto [first, count] = slots.lookup(sourceOf(wait.getRequest()));
    OpBuilder b(wait);
    rt::WaitRequestsOp::create(b, wait.getLoc(), first, count);
    wait.erase();
  }
}

// A collective over buffers that lie side by side in one store (a bucket of
// gradients) is one call over the run.
void Planner::coalesceCollectives() {
  auto coalesce = [&](Operation *op, OperandRange buffers,
                      function_ref<Operation *(OpBuilder &, ValueRange)> make) {
    struct Piece {
      rt::BufferOp view;
      int64_t size; // in the offset's unit
    };
    SmallVector<Piece> pieces;
    for (Value b : buffers) {
      auto view = b.getDefiningOp<rt::BufferOp>();
      if (!view)
        return;
      auto type = cast<MemRefType>(b.getType());
      int64_t size = view.getSpace() == rt::Space::Arena
                         ? bytesOf(b)
                         : type.getNumElements();
      pieces.push_back({view, size});
    }
    llvm::stable_sort(pieces, [](Piece a, Piece b) {
      return std::make_pair(a.view.getSpace(), a.view.getOffset()) <
             std::make_pair(b.view.getSpace(), b.view.getOffset());
    });
    SmallVector<Value> runs;
    OpBuilder b(op);
    for (size_t k = 0; k < pieces.size();) {
      size_t end = k + 1;
      Type element =
          rt::elementTypeOf(pieces[k].view);
      int64_t elements =
          cast<MemRefType>(pieces[k].view.getType()).getNumElements();
      while (end < pieces.size() &&
             pieces[end].view.getSpace() == pieces[k].view.getSpace() &&
             rt::elementTypeOf(pieces[end].view) ==
                 element &&
             pieces[end].view.getOffset() ==
                 pieces[end - 1].view.getOffset() + pieces[end - 1].size) {
        elements +=
            cast<MemRefType>(pieces[end].view.getType()).getNumElements();
        ++end;
      }
      if (end == k + 1)
        runs.push_back(pieces[k].view);
      else
        runs.push_back(view(b, op->getLoc(), MemRefType::get({elements}, element),
                            {pieces[k].view.getSpace(),
                             (int64_t)pieces[k].view.getOffset()}));
      k = end;
    }
    if (runs.size() == buffers.size())
      return;
    Operation *merged = make(b, runs);
    op->replaceAllUsesWith(merged);
    op->erase();
  };
  SmallVector<Operation *> collectives;
  func.walk([&](Operation *op) {
    if (isa<rt::AllReduceOp, rt::AllReduceStartOp>(op))
      collectives.push_back(op);
  });
  for (Operation *op : collectives) {
    // The members of a group across pipeline stages run different programs,
    // whose buffers lie differently: each must make the same calls, so
    // their buffers stay one call each, in the order the program gives.
    auto axes = op->getAttrOfType<dist::AxesAttr>("axes");
    if (axes && axes.getValue().intersects(AxisSet(MeshAxis::PP)))
      continue;
    if (auto ar = dyn_cast<rt::AllReduceOp>(op))
      coalesce(op, ar.getBuffers(), [&](OpBuilder &b, ValueRange runs) {
        return rt::AllReduceOp::create(b, op->getLoc(), runs, ar.getAxesAttr())
            .getOperation();
      });
    else if (auto start = dyn_cast<rt::AllReduceStartOp>(op))
      coalesce(op, start.getBuffers(), [&](OpBuilder &b, ValueRange runs) {
        return rt::AllReduceStartOp::create(b, op->getLoc(),
                                            start.getRequest().getType(), runs,
                                            start.getAxesAttr(), IntegerAttr())
            .getOperation();
      });
  }
}

LogicalResult Planner::run() {
  func.walk([&](Operation *op) {
    hasParts |= isa<pipe::ForwardPassOp, pipe::BackwardPassOp,
                    pipe::UpdateOp>(op);
  });
  // Values handed on share their producer's storage: a part's results are
  // what it yields, and without accumulation the update's block arguments
  // are its inputs.
  func.walk([&](Operation *op) {
    if (auto view = dyn_cast<rt::ViewOp>(op))
      aliasOf[view.getResult()] = view.getSource();
    if (auto block = dyn_cast<rt::GroupBlockOp>(op))
      aliasOf[block.getResult()] = block.getSource();
    if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(op)) {
      auto yield = cast<pipe::YieldOp>(op->getRegion(0).front().getTerminator());
      for (auto [result, value] :
           llvm::zip(op->getResults(), yield.getValues()))
        aliasOf[result] = value;
    }
    if (auto update = dyn_cast<pipe::UpdateOp>(op); update && !accumulates)
      for (auto [arg, input] : llvm::zip(update.getBody().getArguments(),
                                          update.getInputs()))
        aliasOf[arg] = input;
  });
  if (fuseAccumulation)
    sumTermsInPlace();
  placeParams();
  placeGradients();
  func.walk([&](pipe::UpdateOp update) {
    if (accumulates)
      placeAccumulators(update);
  });
  if (hadError)
    return failure();
  func.walk([&](pipe::UpdateOp update) {
    if (accumulates)
      accumulateEarly(update);
  });
  // Positions for liveness, with the accumulations in place.
  numberOps();
  placeArena();
  func.walk([&](rt::BufferOp view) {
    if (view.getSpace() == rt::Space::NormSums)
      normSums = std::max<int64_t>(
          normSums, view.getOffset() +
                        cast<MemRefType>(view.getType()).getNumElements());
  });
  placeStates();
  materialize();
  // The caches are places now; nothing refers to their declarations.
  for (auto cache : llvm::make_early_inc_range(
           func.getBody().getOps<rt::KvCacheOp>()))
    cache.erase();
  coalesceCollectives();
  placeRequests();
  OpBuilder b(ctx);
  func->setAttr("rt.param_elems", b.getI64IntegerAttr(paramElems));
  func->setAttr("rt.arena_bytes", b.getI64IntegerAttr(arenaBytes));
  if (!chunkOffsets.empty()) {
    func->setAttr("rt.chunk_arena_offsets",
                  b.getDenseI64ArrayAttr(chunkOffsets));
    func->setAttr("rt.chunk_arena_total", b.getI64IntegerAttr(chunkArenaTotal));
    func->setAttr("rt.chunks_in_flight", b.getI64IntegerAttr(chunksInFlight));
  }
  func->setAttr("rt.accumulator_elems", b.getI64IntegerAttr(accumulatorElems));
  func->setAttr("rt.norm_sums", b.getI64IntegerAttr(normSums));
  func->setAttr("rt.received_bytes", b.getI64IntegerAttr(receivedBytes));
  if (split)
    func->setAttr("rt.transient_bytes", b.getI64IntegerAttr(transientBytes));
  func->setAttr("rt.request_slots", b.getI64IntegerAttr(requests));
  if (kvCacheElems)
    func->setAttr("rt.kv_cache_elems", b.getI64IntegerAttr(kvCacheElems));
  return success();
}

struct PlanMemoryPass : tessel::impl::PlanMemoryBase<PlanMemoryPass> {
  using PlanMemoryBase::PlanMemoryBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    int64_t microbatches = pipe::layoutOf(module).getMicrobatches();
    // The microbatches each rank holds at once, from its schedule (one slot
    // when the module has none).
    DenseMap<int64_t, int64_t> slots;
    // And each rank's compute steps, by chunk.
    DenseMap<int64_t, SmallVector<ChunkStep>> steps;
    for (auto schedule : module.getOps<pipe::ScheduleOp>()) {
      MeshLayout layout = pipe::pipelineLayout(schedule.getRanks(),
                                               schedule.getVirtualStages());
      for (auto rank : schedule.getBody().getOps<pipe::RankOp>()) {
        slots[rank.getRank()] =
            pipe::activationSlots(rank, schedule.getMicrobatches());
        SmallVector<ChunkStep> &order = steps[rank.getRank()];
        rank.walk([&](Operation *op) {
          if (auto f = dyn_cast<pipe::ForwardOp>(op))
            order.push_back({true, layout.stageChunk(f.getStage()),
                             (int64_t)f.getMicrobatch()});
          else if (auto b = dyn_cast<pipe::BackwardOp>(op))
            order.push_back({false, layout.stageChunk(b.getStage()),
                             (int64_t)b.getMicrobatch()});
        });
      }
    }
    bool any = false;
    for (auto func : module.getOps<func::FuncOp>()) {
      auto rank = func->getAttrOfType<IntegerAttr>("pipe.rank");
      if (!rank)
        continue;
      any = true;
      if (failed(Planner(func, microbatches, slots.lookup(rank.getInt()),
                         steps.lookup(rank.getInt()), fuseAccumulation)
                     .run()))
        return signalPassFailure();
    }
    if (!any) {
      module.emitError("tessel-plan-memory: no rank program (a function "
                       "with pipe.rank; run convert-graph-to-rt first)");
      signalPassFailure();
    }
  }
};

} // namespace

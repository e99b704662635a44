//===- GraphOps.cpp - Verifiers and shape inference of the graph dialect -===//
//
// Every shape rule of the graph dialect lives here, once: the verifier of an
// op whose result type is given, or `inferReturnTypes` of an op whose result
// type follows from its operands (which the verifier then checks too).
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/IR/TypeUtilities.h"
#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace tessel::graph;

#include "dialects/Graph/GraphDialect.cpp.inc"
#include "dialects/Graph/GraphEnums.cpp.inc"
#include "dialects/Graph/GraphInterfaces.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Graph/GraphAttrs.cpp.inc"

void GraphDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/Graph/GraphAttrs.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Graph/GraphOps.cpp.inc"
      >();
}

LogicalResult GraphDialect::verifyOperationAttribute(Operation *op,
                                                     NamedAttribute attr) {
  if (attr.getName() == kLayerAttrName && !isa<LayerAttr>(attr.getValue()))
    return op->emitOpError("graph.layer must be a #graph.layer<...>");
  if (attr.getName() == kPhaseAttrName && !isa<PhaseAttr>(attr.getValue()))
    return op->emitOpError("graph.phase must be a #graph.phase<...>");
  if (attr.getName() == kRecomputeAttrName && !isa<UnitAttr>(attr.getValue()))
    return op->emitOpError("graph.recompute must be a unit attribute");
  return success();
}

Attribute LayerAttr::parse(AsmParser &parser, Type) {
  StringRef keyword;
  SMLoc loc = parser.getCurrentLocation();
  if (parser.parseLess() || parser.parseKeyword(&keyword))
    return {};
  std::optional<LayerKind> kind = symbolizeLayerKind(keyword);
  if (!kind) {
    parser.emitError(loc, "expected embedding, block N or head");
    return {};
  }
  int64_t index = 0;
  SMLoc indexLoc = parser.getCurrentLocation();
  if (*kind == LayerKind::Block && parser.parseInteger(index))
    return {};
  // As many blocks as a spec may have (model.layers <= 4096).
  if (index < 0 || index >= 4096) {
    parser.emitError(indexLoc, "block index must be in [0, 4096), got ")
        << index;
    return {};
  }
  if (parser.parseGreater())
    return {};
  return LayerAttr::get(parser.getContext(), *kind, index);
}

void LayerAttr::print(AsmPrinter &printer) const {
  printer << "<" << stringifyLayerKind(getKind());
  if (getKind() == LayerKind::Block)
    printer << " " << getIndex();
  printer << ">";
}

LayerAttr tessel::graph::layerOf(Operation *op) {
  return op->getAttrOfType<LayerAttr>(GraphDialect::kLayerAttrName);
}
std::optional<Phase> tessel::graph::phaseOf(Operation *op) {
  if (auto phase = op->getAttrOfType<PhaseAttr>(GraphDialect::kPhaseAttrName))
    return phase.getValue();
  return std::nullopt;
}
void tessel::graph::setLayer(Operation *op, LayerAttr layer) {
  op->setAttr(GraphDialect::kLayerAttrName, layer);
}
void tessel::graph::setPhase(Operation *op, Phase phase) {
  op->setAttr(GraphDialect::kPhaseAttrName,
              PhaseAttr::get(op->getContext(), phase));
}
void tessel::graph::copyPlacement(Operation *from, Operation *op) {
  if (LayerAttr layer = layerOf(from))
    setLayer(op, layer);
  if (std::optional<Phase> phase = phaseOf(from))
    setPhase(op, *phase);
}

#define GET_OP_CLASSES
#include "dialects/Graph/GraphOps.cpp.inc"

namespace {
RankedTensorType tensorOf(ArrayRef<int64_t> shape, Type element) {
  return RankedTensorType::get(shape, element);
}
ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}
std::string shapeStr(ArrayRef<int64_t> shape) {
  std::string s = "[";
  for (auto [i, d] : llvm::enumerate(shape))
    s += (i ? "x" : "") + std::to_string(d);
  return s + "]";
}
// `suffix` equals the trailing dimensions of `shape`.
bool isSuffix(ArrayRef<int64_t> suffix, ArrayRef<int64_t> shape) {
  return suffix.size() <= shape.size() &&
         shape.take_back(suffix.size()) == suffix;
}
LogicalResult fail(std::optional<Location> loc, const Twine &msg) {
  return emitOptionalError(loc, msg);
}
} // namespace

//===----------------------------------------------------------------------===//
// Leaves
//===----------------------------------------------------------------------===//

LogicalResult ParamOp::verify() {
  if (getName().empty())
    return emitOpError("parameter needs a non-empty name");
  if (!getType().hasStaticShape())
    return emitOpError("parameter '") << getName() << "' needs a static shape";
  StringRef init = getInit();
  if (init != "normal" && init != "zeros" && init != "ones")
    return emitOpError("init must be 'normal', 'zeros' or 'ones', got '")
           << init << "'";
  if (getStd().convertToDouble() < 0)
    return emitOpError("std must be non-negative");
  return success();
}

LogicalResult InputOp::verify() {
  if (getName() != "tokens" && getName() != "targets" &&
      getName() != "positions")
    return emitOpError("input must be 'tokens', 'targets' or 'positions', "
                       "got '")
           << getName() << "'";
  if (getType().getRank() != 2 || !getType().hasStaticShape())
    return emitOpError("input must be a static [batch, seq] tensor");
  return success();
}

//===----------------------------------------------------------------------===//
// Forward math
//===----------------------------------------------------------------------===//

LogicalResult EmbeddingOp::inferReturnTypes(MLIRContext *,
                                            std::optional<Location> loc,
                                            Adaptor adaptor,
                                            SmallVectorImpl<Type> &types) {
  auto table = shapeOf(adaptor.getTable());
  if (table.size() != 2)
    return fail(loc, "embedding table must be [vocab, hidden], got " +
                         shapeStr(table));
  SmallVector<int64_t> shape(shapeOf(adaptor.getIds()));
  shape.push_back(table[1]);
  types.push_back(tensorOf(shape, getElementTypeOrSelf(adaptor.getTable())));
  return success();
}

LogicalResult MatmulOp::inferReturnTypes(MLIRContext *,
                                         std::optional<Location> loc,
                                         Adaptor adaptor,
                                         SmallVectorImpl<Type> &types) {
  auto lhs = shapeOf(adaptor.getLhs());
  auto rhs = shapeOf(adaptor.getRhs());
  if (lhs.size() < 2 || rhs.size() < 2)
    return fail(loc, "matmul operands must have rank >= 2");
  if (rhs.size() != 2 && rhs.size() != lhs.size())
    return fail(loc, "matmul rhs must be rank 2 or have lhs's rank, got " +
                         shapeStr(lhs) + " and " + shapeStr(rhs));
  auto batch = lhs.drop_back(2);
  if (rhs.size() == lhs.size() && rhs.drop_back(2) != batch)
    return fail(loc, "matmul batch dimensions differ: " + shapeStr(lhs) +
                         " and " + shapeStr(rhs));
  bool tl = adaptor.getTransposeLhs(), tr = adaptor.getTransposeRhs();
  bool sumBatch = adaptor.getSumBatch();
  if (sumBatch && (!tl || tr || rhs.size() != lhs.size() || lhs.size() < 3))
    return fail(loc, "matmul with sum_batch needs transpose_lhs, no "
                     "transpose_rhs and batched operands of equal rank, got " +
                         shapeStr(lhs) + " and " + shapeStr(rhs));
  int64_t m = lhs[lhs.size() - (tl ? 1 : 2)];
  int64_t kl = lhs[lhs.size() - (tl ? 2 : 1)];
  int64_t kr = rhs[rhs.size() - (tr ? 1 : 2)];
  int64_t n = rhs[rhs.size() - (tr ? 2 : 1)];
  if (kl != kr)
    return fail(loc, "matmul contraction sizes differ: " + Twine(kl) + " vs " +
                         Twine(kr) + " (" + shapeStr(lhs) + " and " +
                         shapeStr(rhs) + ")");
  SmallVector<int64_t> shape(sumBatch ? ArrayRef<int64_t>() : batch);
  shape.append({m, n});
  types.push_back(tensorOf(shape, getElementTypeOrSelf(adaptor.getLhs())));
  return success();
}

static LogicalResult inferBroadcast(std::optional<Location> loc, Value lhs,
                                    Value rhs, SmallVectorImpl<Type> &types) {
  if (!isSuffix(shapeOf(rhs), shapeOf(lhs)))
    return fail(loc, "rhs shape " + shapeStr(shapeOf(rhs)) +
                         " must equal or be a suffix of lhs shape " +
                         shapeStr(shapeOf(lhs)));
  types.push_back(lhs.getType());
  return success();
}
LogicalResult AddOp::inferReturnTypes(MLIRContext *,
                                      std::optional<Location> loc,
                                      Adaptor adaptor,
                                      SmallVectorImpl<Type> &types) {
  return inferBroadcast(loc, adaptor.getLhs(), adaptor.getRhs(), types);
}
LogicalResult MulOp::inferReturnTypes(MLIRContext *,
                                      std::optional<Location> loc,
                                      Adaptor adaptor,
                                      SmallVectorImpl<Type> &types) {
  return inferBroadcast(loc, adaptor.getLhs(), adaptor.getRhs(), types);
}

LogicalResult GeluOp::inferReturnTypes(MLIRContext *, std::optional<Location>,
                                       Adaptor adaptor,
                                       SmallVectorImpl<Type> &types) {
  types.push_back(adaptor.getInput().getType());
  return success();
}
LogicalResult SiluOp::inferReturnTypes(MLIRContext *, std::optional<Location>,
                                       Adaptor adaptor,
                                       SmallVectorImpl<Type> &types) {
  types.push_back(adaptor.getInput().getType());
  return success();
}
LogicalResult DropoutOp::inferReturnTypes(MLIRContext *,
                                          std::optional<Location> loc,
                                          Adaptor adaptor,
                                          SmallVectorImpl<Type> &types) {
  auto x = shapeOf(adaptor.getInput());
  FloatAttr p = adaptor.getPAttr();
  if (p && !(p.getValueAsDouble() >= 0 && p.getValueAsDouble() < 1))
    return fail(loc, "dropout p must be in [0, 1), got " +
                         std::to_string(p.getValueAsDouble()));
  if (x.empty() || x.size() > 6)
    return fail(loc, "dropout takes a tensor of rank 1 to 6, got " +
                         shapeStr(x));
  if (auto axes = adaptor.getSplitAxesAttr(); axes && axes.size() != (int64_t)x.size())
    return fail(loc, "dropout split_axes needs one entry per dimension");
  types.push_back(adaptor.getInput().getType());
  return success();
}
LogicalResult SoftmaxOp::inferReturnTypes(MLIRContext *,
                                          std::optional<Location> loc,
                                          Adaptor adaptor,
                                          SmallVectorImpl<Type> &types) {
  auto x = shapeOf(adaptor.getInput());
  // (The attribute is absent, not yet defaulted, when a builder infers.)
  BoolAttr causal = adaptor.getCausalAttr();
  if (causal && causal.getValue() &&
      (x.size() < 2 || x.back() == 0 || x[x.size() - 2] % x.back() != 0))
    return fail(loc, "a causal softmax needs [..., rows, n] with rows a "
                     "multiple of n, got " + shapeStr(x));
  types.push_back(adaptor.getInput().getType());
  return success();
}

static LogicalResult checkNormWeight(std::optional<Location> loc, Value input,
                                     Value weight, StringRef what) {
  auto x = shapeOf(input);
  if (x.empty())
    return fail(loc, "norm input must have rank >= 1");
  if (shapeOf(weight) != x.take_back(1))
    return fail(loc, Twine(what) + " must be [" + Twine(x.back()) + "], got " +
                         shapeStr(shapeOf(weight)));
  return success();
}
LogicalResult LayerNormOp::inferReturnTypes(MLIRContext *,
                                            std::optional<Location> loc,
                                            Adaptor adaptor,
                                            SmallVectorImpl<Type> &types) {
  if (failed(checkNormWeight(loc, adaptor.getInput(), adaptor.getWeight(),
                             "weight")) ||
      failed(
          checkNormWeight(loc, adaptor.getInput(), adaptor.getBias(), "bias")))
    return failure();
  types.push_back(adaptor.getInput().getType());
  return success();
}
LogicalResult RmsNormOp::inferReturnTypes(MLIRContext *,
                                          std::optional<Location> loc,
                                          Adaptor adaptor,
                                          SmallVectorImpl<Type> &types) {
  if (failed(checkNormWeight(loc, adaptor.getInput(), adaptor.getWeight(),
                             "weight")))
    return failure();
  types.push_back(adaptor.getInput().getType());
  return success();
}

LogicalResult ZigzagOp::inferReturnTypes(MLIRContext *,
                                         std::optional<Location> loc,
                                         Adaptor adaptor,
                                         SmallVectorImpl<Type> &types) {
  auto x = shapeOf(adaptor.getInput());
  int64_t dim = adaptor.getDim(), pieces = adaptor.getPieces();
  if (dim < 0 || dim >= (int64_t)x.size())
    return fail(loc, "zigzag dim " + std::to_string(dim) +
                         " is not a dimension of " + shapeStr(x));
  if (pieces < 1 || x[dim] % (2 * pieces) != 0)
    return fail(loc, "zigzag cuts dimension " + std::to_string(dim) +
                         " of " + shapeStr(x) + " into 2 x " +
                         std::to_string(pieces) + " chunks, which it does "
                         "not divide (pieces must be >= 1)");
  types.push_back(adaptor.getInput().getType());
  return success();
}

LogicalResult RopeOp::inferReturnTypes(MLIRContext *,
                                       std::optional<Location> loc,
                                       Adaptor adaptor,
                                       SmallVectorImpl<Type> &types) {
  auto x = shapeOf(adaptor.getInput());
  if (x.size() != 4 || x[3] % 2 != 0)
    return fail(loc, "rope input must be [batch, seq, heads, head_dim] with "
                     "an even head_dim, got " +
                         shapeStr(x));
  types.push_back(adaptor.getInput().getType());
  return success();
}

// The row log-sum-exp of attention over query q [B, T, H, D]: [B, H, T].
static RankedTensorType lseType(Value q) {
  auto type = cast<RankedTensorType>(q.getType());
  auto s = type.getShape();
  return RankedTensorType::get({s[0], s[2], s[1]}, type.getElementType());
}

static LogicalResult checkAttention(std::optional<Location> loc, Value q,
                                    Value k, Value v) {
  auto qs = shapeOf(q), ks = shapeOf(k), vs = shapeOf(v);
  if (qs.size() != 4 || ks.size() != 4)
    return fail(loc,
                "attention operands must be [batch, seq, heads, head_dim]");
  if (ks != vs)
    return fail(loc, "attention key and value shapes differ: " + shapeStr(ks) +
                         " vs " + shapeStr(vs));
  // A rank's piece of the queries attends over all keys (context
  // parallelism): the queries' sequence divides the keys'.
  if (qs[0] != ks[0] || qs[3] != ks[3] || qs[1] <= 0 || ks[1] % qs[1] != 0)
    return fail(loc, "attention query " + shapeStr(qs) + " and key " +
                         shapeStr(ks) +
                         " must agree on batch and head_dim, and the "
                         "query's seq must be the key's or a piece of it");
  if (ks[2] == 0 || qs[2] % ks[2] != 0)
    return fail(loc, "attention heads (" + Twine(qs[2]) +
                         ") must be a multiple of kv heads (" + Twine(ks[2]) +
                         ")");
  return success();
}
LogicalResult AttentionOp::inferReturnTypes(MLIRContext *,
                                            std::optional<Location> loc,
                                            Adaptor adaptor,
                                            SmallVectorImpl<Type> &types) {
  if (failed(checkAttention(loc, adaptor.getQuery(), adaptor.getKey(),
                            adaptor.getValue())))
    return failure();
  types.push_back(adaptor.getQuery().getType());
  types.push_back(lseType(adaptor.getQuery()));
  return success();
}

static LogicalResult checkCrossEntropy(std::optional<Location> loc,
                                       Value logits, Value targets) {
  auto l = shapeOf(logits), t = shapeOf(targets);
  if (l.size() < 2 || l.drop_back(1) != t)
    return fail(loc, "targets " + shapeStr(t) +
                         " must be the leading shape of logits " + shapeStr(l));
  return success();
}
LogicalResult CrossEntropyOp::inferReturnTypes(MLIRContext *ctx,
                                               std::optional<Location> loc,
                                               Adaptor adaptor,
                                               SmallVectorImpl<Type> &types) {
  if (failed(checkCrossEntropy(loc, adaptor.getLogits(), adaptor.getTargets())))
    return failure();
  // The loss has the logits' element type.
  types.push_back(tensorOf({}, getElementTypeOrSelf(adaptor.getLogits())));
  return success();
}

//===----------------------------------------------------------------------===//
// Layout
//===----------------------------------------------------------------------===//

LogicalResult ReshapeOp::verify() {
  auto in = getInput().getType(), out = getResult().getType();
  if (!in.hasStaticShape() || !out.hasStaticShape() ||
      in.getNumElements() != out.getNumElements())
    return emitOpError("cannot reshape ")
           << shapeStr(in.getShape()) << " to " << shapeStr(out.getShape());
  return success();
}

LogicalResult TransposeOp::inferReturnTypes(MLIRContext *,
                                            std::optional<Location> loc,
                                            Adaptor adaptor,
                                            SmallVectorImpl<Type> &types) {
  auto x = shapeOf(adaptor.getInput());
  ArrayRef<int64_t> perm = adaptor.getPermutation();
  SmallVector<bool> seen(x.size(), false);
  if (perm.size() != x.size())
    return fail(loc, "permutation has " + Twine(perm.size()) +
                         " entries for a rank-" + Twine(x.size()) + " input");
  SmallVector<int64_t> shape;
  for (int64_t p : perm) {
    if (p < 0 || p >= (int64_t)x.size() || seen[p])
      return fail(loc, "permutation is not a permutation of the dimensions");
    seen[p] = true;
    shape.push_back(x[p]);
  }
  types.push_back(tensorOf(shape, getElementTypeOrSelf(adaptor.getInput())));
  return success();
}

// All `shapes` equal `reference` except along `axis`; returns the axis sum.
static FailureOr<int64_t> sumAlongAxis(std::optional<Location> loc,
                                       ArrayRef<int64_t> reference,
                                       ArrayRef<ArrayRef<int64_t>> shapes,
                                       int64_t axis) {
  if (axis < 0 || axis >= (int64_t)reference.size())
    return fail(loc, "axis " + Twine(axis) + " out of range for rank " +
                         Twine(reference.size()));
  int64_t total = 0;
  for (ArrayRef<int64_t> s : shapes) {
    if (s.size() != reference.size())
      return fail(loc, "pieces must have the same rank");
    for (size_t d = 0; d < s.size(); ++d)
      if ((int64_t)d != axis && s[d] != reference[d])
        return fail(loc, "pieces differ outside axis " + Twine(axis) + ": " +
                             shapeStr(s) + " vs " + shapeStr(reference));
    total += s[axis];
  }
  return total;
}

LogicalResult SplitOp::verify() {
  auto in = shapeOf(getInput());
  SmallVector<ArrayRef<int64_t>> pieces;
  for (Value r : getResults())
    pieces.push_back(shapeOf(r));
  FailureOr<int64_t> total = sumAlongAxis(getLoc(), in, pieces, getAxis());
  if (failed(total))
    return failure();
  if (*total != in[getAxis()])
    return emitOpError("pieces add up to ")
           << *total << " along axis " << getAxis() << ", input has "
           << in[getAxis()];
  return success();
}

LogicalResult ConcatOp::inferReturnTypes(MLIRContext *,
                                         std::optional<Location> loc,
                                         Adaptor adaptor,
                                         SmallVectorImpl<Type> &types) {
  if (adaptor.getInputs().empty())
    return fail(loc, "concat needs at least one input");
  SmallVector<ArrayRef<int64_t>> pieces;
  for (Value v : adaptor.getInputs())
    pieces.push_back(shapeOf(v));
  FailureOr<int64_t> total =
      sumAlongAxis(loc, pieces.front(), pieces, adaptor.getAxis());
  if (failed(total))
    return failure();
  SmallVector<int64_t> shape(pieces.front());
  shape[adaptor.getAxis()] = *total;
  types.push_back(
      tensorOf(shape, getElementTypeOrSelf(adaptor.getInputs().front())));
  return success();
}

//===----------------------------------------------------------------------===//
// Gradient ops
//===----------------------------------------------------------------------===//

LogicalResult ReduceSumOp::verify() {
  if (!isSuffix(shapeOf(getResult()), shapeOf(getInput())))
    return emitOpError("result shape ")
           << shapeStr(shapeOf(getResult()))
           << " must be a suffix of the input shape "
           << shapeStr(shapeOf(getInput()));
  return success();
}

static LogicalResult sameShapeGrad(std::optional<Location> loc, Value x,
                                   Value grad, SmallVectorImpl<Type> &types) {
  if (x.getType() != grad.getType())
    return fail(loc, "gradient type must match the input type");
  types.push_back(x.getType());
  return success();
}
LogicalResult GeluGradOp::inferReturnTypes(MLIRContext *,
                                           std::optional<Location> loc,
                                           Adaptor a,
                                           SmallVectorImpl<Type> &types) {
  return sameShapeGrad(loc, a.getInput(), a.getGrad(), types);
}
LogicalResult SiluGradOp::inferReturnTypes(MLIRContext *,
                                           std::optional<Location> loc,
                                           Adaptor a,
                                           SmallVectorImpl<Type> &types) {
  return sameShapeGrad(loc, a.getInput(), a.getGrad(), types);
}
LogicalResult SoftmaxGradOp::inferReturnTypes(MLIRContext *,
                                              std::optional<Location> loc,
                                              Adaptor a,
                                              SmallVectorImpl<Type> &types) {
  return sameShapeGrad(loc, a.getOutput(), a.getGrad(), types);
}
LogicalResult LayerNormGradOp::inferReturnTypes(MLIRContext *,
                                                std::optional<Location> loc,
                                                Adaptor a,
                                                SmallVectorImpl<Type> &types) {
  if (failed(checkNormWeight(loc, a.getInput(), a.getWeight(), "weight")) ||
      failed(sameShapeGrad(loc, a.getInput(), a.getGrad(), types)))
    return failure();
  types.append({a.getWeight().getType(), a.getWeight().getType()});
  return success();
}
LogicalResult RmsNormGradOp::inferReturnTypes(MLIRContext *,
                                              std::optional<Location> loc,
                                              Adaptor a,
                                              SmallVectorImpl<Type> &types) {
  if (failed(checkNormWeight(loc, a.getInput(), a.getWeight(), "weight")) ||
      failed(sameShapeGrad(loc, a.getInput(), a.getGrad(), types)))
    return failure();
  types.push_back(a.getWeight().getType());
  return success();
}
LogicalResult AttentionGradOp::inferReturnTypes(MLIRContext *,
                                                std::optional<Location> loc,
                                                Adaptor a,
                                                SmallVectorImpl<Type> &types) {
  if (failed(checkAttention(loc, a.getQuery(), a.getKey(), a.getValue())) ||
      failed(sameShapeGrad(loc, a.getQuery(), a.getGrad(), types)))
    return failure();
  if (a.getResult().getType() != a.getQuery().getType())
    return fail(loc, "attention result type must match the query type");
  if (a.getLse().getType() != lseType(a.getQuery()))
    return fail(loc, "attention lse must be " +
                         shapeStr(lseType(a.getQuery()).getShape()) +
                         " of the query's element type, got " +
                         shapeStr(shapeOf(a.getLse())));
  types.append({a.getKey().getType(), a.getValue().getType()});
  return success();
}
LogicalResult
CrossEntropyGradOp::inferReturnTypes(MLIRContext *, std::optional<Location> loc,
                                     Adaptor a, SmallVectorImpl<Type> &types) {
  if (failed(checkCrossEntropy(loc, a.getLogits(), a.getTargets())))
    return failure();
  types.push_back(a.getLogits().getType());
  return success();
}

LogicalResult EmbeddingGradOp::verify() {
  auto ids = shapeOf(getIds()), grad = shapeOf(getGrad()),
       table = shapeOf(getResult());
  if (table.size() != 2 || grad.size() != ids.size() + 1 ||
      grad.drop_back(1) != ids || grad.back() != table[1])
    return emitOpError("gradient ")
           << shapeStr(grad) << " does not match ids " << shapeStr(ids)
           << " and table " << shapeStr(table);
  return success();
}

//===----------------------------------------------------------------------===//
// Optimizer
//===----------------------------------------------------------------------===//

LogicalResult AdamWOp::verify() {
  if (!getParam().getDefiningOp<ParamOp>())
    return emitOpError("updates a value that is not a graph.param");
  if (getParam().getType() != getGrad().getType())
    return emitOpError("gradient type must match the parameter type");
  if (getBeta1().convertToDouble() < 0 || getBeta1().convertToDouble() >= 1 ||
      getBeta2().convertToDouble() < 0 || getBeta2().convertToDouble() >= 1)
    return emitOpError("betas must be in [0, 1)");
  return success();
}

//===----------------------------------------------------------------------===//
// Inference
//===----------------------------------------------------------------------===//

LogicalResult KvCacheOp::verify() {
  auto type = cast<RankedTensorType>(getType());
  if (getName().empty())
    return emitOpError("needs a non-empty name");
  if (type.getRank() != 4 || !type.hasStaticShape())
    return emitOpError("must be a static [batch, max_len, kv_heads, "
                       "head_dim] tensor");
  return success();
}

LogicalResult CachedAttentionOp::verify() {
  auto q = shapeOf(getQuery()), k = shapeOf(getKey()), v = shapeOf(getValue()),
       kc = shapeOf(getKCache()), vc = shapeOf(getVCache()),
       pos = shapeOf(getPositions());
  if (q.size() != 4 || k != v || kc != vc || k.size() != 4 || kc.size() != 4)
    return emitOpError("needs [batch, seq, heads, head_dim] operands");
  if (k[0] != q[0] || k[1] != q[1] || k[3] != q[3] || q[2] % k[2] != 0)
    return emitOpError("key and value must be [batch, seq, kv_heads, "
                       "head_dim] with kv_heads dividing the query's heads");
  if (kc[0] != q[0] || kc[2] != k[2] || kc[3] != k[3] || kc[1] < q[1])
    return emitOpError("caches must be [batch, max_len, kv_heads, head_dim] "
                       "with max_len >= seq");
  if (pos.size() != 2 || pos[0] != q[0] || pos[1] != q[1])
    return emitOpError("positions must be [batch, seq]");
  if (getType() != getQuery().getType())
    return emitOpError("result must have the query's type");
  return success();
}

LogicalResult RopeAtOp::verify() {
  auto x = shapeOf(getInput()), pos = shapeOf(getPositions());
  if (x.size() != 4 || x[3] % 2 != 0)
    return emitOpError("input must be [batch, seq, heads, head_dim] with an "
                       "even head_dim");
  if (pos.size() != 2 || pos[0] != x[0] || pos[1] != x[1])
    return emitOpError("positions must be [batch, seq] of the input");
  if (getType() != getInput().getType())
    return emitOpError("result must have the input's type");
  return success();
}

LogicalResult OutputOp::verify() {
  if (getName() != "logits")
    return emitOpError("the one output is 'logits', got '") << getName() << "'";
  return success();
}

//===----------------------------------------------------------------------===//
// Mixture of experts
//===----------------------------------------------------------------------===//

namespace {
int64_t tokensOf(ArrayRef<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape.drop_back())
    n *= d;
  return n;
}
// `perToken` ([..., k]) has the token dimensions of `tokens` ([..., X]).
LogicalResult checkSameTokens(std::optional<Location> loc, Value tokens,
                              Value perToken, StringRef what) {
  auto t = shapeOf(tokens), p = shapeOf(perToken);
  if (t.empty() || p.size() != t.size() || t.drop_back() != p.drop_back())
    return fail(loc, Twine(what) + " " + shapeStr(p) +
                         " must have the token dimensions of " + shapeStr(t));
  return success();
}
// Rows [R, X] of an expert-major buffer for `rowOf` [..., k].
LogicalResult checkRows(std::optional<Location> loc, Value rows, Value rowOf) {
  auto r = shapeOf(rows), p = shapeOf(rowOf);
  if (r.size() != 2 || p.empty() || r[0] != tokensOf(p) * p.back())
    return fail(loc, "expert rows " + shapeStr(r) + " must be [" +
                         Twine(p.empty() ? 0 : tokensOf(p) * p.back()) +
                         ", X] for assignments " + shapeStr(p));
  return success();
}
LogicalResult checkScalar(std::optional<Location> loc, Value v,
                          StringRef what) {
  if (!shapeOf(v).empty())
    return fail(loc, Twine(what) + " must be a scalar");
  return success();
}
} // namespace

LogicalResult MoeTopKOp::inferReturnTypes(MLIRContext *ctx,
                                          std::optional<Location> loc,
                                          Adaptor adaptor,
                                          SmallVectorImpl<Type> &types) {
  auto p = shapeOf(adaptor.getProbs());
  int64_t k = adaptor.getTopK();
  if (p.size() < 2 || k < 1 || k > p.back())
    return fail(loc, "moe_top_k needs probabilities [..., E] with 1 <= top_k "
                     "<= E, got " +
                         shapeStr(p) + " and top_k " + Twine(k));
  SmallVector<int64_t> shape(p.drop_back());
  shape.push_back(k);
  types.push_back(tensorOf(shape, getElementTypeOrSelf(adaptor.getProbs())));
  types.push_back(tensorOf(shape, IntegerType::get(ctx, 32)));
  return success();
}

LogicalResult MoeTopKGradOp::inferReturnTypes(MLIRContext *,
                                              std::optional<Location> loc,
                                              Adaptor adaptor,
                                              SmallVectorImpl<Type> &types) {
  if (failed(checkSameTokens(loc, adaptor.getProbs(), adaptor.getExperts(),
                             "experts")) ||
      shapeOf(adaptor.getExperts()) != shapeOf(adaptor.getGrad()))
    return fail(loc, "moe_top_k_grad: experts and grad must be [..., k] of "
                     "the probabilities' tokens");
  types.push_back(adaptor.getProbs().getType());
  return success();
}

LogicalResult MoeLoadStatsOp::inferReturnTypes(MLIRContext *,
                                               std::optional<Location> loc,
                                               Adaptor adaptor,
                                               SmallVectorImpl<Type> &types) {
  if (failed(checkSameTokens(loc, adaptor.getProbs(), adaptor.getExperts(),
                             "experts")))
    return failure();
  auto type = tensorOf({shapeOf(adaptor.getProbs()).back()},
                       getElementTypeOrSelf(adaptor.getProbs()));
  types.append({type, type});
  return success();
}

LogicalResult MoeProbSumsGradOp::inferReturnTypes(MLIRContext *,
                                                  std::optional<Location> loc,
                                                  Adaptor adaptor,
                                                  SmallVectorImpl<Type> &types) {
  auto p = shapeOf(adaptor.getProbs());
  if (p.empty() || shapeOf(adaptor.getGrad()) != p.take_back())
    return fail(loc, "moe_prob_sums_grad: grad must be [E] of probabilities " +
                         shapeStr(p));
  types.push_back(adaptor.getProbs().getType());
  return success();
}

LogicalResult MoeAuxLossOp::inferReturnTypes(MLIRContext *,
                                             std::optional<Location> loc,
                                             Adaptor adaptor,
                                             SmallVectorImpl<Type> &types) {
  auto c = shapeOf(adaptor.getCounts());
  if (c.size() != 1 || shapeOf(adaptor.getProbSums()) != c)
    return fail(loc, "moe_aux_loss: counts and prob_sums must both be [E]");
  if (adaptor.getTokens() < 1 || adaptor.getTopK() < 1)
    return fail(loc, "moe_aux_loss: tokens and top_k must be positive");
  types.push_back(tensorOf({}, getElementTypeOrSelf(adaptor.getCounts())));
  return success();
}

LogicalResult MoeAuxLossGradOp::inferReturnTypes(MLIRContext *,
                                                 std::optional<Location> loc,
                                                 Adaptor adaptor,
                                                 SmallVectorImpl<Type> &types) {
  if (shapeOf(adaptor.getCounts()).size() != 1 ||
      failed(checkScalar(loc, adaptor.getGrad(), "grad")))
    return fail(loc, "moe_aux_loss_grad: counts must be [E], grad a scalar");
  types.push_back(adaptor.getCounts().getType());
  return success();
}

LogicalResult MoeZLossOp::inferReturnTypes(MLIRContext *,
                                           std::optional<Location> loc,
                                           Adaptor adaptor,
                                           SmallVectorImpl<Type> &types) {
  if (shapeOf(adaptor.getLogits()).size() < 2)
    return fail(loc, "moe_z_loss: logits must be [..., E]");
  types.push_back(tensorOf({}, getElementTypeOrSelf(adaptor.getLogits())));
  return success();
}

LogicalResult MoeZLossGradOp::inferReturnTypes(MLIRContext *,
                                               std::optional<Location> loc,
                                               Adaptor adaptor,
                                               SmallVectorImpl<Type> &types) {
  if (failed(checkScalar(loc, adaptor.getGrad(), "grad")))
    return failure();
  types.push_back(adaptor.getLogits().getType());
  return success();
}

LogicalResult MoeDispatchOp::inferReturnTypes(MLIRContext *ctx,
                                              std::optional<Location> loc,
                                              Adaptor adaptor,
                                              SmallVectorImpl<Type> &types) {
  if (shapeOf(adaptor.getExperts()).size() < 2 || adaptor.getNumExperts() < 1)
    return fail(loc, "moe_dispatch needs experts [..., k] and num_experts >= 1");
  types.push_back(adaptor.getExperts().getType());
  types.push_back(tensorOf({adaptor.getNumExperts() + 1},
                           IntegerType::get(ctx, 32)));
  return success();
}

LogicalResult MoePermuteOp::inferReturnTypes(MLIRContext *,
                                             std::optional<Location> loc,
                                             Adaptor adaptor,
                                             SmallVectorImpl<Type> &types) {
  if (failed(checkSameTokens(loc, adaptor.getInput(), adaptor.getRowOf(),
                             "row_of")))
    return failure();
  auto p = shapeOf(adaptor.getRowOf());
  types.push_back(tensorOf({tokensOf(p) * p.back(),
                            shapeOf(adaptor.getInput()).back()},
                           getElementTypeOrSelf(adaptor.getInput())));
  return success();
}

LogicalResult MoePermuteGradOp::inferReturnTypes(MLIRContext *,
                                                 std::optional<Location> loc,
                                                 Adaptor adaptor,
                                                 SmallVectorImpl<Type> &types) {
  if (failed(checkRows(loc, adaptor.getGrad(), adaptor.getRowOf())))
    return failure();
  SmallVector<int64_t> shape(shapeOf(adaptor.getRowOf()).drop_back());
  shape.push_back(shapeOf(adaptor.getGrad()).back());
  types.push_back(tensorOf(shape, getElementTypeOrSelf(adaptor.getGrad())));
  return success();
}

LogicalResult MoeUnpermuteOp::inferReturnTypes(MLIRContext *,
                                               std::optional<Location> loc,
                                               Adaptor adaptor,
                                               SmallVectorImpl<Type> &types) {
  if (failed(checkRows(loc, adaptor.getRows(), adaptor.getRowOf())))
    return failure();
  if (shapeOf(adaptor.getWeights()) != shapeOf(adaptor.getRowOf()))
    return fail(loc, "moe_unpermute: weights must be shaped as row_of " +
                         shapeStr(shapeOf(adaptor.getRowOf())));
  SmallVector<int64_t> shape(shapeOf(adaptor.getRowOf()).drop_back());
  shape.push_back(shapeOf(adaptor.getRows()).back());
  types.push_back(tensorOf(shape, getElementTypeOrSelf(adaptor.getRows())));
  return success();
}

LogicalResult MoeUnpermuteGradOp::inferReturnTypes(
    MLIRContext *, std::optional<Location> loc, Adaptor adaptor,
    SmallVectorImpl<Type> &types) {
  if (failed(checkRows(loc, adaptor.getRows(), adaptor.getRowOf())))
    return failure();
  SmallVector<int64_t> out(shapeOf(adaptor.getRowOf()).drop_back());
  out.push_back(shapeOf(adaptor.getRows()).back());
  if (shapeOf(adaptor.getGrad()) != ArrayRef<int64_t>(out) ||
      shapeOf(adaptor.getWeights()) != shapeOf(adaptor.getRowOf()))
    return fail(loc, "moe_unpermute_grad: grad must be " + shapeStr(out) +
                         " and weights shaped as row_of");
  types.push_back(adaptor.getRows().getType());
  types.push_back(adaptor.getWeights().getType());
  return success();
}

// [E, K, N] (or [E, N, K] transposed) against offsets [S + 1], S segments
// a multiple of E.
static LogicalResult checkGrouped(std::optional<Location> loc,
                                  ArrayRef<int64_t> w, Value offsets) {
  auto o = shapeOf(offsets);
  if (w.size() != 3 || o.size() != 1 || w[0] < 1 || o[0] < 2 ||
      (o[0] - 1) % w[0] != 0)
    return fail(loc, "grouped_matmul needs a weight [E, K, N] and offsets "
                     "[S + 1] (S a multiple of E), got " +
                         shapeStr(w) + " and " + shapeStr(o));
  return success();
}

LogicalResult GroupedMatmulOp::inferReturnTypes(MLIRContext *,
                                                std::optional<Location> loc,
                                                Adaptor adaptor,
                                                SmallVectorImpl<Type> &types) {
  auto x = shapeOf(adaptor.getInput()), w = shapeOf(adaptor.getWeight());
  if (failed(checkGrouped(loc, w, adaptor.getOffsets())))
    return failure();
  bool tr = adaptor.getTransposeRhs();
  int64_t K = tr ? w[2] : w[1], N = tr ? w[1] : w[2];
  if (x.size() != 2 || x[1] != K)
    return fail(loc, "grouped_matmul input " + shapeStr(x) + " must be [R, " +
                         Twine(K) + "] for weight " + shapeStr(w));
  types.push_back(
      tensorOf({x[0], N}, getElementTypeOrSelf(adaptor.getInput())));
  return success();
}

LogicalResult GroupedMatmulWeightGradOp::verify() {
  auto x = shapeOf(getInput()), g = shapeOf(getGrad());
  auto w = getResult().getType().getShape();
  std::optional<Location> loc = getLoc();
  if (x.size() != 2 || g.size() != 2 || x[0] != g[0])
    return fail(loc, "grouped_matmul_weight_grad needs input [R, K] and "
                     "grad [R, N], got " +
                         shapeStr(x) + " and " + shapeStr(g));
  if (failed(checkGrouped(loc, w, getOffsets())))
    return failure();
  bool tr = getTransposeRhs();
  if ((tr ? w[2] : w[1]) != x[1] || (tr ? w[1] : w[2]) != g[1])
    return fail(loc, "grouped_matmul_weight_grad result " + shapeStr(w) +
                         " does not match input " + shapeStr(x) +
                         " and grad " + shapeStr(g));
  return success();
}

// Rows [R, X] and segment offsets [S + 1] in and out; the rows received may
// be more than those sent (with expert parallelism), the width is kept.
static LogicalResult checkExchanged(Operation *op, Value rows, Value out,
                                    Value offsets) {
  auto r = shapeOf(rows), o = shapeOf(out), off = shapeOf(offsets);
  if (r.size() != 2 || o.size() != 2 || r[1] != o[1] || off.size() != 1)
    return op->emitOpError("needs rows [R, X] in and out and offsets [S + 1], "
                           "got ")
           << shapeStr(r) << ", " << shapeStr(o) << " and " << shapeStr(off);
  return success();
}

LogicalResult MoeKeptCountsOp::verify() {
  auto offsets = shapeOf(getOffsets());
  auto result = shapeOf(getResult());
  if (offsets.size() != 1 || result.size() != 1 ||
      offsets[0] != result[0] + 1)
    return emitOpError("offsets must be [E + 1] for a result of [E], got ")
           << shapeStr(offsets) << " and " << shapeStr(result);
  return success();
}

LogicalResult MoeExchangeOp::verify() {
  if (getRecvOffsets().getType() != getOffsets().getType())
    return emitOpError("recv_offsets must be typed as offsets");
  return checkExchanged(*this, getRows(), getRecvRows(), getOffsets());
}

LogicalResult MoeCombineOp::verify() {
  if (getRecvOffsets().getType() != getOffsets().getType())
    return emitOpError("recv_offsets must be typed as offsets");
  return checkExchanged(*this, getRows(), getResult(), getOffsets());
}

//===- GraphGradients.cpp - Reverse-mode rules of the graph ops ----------===//
//
// One gradient rule per differentiable op (GradientOpInterface). A rule sees
// the gradient of each result and builds the gradient of each operand right
// after the op; the autodiff pass sums the contributions of multiple uses.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"

using namespace mlir;
using namespace tessel::graph;

// Sums `grad` over the leading dimensions that broadcasting added, so that it
// has the type of the broadcast operand.
static Value reduceToType(OpBuilder &b, Location loc, Value grad, Type type) {
  if (grad.getType() == type)
    return grad;
  return ReduceSumOp::create(b, loc, type, grad);
}

static Value matmul(OpBuilder &b, Location loc, Value lhs, Value rhs, bool tl,
                    bool tr) {
  return MatmulOp::create(b, loc, lhs, rhs, tl, tr);
}

LogicalResult MatmulOp::buildGradients(OpBuilder &b,
                                       ArrayRef<Value> resultGrads,
                                       SmallVectorImpl<Value> &operandGrads) {
  Location loc = getLoc();
  Value dC = resultGrads[0], A = getLhs(), B = getRhs();
  bool tA = getTransposeLhs(), tB = getTransposeRhs();
  if (getSumBatch())
    return emitOpError("no gradient rule for a matmul with sum_batch");
  bool broadcastRhs =
      getRhs().getType().getRank() == 2 && getLhs().getType().getRank() > 2;
  if (tA && broadcastRhs)
    return emitOpError("no gradient rule for a transposed batched lhs with a "
                       "broadcast rhs");
  // C = op(A) op(B):  d op(A) = dC op(B)^T,  d op(B) = op(A)^T dC.
  Value dA =
      tA ? matmul(b, loc, B, dC, tB, true) : matmul(b, loc, dC, B, false, !tB);
  // A broadcast rhs sees every batch entry: the batch is summed over too.
  Value dB;
  if (broadcastRhs)
    dB = tB ? MatmulOp::create(b, loc, dC, A, true, false, true)
            : MatmulOp::create(b, loc, A, dC, true, false, true);
  else
    dB = tB ? matmul(b, loc, dC, A, true, tA) : matmul(b, loc, A, dC, !tA, false);
  operandGrads.append({dA, dB});
  return success();
}

LogicalResult AddOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                    SmallVectorImpl<Value> &operandGrads) {
  Value dC = resultGrads[0];
  operandGrads.append({dC, reduceToType(b, getLoc(), dC, getRhs().getType())});
  return success();
}

LogicalResult MulOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                    SmallVectorImpl<Value> &operandGrads) {
  Location loc = getLoc();
  Value dC = resultGrads[0];
  Value dLhs = MulOp::create(b, loc, dC, getRhs());
  Value dRhsFull = MulOp::create(b, loc, dC, getLhs());
  operandGrads.append(
      {dLhs, reduceToType(b, loc, dRhsFull, getRhs().getType())});
  return success();
}

LogicalResult GeluOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                     SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(
      GeluGradOp::create(b, getLoc(), getInput(), resultGrads[0]));
  return success();
}

LogicalResult SiluOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                     SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(
      SiluGradOp::create(b, getLoc(), getInput(), resultGrads[0]));
  return success();
}

LogicalResult
LayerNormOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                            SmallVectorImpl<Value> &operandGrads) {
  auto grad = LayerNormGradOp::create(b, getLoc(), getInput(), getWeight(),
                                      resultGrads[0], getEpsilonAttr());
  operandGrads.append(grad->result_begin(), grad->result_end());
  return success();
}

LogicalResult RmsNormOp::buildGradients(OpBuilder &b,
                                        ArrayRef<Value> resultGrads,
                                        SmallVectorImpl<Value> &operandGrads) {
  auto grad = RmsNormGradOp::create(b, getLoc(), getInput(), getWeight(),
                                    resultGrads[0], getEpsilonAttr());
  operandGrads.append(grad->result_begin(), grad->result_end());
  return success();
}

LogicalResult RopeOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                     SmallVectorImpl<Value> &operandGrads) {
  // A rotation's adjoint is the opposite rotation.
  operandGrads.push_back(RopeOp::create(b, getLoc(), resultGrads[0],
                                        getThetaAttr(),
                                        b.getBoolAttr(!getInverse()),
                                        /*seq_axes=*/nullptr, getZigzagAttr()));
  return success();
}

// A permutation's adjoint is its inverse.
LogicalResult ZigzagOp::buildGradients(OpBuilder &b,
                                       ArrayRef<Value> resultGrads,
                                       SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(ZigzagOp::create(b, getLoc(), resultGrads[0],
                                          getDimAttr(), getPiecesAttr(),
                                          b.getBoolAttr(!getInverse())));
  return success();
}

LogicalResult
AttentionOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                            SmallVectorImpl<Value> &operandGrads) {
  auto grad =
      AttentionGradOp::create(b, getLoc(), getQuery(), getKey(), getValue(),
                              getResult(), getLse(), resultGrads[0],
                              getCausalAttr(),
                              /*kv_replicated=*/nullptr, /*seq_axes=*/nullptr,
                              getZigzagAttr());
  operandGrads.append(grad->result_begin(), grad->result_end());
  return success();
}

// Linear, and its own transpose: the same mask on the gradient.
LogicalResult DropoutOp::buildGradients(OpBuilder &b,
                                        ArrayRef<Value> resultGrads,
                                        SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(DropoutOp::create(b, getLoc(), resultGrads[0],
                                           getPAttr(), getSeedAttr(),
                                           getSiteAttr(), nullptr, nullptr,
                                           getZigzagAttr()));
  return success();
}

LogicalResult SoftmaxOp::buildGradients(OpBuilder &b,
                                        ArrayRef<Value> resultGrads,
                                        SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(
      SoftmaxGradOp::create(b, getLoc(), getResult(), resultGrads[0],
                            getScaleAttr()));
  return success();
}

LogicalResult
CrossEntropyOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                               SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(CrossEntropyGradOp::create(
      b, getLoc(), getLogits(), getTargets(), resultGrads[0],
      /*vocab_axes=*/nullptr, getValidVocabAttr()));
  operandGrads.push_back(Value()); // token ids have no gradient
  return success();
}

LogicalResult
EmbeddingOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                            SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(EmbeddingGradOp::create(
      b, getLoc(), getTable().getType(), getIds(), resultGrads[0],
      /*vocab_axes=*/nullptr));
  operandGrads.push_back(Value());
  return success();
}

LogicalResult ReshapeOp::buildGradients(OpBuilder &b,
                                        ArrayRef<Value> resultGrads,
                                        SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(
      ReshapeOp::create(b, getLoc(), getInput().getType(), resultGrads[0]));
  return success();
}

LogicalResult
TransposeOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                            SmallVectorImpl<Value> &operandGrads) {
  ArrayRef<int64_t> perm = getPermutation();
  SmallVector<int64_t> inverse(perm.size());
  for (auto [i, p] : llvm::enumerate(perm))
    inverse[p] = i;
  operandGrads.push_back(
      TransposeOp::create(b, getLoc(), resultGrads[0], inverse));
  return success();
}

LogicalResult SplitOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                      SmallVectorImpl<Value> &operandGrads) {
  SmallVector<Value> pieces;
  for (auto [grad, result] : llvm::zip(resultGrads, getResults()))
    pieces.push_back(grad ? grad
                          : FillOp::create(b, getLoc(), result.getType(),
                                           b.getF64FloatAttr(0.0))
                                .getResult());
  operandGrads.push_back(ConcatOp::create(b, getLoc(), pieces, getAxis()));
  return success();
}

LogicalResult ConcatOp::buildGradients(OpBuilder &b,
                                       ArrayRef<Value> resultGrads,
                                       SmallVectorImpl<Value> &operandGrads) {
  auto split = SplitOp::create(b, getLoc(), getInputs().getTypes(),
                               resultGrads[0], getAxis());
  operandGrads.append(split->result_begin(), split->result_end());
  return success();
}

//===----------------------------------------------------------------------===//
// Mixture of experts: expert ids, row maps and counts have no gradient
//===----------------------------------------------------------------------===//

LogicalResult MoeTopKOp::buildGradients(OpBuilder &b,
                                        ArrayRef<Value> resultGrads,
                                        SmallVectorImpl<Value> &operandGrads) {
  if (!resultGrads[0]) {
    operandGrads.push_back(Value());
    return success();
  }
  operandGrads.push_back(MoeTopKGradOp::create(b, getLoc(), getProbs(),
                                               getExperts(), resultGrads[0]));
  return success();
}

LogicalResult
MoeLoadStatsOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                               SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(
      resultGrads[1]
          ? MoeProbSumsGradOp::create(b, getLoc(), getProbs(), resultGrads[1])
                .getResult()
          : Value());
  operandGrads.push_back(Value());
  return success();
}

LogicalResult
MoeAuxLossOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                             SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(Value()); // the counts are held fixed
  operandGrads.push_back(MoeAuxLossGradOp::create(
      b, getLoc(), getCounts(), resultGrads[0], getTokensAttr(),
      getTopKAttr(), getCoefAttr()));
  return success();
}

LogicalResult MoeZLossOp::buildGradients(OpBuilder &b,
                                         ArrayRef<Value> resultGrads,
                                         SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(MoeZLossGradOp::create(b, getLoc(), getLogits(),
                                                resultGrads[0], getCoefAttr()));
  return success();
}

LogicalResult
MoePermuteOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                             SmallVectorImpl<Value> &operandGrads) {
  operandGrads.push_back(
      MoePermuteGradOp::create(b, getLoc(), resultGrads[0], getRowOf()));
  operandGrads.push_back(Value());
  return success();
}

LogicalResult
MoeUnpermuteOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                               SmallVectorImpl<Value> &operandGrads) {
  auto grad = MoeUnpermuteGradOp::create(b, getLoc(), getRows(), getRowOf(),
                                         getWeights(), resultGrads[0]);
  operandGrads.append({grad.getRowsGrad(), Value(), grad.getWeightsGrad()});
  return success();
}

LogicalResult
GroupedMatmulOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                                SmallVectorImpl<Value> &operandGrads) {
  Value dy = resultGrads[0];
  bool tr = getTransposeRhs();
  // dx = dy W[e]^T: the same weight read the other way round.
  Value dx = GroupedMatmulOp::create(b, getLoc(), dy, getWeight(),
                                     getOffsets(), b.getBoolAttr(!tr));
  Value dw = GroupedMatmulWeightGradOp::create(
      b, getLoc(), getWeight().getType(), getInput(), dy, getOffsets(),
      b.getBoolAttr(tr));
  operandGrads.append({dx, dw, Value()});
  return success();
}

LogicalResult
MoeExchangeOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                              SmallVectorImpl<Value> &operandGrads) {
  // The received rows' gradient goes back where they came from.
  operandGrads.push_back(MoeCombineOp::create(
      b, getLoc(), getRows().getType(), resultGrads[0], getRecvOffsets(),
      getOffsets(), /*ep_axes=*/nullptr));
  operandGrads.push_back(Value());
  return success();
}

LogicalResult
MoeCombineOp::buildGradients(OpBuilder &b, ArrayRef<Value> resultGrads,
                             SmallVectorImpl<Value> &operandGrads) {
  auto exchange = MoeExchangeOp::create(
      b, getLoc(), TypeRange{getRows().getType(), getOffsets().getType()},
      resultGrads[0], getOffsets(), /*ep_axes=*/nullptr);
  operandGrads.append({exchange.getRecvRows(), Value(), Value()});
  return success();
}

//===- DistOps.td - Ops of the dist dialect -----------------*- tablegen -*-===//
#ifndef TESSEL_DIST_OPS
#define TESSEL_DIST_OPS

include "DistDialect.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

class Dist_CollectiveOp<string mnemonic, list<Trait> traits = []>
    : Dist_Op<mnemonic, traits> {
  let hasVerifier = 1;
}

def Dist_ReshardOp : Dist_Op<"reshard", [Pure, AllTypesMatch<["input", "result"]>]> {
  let summary = "Changes how a value is spread over the mesh";
  let description = [{
    Inserted by sharding propagation where a consumer needs its operand with
    another sharding than the producer gives (a partial sum reduced, a split
    dimension gathered); the partition pass lowers it to collectives. Types
    are global.

    ```mlir
    %r = dist.reshard %x {from = #dist.sharding<[[dp], []], partial = [tp]>, to = #dist.sharding<[[dp], []], partial = []>} : tensor<8x64xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_ShardingAttr:$from,
                   Dist_ShardingAttr:$to);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
  let builders = [OpBuilder<(ins "::mlir::Value":$input,
      "ShardingAttr":$from, "ShardingAttr":$to), [{
    build($_builder, $_state, input.getType(), input, from, to);
  }]>];
}

def Dist_LocalSliceOp : Dist_Op<"local_slice", [Pure]> {
  let summary = "Keeps this rank's piece of a tensor every rank of a group holds";
  let description = [{
    No communication: along `dim`, the result starts at
    `groupRank(axes) * numerator / denominator` (integer division) and has
    the result type's length. Realises a replicated value becoming split, and
    selects the KV head a rank's query heads read when KV heads are
    replicated over tensor parallelism.

    ```mlir
    %k1 = dist.local_slice %k {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x2x16xf32>) -> tensor<8x64x1x16xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxesAttr:$axes, I64Attr:$dim,
                   I64Attr:$numerator, I64Attr:$denominator);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type($input, $result)";
  let hasVerifier = 1;
}

def Dist_LocalInsertOp : Dist_Op<"local_insert", [Pure]> {
  let summary = "Places this rank's piece into zeros: a partial sum over the group";
  let description = [{
    The transpose of `dist.local_slice`: the result is zero except at the
    piece `local_slice` with the same attributes would select, which holds
    the input. Summed over the group it assembles the whole tensor.

    ```mlir
    %dk = dist.local_insert %dk1 {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x1x16xf32>) -> tensor<8x64x2x16xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxesAttr:$axes, I64Attr:$dim,
                   I64Attr:$numerator, I64Attr:$denominator);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type($input, $result)";
  let hasVerifier = 1;
}

def Dist_AllReduceOp : Dist_CollectiveOp<"all_reduce", [Pure]> {
  let summary = "Sums tensors over the ranks of a mesh-axis group";
  let description = [{
    Several operands form one bucket: one collective over their storage when
    it is contiguous. Each result has its operand's type.

    ```mlir
    %g0, %g1 = dist.all_reduce %a, %b {axes = #dist.axes<dp>} : (tensor<64x64xf32>, tensor<64xf32>) -> (tensor<64x64xf32>, tensor<64xf32>)
    ```
  }];
  let arguments = (ins Variadic<AnyRankedTensor>:$inputs, Dist_AxesAttr:$axes);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let assemblyFormat = "$inputs attr-dict `:` functional-type($inputs, $results)";
}

def Dist_AllReduceStartOp : Dist_CollectiveOp<"all_reduce_start"> {
  let summary = "Starts an all_reduce; its results are valid after dist.wait";
  let description = [{
    ```mlir
    %g0, %r = dist.all_reduce_start %a {axes = #dist.axes<dp>} : (tensor<64x64xf32>) -> (tensor<64x64xf32>, !dist.request)
    dist.wait %r
    ```
  }];
  let arguments = (ins Variadic<AnyRankedTensor>:$inputs, Dist_AxesAttr:$axes);
  let results = (outs Variadic<AnyRankedTensor>:$results, Dist_RequestType:$request);
  let assemblyFormat = "$inputs attr-dict `:` functional-type($inputs, results)";
}

def Dist_WaitOp : Dist_Op<"wait"> {
  let summary = "Waits for a collective started with a _start op";
  let description = [{
    ```mlir
    dist.wait %r
    ```
  }];
  let arguments = (ins Dist_RequestType:$request);
  let assemblyFormat = "$request attr-dict";
}

def Dist_AllGatherOp : Dist_CollectiveOp<"all_gather", [Pure]> {
  let summary = "Concatenates the group's pieces along a dimension";
  let description = [{
    ```mlir
    %full = dist.all_gather %x {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x16x64xf32>) -> tensor<2x64x64xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxesAttr:$axes, I64Attr:$dim);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type($input, $result)";
}

def Dist_ReduceScatterOp : Dist_CollectiveOp<"reduce_scatter", [Pure]> {
  let summary = "Sums over the group and keeps this rank's piece of a dimension";
  let description = [{
    ```mlir
    %part = dist.reduce_scatter %x {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x64x64xf32>) -> tensor<2x16x64xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxesAttr:$axes, I64Attr:$dim);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type($input, $result)";
}

def Dist_AllToAllOp : Dist_CollectiveOp<"all_to_all", [Pure]> {
  let summary = "Re-splits a tensor from one dimension to another over a group";
  let description = [{
    ```mlir
    %y = dist.all_to_all %x {axes = #dist.axes<ep>, split_dim = 0 : i64, concat_dim = 1 : i64} : (tensor<8x4xf32>) -> tensor<4x8xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxesAttr:$axes,
                   I64Attr:$split_dim, I64Attr:$concat_dim);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type($input, $result)";
}

def Dist_BroadcastOp : Dist_CollectiveOp<"broadcast", [Pure]> {
  let summary = "Copies the group root's tensor to every rank of the group";
  let description = [{
    ```mlir
    %y = dist.broadcast %x {axes = #dist.axes<dp>, root = 0 : i64} : (tensor<8xf32>) -> tensor<8xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxesAttr:$axes, I64Attr:$root);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "$input attr-dict `:` functional-type($input, $result)";
}

def Dist_SendOp : Dist_Op<"send", [MemoryEffects<[MemWrite]>]> {
  let summary = "Sends a tensor to the next (offset +1) or previous rank along an axis";
  let description = [{
    ```mlir
    dist.send %x {axis = #dist.axis<pp>, offset = 1 : i64, tag = 0 : i64} : tensor<2x64x64xf32>
    ```
  }];
  let arguments = (ins AnyRankedTensor:$input, Dist_AxisAttr:$axis,
                   I64Attr:$offset, I64Attr:$tag);
  let assemblyFormat = "$input attr-dict `:` type($input)";
}

def Dist_RecvOp : Dist_Op<"recv", [MemoryEffects<[MemRead]>]> {
  let summary = "Receives a tensor from the rank at an offset along an axis";
  let description = [{
    ```mlir
    %x = dist.recv {axis = #dist.axis<pp>, offset = -1 : i64, tag = 0 : i64} : tensor<2x64x64xf32>
    ```
  }];
  let arguments = (ins Dist_AxisAttr:$axis, I64Attr:$offset, I64Attr:$tag);
  let results = (outs AnyRankedTensor:$result);
  let assemblyFormat = "attr-dict `:` type($result)";
}

#endif // TESSEL_DIST_OPS

//===- RtDialect.td - The rt dialect ------------------------*- tablegen -*-===//
#ifndef TESSEL_RT_DIALECT
#define TESSEL_RT_DIALECT

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"
include "dialects/Dist/DistDialect.td"

def Rt_Dialect : Dialect {
  let name = "rt";
  let cppNamespace = "::tessel::rtir";
  let summary = "What a rank program does: buffers, kernel calls, communication";
  let description = [{
    The `rt` dialect is the generated program before it is printed: every
    tensor has become a buffer (a `memref` view of the parameter store, the
    gradient store, an activation arena or an accumulator), every op a call
    of a runtime kernel with all its sizes known, and every collective a
    call of the runtime's communication layer (blocking, or started and
    waited for). Its ops correspond one to one to functions of
    `libtessel_rt` (CPU) and `libtessel_cuda_rt` (CUDA), which have the same
    names and argument orders; what differs between the targets (template
    arguments, storage types, device scratch) is said by the target
    interface when `rt` is converted to `emitc`.
  }];
  let useDefaultAttributePrinterParser = 1;
  let useDefaultTypePrinterParser = 1;
}

class Rt_Op<string mnemonic, list<Trait> traits = []>
    : Op<Rt_Dialect, mnemonic, traits>;

def Rt_Space : I32EnumAttr<"Space", "storage a buffer lives in", [
    I32EnumAttrCase<"Arena", 0, "arena">,
    I32EnumAttrCase<"Params", 1, "params">,
    I32EnumAttrCase<"Grads", 2, "grads">,
    I32EnumAttrCase<"AdamM", 3, "adam_m">,
    I32EnumAttrCase<"AdamV", 4, "adam_v">,
    I32EnumAttrCase<"Accumulators", 5, "accumulators">,
    I32EnumAttrCase<"Shadow", 6, "shadow">,
    I32EnumAttrCase<"NormSums", 7, "norm_sums">,
    I32EnumAttrCase<"Received", 8, "received">,
    I32EnumAttrCase<"Transient", 9, "transient">,
    I32EnumAttrCase<"KvCache", 10, "kv_cache">,
    I32EnumAttrCase<"Logits", 11, "logits">,
    I32EnumAttrCase<"ParamPieces", 12, "param_pieces">]> {
  let cppNamespace = "::tessel::rtir";
  let genSpecializedAttr = 0;
}
def Rt_SpaceAttr : EnumAttr<Rt_Dialect, Rt_Space, "space"> {
  let assemblyFormat = "`<` $value `>`";
}

def Rt_GroupOffsetAttr : AttrDef<Rt_Dialect, "GroupOffset"> {
  let mnemonic = "group_offset";
  let summary = "An offset that depends on the rank's place in a group";
  let description = [{
    `groupRank(axes) * numerator / denominator` (integer division): the
    start of this rank's piece of a dimension split over `axes` (a
    vocabulary slice, a KV head). Known only when the program runs.

    ```mlir
    #rt.group_offset<#dist.axes<tp>, 128, 1>
    ```
  }];
  let parameters = (ins "::tessel::dist::AxesAttr":$axes, "int64_t":$numerator,
                    "int64_t":$denominator);
  let assemblyFormat = "`<` $axes `,` $numerator `,` $denominator `>`";
}

def Rt_RequestType : TypeDef<Rt_Dialect, "Request"> {
  let mnemonic = "request";
  let summary = "A collective in flight";
}

#endif // TESSEL_RT_DIALECT

//===- DistDialect.td - The dist dialect --------------------*- tablegen -*-===//
#ifndef TESSEL_DIST_DIALECT
#define TESSEL_DIST_DIALECT

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"

def Dist_Dialect : Dialect {
  let name = "dist";
  let cppNamespace = "::tessel::dist";
  let summary = "Device meshes, shardings and collectives over mesh axes";
  let description = [{
    The `dist` dialect says how tensors are spread over a device mesh with
    named axes (`dp`, `tp`, `pp`, `cp`, `ep`) and how data moves between
    ranks. A sharding gives, for each tensor dimension, the mesh axes that
    split it, and the *partial* axes over which the value is still an
    unreduced sum (which upstream `shard` lacks, and which is what lets a
    reduction become a reduce-scatter, or be delayed and bucketed).
    Collectives run over a set of mesh axes: the group of ranks whose
    coordinates differ only along those axes.
  }];
  let useDefaultAttributePrinterParser = 1;
  let useDefaultTypePrinterParser = 1;
}

class Dist_Op<string mnemonic, list<Trait> traits = []>
    : Op<Dist_Dialect, mnemonic, traits>;

def Dist_ShardingAttr : AttrDef<Dist_Dialect, "Sharding"> {
  let mnemonic = "sharding";
  let summary = "How a tensor is split over mesh axes";
  let description = [{
    `dims` has one entry per tensor dimension: the mesh axes splitting it,
    outermost first (empty: not split). `partial` lists the axes over which
    the value is a partial sum that still needs a reduction. `blocks`, when
    present, gives per dimension the number of equal blocks that are split
    separately (a rank holds its piece of every block): GPT-2's fused
    [q | k | v] projection is split this way so that each rank holds the q, k
    and v columns of its own heads.

    ```mlir
    #dist.sharding<[["dp"], [], []], partial = ["tp"]>
    #dist.sharding<[[], ["tp"]], partial = [], blocks = array<i64: 1, 3>>
    ```
  }];
  let parameters = (ins "::mlir::ArrayAttr":$dims, "::mlir::ArrayAttr":$partial,
                    OptionalParameter<"::mlir::DenseI64ArrayAttr">:$blocks);
  let assemblyFormat = "`<` $dims `,` `partial` `=` $partial (`,` `blocks` `=` $blocks^)? `>`";
  let genVerifyDecl = 1;
}

def Dist_RequestType : TypeDef<Dist_Dialect, "Request"> {
  let mnemonic = "request";
  let summary = "A collective in flight";
  let description = [{
    Returned by the `_start` form of a collective and consumed by
    `dist.wait`; the collective's results may be read only after the wait.
  }];
}

#endif // TESSEL_DIST_DIALECT

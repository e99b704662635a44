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
  let hasOperationAttrVerify = 1;
  let extraClassDeclaration = [{
    // The module attribute holding the mesh (a MeshAttr).
    static constexpr ::llvm::StringLiteral kMeshAttrName = "dist.mesh";
  }];
}

class Dist_Op<string mnemonic, list<Trait> traits = []>
    : Op<Dist_Dialect, mnemonic, traits>;

def Dist_AxisAttr : AttrDef<Dist_Dialect, "Axis"> {
  let mnemonic = "axis";
  let summary = "One mesh axis: dp, tp, pp, cp or ep";
  let description = [{
    ```mlir
    #dist.axis<pp>
    ```
  }];
  let parameters = (ins "::tessel::MeshAxis":$value);
  let assemblyFormat = "`<` custom<AxisName>($value) `>`";
  let returnType = "::tessel::MeshAxis";
  let convertFromStorage = "$_self.getValue()";
  let constBuilderCall = "::tessel::dist::AxisAttr::get($_builder.getContext(), $0)";
}

def Dist_AxesAttr : AttrDef<Dist_Dialect, "Axes"> {
  let mnemonic = "axes";
  let summary = "A set of mesh axes";
  let description = [{
    The group of a collective over these axes is the ranks whose mesh
    coordinates differ only along them.

    ```mlir
    #dist.axes<dp, tp>
    ```
  }];
  let parameters = (ins "::tessel::AxisSet":$value);
  let assemblyFormat = "`<` custom<AxisList>($value) `>`";
  let returnType = "::tessel::AxisSet";
  let convertFromStorage = "$_self.getValue()";
  let constBuilderCall = "::tessel::dist::AxesAttr::get($_builder.getContext(), $0)";
}

def Dist_MeshAttr : AttrDef<Dist_Dialect, "Mesh"> {
  let mnemonic = "mesh";
  let summary = "The device mesh of a program: the size of each named axis";
  let description = [{
    Sizes of the axes larger than one, outermost first in the default rank
    order (pp, dp, ep, cp, tp; see tessel/Support/MeshLayout.h); the others
    are 1. `zero_group` splits dp for hybrid sharding; `order` numbers the
    ranks in another order (parallel.order, innermost first). A module's
    mesh is its `dist.mesh` attribute; without one the program runs on one
    rank.

    ```mlir
    module attributes {dist.mesh = #dist.mesh<pp = 2, dp = 2, tp = 4>} {}
    module attributes {dist.mesh = #dist.mesh<dp = 4, tp = 2, order = "dp-tp-cp-ep-pp">} {}
    ```
  }];
  let parameters = (ins "::tessel::MeshShape":$shape);
  let assemblyFormat = "`<` custom<MeshSizes>($shape) `>`";
  let genVerifyDecl = 1;
}

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
    #dist.sharding<[[dp], [], []], partial = [tp]>
    #dist.sharding<[[], [tp]], partial = [], blocks = [1, 3]>
    ```
  }];
  let parameters = (ins ArrayRefParameter<"::tessel::AxisSet">:$dims,
                    "::tessel::AxisSet":$partial,
                    OptionalArrayRefParameter<"int64_t">:$blocks);
  let hasCustomAssemblyFormat = 1;
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

//===- DistOps.cpp - The dist dialect: meshes, shardings, collectives -----===//

#include "dialects/Dist/DistOps.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace tessel::dist;

//===--- Assembly of the typed attributes ---------------------------------===//

static ParseResult parseAxisName(AsmParser &parser, tessel::MeshAxis &axis) {
  StringRef name;
  SMLoc loc = parser.getCurrentLocation();
  if (parser.parseKeyword(&name))
    return failure();
  std::optional<tessel::MeshAxis> parsed = tessel::parseMeshAxis(name);
  if (!parsed)
    return parser.emitError(loc, "unknown mesh axis '")
           << name << "' (axes: dp, tp, pp, cp, ep)";
  axis = *parsed;
  return success();
}
static void printAxisName(AsmPrinter &printer, tessel::MeshAxis axis) {
  printer << tessel::meshAxisName(axis);
}

// One member of an axis list: a mesh axis, or a sub-group of dp under
// hybrid sharding (dp_shard, dp_replica).
static std::optional<tessel::AxisSet> axisMember(StringRef name) {
  if (name == "dp_shard")
    return tessel::AxisSet::dpShard();
  if (name == "dp_replica")
    return tessel::AxisSet::dpReplica();
  if (std::optional<tessel::MeshAxis> axis = tessel::parseMeshAxis(name))
    return tessel::AxisSet(*axis);
  return std::nullopt;
}

// `dp, tp` (possibly empty), each axis once.
static ParseResult parseAxisList(AsmParser &parser, tessel::AxisSet &axes) {
  axes = tessel::AxisSet();
  StringRef name;
  if (failed(parser.parseOptionalKeyword(&name)))
    return success(); // no axes
  while (true) {
    SMLoc loc = parser.getCurrentLocation();
    std::optional<tessel::AxisSet> member = axisMember(name);
    if (!member)
      return parser.emitError(loc, "unknown mesh axis '")
             << name << "' (axes: dp, tp, pp, cp, ep, dp_shard, dp_replica)";
    if (axes.intersects(*member))
      return parser.emitError(loc, "mesh axis '")
             << name << "' appears twice";
    axes |= *member;
    if (failed(parser.parseOptionalComma()))
      return success();
    if (parser.parseKeyword(&name))
      return failure();
  }
}
static void printAxisList(AsmPrinter &printer, tessel::AxisSet axes) {
  std::string text = axes.str();
  if (axes.empty())
    return;
  for (char &c : text)
    if (c == ',')
      printer << ", ";
    else
      printer << c;
}

// `pp = 2, dp = 4` (possibly empty): the axes larger than one.
static ParseResult parseMeshSizes(AsmParser &parser, tessel::MeshShape &shape) {
  shape = tessel::MeshShape();
  bool first = true;
  do {
    SMLoc loc = parser.getCurrentLocation();
    StringRef name;
    if (first && failed(parser.parseOptionalKeyword(&name)))
      return success(); // `#dist.mesh<>`: one rank
    if (!first && parser.parseKeyword(&name))
      return failure();
    first = false;
    if (name == "zero_group") {
      if (parser.parseEqual() || parser.parseInteger(shape.dpShard))
        return failure();
      continue;
    }
    if (name == "order") {
      std::string order;
      if (parser.parseEqual())
        return failure();
      SMLoc at = parser.getCurrentLocation();
      if (parser.parseString(&order))
        return failure();
      if (!shape.setOrder(order))
        return parser.emitError(at, "order \"")
               << order
               << "\" must name dp, tp, cp, ep and pp once each, innermost "
                  "first and pp last";
      continue;
    }
    std::optional<tessel::MeshAxis> axis = tessel::parseMeshAxis(name);
    if (!axis)
      return parser.emitError(loc, "unknown mesh axis '")
             << name << "' (axes: dp, tp, pp, cp, ep; and zero_group, order)";
    int64_t size = 0;
    if (parser.parseEqual() || parser.parseInteger(size))
      return failure();
    shape[*axis] = size;
  } while (succeeded(parser.parseOptionalComma()));
  return success();
}
static void printMeshSizes(AsmPrinter &printer,
                           const tessel::MeshShape &shape) {
  bool first = true;
  for (tessel::MeshAxis axis : tessel::kRankOrder)
    if (shape[axis] != 1) {
      printer << (first ? "" : ", ") << tessel::meshAxisName(axis) << " = "
              << shape[axis];
      first = false;
    }
  if (shape.hybrid()) {
    printer << (first ? "" : ", ") << "zero_group = " << shape.dpShard;
    first = false;
  }
  if (!shape.defaultOrder())
    printer << (first ? "" : ", ") << "order = \"" << shape.orderName()
            << "\"";
}

#include "dialects/Dist/DistDialect.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Dist/DistAttrs.cpp.inc"
#define GET_TYPEDEF_CLASSES
#include "dialects/Dist/DistTypes.cpp.inc"

void DistDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/Dist/DistAttrs.cpp.inc"
      >();
  addTypes<
#define GET_TYPEDEF_LIST
#include "dialects/Dist/DistTypes.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Dist/DistOps.cpp.inc"
      >();
}

LogicalResult DistDialect::verifyOperationAttribute(Operation *op,
                                                    NamedAttribute attr) {
  if (attr.getName() == kMeshAttrName) {
    if (!isa<ModuleOp>(op))
      return op->emitOpError("dist.mesh is a module attribute");
    if (!isa<MeshAttr>(attr.getValue()))
      return op->emitOpError("dist.mesh must be a #dist.mesh<...>");
  }
  return success();
}

#define GET_OP_CLASSES
#include "dialects/Dist/DistOps.cpp.inc"

//===--- Shardings and meshes ---------------------------------------------===//

Attribute ShardingAttr::parse(AsmParser &parser, Type) {
  SmallVector<tessel::AxisSet> dims;
  tessel::AxisSet partial;
  SmallVector<int64_t> blocks;
  auto parseBracketed = [&](tessel::AxisSet &axes) {
    return failure(parser.parseLSquare() || parseAxisList(parser, axes) ||
                   parser.parseRSquare());
  };
  if (parser.parseLess() ||
      parser.parseCommaSeparatedList(AsmParser::Delimiter::Square,
                                     [&]() -> ParseResult {
                                       tessel::AxisSet axes;
                                       if (failed(parseBracketed(axes)))
                                         return failure();
                                       dims.push_back(axes);
                                       return success();
                                     }) ||
      parser.parseComma() || parser.parseKeyword("partial") ||
      parser.parseEqual() || failed(parseBracketed(partial)))
    return {};
  if (succeeded(parser.parseOptionalComma())) {
    if (parser.parseKeyword("blocks") || parser.parseEqual() ||
        parser.parseCommaSeparatedList(AsmParser::Delimiter::Square,
                                       [&]() -> ParseResult {
                                         int64_t b;
                                         if (parser.parseInteger(b))
                                           return failure();
                                         blocks.push_back(b);
                                         return success();
                                       }))
      return {};
  }
  if (parser.parseGreater())
    return {};
  return parser.getChecked<ShardingAttr>(parser.getContext(), dims, partial,
                                         blocks);
}

void ShardingAttr::print(AsmPrinter &printer) const {
  printer << "<[";
  for (auto [i, axes] : llvm::enumerate(getDims())) {
    printer << (i ? ", [" : "[");
    printAxisList(printer, axes);
    printer << "]";
  }
  printer << "], partial = [";
  printAxisList(printer, getPartial());
  printer << "]";
  if (!getBlocks().empty()) {
    printer << ", blocks = [";
    llvm::interleaveComma(getBlocks(), printer);
    printer << "]";
  }
  printer << ">";
}

LogicalResult MeshAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                               tessel::MeshShape shape) {
  for (tessel::MeshAxis axis : tessel::kMeshAxes)
    if (shape[axis] < 1)
      return emitError() << "mesh axis " << tessel::meshAxisName(axis)
                         << " must have size >= 1";
  int64_t dp = shape[tessel::MeshAxis::DP];
  if (shape.dpShard != 0 && (shape.dpShard < 1 || dp % shape.dpShard != 0))
    return emitError() << "zero_group = " << shape.dpShard
                       << " must divide dp = " << dp;
  return success();
}

Sharding Sharding::fromAttr(ShardingAttr attr) {
  Sharding s;
  s.dims.assign(attr.getDims().begin(), attr.getDims().end());
  s.partial = attr.getPartial();
  for (auto [d, count] : llvm::enumerate(attr.getBlocks()))
    s.setBlocks(d, count);
  return s;
}

ShardingAttr Sharding::toAttr(MLIRContext *ctx) const {
  return ShardingAttr::get(ctx, dims, partial, blocks);
}

tessel::AxisSet Sharding::allAxes() const {
  tessel::AxisSet all = partial;
  for (tessel::AxisSet d : dims)
    all |= d;
  return all;
}

tessel::AxisSet Sharding::leadingAxes(size_t count) const {
  tessel::AxisSet axes;
  for (size_t d = 0; d < count && d < dims.size(); ++d)
    axes |= dims[d];
  return axes;
}

tessel::MeshShape tessel::dist::meshOf(Operation *op) {
  for (Operation *p = op; p; p = p->getParentOp())
    if (isa<ModuleOp>(p))
      if (auto mesh = p->getAttrOfType<MeshAttr>(DistDialect::kMeshAttrName))
        return mesh.getShape();
  return {};
}

void tessel::dist::setMesh(ModuleOp module, const tessel::MeshShape &shape) {
  module->setAttr(DistDialect::kMeshAttrName,
                  MeshAttr::get(module.getContext(), shape));
}

LogicalResult ShardingAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                   ArrayRef<tessel::AxisSet> dims,
                                   tessel::AxisSet partial,
                                   ArrayRef<int64_t> blocks) {
  if (!blocks.empty() &&
      (blocks.size() != dims.size() ||
       llvm::any_of(blocks, [](int64_t b) { return b < 1; })))
    return emitError() << "blocks must give a count >= 1 for each dimension";
  tessel::AxisSet seen = partial;
  for (tessel::AxisSet axes : dims) {
    if (seen.intersects(axes))
      return emitError() << "a mesh axis is used twice in one sharding";
    seen |= axes;
  }
  return success();
}

// Checks the axes and returns the group size of the collective.
static FailureOr<int64_t> groupOf(Operation *op, tessel::AxisSet axes) {
  if (axes.empty())
    return op->emitOpError("needs at least one mesh axis");
  return meshOf(op).groupSize(axes);
}

LogicalResult AllReduceOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  if (getInputs().getTypes() != getResults().getTypes())
    return emitOpError("result types must equal the operand types");
  return success();
}

LogicalResult AllReduceStartOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  if (getInputs().getTypes() != getResults().getTypes())
    return emitOpError("result types must equal the operand types");
  return success();
}

// `big` is `small` scaled by `group` along `dim`, equal elsewhere.
static LogicalResult checkScaled(Operation *op, RankedTensorType small,
                                 RankedTensorType big, int64_t dim,
                                 int64_t group, StringRef what) {
  if (dim < 0 || dim >= small.getRank() || small.getRank() != big.getRank())
    return op->emitOpError("dim ") << dim << " out of range";
  for (int64_t d = 0; d < small.getRank(); ++d) {
    int64_t expect = small.getDimSize(d) * (d == dim ? group : 1);
    if (big.getDimSize(d) != expect)
      return op->emitOpError(what)
             << " dimension " << d << " must be " << expect
             << " for a group of " << group << ", got " << big.getDimSize(d);
  }
  return success();
}

LogicalResult AllGatherOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  return checkScaled(*this, getInput().getType(), getResult().getType(),
                     getDim(), *group, "result");
}

LogicalResult ReduceScatterOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  return checkScaled(*this, getResult().getType(), getInput().getType(),
                     getDim(), *group, "input");
}

LogicalResult AllToAllOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  auto in = getInput().getType(), out = getResult().getType();
  int64_t s = getSplitDim(), c = getConcatDim();
  if (s < 0 || c < 0 || s >= in.getRank() || c >= in.getRank() ||
      in.getRank() != out.getRank())
    return emitOpError("split_dim and concat_dim must be dimensions");
  for (int64_t d = 0; d < in.getRank(); ++d) {
    int64_t expect = in.getDimSize(d);
    if (d == s && d != c)
      expect /= *group;
    if (d == c && d != s)
      expect *= *group;
    if (out.getDimSize(d) != expect ||
        (d == s && d != c && in.getDimSize(d) % *group != 0))
      return emitOpError("result dimension ")
             << d << " must be " << expect << ", got " << out.getDimSize(d);
  }
  return success();
}

LogicalResult BroadcastOp::verify() {
  FailureOr<int64_t> group = groupOf(*this, getAxes());
  if (failed(group))
    return failure();
  if (getInput().getType() != getResult().getType())
    return emitOpError("result type must equal the operand type");
  int64_t root = static_cast<int64_t>(getRoot());
  if (root < 0 || root >= *group)
    return emitOpError("root ")
           << getRoot() << " is outside the group of " << *group;
  return success();
}

// The piece along `dim` has `small`'s length and lies inside `big`.
static LogicalResult checkPiece(Operation *op, RankedTensorType small,
                                RankedTensorType big, int64_t dim,
                                int64_t denominator) {
  if (dim < 0 || dim >= big.getRank() || small.getRank() != big.getRank())
    return op->emitOpError("dim ") << dim << " out of range";
  if (denominator < 1)
    return op->emitOpError("denominator must be >= 1");
  for (int64_t d = 0; d < big.getRank(); ++d)
    if (d != dim && small.getDimSize(d) != big.getDimSize(d))
      return op->emitOpError("shapes may differ only along dim ") << dim;
  if (small.getDimSize(dim) > big.getDimSize(dim))
    return op->emitOpError("the piece is longer than the whole");
  return success();
}

LogicalResult LocalSliceOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  return checkPiece(*this, getResult().getType(), getInput().getType(),
                    getDim(), getDenominator());
}

LogicalResult LocalInsertOp::verify() {
  if (failed(groupOf(*this, getAxes())))
    return failure();
  return checkPiece(*this, getInput().getType(), getResult().getType(),
                    getDim(), getDenominator());
}

//===- Spelling.h - How rt says things in C++ (internal) --------*- C++ -*-===//
//
// Shared by the rt -> emitc patterns (RtToEmitC.cpp) and the program
// assembly (Programs.cpp).
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_LIB_CONVERSION_RTTOEMITC_SPELLING_H
#define TESSEL_LIB_CONVERSION_RTTOEMITC_SPELLING_H

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <cctype>
#include <string>

namespace tessel::emission {

using namespace mlir;
namespace rt = tessel::rtir;

// The program's table of started collectives.
constexpr llvm::StringLiteral kRequests = "gRequests";

inline std::string axesLiteral(AxisSet axes) {
  return std::to_string(axes.bits()) + "u";
}

inline std::string axisLiteral(MeshAxis axis) {
  std::string name = meshAxisName(axis);
  for (char &c : name)
    c = static_cast<char>(toupper(c));
  return "MeshAxis::" + name;
}

inline std::string floatLiteral(double value) {
  std::string text;
  llvm::raw_string_ostream os(text);
  os << "static_cast<float>(" << llvm::format("%.17g", value) << ")";
  return text;
}

// The variable of the generated function that points at a store.
inline StringRef storeName(rt::Space space) {
  switch (space) {
  case rt::Space::Arena:
    return "A";
  case rt::Space::Params:
    return "P";
  case rt::Space::Grads:
    return "G";
  case rt::Space::AdamM:
    return "M";
  case rt::Space::AdamV:
    return "V";
  case rt::Space::Accumulators:
    return "ACC";
  case rt::Space::Shadow:
    return "PB";
  case rt::Space::NormSums:
    return "NS";
  case rt::Space::Received:
    return "R";
  case rt::Space::Transient:
    return "T";
  case rt::Space::KvCache:
    return "KV";
  case rt::Space::Logits:
    return "LG";
  case rt::Space::ParamPieces:
    return "PP";
  }
  llvm_unreachable("unknown space");
}


inline Value literal(OpBuilder &b, Location loc, Type type, const Twine &text) {
  return b.create<emitc::LiteralOp>(loc, type, text.str());
}

inline Type opaque(MLIRContext *ctx, StringRef text) {
  return emitc::OpaqueType::get(ctx, text);
}

inline Attribute opaqueAttr(MLIRContext *ctx, const Twine &text) {
  return emitc::OpaqueAttr::get(ctx, text.str());
}

} // namespace tessel::emission

#endif // TESSEL_LIB_CONVERSION_RTTOEMITC_SPELLING_H

//===- Nesting.h - How deep an .mlir input nests ------------------*- C++ -*-===//
//
// MLIR's parser recurses once per nesting level (regions, attributes,
// lists): a file nested deeply enough overflows the stack instead of failing.
// `tessel compile` and the .mlir fuzzer refuse such a file before parsing it.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_FRONTEND_NESTING_H
#define TESSEL_FRONTEND_NESTING_H

#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <optional>

namespace tessel {

// The deepest nesting an .mlir input may have (docs/spec.md).
constexpr int64_t kMaxMLIRNesting = 256;

// The line where `text` (MLIR) first nests brackets deeper than `limit`,
// outside string literals and comments; none when it never does. `<` nests
// too (tensor<...>, tuple<tuple<...>>), but `>` is also part of `->` and
// `>=`: it closes only a `<`, and `)`, `]` or `}` close any `<` left open
// inside them, so that the depth is never counted short.
inline std::optional<int64_t> tooDeep(llvm::StringRef text, int64_t limit) {
  llvm::SmallVector<char, 64> open;
  int64_t line = 1;
  bool inString = false, inComment = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '\n') {
      ++line;
      inComment = false;
      continue;
    }
    if (inComment)
      continue;
    if (inString) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        inString = false;
      continue;
    }
    switch (c) {
    case '"':
      inString = true;
      break;
    case '/':
      if (i + 1 < text.size() && text[i + 1] == '/')
        inComment = true;
      break;
    case '{':
    case '(':
    case '[':
    case '<':
      open.push_back(c);
      if ((int64_t)open.size() > limit)
        return line;
      break;
    case '>':
      if (i > 0 && text[i - 1] == '-')
        break;
      if (!open.empty() && open.back() == '<')
        open.pop_back();
      break;
    case '}':
    case ')':
    case ']': {
      char opener = c == '}' ? '{' : c == ')' ? '(' : '[';
      while (!open.empty() && open.back() == '<')
        open.pop_back();
      if (!open.empty() && open.back() == opener)
        open.pop_back();
      break;
    }
    default:
      break;
    }
  }
  return std::nullopt;
}

} // namespace tessel

#endif // TESSEL_FRONTEND_NESTING_H

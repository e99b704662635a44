//===- Nesting.h - How deep an .mlir input nests ------------------*- C++ -*-===//
//
// MLIR's parser recurses once per nesting level (regions, attributes,
// lists): a file nested deeply enough overflows the stack instead of failing.
// And it reads a dense array of `index` elements (`array<index: 1>`) past
// its checks, into a crash. `tessel compile` and the .mlir fuzzer refuse such
// a file before parsing it.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_FRONTEND_NESTING_H
#define TESSEL_FRONTEND_NESTING_H

#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <optional>

namespace tessel {

// The deepest nesting an .mlir input may have (docs/spec.md).
constexpr int64_t kMaxMLIRNesting = 256;

// Calls `visit(i, line)` for each character of `text` (MLIR) outside string
// literals and comments, `i` its index and `line` its line, until `visit`
// returns true; returns that line, or none.
template <typename Visit>
std::optional<int64_t> scanCode(llvm::StringRef text, Visit visit) {
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
    if (c == '"') {
      inString = true;
      continue;
    }
    if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      inComment = true;
      continue;
    }
    if (visit(i, line))
      return line;
  }
  return std::nullopt;
}

// The line where `text` (MLIR) first nests brackets deeper than `limit`,
// outside string literals and comments; none when it never does. `<` nests
// too (tensor<...>, tuple<tuple<...>>), but `>` is also part of `->` and
// `>=`: it closes only a `<`, and `)`, `]` or `}` close any `<` left open
// inside them, so that the depth is never counted short.
inline std::optional<int64_t> tooDeep(llvm::StringRef text, int64_t limit) {
  llvm::SmallVector<char, 64> open;
  return scanCode(text, [&](size_t i, int64_t) {
    switch (char c = text[i]) {
    case '{':
    case '(':
    case '[':
    case '<':
      open.push_back(c);
      return (int64_t)open.size() > limit;
    case '>':
      if (i > 0 && text[i - 1] == '-')
        return false;
      if (!open.empty() && open.back() == '<')
        open.pop_back();
      return false;
    case '}':
    case ')':
    case ']': {
      char opener = c == '}' ? '{' : c == ')' ? '(' : '[';
      while (!open.empty() && open.back() == '<')
        open.pop_back();
      if (!open.empty() && open.back() == opener)
        open.pop_back();
      return false;
    }
    default:
      return false;
    }
  });
}

// The line of the first dense array attribute (`array<TYPE: ...>`, outside
// string literals and comments) whose element type the parser would take
// for a number and then fail on: `index`, or a type alias (`!name`), which
// may stand for it. None when there is no such array.
inline std::optional<int64_t> badDenseArray(llvm::StringRef text) {
  auto isWordChar = [](char c) {
    return llvm::isAlnum(c) || c == '_' || c == '.' || c == '!' || c == '$';
  };
  return scanCode(text, [&](size_t i, int64_t) {
    if (!text.substr(i).starts_with("array<") ||
        (i > 0 && isWordChar(text[i - 1])))
      return false;
    llvm::StringRef type = text.substr(i + 6).ltrim(" \t\r\n");
    llvm::StringRef word = type.take_while(
        [&](char ch) { return isWordChar(ch) || ch == '-'; });
    return word == "index" || word.starts_with("!");
  });
}

} // namespace tessel

#endif // TESSEL_FRONTEND_NESTING_H

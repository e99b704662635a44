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

// The line of the first dense array attribute (`array<TYPE: ...>`, outside
// string literals and comments) whose element type the parser would take
// for a number and then fail on: `index`, or a type alias (`!name`), which
// may stand for it. None when there is no such array.
inline std::optional<int64_t> badDenseArray(llvm::StringRef text) {
  int64_t line = 1;
  bool inString = false, inComment = false;
  auto isWordChar = [](char c) {
    return llvm::isAlnum(c) || c == '_' || c == '.' || c == '!' || c == '$';
  };
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
    if (!text.substr(i).starts_with("array<") ||
        (i > 0 && isWordChar(text[i - 1])))
      continue;
    llvm::StringRef type = text.substr(i + 6).ltrim(" \t\r\n");
    llvm::StringRef word = type.take_while([&](char ch) {
      return isWordChar(ch) || ch == '-';
    });
    if (word == "index" || word.starts_with("!"))
      return line;
  }
  return std::nullopt;
}

} // namespace tessel

#endif // TESSEL_FRONTEND_NESTING_H

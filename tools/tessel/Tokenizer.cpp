//===- Tokenizer.cpp - GPT-2's byte-level BPE -----------------------------===//

#include "Tokenizer.h"

#include <nlohmann/json.hpp>
#include <unicode/uchar.h>

#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

using namespace tessel;

namespace {

// A code point of the text and where its bytes are.
struct CodePoint {
  UChar32 c; // -1 for a byte that is not valid UTF-8
  size_t begin, end;
};

std::vector<CodePoint> codePoints(std::string_view text) {
  std::vector<CodePoint> out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    unsigned char b = text[i];
    int extra = b < 0x80 ? 0 : (b >> 5) == 6 ? 1 : (b >> 4) == 14 ? 2
                : (b >> 3) == 30 ? 3 : -1;
    UChar32 c = extra == 0 ? b : extra == 1 ? b & 0x1f : extra == 2 ? b & 0x0f
                                                                     : b & 0x07;
    bool ok = extra >= 0;
    for (int k = 1; ok && k <= extra; k++) {
      if (i + k >= text.size() || ((unsigned char)text[i + k] >> 6) != 2) {
        ok = false;
        break;
      }
      c = (c << 6) | ((unsigned char)text[i + k] & 0x3f);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    if (ok && ((extra == 1 && c < 0x80) || (extra == 2 && c < 0x800) ||
               (extra == 3 && c < 0x10000) || c > 0x10ffff ||
               (c >= 0xd800 && c <= 0xdfff)))
      ok = false;
    if (!ok) {
      out.push_back({-1, i, i + 1});
      i += 1;
      continue;
    }
    out.push_back({c, i, i + extra + 1});
    i += extra + 1;
  }
  return out;
}

bool isLetter(UChar32 c) { return c >= 0 && (U_GET_GC_MASK(c) & U_GC_L_MASK); }
bool isNumber(UChar32 c) { return c >= 0 && (U_GET_GC_MASK(c) & U_GC_N_MASK); }
// \s of the pattern: Unicode's White_Space property.
bool isSpace(UChar32 c) { return c >= 0 && u_isUWhiteSpace(c); }

std::string utf8(UChar32 c) {
  std::string s;
  if (c < 0x80) {
    s += (char)c;
  } else if (c < 0x800) {
    s += (char)(0xc0 | (c >> 6));
    s += (char)(0x80 | (c & 0x3f));
  } else {
    s += (char)(0xe0 | (c >> 12));
    s += (char)(0x80 | ((c >> 6) & 0x3f));
    s += (char)(0x80 | (c & 0x3f));
  }
  return s;
}

std::string readFile(const std::string &path, const char *what) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error(std::string(what) + " '" + path +
                             "' cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

} // namespace

std::vector<std::string_view> Gpt2Bpe::split(std::string_view text) {
  std::vector<CodePoint> cps = codePoints(text);
  std::vector<std::string_view> pieces;
  size_t n = cps.size(), i = 0;
  auto emit = [&](size_t from, size_t to) {
    pieces.push_back(text.substr(cps[from].begin,
                                 cps[to - 1].end - cps[from].begin));
    i = to;
  };
  auto ascii = [&](size_t k, char ch) { return k < n && cps[k].c == ch; };
  auto other = [&](size_t k) {
    return !isSpace(cps[k].c) && !isLetter(cps[k].c) && !isNumber(cps[k].c);
  };
  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (ascii(i, '\'')) {
      if (ascii(i + 1, 's') || ascii(i + 1, 't')) {
        emit(i, i + 2);
        continue;
      }
      if ((ascii(i + 1, 'r') && ascii(i + 2, 'e')) ||
          (ascii(i + 1, 'v') && ascii(i + 2, 'e'))) {
        emit(i, i + 3);
        continue;
      }
      if (ascii(i + 1, 'm')) {
        emit(i, i + 2);
        continue;
      }
      if (ascii(i + 1, 'l') && ascii(i + 2, 'l')) {
        emit(i, i + 3);
        continue;
      }
      if (ascii(i + 1, 'd')) {
        emit(i, i + 2);
        continue;
      }
    }
    //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+
    size_t start = ascii(i, ' ') ? i + 1 : i;
    bool matched = false;
    for (auto in : {isLetter, isNumber}) {
      if (start < n && in(cps[start].c)) {
        size_t j = start;
        while (j < n && in(cps[j].c))
          j++;
        emit(i, j);
        matched = true;
        break;
      }
    }
    if (matched)
      continue;
    if (start < n && other(start)) {
      size_t j = start;
      while (j < n && other(j))
        j++;
      emit(i, j);
      continue;
    }
    // \s+(?!\S) | \s+ : a run of spaces, leaving its last one to the next
    // piece when a non-space follows.
    size_t j = i;
    while (j < n && isSpace(cps[j].c))
      j++;
    if (j == i) // cannot happen: every code point is one of the classes
      j = i + 1;
    if (j < n && j - i >= 2)
      j--;
    emit(i, j);
  }
  return pieces;
}

Gpt2Bpe Gpt2Bpe::load(const std::string &vocabPath,
                      const std::string &mergesPath) {
  Gpt2Bpe bpe;
  bpe.vocabPath_ = vocabPath;
  nlohmann::json vocab = nlohmann::json::parse(
      readFile(vocabPath, "vocabulary"), nullptr, /*allow_exceptions=*/false);
  if (!vocab.is_object() || vocab.empty())
    throw std::runtime_error("vocabulary '" + vocabPath +
                             "' is not a JSON object of token -> id (a "
                             "Hugging Face vocab.json)");
  for (auto &[token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max())
      throw std::runtime_error("vocabulary '" + vocabPath + "': the id of " +
                               nlohmann::json(token).dump(
                                   -1, ' ', false,
                                   nlohmann::json::error_handler_t::replace) +
                               " is not a non-negative 32-bit integer");
    int32_t value = id.get<int32_t>();
    bpe.vocab_[token] = value;
    bpe.vocabSize_ = std::max<int64_t>(bpe.vocabSize_, value + 1);
  }
  if (auto eot = bpe.vocab_.find("<|endoftext|>"); eot != bpe.vocab_.end())
    bpe.endOfText_ = eot->second;

  std::istringstream merges(readFile(mergesPath, "merges"));
  std::string line;
  int rank = 0, number = 0;
  while (std::getline(merges, line)) {
    number++;
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    if (line.empty() || (number == 1 && line.rfind("#version", 0) == 0))
      continue;
    size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      throw std::runtime_error("merges '" + mergesPath + "' line " +
                               std::to_string(number) +
                               ": expected two symbols separated by one space");
    bpe.ranks_.emplace(std::make_pair(line.substr(0, space),
                                      line.substr(space + 1)),
                       rank++);
  }

  // bytes_to_unicode: printable bytes stand for themselves, the others
  // for 256, 257, ... in byte order.
  int next = 256;
  for (int b = 0; b < 256; b++) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) ||
                     (b >= 0xae && b <= 0xff);
    bpe.byteSymbol_[b] = utf8(printable ? b : next++);
  }
  for (int b = 0; b < 256; b++)
    if (!bpe.vocab_.count(bpe.byteSymbol_[b]))
      throw std::runtime_error(
          "vocabulary '" + vocabPath + "' has no token for byte " +
          std::to_string(b) + " (a byte-level BPE vocabulary has all 256)");

  // The inverse of both maps: each id's bytes. A code point that stands for
  // no byte (in a token added by hand) is kept as its UTF-8.
  std::unordered_map<UChar32, char> symbolByte;
  for (int b = 0; b < 256; b++)
    symbolByte[codePoints(bpe.byteSymbol_[b])[0].c] = (char)b;
  bpe.tokenBytes_.resize(bpe.vocabSize_);
  for (const auto &[token, id] : bpe.vocab_) {
    std::string &bytes = bpe.tokenBytes_[id];
    for (const CodePoint &cp : codePoints(token)) {
      auto byte = symbolByte.find(cp.c);
      if (byte != symbolByte.end())
        bytes += byte->second;
      else
        bytes += token.substr(cp.begin, cp.end - cp.begin);
    }
  }
  return bpe;
}

std::string Gpt2Bpe::decode(const std::vector<int32_t> &ids) const {
  std::string bytes;
  for (int32_t id : ids)
    if (id >= 0 && id < (int64_t)tokenBytes_.size())
      bytes += tokenBytes_[id];
  return bytes;
}

void Gpt2Bpe::encodePiece(std::string_view piece, std::vector<int32_t> &out) {
  std::string key(piece);
  if (auto hit = cache_.find(key); hit != cache_.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  std::vector<std::string> word;
  for (unsigned char b : piece)
    word.push_back(byteSymbol_[b]);
  while (word.size() > 1) {
    // The pair of lowest rank; then every occurrence of it, left to right.
    int best = std::numeric_limits<int>::max();
    size_t at = 0;
    for (size_t k = 0; k + 1 < word.size(); k++) {
      auto r = ranks_.find({word[k], word[k + 1]});
      if (r != ranks_.end() && r->second < best) {
        best = r->second;
        at = k;
      }
    }
    if (best == std::numeric_limits<int>::max())
      break;
    std::string first = word[at], second = word[at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < word.size(); k++) {
      if (k + 1 < word.size() && word[k] == first && word[k + 1] == second) {
        merged.push_back(first + second);
        k++;
      } else {
        merged.push_back(word[k]);
      }
    }
    word = std::move(merged);
  }
  std::vector<int32_t> ids;
  for (const std::string &symbol : word) {
    auto id = vocab_.find(symbol);
    if (id == vocab_.end())
      throw std::runtime_error(
          "vocabulary '" + vocabPath_ + "' has no token " +
          nlohmann::json(symbol).dump(-1, ' ', false,
                                      nlohmann::json::error_handler_t::replace) +
          ", which its merges make");
    ids.push_back(id->second);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  cache_.emplace(std::move(key), std::move(ids));
}

void Gpt2Bpe::encode(std::string_view text, std::vector<int32_t> &out) {
  for (std::string_view piece : split(text))
    encodePiece(piece, out);
}

//===- Tokenizer.h - Byte-level and GPT-2 BPE tokenizers -------*- C++ -*-===//
//
// What `tessel data prepare` encodes text with and `tessel generate`
// decodes it with: one token per byte, or GPT-2's byte-level BPE read from
// a Hugging Face vocab.json and merges.txt (Radford et al. 2019; OpenAI's
// encoder.py is the reference): the text is split by GPT-2's pre-tokenizer
// pattern
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// (matched by hand over code points, classified by ICU as Python's regex
// module does: \p{L} and \p{N} by general category, \s as str.isspace),
// each piece's bytes are mapped to printable characters (bytes_to_unicode),
// and the merges are applied lowest rank first until none applies.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_TOOLS_TOKENIZER_H
#define TESSEL_TOOLS_TOKENIZER_H

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tessel {

class Gpt2Bpe {
public:
  // Reads vocab.json (token -> id) and merges.txt ("a b" per line, the
  // first line "#version..." skipped); throws std::runtime_error naming
  // the file and line on bad input.
  static Gpt2Bpe load(const std::string &vocabPath,
                      const std::string &mergesPath);

  // Appends the ids of `text` (UTF-8; invalid bytes are encoded as bytes).
  void encode(std::string_view text, std::vector<int32_t> &out);
  // The bytes of `ids`: each token's symbols mapped back through
  // bytes_to_unicode, as transformers' decode does ("<|endoftext|>" is its
  // own text). An id the vocabulary does not have (a model's vocabulary is
  // often padded past the tokenizer's) stands for no bytes. The bytes of
  // one token may be part of a UTF-8 sequence only.
  std::string decode(const std::vector<int32_t> &ids) const;
  // The id of "<|endoftext|>", or -1 when the vocabulary has none.
  int32_t endOfText() const { return endOfText_; }
  // One more than the largest id.
  int64_t vocabSize() const { return vocabSize_; }

  // GPT-2's pre-tokenizer: the pieces of `text`, in order.
  static std::vector<std::string_view> split(std::string_view text);

private:
  void encodePiece(std::string_view piece, std::vector<int32_t> &out);

  std::unordered_map<std::string, int32_t> vocab_;
  std::map<std::pair<std::string, std::string>, int> ranks_;
  std::string byteSymbol_[256]; // bytes_to_unicode, as UTF-8
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
  std::vector<std::string> tokenBytes_; // by id; "" for an id not in vocab_
  int32_t endOfText_ = -1;
  int64_t vocabSize_ = 0;
  std::string vocabPath_;
};

} // namespace tessel

#endif // TESSEL_TOOLS_TOKENIZER_H

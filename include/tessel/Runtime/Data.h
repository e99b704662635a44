//===- Data.h - Token files and the training batch rule ---------*- C++ -*-===//
//
// Token files use llm.c's format: a header of 256 int32 values, then the
// tokens. header[0] is the magic, header[1] the version, header[2] the token
// count. Magic 20240520 with version 1 stores uint16 tokens; magic 20240801
// with version 7 stores uint32 tokens.
//
// Megatron's indexed datasets are read too: PREFIX.bin (the documents'
// tokens, one after another) and PREFIX.idx ("MMIDIDX\0\0", version 1, the
// dtype code, the sequence and document counts, then the sequence lengths
// (int32), their byte offsets in the .bin (int64) and the document index
// (int64)). Their tokens, concatenated in order, are a token stream like an
// llm.c file's, and batches follow the same rule.
//
// Batches follow one fixed rule so that every rank and every reference
// implementation sees the same data: with nSamples = (N - 1) / T, sequence i
// of step s is sample j = (s * B + i) mod nSamples, its inputs are
// tokens[j*T, j*T+T) and its targets tokens[j*T+1, j*T+T+1).
//
// All errors are reported by throwing std::runtime_error.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_DATA_H
#define TESSEL_RUNTIME_DATA_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::rt {

constexpr int32_t kTokenMagicU16 = 20240520;
constexpr int32_t kTokenVersionU16 = 1;
constexpr int32_t kTokenMagicU32 = 20240801;
constexpr int32_t kTokenVersionU32 = 7;
constexpr int kTokenHeaderInts = 256;

// A validated, read-only sequence of tokens, either memory-mapped from a
// token file or held in memory. Every token is < vocab.
class TokenData {
public:
  // Maps and validates a token file: magic, version, token count against the
  // file size, and every token < vocab. Errors name the file (and, for a bad
  // token, its position). A Megatron dataset is named by its prefix, or its
  // .idx or .bin file.
  static TokenData fromFile(const std::string &path, int64_t vocab);
  // The Megatron dataset PREFIX.bin + PREFIX.idx.
  static TokenData fromMegatron(const std::string &prefix, int64_t vocab);
  // Shards read as one token stream, in the order given: llm.c files or
  // Megatron prefixes. Only their headers are read here; a shard is mapped
  // and checked when a batch first reaches it, so a corpus of any size
  // starts at once. fromFile takes a directory (its *.bin files and
  // Megatron prefixes, sorted by name) or a glob pattern the same way.
  static TokenData fromShards(std::vector<std::string> paths, int64_t vocab,
                              std::string name);
  // A blend (a JSON file {"blend": [{"path": P, "weight": W}, ...]}, which
  // fromFile takes for a path ending in .json): global sample g is drawn
  // from the dataset whose realised share of the first g draws is furthest
  // below its weight (Megatron's rule; ties to the first), and is that
  // dataset's next sample, so every dataset's share is within one sample of
  // its weight over any prefix.
  static TokenData fromBlend(const std::string &path, int64_t vocab);
  // The blend's draw of global sample g: the dataset and its sample index.
  std::pair<int64_t, int64_t> blendDraw(int64_t g) const;
  // Takes tokens held in memory; `name` is used in error messages.
  static TokenData fromTokens(std::vector<int32_t> tokens, int64_t vocab,
                              std::string name);

  TokenData(TokenData &&other) noexcept;
  TokenData &operator=(TokenData &&other) noexcept;
  TokenData(const TokenData &) = delete;
  TokenData &operator=(const TokenData &) = delete;
  ~TokenData();

  int64_t size() const { return count; }
  // Token i (of a single file or tokens in memory; shards: copyTokens).
  int32_t at(int64_t i) const {
    return width == 2   ? (int32_t)((const uint16_t *)base)[i]
           : width == 1 ? (int32_t)((const uint8_t *)base)[i]
                        : (int32_t)((const uint32_t *)base)[i];
  }
  const std::string &name() const { return source; }
  // What the data is, in words: "llm.c token file (uint16)", "Megatron
  // dataset (int32, 80 documents)", "3 shards", "blend of 2 datasets
  // (weights 0.25, 0.75)".
  const std::string &kind() const { return description; }

  // Number of distinct training sequences of length T: (N - 1) / T.
  int64_t numSamples(int64_t T) const;
  // Fills inputs and targets, each [B, T], for 0-based `step` with the rule
  // above. Throws when there are fewer than T + 1 tokens.
  void batchForStep(int64_t step, int64_t B, int64_t T, int32_t *inputs,
                    int32_t *targets) const;
  // Rows [first, first + rows) of step's global batch of B sequences (a
  // data-parallel rank's share).
  void rowsForStep(int64_t step, int64_t B, int64_t first, int64_t rows,
                   int64_t T, int32_t *inputs, int32_t *targets) const;
  // A data-parallel rank's share split into `chunks` microbatches: the
  // global batch is cut into `chunks` consecutive microbatches of B / chunks
  // rows, and the rank reads rows [first, first + rows) scaled down to each
  // (first / chunks, rows / chunks of them), so that a microbatch of all
  // ranks together is a microbatch of the one-rank program. One chunk:
  // rowsForStep.
  void microbatchRowsForStep(int64_t step, int64_t B, int64_t first,
                             int64_t rows, int64_t chunks, int64_t T,
                             int32_t *inputs, int32_t *targets) const;
  // The global row (within the step's batch) of the rank's i-th row.
  static int64_t microbatchRow(int64_t i, int64_t B, int64_t first,
                               int64_t rows, int64_t chunks);
  // Shuffled sampling (data.shuffle): global sample g = step * B + i is
  // sample permute(g mod n, n, seed, g / n) of the n samples, a permutation
  // of each epoch drawn from the seed and the epoch alone, so the order is
  // independent of the layout and a step is all a resume needs.
  void shuffle(uint64_t seed);
  // The sample that global sample g of the run reads.
  int64_t sampleOf(int64_t g, int64_t T) const;
  // What global sample g reads, as JSON: the sample's index in the token
  // stream, or [dataset, index] in a blend.
  std::string describeSample(int64_t g, int64_t T) const;
  // Tokens [start, start + n) into out, across shards.
  void copyTokens(int64_t start, int64_t n, int32_t *out) const;

private:
  TokenData() = default;
  void release();

  std::string source, description;
  const void *base = nullptr; // the tokens, uint16 or uint32
  int width = 4;              // bytes per token
  int64_t count = 0;
  void *mapping = nullptr; // mmap'ed file, or null
  size_t mappingBytes = 0;
  std::vector<uint32_t> owned; // tokens held in memory
  bool shuffled = false;
  uint64_t shuffleSeed = 0;
  // Shards: each one's path, first token and (once reached) its data.
  struct Shards;
  std::shared_ptr<Shards> shards;
  struct Blend;
  std::shared_ptr<Blend> blend;
};

// Reads the batches of the steps ahead on a background thread, so that the
// training thread does not wait for the data: at most `depth` batches (this
// rank's rows [first, first + rows) of each global batch of B, in `chunks`
// microbatches as microbatchRowsForStep reads them) wait in
// memory. get() must ask for steps in order from firstStep; it returns how
// long it waited, in milliseconds. depth 0 reads on the caller's thread
// (the wait is then the read). `delayMs` makes each read that much slower
// (a slow disk, for measuring the overlap).
class BatchPrefetcher {
public:
  BatchPrefetcher(const TokenData &data, int64_t B, int64_t first,
                  int64_t rows, int64_t T, int64_t firstStep,
                  int64_t lastStep, int depth, double delayMs = 0,
                  int64_t chunks = 1);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher &) = delete;
  BatchPrefetcher &operator=(const BatchPrefetcher &) = delete;
  double get(int64_t step, int32_t *inputs, int32_t *targets);

private:
  struct State;
  std::unique_ptr<State> state;
};

// A pseudo-random permutation of [0, n), one per (seed, epoch): a Feistel
// network over the smallest power of four >= n, cycle-walked into range.
// O(1) memory, so a corpus of any size shuffles without a table.
int64_t permute(int64_t index, int64_t n, uint64_t seed, int64_t epoch);

// Writes tokens as an llm.c token file: uint16 (magic 20240520, version 1)
// when every token is < 65536, else uint32 (magic 20240801, version 7).
// Writes a temporary file next to `path` and renames it into place, so a
// failed write never leaves a partial file. Tokens must be non-negative.
void writeTokenFile(const std::string &path,
                    const std::vector<int32_t> &tokens);

// Writes tokens as a Megatron indexed dataset, PREFIX.bin and PREFIX.idx
// (MMIDIDX version 1; uint16 when every token is < 65536, else int32), one
// sequence per document: document k is tokens [documentEnds[k-1],
// documentEnds[k]). Each file is written beside its place and renamed into
// it, the index last.
void writeMegatronDataset(const std::string &prefix,
                          const std::vector<int32_t> &tokens,
                          const std::vector<int64_t> &documentEnds);

// Byte-level tokenisation: each byte of `text` is one token in [0, 256).
std::vector<int32_t> encodeTextBytes(std::string_view text);

// Deterministic synthetic training text with learnable structure: a sparse
// random Markov chain over an alphabet of at most 256 token ids with
// Zipf-like frequencies (each token has three likely successors),
// interleaved with repeated phrases. A small model's loss falls from
// ln(vocab) to below ln(256) as it learns which tokens occur, and further
// as it learns their frequencies and transitions. The output
// depends only on (vocab, count, seed), on every machine.
std::vector<int32_t> syntheticTokens(int64_t vocab, int64_t count,
                                     uint64_t seed);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_DATA_H

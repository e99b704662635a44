//===- DataTest.cpp - Token files, batches and synthetic data -------------===//

#include "tessel/Runtime/Data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <stdexcept>

using namespace tessel::rt;

namespace {

std::string tempPath(const std::string &name) {
  return ::testing::TempDir() + "tessel_data_" + name;
}

// Writes a raw llm.c-style file with the given header fields and payload.
void writeRaw(const std::string &path, int32_t magic, int32_t version,
              int32_t count, const std::string &payload) {
  int32_t header[kTokenHeaderInts] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::ofstream f(path, std::ios::binary);
  f.write((const char *)header, sizeof(header));
  f.write(payload.data(), (std::streamsize)payload.size());
}

std::string u16Payload(const std::vector<uint16_t> &tokens) {
  return std::string((const char *)tokens.data(), tokens.size() * 2);
}

// Runs `fn`, expects a std::runtime_error and returns its message.
template <typename Fn> std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const std::runtime_error &e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

long fileSize(const std::string &path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  return (long)f.tellg();
}

} // namespace

TEST(RuntimeData, RoundTripUint16) {
  std::string path = tempPath("u16.bin");
  std::vector<int32_t> tokens = {0, 1, 2, 65535, 50256, 7, 7, 3};
  writeTokenFile(path, tokens);
  EXPECT_EQ(fileSize(path), 1024 + 2 * (long)tokens.size());
  TokenData data = TokenData::fromFile(path, 65536);
  ASSERT_EQ(data.size(), (int64_t)tokens.size());
  for (size_t i = 0; i < tokens.size(); i++)
    EXPECT_EQ(data.at(i), tokens[i]) << "position " << i;
}

TEST(RuntimeData, RoundTripUint32) {
  std::string path = tempPath("u32.bin");
  std::vector<int32_t> tokens = {0, 65536, 128000, 5, 1 << 20};
  writeTokenFile(path, tokens);
  EXPECT_EQ(fileSize(path), 1024 + 4 * (long)tokens.size());
  {
    std::ifstream f(path, std::ios::binary);
    int32_t header[3];
    f.read((char *)header, sizeof(header));
    EXPECT_EQ(header[0], kTokenMagicU32);
    EXPECT_EQ(header[1], kTokenVersionU32);
    EXPECT_EQ(header[2], 5);
  }
  TokenData data = TokenData::fromFile(path, 1 << 21);
  ASSERT_EQ(data.size(), 5);
  for (size_t i = 0; i < tokens.size(); i++)
    EXPECT_EQ(data.at(i), tokens[i]);
}

TEST(RuntimeData, WriteLeavesNoTemporaryFile) {
  std::string dir = ::testing::TempDir();
  std::string path = tempPath("clean.bin");
  writeTokenFile(path, {1, 2, 3});
  // Overwriting works and replaces the content.
  writeTokenFile(path, {4, 5});
  TokenData data = TokenData::fromFile(path, 10);
  ASSERT_EQ(data.size(), 2);
  EXPECT_EQ(data.at(0), 4);
  // Writing into a missing directory fails without creating anything.
  EXPECT_THROW(writeTokenFile(dir + "no_such_dir/x.bin", {1}),
               std::runtime_error);
  EXPECT_THROW(writeTokenFile(path, {1, -2}), std::runtime_error);
}

TEST(RuntimeData, BatchRuleExactSlices) {
  // 11 tokens, T = 3: nSamples = (11 - 1) / 3 = 3.
  std::vector<int32_t> tokens = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
  std::string path = tempPath("batch.bin");
  writeTokenFile(path, tokens);
  TokenData data = TokenData::fromFile(path, 100);
  EXPECT_EQ(data.numSamples(3), 3);

  const int64_t B = 2, T = 3;
  std::vector<int32_t> in(B * T), tgt(B * T);
  // Step 0: samples 0 and 1.
  data.batchForStep(0, B, T, in.data(), tgt.data());
  EXPECT_EQ(in, (std::vector<int32_t>{10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{11, 12, 13, 14, 15, 16}));
  // Step 1: samples 2 and (3 mod 3) = 0, wrapping around.
  data.batchForStep(1, B, T, in.data(), tgt.data());
  EXPECT_EQ(in, (std::vector<int32_t>{16, 17, 18, 10, 11, 12}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{17, 18, 19, 11, 12, 13}));
  // Step 5: samples 10 mod 3 = 1 and 11 mod 3 = 2.
  data.batchForStep(5, B, T, in.data(), tgt.data());
  EXPECT_EQ(in, (std::vector<int32_t>{13, 14, 15, 16, 17, 18}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{14, 15, 16, 17, 18, 19}));
  // A large step does not overflow: (2^40 * 2) mod 3 = 2.
  data.batchForStep(int64_t(1) << 40, B, T, in.data(), tgt.data());
  EXPECT_EQ(in[0], 16);
}

TEST(RuntimeData, BatchNeedsTPlusOneTokens) {
  TokenData exact = TokenData::fromTokens({1, 2, 3, 4}, 10, "mem");
  std::vector<int32_t> in(3), tgt(3);
  exact.batchForStep(7, 1, 3, in.data(), tgt.data());
  EXPECT_EQ(in, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{2, 3, 4}));

  TokenData shortData = TokenData::fromTokens({1, 2, 3}, 10, "short");
  EXPECT_EQ(shortData.numSamples(3), 0);
  std::string msg =
      errorOf([&] { shortData.batchForStep(0, 1, 3, in.data(), tgt.data()); });
  EXPECT_NE(msg.find("short"), std::string::npos) << msg;
}

TEST(RuntimeData, RejectsBadMagicAndVersion) {
  std::string path = tempPath("badmagic.bin");
  writeRaw(path, 12345, 1, 2, u16Payload({1, 2}));
  std::string msg = errorOf([&] { TokenData::fromFile(path, 10); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;

  writeRaw(path, kTokenMagicU16, 7, 2, u16Payload({1, 2}));
  msg = errorOf([&] { TokenData::fromFile(path, 10); });
  EXPECT_NE(msg.find("version"), std::string::npos) << msg;

  writeRaw(path, kTokenMagicU32, 1, 1, std::string(4, '\0'));
  EXPECT_THROW(TokenData::fromFile(path, 10), std::runtime_error);
}

TEST(RuntimeData, NamesTokensOfTheOtherWidth) {
  // uint32 tokens behind the uint16 header (and the other way round): an
  // error that says what the size fits, never tokens read at the wrong width.
  std::string path = tempPath("width.bin");
  std::vector<uint32_t> wide = {1, 2, 3};
  writeRaw(path, kTokenMagicU16, kTokenVersionU16, 3,
           std::string((const char *)wide.data(), wide.size() * 4));
  std::string msg = errorOf([&] { TokenData::fromFile(path, 10); });
  EXPECT_NE(msg.find("the size fits uint32 tokens"), std::string::npos) << msg;
  writeRaw(path, kTokenMagicU32, kTokenVersionU32, 4, u16Payload({1, 2, 3, 4}));
  msg = errorOf([&] { TokenData::fromFile(path, 10); });
  EXPECT_NE(msg.find("the size fits uint16 tokens"), std::string::npos) << msg;
}

TEST(RuntimeData, RejectsTruncatedAndOversizedFiles) {
  std::string path = tempPath("trunc.bin");
  // Header claims 4 tokens, only 3 present.
  writeRaw(path, kTokenMagicU16, 1, 4, u16Payload({1, 2, 3}));
  std::string msg = errorOf([&] { TokenData::fromFile(path, 10); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 tokens"), std::string::npos) << msg;
  // Extra bytes after the tokens.
  writeRaw(path, kTokenMagicU16, 1, 2, u16Payload({1, 2, 3}));
  EXPECT_THROW(TokenData::fromFile(path, 10), std::runtime_error);
  // Negative count.
  writeRaw(path, kTokenMagicU16, 1, -1, "");
  EXPECT_THROW(TokenData::fromFile(path, 10), std::runtime_error);
  // Shorter than the header.
  {
    std::ofstream f(path, std::ios::binary);
    f << "short";
  }
  EXPECT_THROW(TokenData::fromFile(path, 10), std::runtime_error);
  // Missing file.
  msg = errorOf([&] { TokenData::fromFile(tempPath("missing.bin"), 10); });
  EXPECT_NE(msg.find("missing.bin"), std::string::npos) << msg;
}

TEST(RuntimeData, RejectsTokensOutsideVocab) {
  std::string path = tempPath("vocab.bin");
  writeTokenFile(path, {1, 2, 9, 10, 3});
  EXPECT_NO_THROW(TokenData::fromFile(path, 11));
  std::string msg = errorOf([&] { TokenData::fromFile(path, 10); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 10"), std::string::npos) << msg;

  msg = errorOf([] { TokenData::fromTokens({0, 5, -1}, 10, "mem"); });
  EXPECT_NE(msg.find("position 2"), std::string::npos) << msg;
}

TEST(RuntimeData, EmptyFileHasNoSamples) {
  std::string path = tempPath("empty.bin");
  writeTokenFile(path, {});
  TokenData data = TokenData::fromFile(path, 10);
  EXPECT_EQ(data.size(), 0);
  EXPECT_EQ(data.numSamples(1), 0);
}

TEST(RuntimeData, EncodeTextBytes) {
  std::string text = "Hi!\n\xff";
  std::vector<int32_t> tokens = encodeTextBytes(text);
  EXPECT_EQ(tokens, (std::vector<int32_t>{72, 105, 33, 10, 255}));
}

TEST(RuntimeData, SyntheticIsDeterministicAndInRange) {
  std::vector<int32_t> a = syntheticTokens(50257, 4096, 1234);
  std::vector<int32_t> b = syntheticTokens(50257, 4096, 1234);
  std::vector<int32_t> c = syntheticTokens(50257, 4096, 1235);
  ASSERT_EQ(a.size(), 4096u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (int32_t t : a) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, 50257);
  }
  std::vector<int32_t> small = syntheticTokens(5, 1000, 1);
  for (int32_t t : small)
    ASSERT_TRUE(t >= 0 && t < 5);
  EXPECT_TRUE(syntheticTokens(10, 0, 1).empty());
  // A prefix of a longer stream is the shorter stream.
  std::vector<int32_t> longer = syntheticTokens(50257, 8192, 1234);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), longer.begin()));
}

TEST(RuntimeData, SyntheticGoldenValues) {
  // Pins the generator: these values must be the same on every machine.
  EXPECT_EQ(syntheticTokens(256, 8, 1234),
            (std::vector<int32_t>{220, 178, 11, 159, 218, 241, 149, 192}));
  uint64_t h = 1469598103934665603ull;
  for (int32_t v : syntheticTokens(50257, 1 << 16, 42))
    h = (h ^ (uint64_t)v) * 1099511628211ull;
  EXPECT_EQ(h, 0x53513a32b7148c3bull);
}

TEST(RuntimeData, SyntheticIsLearnable) {
  // The bigram conditional entropy must be far below ln(vocab): a model that
  // learns the transitions gets a much lower loss than uniform guessing.
  const int64_t vocab = 50257;
  std::vector<int32_t> t = syntheticTokens(vocab, 1 << 20, 1234);
  std::map<int32_t, std::map<int32_t, int64_t>> pairs;
  std::map<int32_t, int64_t> firsts;
  for (size_t i = 0; i + 1 < t.size(); i++) {
    pairs[t[i]][t[i + 1]]++;
    firsts[t[i]]++;
  }
  double entropy = 0;
  double n = (double)(t.size() - 1);
  for (const auto &[a, nexts] : pairs)
    for (const auto &[b, count] : nexts)
      entropy -= count / n * std::log((double)count / firsts[a]);
  EXPECT_LT(entropy, 0.5 * std::log(256.0));
  EXPECT_LE(firsts.size(), 256u);
}

namespace {

// The shuffle is a permutation of each epoch's samples, drawn from the seed
// and the epoch alone.
TEST(DataShuffle, EachEpochIsAPermutation) {
  for (int64_t n : {1, 2, 3, 7, 64, 100, 1000, 4097}) {
    for (int64_t epoch : {0, 1, 5}) {
      std::vector<int> seen(n, 0);
      for (int64_t i = 0; i < n; ++i) {
        int64_t j = tessel::rt::permute(i, n, 1234, epoch);
        ASSERT_GE(j, 0);
        ASSERT_LT(j, n);
        seen[j]++;
      }
      for (int64_t j = 0; j < n; ++j)
        ASSERT_EQ(seen[j], 1) << "n " << n << " epoch " << epoch;
    }
  }
  // Another epoch or seed is another order; the same is the same.
  int64_t n = 1000, moved = 0, reseeded = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(tessel::rt::permute(i, n, 7, 3), tessel::rt::permute(i, n, 7, 3));
    moved += tessel::rt::permute(i, n, 7, 0) != tessel::rt::permute(i, n, 7, 1);
    reseeded += tessel::rt::permute(i, n, 7, 0) != tessel::rt::permute(i, n, 8, 0);
  }
  EXPECT_GT(moved, n / 2);
  EXPECT_GT(reseeded, n / 2);
}

// A data-parallel rank's rows are the same sequences as the rows of the
// global batch, shuffled or not.
TEST(DataShuffle, RowsAreSlicesOfTheGlobalBatch) {
  std::vector<int32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = (int32_t)(i * 7919 % 251);
  for (bool shuffled : {false, true}) {
    tessel::rt::TokenData data =
        tessel::rt::TokenData::fromTokens(tokens, 256, "tokens");
    if (shuffled)
      data.shuffle(99);
    const int64_t B = 8, T = 16;
    for (int64_t step : {0, 3, 40, 1000}) {
      std::vector<int32_t> in(B * T), out(B * T), rin(2 * T), rout(2 * T);
      data.batchForStep(step, B, T, in.data(), out.data());
      for (int64_t first = 0; first < B; first += 2) {
        data.rowsForStep(step, B, first, 2, T, rin.data(), rout.data());
        EXPECT_TRUE(std::equal(rin.begin(), rin.end(), in.begin() + first * T));
        EXPECT_TRUE(std::equal(rout.begin(), rout.end(), out.begin() + first * T));
      }
    }
  }
}

} // namespace

namespace {

// Megatron's blending rule: over every prefix of the draws, each dataset's
// share is within one sample of its weight, and a dataset's draws take its
// samples in order.
TEST(DataBlend, SharesFollowTheWeightsOverEveryPrefix) {
  std::string dir = testing::TempDir();
  std::vector<int32_t> tokens(3000, 1);
  tessel::rt::writeTokenFile(dir + "/blend-a.bin", tokens);
  tessel::rt::writeTokenFile(dir + "/blend-b.bin", tokens);
  tessel::rt::writeTokenFile(dir + "/blend-c.bin", tokens);
  {
    std::ofstream f(dir + "/blend.json");
    f << "{\"blend\": [{\"path\": \"" << dir << "/blend-a.bin\", \"weight\": 2},"
      << " {\"path\": \"" << dir << "/blend-b.bin\", \"weight\": 5},"
      << " {\"path\": \"" << dir << "/blend-c.bin\", \"weight\": 3}]}";
  }
  tessel::rt::TokenData data =
      tessel::rt::TokenData::fromFile(dir + "/blend.json", 256);
  const double weights[3] = {0.2, 0.5, 0.3};
  int64_t counts[3] = {0, 0, 0};
  for (int64_t g = 0; g < 2000; ++g) {
    auto [d, index] = data.blendDraw(g);
    ASSERT_EQ(index, counts[d]) << "draw " << g;
    counts[d]++;
    for (int k = 0; k < 3; ++k)
      ASSERT_LE(std::abs(counts[k] - weights[k] * (g + 1)), 1.0)
          << "dataset " << k << " after " << g + 1 << " draws";
  }
  // Random access gives the same draws (a resume starts anywhere).
  EXPECT_EQ(data.blendDraw(1234), data.blendDraw(1234));
  auto late = data.blendDraw(1999);
  data.blendDraw(5);
  EXPECT_EQ(data.blendDraw(1999), late);
}

} // namespace

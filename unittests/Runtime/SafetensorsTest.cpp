//===- SafetensorsTest.cpp - Safetensors reading and writing --------------===//

#include "tessel/Runtime/Safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include <unistd.h>

using namespace tessel::rt;

namespace {

std::string tempPath(const std::string &name) {
  return ::testing::TempDir() + "tessel_st_" + name;
}

std::string readAll(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Writes a safetensors file from a JSON header text and raw data bytes.
void writeRawFile(const std::string &path, const std::string &header,
                  const std::string &data, int64_t lengthOverride = -1) {
  uint64_t length =
      lengthOverride >= 0 ? (uint64_t)lengthOverride : (uint64_t)header.size();
  std::ofstream f(path, std::ios::binary);
  for (int i = 0; i < 8; i++)
    f.put((char)(length >> (8 * i)));
  f << header << data;
}

std::string bytesOf(const void *p, size_t n) {
  return std::string((const char *)p, n);
}

template <typename Fn> std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const std::runtime_error &e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

} // namespace

TEST(RuntimeSafetensors, RoundTrip) {
  std::string path = tempPath("roundtrip.safetensors");
  std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.1f, 1e-30f, -0.0f};
  std::vector<float> b = {42.0f};
  writeSafetensors(path, {{"h.0.w", {2, 3}, a.data()}, {"bias", {1}, b.data()}},
                   {{"note", "hello"}});

  SafetensorsReader reader(path);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"bias", "h.0.w"}));
  EXPECT_EQ(reader.info("h.0.w").dtype, "F32");
  EXPECT_EQ(reader.info("h.0.w").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(reader.info("h.0.w").numel, 6);
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  EXPECT_EQ(reader.metadata().at("note"), "hello");
  std::vector<float> a2 = reader.read("h.0.w");
  ASSERT_EQ(a2.size(), a.size());
  EXPECT_EQ(std::memcmp(a2.data(), a.data(), a.size() * 4), 0);
  EXPECT_EQ(reader.read("bias"), b);

  // The file layout: 8-byte length, 8-aligned JSON, then the tensors in the
  // order given, bit for bit.
  std::string file = readAll(path);
  uint64_t length = 0;
  for (int i = 7; i >= 0; i--)
    length = (length << 8) | (unsigned char)file[i];
  EXPECT_EQ(length % 8, 0u);
  ASSERT_EQ(file.size(), 8 + length + 7 * 4);
  EXPECT_EQ(file.substr(8 + length),
            bytesOf(a.data(), 24) + bytesOf(b.data(), 4));
  std::string header = file.substr(8, length);
  EXPECT_NE(header.find("\"__metadata__\""), std::string::npos);
  EXPECT_NE(header.find("\"data_offsets\":[0,24]"), std::string::npos)
      << header;
}

TEST(RuntimeSafetensors, EmptyAndScalarTensors) {
  std::string path = tempPath("scalar.safetensors");
  float s = 7.0f;
  writeSafetensors(path, {{"scalar", {}, &s}, {"empty", {0, 4}, nullptr}});
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.info("scalar").numel, 1);
  EXPECT_EQ(reader.read("scalar"), std::vector<float>{7.0f});
  EXPECT_EQ(reader.info("empty").numel, 0);
  EXPECT_TRUE(reader.read("empty").empty());
}

TEST(RuntimeSafetensors, WriteRejectsDuplicatesAndLeavesNoFile) {
  std::string path = tempPath("dup.safetensors");
  std::remove(path.c_str());
  float x = 1;
  EXPECT_THROW(writeSafetensors(path, {{"a", {1}, &x}, {"a", {1}, &x}}),
               std::runtime_error);
  EXPECT_FALSE(std::ifstream(path).good());
  EXPECT_THROW(
      writeSafetensors(tempPath("nodir/x.safetensors"), {{"a", {1}, &x}}),
      std::runtime_error);
}

// The streaming writer writes, tensor by tensor, the bytes writeSafetensors
// writes at once; the file appears only at commit, and a writer given up
// (or given too few or too many tensors) leaves no file and no temporary.
TEST(RuntimeSafetensors, StreamingWriterMatchesAndCommitsAtomically) {
  std::string whole = tempPath("whole.safetensors");
  std::string streamed = tempPath("streamed.safetensors");
  std::remove(streamed.c_str());
  std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.1f, 1e-30f, -0.0f};
  float b = 42.0f;
  std::vector<SafetensorView> views = {{"h.0.w", {2, 3}, a.data()},
                                       {"bias", {}, &b},
                                       {"empty", {0, 4}, nullptr}};
  std::string prefix = writeSafetensors(whole, views, {{"steps", "3"}});
  std::vector<SafetensorView> names = views;
  for (SafetensorView &v : names)
    v.data = nullptr;
  {
    SafetensorsWriter writer(streamed, names, {{"steps", "3"}});
    writer.write(a.data());
    writer.write(&b);
    EXPECT_FALSE(std::ifstream(streamed).good());
    writer.write(nullptr);
    EXPECT_EQ(writer.commit(), prefix);
  }
  EXPECT_EQ(readAll(streamed), readAll(whole));

  std::string given = tempPath("given-up.safetensors");
  std::remove(given.c_str());
  {
    SafetensorsWriter writer(given, names);
    writer.write(a.data());
    EXPECT_NE(
        errorOf([&] { writer.commit(); }).find("2 of its tensors missing"),
        std::string::npos);
  }
  {
    SafetensorsWriter writer(given, names);
    writer.write(a.data());
  }
  EXPECT_FALSE(std::ifstream(given).good());
  EXPECT_NE(errorOf([&] {
              SafetensorsWriter writer(given, names);
              writer.write(a.data());
              writer.write(nullptr);
            }).find("tensor 'bias' has no data"),
            std::string::npos);
  {
    SafetensorsWriter writer(given, {names[0]});
    writer.write(a.data());
    EXPECT_NE(errorOf([&] {
                writer.write(a.data());
              }).find("more tensors than its header lists"),
              std::string::npos);
  }
  EXPECT_FALSE(std::ifstream(given).good());
  EXPECT_FALSE(
      std::ifstream(given + ".tmp." + std::to_string(::getpid())).good());
}

TEST(RuntimeSafetensors, HalfDecoding) {
  EXPECT_EQ(halfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(halfToFloat(0xC000), -2.0f);
  EXPECT_EQ(halfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(halfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(halfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(halfToFloat(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(halfToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_TRUE(std::signbit(halfToFloat(0x8000)));
  EXPECT_EQ(halfToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(halfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(halfToFloat(0x7E00)));

  EXPECT_EQ(bfloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(bfloat16ToFloat(0xC040), -3.0f);
  EXPECT_EQ(bfloat16ToFloat(0x4049), 3.140625f);
  EXPECT_TRUE(std::isnan(bfloat16ToFloat(0x7FC0)));
}

TEST(RuntimeSafetensors, ReadsF16BF16F64) {
  std::string path = tempPath("dtypes.safetensors");
  uint16_t f16[3] = {0x3C00, 0xC000, 0x3800}; // 1, -2, 0.5
  uint16_t bf16[2] = {0x3F80, 0xC040};        // 1, -3
  double f64[2] = {0.1, -1e10};
  std::string data = bytesOf(f16, 6) + bytesOf(bf16, 4) + std::string(6, '\0') +
                     bytesOf(f64, 16);
  std::string header =
      R"({"a":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
      R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[6,10]},)"
      R"("c":{"dtype":"F64","shape":[2],"data_offsets":[16,32]}})";
  writeRawFile(path, header, data);
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.read("a"), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  EXPECT_EQ(reader.read("b"), (std::vector<float>{1.0f, -3.0f}));
  EXPECT_EQ(reader.read("c"), (std::vector<float>{0.1f, -1e10f}));
  EXPECT_TRUE(reader.metadata().empty());
}

TEST(RuntimeSafetensors, NonFloatDtypeFailsOnlyWhenRead) {
  std::string path = tempPath("int.safetensors");
  int64_t ids[2] = {1, 2};
  float w = 3.0f;
  writeRawFile(path,
               R"({"mask":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
               R"("w":{"dtype":"F32","shape":[],"data_offsets":[16,20]}})",
               bytesOf(ids, 16) + bytesOf(&w, 4));
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.read("w"), std::vector<float>{3.0f});
  std::string msg = errorOf([&] { reader.read("mask"); });
  EXPECT_NE(msg.find("'mask'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("I64"), std::string::npos) << msg;
  EXPECT_THROW(reader.info("nope"), std::runtime_error);
}

TEST(RuntimeSafetensors, RejectsCorruptFiles) {
  std::string path = tempPath("corrupt.safetensors");
  std::string good =
      R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string data(8, '\0');

  writeRawFile(path, good, data);
  EXPECT_NO_THROW(SafetensorsReader{path});

  // Header length beyond the end of the file.
  writeRawFile(path, good, data, 1 << 20);
  std::string msg = errorOf([&] { SafetensorsReader r(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("header length"), std::string::npos) << msg;

  // Truncated data region.
  writeRawFile(path, good, std::string(5, '\0'));
  msg = errorOf([&] { SafetensorsReader r(path); });
  EXPECT_NE(msg.find("'x'"), std::string::npos) << msg;

  // Offsets that disagree with dtype * shape.
  writeRawFile(
      path, R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data);
  msg = errorOf([&] { SafetensorsReader r(path); });
  EXPECT_NE(msg.find("'x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs 12"), std::string::npos) << msg;

  // Unknown dtype names the tensor.
  writeRawFile(path,
               R"({"weird":{"dtype":"F13","shape":[2],"data_offsets":[0,8]}})",
               data);
  msg = errorOf([&] { SafetensorsReader r(path); });
  EXPECT_NE(msg.find("'weird'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("F13"), std::string::npos) << msg;

  // Overlapping tensors.
  writeRawFile(path,
               R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
               data);
  EXPECT_THROW(SafetensorsReader{path}, std::runtime_error);

  // Broken JSON, wrong types, a file too short for the length field.
  writeRawFile(path, "{\"x\": [", data);
  EXPECT_THROW(SafetensorsReader{path}, std::runtime_error);
  writeRawFile(path, "[1, 2]", data);
  EXPECT_THROW(SafetensorsReader{path}, std::runtime_error);
  writeRawFile(
      path, R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data);
  EXPECT_THROW(SafetensorsReader{path}, std::runtime_error);
  writeRawFile(path, R"({"x":{"dtype":"F32","shape":[2]}})", data);
  EXPECT_THROW(SafetensorsReader{path}, std::runtime_error);
  {
    std::ofstream f(path, std::ios::binary);
    f << "abc";
  }
  EXPECT_THROW(SafetensorsReader{path}, std::runtime_error);
  EXPECT_THROW(SafetensorsReader{tempPath("missing.safetensors")},
               std::runtime_error);
}

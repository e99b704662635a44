//===- CheckpointTest.cpp - Boxes, manifests and checksums ----------------===//

#include "tessel/Runtime/Checkpoint.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <zlib.h>

using namespace tessel::rt;

namespace {

// A [4, 5, 6] tensor whose element at (i, j, k) is i * 100 + j * 10 + k.
float at(int64_t i, int64_t j, int64_t k) { return i * 100 + j * 10 + k; }

std::vector<float> fill(const Box &box) {
  std::vector<float> data;
  for (int64_t i = 0; i < box.sizes[0]; i++)
    for (int64_t j = 0; j < box.sizes[1]; j++)
      for (int64_t k = 0; k < box.sizes[2]; k++)
        data.push_back(at(box.offsets[0] + i, box.offsets[1] + j,
                          box.offsets[2] + k));
  return data;
}

// Boxes cut along one dimension and read back along another rebuild every
// element once.
TEST(Checkpoint, IntersectionsRebuildATensorCutAnotherWay) {
  Box whole{{0, 0, 0}, {4, 5, 6}};
  std::vector<Box> saved = {{{0, 0, 0}, {4, 5, 2}},
                            {{0, 0, 2}, {4, 5, 2}},
                            {{0, 0, 4}, {4, 5, 2}}};
  for (int64_t half = 0; half < 2; half++) {
    Box want{{half * 2, 1, 0}, {2, 4, 6}};
    std::vector<float> out(want.numel(), -1.0f);
    int64_t copied = 0;
    for (const Box &b : saved)
      copied += copyIntersection(b, fill(b).data(), want, out.data());
    EXPECT_EQ(copied, want.numel());
    EXPECT_EQ(out, fill(want));
  }
  // Disjoint boxes copy nothing.
  std::vector<float> out(whole.numel());
  Box a{{0, 0, 0}, {1, 5, 6}}, b{{1, 0, 0}, {1, 5, 6}};
  EXPECT_EQ(copyIntersection(a, fill(a).data(), b, out.data()), 0);
}

TEST(Checkpoint, OneDimensionalAndScalarBoxes) {
  Box from{{3}, {5}}, to{{5}, {6}};
  std::vector<float> src = {3, 4, 5, 6, 7}, dst(6, -1.0f);
  EXPECT_EQ(copyIntersection(from, src.data(), to, dst.data()), 3);
  EXPECT_EQ(dst, (std::vector<float>{5, 6, 7, -1, -1, -1}));
  float x = 2.5f, y = 0.0f;
  EXPECT_EQ(copyIntersection(Box{}, &x, Box{}, &y), 1);
  EXPECT_EQ(y, 2.5f);
}

// Every range [lo, hi) of a [4, 5, 6] tensor, as boxes: their row-major
// data, one after another, are the range's elements in order, and there are
// at most 2 * rank - 1 of them.
TEST(Checkpoint, FlatRangesAreFewBoxesInOrder) {
  const std::vector<int64_t> shape = {4, 5, 6};
  Box whole{{0, 0, 0}, shape};
  std::vector<float> all = fill(whole);
  for (int64_t lo = 0; lo <= 120; lo++)
    for (int64_t hi = lo; hi <= 120; hi++) {
      std::vector<Box> boxes = flatRangeBoxes(shape, lo, hi);
      std::vector<float> got;
      for (const Box &b : boxes) {
        ASSERT_GT(b.numel(), 0);
        std::vector<float> data = fill(b);
        got.insert(got.end(), data.begin(), data.end());
      }
      ASSERT_EQ(got, std::vector<float>(all.begin() + lo, all.begin() + hi))
          << "range [" << lo << ", " << hi << ")";
      ASSERT_LE(boxes.size(), 5u);
    }
  // Whole rows and slabs are one box each.
  EXPECT_EQ(flatRangeBoxes(shape, 30, 90).size(), 1u);
  EXPECT_EQ(flatRangeBoxes(shape, 6, 24).size(), 1u);
  EXPECT_EQ(flatRangeBoxes({7}, 2, 5).size(), 1u);
  EXPECT_EQ(flatRangeBoxes({7}, 2, 5)[0].offsets, std::vector<int64_t>{2});
}

TEST(Checkpoint, FileCrcIsZlibs) {
  std::string path = testing::TempDir() + "/tessel-crc-test.bin";
  std::string text = "123456789";
  std::ofstream(path, std::ios::binary) << text;
  int64_t bytes = 0;
  EXPECT_EQ(fileCrc32(path, &bytes), 0xcbf43926u); // the CRC-32 check value
  EXPECT_EQ(bytes, 9);
  std::remove(path.c_str());
  EXPECT_THROW(fileCrc32(path), std::runtime_error);
}

// A manifest that lists a file its tensors do not name, or a box outside
// the tensor, is refused naming the file.
TEST(Checkpoint, MalformedManifestsAreRefused) {
  std::string dir = testing::TempDir() + "/tessel-manifest-test";
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string &text) {
    std::ofstream(dir + "/manifest.json") << text;
  };
  const char *head = R"({"format": "tessel-checkpoint", "version": 1,
      "step": 2, "consumed_samples": 16, "loss": 1.5, "layout": "dp=2",
      "files": {"rank-00000.safetensors": {"bytes": 10, "crc32": "0a"}},)";
  write(std::string(head) + R"("tensors": {"w": {"shape": [4],
      "boxes": [{"file": "rank-00000.safetensors", "key": "w@0",
                 "offsets": [0], "sizes": [4]}]}}})");
  CheckpointManifest m = readManifest(dir);
  EXPECT_EQ(m.step, 2);
  EXPECT_EQ(m.files["rank-00000.safetensors"].second, 10u);
  write(std::string(head) + R"("tensors": {"w": {"shape": [4],
      "boxes": [{"file": "rank-00001.safetensors", "key": "w@0",
                 "offsets": [0], "sizes": [4]}]}}})");
  EXPECT_THROW(readManifest(dir), std::runtime_error);
  write(std::string(head) + R"("tensors": {"w": {"shape": [4],
      "boxes": [{"file": "rank-00000.safetensors", "key": "w@0",
                 "offsets": [2], "sizes": [4]}]}}})");
  try {
    readManifest(dir);
    FAIL() << "a box outside its tensor was accepted";
  } catch (const std::runtime_error &e) {
    EXPECT_NE(std::string(e.what()).find("lies outside its shape"),
              std::string::npos);
  }
  // Files are a rank's here or an earlier step's (incremental saves), and
  // nothing else: no path outside the checkpoint directory is read.
  for (const char *file : {"../etc/rank-00000.safetensors",
                           "../../step-00000002/rank-00000.safetensors",
                           "rank-00000.safetensors/../../x", "manifest.json"}) {
    write(std::string(R"({"format": "tessel-checkpoint", "version": 1,
        "step": 2, "consumed_samples": 16, "loss": 1.5, "layout": "dp=2",
        "files": {")") + file + R"(": {"bytes": 10, "crc32": "0a"}},
        "tensors": {}})");
    EXPECT_THROW(readManifest(dir), std::runtime_error) << file;
  }
  write(std::string(head) + R"("tensors": {}})");
  write(R"({"format": "tessel-checkpoint", "version": 1, "step": 4,
      "consumed_samples": 32, "loss": 1.5, "layout": "dp=2",
      "files": {"../step-00000002/rank-00001.safetensors":
                {"bytes": 10, "crc32": "0a"}}, "tensors": {}})");
  EXPECT_EQ(readManifest(dir).files.size(), 1u);
  write("{\"format\": \"something else\"}");
  EXPECT_THROW(readManifest(dir), std::runtime_error);
  std::filesystem::remove_all(dir);
}

} // namespace

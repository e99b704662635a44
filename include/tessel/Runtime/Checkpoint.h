//===- Checkpoint.h - Sharded, committed training checkpoints ---*- C++ -*-===//
//
// A checkpoint is a directory CKPT_DIR/step-NNNNNNNN/ holding one
// safetensors file per writing rank (rank-RRRRR.safetensors) and a
// manifest.json that lists every tensor's global shape and the boxes
// (offsets, sizes) each file holds of it, with each file's size and CRC-32.
// Every box of a tensor is written by exactly one rank: replicas (data
// parallel copies, tensors no axis splits) are written once, by the replicas
// in turn, so that writing is spread over them.
//
// Commit protocol: each rank writes its file (temporary name, fsync,
// rename); then, collectively, rank 0 gathers the files' records, writes
// the manifest (temporary name, fsync, rename, directory fsync) and points
// CKPT_DIR/latest at the directory the same way. A directory without a
// manifest is not a checkpoint. Writing runs on a background thread; the
// commit happens at the first step boundary where every rank's write has
// finished. A failed write on any rank fails the run on every rank, and the
// checkpoint is not committed.
//
// Loading reads, on each rank, only the boxes that meet its own shards, so
// a checkpoint saved at any layout of the same model resumes at any other.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_CHECKPOINT_H
#define TESSEL_RUNTIME_CHECKPOINT_H

#include "tessel/Runtime/Safetensors.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace tessel::rt {

// A box of a global tensor.
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t numel() const;
};

// Copies the elements of box `from` (data row-major over its sizes) that lie
// in box `to` into toData (row-major over to's sizes); returns how many.
int64_t copyIntersection(const Box &from, const float *fromData, const Box &to,
                         float *toData);

// Elements [lo, hi) of a tensor of `shape`, in row-major order, as boxes
// whose row-major data, one after another, are those elements in order: at
// most 2 * rank - 1 of them (a partial row, whole rows or slabs, a partial
// row), none when lo >= hi. How a piece of a flattened run (ZeRO's shards)
// is stored as boxes.
std::vector<Box> flatRangeBoxes(const std::vector<int64_t> &shape, int64_t lo,
                                int64_t hi);

// One box of a tensor that this rank writes.
struct CheckpointPiece {
  std::string tensor;
  std::vector<int64_t> shape; // the global shape
  Box box;
  std::vector<float> data; // row-major over box.sizes
};

// What a checkpoint records besides the tensors.
struct CheckpointInfo {
  int64_t step = 0;             // steps trained
  int64_t updates = 0;          // of which applied (--skip-nonfinite)
  int64_t consumedSamples = 0;  // sequences read (step * global batch)
  double loss = 0;              // the loss of the last step
  std::string program, layout;  // program name, mesh ("dp2 x tp2")
  int64_t worldSize = 1;
  std::map<std::string, std::string> config; // the training settings
  // The plan's "model", "train" and "data" sections (JSON text; empty when
  // the program runs without its plan.json).
  std::string model, train, data;
};

// Retention: keep the last `keepLast` checkpoints and every checkpoint whose
// step is a multiple of `keepEvery` (0: none besides the last).
struct Retention {
  int64_t keepLast = 0; // 0: keep every checkpoint
  int64_t keepEvery = 0;
};

class CheckpointWriter {
public:
  CheckpointWriter(std::string root, Retention retention);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter &) = delete;
  CheckpointWriter &operator=(const CheckpointWriter &) = delete;

  // Collective. Completes a write in flight (waiting for it), then starts
  // writing this rank's pieces of the checkpoint at info.step in the
  // background.
  void begin(const CheckpointInfo &info, std::vector<CheckpointPiece> pieces);
  // Collective, at a step boundary: commits the write in flight if every
  // rank has finished it (or, with `wait`, once they have). Returns the
  // step committed, or -1.
  int64_t poll(bool wait);
  bool pending() const { return writing; }
  // The pieces of the last committed checkpoint, handed back so that the
  // next snapshot reuses their memory (already paged in) instead of
  // allocating it afresh.
  std::vector<CheckpointPiece> recycle() { return std::move(spare); }
  // The committed checkpoint directory of the last commit, this rank's
  // file's bytes in it and the seconds its background write took.
  const std::string &lastCommitted() const { return committed; }
  int64_t lastBytes() const { return fileBytes; }
  double lastWriteSeconds() const { return writeSeconds; }

private:
  void commit();

  std::string root;
  Retention retention;
  CheckpointInfo info;
  std::vector<CheckpointPiece> pieces, spare;
  std::thread writer;
  std::atomic<bool> done{false};
  bool writing = false;
  // Written by the writer thread, read after it finished.
  std::string error, fileName;
  int64_t fileBytes = 0;
  uint32_t fileCrc = 0;
  double writeSeconds = 0;
  std::string committed;
  // Incremental saves: where each box of the last committed checkpoint
  // lies (its file relative to the root, that file's size and CRC-32, the
  // box's CRC-32), by key; a box whose contents are unchanged is referenced
  // there instead of written again.
  struct Stored {
    std::string file;
    int64_t fileBytes = 0;
    uint32_t fileCrc = 0, boxCrc = 0;
  };
  std::map<std::string, Stored> stored;
  // Per piece of the write in flight: its CRC-32 and, when unchanged, the
  // box it refers to.
  std::vector<uint32_t> pieceCrc;
  std::vector<const Stored *> reused;
};

// A committed checkpoint, parsed.
struct CheckpointManifest {
  std::string dir; // the step directory
  int64_t step = 0, consumedSamples = 0;
  int64_t updates = 0; // the updates applied in `step` steps
  double loss = 0;
  std::string layout;
  std::string model, train; // JSON text, "" when the manifest has none
  std::string tesselVersion;
  struct Source {
    std::string file, key;
    Box box;
  };
  struct Tensor {
    std::vector<int64_t> shape;
    std::vector<Source> boxes;
  };
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::pair<int64_t, uint32_t>> files; // bytes, crc
  // The files readCheckpointBox opened, kept open (mapped) while the
  // manifest lives, so that each file's header is read once however many
  // boxes are read from it (shared by copies of the manifest).
  std::shared_ptr<std::map<std::string, std::unique_ptr<SafetensorsReader>>>
      opened = std::make_shared<
          std::map<std::string, std::unique_ptr<SafetensorsReader>>>();
};

// The step of a directory named step-N (N decimal digits), or -1.
int64_t checkpointStepOf(const std::string &dirName);
// Whether `path` names a checkpoint directory: a step directory (with a
// manifest) or a root holding step directories or a `latest` pointer.
bool isCheckpointDirectory(const std::string &path);
// The committed step directories under `path` to try, newest first (by
// step; `path` alone when it is a step directory). Throws when there is
// none.
std::vector<std::string> committedCheckpoints(const std::string &path);
// Parses dir/manifest.json; throws naming the file and field when it is
// malformed.
CheckpointManifest readManifest(const std::string &dir);
// Checks the size and CRC-32 of `file` (a file of the manifest); returns
// "" or what is wrong.
std::string verifyCheckpointFile(const CheckpointManifest &manifest,
                                 const std::string &file);
// Fills `out` (row-major over `want`) with tensor `name`'s elements in box
// `want`, reading only the files whose boxes meet it. Throws when the
// manifest lacks the tensor, its shape differs from `shape`, or its boxes
// do not cover `want`.
void readCheckpointBox(const CheckpointManifest &manifest,
                       const std::string &name,
                       const std::vector<int64_t> &shape, const Box &want,
                       float *out);

// Whether every rank says yes (an all-reduce of one flag over the world, not
// counted as the step's traffic).
bool everyRank(bool yes);

// A whole file's text; throws naming it when it cannot be read.
std::string readTextFile(const std::string &path);

// CRC-32 (zlib's) of a file's bytes; throws when it cannot be read.
uint32_t fileCrc32(const std::string &path, int64_t *bytes = nullptr);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_CHECKPOINT_H

//===- main.cpp - CUDA kernel tests: run on a GPU, skipped without --------===//
//
// Exits with 77 (ctest's SKIP_RETURN_CODE) when no CUDA device is present,
// so a machine without a GPU reports the tests as skipped, not passed.
//
//===----------------------------------------------------------------------===//

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char **argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: the CUDA kernel tests are skipped\n");
    return 77;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

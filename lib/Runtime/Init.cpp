//===- Init.cpp - Deterministic parameter initialisation ------------------===//

#include "tessel/Runtime/Init.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace tessel::rt {

uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t hashName(const char *name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const char *c = name; *c; c++) {
    h ^= (unsigned char)*c;
    h *= 0x100000001B3ull;
  }
  return mix64(h);
}

double normalSample(uint64_t seed, uint64_t nameHash, int64_t index) {
  uint64_t key = mix64(mix64(mix64(seed) ^ nameHash) ^ (uint64_t)index);
  uint64_t a = mix64(key ^ 0x243F6A8885A308D3ull);
  uint64_t b = mix64(key ^ 0x13198A2E03707344ull);
  // u1 in (0, 1] so that log(u1) is finite; u2 in [0, 1).
  double u1 = (double)((a >> 11) + 1) * 0x1.0p-53;
  double u2 = (double)(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

void initRange(const char *name, InitKind kind, float mean, float std,
               uint64_t seed, int64_t begin, int64_t count, float *out) {
  switch (kind) {
  case InitKind::Zeros:
  case InitKind::Ones: {
    float value = kind == InitKind::Ones ? 1.0f : 0.0f;
    for (int64_t i = 0; i < count; i++)
      out[i] = value;
    return;
  }
  case InitKind::Normal: {
    uint64_t nameHash = hashName(name);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++)
      out[i] = (float)((double)mean +
                       (double)std * normalSample(seed, nameHash, begin + i));
    return;
  }
  }
  throw std::runtime_error(std::string("parameter '") + name +
                           "' has an unknown init kind " +
                           std::to_string((int)kind));
}

void initParam(const ParamInfo &param, uint64_t seed, float *out) {
  initRange(param.name, param.init, param.initMean, param.initStd, seed, 0,
            param.numel, out);
}

} // namespace tessel::rt

//===- Init.h - Deterministic parameter initialisation ----------*- C++ -*-===//
//
// Initialisation is counter-based: element i of parameter `name` depends
// only on (seed, hash(name), i), so any element, or any shard of a
// parameter, can be generated independently and every rank layout and thread
// count produces the same values.
//
//   key = splitmix64 chain of seed, hashName(name) and i
//   u1, u2 = two uniforms in (0, 1] and [0, 1) from the key
//   z = sqrt(-2 ln u1) * cos(2 pi u2)          (Box-Muller, in double)
//   value = (float)(mean + std * z)
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_INIT_H
#define TESSEL_RUNTIME_INIT_H

#include "tessel/Runtime/Program.h"

#include <cstdint>

namespace tessel::rt {

// splitmix64's finalising mix (also the data shuffle's round function).
uint64_t mix64(uint64_t z);

// 64-bit FNV-1a of the name, finished with a splitmix64 mix.
uint64_t hashName(const char *name);

// A standard normal sample for element `index` of the parameter whose name
// hashes to `nameHash`.
double normalSample(uint64_t seed, uint64_t nameHash, int64_t index);

// Writes elements [begin, begin + count) of a parameter into out[0, count):
// mean + std * normalSample(...) for Normal, 0 for Zeros, 1 for Ones.
void initRange(const char *name, InitKind kind, float mean, float std,
               uint64_t seed, int64_t begin, int64_t count, float *out);

// Initialises the whole parameter into out[0, param.numel).
void initParam(const ParamInfo &param, uint64_t seed, float *out);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_INIT_H

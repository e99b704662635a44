//===- Embedding.cpp - Table lookup and its scatter-add gradient ----------===//
//
// The backward pass gives each thread a range of table rows; every thread
// scans all ids in ascending order and adds only the rows it owns. Each
// dtable row thus receives its contributions in ascending i, whatever the
// number of threads. Ids are assumed to lie in [0, V).
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tessel::rt {

template <typename T>
void embeddingForward(const T *table, const int32_t *ids, T *out, int64_t n,
                      int64_t V, int64_t C) {
  (void)V;
#pragma omp parallel for schedule(static) if (n * C >= (1 << 15))
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + i * C, table + int64_t(ids[i]) * C,
                size_t(C) * sizeof(T));
}

template <typename T>
void embeddingBackward(const int32_t *ids, const T *dout, T *dtable, int64_t n,
                       int64_t V, int64_t C) {
  embeddingBackwardAccumulate(ids, dout, dtable, /*first=*/true, n, V, C);
}

template <typename T>
void embeddingBackwardAccumulate(const int32_t *ids, const T *dout, T *dtable,
                                 bool first, int64_t n, int64_t V, int64_t C) {
  if (V <= 0 || C <= 0)
    return;
  const bool par = (n + V) * C >= (1 << 15);
#pragma omp parallel if (par)
  {
    int nThreads = 1, tid = 0;
#ifdef _OPENMP
    nThreads = omp_get_num_threads();
    tid = omp_get_thread_num();
#endif
    const int64_t v0 = V * tid / nThreads;
    const int64_t v1 = V * (tid + 1) / nThreads;
    if (first)
      std::memset(dtable + v0 * C, 0, size_t((v1 - v0) * C) * sizeof(T));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = ids[i];
      if (id < v0 || id >= v1)
        continue;
      T *dst = dtable + id * C;
      const T *src = dout + i * C;
      for (int64_t j = 0; j < C; ++j)
        dst[j] += src[j];
    }
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void embeddingForward<T>(const T *, const int32_t *, T *, int64_t,  \
                                    int64_t, int64_t);                         \
  template void embeddingBackward<T>(const int32_t *, const T *, T *, int64_t, \
                                     int64_t, int64_t);                        \
  template void embeddingBackwardAccumulate<T>(                                \
      const int32_t *, const T *, T *, bool, int64_t, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt

//===- BufferRegion.h - The part of a store a placed buffer covers -*- C++
//-*-===//
//
// After tessel-plan-memory every buffer is a place in one of a program's
// stores (rt.buffer, possibly through rt.view): passes that move ops across
// parts compare those places to know what an op reads or writes.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_TRANSFORMS_BUFFERREGION_H
#define TESSEL_TRANSFORMS_BUFFERREGION_H

#include "dialects/Rt/RtOps.h"

#include <optional>

namespace tessel {

// The part of a store a buffer covers, in the store's units (bytes in the
// arena, the received and the transient spaces; elements elsewhere).
struct BufferRegion {
  rtir::Space space;
  int64_t begin, end;
  bool operator==(const BufferRegion &o) const {
    return space == o.space && begin == o.begin && end == o.end;
  }
  bool overlaps(const BufferRegion &o) const {
    return space == o.space && begin < o.end && o.begin < end;
  }
};

inline std::optional<BufferRegion> regionOf(mlir::Value v) {
  while (auto view = v.getDefiningOp<rtir::ViewOp>())
    v = view.getSource();
  auto buffer = v.getDefiningOp<rtir::BufferOp>();
  if (!buffer)
    return std::nullopt;
  int64_t size = rtir::elementsOf(buffer.getBuffer());
  rtir::Space space = buffer.getSpace();
  if (space == rtir::Space::Arena || space == rtir::Space::Received ||
      space == rtir::Space::Transient)
    size *= rtir::elementBytesOf(buffer.getBuffer());
  int64_t offset = buffer.getOffset();
  return BufferRegion{space, offset, offset + size};
}

// Whether an operand of `op` (or of an op nested in it) covers part of
// `region`.
inline bool touches(mlir::Operation *op, const BufferRegion &region) {
  bool any = false;
  op->walk([&](mlir::Operation *inner) {
    for (mlir::Value v : inner->getOperands())
      if (auto r = regionOf(v); r && r->overlaps(region))
        any = true;
    return any ? mlir::WalkResult::interrupt() : mlir::WalkResult::advance();
  });
  return any;
}

} // namespace tessel

#endif // TESSEL_TRANSFORMS_BUFFERREGION_H

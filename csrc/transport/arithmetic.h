// The host collectives' arithmetic: one rank's values combined with a received segment, element
// by element, for every dtype and reduction op of the frames (frame.h). The ring (ring.cc)
// calls it once per received reduce-scatter segment.
#pragma once

#include <cstdint>

#include "csrc/common/status.h"
#include "csrc/transport/frame.h"

namespace dtenjax::transport {

// out[i] = own[i] (op) in[i] (out may alias own). Sum/prod are commutative in IEEE arithmetic,
// so every rank that combines the same two values gets the same bits. max/min propagate NaN.
Status Reduce(void* out, const void* own, const void* in, uint64_t count, DType dt, ReduceOp op);

}  // namespace dtenjax::transport

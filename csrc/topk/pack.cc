#include "csrc/topk/pack.h"

#include <cmath>
#include <limits>
#include <string>

namespace dtenjax::compress {

Status PackAboveThreshold(const float* x, int64_t n, float threshold, int64_t k, int32_t* idx,
                          float* val, int32_t* count) {
  DTENJAX_CHECK_ARG(n >= 0 && n <= std::numeric_limits<int32_t>::max(),
                    "topk pack: n=" + std::to_string(n) + " does not fit int32 indices");
  DTENJAX_CHECK_ARG(k >= 0, "topk pack: k must be >= 0, got " + std::to_string(k));
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (std::fabs(v) >= threshold) {  // false for NaN
      if (c < k) {
        idx[c] = static_cast<int32_t>(i);
        val[c] = v;
      }
      ++c;
    }
  }
  for (int64_t j = c; j < k; ++j) {
    idx[j] = static_cast<int32_t>(n);
    val[j] = 0.0f;
  }
  *count = static_cast<int32_t>(c);
  return Status::Ok();
}

}  // namespace dtenjax::compress

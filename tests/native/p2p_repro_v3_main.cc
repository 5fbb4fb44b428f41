// Host build of the NVLink kernels' contract-v3 arithmetic (csrc/p2p/repro_v3.h), for
// tests/test_p2p.py: reads W, mean, bf16, n and W x n float32 values (row r = rank r; bfloat16
// inputs widened) from the file argv[1], writes the n float32 results' bits to argv[2].
#include <cstdint>
#include <cstdio>
#include <vector>

#include "csrc/p2p/repro_v3.h"

namespace {

template <int W>
void Run(const std::vector<float>& x, int64_t n, bool mean, bool bf16, std::vector<uint32_t>* out) {
  float v[W];
  for (int64_t i = 0; i < n; ++i) {
    for (int p = 0; p < W; ++p) v[p] = x[p * n + i];
    const float r = bf16 ? dtenjax::p2p::v3::RepSum<W, true>(v, mean)
                         : dtenjax::p2p::v3::RepSum<W, false>(v, mean);
    (*out)[i] = dtenjax::p2p::v3::Bits(r);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* f = std::fopen(argv[1], "rb");
  if (f == nullptr) return 3;
  int32_t head[4];
  if (std::fread(head, 4, 4, f) != 4) return 4;
  const int w = head[0];
  const bool mean = head[1] != 0, bf16 = head[2] != 0;
  const int64_t n = head[3];
  std::vector<float> x(static_cast<size_t>(w * n));
  if (std::fread(x.data(), 4, x.size(), f) != x.size()) return 5;
  std::fclose(f);
  std::vector<uint32_t> out(static_cast<size_t>(n));
  switch (w) {
    case 2: Run<2>(x, n, mean, bf16, &out); break;
    case 3: Run<3>(x, n, mean, bf16, &out); break;
    case 4: Run<4>(x, n, mean, bf16, &out); break;
    case 5: Run<5>(x, n, mean, bf16, &out); break;
    case 6: Run<6>(x, n, mean, bf16, &out); break;
    case 7: Run<7>(x, n, mean, bf16, &out); break;
    case 8: Run<8>(x, n, mean, bf16, &out); break;
    default: return 6;
  }
  std::FILE* g = std::fopen(argv[2], "wb");
  if (g == nullptr || std::fwrite(out.data(), 4, out.size(), g) != out.size()) return 7;
  std::fclose(g);
  return 0;
}

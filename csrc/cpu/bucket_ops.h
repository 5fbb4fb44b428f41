// The per-element work of dtenjax's XLA-native collectives on XLA:CPU, as plain host code (no
// XLA, no CUDA): the custom calls of custom_calls/cpu/bucket_ops.cc run it, so that XLA:CPU
// compiles no LLVM kernel for it (XLA:CPU compiles every fused computation as an LLVM module of
// its own, tens of milliseconds each; a custom call is a thunk). The bits are those of the jnp
// formulation each replaces (dtenjax/_src/collectives/cpu_ffi.py says which, the tests compare).
//
// Layouts: every buffer is row-major; `rows` leading rows (a batch, or the contributions of a
// stacked bucket) are handled alike, each row of `width`-byte elements.
//   Pack:    operand i is [rows, sizes[i]], the result [rows, total] with total >= sum(sizes):
//            the operands' rows one after the other, zeros after them.
//   Unpack:  the operand is [rows, total], result i is [rows, sizes[i]]: consecutive pieces of
//            each row from its start, zeros where a piece runs past the row's end.
//   Fold:    n operands of `count` values each, folded left to right in float32
//            ((x0 + x1) + x2) + ..., rounded once to the result's type; subnormal inputs and
//            results are flushed to zero as XLA:CPU's own kernels do (FTZ and DAZ).
//   RingStep: chunk `chunk` of `c` values of the flat `total`-value buffer, read as if it were
//            padded with zeros to a multiple of c, widened to float32, plus the received float32
//            partial `recv` where there is one (received first, own second), with XLA:CPU's
//            flushing, rounded to the result's type. `result` may be `recv` (in place). Or all
//            int32 (wrapping adds).
//   Butterfly: a step of algorithms/butterfly.py's recursive halving in float32 (XLA:CPU's
//            flushing) or int32 (wrapping adds, no scaling). The first, from the flat buffer: the `n` chunks of `c` values (read as
//            if padded with zeros) in bit-reversed order, each scaled by 2^-scale_log2, their
//            half `upper` into `keep` and the other half into `send` ([n/2, c] each). A later
//            one: `h` rows of `keep` plus the partner's `recv` (the lower block's first: `keep +
//            recv` where `upper` is 0, `recv + keep` where it is 1), then either (h == 1) that
//            row scaled by 2^scale_log2 into `out_keep`, or its half `next_upper` into `out_keep`
//            and the other half into `out_send`.
//   RepSum:  contract v3 (csrc/p2p/repro_v3.h) of the W = sum(contributions) values of each
//            element, IEEE arithmetic (no flushing, as the contract requires).
#pragma once

#include <cstddef>
#include <cstdint>

#include "csrc/common/status.h"

namespace dtenjax::cpu {

enum class Float { kF32, kBf16 };

Status Pack(const void* const* operands, const int64_t* sizes, int count, int64_t rows,
            int64_t total, size_t width, void* out);

Status Unpack(const void* operand, int64_t rows, int64_t total, void* const* results,
              const int64_t* sizes, int count, size_t width);

Status Fold(const void* const* operands, int count, int64_t values, Float in, Float out,
            void* result);

Status RingStep(const void* flat, int64_t total, Float in, const float* recv, int64_t chunk,
                int64_t c, Float out, void* result);

// The same for int32 sums (wrapping adds): the word exchange's words.
Status RingStep(const int32_t* flat, int64_t total, const int32_t* recv, int64_t chunk,
                int64_t c, int32_t* result);

Status ButterflyFirst(const float* flat, int64_t total, int64_t n, int upper, int64_t c,
                      int scale_log2, float* keep, float* send);

Status ButterflyStep(const float* keep, const float* recv, int64_t h, int64_t c, int upper,
                     int next_upper, int scale_log2, float* out_keep, float* out_send);

// The same for int32 sums (wrapping adds, no scaling): the word exchange's words.
Status ButterflyFirst(const int32_t* flat, int64_t total, int64_t n, int upper, int64_t c,
                      int32_t* keep, int32_t* send);

Status ButterflyStep(const int32_t* keep, const int32_t* recv, int64_t h, int64_t c, int upper,
                     int next_upper, int32_t* out_keep, int32_t* out_send);

// Contract v3's word exchange (fixed_point_v3.py's stack_codes, encode, decode), per element,
// IEEE arithmetic, `k` contributions [k, c] of `in` read where they lie:
//   ReproCodes:  the code of the largest magnitude of the k contributions (uint8).
//   ReproEncode: the int32 sum of the k contributions' words against the reduced codes, for
//                `count` contributions in all.
//   ReproDecode: the rounded result of the words summed over every device.
Status ReproCodes(const void* x, int64_t k, int64_t c, Float in, uint8_t* codes);
Status ReproEncode(const void* x, int64_t k, int64_t c, Float in, const uint8_t* codes,
                   int count, int32_t* words);
Status ReproDecode(const int32_t* words, const uint8_t* codes, int64_t c, int count, bool mean,
                   Float out, void* result);

// operand i is [rows, contributions[i], c]; the result [rows, c].
Status RepSum(const void* const* operands, const int64_t* contributions, int count,
              int64_t rows, int64_t c, Float in, bool mean, Float out, void* result);

}  // namespace dtenjax::cpu

// CPU FFI handlers for the per-element work of the XLA-native collectives
// (csrc/cpu/bucket_ops.h; dtenjax/_src/collectives/cpu_ffi.py calls them). A custom call is a
// thunk on XLA:CPU: XLA compiles no kernel for it. Every handler checks its buffers (counts,
// ranks, dimensions, dtypes) and returns an FFI error naming the mismatch.
//
//   dtenjax_cpu_pack(x_0[..., s_0], ..., x_k[..., s_k]) -> out[..., total]   (any one dtype)
//   dtenjax_cpu_unpack(x[..., total]) -> (out_0[..., s_0], ..., out_k[..., s_k])
//   dtenjax_cpu_fold(x_0[...], ..., x_k[...]) -> out[...]        (f32/bf16 in, f32/bf16 out)
//       an operand [..., m, c] for a result [..., c] holds m contributions
//   dtenjax_cpu_ring_step(flat[..., total], rank s32[...], [recv f32[..., c]]) -> out[..., c]
//       (or flat, recv and out all s32: an integer sum)
//       attributes n, shift: the chunk ((rank + shift) mod n) of each row of flat, plus recv
//       (the result may alias recv)
//   dtenjax_cpu_butterfly(src, rank s32[...], [recv]) -> (keep[..., h, c], send[..., h, c])
//                                                  or out[..., c] (the last step)
//       all f32, or all s32 (an integer sum: scale_log2 0)
//       attributes n, step, scale_log2: step -1 reads src[..., total] as n chunks (the first
//       send); step s >= 0 adds recv[..., 2h, c] to src[..., 2h, c] (the kept half) at the
//       rank's bit s and splits the sum at its bit s + 1
//   dtenjax_cpu_repro_codes(x[..., k, c]) -> codes u8[..., c]
//   dtenjax_cpu_repro_encode(x[..., k, c], codes u8[..., c]) -> words s32[..., c]
//       attribute count: the contributions over every device
//   dtenjax_cpu_repro_decode(words s32[..., c], codes u8[..., c]) -> out[..., c]
//       attributes count, mean (0 or 1)
//   dtenjax_cpu_repro_sum(x_0[..., m_0, c], ..., x_k[..., m_k, c]) -> out[..., c]
//       attribute mean (0 or 1)
// The leading dimensions "..." are the same for every buffer of a call (vmap's batch, or none).
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/cpu/bucket_ops.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Dims = ffi::AnyBuffer::Dimensions;

std::string Shape(Dims d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

int64_t Product(Dims d, size_t n) {
  int64_t p = 1;
  for (size_t i = 0; i < n; ++i) p *= d[i];
  return p;
}

// Whether a's first n dimensions are b's first n.
bool SameLead(Dims a, Dims b, size_t n) {
  if (a.size() < n || b.size() < n) return false;
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

ffi::Error Bad(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

bool FloatOf(ffi::DataType t, dtenjax::cpu::Float* out) {
  if (t == ffi::DataType::F32) { *out = dtenjax::cpu::Float::kF32; return true; }
  if (t == ffi::DataType::BF16) { *out = dtenjax::cpu::Float::kBf16; return true; }
  return false;
}

// --- pack / unpack ---------------------------------------------------------------------------

ffi::Error PackImpl(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kName = "dtenjax_cpu_pack";
  const Dims od = out->dimensions();
  if (od.size() < 1) return Bad(kName, "the result must have at least one dimension");
  const size_t lead = od.size() - 1;
  const size_t width = ffi::ByteWidth(out->element_type());
  if (width == 0) return Bad(kName, "the result's dtype has no byte width");
  std::vector<const void*> ptrs(args.size());
  std::vector<int64_t> sizes(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    const Dims d = a->dimensions();
    if (a->element_type() != out->element_type()) {
      return Bad(kName, "operand " + std::to_string(i) + " has another dtype than the result");
    }
    if (d.size() != od.size() || !SameLead(d, od, lead)) {
      return Bad(kName, "operand " + std::to_string(i) + " of shape " + Shape(d) +
                            " does not share the leading dimensions of the result " + Shape(od));
    }
    ptrs[i] = a->untyped_data();
    sizes[i] = d[lead];
  }
  return dtenjax::ffi::ToFfiError(dtenjax::cpu::Pack(
      ptrs.data(), sizes.data(), static_cast<int>(args.size()), Product(od, lead), od[lead],
      width, out->untyped_data()));
}

ffi::Error UnpackImpl(ffi::AnyBuffer x, ffi::RemainingRets rets) {
  constexpr const char* kName = "dtenjax_cpu_unpack";
  const Dims xd = x.dimensions();
  if (xd.size() < 1) return Bad(kName, "the operand must have at least one dimension");
  const size_t lead = xd.size() - 1;
  const size_t width = ffi::ByteWidth(x.element_type());
  if (width == 0) return Bad(kName, "the operand's dtype has no byte width");
  std::vector<void*> ptrs(rets.size());
  std::vector<int64_t> sizes(rets.size());
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    const Dims d = (*r)->dimensions();
    if ((*r)->element_type() != x.element_type()) {
      return Bad(kName, "result " + std::to_string(i) + " has another dtype than the operand");
    }
    if (d.size() != xd.size() || !SameLead(d, xd, lead)) {
      return Bad(kName, "result " + std::to_string(i) + " of shape " + Shape(d) +
                            " does not share the leading dimensions of the operand " + Shape(xd));
    }
    ptrs[i] = (*r)->untyped_data();
    sizes[i] = d[lead];
  }
  return dtenjax::ffi::ToFfiError(dtenjax::cpu::Unpack(
      x.untyped_data(), Product(xd, lead), xd[lead], ptrs.data(), sizes.data(),
      static_cast<int>(rets.size()), width));
}

// --- the folds ----------------------------------------------------------------------------------

// The operands of a float handler: all of the first one's f32 or bf16 dtype, each shape accepted
// by `why_not` (which returns what is wrong, or "" when nothing is); their data into `ptrs`.
template <typename WhyNot>
ffi::Error FloatOperands(const char* name, ffi::RemainingArgs args, dtenjax::cpu::Float* in,
                         std::vector<const void*>* ptrs, WhyNot why_not) {
  if (args.size() < 1) return Bad(name, "no operand");
  ptrs->resize(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    dtenjax::cpu::Float t{};
    if (!FloatOf(a->element_type(), &t) || (i > 0 && t != *in)) {
      return Bad(name, "operand " + std::to_string(i) + " is not of the first operand's f32 or "
                       "bf16 dtype");
    }
    *in = t;
    const std::string why = why_not(i, a->dimensions());
    if (!why.empty()) {
      return Bad(name, "operand " + std::to_string(i) + " of shape " + Shape(a->dimensions()) +
                           why);
    }
    (*ptrs)[i] = a->untyped_data();
  }
  return ffi::Error::Success();
}

ffi::Error FoldImpl(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kName = "dtenjax_cpu_fold";
  dtenjax::cpu::Float in{}, ot{};
  if (!FloatOf(out->element_type(), &ot)) return Bad(kName, "the result must be f32 or bf16");
  const int64_t n = static_cast<int64_t>(out->element_count());
  const Dims od = out->dimensions();
  const size_t lead = od.size() == 0 ? 0 : od.size() - 1;
  // contributions per operand: 1 (the result's values), or m ([..., m, c] for a result [..., c])
  std::vector<int64_t> counts(args.size(), 1);
  std::vector<const void*> ptrs;
  ffi::Error err = FloatOperands(kName, args, &in, &ptrs, [&](size_t i, Dims d) {
    if (Product(d, d.size()) == n) return std::string();
    if (od.size() > 0 && d.size() == od.size() + 1 && SameLead(d, od, lead) &&
        d[lead + 1] == od[lead]) {
      counts[i] = d[lead];
      return std::string();
    }
    return " has not the result's " + std::to_string(n) + " values, nor is it [..., m, values] "
           "for the result " + Shape(od);
  });
  if (err.failure()) return err;
  int64_t total = 0;
  for (int64_t m : counts) total += m;
  if (total == static_cast<int64_t>(args.size())) {   // one contribution per operand
    return dtenjax::ffi::ToFfiError(dtenjax::cpu::Fold(
        ptrs.data(), static_cast<int>(args.size()), n, in, ot, out->untyped_data()));
  }
  // per row of the leading dimensions: the contributions in operand order, then row order
  const int64_t c = od[lead], rows = Product(od, lead);
  const size_t in_w = in == dtenjax::cpu::Float::kF32 ? 4 : 2;
  const size_t out_w = ot == dtenjax::cpu::Float::kF32 ? 4 : 2;
  std::vector<const void*> row(static_cast<size_t>(total));
  for (int64_t r = 0; r < rows; ++r) {
    size_t p = 0;
    for (size_t i = 0; i < ptrs.size(); ++i) {
      const char* base = static_cast<const char*>(ptrs[i]) + r * counts[i] * c * in_w;
      for (int64_t j = 0; j < counts[i]; ++j) row[p++] = base + j * c * in_w;
    }
    const dtenjax::Status s = dtenjax::cpu::Fold(
        row.data(), static_cast<int>(total), c, in, ot,
        static_cast<char*>(out->untyped_data()) + r * c * out_w);
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

// The rank of leading row r: one value for every row, or one per row.
ffi::Error Ranks(const char* name, ffi::AnyBuffer rank, int64_t rows) {
  if (rank.element_type() != ffi::DataType::S32 ||
      (static_cast<int64_t>(rank.element_count()) != rows && rank.element_count() != 1)) {
    return Bad(name, "the rank must be int32, one value or one per row");
  }
  return ffi::Error::Success();
}

int64_t RankOf(ffi::AnyBuffer rank, int64_t r) {
  return rank.typed_data<int32_t>()[rank.element_count() == 1 ? 0 : r];
}

ffi::Error RingStepImpl(ffi::AnyBuffer flat, ffi::AnyBuffer rank, ffi::RemainingArgs recv,
                        ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t shift) {
  constexpr const char* kName = "dtenjax_cpu_ring_step";
  dtenjax::cpu::Float in{}, ot{};
  // all s32 (an integer sum), or f32/bf16 with an f32 partial
  const bool ints = flat.element_type() == ffi::DataType::S32 &&
                    out->element_type() == ffi::DataType::S32;
  if (!ints && (!FloatOf(flat.element_type(), &in) || !FloatOf(out->element_type(), &ot))) {
    return Bad(kName, "the flat buffer and the result must be f32 or bf16, or both s32");
  }
  const ffi::DataType partial_type = ints ? ffi::DataType::S32 : ffi::DataType::F32;
  if (n < 1) return Bad(kName, "n = " + std::to_string(n) + " must be positive");
  const Dims fd = flat.dimensions(), od = out->dimensions();
  if (fd.size() < 1 || od.size() != fd.size() || !SameLead(fd, od, fd.size() - 1)) {
    return Bad(kName, "the flat buffer " + Shape(fd) + " and the result " + Shape(od) +
                          " must share their leading dimensions");
  }
  const size_t lead = fd.size() - 1;
  const int64_t rows = Product(fd, lead), total = fd[lead], c = od[lead];
  if (c * n < total) {
    return Bad(kName, std::to_string(n) + " chunks of " + std::to_string(c) +
                          " values do not cover the flat buffer's " + std::to_string(total));
  }
  ffi::Error err = Ranks(kName, rank, rows);
  if (err.failure()) return err;
  const char* partial = nullptr;
  if (recv.size() > 1) return Bad(kName, "at most one received partial");
  if (recv.size() == 1) {
    auto r = recv.get<ffi::AnyBuffer>(0);
    if (r.has_error()) return r.error();
    if (r->element_type() != partial_type || r->element_count() != out->element_count()) {
      return Bad(kName, std::string("the received partial must be ") + (ints ? "s32" : "f32") +
                            " of the result's shape " + Shape(od));
    }
    partial = static_cast<const char*>(r->untyped_data());
  }
  const size_t in_w = ffi::ByteWidth(flat.element_type());
  const size_t out_w = ffi::ByteWidth(out->element_type());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = RankOf(rank, r), chunk = (((k + shift) % n) + n) % n;
    const char* x = static_cast<const char*>(flat.untyped_data()) + r * total * in_w;
    const char* p = partial != nullptr ? partial + r * c * 4 : nullptr;
    char* y = static_cast<char*>(out->untyped_data()) + r * c * out_w;
    const dtenjax::Status s =
        ints ? dtenjax::cpu::RingStep(reinterpret_cast<const int32_t*>(x), total,
                                      reinterpret_cast<const int32_t*>(p), chunk, c,
                                      reinterpret_cast<int32_t*>(y))
             : dtenjax::cpu::RingStep(x, total, in, reinterpret_cast<const float*>(p), chunk, c,
                                      ot, y);
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

ffi::Error ButterflyImpl(ffi::AnyBuffer src, ffi::AnyBuffer rank, ffi::RemainingArgs recv,
                         ffi::RemainingRets rets, int64_t n, int64_t step, int64_t scale_log2) {
  constexpr const char* kName = "dtenjax_cpu_butterfly";
  if (n < 2 || (n & (n - 1)) != 0) {
    return Bad(kName, "n = " + std::to_string(n) + " must be a power of two >= 2");
  }
  if (step < -1 || step > 61 || (step >= 0 && (int64_t{2} << step) > n) || scale_log2 < 0 || scale_log2 > 126) {
    return Bad(kName, "step " + std::to_string(step) + " or scale_log2 " +
                          std::to_string(scale_log2) + " out of range for n = " +
                          std::to_string(n));
  }
  const bool first = step < 0;
  const int64_t h = n >> (step + 1);     // the rows of src at a step, of the split's halves first
  const size_t results = first || h > 1 ? 2 : 1;
  if (recv.size() != (first ? 0u : 1u) || rets.size() != results) {
    return Bad(kName, "step " + std::to_string(step) + " of n = " + std::to_string(n) +
                          " takes " + (first ? "no" : "one") + " received buffer and gives " +
                          std::to_string(results) + " result(s)");
  }
  const ffi::DataType dt = src.element_type();   // f32, or s32 (integer sums, no scaling)
  if ((dt != ffi::DataType::F32 && dt != ffi::DataType::S32) ||
      (dt == ffi::DataType::S32 && scale_log2 != 0)) {
    return Bad(kName, "the source must be f32, or s32 with scale_log2 0");
  }
  std::vector<void*> outs(results);
  Dims od;
  for (size_t i = 0; i < results; ++i) {
    auto o = rets.get<ffi::AnyBuffer>(i);
    if (o.has_error()) return o.error();
    if ((*o)->element_type() != dt) return Bad(kName, "the results must be of the source's type");
    if (i > 0 && (*o)->dimensions().size() != od.size()) return Bad(kName, "unequal results");
    od = (*o)->dimensions();
    outs[i] = (*o)->untyped_data();
  }
  // [..., rows of the result, c]: h / 2 rows per half after a step, n / 2 after the first
  const size_t cut = results == 2 ? 2 : 1;
  if (od.size() < cut) {
    return Bad(kName, "the results must be [..., rows, c]");
  }
  const size_t lead = od.size() - cut;
  const int64_t c = od[od.size() - 1], rows = Product(od, lead);
  const int64_t out_rows = results == 1 ? 1 : od[lead];
  const Dims sd = src.dimensions();
  const bool src_ok = first ? (sd.size() == lead + 1 && SameLead(sd, od, lead) &&
                               out_rows == n / 2)
                            : (sd.size() == lead + 2 && SameLead(sd, od, lead) &&
                               sd[lead] == h && sd[lead + 1] == c &&
                               out_rows == (h > 1 ? h / 2 : 1));
  if (!src_ok) {
    return Bad(kName, "the source " + Shape(sd) + " does not fit the results " + Shape(od) +
                          " at step " + std::to_string(step) + " of n = " + std::to_string(n));
  }
  ffi::Error err = Ranks(kName, rank, rows);
  if (err.failure()) return err;
  const char* partner = nullptr;
  if (!first) {
    auto r = recv.get<ffi::AnyBuffer>(0);
    if (r.has_error()) return r.error();
    if (r->element_type() != dt || r->element_count() != src.element_count()) {
      return Bad(kName, "the received buffer must be of the source's type and shape " + Shape(sd));
    }
    partner = static_cast<const char*>(r->untyped_data());
  }
  const int64_t in_row = first ? sd[lead] : h * c, out_row = out_rows * c;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = RankOf(rank, r);
    const int upper = static_cast<int>(first ? k & 1 : (k >> step) & 1);
    const int next = static_cast<int>(first ? 0 : (k >> (step + 1)) & 1);
    const auto at = [&](auto* base, int64_t row) {   // row r of a buffer of `row` values a row
      return base == nullptr ? nullptr : base + r * row;
    };
    dtenjax::Status s;
    if (dt == ffi::DataType::F32) {
      const float* x = at(src.typed_data<float>(), in_row);
      float* keep = at(static_cast<float*>(outs[0]), out_row);
      float* send = results == 2 ? at(static_cast<float*>(outs[1]), out_row) : nullptr;
      s = first ? dtenjax::cpu::ButterflyFirst(x, in_row, n, upper, c,
                                               static_cast<int>(scale_log2), keep, send)
                : dtenjax::cpu::ButterflyStep(x, at(reinterpret_cast<const float*>(partner),
                                                    in_row), h, c, upper, next,
                                              static_cast<int>(scale_log2), keep, send);
    } else {
      const int32_t* x = at(src.typed_data<int32_t>(), in_row);
      int32_t* keep = at(static_cast<int32_t*>(outs[0]), out_row);
      int32_t* send = results == 2 ? at(static_cast<int32_t*>(outs[1]), out_row) : nullptr;
      s = first ? dtenjax::cpu::ButterflyFirst(x, in_row, n, upper, c, keep, send)
                : dtenjax::cpu::ButterflyStep(x, at(reinterpret_cast<const int32_t*>(partner),
                                                    in_row), h, c, upper, next, keep, send);
    }
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

// The [..., k, c] contributions of the word exchange: their type, rows (the leading dimensions'
// product), k and c, checked against `codes` ([..., c], uint8).
ffi::Error WordOperands(const char* name, ffi::AnyBuffer x, Dims cd, dtenjax::cpu::Float* in,
                        int64_t* rows, int64_t* k, int64_t* c) {
  const Dims xd = x.dimensions();
  if (!FloatOf(x.element_type(), in)) return Bad(name, "the contributions must be f32 or bf16");
  if (xd.size() < 2 || cd.size() + 1 != xd.size() || !SameLead(xd, cd, xd.size() - 2) ||
      cd[cd.size() - 1] != xd[xd.size() - 1]) {
    return Bad(name, "the contributions " + Shape(xd) + " are not [..., k, c] for the codes " +
                         Shape(cd));
  }
  *rows = Product(xd, xd.size() - 2);
  *k = xd[xd.size() - 2];
  *c = xd[xd.size() - 1];
  return ffi::Error::Success();
}

ffi::Error ReproCodesImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> codes) {
  constexpr const char* kName = "dtenjax_cpu_repro_codes";
  if (codes->element_type() != ffi::DataType::U8) return Bad(kName, "the codes must be u8");
  dtenjax::cpu::Float in{};
  int64_t rows = 0, k = 0, c = 0;
  ffi::Error err = WordOperands(kName, x, codes->dimensions(), &in, &rows, &k, &c);
  if (err.failure()) return err;
  const size_t w = ffi::ByteWidth(x.element_type());
  for (int64_t r = 0; r < rows; ++r) {
    const dtenjax::Status s = dtenjax::cpu::ReproCodes(
        static_cast<const char*>(x.untyped_data()) + r * k * c * w, k, c, in,
        codes->typed_data<uint8_t>() + r * c);
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

ffi::Error ReproEncodeImpl(ffi::AnyBuffer x, ffi::AnyBuffer codes,
                           ffi::Result<ffi::AnyBuffer> words, int64_t count) {
  constexpr const char* kName = "dtenjax_cpu_repro_encode";
  if (codes.element_type() != ffi::DataType::U8 || words->element_type() != ffi::DataType::S32 ||
      words->element_count() != codes.element_count()) {
    return Bad(kName, "the codes must be u8 and the words s32 of the codes' shape");
  }
  dtenjax::cpu::Float in{};
  int64_t rows = 0, k = 0, c = 0;
  ffi::Error err = WordOperands(kName, x, codes.dimensions(), &in, &rows, &k, &c);
  if (err.failure()) return err;
  const size_t w = ffi::ByteWidth(x.element_type());
  for (int64_t r = 0; r < rows; ++r) {
    const dtenjax::Status s = dtenjax::cpu::ReproEncode(
        static_cast<const char*>(x.untyped_data()) + r * k * c * w, k, c, in,
        codes.typed_data<uint8_t>() + r * c, static_cast<int>(count),
        words->typed_data<int32_t>() + r * c);
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

ffi::Error ReproDecodeImpl(ffi::AnyBuffer words, ffi::AnyBuffer codes,
                           ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t mean) {
  constexpr const char* kName = "dtenjax_cpu_repro_decode";
  dtenjax::cpu::Float ot{};
  if (!FloatOf(out->element_type(), &ot)) return Bad(kName, "the result must be f32 or bf16");
  if (words.element_type() != ffi::DataType::S32 || codes.element_type() != ffi::DataType::U8 ||
      words.element_count() != codes.element_count() ||
      out->element_count() != codes.element_count()) {
    return Bad(kName, "the words (s32), the codes (u8) and the result must have one shape");
  }
  if (mean != 0 && mean != 1) return Bad(kName, "mean must be 0 or 1");
  if (count > INT32_MAX) return Bad(kName, "count out of range");
  return dtenjax::ffi::ToFfiError(dtenjax::cpu::ReproDecode(
      words.typed_data<int32_t>(), codes.typed_data<uint8_t>(),
      static_cast<int64_t>(codes.element_count()), static_cast<int>(count), mean == 1, ot,
      out->untyped_data()));
}

ffi::Error ReproSumImpl(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out, int64_t mean) {
  constexpr const char* kName = "dtenjax_cpu_repro_sum";
  dtenjax::cpu::Float in{}, ot{};
  if (!FloatOf(out->element_type(), &ot)) return Bad(kName, "the result must be f32 or bf16");
  const Dims od = out->dimensions();
  if (od.size() < 1) return Bad(kName, "the result must have at least one dimension");
  const size_t lead = od.size() - 1;
  std::vector<const void*> ptrs;
  std::vector<int64_t> counts(args.size());
  ffi::Error err = FloatOperands(kName, args, &in, &ptrs, [&](size_t i, Dims d) {
    if (d.size() != od.size() + 1 || !SameLead(d, od, lead) || d[lead + 1] != od[lead]) {
      return " is not [..., contributions, values] for the result " + Shape(od);
    }
    counts[i] = d[lead];
    return std::string();
  });
  if (err.failure()) return err;
  if (mean != 0 && mean != 1) return Bad(kName, "mean must be 0 or 1");
  return dtenjax::ffi::ToFfiError(dtenjax::cpu::RepSum(
      ptrs.data(), counts.data(), static_cast<int>(args.size()), Product(od, lead), od[lead], in,
      mean == 1, ot, out->untyped_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuPack, PackImpl,
                              ffi::Ffi::Bind().RemainingArgs().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuUnpack, UnpackImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFold, FoldImpl,
                              ffi::Ffi::Bind().RemainingArgs().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuRingStep, RingStepImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("shift"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuButterfly, ButterflyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("step")
                                  .Attr<int64_t>("scale_log2"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuReproCodes, ReproCodesImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuReproEncode, ReproEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("count"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuReproDecode, ReproDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("mean"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuReproSum, ReproSumImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("mean"));

DTENJAX_REGISTER_FFI("dtenjax_cpu_pack", "cpu", CpuPack);
DTENJAX_REGISTER_FFI("dtenjax_cpu_unpack", "cpu", CpuUnpack);
DTENJAX_REGISTER_FFI("dtenjax_cpu_fold", "cpu", CpuFold);
DTENJAX_REGISTER_FFI("dtenjax_cpu_ring_step", "cpu", CpuRingStep);
DTENJAX_REGISTER_FFI("dtenjax_cpu_butterfly", "cpu", CpuButterfly);
DTENJAX_REGISTER_FFI("dtenjax_cpu_repro_codes", "cpu", CpuReproCodes);
DTENJAX_REGISTER_FFI("dtenjax_cpu_repro_encode", "cpu", CpuReproEncode);
DTENJAX_REGISTER_FFI("dtenjax_cpu_repro_decode", "cpu", CpuReproDecode);
DTENJAX_REGISTER_FFI("dtenjax_cpu_repro_sum", "cpu", CpuReproSum);

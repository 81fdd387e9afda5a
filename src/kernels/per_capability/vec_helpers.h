// What every per-capability loop file shares. Included first in such a file: it opens
// hp::kernels::CPU_CAPABILITY inline (as at::vec opens its own), which loops.h, declaring every
// capability's namespace, must not do first.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

// The entry points stay visible; everything else a copy compiles (inline functions of the ATen and
// c10 headers, built with its capability's -m flags) is hidden, so no other object or library can
// bind to a copy that uses instructions the CPU may lack.
#define HP_KERNEL_ENTRY __attribute__((visibility("default")))

namespace hp::kernels {
inline namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<c10::BFloat16>;
constexpr int64_t kGrain = 16384;  // elements per task: small enough to split a layer's activations

// Rows of `length` elements per task of a parallel loop over rows: about kGrain elements, at least
// one row.
inline int64_t rows_per_task(int64_t length) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(length, 1)); }

// The first `count` values at `data` in a vector, the rest zero (a partial load leaves them
// undefined; their results are never stored, but nothing should compute on undefined values).
template <typename V, typename T>
V load(const T* data, int count) {
  if (count == V::size()) return V::loadu(data);
  __at_align__ T buffer[V::size()] = {};
  std::copy(data, data + count, buffer);
  return V::loadu(buffer);
}

// Two fp32 vectors side by side: the width of one bf16 vector, so that row loops over either dtype
// step by whole bf16 vectors (a partial bf16 load goes through a buffer).
struct Vec2 {
  static constexpr int kSize = 2 * Vec::size();
  Vec lo, hi;

  static Vec2 all(float x) { return {Vec(x), Vec(x)}; }
  // The first `count` lanes of b, the rest of a. (Through memory: Vectorized<float>::set is not
  // inline under AVX512, and would be exported from this copy; see loops.h.)
  static Vec2 set(const Vec2& a, const Vec2& b, int count) {
    if (count >= kSize) return b;
    __at_align__ float lanes[kSize], rest[kSize];
    b.store(lanes);
    a.store(rest);
    std::copy(rest + count, rest + kSize, lanes + count);
    return {Vec::loadu(lanes), Vec::loadu(lanes + Vec::size())};
  }
  void store(float* lanes) const {
    lo.store(lanes);
    hi.store(lanes + Vec::size());
  }
  Vec2 exp() const { return {lo.exp(), hi.exp()}; }
  friend Vec2 operator+(const Vec2& a, const Vec2& b) { return {a.lo + b.lo, a.hi + b.hi}; }
  friend Vec2 operator-(const Vec2& a, const Vec2& b) { return {a.lo - b.lo, a.hi - b.hi}; }
  friend Vec2 operator*(const Vec2& a, const Vec2& b) { return {a.lo * b.lo, a.hi * b.hi}; }
  friend Vec2 maximum(const Vec2& a, const Vec2& b) {
    return {at::vec::maximum(a.lo, b.lo), at::vec::maximum(a.hi, b.hi)};
  }
  // Lanes combined in one order: lo's then hi's, pairwise by `op`.
  template <typename Op>
  float reduce(const Op& op) const {
    __at_align__ float lanes[kSize];
    store(lanes);
    float out = lanes[0];
    for (int i = 1; i < kSize; ++i) out = op(out, lanes[i]);
    return out;
  }
};

static_assert(BVec::size() == Vec2::kSize, "a bf16 vector widens to two fp32 ones");

// The lanes in [j, j + Vec2::kSize) of a row of n that exist.
inline int lanes_at(int64_t j, int64_t n) { return static_cast<int>(std::min<int64_t>(Vec2::kSize, n - j)); }

// `count` (at most Vec2::kSize) values from fp32 or bf16 data as fp32, zero past them.
inline Vec2 load2(const float* data, int count) {
  if (count <= Vec::size()) return {load<Vec>(data, count), Vec(0.0f)};
  return {Vec::loadu(data), load<Vec>(data + Vec::size(), count - Vec::size())};
}
inline Vec2 load2(const c10::BFloat16* data, int count) {
  if (count == Vec::size()) {  // half a bf16 vector (a head of 32 halved, at AVX512): no buffer
    Vec lo;
    at::vec::load_fp32_from_bf16(data, lo);
    return {lo, Vec(0.0f)};
  }
  const auto [lo, hi] = at::vec::convert_bfloat16_float(load<BVec>(data, count));
  return {lo, hi};
}

// The first `count` lanes stored as fp32, or rounded once to bf16.
inline void store2(const Vec2& v, float* data, int count) {
  v.lo.store(data, std::min(count, Vec::size()));
  if (count > Vec::size()) v.hi.store(data + Vec::size(), count - Vec::size());
}
inline void store2(const Vec2& v, c10::BFloat16* data, int count) {
  at::vec::convert_float_bfloat16(v.lo, v.hi).store(data, count);
}

// Sum of f(j, count) over a row's steps [0, n), f returning a Vec2 (zero past n); one order.
template <typename F>
float row_sum(int64_t n, const F& f) {
  Vec2 acc = Vec2::all(0.0f);
  for (int64_t j = 0; j < n; j += Vec2::kSize) acc = acc + f(j, lanes_at(j, n));
  return acc.reduce([](float a, float b) { return a + b; });
}

// The largest of the first n values of row times scale (-inf for none); one order.
template <typename T>
float row_max(const T* row, int64_t n, const Vec2& scale) {
  const Vec2 lowest = Vec2::all(-std::numeric_limits<float>::infinity());
  Vec2 top = lowest;
  for (int64_t j = 0; j < n; j += Vec2::kSize) {
    const int count = lanes_at(j, n);
    top = maximum(top, Vec2::set(lowest, load2(row + j, count) * scale, count));
  }
  return top.reduce([](float a, float b) { return std::max(a, b); });
}

// The sum of exp(row[j] * scale - shift) over the first n values; one order.
template <typename T>
float row_sum_exp(const T* row, int64_t n, const Vec2& scale, float shift) {
  return row_sum(n, [&](int64_t j, int count) {
    return Vec2::set(Vec2::all(0.0f), (load2(row + j, count) * scale - Vec2::all(shift)).exp(), count);
  });
}

// v rounded to bf16 and widened back: what a bf16 tensor holds of it.
inline Vec2 round_to_bfloat16(const Vec2& v) {
  const auto [lo, hi] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(v.lo, v.hi));
  return {lo, hi};
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace hp::kernels

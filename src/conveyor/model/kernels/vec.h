// Float vectors for the CPU kernels: GCC/Clang vector extensions, lowered by -march=native.
// kLanes floats wide: 16 (one register) with AVX-512, else 8 (one AVX2 register): 16-wide
// vectors on AVX2 are register pairs that GCC 12 spills to the stack in the kernels' loops
// (the decode attention kernel ran at half speed). Element type T is float or bf16 (stored as
// uint16_t); sizes handed to these helpers are multiples of 16 (the Python side checks).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace conveyor {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vuint __attribute__((vector_size(4 * kLanes)));
typedef int32_t vint __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vhalf __attribute__((vector_size(2 * kLanes)));

// __builtin_prefetch that stays: GCC 12 deletes a loop whose only work is prefetching (a
// prefetch has no effect it must keep). The empty asm, which emits nothing and touches no
// memory, is an effect in each iteration. LOCALITY as __builtin_prefetch's: 3 (L1) to 0.
template <int LOCALITY>
inline void prefetch(const void* p) {
  __builtin_prefetch(p, 0, LOCALITY);
  asm volatile("" : : "r"(p));
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bf16 -> float: the bf16 bits are a float's top half. GCC lowers the vector-extension
// widening to two half-width conversions and an insert; with AVX-512 one vpmovzxwd does it.
inline vfloat load(const uint16_t* p) {
#ifdef __AVX512F__
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vfloat>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vfloat>(__builtin_convertvector(h, vuint) << 16);
#endif
}

inline vuint bf16_rounded_bits(vfloat v) {  // round to nearest even, as torch does
  const vuint bits = reinterpret_cast<vuint>(v);
  return bits + 0x7FFF + ((bits >> 16) & 1);
}

inline void store(vfloat v, float* p) { std::memcpy(p, &v, sizeof v); }

inline void store(vfloat v, uint16_t* p) {  // (vcvtneps2bf16 would flush subnormals to zero)
#ifdef __AVX512F__
  const __m512i bits = reinterpret_cast<__m512i>(bf16_rounded_bits(v) >> 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
#else
  const vhalf h = __builtin_convertvector(bf16_rounded_bits(v) >> 16, vhalf);
  std::memcpy(p, &h, sizeof h);
#endif
}

// v rounded to T and back: what torch's eager ops produce between two bf16 ops.
inline vfloat rounded(vfloat v, const float*) { return v; }
inline vfloat rounded(vfloat v, const uint16_t*) {
  return reinterpret_cast<vfloat>(bf16_rounded_bits(v) & 0xFFFF0000u);
}

inline void store(float x, float* out) { *out = x; }

inline void store(float x, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  *out = static_cast<uint16_t>(bits >> 16);
}

// A scratch vector v with room for n elements: grown, never shrunk, so that reusing it across
// calls does not zero-fill it again (fresh attention score rows would be a memset of every
// score a step).
template <typename V>
auto* at_least(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// __builtin_shufflevector (constant lane indices) is understood by GCC 12+ and clang alike.
inline float hsum(vfloat v) {  // a tree: a left-to-right sum would be kLanes dependent adds
#ifdef __AVX512F__
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
#else
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0);
#endif
  return v[0];
}

// exp(x), kLanes at a time, x clamped to [-87, 88] (exp(-87) ~ 1.6e-38 is still a normal float):
// 2^n * e^f with n = round(x log2 e) and a degree-6 polynomial for e^f, |f| <= 0.35
// (relative error about 1e-7). Adding 1.5 * 2^23 rounds x log2 e to an integer (to nearest
// even) in the sum's low mantissa bits, which then become 2^n's exponent (AVX-512: vscalefps
// multiplies by 2^n, the same product in fewer instructions). Scalar expf would be a library
// call per element. The polynomial is a chain of dependent FMAs: a loop over many vectors runs
// faster computing several in one iteration, so the core overlaps their chains.
inline vfloat vexp(vfloat x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: floats near it are 1 apart
#ifdef __AVX512F__  // max/min with x second keep a NaN x, as the comparisons below do
  x = reinterpret_cast<vfloat>(_mm512_max_ps(_mm512_set1_ps(-87.f), reinterpret_cast<__m512>(x)));
  x = reinterpret_cast<vfloat>(_mm512_min_ps(_mm512_set1_ps(88.f), reinterpret_cast<__m512>(x)));
#else
  x = x < -87.f ? vfloat{} - 87.f : x;
  x = x > 88.f ? vfloat{} + 88.f : x;
#endif
  const vfloat r = x * 1.44269504f + kRound;
  const vfloat n = r - kRound;
  const vfloat f = (x * 1.44269504f - n) * 0.69314718f;
  vfloat p = f * (1.f / 720) + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
#ifdef __AVX512F__
  return reinterpret_cast<vfloat>(
      _mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#else
  const vint bits = (reinterpret_cast<vint>(r) - (0x4B400000 - 127)) << 23;
  return p * reinterpret_cast<vfloat>(bits);
#endif
}

// body(c, std::integral_constant<int, B>{}) for c = 0, B kLanes, ... while B vectors fit in
// [0, n), then body(c, std::integral_constant<int, 1>{}) a vector at a time: a loop whose
// vectors are independent, B at a time (n a multiple of kLanes).
template <int B, typename Body>
inline void in_batches(int64_t n, Body&& body) {
  int64_t c = 0;
  for (; c + B * kLanes <= n; c += B * kLanes) body(c, std::integral_constant<int, B>{});
  for (; c < n; c += kLanes) body(c, std::integral_constant<int, 1>{});
}

// One stretch of a row's unnormalised softmax, folded into the row's running max m and sum l
// (m = -inf and l = 0 before its first stretch): with m' = max(m, max s[0, n)),
// w[t] = exp(s[t] - m'), 0 from n to width (a multiple of kLanes); l = l exp(m - m') + the
// stretch's sum; m = m'. Returns exp(m - m'): the factor for what the row summed before.
// n >= 1. w may be s itself (W = float). W = uint16_t: the weights are rounded to bf16 (for
// bf16 products), and l sums the rounded weights.
template <typename W>
inline float softmax_fold(float* s, int64_t n, int64_t width, float& m, float& l, W* w) {
  std::fill(s + n, s + width, -INFINITY);
  vfloat vmax = load(s);
  for (int64_t t = kLanes; t < width; t += kLanes) {
    const vfloat x = load(s + t);
    vmax = x > vmax ? x : vmax;
  }
  float mx = m;
  for (int i = 0; i < kLanes; ++i) mx = std::max(mx, vmax[i]);
  vfloat sum{};
  in_batches<4>(width, [&](int64_t t, auto batch) {  // exps overlap: see vexp
    constexpr int B = decltype(batch)::value;
    vfloat e[B];
    for (int i = 0; i < B; ++i) {
      const vfloat x = load(s + t + i * kLanes);
      e[i] = rounded(x > -INFINITY ? vexp(x - mx) : vfloat{}, w);
    }
    for (int i = 0; i < B; ++i) {
      store(e[i], w + t + i * kLanes);
      sum += e[i];
    }
  });
  const float rescale = std::exp(m - mx);  // 0 on the first stretch (m = -inf)
  l = l * rescale + hsum(sum);
  m = mx;
  return rescale;
}

}  // namespace conveyor

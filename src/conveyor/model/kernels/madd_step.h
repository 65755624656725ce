// One step of a dot-product micro-kernel, in float or in bf16 pairs: a broadcast of one
// operand, a vector of the other, a multiply-add into float accumulators. Shared by the panel
// GEMM (panel_gemm.cpp: x broadcast, W's panel as vectors), the prefill attention tiles
// (attention_tile.h: a query or a softmax weight broadcast, keys or values as vectors) and the
// decode attention (paged_attention.cpp: the same steps, and the weights of two value rows
// broadcast).

#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace conveyor {

// float32: one element per step; the broadcast is a float, one FMA per accumulator.
struct F32 {
  using T = float;
  static constexpr int kStep = 1;
  using Bcast = vfloat;
  // One vbroadcastss; `vfloat{} + x` is two (the add of 0.0 cannot be folded: -0.0).
  static Bcast broadcast(const float* x) { return *x - vfloat{}; }
  static vfloat vector(const float* w) { return load(w); }
  static void madd(vfloat& acc, Bcast x, vfloat w) { acc += x * w; }
};

#ifdef __AVX512BF16__
// bf16: two elements per step; the broadcast is a pair as one 32-bit lane, one vdpbf16ps per
// accumulator (acc[l] += x[2i] * w[l][2i] + x[2i + 1] * w[l][2i + 1], in float32).
struct BF16 {
  using T = uint16_t;
  static constexpr int kStep = 2;
  using Bcast = __m512bh;
  static Bcast broadcast(const uint16_t* x) {
    uint32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
  }
  static __m512bh vector(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static void madd(vfloat& acc, Bcast x, __m512bh w) {
    acc = (vfloat)_mm512_dpbf16_ps((__m512)acc, x, w);
  }
};
#endif

// One step of an R-row tile: rows r < R of x (`x + r * stride`) broadcast against two weight
// vectors, into acc[r][0] and acc[r][1]. The inner loop of the panel GEMMs (panel_gemm.cpp,
// quant_panels.cpp) and of the prefill attention tiles (attention_tile.h).
template <class F, int R, class W>
__attribute__((always_inline)) inline void madd_rows(vfloat (&acc)[R][2],
                                                     const typename F::T* x, int64_t stride,
                                                     W w0, W w1) {
  for (int r = 0; r < R; ++r) {
    const auto xr = F::broadcast(x + r * stride);
    F::madd(acc[r][0], xr, w0);
    F::madd(acc[r][1], xr, w1);
  }
}

}  // namespace conveyor

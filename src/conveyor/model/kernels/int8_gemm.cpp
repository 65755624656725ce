// y = x @ W^T on the CPU with a GGUF file's 4-bit or 8-bit weights multiplied as integers
// (AVX512-VNNI): a bf16 model's matmuls beyond the few rows kernels/block_matmul.cpp serves, from
// a batch of decodes to a 4,096-token prefill.
//
// Why: at those sizes a matmul is bound by arithmetic, not by reading W. One vpdpbusd does 64
// byte multiply-adds (unsigned x signed bytes, summed in fours into 16 int32 lanes) where one
// vdpbf16ps does 32, at the same rate on Zen 4. What it costs: the activations are rounded to 8
// bits, per row and block of 32, as llama.cpp (Q8_1) and vLLM's GGUF kernels also do:
// a = s * qa, qa in -127..127 (signed bytes), s = max|a| / 127, and S = s * sum(qa) per block.
//
// W [N, K] comes as panels of kInt8Panel = 32 outputs (layers/quantized.py, Int8Panels, packs them):
// per panel and block of 32 inputs, 8 groups of 4 inputs, each 32 outputs x 4 unsigned bytes,
// codes[p][b][g][j][e] = u(W[32p + j][32b + 4g + e]); then per panel and block two rows of 32
// floats, a scale d and a minimum m, with w = d * u + m: Q4's codes (0..15) and minimum as the
// file has them, Q8's codes + 128 (-128..127 made unsigned) and m = -128 d. Per output, row and
// block:
//
//   sum_j w_j a_j = sum_j (d u_j + m) s qa_j = s * d * sum_j u_j qa_j + m * S
//
// The micro-kernel computes kInt8Rows x 32 outputs: per group, two loads of W, kInt8Rows
// broadcasts of a row's 4 activation bytes and 2 * kInt8Rows vpdpbusd into int32 accumulators;
// per block, those become float with the scales above (4 vector operations for 8 vpdpbusd, so
// the gain over bf16 is about 1.3x, not 2x). Threads split the panels, as in panel_gemm.cpp.
//
// Exact channels: a few input channels of a projection (those whose activations calibration
// found largest, model/calibration.py) can be kept out of the rounding, as LLM.int8 does. The
// normed hidden state that QKV and gate/up read has such outlier channels: one of them in a
// block of 32 sets the block's scale and leaves its other 31 values a few steps each. Those
// channels are zeroed before rounding, and their bf16 values meet bf16 copies of their weight
// columns (pairs of channels, vdpbf16ps) in the tile's epilogue, a small addition to a tile's
// instructions.
//
// Entry points in int8_gemm.h; only where the compiler targets AVX512-VNNI (and AVX512-BF16, for
// the exact channels: every CPU that runs a bf16 model on panels has both).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "int8_gemm.h"
#include "madd_step.h"
#include "vec.h"

#ifdef CONVEYOR_INT8_GEMM
#include <immintrin.h>
#endif

namespace {

using conveyor::Int8Weight;
using conveyor::kGroups;
using conveyor::kInt8Block;
using conveyor::kInt8Panel;
using conveyor::QuantizedRows;

constexpr int64_t kPanelBlockBytes = kInt8Panel * kInt8Block;
constexpr int kInt8Rows = 5;  // 4 and 6 measured no better (20 registers of accumulators)
constexpr int64_t kInt8BlockRows = 32 * kInt8Rows;

#ifdef CONVEYOR_INT8_GEMM
inline uint16_t bf16_bits(uint16_t bits) { return bits; }
inline uint16_t bf16_bits(float x) {  // rounded to nearest even
  uint16_t bits;
  conveyor::store(x, &bits);
  return bits;
}

template <typename T>
void quantize_rows(QuantizedRows& out, const T* x, int64_t rows, int64_t k, int64_t x_stride,
                   const Int8Weight& w, int num_threads) {
  const int64_t blocks = k / kInt8Block;
  int8_t* codes = conveyor::at_least(out.codes, rows * k);
  float* scale = conveyor::at_least(out.scale, rows * blocks);
  float* sum = conveyor::at_least(out.sum, rows * blocks);
  uint16_t* exact = conveyor::at_least(out.exact, rows * w.n_exact);
  uint32_t* zeroed = conveyor::at_least(out.zeroed, blocks);
  std::fill(zeroed, zeroed + blocks, 0u);
  for (int64_t j = 0; j < w.n_exact; ++j)
    zeroed[w.exact[j] / kInt8Block] |= 1u << (w.exact[j] % kInt8Block);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < w.n_exact; ++j)
      exact[r * w.n_exact + j] = bf16_bits(x[r * x_stride + w.exact[j]]);
    for (int64_t b = 0; b < blocks; ++b) {
      const T* xb = x + r * x_stride + b * kInt8Block;
      __m512 lo = (__m512)conveyor::load(xb), hi = (__m512)conveyor::load(xb + 16);
      if (zeroed[b]) {
        lo = _mm512_maskz_mov_ps(static_cast<__mmask16>(~zeroed[b]), lo);
        hi = _mm512_maskz_mov_ps(static_cast<__mmask16>(~zeroed[b] >> 16), hi);
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // to nearest even
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      int8_t* qb = codes + r * k + b * kInt8Block;
      _mm_storeu_si128((__m128i*)qb, _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128((__m128i*)(qb + 16), _mm512_cvtsepi32_epi8(qhi));
      const float s = amax / 127.f;
      scale[r * blocks + b] = s;
      sum[r * blocks + b] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
  }
}

// y[0:R, 0:cols] (row stride ldy) from R quantized rows and one panel (cols <= kInt8Panel);
// ex: the rows' exact channels (n_exact apart), ew: the panel's exact weight pairs.
template <int R, typename T>
void int8_tile(T* y, int64_t ldy, const int8_t* q, const float* s, const float* s_sum,
               const uint8_t* codes, const float* d, const float* m, int64_t k, int64_t cols,
               const uint16_t* ex, const uint16_t* ew, int64_t n_exact) {
  const int64_t blocks = k / kInt8Block;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    const uint8_t* w = codes + b * kPanelBlockBytes;
    for (int g = 0; g < kGroups; ++g) {
      const __m512i w0 = _mm512_loadu_si512(w + g * 2 * 64), w1 = _mm512_loadu_si512(w + g * 2 * 64 + 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * k + b * kInt8Block + g * 4, sizeof four);
        const __m512i a = _mm512_set1_epi32(four);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, a);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, a);
      }
    }
    const float *db = d + b * kInt8Panel, *mb = m + b * kInt8Panel;
    for (int r = 0; r < R; ++r) {
      const __m512 sr = _mm512_set1_ps(s[r * blocks + b]);
      const __m512 sum_r = _mm512_set1_ps(s_sum[r * blocks + b]);
      for (int h = 0; h < 2; ++h) {
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][h]), _mm512_loadu_ps(db + 16 * h));
        acc[r][h] = _mm512_fmadd_ps(t, sr, acc[r][h]);
        acc[r][h] = _mm512_fmadd_ps(_mm512_loadu_ps(mb + 16 * h), sum_r, acc[r][h]);
      }
    }
  }
  for (int64_t j = 0; j < n_exact; j += 2) {
    const __m512bh w0 = conveyor::BF16::vector(ew + j * kInt8Panel);
    const __m512bh w1 = conveyor::BF16::vector(ew + j * kInt8Panel + 32);
    for (int r = 0; r < R; ++r) {
      const auto a = conveyor::BF16::broadcast(ex + r * n_exact + j);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, a);
    }
  }
  for (int r = 0; r < R; ++r) {
    T row[kInt8Panel];
    conveyor::store((conveyor::vfloat)acc[r][0], row);
    conveyor::store((conveyor::vfloat)acc[r][1], row + 16);
    std::memcpy(y + r * ldy, row, cols * sizeof(T));
  }
}

// y [m, w.n_out] = the quantized rows a [m, k] @ W^T.
template <typename T>
void int8_gemm_rows(T* y, const QuantizedRows& a, const Int8Weight& w, int64_t m, int64_t k,
                    int num_threads) {
  const int64_t n = w.n_out, blocks = k / kInt8Block;
  const int64_t panels = (n + kInt8Panel - 1) / kInt8Panel;
  for (int64_t r0 = 0; r0 < m; r0 += kInt8BlockRows) {
    const int64_t r1 = std::min(m, r0 + kInt8BlockRows);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const uint8_t* codes = w.codes + p * blocks * kPanelBlockBytes;
      const int64_t off = p * blocks * kInt8Panel;  // into the panel's scale rows
      const int64_t cols = std::min<int64_t>(kInt8Panel, n - p * kInt8Panel);
      auto tile = [&](auto rows, int64_t r) {
        int8_tile<decltype(rows)::value>(y + r * n + p * kInt8Panel, n, a.codes.data() + r * k,
                                         a.scale.data() + r * blocks, a.sum.data() + r * blocks,
                                         codes, w.scale + off, w.minimum + off, k, cols,
                                         a.exact.data() + r * w.n_exact,
                                         w.exact_weights + p * w.n_exact * kInt8Panel, w.n_exact);
      };
      int64_t r = r0;
      for (; r + kInt8Rows <= r1; r += kInt8Rows) tile(std::integral_constant<int, kInt8Rows>{}, r);
      conveyor::with_constant<kInt8Rows - 1>(r1 - r, [&](auto rows) { tile(rows, r); });
    }
  }
}

#endif  // CONVEYOR_INT8_GEMM

template <typename T>
void quantized_matmul(T* y, const T* x, const Int8Weight& w, int64_t m, int64_t k,
                      int64_t x_stride, QuantizedRows& scratch, int num_threads) {
#ifdef CONVEYOR_INT8_GEMM
  quantize_rows(scratch, x, m, k, x_stride, w, num_threads);
  int8_gemm_rows(y, scratch, w, m, k, num_threads);
#else
  std::abort();  // ops.cpp and the Python side never call it in such a build
#endif
}

}  // namespace

namespace conveyor {

void int8_matmul(float* y, const float* x, const Int8Weight& w, int64_t m, int64_t k,
                 int64_t x_stride, QuantizedRows& scratch, int num_threads) {
  quantized_matmul(y, x, w, m, k, x_stride, scratch, num_threads);
}

void int8_matmul(uint16_t* y, const uint16_t* x, const Int8Weight& w, int64_t m, int64_t k,
                 int64_t x_stride, QuantizedRows& scratch, int num_threads) {
  quantized_matmul(y, x, w, m, k, x_stride, scratch, num_threads);
}

}  // namespace conveyor

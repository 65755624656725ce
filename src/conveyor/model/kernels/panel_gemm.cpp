// y = x @ W^T on the CPU, W packed once into column panels: the dense matmuls of a float32
// model, and of a bf16 one where the CPU has AVX512-BF16, from one decode row to a 4,096-token
// prefill.
//
// W [N, K] is stored as panels of kPanel = 2 * kLanes output columns (32 with AVX-512), each
// panel K-major:
//
// * float32: panel p holds W[p * kPanel + j][k] at [p][k][j];
// * bf16: pairs of consecutive k side by side, W[p * kPanel + j][2i + e] at [p][i][j][e], the
//   operand layout of vdpbf16ps (each float lane accumulates a pair of bf16 products).
//
// Columns past N are zero. Packing is a reshape that kernels/panel_gemm.py does with torch at
// load time.
//
// The micro-kernel computes a kRows x kPanel tile of y over the whole of K in 2 * kRows vector
// accumulators (12 registers): per step of K (one k in float32, a pair in bf16), two vector
// loads of W, kRows broadcasts of x and 2 * kRows multiply-adds. Threads split the panels, so
// each thread streams its part of W once per block of kBlockRows rows; a block's rows of x (up
// to 192 x K) stay in L2 while the panels pass. It outran oneDNN's packed GEMM in float32 on
// AVX2 and in bf16 on AVX512-BF16 (without AMX) from one row to thousands (docs/performance.md).
//
// Entry points in panel_gemm.h; ops.cpp makes them torch operators (build.py builds both).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "madd_step.h"
#include "panel_gemm.h"
#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kRows = 6;  // bf16 on Zen 4: 4, 8 and 12 rows measured no better
constexpr int64_t kBlockRows = 32 * kRows;
// Below this many rows a matmul is bound by reading W, and prefetching the next panel on top of
// the hardware's own prefetch only competes with it for bandwidth.
constexpr int64_t kPanelPrefetchRows = 24;

// A tile row's first `cols` outputs, in T (bf16 rounded to nearest even).
template <typename T>
inline void store_row(const vfloat* acc, T* y, int64_t cols) {
  T row[kPanel];
  store(acc[0], row);
  store(acc[1], row + kLanes);
  std::memcpy(y, row, cols * sizeof(T));
}

// y[0:R, 0:cols] (row stride ldy) = x[0:R, :] (row stride k) @ panel^T, cols <= kPanel.
// Meanwhile, cache lines [first, last) of `next` (a panel, or null) are prefetched into L2,
// spread evenly over the steps of K.
template <class F, int R>
void tile(typename F::T* y, int64_t ldy, const typename F::T* x, const typename F::T* panel,
          int64_t k, int64_t cols, const typename F::T* next, int64_t first, int64_t last) {
  constexpr int64_t kStepElems = kPanel * F::kStep;  // W's elements per step of K
  constexpr int64_t kLineElems = 64 / sizeof(typename F::T);
  const int64_t steps = k / F::kStep, lines = next ? last - first : 0;
  const typename F::T* line = next ? next + first * kLineElems : nullptr;
  int64_t due = 0;  // Bresenham: `lines` prefetches over `steps` steps
  vfloat acc[R][2] = {};
  for (int64_t i = 0; i < k; i += F::kStep) {
    const typename F::T* w = panel + i * kPanel;
    for (due += lines; due >= steps; due -= steps, line += kLineElems)
      __builtin_prefetch(line, 0, 2);
    const auto w0 = F::vector(w), w1 = F::vector(w + kStepElems / 2);
    madd_rows<F>(acc, x + i, k, w0, w1);
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], y + r * ldy, cols);
}

template <class F>
void gemm(typename F::T* y, const typename F::T* x, const typename F::T* packed, int64_t m,
          int64_t n, int64_t k, int num_threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
    const int64_t r1 = std::min(m, r0 + kBlockRows);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const typename F::T* panel = packed + p * k * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      typename F::T* yp = y + p * kPanel;
      // The first tile streams this panel from memory; meanwhile the thread's next panel
      // (static schedule: p + 1) is fetched into L2, a share of its lines in each tile.
      const bool prefetch = p + 1 < panels && r1 - r0 >= kPanelPrefetchRows;
      const typename F::T* next = prefetch ? panel + k * kPanel : nullptr;
      const int64_t lines = k * kPanel * sizeof(typename F::T) / 64;
      const int64_t tiles = (r1 - r0 + kRows - 1) / kRows;
      int64_t r = r0;
      for (int64_t t = 0; r + kRows <= r1; r += kRows, ++t)
        tile<F, kRows>(yp + r * n, n, x + r * k, panel, k, cols, next, t * lines / tiles,
                       (t + 1) * lines / tiles);
      with_constant<kRows - 1>(r1 - r, [&](auto rows) {  // leftover rows, a tile of their height
        tile<F, decltype(rows)::value>(yp + r * n, n, x + r * k, panel, k, cols, next,
                                       (tiles - 1) * lines / tiles, lines);
      });
    }
  }
}

#ifdef __AVX2__
// The same products over a weight kept as a GGUF file's blocks of 32 along K (4-bit: w = d q + m;
// 8-bit: w = d q), laid out by panels (layers/quantized.py's BlockPanels): each step of K
// converts the codes of its kPanel outputs to exactly the values pack_panels holds (the file's
// float32 dequantization, q d being exact, then rounded to bf16 for bf16 panels) and feeds them to
// the very loop of `tile`, so that every output is the same chain of multiply-adds as on the
// panels, bit for bit, at a quarter (4-bit) or half (8-bit) of bf16's bytes. Per panel and block:
// d (and m) for its kPanel outputs, then the codes of each step of K:
//
// * bf16 (AVX512-BF16), a step = a pair of k: 64 codes in the order of the panel's two vectors
//   (word 2j + e: output j, k = 2i + e); 4-bit: byte t holds word t (low nibble) and word 32 + t
//   (high);
// * float32, a step = one k: kPanel codes, output j; 4-bit: byte t holds outputs t and
//   kLanes + t (one vector's worth each).
#ifdef __AVX512F__
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
// A float vector's worth of codes (kLanes bytes) as int32 lanes.
inline __m512i widen_unsigned(const uint8_t* p) { return _mm512_cvtepu8_epi32(load16(p)); }
inline __m512i widen_signed(const uint8_t* p) { return _mm512_cvtepi8_epi32(load16(p)); }
inline vfloat fmadd(__m512i q, __m512 d, __m512 m) {
  return (vfloat)_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
}
inline vfloat times(__m512i q, __m512 d) { return (vfloat)_mm512_mul_ps(_mm512_cvtepi32_ps(q), d); }
inline __m512i low_nibbles(__m512i q) { return _mm512_and_si512(q, _mm512_set1_epi32(0xF)); }
inline __m512i high_nibbles(__m512i q) { return _mm512_srli_epi32(q, 4); }
using vnative = __m512;
inline vnative load_native(const float* p) { return _mm512_loadu_ps(p); }
#else
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64((const __m128i*)p); }
inline __m256i widen_unsigned(const uint8_t* p) { return _mm256_cvtepu8_epi32(load8(p)); }
inline __m256i widen_signed(const uint8_t* p) { return _mm256_cvtepi8_epi32(load8(p)); }
inline vfloat fmadd(__m256i q, __m256 d, __m256 m) {
  return (vfloat)_mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}
inline vfloat times(__m256i q, __m256 d) { return (vfloat)_mm256_mul_ps(_mm256_cvtepi32_ps(q), d); }
inline __m256i low_nibbles(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi32(0xF)); }
inline __m256i high_nibbles(__m256i q) { return _mm256_srli_epi32(q, 4); }
using vnative = __m256;
inline vnative load_native(const float* p) { return _mm256_loadu_ps(p); }
#endif

// One block's steps: STEP() returns the two vectors of W a step of K multiplies.
template <class F, bool kFour>
struct BlockSteps;

template <bool kFour>
struct BlockSteps<F32, kFour> {
  static constexpr int64_t kStepBytes = kFour ? kLanes : kPanel, kSteps = 32;
  vnative d[2], m[2];
  const uint8_t* c;
  BlockSteps(const BlockPanel& w, int64_t panel, int64_t b) {
    const int64_t at = (panel * w.blocks + b) * kPanel;
    c = w.codes + (panel * w.blocks + b) * kSteps * kStepBytes;
    for (int h = 0; h < 2; ++h) {
      d[h] = load_native(w.scale + at + kLanes * h);
      if constexpr (kFour) m[h] = load_native(w.minimum + at + kLanes * h);
    }
  }
  void step(int64_t s, vfloat& w0, vfloat& w1) const {
    const uint8_t* p = c + s * kStepBytes;
    if constexpr (kFour) {
      const auto q = widen_unsigned(p);
      w0 = fmadd(low_nibbles(q), d[0], m[0]);
      w1 = fmadd(high_nibbles(q), d[1], m[1]);
    } else {
      w0 = times(widen_signed(p), d[0]);
      w1 = times(widen_signed(p + kLanes), d[1]);
    }
  }
};

#ifdef __AVX512BF16__
template <bool kFour>
struct BlockSteps<BF16, kFour> {
  static constexpr int64_t kStepBytes = kFour ? 32 : 64, kSteps = 16;
  __m512 d[4], m[4];  // per word of a step's four float vectors: outputs 8v .. 8v + 7, twice
  const uint8_t* c;
  BlockSteps(const BlockPanel& w, int64_t panel, int64_t b) {
    const int64_t at = (panel * w.blocks + b) * kPanel;
    c = w.codes + (panel * w.blocks + b) * kSteps * kStepBytes;
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int h = 0; h < 2; ++h) {
      const __m512 dh = _mm512_loadu_ps(w.scale + at + 16 * h);
      d[2 * h] = _mm512_permutexvar_ps(lo, dh);
      d[2 * h + 1] = _mm512_permutexvar_ps(hi, dh);
      if constexpr (kFour) {
        const __m512 mh = _mm512_loadu_ps(w.minimum + at + 16 * h);
        m[2 * h] = _mm512_permutexvar_ps(lo, mh);
        m[2 * h + 1] = _mm512_permutexvar_ps(hi, mh);
      }
    }
  }
  void step(int64_t s, __m512bh& w0, __m512bh& w1) const {
    const uint8_t* p = c + s * kStepBytes;
    vfloat f[4];  // words 16v .. 16v + 15
    if constexpr (kFour) {
      const __m512i first = widen_unsigned(p), second = widen_unsigned(p + 16);
      f[0] = fmadd(low_nibbles(first), d[0], m[0]);
      f[1] = fmadd(low_nibbles(second), d[1], m[1]);
      f[2] = fmadd(high_nibbles(first), d[2], m[2]);
      f[3] = fmadd(high_nibbles(second), d[3], m[3]);
    } else {
      for (int v = 0; v < 4; ++v) f[v] = times(widen_signed(p + 16 * v), d[v]);
    }
    // round to nearest even, as torch's .to(bfloat16)
    w0 = _mm512_cvtne2ps_pbh((__m512)f[1], (__m512)f[0]);
    w1 = _mm512_cvtne2ps_pbh((__m512)f[3], (__m512)f[2]);
  }
};
#endif

// `tile`'s loop, W's vectors converted from a BlockPanel's codes.
template <class F, bool kFour, int R>
void block_tile(typename F::T* y, int64_t ldy, const typename F::T* x, const BlockPanel& w,
                int64_t panel, int64_t k, int64_t cols) {
  using Steps = BlockSteps<F, kFour>;
  vfloat acc[R][2] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    const Steps steps(w, panel, b);
    for (int64_t s = 0; s < Steps::kSteps; ++s) {
      const int64_t i = b * 32 + s * F::kStep;
      decltype(F::vector(x)) w0, w1;
      steps.step(s, w0, w1);
      madd_rows<F>(acc, x + i, k, w0, w1);
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], y + r * ldy, cols);
}

template <class F, bool kFour>
void block_gemm(typename F::T* y, const typename F::T* x, const BlockPanel& w, int64_t m,
                int64_t n, int64_t k, int num_threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
    const int64_t r1 = std::min(m, r0 + kBlockRows);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      typename F::T* yp = y + p * kPanel;
      int64_t r = r0;
      for (; r + kRows <= r1; r += kRows)
        block_tile<F, kFour, kRows>(yp + r * n, n, x + r * k, w, p, k, cols);
      with_constant<kRows - 1>(r1 - r, [&](auto rows) {
        block_tile<F, kFour, decltype(rows)::value>(yp + r * n, n, x + r * k, w, p, k, cols);
      });
    }
  }
}

template <class F>
void block_panels(typename F::T* y, const typename F::T* x, const BlockPanel& w, int64_t m,
                  int64_t n, int64_t k, int num_threads) {
  if (w.minimum)
    block_gemm<F, true>(y, x, w, m, n, k, num_threads);
  else
    block_gemm<F, false>(y, x, w, m, n, k, num_threads);
}
#endif  // __AVX2__

}  // namespace

namespace conveyor {

// A build without bf16 (or without AVX2, for BlockPanels) aborts there: ops.cpp and the Python
// side never call it so.

template <typename T>
void panel_gemm(T* y, const T* x, const T* packed, int64_t m, int64_t n, int64_t k,
                int num_threads) {
  if constexpr (std::is_same_v<T, float>) return gemm<F32>(y, x, packed, m, n, k, num_threads);
#ifdef __AVX512BF16__
  else return gemm<BF16>(y, x, packed, m, n, k, num_threads);
#endif
  std::abort();
}

template <typename T>
void block_panel_gemm(T* y, const T* x, const BlockPanel& w, int64_t m, int64_t n, int64_t k,
                      int num_threads) {
#ifdef __AVX2__
  if constexpr (std::is_same_v<T, float>) return block_panels<F32>(y, x, w, m, n, k, num_threads);
#endif
#ifdef __AVX512BF16__
  else return block_panels<BF16>(y, x, w, m, n, k, num_threads);
#endif
  std::abort();
}

template void panel_gemm<float>(float*, const float*, const float*, int64_t, int64_t, int64_t,
                                int);
template void panel_gemm<uint16_t>(uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t,
                                   int64_t, int);
template void block_panel_gemm<float>(float*, const float*, const BlockPanel&, int64_t, int64_t,
                                      int64_t, int);
template void block_panel_gemm<uint16_t>(uint16_t*, const uint16_t*, const BlockPanel&, int64_t,
                                         int64_t, int64_t, int);

}  // namespace conveyor

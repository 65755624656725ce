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
// AVX2 and in bf16 on AVX512-BF16 (without AMX) from one row to thousands (docs/performance.md,
// changes 19 and 28; the next panel's prefetch, change 35).
//
// Built and loaded as ops.cpp's torch operators (build.py).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "madd_step.h"
#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kPanel = 2 * kLanes;
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
    for (int r = 0; r < R; ++r) {
      const auto xr = F::broadcast(x + r * k + i);
      F::madd(acc[r][0], xr, w0);
      F::madd(acc[r][1], xr, w1);
    }
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

}  // namespace

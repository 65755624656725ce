// y = x @ W^T in float32 (CPU), W packed once into column panels: the dense matmuls of a
// float32 model, from one decode row to a 4,096-token prefill.
//
// W [N, K] is stored as panels of kPanel = 2 * kLanes output columns, each panel K-major:
// panel p holds W[p * kPanel + j][k] at [p][k][j] (columns past N are zero). Packing is a
// reshape that layers/linear.py does with torch at load time.
//
// The micro-kernel computes a kRows x kPanel tile of y over the whole of K in 2 * kRows vector
// accumulators (12 of AVX2's 16 registers): per k, two vector loads of W, kRows broadcasts of
// x and 2 * kRows fused multiply-adds. Threads split the panels, so each thread streams its
// part of W once per block of kBlockRows rows; a block's rows of x (up to 192 x K floats) stay
// in L2 while the panels pass. On the 2-core AVX2 machine this ran at 163-187 GFLOP/s against
// 124-160 for oneDNN's packed float32 GEMM, from 64 to 4,096 rows (docs/performance.md).
//
// Built and loaded like paged_attention.cpp.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kPanel = 2 * kLanes;
constexpr int kRows = 6;
constexpr int64_t kBlockRows = 32 * kRows;

inline vfloat splat(float x) { return x - vfloat{}; }  // one vbroadcastss; `vfloat{} + x` is two

// y[0:R, 0:cols] (row stride ldy) = x[0:R, :] (row stride k) @ panel^T, cols <= kPanel.
// `next`: a panel to prefetch into L2 meanwhile (a step's row of it), or null.
template <int R>
void tile(float* y, int64_t ldy, const float* x, const float* panel, int64_t k, int64_t cols,
          const float* next) {
  vfloat acc[R][2] = {};
  for (int64_t i = 0; i < k; ++i) {
    if (next)
      for (int line = 0; line < kPanel; line += 16)  // 16 floats: one cache line
        __builtin_prefetch(next + i * kPanel + line, 0, 2);
    const vfloat w0 = load(panel + i * kPanel), w1 = load(panel + i * kPanel + kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat xr = splat(x[r * k + i]);
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    store(acc[r][0], row);
    store(acc[r][1], row + kLanes);
    std::memcpy(y + r * ldy, row, cols * sizeof(float));
  }
}

}  // namespace

extern "C" int panel_gemm_width() { return kPanel; }

// y [m, n] = x [m, k] @ W^T, both contiguous; packed: W as above, ceil(n / kPanel) panels.
extern "C" void panel_gemm_f32(float* y, const float* x, const float* packed, int64_t m,
                               int64_t n, int64_t k, int num_threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
    const int64_t r1 = std::min(m, r0 + kBlockRows);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const float* panel = packed + p * k * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      float* yp = y + p * kPanel;
      // The first tile streams this panel from memory; it also fetches the thread's next one
      // (static schedule: p + 1) into L2, so that one does not wait on memory (2-3% at 64 rows).
      const float* next = p + 1 < panels ? panel + k * kPanel : nullptr;
      int64_t r = r0;
      for (; r + kRows <= r1; r += kRows, next = nullptr)
        tile<kRows>(yp + r * n, n, x + r * k, panel, k, cols, next);
      with_constant<kRows - 1>(r1 - r, [&](auto rows) {  // leftover rows, a tile of their height
        tile<decltype(rows)::value>(yp + r * n, n, x + r * k, panel, k, cols, nullptr);
      });
    }
  }
}

// The panel GEMM's entry points (panel_gemm.cpp): y = x @ W^T, W packed once into column panels
// (kernels/panel_gemm.py's pack_panels) or kept as a GGUF file's blocks laid out by panels
// (layers/quantized.py's BlockPanels). T is float, or bf16 stored as uint16_t.

#pragma once

#include <cstdint>

#include "vec.h"

namespace conveyor {

constexpr int kPanel = 2 * kLanes;  // outputs per panel: two vectors

// A weight as BlockPanels holds it.
struct BlockPanel {
  const uint8_t* codes;
  const float* scale;
  const float* minimum;  // null: 8-bit
  int64_t blocks;  // K / 32
};

// y [m, n] = x [m, k] @ W^T, W packed in x's type (bf16 panels: a build targeting AVX512-BF16).
template <typename T>
void panel_gemm(T* y, const T* x, const T* packed, int64_t m, int64_t n, int64_t k,
                int num_threads);

// The same products over BlockPanels, the same bits (float32: a build targeting AVX2; bf16:
// AVX512-BF16).
template <typename T>
void block_panel_gemm(T* y, const T* x, const BlockPanel& w, int64_t m, int64_t n, int64_t k,
                      int num_threads);

}  // namespace conveyor

// The block matmul's entry points (block_matmul.cpp): y = x @ W^T for a few rows x and a weight W
// kept as a GGUF file's blocks of 32 along K. T is float, or bf16 stored as uint16_t.

#pragma once

#include <cstdint>

namespace conveyor {

// y [rows, n_out] = x [rows, k] (row stride x_stride) @ W^T, W given as 4-bit codes
// [n_out, k / 2] (GGUF nibble order) with a scale and a minimum per block [n_out, k / 32], or
// as 8-bit codes [n_out, k] with a scale and no minimum (null).
void block_matmul(float* y, const float* x, const uint8_t* codes, const float* scale,
                  const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
                  int num_threads);
void block_matmul(uint16_t* y, const uint16_t* x, const uint8_t* codes, const float* scale,
                  const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
                  int num_threads);

}  // namespace conveyor

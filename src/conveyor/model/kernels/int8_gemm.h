// The int8 GEMM's entry points (int8_gemm.cpp): y = x @ W^T with W as layers/quantized.py's
// Int8Panels and x rounded to 8 bits per block of 32. T is float, or bf16 stored as uint16_t.

#pragma once

#include <cstdint>
#include <vector>

// What the GEMM needs: the builds without it abort in int8_matmul (ops.cpp refuses first).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define CONVEYOR_INT8_GEMM 1
#endif

namespace conveyor {

constexpr int kInt8Panel = 32;  // outputs per panel: two vectors of int32 lanes
constexpr int kInt8Block = 32;  // inputs per scale block
constexpr int kGroups = kInt8Block / 4;  // vpdpbusd sums products in fours

struct Int8Weight {  // a projection as Int8Panels holds it
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  int64_t n_out;
  // Exact channels (n_exact: even, may be 0): their indices, and per panel their weight columns
  // as bf16 pairs [n_exact / 2][kInt8Panel][2] (vdpbf16ps's operand order).
  const int32_t* exact;
  const uint16_t* exact_weights;
  int64_t n_exact;
};

// Activations rounded to 8 bits: rows x k signed bytes, and per row and block the scale s and
// S = s * sum(qa); the exact channels' values in bf16, rows x n_exact. Reused across calls
// (conveyor::at_least); quantize_rows writes every element the GEMM reads.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scale, sum;
  std::vector<uint16_t> exact;
  std::vector<uint32_t> zeroed;  // per block, a bit per exact channel in it
};

// y [m, w.n_out] = x [m, k] (row stride x_stride) @ W^T, through `scratch`.
void int8_matmul(float* y, const float* x, const Int8Weight& w, int64_t m, int64_t k,
                 int64_t x_stride, QuantizedRows& scratch, int num_threads);
void int8_matmul(uint16_t* y, const uint16_t* x, const Int8Weight& w, int64_t m, int64_t k,
                 int64_t x_stride, QuantizedRows& scratch, int num_threads);

}  // namespace conveyor

// The integer block GEMM's entry points (int8_blocks.cpp): y = x @ W^T for a weight kept as a GGUF
// file's own bytes, x rounded to 8 bits per row and block of 32, products summed as integers.
// T is float, or bf16 stored as uint16_t.

#pragma once

#include <cstdint>
#include <vector>

namespace conveyor {

constexpr int kActBlock = 32;  // activations per 8-bit scale

// Rows of a weight in one GGUF type (quant_panels.h's QuantFormat ids): the file's bytes by
// panels of int8_panel_lanes() outputs (the last panel padded with zero bytes), a permutation of
// them that adds none. Per panel, per block along K, its outputs' blocks side by side: the scale
// bytes as 16-bit units [units][lanes][2], then the code bytes (the rest of the block, before or
// after them) as 4-byte groups [groups][lanes][4], so that one vector load gives a group of every
// output of the panel (kernels/int8_blocks.py's pack_panels).
struct Int8BlockPart {
  int64_t format;
  const uint8_t* data;
  int64_t n_out;
};

// Outputs per panel of this build's layout.
int int8_panel_lanes();

// Bytes of one block of `format` and its weights along K (`block`); 0 for a type the kernel
// does not read.
int64_t int8_block_bytes(int64_t format, int64_t& block);

// Activations rounded to 8 bits: per row and block of 32, q = rint(x / d) with d = max|x| / 127,
// the scale d, S = d * sum(q), and the sums of q over each half of 16. Reused across calls
// (conveyor::at_least); int8_rows writes every element the GEMM reads.
struct Int8Rows {
  std::vector<int8_t> codes;  // rows x k
  std::vector<float> scale, sum;  // rows x k / 32
  std::vector<int32_t> halves;  // rows x k / 32 x 2
};

// Rounds x [rows, k] (row stride x_stride; k a multiple of 32) into `out`.
template <typename T>
void int8_rows(Int8Rows& out, const T* x, int64_t rows, int64_t k, int64_t x_stride,
               int num_threads);

// y [m, w.n_out] (row stride ldy) = the rounded rows a [m, k] @ W^T.
template <typename T>
void int8_block_gemm(T* y, int64_t ldy, const Int8Rows& a, const Int8BlockPart& w, int64_t m,
                     int64_t k, int num_threads);

// y [m, sum of the parts' n_out] (contiguous) = x [m, k] @ W^T, W's parts in output order:
// x rounded once into `scratch`, then each part into its columns.
template <typename T>
void int8_block_matmul(T* y, const T* x, int64_t x_stride, const Int8BlockPart* parts,
                       int count, int64_t m, int64_t k, Int8Rows& scratch, int num_threads);

}  // namespace conveyor

// The quant-panel GEMM's entry points (quant_panels.cpp): y = x @ W^T for a weight kept as a
// GGUF file's quantized blocks of any type below, repacked by panels (layers/gguf_blocks.py's
// QuantPanels) without adding a byte. T is float, or bf16 stored as uint16_t.

#pragma once

#include <cstdint>

namespace conveyor {

// GGUF's type ids (ggml_type) of the formats the kernel reads.
enum QuantFormat : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

// A format's geometry: weights per block along K, the file's scale bytes per block and output
// (kept as they are), and code bits per weight (4 low bits as nibbles, the rest above them).
struct QuantLayout {
  int64_t block, header_bytes, code_bits;
};

// Its layout; false for a type the kernel does not read.
bool quant_layout(int64_t format, QuantLayout& layout);

// A block's float32 s[sub], m[sub] (m: 0 where the type has none), from its scale bytes `header`
// (the file's bytes [header start, header start + header_bytes) of the block), as gguf computes
// them; the format must be one quant_layout takes.
void quant_scales(int64_t format, const uint8_t* header, float* s, float* m);

// Bytes of one step of K (one k, the kPanel outputs of a panel) in the codes.
int64_t quant_step_bytes(const QuantLayout& layout);

// A weight [n, k] as QuantPanels holds it: per panel of kPanel outputs, `codes` [k, step bytes]
// (k ascending) and `header` [k / block, kPanel, header bytes] (the file's scale bytes).
struct QuantPanel {
  int64_t format;
  const uint8_t* codes;
  const uint8_t* header;
};

// y [m, n] (row stride ldy) = x [m, k] (row stride x_stride) @ W^T: each output the panel GEMM's
// chain of multiply-adds over the file's float32 dequantized weight (rounded to bf16 for bf16
// activations, where the build targets AVX512-BF16; elsewhere bf16 rows are widened to float32
// and the weight stays float32), so the bits of panel_gemm over that weight.
template <typename T>
void quant_panel_gemm(T* y, int64_t ldy, const T* x, int64_t x_stride, const QuantPanel& w,
                      int64_t m, int64_t n, int64_t k, int num_threads);

}  // namespace conveyor

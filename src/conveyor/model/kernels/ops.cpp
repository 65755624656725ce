// The kernels as typed torch operators: torch.ops.conveyor.<name> (the library's namespace is
// CONVEYOR_OPS_NAMESPACE, so that builds for other targets load beside it in one process); the
// one-call decode layers' class and operator are decode_layers_op.cpp's.
//
// Every entry point takes at::Tensor arguments and checks each one's dtype, shape, contiguity
// (and, where a kernel indexes memory by them, the values of index tensors) before the raw
// call, failing with a RuntimeError that names the argument: a mismatch never reaches the
// kernels' pointer arithmetic (tensor_checks.h declares the checks). The kernels are their own
// translation units (their entry points in the headers below); this and decode_layers_op.cpp
// are the only ones that include torch's headers, which are slow to compile. build.py builds
// and links them once per CPU, target and compiler.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "block_matmul.h"
#include "decode_layer.h"
#include "fused_ops.h"
#include "int8_blocks.h"
#include "lora.h"
#include "paged_attention.h"
#include "panel_gemm.h"
#include "quant_panels.h"
#include "tensor_checks.h"
#include "vec.h"

namespace conveyor::ops {

using namespace conveyor;
using at::ScalarType;
using at::Tensor;

// torch's Python names, as error messages should read.
const char* dtype_name(ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

void check_dtype(const Tensor& t, const char* name, ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, name, " must be ", dtype_name(want), ", got ",
              dtype_name(t.scalar_type()));
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

void check_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

void check_shape(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

// A CPU tensor of `want`, `shape` and contiguous: a weight or an index tensor.
void check_tensor(const Tensor& t, const char* name, ScalarType want, at::IntArrayRef shape) {
  check_cpu(t, name);
  check_dtype(t, name, want);
  check_shape(t, name, shape);
  check_contiguous(t, name);
}

// Activations: float32, or bf16 (handed to the kernels as uint16_t).
void check_activation_dtype(const Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", dtype_name(t.scalar_type()));
}

void check_multiple(int64_t value, int64_t of, const char* what) {
  TORCH_CHECK(value % of == 0, what, " must be a multiple of ", of, ", got ", value);
}

// Rows with unit stride: 2-D, the last dimension packed (a row stride is passed on).
Tensor unit_stride_rows(const Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D, got shape ", x.sizes());
  return x.stride(1) == 1 ? x : x.contiguous();
}


std::vector<std::string> features_op() {
  std::vector<std::string> out;
#ifdef __AVX2__
  out.push_back("avx2");
#endif
#ifdef __AVX512F__
  out.push_back("avx512f");
#endif
#ifdef __AVX512BF16__
  out.push_back("avx512bf16");
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  out.push_back("avx512vnni");
#elif defined(__AVXVNNI__)
  out.push_back("avxvnni");
#endif
  return out;
}

int64_t panel_width_op() { return kPanel; }
int64_t int8_panel_lanes_op() { return int8_panel_lanes(); }

// ---- panel_gemm.cpp ----

void check_panels(const Tensor& packed, const char* name, ScalarType dtype, int64_t n,
                  int64_t k) {
  const int64_t pair = dtype == at::kBFloat16 ? 2 : 1;
#ifndef __AVX512BF16__
  TORCH_CHECK(dtype != at::kBFloat16, name, ": bf16 panels need a build targeting AVX512-BF16");
#endif
  check_multiple(k, pair, "the input size of bf16 panels");
  check_tensor(packed, name, dtype, {(n + kPanel - 1) / kPanel, k / pair, kPanel * pair});
}

Tensor panel_gemm_op(const Tensor& x_in, const Tensor& packed, int64_t n) {
  check_activation_dtype(x_in, "x");
  const Tensor x = unit_stride_rows(x_in, "x").contiguous();
  TORCH_CHECK(packed.dim() == 3, "packed must be 3-D, got shape ", packed.sizes());
  const int64_t k = packed.size(1) * (is_bf16(x) ? 2 : 1);
  TORCH_CHECK(x.size(1) == k, "x must have ", k, " columns (packed's input size), got ",
              x.size(1));
  TORCH_CHECK(n > 0, "n must be positive, got ", n);
  check_panels(packed, "packed", x.scalar_type(), n, k);
  Tensor y = at::empty({x.size(0), n}, x.options());
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    panel_gemm(data<T>(y), data<const T>(x), data<const T>(packed), x.size(0), n, k, threads());
  });
  return y;
}

// BlockPanels (layers/quantized.py) of an [n, k] weight: 4-bit codes [n, k / 2] uint8 with
// minimum given, 8-bit codes [n, k] int8 without; scale (and minimum) [n, k / 32] float32.
void check_block_panels(const Tensor& codes, const Tensor& scale,
                        const std::optional<Tensor>& minimum, const char* prefix, ScalarType dtype,
                        int64_t n, int64_t k) {
  const std::string p(prefix);
#ifndef __AVX2__
  TORCH_CHECK(false, p + "codes: BlockPanels need a build targeting AVX2");
#endif
#ifndef __AVX512BF16__
  TORCH_CHECK(dtype != at::kBFloat16, p + "codes: bf16 BlockPanels need a build targeting "
              "AVX512-BF16");
#endif
  check_multiple(k, 32, "the input size of BlockPanels");
  check_multiple(n, kPanel, "the output size of BlockPanels");
  if (minimum) {
    check_tensor(codes, (p + "codes").c_str(), at::kByte, {n, k / 2});
    check_tensor(*minimum, (p + "minimum").c_str(), at::kFloat, {n, k / 32});
  } else {
    check_tensor(codes, (p + "codes").c_str(), at::kChar, {n, k});
  }
  check_tensor(scale, (p + "scale").c_str(), at::kFloat, {n, k / 32});
}

Tensor block_panel_gemm_op(const Tensor& x_in, const Tensor& codes, const Tensor& scale,
                           const std::optional<Tensor>& minimum) {
  check_activation_dtype(x_in, "x");
  const Tensor x = unit_stride_rows(x_in, "x").contiguous();
  TORCH_CHECK(scale.dim() == 2, "scale must be 2-D, got shape ", scale.sizes());
  const int64_t n = scale.size(0), k = scale.size(1) * 32;
  TORCH_CHECK(x.size(1) == k, "x must have ", k, " columns (32 per scale column), got ",
              x.size(1));
  check_block_panels(codes, scale, minimum, "", x.scalar_type(), n, k);
  Tensor y = at::empty({x.size(0), n}, x.options());
  const BlockPanel w{data<const uint8_t>(codes), data<const float>(scale),
                     minimum ? data<const float>(*minimum) : nullptr, k / 32};
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    block_panel_gemm(data<T>(y), data<const T>(x), w, x.size(0), n, k, threads());
  });
  return y;
}

// ---- block_matmul.cpp ----

// 4-bit blocks (minimum given; NibbleInt4) or 8-bit ones (Int8Blocks) of an [n, k] weight.
void check_blocks(const Tensor& codes, const Tensor& scale, const std::optional<Tensor>& minimum,
                  const char* prefix, int64_t k) {
  const std::string p(prefix);
  check_multiple(k, kActBlock, "the input size of block weights");
  TORCH_CHECK(codes.dim() == 2, p + "codes must be 2-D, got shape ", codes.sizes());
  const int64_t n = codes.size(0);
  if (minimum) {
    check_tensor(codes, (p + "codes").c_str(), at::kByte, {n, k / 2});
    check_tensor(*minimum, (p + "minimum").c_str(), at::kFloat, {n, k / kActBlock});
  } else {
    check_tensor(codes, (p + "codes").c_str(), at::kChar, {n, k});
  }
  check_tensor(scale, (p + "scale").c_str(), at::kFloat, {n, k / kActBlock});
}

Tensor block_matmul_op(const Tensor& x_in, const Tensor& codes, const Tensor& scale,
                    const std::optional<Tensor>& minimum) {
  check_activation_dtype(x_in, "x");
  const Tensor x = unit_stride_rows(x_in, "x");
  check_blocks(codes, scale, minimum, "", x.size(1));
  const int64_t rows = x.size(0), n = codes.size(0), k = x.size(1);
  Tensor y = at::empty({rows, n}, x.options());
  const float* min = minimum ? data<const float>(*minimum) : nullptr;
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    block_matmul(data<T>(y), data<const T>(x), data<const uint8_t>(codes),
                 data<const float>(scale), min, rows, n, k, x.stride(0), threads());
  });
  return y;
}

// ---- quant_panels.cpp ----

// QuantPanels (layers/gguf_blocks.py) of an [n, k] weight of GGUF type `format`.
QuantLayout check_quant_panels(int64_t format, const Tensor& codes, const Tensor& header,
                               const char* prefix, int64_t n, int64_t k) {
  const std::string p(prefix);
  QuantLayout layout{};
  TORCH_CHECK(quant_layout(format, layout), p + "format must be a GGUF type id of Q4_0, Q4_1, "
              "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (2, 3, 6, 7, 8, 12, 13, 14), got ", format);
  TORCH_CHECK(n > 0, p + "n must be positive, got ", n);
  check_multiple(k, layout.block, (p + "the input size of these blocks").c_str());
  const int64_t panels = (n + kPanel - 1) / kPanel;
  check_tensor(codes, (p + "codes").c_str(), at::kByte, {panels, k, quant_step_bytes(layout)});
  check_tensor(header, (p + "header").c_str(), at::kByte,
               {panels, k / layout.block, kPanel, layout.header_bytes});
  return layout;
}

Tensor quant_panel_gemm_op(const Tensor& x_in, int64_t format, const Tensor& codes,
                           const Tensor& header, int64_t n) {
  check_activation_dtype(x_in, "x");
  const Tensor x = unit_stride_rows(x_in, "x");
  check_quant_panels(format, codes, header, "", n, x.size(1));
  Tensor y = at::empty({x.size(0), n}, x.options());
  const QuantPanel w{format, data<const uint8_t>(codes), data<const uint8_t>(header)};
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    quant_panel_gemm(data<T>(y), n, data<const T>(x), x.stride(0), w, x.size(0), n, x.size(1),
                     threads());
  });
  return y;
}

// ---- int8_blocks.cpp ----

// A weight's parts (Int8BlockMethod, layers/block_method.py) for x [m, k]: per part a GGUF type
// id, the file's bytes by panels (int8_blocks.h: [rows rounded up to whole panels, k / block *
// block bytes]) and its rows; `prefix` names the weight.
std::vector<Int8BlockPart> int8_block_parts(const std::vector<int64_t>& formats,
                                            const std::vector<Tensor>& blocks,
                                            const std::vector<int64_t>& sizes, int64_t k,
                                            const std::string& prefix) {
  TORCH_CHECK(!formats.empty() && blocks.size() == formats.size() && sizes.size() == formats.size(),
              prefix, "formats, blocks and sizes must hold one entry per part (at least one), got ",
              formats.size(), ", ", blocks.size(), " and ", sizes.size());
  check_multiple(k, kActBlock, "the input size of int8 blocks");
  std::vector<Int8BlockPart> parts;
  for (size_t i = 0; i < formats.size(); ++i) {
    const std::string p = prefix + "part " + std::to_string(i) + "'s ";
    int64_t block = 0;
    const int64_t bytes = int8_block_bytes(formats[i], block);
    TORCH_CHECK(bytes, p + "format must be a GGUF type id of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                "Q4_K, Q5_K or Q6_K (2, 3, 6, 7, 8, 12, 13, 14), got ", formats[i]);
    TORCH_CHECK(sizes[i] > 0, p + "size must be positive, got ", sizes[i]);
    check_multiple(k, block, (p + "input size (its blocks')").c_str());
    const int64_t lanes = int8_panel_lanes(), panels = (sizes[i] + lanes - 1) / lanes;
    check_tensor(blocks[i], (p + "data").c_str(), at::kByte, {panels * lanes, k / block * bytes});
    parts.push_back(Int8BlockPart{formats[i], data<const uint8_t>(blocks[i]), sizes[i]});
  }
  return parts;
}

Tensor int8_block_gemm_op(const Tensor& x_in, const std::vector<int64_t>& formats,
                          const std::vector<Tensor>& blocks, const std::vector<int64_t>& sizes) {
  check_activation_dtype(x_in, "x");
  const Tensor x = unit_stride_rows(x_in, "x");
  const std::vector<Int8BlockPart> parts = int8_block_parts(formats, blocks, sizes, x.size(1), "");
  int64_t n = 0;
  for (const Int8BlockPart& p : parts) n += p.n_out;
  Tensor y = at::empty({x.size(0), n}, x.options());
  static thread_local Int8Rows scratch;
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    int8_block_matmul(data<T>(y), data<const T>(x), x.stride(0), parts.data(),
                      static_cast<int>(parts.size()), x.size(0), x.size(1), scratch, threads());
  });
  return y;
}

// ---- fused_ops.cpp ----

void check_like(const Tensor& t, const char* name, const Tensor& x, at::IntArrayRef shape) {
  check_tensor(t, name, x.scalar_type(), shape);
}

void rms_norm_op(const Tensor& x, const Tensor& weight, double eps,
              const std::optional<Tensor>& residual, const Tensor& out) {
  check_activation_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be 2-D with unit-stride rows, got shape ",
              x.sizes(), " and strides ", x.strides());
  const int64_t rows = x.size(0), dim = x.size(1);
  check_multiple(dim, kLanes, "x's width");
  check_like(weight, "weight", x, {dim});
  if (residual) check_like(*residual, "residual", x, {rows, dim});
  check_like(out, "out", x, {rows, dim});
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rms_norm<T>(data<T>(out), data<const T>(x), residual ? data<T>(*residual) : nullptr,
                data<const T>(weight), rows, dim, x.stride(0), static_cast<float>(eps),
                threads());
  });
}

// A gated activation's [rows, 2 * inter] input (gate first) checked; its [rows, inter] output.
Tensor gated_output(const Tensor& gate_up) {
  check_activation_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2, "gate_up must be 2-D, got shape ", gate_up.sizes());
  check_contiguous(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  check_multiple(inter, kLanes, "half of gate_up's width");
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "gate_up's width must be even");
  return at::empty({rows, inter}, gate_up.options());
}

Tensor silu_mul_op(const Tensor& gate_up) {
  Tensor out = gated_output(gate_up);
  with_type(gate_up, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    silu_mul<T>(data<T>(out), data<const T>(gate_up), out.size(0), out.size(1), threads());
  });
  return out;
}

Tensor gelu_tanh_mul_op(const Tensor& gate_up) {
  Tensor out = gated_output(gate_up);
  with_type(gate_up, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    gelu_tanh_mul<T>(data<T>(out), data<const T>(gate_up), out.size(0), out.size(1), threads());
  });
  return out;
}

// cos or sin: a contiguous [rows, head_dim] or [rows, 1, head_dim] in x's dtype.
void check_angles(const Tensor& t, const char* name, const Tensor& x, int64_t rows,
                  int64_t head_dim) {
  check_cpu(t, name);
  check_dtype(t, name, x.scalar_type());
  TORCH_CHECK((t.dim() == 2 || (t.dim() == 3 && t.size(1) == 1)) && t.size(0) == rows &&
                  t.size(-1) == head_dim,
              name, " must have shape [", rows, ", 1, ", head_dim, "], got ", t.sizes());
  check_contiguous(t, name);
}

// [T, H, D] whose heads are packed in each row (rows may be strided).
void check_packed_heads(const Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, name, " must be 3-D [tokens, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must have its heads packed in each row, got strides ", t.strides());
}

void rotary_op(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out) {
  check_activation_dtype(x, "x");
  check_packed_heads(x, "x");
  const int64_t rows = x.size(0), heads = x.size(1), head_dim = x.size(2);
  check_multiple(head_dim, 2 * kLanes, "head_dim");
  check_angles(cos, "cos", x, rows, head_dim);
  check_angles(sin, "sin", x, rows, head_dim);
  check_activation_dtype(out, "out");
  check_dtype(out, "out", x.scalar_type());
  check_packed_heads(out, "out");
  check_shape(out, "out", x.sizes());
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    rotary<T>(data<T>(out), data<const T>(x), data<const T>(cos), data<const T>(sin), rows,
              heads, head_dim, x.stride(0), out.stride(0), threads());
  });
}

Tensor argmax_op(const Tensor& x) {
  check_activation_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.numel() > 0, "x must be a non-empty 2-D tensor, got shape ",
              x.sizes());
  check_contiguous(x, "x");
  check_multiple(x.size(1), kLanes, "x's width");
  Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  with_type(x, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    argmax<T>(data<int64_t>(out), data<const T>(x), x.size(0), x.size(1), threads());
  });
  return out;
}

// ---- lora.cpp ----

// y [T, out] += each row's adapter update (lora.cpp): x [T, in] in y's dtype, a [S, R, in] and
// b [S, R, out] float32 stacks, slots [T] int32 in 0..S-1, the first `width` of R rows.
void lora_apply_op(const Tensor& y, const Tensor& x_in, const Tensor& a, const Tensor& b,
                   const Tensor& slots, int64_t width) {
  check_cpu(y, "y");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16 ||
                  y.scalar_type() == at::kHalf,
              "y must be float32, bfloat16 or float16, got ", dtype_name(y.scalar_type()));
  TORCH_CHECK(y.dim() == 2, "y must be 2-D [tokens, out], got shape ", y.sizes());
  check_contiguous(y, "y");
  check_cpu(x_in, "x");
  check_dtype(x_in, "x", y.scalar_type());
  const Tensor x = unit_stride_rows(x_in, "x");
  const int64_t rows = y.size(0), in = x.size(1), out = y.size(1);
  TORCH_CHECK(x.size(0) == rows, "x must have ", rows, " rows (y's), got ", x.size(0));
  check_multiple(in, kLanes, "x's width");
  check_multiple(out, kLanes, "y's width");
  TORCH_CHECK(a.dim() == 3, "a must be 3-D [slots, rank, in], got shape ", a.sizes());
  const int64_t num_slots = a.size(0), rank = a.size(1);
  TORCH_CHECK(num_slots > 0, "a must hold at least one slot (slot 0: no adapter)");
  check_tensor(a, "a", at::kFloat, {num_slots, rank, in});
  check_tensor(b, "b", at::kFloat, {num_slots, rank, out});
  check_tensor(slots, "slots", at::kInt, {rows});
  TORCH_CHECK(width >= 0 && width <= rank, "width must be in 0..", rank, " (a's rank), got ",
              width);
  const int32_t* s = data<const int32_t>(slots);
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "slots[", t, "] = ", s[t], " is not a slot of a (",
                num_slots, " slots)");
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    lora_apply<T>(data<T>(y), data<const T>(x), x.stride(0), data<const float>(a),
                  data<const float>(b), s, rows, in, out, num_slots, rank, width, threads());
  };
  if (y.scalar_type() == at::kHalf)
    run(static_cast<Half*>(nullptr));
  else
    with_type(y, run);
}

// ---- paged_attention.cpp ----


CacheShape check_caches(const Tensor& k_cache, const Tensor& v_cache, const char* k_name,
                        const char* v_name) {
  check_activation_dtype(k_cache, k_name);
  TORCH_CHECK(k_cache.dim() == 4, k_name,
              " must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              k_cache.sizes());
  check_contiguous(k_cache, k_name);
  check_like(v_cache, v_name, k_cache, k_cache.sizes());
  const CacheShape c{k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3)};
  TORCH_CHECK(c.head_dim % kLanes == 0 && c.head_dim <= 256, k_name,
              "'s head_dim must be a multiple of ", kLanes, " up to 256, got ", c.head_dim);
  return c;
}

// The index tensors of `tokens` query tokens over caches of `cache`'s shape, values included:
// every block, slot and sequence they name must exist (under a sliding `window`, the blocks
// from the window's first one on: the entries before it are never read).
void check_indices(const CacheShape& cache, int64_t tokens, const Tensor& block_tables,
                   const Tensor& context_lens, const std::optional<Tensor>& token_seqs,
                   const std::optional<Tensor>& slot_mapping, int64_t window) {
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be 2-D, got shape ",
              block_tables.sizes());
  const int64_t seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  check_tensor(block_tables, "block_tables", at::kInt, {seqs, max_blocks});
  check_tensor(context_lens, "context_lens", at::kInt, {tokens});
  if (token_seqs)
    check_tensor(*token_seqs, "token_seqs", at::kInt, {tokens});
  else
    TORCH_CHECK(seqs >= tokens, "block_tables needs a row per token without token_seqs, got ",
                seqs, " rows for ", tokens, " tokens");
  const int32_t* lens = data<const int32_t>(context_lens);
  const int32_t* tables = data<const int32_t>(block_tables);
  const int32_t* seq_of = token_seqs ? data<const int32_t>(*token_seqs) : nullptr;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t seq = seq_of ? seq_of[t] : t;
    TORCH_CHECK(seq >= 0 && seq < seqs, "token_seqs[", t, "] = ", seq, " is not a row of ",
                "block_tables (", seqs, " rows)");
    TORCH_CHECK(lens[t] >= 0 && lens[t] <= max_blocks * cache.block_size, "context_lens[", t,
                "] = ", lens[t], " is outside 0..", max_blocks * cache.block_size);
    const int32_t* row = tables + seq * max_blocks;
    for (int64_t b = window_start(lens[t], window, cache.block_size).first_block;
         b < (lens[t] + cache.block_size - 1) / cache.block_size; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < cache.num_blocks, "block_tables[", seq, ", ", b,
                  "] = ", row[b], " is not a cache block (", cache.num_blocks, " blocks)");
  }
  if (slot_mapping) {
    check_tensor(*slot_mapping, "slot_mapping", at::kLong, {tokens});
    const int64_t* slots = data<const int64_t>(*slot_mapping);
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < cache.num_blocks * cache.block_size,
                  "slot_mapping[", t, "] = ", slots[t], " is not a cache row");
  }
}

void paged_attention_op(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& block_tables, const Tensor& context_lens,
                     const std::optional<Tensor>& token_seqs, double scale, const Tensor& out,
                     const std::optional<Tensor>& new_k, const std::optional<Tensor>& new_v,
                     const std::optional<Tensor>& slot_mapping, int64_t window) {
  check_activation_dtype(q_in, "q");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
  TORCH_CHECK(q_in.dim() == 3, "q must be 3-D [tokens, heads, head_dim], got shape ",
              q_in.sizes());
  const Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in
                                                                          : q_in.contiguous();
  const CacheShape c = check_caches(k_cache, v_cache, "k_cache", "v_cache");
  const int64_t tokens = q.size(0), heads = q.size(1);
  TORCH_CHECK(q.size(2) == c.head_dim, "q's head_dim must be the cache's, ", c.head_dim,
              ", got ", q.size(2));
  TORCH_CHECK(heads % c.num_kv_heads == 0, "q's ", heads,
              " heads must be a multiple of the cache's ", c.num_kv_heads, " KV heads");
  const bool bf16_cache = is_bf16(k_cache);
  TORCH_CHECK(!is_bf16(q) || bf16_cache, "k_cache must be bfloat16 for bfloat16 queries");
  TORCH_CHECK(new_k.has_value() == new_v.has_value() && new_k.has_value() == slot_mapping.has_value(),
              "new_k, new_v and slot_mapping come together");
  check_indices(c, tokens, block_tables, context_lens, token_seqs, slot_mapping, window);
  if (new_k) {
    for (const auto& [t, name] : {std::pair{&*new_k, "new_k"}, std::pair{&*new_v, "new_v"}}) {
      check_dtype(*t, name, q.scalar_type());
      check_packed_heads(*t, name);
      check_shape(*t, name, {tokens, c.num_kv_heads, c.head_dim});
    }
  }
  check_like(out, "out", q, {tokens, heads * c.head_dim});
  with_type(q, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const NewKV<T> kv = new_k ? NewKV<T>{data<const T>(*new_k), data<const T>(*new_v),
                                         new_k->stride(0), new_v->stride(0),
                                         data<const int64_t>(*slot_mapping)}
                              : NewKV<T>{};
    auto run = [&](auto* cache_type) {
      using C = std::remove_pointer_t<decltype(cache_type)>;
      paged_attention<T, C>(data<T>(out), data<const T>(q), data<C>(k_cache), data<C>(v_cache),
                            kv, data<const int32_t>(block_tables),
                            token_seqs ? data<const int32_t>(*token_seqs) : nullptr,
                            data<const int32_t>(context_lens), tokens, heads, c.num_kv_heads,
                            c.head_dim, c.block_size, block_tables.size(1), q.stride(0),
                            static_cast<float>(scale), threads(), window);
    };
    if (bf16_cache)
      run(static_cast<uint16_t*>(nullptr));
    else if constexpr (std::is_same_v<T, float>)  // bf16 queries over a float32 cache: none
      run(static_cast<float*>(nullptr));
  });
}
}  // namespace conveyor::ops

using namespace conveyor::ops;

TORCH_LIBRARY(CONVEYOR_OPS_NAMESPACE, m) {
  m.def("features() -> str[]", &features_op);
  m.def("panel_width() -> int", &panel_width_op);
  m.def("int8_panel_lanes() -> int", &int8_panel_lanes_op);
  m.def("panel_gemm(Tensor x, Tensor packed, int n) -> Tensor", &panel_gemm_op);
  m.def("block_panel_gemm(Tensor x, Tensor codes, Tensor scale, Tensor? minimum) -> Tensor",
        &block_panel_gemm_op);
  m.def("block_matmul(Tensor x, Tensor codes, Tensor scale, Tensor? minimum) -> Tensor",
        &block_matmul_op);
  m.def("quant_panel_gemm(Tensor x, int format, Tensor codes, Tensor header, int n) -> Tensor",
        &quant_panel_gemm_op);
  m.def("int8_block_gemm(Tensor x, int[] formats, Tensor[] blocks, int[] sizes) -> Tensor",
        &int8_block_gemm_op);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual, Tensor(b!) out) -> ()",
        &rms_norm_op);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul_op);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &gelu_tanh_mul_op);
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()", &rotary_op);
  m.def("argmax(Tensor x) -> Tensor", &argmax_op);
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor slots, int width) -> ()",
        &lora_apply_op);
  m.def("paged_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, "
        "Tensor context_lens, Tensor? token_seqs, float scale, Tensor(c!) out, Tensor? new_k, "
        "Tensor? new_v, Tensor? slot_mapping, int window=0) -> ()",
        &paged_attention_op);
}

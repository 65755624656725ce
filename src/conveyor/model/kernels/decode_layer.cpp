// Every decoder layer of a decode step, in one call (CPU, float32 or bf16): Llama's, with per-head
// q/k norms (Qwen3's), or Gemma 3's.
//
// At small batches a decode step's kernels are short, so the Python around each layer's nine
// kernel calls costs about as much as the kernels themselves. This runs the same kernels, in
// the same order and with the same arithmetic, from C++, for each layer:
//
//   residual += x; h = rms_norm(residual)             (input_norm)
//   qkv = h @ Wqkv^T; q, k = rotary(q, k)              (one rotary pass over q's and k's heads;
//                                                       with q/k norms, each head normed first)
//   k, v -> their cache slots; a = paged_attention(q)  (the layer's scale and window)
//   p = a @ Wo^T [; p = rms_norm(p)]                   (post_attention_norm, Gemma)
//   residual += p; h = rms_norm(residual)              (post_norm)
//   out = (act(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T   (act: SiLU, or Gemma's tanh GeLU)
//   [out = rms_norm(out)]                              (post_feedforward_norm, Gemma)
//
// where each matmul is int8_blocks.cpp's integer GEMM where the weight has it (integer compute:
// every row), else the 4-bit block kernel (or quant_panels.cpp's, for QuantPanels) up to its
// max_block_rows rows and above them the panel GEMM (as Linear picks), so its results equal the
// layer's Python path bit for bit (the tests check). With a step's LoRA slots, each
// projection's output then gets its rows' adapter updates (lora.cpp's lora_apply, as
// layers/lora.py adds them on the Python path). Each layer takes its rotary table (Gemma's
// sliding layers have their own) and its KV-cache group's slots, block tables and context
// lengths (a hybrid cache: docs/kv_cache.md). The pieces are the kernels' own entry points;
// decode_layers_op.cpp holds the typed class and operator.

#include <cstdint>
#include <cstring>

#include "block_matmul.h"
#include "decode_layer.h"
#include "fused_ops.h"
#include "int8_blocks.h"
#include "lora.h"
#include "paged_attention.h"
#include "panel_gemm.h"
#include "quant_panels.h"

namespace {

using namespace conveyor;

// y [rows, out] += its rows' updates from projection p's stacks, x [rows, in] contiguous.
template <typename T>
void add_lora(T* y, const T* x, const LayerWeights* w, int p, const LoraStep& step,
              int64_t rows, int64_t in, int64_t out, int num_threads) {
  const LoraStack& s = w->lora[p];
  if (step.slots && s.a)
    lora_apply<T>(y, x, in, s.a, s.b, step.slots, rows, in, out, step.num_slots, s.rank,
                  step.widths[p], num_threads);
}

// y [rows, w.n_out] = x [rows, k] @ W^T by the kernel that serves `rows` rows.
template <typename T>
void matmul(T* y, const T* x, const Weight& w, int64_t rows, int64_t k, Activations<T>& a,
            int num_threads) {
  if (w.int8_block_count) {
    int8_block_matmul(y, x, k, w.int8_blocks, w.int8_block_count, rows, k, a.int8_rows,
                      num_threads);
  } else if (rows <= w.max_block_rows && w.quant.count) {
    for (int i = 0, column = 0; i < w.quant.count; column += w.quant.n_out[i++])
      quant_panel_gemm(y + column, w.n_out, x, k, w.quant.parts[i], rows, w.quant.n_out[i], k,
                       num_threads);
  } else if (rows <= w.max_block_rows && w.block_panels)
    block_panel_gemm(y, x, BlockPanel{w.codes, w.scale, w.minimum, k / 32}, rows, w.n_out, k,
                     num_threads);
  else if (rows <= w.max_block_rows)
    block_matmul(y, x, w.codes, w.scale, w.minimum, rows, w.n_out, k, k, num_threads);
  else
    panel_gemm(y, x, static_cast<const T*>(w.panels), rows, w.n_out, k, num_threads);
}

}  // namespace

namespace conveyor {

template <typename T>
void decode_layer(const LayerWeights* w, T* out, const T* x, T* residual, int64_t rows,
                  const LayerStep<T>& step, T* k_cache, T* v_cache, int64_t block_size,
                  Activations<T>& a, int num_threads, const LoraStep& lora) {
  const int64_t hidden = w->hidden, hd = w->head_dim, inter = w->intermediate;
  const int64_t q_heads = w->num_heads, kv_heads = w->num_kv_heads;
  const int64_t q_width = q_heads * hd, k_width = kv_heads * hd, qk_width = q_width + k_width;
  const int64_t qkv_width = w->qkv.n_out;
  const T* input_norm = static_cast<const T*>(w->input_norm);
  const T* post_norm = static_cast<const T*>(w->post_norm);
  T *h = a.h.get(), *qkv = a.qkv.get(), *qk = a.qk.get(), *attn = a.attn.get();
  T *proj = a.proj.get(), *gate_up = a.gate_up.get(), *act = a.act.get();

  rms_norm<T>(h, x, residual, input_norm, rows, hidden, hidden, w->eps, num_threads);
  matmul(qkv, h, w->qkv, rows, hidden, a, num_threads);
  add_lora(qkv, h, w, 0, lora, rows, hidden, qkv_width, num_threads);
  const T *q = qk, *k = qk + q_width;  // rotated heads, rows q_stride and k_stride apart
  int64_t q_stride = qk_width, k_stride = qk_width;
  if (w->q_norm) {
    // Each head of q, then of k, a row of rms_norm (the Python path's per-head norms): copied
    // out of the QKV rows so that the rows are evenly spaced, normed and rotated in place.
    T *qn = qk, *kn = qk + rows * q_width;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(qn + r * q_width, qkv + r * qkv_width, q_width * sizeof(T));
      std::memcpy(kn + r * k_width, qkv + r * qkv_width + q_width, k_width * sizeof(T));
    }
    rms_norm<T>(qn, qn, nullptr, static_cast<const T*>(w->q_norm), rows * q_heads, hd, hd,
                w->eps, num_threads);
    rms_norm<T>(kn, kn, nullptr, static_cast<const T*>(w->k_norm), rows * kv_heads, hd, hd,
                w->eps, num_threads);
    rotary<T>(qn, qn, step.cos, step.sin, rows, q_heads, hd, q_width, q_width, num_threads);
    rotary<T>(kn, kn, step.cos, step.sin, rows, kv_heads, hd, k_width, k_width, num_threads);
    q = qn, k = kn, q_stride = q_width, k_stride = k_width;
  } else {
    rotary<T>(qk, qkv, step.cos, step.sin, rows, q_heads + kv_heads, hd, qkv_width, qk_width,
              num_threads);
  }
  const NewKV<T> new_kv{k, qkv + qk_width, k_stride, qkv_width,
                        step.slot_mapping};  // rotated keys, values straight from the projection
  paged_attention<T>(attn, q, k_cache, v_cache, new_kv, step.block_tables, nullptr,
                     step.context_lens, rows, q_heads, kv_heads, hd, block_size, step.max_blocks,
                     q_stride, w->scale, num_threads, w->window);
  matmul(proj, attn, w->o, rows, q_width, a, num_threads);
  add_lora(proj, attn, w, 1, lora, rows, q_width, hidden, num_threads);
  if (w->post_attention_norm)  // in place: each row is read before it is written
    rms_norm<T>(proj, proj, nullptr, static_cast<const T*>(w->post_attention_norm), rows, hidden,
                hidden, w->eps, num_threads);
  rms_norm<T>(h, proj, residual, post_norm, rows, hidden, hidden, w->eps,
              num_threads);
  matmul(gate_up, h, w->gate_up, rows, hidden, a, num_threads);
  add_lora(gate_up, h, w, 2, lora, rows, hidden, 2 * inter, num_threads);
  if (w->activation == Activation::kGeluTanh)
    gelu_tanh_mul<T>(act, gate_up, rows, inter, num_threads);
  else
    silu_mul<T>(act, gate_up, rows, inter, num_threads);
  matmul(out, act, w->down, rows, inter, a, num_threads);
  add_lora(out, act, w, 3, lora, rows, inter, hidden, num_threads);
  if (w->post_feedforward_norm)
    rms_norm<T>(out, out, nullptr, static_cast<const T*>(w->post_feedforward_norm), rows, hidden,
                hidden, w->eps, num_threads);
}

template void decode_layer<float>(const LayerWeights*, float*, const float*, float*, int64_t,
                                  const LayerStep<float>&, float*, float*, int64_t,
                                  Activations<float>&, int, const LoraStep&);
template void decode_layer<uint16_t>(const LayerWeights*, uint16_t*, const uint16_t*, uint16_t*,
                                     int64_t, const LayerStep<uint16_t>&, uint16_t*, uint16_t*,
                                     int64_t, Activations<uint16_t>&, int, const LoraStep&);

}  // namespace conveyor

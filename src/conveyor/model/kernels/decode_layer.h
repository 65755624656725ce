// Every decoder layer of a decode step in one call (decode_layer.cpp): Llama's, and the same with
// per-head q/k norms (Qwen3) or with Gemma 3's additions. A layer's weights as the kernels take
// them, and one layer's step. T is float, or bf16 stored as uint16_t.

#pragma once

#include <cstdint>
#include <memory>

#include "int8_blocks.h"
#include "quant_panels.h"

namespace conveyor {

constexpr int kMaxQuantParts = 3;  // q, k, v of three GGUF types

struct QuantParts {  // QuantPanels: parts of consecutive outputs, each of one GGUF type
  QuantPanel parts[kMaxQuantParts];
  int64_t n_out[kMaxQuantParts];
  int count = 0;  // 0: none
};

// A projection [n_out, k]: 4-bit as NibbleInt4 or BlockPanels holds it, or as QuantPanels, and
// its panels
struct Weight {
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  const void* panels;  // pack_panels' layout in the activations' type; null: none
  int64_t n_out;
  int64_t max_block_rows;  // rows up to which the blocks serve (NibbleInt4.max_tokens)
  int64_t block_panels;  // nonzero: codes, scale and minimum are BlockPanels (panel_gemm.cpp)
  QuantParts quant = {};  // in place of codes, scale and minimum where it has parts
  // Integer compute (int8_blocks.cpp): the file's blocks, serving every row; count 0: none.
  Int8BlockPart int8_blocks[kMaxQuantParts] = {};
  int int8_block_count = 0;
};

struct LoraStack {  // a projection's adapters: lora.cpp's a [slots, rank, in], b [slots, rank, out]
  const float* a = nullptr;  // null: no LoRA
  const float* b = nullptr;
  int64_t rank = 0;
};

enum class Activation { kSilu, kGeluTanh };  // the MLP's gate: silu_mul or gelu_tanh_mul

// Every norm in the activations' type, with one eps; a null optional norm is none.
struct LayerWeights {
  const void* input_norm;  // [hidden], as post_norm (the MLP's input norm)
  const void* post_norm;
  const void* q_norm = nullptr;  // [head_dim]: q's and k's heads normed before the rotary
  const void* k_norm = nullptr;
  const void* post_attention_norm = nullptr;  // [hidden]: the attention's output (after o)
  const void* post_feedforward_norm = nullptr;  // [hidden]: the MLP's output (after down)
  Weight qkv, o, gate_up, down;
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;
  float scale = 0;  // of q.k in attention
  Activation activation = Activation::kSilu;
  int64_t window = 0;  // attention's sliding window (paged_attention.h); 0: none
  int64_t rotary = 0;  // which of the call's rotary tables (cos, sin) the layer takes
  LoraStack lora[4] = {};  // qkv, o, gate_up, down
};

// What one layer reads of a step besides its weights: its rotary table's rows and its KV-cache
// group's indices.
template <typename T>
struct LayerStep {
  const T* cos;  // [rows, head_dim], as sin
  const T* sin;
  const int64_t* slot_mapping;  // [rows] flat cache rows
  const int32_t* block_tables;  // [rows, max_blocks]
  const int32_t* context_lens;  // [rows]
  int64_t max_blocks;
};

struct LoraStep {  // a step's rows under adapters
  const int32_t* slots = nullptr;  // [rows] slot of each row; null: no LoRA this step
  const int64_t* widths = nullptr;  // of the layer's four stacks, the rows of rank in use
  int64_t num_slots = 0;
};

// A layer's intermediate activations, allocated once per call for all layers (which share their
// sizes) and left uninitialized: every element is written before it is read, so zeroing them
// would be a wasted pass over memory per layer. qk: the rotated q and k heads, per row [q | k]
// (rows qk-width apart), or with q/k norms every row's q, then every row's k.
template <typename T>
struct Activations {
  std::unique_ptr<T[]> h, qkv, qk, attn, proj, gate_up, act;
  Int8Rows int8_rows;  // the integer block GEMM's
  Activations(const LayerWeights& w, int64_t rows)
      : h(new T[rows * w.hidden]),
        qkv(new T[rows * w.qkv.n_out]),
        qk(new T[rows * (w.num_heads + w.num_kv_heads) * w.head_dim]),
        attn(new T[rows * w.num_heads * w.head_dim]),
        proj(new T[rows * w.hidden]),
        gate_up(new T[rows * 2 * w.intermediate]),
        act(new T[rows * w.intermediate]) {}
};

// One layer, in T (float, or bf16 stored as uint16_t). x, out: [rows, hidden] (out may be x);
// residual: [rows, hidden], updated in place; caches: [num_blocks, block_size, num_kv_heads,
// head_dim].
template <typename T>
void decode_layer(const LayerWeights* w, T* out, const T* x, T* residual, int64_t rows,
                  const LayerStep<T>& step, T* k_cache, T* v_cache, int64_t block_size,
                  Activations<T>& a, int num_threads, const LoraStep& lora);

}  // namespace conveyor

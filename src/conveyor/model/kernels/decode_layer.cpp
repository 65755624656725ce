// Every Llama decoder layer of a decode step, in one call (CPU, float32 or bf16).
//
// At small batches a decode step's kernels are short, so the Python around each layer's nine
// kernel calls costs about as much as the kernels themselves. This runs the same kernels, in
// the same order and with the same arithmetic, from C++, for each layer:
//
//   residual += x; h = rms_norm(residual)             (input_norm)
//   qkv = h @ Wqkv^T; q, k = rotary(q, k)              (one rotary pass over q's and k's heads)
//   k, v -> their cache slots; a = paged_attention(q)
//   residual += a @ Wo^T; h = rms_norm(residual)       (post_norm)
//   out = (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
//
// With a step's LoRA slots, each projection's output then gets its rows' adapter updates
// (lora.cpp's lora_apply, as layers/lora.py adds them on the Python path).
//
// where each matmul is the 4-bit block kernel up to its max_block_rows rows and above them the
// integer GEMM of int8_gemm.cpp where the weight has Int8Panels, else the panel GEMM (as Linear
// picks), so its results equal the layer's Python path bit for bit (the tests check). The
// pieces come from the kernels' own sources; ops.cpp holds the typed entry point.

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "block_matmul.cpp"
#include "fused_ops.cpp"
#include "int8_gemm.cpp"
#include "lora.cpp"
#include "paged_attention.cpp"
#include "panel_gemm.cpp"

namespace {

struct Weight {  // a projection [n_out, k]: 4-bit as NibbleInt4 or BlockPanels holds it, and its panels
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  const void* panels;  // pack_panels' layout in the activations' type; null: none
  Int8Weight int8;  // Int8Panels; codes null: none
  int64_t n_out;
  int64_t max_block_rows;  // rows up to which the blocks serve (NibbleInt4.max_tokens)
  int64_t block_panels;  // nonzero: codes, scale and minimum are BlockPanels (panel_gemm.cpp)
};

struct LoraStack {  // a projection's adapters: lora.cpp's a [slots, rank, in], b [slots, rank, out]
  const float* a = nullptr;  // null: no LoRA
  const float* b = nullptr;
  int64_t rank = 0;
};

struct LayerWeights {
  const void* input_norm;  // [hidden] in the activations' type, as post_norm
  const void* post_norm;
  Weight qkv, o, gate_up, down;
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;
  LoraStack lora[4] = {};  // qkv, o, gate_up, down
};

struct LoraStep {  // a step's rows under adapters
  const int32_t* slots = nullptr;  // [rows] slot of each row; null: no LoRA this step
  const int64_t* widths = nullptr;  // of the layer's four stacks, the rows of rank in use
  int64_t num_slots = 0;
};

// y [rows, out] += its rows' updates from projection p's stacks, x [rows, in] contiguous.
template <typename T>
void add_lora(T* y, const T* x, const LayerWeights* w, int p, const LoraStep& step,
              int64_t rows, int64_t in, int64_t out, int num_threads) {
  const LoraStack& s = w->lora[p];
  if (step.slots && s.a)
    lora_apply<T>(y, x, in, s.a, s.b, step.slots, rows, in, out, step.num_slots, s.rank,
                  step.widths[p], num_threads);
}

void panel_matmul(float* y, const float* x, const void* panels, int64_t rows, int64_t n,
                  int64_t k, int num_threads) {
  gemm<F32>(y, x, static_cast<const float*>(panels), rows, n, k, num_threads);
}

void panel_matmul(uint16_t* y, const uint16_t* x, const void* panels, int64_t rows, int64_t n,
                  int64_t k, int num_threads) {
#ifdef __AVX512BF16__
  gemm<BF16>(y, x, static_cast<const uint16_t*>(panels), rows, n, k, num_threads);
#else
  std::abort();  // bf16 panels exist only with AVX512-BF16 (the Python side checks)
#endif
}

void block_panel_matmul(float* y, const float* x, const Weight& w, int64_t rows, int64_t k,
                        int num_threads) {
#ifdef __AVX2__
  block_panel_gemm<F32>(y, x, BlockPanel{w.codes, w.scale, w.minimum, k / 32}, rows, w.n_out, k,
                        num_threads);
#else
  std::abort();  // BlockPanels exist only with AVX2 (the Python side checks)
#endif
}

void block_panel_matmul(uint16_t* y, const uint16_t* x, const Weight& w, int64_t rows, int64_t k,
                        int num_threads) {
#ifdef __AVX512BF16__
  block_panel_gemm<BF16>(y, x, BlockPanel{w.codes, w.scale, w.minimum, k / 32}, rows, w.n_out, k,
                         num_threads);
#else
  std::abort();  // bf16 BlockPanels exist only with AVX512-BF16 (the Python side checks)
#endif
}

template <typename T>
void int8_panel_matmul(T* y, const T* x, const Int8Weight& w, int64_t rows, int64_t k,
                       QuantizedRows& scratch, int num_threads) {
#ifdef CONVEYOR_INT8_GEMM
  int8_matmul(y, x, w, rows, k, k, scratch, num_threads);
#else
  std::abort();  // Int8Panels exist only with AVX512-VNNI (the Python side checks)
#endif
}

template <typename T>
void matmul(T* y, const T* x, const Weight& w, int64_t rows, int64_t k, QuantizedRows& scratch,
            int num_threads) {
  if (rows <= w.max_block_rows && w.block_panels)
    block_panel_matmul(y, x, w, rows, k, num_threads);
  else if (rows <= w.max_block_rows)
    multiply<Q4>(y, x, w.codes, w.scale, w.minimum, rows, w.n_out, k, k, num_threads);
  else if (w.int8.codes)
    int8_panel_matmul(y, x, w.int8, rows, k, scratch, num_threads);
  else
    panel_matmul(y, x, w.panels, rows, w.n_out, k, num_threads);
}

// A layer's intermediate activations, allocated once per call for all layers (which share their
// sizes) and left uninitialized: every element is written before it is read, so zeroing them
// would be a wasted pass over memory per layer.
template <typename T>
struct Activations {
  std::unique_ptr<T[]> h, qkv, qk, attn, proj, gate_up, act;
  QuantizedRows quantized;  // the int8 GEMM's rounded inputs
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
// residual: [rows, hidden], updated in place; cos, sin: [rows, head_dim]; caches: [num_blocks,
// block_size, num_kv_heads, head_dim]; slot_mapping: [rows] flat cache rows.
template <typename T>
void decode_layer(const LayerWeights* w, T* out, const T* x, T* residual, int64_t rows,
                  const T* cos, const T* sin, T* k_cache, T* v_cache, int64_t block_size,
                  const int64_t* slot_mapping, const int32_t* block_tables,
                  const int32_t* context_lens, int64_t max_blocks, float scale,
                  Activations<T>& a, int num_threads, bool deterministic, const LoraStep& lora) {
  const int64_t hidden = w->hidden, hd = w->head_dim, inter = w->intermediate;
  const int64_t q_heads = w->num_heads, kv_heads = w->num_kv_heads;
  const int64_t qk_width = (q_heads + kv_heads) * hd;
  const int64_t qkv_width = w->qkv.n_out;
  const T* input_norm = static_cast<const T*>(w->input_norm);
  const T* post_norm = static_cast<const T*>(w->post_norm);
  T *h = a.h.get(), *qkv = a.qkv.get(), *qk = a.qk.get(), *attn = a.attn.get();
  T *proj = a.proj.get(), *gate_up = a.gate_up.get(), *act = a.act.get();

  rms_norm<T>(h, x, residual, input_norm, rows, hidden, hidden, w->eps, num_threads);
  matmul(qkv, h, w->qkv, rows, hidden, a.quantized, num_threads);
  add_lora(qkv, h, w, 0, lora, rows, hidden, qkv_width, num_threads);
  rotary<T>(qk, qkv, cos, sin, rows, q_heads + kv_heads, hd, qkv_width, qk_width,
            num_threads);
  const NewKV<T> new_kv{qk + q_heads * hd, qkv + qk_width, qk_width, qkv_width,
                        slot_mapping};  // rotated keys, values straight from the projection
  paged_attention<T>(attn, qk, k_cache, v_cache, new_kv, block_tables, nullptr,
                     context_lens, rows, q_heads, kv_heads, hd, block_size, max_blocks, qk_width,
                     scale, num_threads, deterministic);
  matmul(proj, attn, w->o, rows, q_heads * hd, a.quantized, num_threads);
  add_lora(proj, attn, w, 1, lora, rows, q_heads * hd, hidden, num_threads);
  rms_norm<T>(h, proj, residual, post_norm, rows, hidden, hidden, w->eps,
              num_threads);
  matmul(gate_up, h, w->gate_up, rows, hidden, a.quantized, num_threads);
  add_lora(gate_up, h, w, 2, lora, rows, hidden, 2 * inter, num_threads);
  silu_mul<T>(act, gate_up, rows, inter, num_threads);
  matmul(out, act, w->down, rows, inter, a.quantized, num_threads);
  add_lora(out, act, w, 3, lora, rows, inter, hidden, num_threads);
}

}  // namespace

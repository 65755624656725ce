// Every Llama decoder layer of a step of a few decode tokens, in one call (CPU, float32 or bf16,
// 4-bit weights).
//
// A single-stream decode step spent about as long in Python around each layer's nine kernel
// calls (about 130 us a layer) as in the kernels themselves, and then about 10 us a layer
// around a per-layer call. This runs the same kernels, in the same order and with the same
// arithmetic, from C++, for each layer:
//
//   residual += x; h = rms_norm(residual)             (input_norm)
//   qkv = h @ Wqkv^T; q, k = rotary(q, k)              (4-bit block matmul, one rotary pass
//                                                      over q's and k's heads)
//   k, v -> their cache slots; a = paged_attention(q)
//   residual += a @ Wo^T; h = rms_norm(residual)       (post_norm)
//   out = (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
//
// so its results equal the layer's Python path bit for bit (the tests check). The pieces come
// from the kernels' own sources, compiled into this library too.

#include <cstdint>
#include <vector>

#include "block_matmul.cpp"
#include "fused_ops.cpp"
#include "paged_attention.cpp"

namespace {

struct BlockWeight {  // a 4-bit weight [n_out, k] as NibbleInt4 holds it
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  int64_t n_out;
};

struct LayerWeights {
  const void* input_norm;  // [hidden] in the activations' type, as post_norm
  const void* post_norm;
  BlockWeight qkv, o, gate_up, down;
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps;
};

template <typename T>
void matmul(T* y, const T* x, const BlockWeight& w, int64_t rows, int64_t k, int num_threads) {
  multiply<Q4>(y, x, w.codes, w.scale, w.minimum, rows, w.n_out, k, k, num_threads);
}

// One layer, in T (float, or bf16 stored as uint16_t). x, out: [rows, hidden] (out may be x);
// residual: [rows, hidden], updated in place; cos, sin: [rows, head_dim]; caches: [num_blocks,
// block_size, num_kv_heads, head_dim]; slot_mapping: [rows] flat cache rows.
template <typename T>
void decode_layer(const LayerWeights* w, T* out, const T* x, T* residual, int64_t rows,
                  const T* cos, const T* sin, T* k_cache, T* v_cache, int64_t block_size,
                  const int64_t* slot_mapping, const int32_t* block_tables,
                  const int32_t* context_lens, int64_t max_blocks, float scale,
                  int num_threads) {
  const int64_t hidden = w->hidden, hd = w->head_dim, inter = w->intermediate;
  const int64_t q_heads = w->num_heads, kv_heads = w->num_kv_heads;
  const int64_t qk_width = (q_heads + kv_heads) * hd;
  const int64_t qkv_width = w->qkv.n_out;
  const T* input_norm = static_cast<const T*>(w->input_norm);
  const T* post_norm = static_cast<const T*>(w->post_norm);
  std::vector<T> h(rows * hidden), qkv(rows * qkv_width), qk(rows * qk_width);
  std::vector<T> attn(rows * q_heads * hd), proj(rows * hidden);
  std::vector<T> gate_up(rows * 2 * inter), act(rows * inter);

  rms_norm<T>(h.data(), x, residual, input_norm, rows, hidden, hidden, w->eps, num_threads);
  matmul(qkv.data(), h.data(), w->qkv, rows, hidden, num_threads);
  rotary<T>(qk.data(), qkv.data(), cos, sin, rows, q_heads + kv_heads, hd, qkv_width, qk_width,
            num_threads);
  const NewKV<T> new_kv{qk.data() + q_heads * hd, qkv.data() + qk_width, qk_width, qkv_width,
                        slot_mapping};  // rotated keys, values straight from the projection
  paged_attention<T>(attn.data(), qk.data(), k_cache, v_cache, new_kv, block_tables, nullptr,
                     context_lens, rows, q_heads, kv_heads, hd, block_size, max_blocks, qk_width,
                     scale, num_threads);
  matmul(proj.data(), attn.data(), w->o, rows, q_heads * hd, num_threads);
  rms_norm<T>(h.data(), proj.data(), residual, post_norm, rows, hidden, hidden, w->eps,
              num_threads);
  matmul(gate_up.data(), h.data(), w->gate_up, rows, hidden, num_threads);
  silu_mul<T>(act.data(), gate_up.data(), rows, inter, num_threads);
  matmul(out, act.data(), w->down, rows, inter, num_threads);
}

}  // namespace

// Every layer of a decode step, in order, in one call. Layer i's output overwrites x, which is
// layer i + 1's input: each layer reads its input only in its first norm and writes its output
// only at its end. k_caches[i], v_caches[i]: layer i's caches, laid out as above, in T.
#define CONVEYOR_DECODE_LAYERS(SUFFIX, T)                                                       \
  extern "C" void decode_layers_##SUFFIX(                                                     \
      const LayerWeights* const* layers, void* const* k_caches, void* const* v_caches,        \
      int64_t num_layers, void* x, void* residual, int64_t rows, const void* cos,             \
      const void* sin, int64_t block_size, const int64_t* slot_mapping,                       \
      const int32_t* block_tables, const int32_t* context_lens, int64_t max_blocks,           \
      float scale, int num_threads) {                                                         \
    T* xt = static_cast<T*>(x);                                                               \
    for (int64_t i = 0; i < num_layers; ++i)                                                  \
      decode_layer<T>(layers[i], xt, xt, static_cast<T*>(residual), rows,                     \
                      static_cast<const T*>(cos), static_cast<const T*>(sin),                 \
                      static_cast<T*>(k_caches[i]), static_cast<T*>(v_caches[i]), block_size, \
                      slot_mapping, block_tables, context_lens, max_blocks, scale,            \
                      num_threads);                                                           \
  }

CONVEYOR_DECODE_LAYERS(f32, float)
CONVEYOR_DECODE_LAYERS(bf16, uint16_t)

// Paged attention read straight from the KV cache (CPU): decodes and prefill chunks alike.
//
// Every query token attends to the first context_lens[t] positions of its sequence, the
// sequence being token_seqs[t] (a row of block_tables; null: token t is sequence t's only
// token, a decode step). A prefill chunk's tokens thus each see their own causal prefix,
// cached prefix included: no padding, no mask, no gathered copy of the keys.
// For each (token, KV head) the g query heads that share the KV head walk the sequence's block
// table together: each key row is read from its block once, converted to float once and
// dotted with all g queries; the same for values. Nothing is gathered into a contiguous copy
// first, which is what makes this faster than index_select + scaled_dot_product_attention.
//
// Layouts (element strides; T is float or bf16 stored as uint16_t):
//   q:            [num_tokens, num_heads, head_dim], row stride q_stride between tokens
//   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   block_tables: [num_seqs, max_blocks] int32
//   token_seqs:   [num_tokens] int32, or null
//   context_lens: [num_tokens] int32 (positions to attend, the token's own included)
//   out:          [num_tokens, num_heads, head_dim], contiguous
//
// Built by conveyor/model/kernels/build.py with the system C++ compiler and OpenMP; loaded
// with ctypes. The OpenMP runtime is the one torch already loaded (same soname).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kMaxChunks = 256 / kLanes;  // head_dim <= 256

struct Scratch {  // per thread, reused across tasks
  std::vector<float> scores, inv_sum;
  std::vector<vfloat> qv, acc;
};

// One query token, KV heads [h0, h1): each of them with its `group` query heads. The context is
// read block by block and, within a block, token row by token row with all the range's heads
// at once: a sequential stream the hardware prefetcher follows, plus a software prefetch of
// the next block (blocks are scattered); the key pass also prefetches the value rows into L2,
// so that pass finds them there (two streams in flight: 6% faster). CHUNKS = head_dim / kLanes when known at compile time
// (loops unroll), 0 for any other size.
template <typename T, int CHUNKS>
void attend(T* out, const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
            int64_t ctx, int64_t h0, int64_t h1, int64_t group, int64_t head_dim,
            int64_t block_size, int64_t token_stride, float scale, Scratch& scratch) {
  const int64_t chunks = CHUNKS ? CHUNKS : head_dim / kLanes;
  const int64_t block_stride = block_size * token_stride;
  const int64_t heads = (h1 - h0) * group;  // query heads handled here
  const int64_t padded = (ctx + kLanes - 1) / kLanes * kLanes;  // a score row's length
  scratch.scores.resize(heads * padded);
  scratch.qv.resize(heads * chunks);
  scratch.acc.assign(heads * chunks, vfloat{});
  scratch.inv_sum.resize(heads);
  float* scores = scratch.scores.data();
  vfloat* qv = scratch.qv.data();
  vfloat* acc = scratch.acc.data();

  // f(t, row of token t, first element of head h0) for every context token, block by block;
  // `also`: another cache whose same rows to prefetch.
  auto for_each_row = [&](const T* cache, const T* also, auto&& f) {
    const int64_t num_blocks = (ctx + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* base = cache + table[b] * block_stride + h0 * head_dim;
      const T* next = b + 1 < num_blocks ? cache + table[b + 1] * block_stride : nullptr;
      const T* also_here = also ? also + table[b] * block_stride : nullptr;
      const int64_t n = std::min(block_size, ctx - b * block_size);
      for (int64_t j = 0; j < n; ++j) {
        if (next)
          for (int64_t e = 0; e < token_stride; e += 64 / sizeof(T))
            __builtin_prefetch(next + j * token_stride + e);
        if (also_here)
          for (int64_t e = 0; e < token_stride; e += 64 / sizeof(T))
            __builtin_prefetch(also_here + j * token_stride + e, 0, 2);
        f(b * block_size + j, base + j * token_stride);
      }
    }
  };

  // qv[i * chunks + c]: query head i, scaled, as vectors; acc likewise for the output.
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      qv[i * chunks + c] = load(q + (h0 * group + i) * head_dim + c * kLanes) * scale;

  // scores[i][t] = q_i . k_t (i: query head); each key row is loaded once for its g query heads.
  for_each_row(k_cache, v_cache, [&](int64_t t, const T* row) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      vfloat kv[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load(row + h * head_dim + c * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = h * group + g;
        const vfloat* qi = qv + i * chunks;
        vfloat dot = qi[0] * kv[0];
        for (int64_t c = 1; c < chunks; ++c) dot += qi[c] * kv[c];
        scores[i * padded + t] = hsum(dot);
      }
    }
  });

  // Unnormalised softmax, kLanes scores at a time; the rows have room up to a multiple of it.
  for (int64_t i = 0; i < heads; ++i) {
    float* si = scores + i * padded;
    float mx = si[0];
    for (int64_t t = 1; t < ctx; ++t) mx = si[t] > mx ? si[t] : mx;
    for (int64_t t = ctx; t < padded; ++t) si[t] = -INFINITY;  // padding: exp gives ~1e-38
    vfloat sum{};
    for (int64_t t = 0; t < padded; t += kLanes) {
      const vfloat e = vexp(load(si + t) - mx);
      std::memcpy(si + t, &e, sizeof e);
      sum += e;
    }
    scratch.inv_sum[i] = 1.f / hsum(sum);
  }

  // out_i = sum_t p[i][t] v_t / sum_t p[i][t]
  for_each_row(v_cache, nullptr, [&](int64_t t, const T* row) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      vfloat vv[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) vv[c] = load(row + h * head_dim + c * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = h * group + g;
        const float p = scores[i * padded + t];
        vfloat* ai = acc + i * chunks;
        for (int64_t c = 0; c < chunks; ++c) ai[c] += p * vv[c];
      }
    }
  });
  for (int64_t i = 0; i < heads; ++i) {
    const float inv_sum = scratch.inv_sum[i];
    T* o = out + (h0 * group + i) * head_dim;
    for (int64_t c = 0; c < chunks; ++c)
      for (int l = 0; l < kLanes; ++l) store(acc[i * chunks + c][l] * inv_sum, o + c * kLanes + l);
  }
}

template <typename T>
void paged_attention(T* out, const T* q, const T* k_cache, const T* v_cache,
                     const int32_t* block_tables, const int32_t* token_seqs,
                     const int32_t* context_lens, int64_t num_tokens, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t max_blocks, int64_t q_stride, float scale, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  // A task is one token and a range of KV heads: all heads (a whole token row per read) when
  // there are enough tokens to keep the threads busy, else one head per task. A prefill
  // chunk's consecutive tokens read the same rows, which the cache then still holds.
  const int64_t span = num_tokens >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t ranges = num_kv_heads / span;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tokens * ranges; ++task) {
      const int64_t t = task / ranges, h0 = task % ranges * span;
      const int64_t ctx = context_lens[t];
      const int32_t* table = block_tables + (token_seqs ? token_seqs[t] : t) * max_blocks;
      T* o = out + t * num_heads * head_dim;
      const T* qt = q + t * q_stride;
      if (head_dim == 64)
        attend<T, 64 / kLanes>(o, qt, k_cache, v_cache, table, ctx, h0, h0 + span, group,
                               head_dim, block_size, token_stride, scale, scratch);
      else if (head_dim == 128)
        attend<T, 128 / kLanes>(o, qt, k_cache, v_cache, table, ctx, h0, h0 + span, group,
                                head_dim, block_size, token_stride, scale, scratch);
      else
        attend<T, 0>(o, qt, k_cache, v_cache, table, ctx, h0, h0 + span, group, head_dim,
                     block_size, token_stride, scale, scratch);
    }
  }
}

}  // namespace

#define CONVEYOR_PAGED_ATTENTION(NAME, T)                                                    \
  extern "C" void NAME(void* out, const void* q, const void* k_cache, const void* v_cache,  \
                       const int32_t* block_tables, const int32_t* token_seqs,              \
                       const int32_t* context_lens, int64_t num_tokens, int64_t num_heads,  \
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,          \
                       int64_t max_blocks, int64_t q_stride, float scale, int num_threads) { \
    paged_attention<T>(static_cast<T*>(out), static_cast<const T*>(q),                      \
                       static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),      \
                       block_tables, token_seqs, context_lens, num_tokens, num_heads,       \
                       num_kv_heads, head_dim, block_size, max_blocks, q_stride, scale,     \
                       num_threads);                                                        \
  }

CONVEYOR_PAGED_ATTENTION(paged_attention_f32, float)
CONVEYOR_PAGED_ATTENTION(paged_attention_bf16, uint16_t)

// Paged attention read straight from the KV cache (paged_attention.cpp, which describes the
// layouts). T, the queries' type, and C, the cache's, are float or bf16 stored as uint16_t.

#pragma once

#include <cstdint>

namespace conveyor {

// This step's keys and values, [num_tokens, num_kv_heads, head_dim], rows *_stride apart: written
// to cache row slots[t] before any token attends (a prefill chunk's tokens read each other's),
// rounded to the cache's type. k == nullptr: the caller has written them.
template <typename T>
struct NewKV {
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;
  const int64_t* slots = nullptr;
};

// Built for (T, C) = (float, float), (float, bf16) and (bf16, bf16). window > 0: a token at
// position p attends to positions (p - window, p] only, and no block wholly before that range
// is read (its block-table entry may name a freed or reused block); 0: its whole context.
template <typename T, typename C = T>
void paged_attention(T* out, const T* q, C* k_cache, C* v_cache, NewKV<T> new_kv,
                     const int32_t* block_tables, const int32_t* token_seqs,
                     const int32_t* context_lens, int64_t num_tokens, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t max_blocks, int64_t q_stride, float scale, int num_threads,
                     int64_t window = 0);

// Where a token whose context is `ctx` positions reads under `window` (0: none): from block
// `first_block` of its table on, the first `skip` rows of that block being outside the window.
struct WindowStart {
  int64_t first_block, skip;
};
inline WindowStart window_start(int64_t ctx, int64_t window, int64_t block_size) {
  const int64_t first = window > 0 && ctx > window ? ctx - window : 0;
  return {first / block_size, first % block_size};
}

}  // namespace conveyor

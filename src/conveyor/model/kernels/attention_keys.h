// The key pass of a decode token's attention, shared by paged_attention.cpp's attend (float
// FMAs) and attention_bf16.h's attend_bf16 (vdpbf16ps): the token's sequence is read block by
// block (blocks are scattered: the next block's keys are prefetched, and for a decode this
// block's values too, into L2 for the value pass that follows), each key row once for all the
// query heads that share its KV heads. The caller's dot_row(row, r) leaves, for every query
// head i, the products of q_i and key `row` as an unreduced vector in dots[i * kLanes + r];
// kLanes rows' vectors are then reduced together (transposed_hsum): a hsum per score would cost
// more than the products.
// KeyStream brings the next task's keys into L2 during this task's value pass, which reads from
// L2 and would otherwise leave memory idle.

#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace conveyor {

// scores[i * padded + t] = scale * q_i . k_t for t < ctx, i < heads. Rows start at KV head h0;
// `range` elements of each row (the task's KV heads) are prefetched, and of the values too when
// prefetch_values (a decode's; a long run's values would leave L2 before its value pass).
// NEXT_LOCALITY: the prefetch hint for the next block's keys (3: L1, 2: L2). Always inlined:
// called out of line, the dot_row closure's captures were reloaded every row.
template <int NEXT_LOCALITY, typename C, typename DotRow>
__attribute__((always_inline)) inline void score_keys(
    float* scores, int64_t padded, const C* k_cache, const C* v_cache, const int32_t* table,
    int64_t ctx, int64_t h0, int64_t range, int64_t heads, int64_t head_dim, int64_t block_size,
    int64_t token_stride, float scale, bool prefetch_values, vfloat* dots, DotRow&& dot_row) {
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  auto rows_of = [&](const C* cache, int64_t b) {
    return cache + table[b] * block_stride + h0 * head_dim;
  };
  for (int64_t b = 0; b < num_blocks; ++b) {
    const C* rows = rows_of(k_cache, b);
    const C* next = b + 1 < num_blocks ? rows_of(k_cache, b + 1) : nullptr;
    const C* values = rows_of(v_cache, b);
    const int64_t n = std::min(block_size, ctx - b * block_size);
    for (int64_t j = 0; j < n; j += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, n - j);
      for (int64_t r = 0; r < m; ++r) {
        const C* row = rows + (j + r) * token_stride;
        for (int64_t e = 0; e < range; e += 64 / sizeof(C)) {
          if (next) prefetch<NEXT_LOCALITY>(next + (j + r) * token_stride + e);
          if (prefetch_values) prefetch<2>(values + (j + r) * token_stride + e);
        }
        dot_row(row, r);
      }
      for (int64_t i = 0; i < heads; ++i) {
        float* s = scores + i * padded + b * block_size + j;
        if (m == kLanes)
          store(transposed_hsum(dots + i * kLanes) * scale, s);
        else
          for (int64_t r = 0; r < m; ++r) s[r] = hsum(dots[i * kLanes + r]) * scale;
      }
    }
  }
}

// A sequence's keys (KV heads [h0, h1) of its first `ctx` rows) prefetched into L2 a few rows
// at a time: spread_over(n) paces them evenly over n calls of step(). Default-constructed, it
// prefetches nothing. transposed: keys stored [KV head][dim][block row] per block (a float
// cache), prefetched a block at a time.
class KeyStream {
 public:
  KeyStream() = default;
  template <typename C>
  KeyStream(const C* k_cache, const int32_t* table, int64_t ctx, int64_t h0, int64_t h1,
            int64_t head_dim, int64_t block_size, int64_t token_stride, bool transposed = false)
      : table_(table) {
    if (transposed) {
      cache_ = reinterpret_cast<const char*>(k_cache + h0 * head_dim * block_size);
      rows_ = (ctx + block_size - 1) / block_size;
      per_block_ = 1;
      row_bytes_ = token_stride * block_size * sizeof(C);
      row_lines_ = ((h1 - h0) * head_dim * block_size * sizeof(C) + 63) / 64;
    } else {
      cache_ = reinterpret_cast<const char*>(k_cache + h0 * head_dim);
      rows_ = ctx;
      per_block_ = block_size;
      row_bytes_ = token_stride * sizeof(C);
      row_lines_ = ((h1 - h0) * head_dim * sizeof(C) + 63) / 64;
    }
  }

  void spread_over(int64_t steps) { per_step_ = steps > 0 ? (rows_ + steps - 1) / steps : 0; }

  void step() {
    for (const int64_t end = std::min(rows_, row_ + per_step_); row_ < end; ++row_) {
      const char* at =
          cache_ + (table_[row_ / per_block_] * per_block_ + row_ % per_block_) * row_bytes_;
      for (int64_t line = 0; line < row_lines_; ++line) prefetch<2>(at + line * 64);
    }
  }

 private:
  const char* cache_ = nullptr;  // block 0's first row (or keys), at KV head h0
  const int32_t* table_ = nullptr;
  int64_t rows_ = 0, per_block_ = 1, row_bytes_ = 0, row_lines_ = 0, per_step_ = 0;
  int64_t row_ = 0;  // the next row (or block) to fetch
};

}  // namespace conveyor

// Decode-way attention of bf16 queries over a bf16 cache on vdpbf16ps (AVX512-BF16): a query
// token (or a deterministic run of a prefill chunk's tokens, as attend takes them) against KV
// heads [h0, h1), each with its `group` query heads. Included by
// paged_attention.cpp, which sends decode tokens here when the CPU has the instruction and
// head_dim is 64 or 128.
//
// paged_attention.cpp's attend converts every key and value element to float before its
// FMAs, which makes a large decode step compute-bound once the cache is in L2. vdpbf16ps takes
// the bf16 elements as they are and does 32 products where an FMA does 16, which leaves it
// bound by reading the scattered blocks:
//   keys:   q . k_t as two vectors of 32 bf16 per 64 dims, the products exact and summed in
//           float (the scale is applied to the reduced score, not rounded into q);
//   values: out += p_t v_t + p_t+1 v_t+1, two consecutive rows of a block interleaved by
//           element (bf16_pairs.h; the accumulators hold a chunk's 32 dimensions in a permuted
//           order, put back once at the output), and the weights p_t, p_t+1 rounded to bf16 (as
//           flash attention rounds P before its PV product). The weights are normalised by the
//           sum of their rounded values.

#pragma once

#ifdef __AVX512BF16__

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_keys.h"
#include "bf16_pairs.h"
#include "dispatch.h"
#include "madd_step.h"
#include "vec.h"

namespace conveyor {

constexpr int kBf16Chunk = kPairDims;  // dimensions per vector of bf16
constexpr int kBf16GroupTile = 4;    // query heads whose accumulators stay in registers

struct Bf16Scratch {  // per thread, reused across tasks and calls
  std::vector<float> scores, inv_sum;
  std::vector<uint16_t> weights;  // the scores after softmax, rounded to bf16
  std::vector<vfloat> dots;
  std::vector<const uint16_t*> queries;  // each row's query head
};

// n consecutive tokens of one sequence, rows ordered and contexts as in attend (a decode is
// n = 1; a run's rows come out bit for bit as each token's alone: pairs of value rows start at
// a block's even positions whatever the row, and a row's weights are 0 past its context). The
// first `skip` positions of the context are read but weigh nothing (n = 1, as in attend).
template <int CHUNKS>  // head_dim / kBf16Chunk
void attend_bf16(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride,
                 int64_t n, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int32_t* table, int64_t ctx, int64_t skip, int64_t h0, int64_t h1,
                 int64_t group, int64_t block_size, int64_t token_stride, float scale,
                 Bf16Scratch& scratch, KeyStream& next_keys) {
  constexpr int64_t head_dim = CHUNKS * kBf16Chunk;
  const int64_t block_stride = block_size * token_stride;
  const int64_t last = ctx + n - 1;  // the last token's context: the keys read
  const int64_t num_blocks = (last + block_size - 1) / block_size;
  const int64_t per_head = n * group;  // rows of one KV head
  const int64_t rows = (h1 - h0) * per_head;
  const int64_t padded = (last + kLanes - 1) / kLanes * kLanes;  // a score row's length
  const int64_t range = (h1 - h0) * head_dim;
  float* scores = at_least(scratch.scores, rows * padded);
  uint16_t* weights = at_least(scratch.weights, rows * padded);
  vfloat* dots = at_least(scratch.dots, rows * kLanes);
  float* inv_sum = at_least(scratch.inv_sum, rows);
  const uint16_t** queries = at_least(scratch.queries, rows);

  auto token_of = [&](int64_t i) { return i / group % n; };
  auto head_of = [&](int64_t i) {  // the query head's offset in a token row
    return ((h0 + i / per_head) * group + i % group) * head_dim;
  };
  for (int64_t i = 0; i < rows; ++i) queries[i] = q + token_of(i) * q_stride + head_of(i);
  auto rows_of = [&](const uint16_t* cache, int64_t b) {
    return cache + table[b] * block_stride + h0 * head_dim;
  };
  auto rows_in = [&](int64_t b, int64_t len) { return std::min(block_size, len - b * block_size); };

  // Scores: each key row dotted as it lies with the rows of its KV head (attention_keys.h); the
  // next block's keys are prefetched into L2 rather than L1, which measured faster here.
  score_keys<2>(scores, padded, k_cache, v_cache, table, last, h0, range, rows, head_dim,
                block_size, token_stride, scale, n == 1, dots,
                [=](const uint16_t* row, int64_t r) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      __m512bh kv[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) kv[c] = BF16::vector(row + h * head_dim + c * kBf16Chunk);
      for (int64_t i = h * per_head; i < (h + 1) * per_head; ++i) {
        const uint16_t* qi = queries[i];
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < CHUNKS; ++c)
          dot = _mm512_dpbf16_ps(dot, kv[c], BF16::vector(qi + c * kBf16Chunk));
        dots[i * kLanes + r] = (vfloat)dot;
      }
    }
  });

  // Softmax, the weights rounded to bf16 (zeros from a row's context to padded: the last pair's
  // partner after an odd context).
  for (int64_t i = 0; i < rows; ++i) {
    std::fill(scores + i * padded, scores + i * padded + skip, -INFINITY);
    inv_sum[i] =
        softmax_row(scores + i * padded, ctx + token_of(i), padded, weights + i * padded);
  }

  // out_i = sum_t w[i][t] v_t / sum_t w[i][t]: per KV head, up to kBf16GroupTile of its rows and
  // one chunk of 32 dimensions at a time (2 accumulators a row), over the context's row pairs.
  // The values are in L2 (the key pass fetched them), so the next task's keys come in meanwhile.
  const int64_t tiles = (per_head + kBf16GroupTile - 1) / kBf16GroupTile;
  next_keys.spread_over((h1 - h0) * tiles * CHUNKS * num_blocks);
  auto weigh_values = [&](auto tile, int64_t h, int64_t i0, int c) {
    constexpr int G = decltype(tile)::value;
    const int64_t len = ctx + token_of(i0 + G - 1);  // the tile's longest context
    const int64_t first = h * head_dim + c * kBf16Chunk;
    vfloat lo[G] = {}, hi[G] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      next_keys.step();
      const int64_t t0 = b * block_size, m = rows_in(b, len);
      if (m <= 0) continue;
      const uint16_t* block = rows_of(v_cache, b) + first;
      for (int64_t j = 0; j < m; j += 2) {
        const RowPairs v = interleave(block + j * token_stride,
                                      j + 1 < m ? block + (j + 1) * token_stride : nullptr);
        for (int g = 0; g < G; ++g) {
          const auto p = BF16::broadcast(weights + (i0 + g) * padded + t0 + j);
          BF16::madd(lo[g], p, v.lo);
          BF16::madd(hi[g], p, v.hi);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      store_in_order(lo[g] * inv_sum[i0 + g], hi[g] * inv_sum[i0 + g],
                     out + token_of(i0 + g) * out_stride + head_of(i0 + g) + c * kBf16Chunk);
  };
  for (int64_t h = 0; h < h1 - h0; ++h)
    for (int64_t i = h * per_head; i < (h + 1) * per_head; i += kBf16GroupTile)
      for (int c = 0; c < CHUNKS; ++c)
        with_constant<kBf16GroupTile>(std::min<int64_t>((h + 1) * per_head - i, kBf16GroupTile),
                                      [&](auto tile) { weigh_values(tile, h, i, c); });
}

}  // namespace conveyor

#endif  // __AVX512BF16__

// Paged attention read straight from the KV cache (CPU): decodes and prefill chunks alike.
//
// Every query token attends to the first context_lens[t] positions of its sequence, the
// sequence being token_seqs[t] (a row of block_tables; null: token t is sequence t's only
// token, a decode step). A prefill chunk's tokens thus each see their own causal prefix,
// cached prefix included: no padding, no mask, no gathered copy of the keys.
// A prefill chunk's consecutive tokens go in tiles of query rows (attention_tile.h), where each
// key and value row read serves many queries; a decode token, or a token of a short run, goes
// alone (attend_decode below), each key read once for all the query heads of its KV head. Both
// compute in one arithmetic, so a row's bits are the same whichever way it goes: the keys are
// read as vectors of positions (the K cache stores each block's keys transposed), a score is a
// chain of products over the head dimension, the softmax folds fixed stretches of keys, and
// each output element sums the values in position order. Nothing is gathered into a contiguous
// copy first, which is what makes this faster than index_select +
// scaled_dot_product_attention.
//
// Layouts (element strides; T, the queries' type, and C, the cache's, are float or bf16
// stored as uint16_t):
//   q:            [num_tokens, num_heads, head_dim], row stride q_stride between tokens
//   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim] of C, contiguous; a K
//                 cache's block stores [num_kv_heads, head_dim / P, block_size, P] (its keys
//                 transposed in 32-bit lanes: P = 1 float or 2 bf16) under the same shape
//   block_tables: [num_seqs, max_blocks] int32
//   token_seqs:   [num_tokens] int32, or null
//   context_lens: [num_tokens] int32 (positions to attend, the token's own included)
//   out:          [num_tokens, num_heads, head_dim], contiguous
//   new_k/new_v:  [num_tokens, num_kv_heads, head_dim], row strides k_stride/v_stride, or null;
//                 written to cache rows slot_mapping[t] ([num_tokens] int64) first
//
// Entry point in paged_attention.h; ops.cpp makes it a torch operator, build.py builds both with
// the system C++ compiler and OpenMP (the runtime torch already loaded: the same soname).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_keys.h"
#include "attention_tile.h"
#include "dispatch.h"
#include "paged_attention.h"
#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kLineChunks = 64 / sizeof(vfloat);  // vectors in a cache line: 2 (AVX2) or 1
constexpr int kGroupTile = 4;  // query heads whose value accumulators are held in registers

// A decode's values of a block's rows [j0, j1) (row j at block + j * token_stride, the cache
// line read at `line`) weighed into G query heads' accumulators, kLineChunks vectors each at
// acc + g * chunks, every element summed in position order: p[g * p_stride + j - j0] is head
// g's weight of row j. The accumulators stay in registers over the rows; held for all of a
// KV head's heads and vectors at once (9 x 64 floats) they would spill, a load and a store each,
// every key. next: the next block, whose same lines are prefetched.
template <int G, typename C>
inline void weigh_lines(vfloat* acc, int64_t chunks, const float* p, int64_t p_stride,
                        const C* block, const C* next, int64_t j0, int64_t j1, int64_t line,
                        int64_t token_stride) {
  vfloat a[G][kLineChunks];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kLineChunks; ++c) a[g][c] = acc[g * chunks + c];
  for (int64_t j = j0; j < j1; ++j) {
    const C* row = block + j * token_stride + line;
    if (next) __builtin_prefetch(next + j * token_stride + line);
    for (int c = 0; c < kLineChunks; ++c) {
      const vfloat v = load(row + c * kLanes);
      for (int g = 0; g < G; ++g) a[g][c] += p[g * p_stride + j - j0] * v;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kLineChunks; ++c) acc[g * chunks + c] = a[g][c];
}

// A block's rows [j0, j1) weighed into the accumulators of every query head of KV heads [0,
// heads) (head i at acc + i * chunks, its weight of row j0 at p[i * p_stride]): kGroupTile heads
// and one cache line at a time (weigh_lines).
template <typename C>
__attribute__((always_inline)) inline void weigh_block(vfloat* acc, int64_t chunks,
                                                       const float* p, int64_t p_stride,
                                                       const C* block, const C* next, int64_t j0,
                                                       int64_t j1, int64_t heads, int64_t group,
                                                       int64_t head_dim, int64_t token_stride) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = h * group; i < (h + 1) * group; i += kGroupTile)
      for (int64_t c = 0; c < chunks; c += kLineChunks)
        with_constant<kGroupTile>(std::min<int64_t>((h + 1) * group - i, kGroupTile),
                                  [&](auto tile) {
          weigh_lines<decltype(tile)::value>(acc + i * chunks + c, chunks, p + i * p_stride,
                                             p_stride, block, next, j0, j1,
                                             h * head_dim + c * kLanes, token_stride);
        });
}

// A query token alone (a decode, or a token of a short run) against KV heads [h0, h1), each
// with its `group` query heads, in the arithmetic of the tiles (attention_tile.h) with the same
// F (madd_step.h: F32, or BF16 for bf16 queries over a bf16 cache), so that a token's bits are
// those of its row in any tile: a score is score_rows' chain of products over the head
// dimension on keys read in place as vectors of positions (key_halves), the softmax folds
// kKeyChunk keys at a time from fixed positions, each output element sums the values in
// position order (BF16: in pairs of rows from even positions, the weights rounded to bf16).
// What differs from a tile is how the cache is read: kDecodeKeys keys at a time, read once for
// the task's KV heads; the next keys are prefetched (kNextKeys) and these keys' values into L2
// (for the value pass that follows the chunk's keys), their lines spread over the products,
// and the next task's keys into L2 during the value pass (KeyStream); the values come straight
// from the cache. The table starts at the window's first block, whose absolute position
// `first` fixes where chunks start; its first `skip` rows weigh nothing. CHUNKS = head_dim /
// kLanes when known at compile time (loops unroll), 0 for any other size.
template <typename E>  // F::T
struct DecodeScratch {  // per thread, reused across tasks and calls
  std::vector<E> q, p;  // p: the softmax weights as bf16 (BF16 only)
  std::vector<uint32_t> kt;  // key_halves' gathered lanes
  std::vector<float> scores, row_max, row_sum;
  std::vector<vfloat> acc;
  std::vector<const char*> lines;  // a key tile's value lines, to prefetch
  std::vector<const uint16_t*> value_rows;  // a chunk's, for BF16's value pass
};

// Key vectors a decode's score pass holds at once: with AVX-512 four, so that a group of 3
// query heads has 12 chains of products in flight (enough to cover the FMA's or vdpbf16ps's
// latency); with AVX2's 16 registers two.
constexpr int kDecodeHalves = kLanes == 16 ? 4 : 2;
constexpr int64_t kDecodeKeys = kDecodeHalves * kLanes;
constexpr int64_t kPairStep = 32;  // positions of a value pass per step of the next task's keys
// Where a decode prefetches its next keys: with AVX2 into L1 (a step's next keys are a block or
// two), with AVX-512 into L2 (four times as many would crowd L1); measured faster each.
constexpr int kNextKeys = kLanes == 16 ? 2 : 3;

// How many times weigh_pairs steps the next task's keys over `positions` positions in
// `num_chunks` chunks (at most): once per kPairStep positions of each of its passes.
constexpr int64_t pair_steps(int64_t heads, int64_t group, int64_t chunks, int64_t positions,
                             int64_t num_chunks) {
  const int64_t passes = heads * ((group + kGroupTile - 1) / kGroupTile) * ((chunks / 2 + 1) / 2);
  return passes * (positions / kPairStep + 2 * num_chunks);
}

// BF16's value pass over positions [lo, c1) of the chunk starting at c0: pairs of rows from an
// even position (the rows before `first` and the partner after c1 are zeros, weighing 0), the
// weights p (bf16, row i at p + i * p_stride, position c0 first), into acc's permuted order
// (row i's 32-dimension chunk m at acc[i * chunks + 2m], + 1).
#ifdef __AVX512BF16__
inline void weigh_pairs(vfloat* acc, int64_t chunks, const uint16_t* p, int64_t p_stride,
                        const uint16_t* v_cache, const int32_t* table, int64_t first,
                        int64_t c0, int64_t lo, int64_t c1, int64_t h0, int64_t h1,
                        int64_t group, int64_t head_dim, int64_t block_size,
                        int64_t token_stride, const uint16_t** rows, KeyStream& next_keys) {
  alignas(64) static const uint16_t zero_row[kPairDims] = {};
  const int64_t p0 = lo & ~int64_t{1}, n = c1 - p0;
  const int64_t from = std::max<int64_t>(p0, first) - first;  // the first row in the table
  std::fill(rows, rows + (from + first - p0), nullptr);
  for (int64_t k = from + first - p0, b = from / block_size, j = from % block_size; k < n; ++k) {
    rows[k] = v_cache + (table[b] * block_size + j) * token_stride;
    if (++j == block_size) j = 0, ++b;
  }
  rows[n] = nullptr;
  // Up to kGroupTile rows x two chunks of 32 dimensions (8 accumulators) at a time.
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = (h - h0) * group; i < (h - h0 + 1) * group; i += kGroupTile)
      for (int64_t m0 = 0; m0 < chunks / 2; m0 += 2)
        with_constant<kGroupTile>(std::min<int64_t>((h - h0 + 1) * group - i, kGroupTile),
                                  [&](auto tile) {
          with_constant<2>(std::min<int64_t>(chunks / 2 - m0, 2), [&](auto pairs) {
            constexpr int G = decltype(tile)::value, M = decltype(pairs)::value;
            const int64_t at = h * head_dim + m0 * kPairDims;
            vfloat a[G][M][2];
            for (int g = 0; g < G; ++g)
              for (int m = 0; m < M; ++m)
                for (int c = 0; c < 2; ++c) a[g][m][c] = acc[(i + g) * chunks + 2 * (m0 + m) + c];
            const uint16_t* w = p + i * p_stride + (p0 - c0);
            for (int64_t k = 0; k < n; k += 2) {
              if (k % kPairStep == 0) next_keys.step();
              RowPairs v[M];
              for (int m = 0; m < M; ++m)
                v[m] = interleave(rows[k] ? rows[k] + at + m * kPairDims : zero_row,
                                  rows[k + 1] ? rows[k + 1] + at + m * kPairDims : nullptr);
              for (int g = 0; g < G; ++g) {
                const auto x = BF16::broadcast(w + g * p_stride + k);
                for (int m = 0; m < M; ++m) {
                  BF16::madd(a[g][m][0], x, v[m].lo);
                  BF16::madd(a[g][m][1], x, v[m].hi);
                }
              }
            }
            for (int g = 0; g < G; ++g)
              for (int m = 0; m < M; ++m)
                for (int c = 0; c < 2; ++c) acc[(i + g) * chunks + 2 * (m0 + m) + c] = a[g][m][c];
          });
        });
}
#endif

template <class F, int CHUNKS, typename T, typename C>
void attend_decode(T* out, const T* q, const C* k_cache, const C* v_cache, const int32_t* table,
                   int64_t ctx, int64_t first, int64_t skip, int64_t h0, int64_t h1,
                   int64_t group, int64_t head_dim, int64_t block_size, int64_t num_kv_heads,
                   float scale, DecodeScratch<typename F::T>& scratch, KeyStream& next_keys) {
  using E = typename F::T;
  constexpr bool kBf16 = F::kStep == 2;
  const int64_t chunks = CHUNKS ? CHUNKS : head_dim / kLanes;
  const int64_t num_lanes = head_dim / kPerLane<C>;  // a key's lanes (attention_tile.h)
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t rows = (h1 - h0) * group;  // row i: query head h0 * group + i
  const int64_t width_max = kKeyChunk + kKeyTile;
  E* qs = at_least(scratch.q, rows * head_dim);
  float* scores = at_least(scratch.scores, rows * width_max);
  // The weights the values take: the scores themselves in float, written over them; for BF16
  // their bf16 rounding, in an array of their own.
  E* p = kBf16 ? at_least(scratch.p, rows * width_max) : reinterpret_cast<E*>(scores);
  uint32_t* kt = at_least(scratch.kt, kDecodeHalves / 2 * head_dim * kKeyTile);
  vfloat* acc = at_least(scratch.acc, rows * chunks);
  float* row_max = at_least(scratch.row_max, rows);
  float* row_sum = at_least(scratch.row_sum, rows);
  std::fill(acc, acc + rows * chunks, vfloat{});
  std::fill(row_max, row_max + rows, -INFINITY);
  std::fill(row_sum, row_sum + rows, 0.f);
  for (int64_t i = 0; i < rows; ++i)
    query_row<F>(qs + i * head_dim, q + (h0 * group + i) * head_dim, head_dim, scale);
  const float score_scale = scores_scale<F>(scale);

  const int64_t start = first + skip, end = first + ctx;  // the positions that weigh
  const int64_t num_chunks = (end - 1) / kKeyChunk - start / kKeyChunk + 1;
  next_keys.spread_over(kBf16 ? pair_steps(h1 - h0, group, chunks, ctx - skip, num_chunks)
                              : (ctx - skip + block_size - 1) / block_size + 1);
  const int64_t row_lines = ((h1 - h0) * head_dim * sizeof(C) + 63) / 64;
  const char** lines = at_least(scratch.lines, kDecodeKeys * row_lines);
  const int64_t key_lines = (head_dim * block_size * sizeof(C) + 63) / 64;  // a block's, a head's
  for (int64_t c0 = start / kKeyChunk * kKeyChunk; c0 < end; c0 += kKeyChunk) {
    const int64_t c1 = std::min(end, c0 + kKeyChunk), lo = std::max(c0, start);
    for (int64_t k0 = c0 + (lo - c0) / kDecodeKeys * kDecodeKeys; k0 < c1; k0 += kDecodeKeys) {
      const int64_t k_lo = std::max(k0, lo) - first;
      const int64_t k_hi = std::min(c1, k0 + kDecodeKeys) - first;
      // These keys' values into L2 for the value pass, the next keys where kNextKeys says: their
      // cache lines spread over the products (a burst would fill the miss buffers).
      int64_t num_lines = 0;
      for (int64_t b = k_lo / block_size, j = k_lo % block_size, n = k_hi - k_lo; n > 0; --n) {
        const char* row = reinterpret_cast<const char*>(
            v_cache + (table[b] * block_size + j) * token_stride + h0 * head_dim);
        for (int64_t e = 0; e < row_lines; ++e) lines[num_lines++] = row + e * 64;
        if (++j == block_size) j = 0, ++b;
      }
      const int64_t per_lane = (num_lines + (h1 - h0) * num_lanes - 1) / ((h1 - h0) * num_lanes);
      int64_t next_blocks[kDecodeKeys], num_next = 0;  // the blocks starting in the next keys
      for (int64_t at = (k0 + kDecodeKeys - first + block_size - 1) / block_size * block_size;
           at < k0 + 2 * kDecodeKeys - first && at + first < end; at += block_size)
        next_blocks[num_next++] = at;
      const int64_t next_lines = num_next * key_lines;
      for (int64_t h = 0; h < h1 - h0; ++h) {
        // kDecodeHalves vectors of keys, a key tile's two at a time; a tile wholly outside
        // [lo, c1) reads another's (its scores are not used).
        const C* half[kDecodeHalves];
        int64_t key_stride = 0;
        for (int v = 0; v < kDecodeHalves; v += 2)
          key_stride = key_halves(k_cache, table, h0 + h, num_kv_heads, head_dim, block_size,
                                  k0 + v * kLanes - first, lo - first, c1 - first,
                                  kt + v / 2 * num_lanes * kKeyTile, half + v);
        const C* any = *std::find_if(half, half + kDecodeHalves, [](const C* k) { return k; });
        for (const C*& k : half)
          if (!k) k = any;
        const char* next[kDecodeKeys];  // this KV head's keys in those blocks
        for (int64_t i = 0; i < num_next; ++i)
          next[i] = reinterpret_cast<const char*>(transposed_key(
              k_cache, table, next_blocks[i], h0 + h, num_kv_heads, head_dim, block_size));
        int64_t key_line = 0, next_block = 0, block_line = 0;  // the next line to prefetch
        for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += kRowTile)
          with_constant<kRowTile>(std::min<int64_t>((h + 1) * group - r0, kRowTile),
                                  [&](auto mr) {
            score_rows<F, decltype(mr)::value, kDecodeHalves>(
                qs + r0 * head_dim, head_dim, half, key_stride,
                scores + r0 * width_max + (k0 - c0), width_max, score_scale, [&](int64_t l) {
                  if (r0 != h * group) return;  // the first row tile prefetches
                  for (; key_line * num_lanes < (l + 1) * next_lines; ++key_line) {
                    prefetch<kNextKeys>(next[next_block] + block_line * 64);
                    if (++block_line == key_lines) block_line = 0, ++next_block;
                  }
                  for (int64_t i = (h * num_lanes + l) * per_lane;
                       i < std::min(num_lines, (h * num_lanes + l + 1) * per_lane); ++i)
                    prefetch<2>(lines[i]);
                });
          });
      }
    }
    const int64_t own = c1 - c0, width = (own + kLanes - 1) / kLanes * kLanes;
    for (int64_t i = 0; i < rows; ++i) {
      float* s = scores + i * width_max;
      std::fill(s, s + (lo - c0), -INFINITY);
      const float rescale = softmax_fold(s, own, width, row_max[i], row_sum[i], p + i * width_max);
      if (rescale != 1.f)
        for (int64_t c = 0; c < chunks; ++c) acc[i * chunks + c] *= rescale;
    }
    if constexpr (kBf16) {
#ifdef __AVX512BF16__
      weigh_pairs(acc, chunks, p, width_max, v_cache, table, first, c0, lo, c1, h0, h1, group,
                  head_dim, block_size, token_stride,
                  at_least(scratch.value_rows, kKeyChunk + 2), next_keys);
#endif
    } else {
      for (int64_t k = lo; k < c1;) {
        const int64_t b = (k - first) / block_size, b0 = first + b * block_size;
        const int64_t b1 = std::min(c1, b0 + block_size);
        const C* block = v_cache + table[b] * block_size * token_stride + h0 * head_dim;
        const C* next =
            b1 < c1 ? v_cache + table[b + 1] * block_size * token_stride + h0 * head_dim
                    : nullptr;
        next_keys.step();
        weigh_block(acc, chunks, p + (k - c0), width_max, block, next, k - b0, b1 - b0,
                    h1 - h0, group, head_dim, token_stride);
        k = b1;
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv_sum = 1.f / row_sum[i];
    T* o = out + (h0 * group + i) * head_dim;
    if constexpr (kBf16) {
#ifdef __AVX512BF16__
      for (int64_t m = 0; m < chunks / 2; ++m)
        store_in_order(acc[i * chunks + 2 * m] * inv_sum, acc[i * chunks + 2 * m + 1] * inv_sum,
                       o + m * kPairDims);
#endif
    } else {
      for (int64_t c = 0; c < chunks; ++c) store(acc[i * chunks + c] * inv_sum, o + c * kLanes);
    }
  }
}

template <typename T, typename C>
void copy_row(C* dst, const T* src, int64_t n) {  // n: a multiple of kLanes
  for (int64_t e = 0; e < n; e += kLanes) store(load(src + e), dst + e);
}

// What one thread does at a time: tokens [t, t + n) of one sequence against KV head h0 (a tile,
// attention_tile.h), or token t against KV heads [h0, h1) (attend_decode).
struct Task {
  int64_t t, n, h0, h1;
  bool tile;
};

// A run is a prefill chunk's consecutive tokens: one sequence, each seeing one more position.
// Runs of at least kMinTileRows query rows go in tiles of about kTileRows rows, last tile
// first (the longest contexts: dynamic scheduling then balances the rest); the other tokens
// go one by one, all KV heads per task when there are enough tokens to keep the threads busy.
// Both ways compute a row in one arithmetic, so where a token goes never changes its bits.
constexpr int64_t kMinTileRows = 24;

std::vector<Task> plan_tasks(const int32_t* token_seqs, const int32_t* context_lens,
                             int64_t num_tokens, int64_t num_kv_heads, int64_t group,
                             int num_threads) {
  const int64_t span = num_tokens >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / group);
  std::vector<Task> tasks;
  for (int64_t t = 0; t < num_tokens;) {
    int64_t end = t + 1;
    while (token_seqs && end < num_tokens && token_seqs[end] == token_seqs[t] &&
           context_lens[end] == context_lens[end - 1] + 1)
      ++end;
    if ((end - t) * group >= kMinTileRows) {
      for (int64_t s = t + (end - t - 1) / per_tile * per_tile; s >= t; s -= per_tile)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          tasks.push_back({s, std::min(per_tile, end - s), h, h + 1, true});
    } else {
      for (int64_t u = t; u < end; ++u)
        for (int64_t h0 = 0; h0 < num_kv_heads; h0 += span)
          tasks.push_back({u, 1, h0, h0 + span, false});
    }
    t = end;
  }
  return tasks;
}

}  // namespace

namespace conveyor {

template <typename T, typename C>
void paged_attention(T* out, const T* q, C* k_cache, C* v_cache, NewKV<T> new_kv,
                     const int32_t* block_tables, const int32_t* token_seqs,
                     const int32_t* context_lens, int64_t num_tokens, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t max_blocks, int64_t q_stride, float scale, int num_threads,
                     int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const std::vector<Task> tasks =
      plan_tasks(token_seqs, context_lens, num_tokens, num_kv_heads, group, num_threads);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  auto table_of = [&](int64_t t) {  // token t's sequence's block table
    return block_tables + (token_seqs ? token_seqs[t] : t) * max_blocks;
  };
  // What a decode-way token reads: its table from the window's first block, the context from
  // that block's first row, the rows of it before the window.
  struct Span {
    const int32_t* table;
    int64_t ctx, skip, first;
  };
  auto span_of = [&](int64_t t) {
    const int64_t ctx = context_lens[t];
    const WindowStart w = window_start(ctx, window, block_size);
    return Span{table_of(t) + w.first_block, ctx - w.first_block * block_size, w.skip,
                w.first_block * block_size};
  };
  std::atomic<int64_t> next_task{0};
#pragma omp parallel num_threads(num_threads)
  {
    if (new_kv.k) {
      static thread_local std::vector<C> key_row;  // a key rounded to the cache's type
#pragma omp for  // and its barrier: every row is in place before anyone reads
      for (int64_t t = 0; t < num_tokens; ++t) {
        // Keys transposed as lanes of P elements: block b's [head_dim * heads / P][slot][P].
        constexpr int64_t P = kPerLane<C>;
        const int64_t slot = new_kv.slots[t], b = slot / block_size, j = slot % block_size;
        C* key = at_least(key_row, token_stride);
        copy_row(key, new_kv.k + t * new_kv.k_stride, token_stride);
        for (int64_t e = 0; e < token_stride; e += P)
          std::memcpy(k_cache + (b * token_stride + e) * block_size + j * P, key + e,
                      P * sizeof(C));
        copy_row(v_cache + new_kv.slots[t] * token_stride, new_kv.v + t * new_kv.v_stride,
                 token_stride);
      }
    }
    static thread_local DecodeScratch<float> decode_scratch;
    TileScratch<float> tile_scratch;
#ifdef __AVX512BF16__
    static thread_local DecodeScratch<uint16_t> bf16_decode_scratch;
    TileScratch<uint16_t> bf16_tile_scratch;
#endif
    // step: madd_step.h's F32 or BF16, as the tiles take it (BF16 for bf16 queries over a bf16
    // cache where the CPU has AVX512-BF16), the same for a tile and a decode.
    auto run = [&](const Task& task, KeyStream& next_keys) {
      const int64_t t = task.t, h0 = task.h0, h1 = task.h1;
      T* o = out + t * num_heads * head_dim;
      const T* qt = q + t * q_stride;
      auto go = [&](auto step, auto& step_tile_scratch, auto& step_decode_scratch) {
        using F = decltype(step);
        if (task.tile) {
          attend_tile<F>(o, num_heads * head_dim, qt, q_stride, k_cache, v_cache, table_of(t),
                         context_lens[t], task.n, h0, group, head_dim, block_size, token_stride,
                         scale, window, step_tile_scratch);
          return;
        }
        const Span span = span_of(t);
        auto decode = [&](auto chunks) {
          attend_decode<F, decltype(chunks)::value>(
              o, qt, k_cache, v_cache, span.table, span.ctx, span.first, span.skip, h0, h1,
              group, head_dim, block_size, num_kv_heads, scale, step_decode_scratch, next_keys);
        };
        if (head_dim == 64)
          decode(std::integral_constant<int, 64 / kLanes>{});
        else if (head_dim == 128)
          decode(std::integral_constant<int, 128 / kLanes>{});
        else if (head_dim == 256)
          decode(std::integral_constant<int, 256 / kLanes>{});
        else
          decode(std::integral_constant<int, 0>{});
      };
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t>)
        if (head_dim % kPairDims == 0) {
          go(BF16{}, bf16_tile_scratch, bf16_decode_scratch);
          return;
        }
#endif
      go(F32{}, tile_scratch, decode_scratch);
    };
    // Dynamic scheduling by hand. With tasks enough to go round, a thread claims its next task
    // as it starts one, so that a decode task can fetch the next one's keys (KeyStream) while it
    // computes; with few, claiming ahead could leave the other thread idle.
    const bool claim_ahead = num_tasks >= 4 * num_threads;
    for (int64_t i = next_task++; i < num_tasks;) {
      const int64_t following = claim_ahead ? next_task++ : num_tasks;
      KeyStream next_keys;
      if (following < num_tasks && !tasks[following].tile) {
        const Task& f = tasks[following];
        const Span next = span_of(f.t);
        next_keys = KeyStream(k_cache, next.table, next.ctx + f.n - 1, f.h0, f.h1, head_dim,
                              block_size, token_stride);
      }
      run(tasks[i], next_keys);
      i = claim_ahead ? following : next_task++;
    }
  }
}

template void paged_attention<float, float>(float*, const float*, float*, float*, NewKV<float>,
                                            const int32_t*, const int32_t*, const int32_t*,
                                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                            int64_t, float, int, int64_t);
template void paged_attention<float, uint16_t>(float*, const float*, uint16_t*, uint16_t*,
                                               NewKV<float>, const int32_t*, const int32_t*,
                                               const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                               int64_t, int64_t, int64_t, float, int, int64_t);
template void paged_attention<uint16_t, uint16_t>(uint16_t*, const uint16_t*, uint16_t*,
                                                  uint16_t*, NewKV<uint16_t>, const int32_t*,
                                                  const int32_t*, const int32_t*, int64_t,
                                                  int64_t, int64_t, int64_t, int64_t, int64_t,
                                                  int64_t, float, int, int64_t);

}  // namespace conveyor

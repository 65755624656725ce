// Paged attention read straight from the KV cache (CPU): decodes and prefill chunks alike.
//
// Every query token attends to the first context_lens[t] positions of its sequence, the
// sequence being token_seqs[t] (a row of block_tables; null: token t is sequence t's only
// token, a decode step). A prefill chunk's tokens thus each see their own causal prefix,
// cached prefix included: no padding, no mask, no gathered copy of the keys.
// A decode token over a float cache (attend_transposed below) computes in the tiles'
// arithmetic, reading a block's keys as vectors of positions (the K cache stores them
// transposed): each key tile is read once for all the g query heads of its KV head, values a
// cache line at a time for up to kGroupTile of them. Over a bf16 cache (attend) each key row is
// read from its block once, converted to float once and dotted with all g queries (bf16
// queries, where the CPU has AVX512-BF16, take attention_bf16.h's version of this on
// vdpbf16ps). The value pass reads from L2, so meanwhile the keys of the thread's next task are
// prefetched (attention_keys.h's KeyStream). A prefill chunk's consecutive tokens instead go in
// tiles of query rows (attention_tile.h), where each key and value row read serves many
// queries. A float cache's decodes and tiles share one arithmetic, so every row's bits are the
// same whichever way it goes; over a bf16 cache the deterministic mode sends a chunk's tokens in
// runs through the decode's own arithmetic (attend with n > 1: each key and value row read
// once for the run's query rows, each row's sums those of the token alone). Nothing is gathered
// into a contiguous copy first, which is what makes this faster than index_select +
// scaled_dot_product_attention.
//
// Layouts (element strides; T, the queries' type, and C, the cache's, are float or bf16
// stored as uint16_t):
//   q:            [num_tokens, num_heads, head_dim], row stride q_stride between tokens
//   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim] of C, contiguous; a float
//                 K cache's block stores [num_kv_heads, head_dim, block_size] (its keys
//                 transposed) under the same shape
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
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "attention_keys.h"
#include "attention_tile.h"
#include "dispatch.h"
#include "paged_attention.h"
#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kMaxChunks = 256 / kLanes;  // head_dim <= 256
constexpr int kLineChunks = 64 / sizeof(vfloat);  // vectors in a cache line: 2 (AVX2) or 1
constexpr int kGroupTile = 4;  // query heads whose value accumulators are held in registers
constexpr int kRunTile = 6;  // a run's rows whose value accumulators are held in registers
constexpr int64_t kRunKeys = 64;  // keys a run's value pass takes at a time (L1-sized)

struct Scratch {  // per thread, reused across tasks and calls
  std::vector<float> scores, inv_sum;
  std::vector<vfloat> qv, acc, dots;  // dots: kLanes rows' unreduced q.k products per head
};

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

// n consecutive query tokens of one sequence (token u: query row q + u * q_stride, output row
// out + u * out_stride, context ctx + u positions), KV heads [h0, h1): each of them with its
// `group` query heads. A decode is n = 1; a run of a prefill chunk's tokens (n > 1) shares each
// key and value row read among all of its n x g query rows. Row i of the task is KV head
// h0 + i / (n g), token i / g % n, query head g = i % g of that KV head. Whatever n, a row's
// scores, softmax and value sums are the same operations in the same order as the token's alone:
// a key's score does not depend on which other rows were dotted with it, a row's softmax covers
// its own context (later keys get weight 0) and its value sums run over positions in order
// (weight-0 terms add nothing). The context is read block by block (attention_keys.h, then the
// values; the next block is prefetched). CHUNKS = head_dim / kLanes when known at compile time
// (loops unroll), 0 for any other size. The first `skip` positions of the context are read but
// weigh nothing (a sliding window's start inside the table's first block, see window_start;
// n = 1 only, since later tokens' windows start later).
template <typename T, typename C, int CHUNKS>
void attend(T* out, int64_t out_stride, const T* q, int64_t q_stride, int64_t n,
            const C* k_cache, const C* v_cache, const int32_t* table, int64_t ctx, int64_t skip,
            int64_t h0, int64_t h1, int64_t group, int64_t head_dim, int64_t block_size,
            int64_t token_stride, float scale, Scratch& scratch, KeyStream& next_keys) {
  const int64_t chunks = CHUNKS ? CHUNKS : head_dim / kLanes;
  const int64_t block_stride = block_size * token_stride;
  const int64_t last = ctx + n - 1;  // the last token's context: the keys read
  const int64_t num_blocks = (last + block_size - 1) / block_size;
  const int64_t per_head = n * group;  // rows of one KV head
  const int64_t rows = (h1 - h0) * per_head;
  const int64_t padded = (last + kLanes - 1) / kLanes * kLanes;  // a score row's length
  const int64_t range = (h1 - h0) * head_dim;  // elements of a key row handled here
  float* scores = at_least(scratch.scores, rows * padded);
  vfloat* qv = at_least(scratch.qv, rows * chunks);
  vfloat* acc = at_least(scratch.acc, rows * chunks);
  std::fill(acc, acc + rows * chunks, vfloat{});
  vfloat* dots = at_least(scratch.dots, rows * kLanes);
  float* inv_sum = at_least(scratch.inv_sum, rows);

  auto token_of = [&](int64_t i) { return i / group % n; };
  auto head_of = [&](int64_t i) {  // the query head's offset in a token row
    return ((h0 + i / per_head) * group + i % group) * head_dim;
  };
  // Block b's rows, from head h0 on; how many of them the first `len` positions reach.
  auto rows_of = [&](const C* cache, int64_t b) {
    return cache + table[b] * block_stride + h0 * head_dim;
  };
  auto rows_in = [&](int64_t b, int64_t len) { return std::min(block_size, len - b * block_size); };

  // qv[i * chunks + c]: row i's query, scaled, as vectors.
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      qv[i * chunks + c] = load(q + token_of(i) * q_stride + head_of(i) + c * kLanes) * scale;

  // scores[i][t] = q_i . k_t (q is scaled already), each key row converted to float once for
  // every row of its KV head.
  score_keys<3>(scores, padded, k_cache, v_cache, table, last, h0, range, rows, head_dim,
                block_size, token_stride, 1.f, n == 1, dots, [=](const C* row, int64_t r) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      vfloat kv[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load(row + h * head_dim + c * kLanes);
      for (int64_t i = h * per_head; i < (h + 1) * per_head; ++i) {
        const vfloat* qi = qv + i * chunks;
        vfloat dot = qi[0] * kv[0];
        for (int64_t c = 1; c < chunks; ++c) dot += qi[c] * kv[c];
        dots[i * kLanes + r] = dot;
      }
    }
  });

  for (int64_t i = 0; i < rows; ++i) {
    std::fill(scores + i * padded, scores + i * padded + skip, -INFINITY);
    inv_sum[i] = softmax_row(scores + i * padded, ctx + token_of(i), padded, scores + i * padded);
  }

  // out_i = sum_t p[i][t] v_t / sum_t p[i][t], each output element summed over the keys in
  // position order. A decode goes block by block (weigh_lines).
  // A run's rows instead go kRunTile at a time, NV vectors of the head dimension each, the
  // accumulators in registers over a stretch of kRunKeys keys: each value vector loaded serves
  // kRunTile rows, and the stretch's values, read from the cache once, stay in L1 for every
  // tile and vector of the run (a row's sums still run over the positions in order). Keys past
  // a tile's longest row are not read; for its shorter rows the later keys weigh 0.
  auto weigh_run = [&](auto tile, auto vectors, int64_t h, int64_t i0, int64_t c0, int64_t k0,
                       int64_t k1) {
    constexpr int G = decltype(tile)::value, NV = decltype(vectors)::value;
    const int64_t len = std::min(k1, ctx + token_of(i0 + G - 1));
    const int64_t first = h * head_dim + c0 * kLanes;
    vfloat a[G][NV];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NV; ++c) a[g][c] = acc[(i0 + g) * chunks + c0 + c];
    const float* p = scores + i0 * padded;
    for (int64_t b = k0 / block_size; b * block_size < len; ++b) {
      const C* block = rows_of(v_cache, b) + first;
      const float* pb = p + b * block_size;
      for (int64_t j = 0, keys = rows_in(b, len); j < keys; ++j) {
        vfloat v[NV];
        for (int c = 0; c < NV; ++c) v[c] = load(block + j * token_stride + c * kLanes);
        for (int g = 0; g < G; ++g) {
          const float w = pb[g * padded + j];
          for (int c = 0; c < NV; ++c) a[g][c] += w * v[c];
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NV; ++c) acc[(i0 + g) * chunks + c0 + c] = a[g][c];
  };
  if (n == 1) {
    next_keys.spread_over(num_blocks);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const C* block = rows_of(v_cache, b);
      const C* next = b + 1 < num_blocks ? rows_of(v_cache, b + 1) : nullptr;
      next_keys.step();
      weigh_block(acc, chunks, scores + b * block_size, padded, block, next, 0, rows_in(b, ctx),
                  h1 - h0, group, head_dim, token_stride);
    }
  } else {
    const int64_t stretch = std::max<int64_t>(1, kRunKeys / block_size) * block_size;
    for (int64_t k0 = 0; k0 < last; k0 += stretch)
      for (int64_t h = 0; h < h1 - h0; ++h)
        for (int64_t i = h * per_head; i < (h + 1) * per_head; i += kRunTile)
          with_constant<kRunTile>(std::min<int64_t>((h + 1) * per_head - i, kRunTile),
                                  [&](auto tile) {
            const int64_t k1 = k0 + stretch;
            int64_t c = 0;
            for (; c + 2 <= chunks; c += 2)
              weigh_run(tile, std::integral_constant<int, 2>{}, h, i, c, k0, k1);
            if (c < chunks) weigh_run(tile, std::integral_constant<int, 1>{}, h, i, c, k0, k1);
          });
  }
  for (int64_t i = 0; i < rows; ++i) {
    T* o = out + token_of(i) * out_stride + head_of(i);
    for (int64_t c = 0; c < chunks; ++c)
      store(acc[i * chunks + c] * inv_sum[i], o + c * kLanes);
  }
}

// A query token alone (a decode, or a token of a short run) over a float cache, whose keys are
// stored transposed (block b, KV head h: [head_dim][block_size]), against KV heads [h0, h1),
// each with its `group` query heads. The arithmetic is the tiles' (attention_tile.h), so a
// token's bits are those of its row in any tile: a score is score_rows_at's chain of FMAs over
// the head dimension on kKeyTile keys read as vectors (key_halves), the softmax folds kKeyChunk
// keys at a time from fixed positions, each output element sums the values in position order.
// What differs is how the cache is read: each key tile is read once for the task's KV heads,
// the next block's keys are prefetched into L1 and this tile's values into L2 (for the value
// pass that follows the chunk's keys), their lines spread over the products, and the next
// task's keys into L2 during the value pass (KeyStream); the values come straight from the
// cache (weigh_lines). The table starts at the window's first block, whose absolute position
// `first` fixes where chunks start; its first `skip` rows weigh nothing. CHUNKS = head_dim /
// kLanes when known at compile time (loops unroll), 0 for any other size.
struct DecodeScratch {  // per thread, reused across tasks and calls
  std::vector<float> q, kt, scores, row_max, row_sum;
  std::vector<vfloat> acc;
  std::vector<const char*> lines;  // a key tile's value lines, to prefetch
};

template <int CHUNKS>
void attend_transposed(float* out, const float* q, const float* k_cache, const float* v_cache,
                       const int32_t* table, int64_t ctx, int64_t first, int64_t skip, int64_t h0,
                       int64_t h1, int64_t group, int64_t head_dim, int64_t block_size,
                       int64_t num_kv_heads, float scale, DecodeScratch& scratch,
                       KeyStream& next_keys) {
  const int64_t chunks = CHUNKS ? CHUNKS : head_dim / kLanes;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t rows = (h1 - h0) * group;  // row i: query head h0 * group + i
  const int64_t width_max = kKeyChunk + kKeyTile;
  float* qs = at_least(scratch.q, rows * head_dim);
  float* scores = at_least(scratch.scores, rows * width_max);
  float* kt = at_least(scratch.kt, head_dim * kKeyTile);
  vfloat* acc = at_least(scratch.acc, rows * chunks);
  float* row_max = at_least(scratch.row_max, rows);
  float* row_sum = at_least(scratch.row_sum, rows);
  std::fill(acc, acc + rows * chunks, vfloat{});
  std::fill(row_max, row_max + rows, -INFINITY);
  std::fill(row_sum, row_sum + rows, 0.f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t d = 0; d < head_dim; d += kLanes)
      store(load(q + (h0 * group + i) * head_dim + d) * scale, qs + i * head_dim + d);
  const int64_t block_keys = head_dim * block_size;  // a KV head's keys in a block

  const int64_t start = first + skip, end = first + ctx;  // the positions that weigh
  next_keys.spread_over((ctx - skip + block_size - 1) / block_size + 1);
  const int64_t row_lines = ((h1 - h0) * head_dim * sizeof(float) + 63) / 64;
  const char** lines = at_least(scratch.lines, kKeyTile * row_lines);
  const int64_t key_lines = (block_keys * sizeof(float) + 63) / 64;  // a block's, a KV head's
  for (int64_t c0 = start / kKeyChunk * kKeyChunk; c0 < end; c0 += kKeyChunk) {
    const int64_t c1 = std::min(end, c0 + kKeyChunk), lo = std::max(c0, start);
    for (int64_t k0 = c0 + (lo - c0) / kKeyTile * kKeyTile; k0 < c1; k0 += kKeyTile) {
      // This tile's values into L2 for the value pass, the next tile's keys into L1: their
      // cache lines spread over the products (a burst would fill the miss buffers).
      int64_t num_lines = 0;
      const int64_t k_lo = std::max(k0, lo) - first, k_hi = std::min(c1, k0 + kKeyTile) - first;
      for (int64_t b = k_lo / block_size, j = k_lo % block_size, n = k_hi - k_lo; n > 0; --n) {
        const char* row = reinterpret_cast<const char*>(
            v_cache + (table[b] * block_size + j) * token_stride + h0 * head_dim);
        for (int64_t e = 0; e < row_lines; ++e) lines[num_lines++] = row + e * 64;
        if (++j == block_size) j = 0, ++b;
      }
      const int64_t per_d = (num_lines + (h1 - h0) * head_dim - 1) / ((h1 - h0) * head_dim);
      const bool next_block =
          k0 + kKeyTile < end && (k0 + kKeyTile - first) % block_size == 0;
      for (int64_t h = 0; h < h1 - h0; ++h) {
        const float* half[2];
        const int64_t key_stride =
            key_halves(k_cache, table, h0 + h, num_kv_heads, head_dim, block_size, k0 - first,
                       lo - first, c1 - first, kt, half);
        const char* next =
            next_block ? reinterpret_cast<const char*>(
                             transposed_key(k_cache, table, k0 + kKeyTile - first, h0 + h,
                                            num_kv_heads, head_dim, block_size))
                       : nullptr;
        int64_t key_line = 0;  // the next of next's lines to prefetch
        for (int64_t r0 = h * group; r0 < (h + 1) * group; r0 += kRowTile)
          with_constant<kRowTile>(std::min<int64_t>((h + 1) * group - r0, kRowTile),
                                  [&](auto mr) {
            score_rows_at<decltype(mr)::value>(
                qs + r0 * head_dim, head_dim, half[0], half[1], key_stride,
                scores + r0 * width_max + (k0 - c0), width_max, [&](int64_t d) {
                  if (r0 != h * group) return;  // the first row tile prefetches
                  if (next)  // lines [d, d + 1) * key_lines / head_dim
                    for (; key_line * head_dim < (d + 1) * key_lines; ++key_line)
                      prefetch<3>(next + key_line * 64);
                  for (int64_t l = (h * head_dim + d) * per_d;
                       l < std::min(num_lines, (h * head_dim + d + 1) * per_d); ++l)
                    prefetch<2>(lines[l]);
                });
          });
      }
    }
    const int64_t own = c1 - c0, width = (own + kLanes - 1) / kLanes * kLanes;
    for (int64_t i = 0; i < rows; ++i) {
      float* s = scores + i * width_max;
      std::fill(s, s + (lo - c0), -INFINITY);
      const float rescale = softmax_fold(s, own, width, row_max[i], row_sum[i], s);
      if (rescale != 1.f)
        for (int64_t c = 0; c < chunks; ++c) acc[i * chunks + c] *= rescale;
    }
    for (int64_t k = lo; k < c1;) {
      const int64_t b = (k - first) / block_size, b0 = first + b * block_size;
      const int64_t b1 = std::min(c1, b0 + block_size);
      const float* block = v_cache + table[b] * block_size * token_stride + h0 * head_dim;
      const float* next =
          b1 < c1 ? v_cache + table[b + 1] * block_size * token_stride + h0 * head_dim : nullptr;
      next_keys.step();
      weigh_block(acc, chunks, scores + (k - c0), width_max, block, next, k - b0, b1 - b0,
                  h1 - h0, group, head_dim, token_stride);
      k = b1;
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv_sum = 1.f / row_sum[i];
    float* o = out + (h0 * group + i) * head_dim;
    for (int64_t c = 0; c < chunks; ++c) store(acc[i * chunks + c] * inv_sum, o + c * kLanes);
  }
}

template <typename T, typename C>
void copy_row(C* dst, const T* src, int64_t n) {  // n: a multiple of kLanes
  for (int64_t e = 0; e < n; e += kLanes) store(load(src + e), dst + e);
}

// What one thread does at a time: tokens [t, t + n) of one sequence against KV head h0 (a tile,
// attention_tile.h), or against KV heads [h0, h1) (attend: a decode, or a run of a prefill
// chunk's tokens in the deterministic mode).
struct Task {
  int64_t t, n, h0, h1;
  bool tile;
};

// A run is a prefill chunk's consecutive tokens: one sequence, each seeing one more position.
// Runs of at least kMinTileRows query rows go in tiles of about kTileRows rows, last tile
// first (the longest contexts: dynamic scheduling then balances the rest); the other tokens
// go one by one, all KV heads per task when there are enough tokens to keep the threads busy.
// Deterministic inference needs one arithmetic for every query row, whether it is a decode or
// sits anywhere in a prefill chunk (docs/determinism.md). Over a float cache kMixed is that
// already (attend_transposed computes as the tiles do). Over a bf16 cache kRuns sends every
// token the decode's way (attend, attend_bf16: a row's scores, softmax and value sums depend
// only on its own query, context and cache, hsum and transposed_hsum being the same tree), a
// run's tokens kRunRows query rows at a time per KV head so that each key read serves them all;
// kTiles sends every run to attend_tile (a decode as a tile of its own), for bf16 over an odd
// block size, where attend_bf16's pairs of value rows would start at odd positions.
enum class Plan { kMixed, kRuns, kTiles };
constexpr int64_t kMinTileRows = 24;
constexpr int64_t kRunRows = 48;
// A run task's score rows (query rows x its last token's context) kept within about 256 KB,
// which stays in L2 between the key pass that writes them and the value pass that reads them.
constexpr int64_t kRunScores = 64 * 1024;

std::vector<Task> plan_tasks(const int32_t* token_seqs, const int32_t* context_lens,
                             int64_t num_tokens, int64_t num_kv_heads, int64_t group,
                             int num_threads, Plan plan, bool windowed) {
  const int64_t span = num_tokens >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t per_tile = std::max<int64_t>(1, kTileRows / group);
  std::vector<Task> tasks;
  for (int64_t t = 0; t < num_tokens;) {
    int64_t end = t + 1;
    while (token_seqs && end < num_tokens && token_seqs[end] == token_seqs[t] &&
           context_lens[end] == context_lens[end - 1] + 1)
      ++end;
    if (plan == Plan::kTiles || (plan == Plan::kMixed && (end - t) * group >= kMinTileRows)) {
      for (int64_t s = t + (end - t - 1) / per_tile * per_tile; s >= t; s -= per_tile)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          tasks.push_back({s, std::min(per_tile, end - s), h, h + 1, true});
    } else if (plan == Plan::kRuns && end - t > 1 && !windowed) {
      const int64_t longest = context_lens[end - 1] + kLanes;
      const int64_t per_run =
          std::max<int64_t>(1, std::min(kRunRows, kRunScores / longest) / group);
      for (int64_t s = t + (end - t - 1) / per_run * per_run; s >= t; s -= per_run)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          tasks.push_back({s, std::min(per_run, end - s), h, h + 1, false});
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
                     bool deterministic, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const bool pairs = std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t> &&
                     (head_dim == 64 || head_dim == 128);  // attend_bf16 serves decode-way tokens
  const Plan plan = !deterministic || std::is_same_v<C, float> ? Plan::kMixed
                    : pairs && block_size % 2 == 1 ? Plan::kTiles
                                                   : Plan::kRuns;
  const std::vector<Task> tasks = plan_tasks(token_seqs, context_lens, num_tokens, num_kv_heads,
                                             group, num_threads, plan, window > 0);
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
#pragma omp for  // and its barrier: every row is in place before anyone reads
      for (int64_t t = 0; t < num_tokens; ++t) {
        if constexpr (std::is_same_v<C, float>) {  // keys transposed: [head][dim][slot]
          const int64_t slot = new_kv.slots[t], b = slot / block_size, j = slot % block_size;
          const T* k = new_kv.k + t * new_kv.k_stride;
          for (int64_t e = 0; e < token_stride; ++e)
            k_cache[(b * token_stride + e) * block_size + j] = k[e];
        } else {
          copy_row(k_cache + new_kv.slots[t] * token_stride, new_kv.k + t * new_kv.k_stride,
                   token_stride);
        }
        copy_row(v_cache + new_kv.slots[t] * token_stride, new_kv.v + t * new_kv.v_stride,
                 token_stride);
      }
    }
    static thread_local Scratch scratch;
    static thread_local DecodeScratch decode_scratch;
    TileScratch<float> tile_scratch;
#ifdef __AVX512BF16__
    static thread_local Bf16Scratch bf16_scratch;
    TileScratch<uint16_t> bf16_tile_scratch;
#endif
    auto run = [&](const Task& task, KeyStream& next_keys) {
      const int64_t t = task.t, h0 = task.h0, h1 = task.h1;
      const int64_t ctx = context_lens[t];
      const int32_t* table = table_of(t);
      const Span span = span_of(t);
      T* o = out + t * num_heads * head_dim;
      const T* qt = q + t * q_stride;
      if (task.tile) {
        auto tile = [&](auto step, auto& step_scratch) {  // step: madd_step.h's F32 or BF16
          attend_tile<decltype(step)>(o, num_heads * head_dim, qt, q_stride, k_cache, v_cache,
                                      table, ctx, task.n, h0, group, head_dim, block_size,
                                      token_stride, scale, window, step_scratch);
        };
#ifdef __AVX512BF16__
        if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t>)
          if (head_dim % kPairDims == 0) {
            tile(BF16{}, bf16_tile_scratch);
            return;
          }
#endif
        tile(F32{}, tile_scratch);
      }
#ifdef __AVX512BF16__
      else if (std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t> &&
               (head_dim == 64 || head_dim == 128)) {
        const auto* qb = reinterpret_cast<const uint16_t*>(qt);
        auto* ob = reinterpret_cast<uint16_t*>(o);
        const auto* kb = reinterpret_cast<const uint16_t*>(k_cache);
        const auto* vb = reinterpret_cast<const uint16_t*>(v_cache);
        auto bf16_way = [&](auto chunks) {
          attend_bf16<decltype(chunks)::value>(
              ob, num_heads * head_dim, qb, q_stride, task.n, kb, vb, span.table, span.ctx,
              span.skip, h0, h1, group, block_size, token_stride, scale, bf16_scratch, next_keys);
        };
        if (head_dim == 64)
          bf16_way(std::integral_constant<int, 2>{});
        else
          bf16_way(std::integral_constant<int, 4>{});
      }
#endif
      else {
        auto float_way = [&](auto chunks) {
          if constexpr (std::is_same_v<C, float>)  // keys transposed
            attend_transposed<decltype(chunks)::value>(
                o, qt, k_cache, v_cache, span.table, span.ctx, span.first, span.skip, h0, h1,
                group, head_dim, block_size, num_kv_heads, scale, decode_scratch, next_keys);
          else
            attend<T, C, decltype(chunks)::value>(o, num_heads * head_dim, qt, q_stride, task.n,
                                                  k_cache, v_cache, span.table, span.ctx,
                                                  span.skip, h0, h1, group, head_dim, block_size,
                                                  token_stride, scale, scratch, next_keys);
        };
        if (head_dim == 64)
          float_way(std::integral_constant<int, 64 / kLanes>{});
        else if (head_dim == 128)
          float_way(std::integral_constant<int, 128 / kLanes>{});
        else if (head_dim == 256)
          float_way(std::integral_constant<int, 256 / kLanes>{});
        else
          float_way(std::integral_constant<int, 0>{});
      }
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
                              block_size, token_stride, std::is_same_v<C, float>);
      }
      run(tasks[i], next_keys);
      i = claim_ahead ? following : next_task++;
    }
  }
}

template void paged_attention<float, float>(float*, const float*, float*, float*, NewKV<float>,
                                            const int32_t*, const int32_t*, const int32_t*,
                                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                            int64_t, float, int, bool, int64_t);
template void paged_attention<float, uint16_t>(float*, const float*, uint16_t*, uint16_t*,
                                               NewKV<float>, const int32_t*, const int32_t*,
                                               const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                               int64_t, int64_t, int64_t, float, int, bool,
                                               int64_t);
template void paged_attention<uint16_t, uint16_t>(uint16_t*, const uint16_t*, uint16_t*,
                                                  uint16_t*, NewKV<uint16_t>, const int32_t*,
                                                  const int32_t*, const int32_t*, int64_t,
                                                  int64_t, int64_t, int64_t, int64_t, int64_t,
                                                  int64_t, float, int, bool, int64_t);

}  // namespace conveyor

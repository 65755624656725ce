// Paged attention read straight from the KV cache (CPU): decodes and prefill chunks alike.
//
// Every query token attends to the first context_lens[t] positions of its sequence, the
// sequence being token_seqs[t] (a row of block_tables; null: token t is sequence t's only
// token, a decode step). A prefill chunk's tokens thus each see their own causal prefix,
// cached prefix included: no padding, no mask, no gathered copy of the keys.
// A decode token (attend below): for each KV head, the g query heads that share it walk the
// sequence's block table together: each key row is read from its block once, converted to
// float once and dotted with all g queries; values are read a cache line at a time for up to
// kGroupTile query heads (bf16 queries over a bf16 cache, where the CPU has AVX512-BF16, take
// attention_bf16.h's version of this on vdpbf16ps). The value pass reads from L2, so meanwhile
// the keys of the thread's next task are prefetched (attention_keys.h's KeyStream). A prefill
// chunk's consecutive tokens instead go in tiles of query rows (attention_tile.h), where each
// key and value row read serves many queries. Nothing is gathered into a contiguous copy
// first, which is what makes this faster than index_select + scaled_dot_product_attention.
//
// Layouts (element strides; T, the queries' type, and C, the cache's, are float or bf16
// stored as uint16_t):
//   q:            [num_tokens, num_heads, head_dim], row stride q_stride between tokens
//   k/v cache:    [num_blocks, block_size, num_kv_heads, head_dim] of C, contiguous
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

struct Scratch {  // per thread, reused across tasks and calls
  std::vector<float> scores, inv_sum;
  std::vector<vfloat> qv, acc, dots;  // dots: kLanes rows' unreduced q.k products per head
};

// One query token, KV heads [h0, h1): each of them with its `group` query heads. The context is
// read block by block (attention_keys.h, then the values; the next block is prefetched).
// CHUNKS = head_dim / kLanes when known at compile time (loops unroll), 0 for any other size.
// The first `skip` positions of the context are read but weigh nothing (a sliding window's
// start inside the table's first block, see window_start).
template <typename T, typename C, int CHUNKS>
void attend(T* out, const T* q, const C* k_cache, const C* v_cache, const int32_t* table,
            int64_t ctx, int64_t skip, int64_t h0, int64_t h1, int64_t group, int64_t head_dim,
            int64_t block_size, int64_t token_stride, float scale, Scratch& scratch,
            KeyStream& next_keys) {
  const int64_t chunks = CHUNKS ? CHUNKS : head_dim / kLanes;
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  const int64_t heads = (h1 - h0) * group;  // query heads handled here
  const int64_t padded = (ctx + kLanes - 1) / kLanes * kLanes;  // a score row's length
  const int64_t range = (h1 - h0) * head_dim;  // elements of a token row handled here
  float* scores = at_least(scratch.scores, heads * padded);
  vfloat* qv = at_least(scratch.qv, heads * chunks);
  vfloat* acc = at_least(scratch.acc, heads * chunks);
  std::fill(acc, acc + heads * chunks, vfloat{});
  vfloat* dots = at_least(scratch.dots, heads * kLanes);
  float* inv_sum = at_least(scratch.inv_sum, heads);

  // Block b's rows, from head h0 on; how many of them are in the context.
  auto rows_of = [&](const C* cache, int64_t b) {
    return cache + table[b] * block_stride + h0 * head_dim;
  };
  auto rows_in = [&](int64_t b) { return std::min(block_size, ctx - b * block_size); };

  // qv[i * chunks + c]: query head i, scaled, as vectors.
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      qv[i * chunks + c] = load(q + (h0 * group + i) * head_dim + c * kLanes) * scale;

  // scores[i][t] = q_i . k_t (i: query head; q is scaled already), each key row converted to
  // float once for its g query heads.
  score_keys<3>(scores, padded, k_cache, v_cache, table, ctx, h0, range, heads, head_dim,
                block_size, token_stride, 1.f, dots, [=](const C* row, int64_t r) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      vfloat kv[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load(row + h * head_dim + c * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = h * group + g;
        const vfloat* qi = qv + i * chunks;
        vfloat dot = qi[0] * kv[0];
        for (int64_t c = 1; c < chunks; ++c) dot += qi[c] * kv[c];
        dots[i * kLanes + r] = dot;
      }
    }
  });

  for (int64_t i = 0; i < heads; ++i) {
    std::fill(scores + i * padded, scores + i * padded + skip, -INFINITY);
    inv_sum[i] = softmax_row(scores + i * padded, ctx, padded, scores + i * padded);
  }

  // out_i = sum_t p[i][t] v_t / sum_t p[i][t]. Block by block; within a block, one cache line
  // of a KV head's values (kLineChunks vectors) for up to kGroupTile of its query heads at a
  // time, so that their accumulators stay in registers over the block's rows. Held for all
  // heads at once (9 x 64 floats) they would spill: a load and a store each, every row.
  auto weigh_values = [&](auto tile, const C* rows, const C* next, int64_t t0, int64_t n,
                          int64_t h, int64_t g0, int64_t c0) {
    constexpr int G = decltype(tile)::value;
    const int64_t i0 = h * group + g0, first = h * head_dim + c0 * kLanes;
    vfloat a[G][kLineChunks];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kLineChunks; ++c) a[g][c] = acc[(i0 + g) * chunks + c0 + c];
    const float* p = scores + i0 * padded + t0;
    for (int64_t j = 0; j < n; ++j) {
      const C* line = rows + j * token_stride + first;
      if (next) __builtin_prefetch(next + j * token_stride + first);
      for (int c = 0; c < kLineChunks; ++c) {
        const vfloat v = load(line + c * kLanes);
        for (int g = 0; g < G; ++g) a[g][c] += p[g * padded + j] * v;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kLineChunks; ++c) acc[(i0 + g) * chunks + c0 + c] = a[g][c];
  };
  next_keys.spread_over(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const C* rows = rows_of(v_cache, b);
    const C* next = b + 1 < num_blocks ? rows_of(v_cache, b + 1) : nullptr;
    const int64_t t0 = b * block_size, n = rows_in(b);
    next_keys.step();
    for (int64_t h = 0; h < h1 - h0; ++h)
      for (int64_t g = 0; g < group; g += kGroupTile)
        for (int64_t c = 0; c < chunks; c += kLineChunks)
          with_constant<kGroupTile>(std::min<int64_t>(group - g, kGroupTile), [&](auto tile) {
            weigh_values(tile, rows, next, t0, n, h, g, c);
          });
  }
  for (int64_t i = 0; i < heads; ++i) {
    T* o = out + (h0 * group + i) * head_dim;
    for (int64_t c = 0; c < chunks; ++c)
      store(acc[i * chunks + c] * inv_sum[i], o + c * kLanes);
  }
}

template <typename T, typename C>
void copy_row(C* dst, const T* src, int64_t n) {  // n: a multiple of kLanes
  for (int64_t e = 0; e < n; e += kLanes) store(load(src + e), dst + e);
}

// What one thread does at a time: tokens [t, t + n) of one sequence against KV head h0 (a tile,
// attention_tile.h), or token t alone against KV heads [h0, h1) (attend).
struct Task {
  int64_t t, n, h0, h1;
  bool tile;
};

// A run is a prefill chunk's consecutive tokens: one sequence, each seeing one more position.
// Runs of at least kMinTileRows query rows go in tiles of about kTileRows rows, last tile
// first (the longest contexts: dynamic scheduling then balances the rest); the other tokens
// go one by one, all KV heads per task when there are enough tokens to keep the threads busy.
// Deterministic inference needs one arithmetic for every query row, whether it is a decode or
// sits anywhere in a prefill chunk (docs/determinism.md): kOneByOne sends every token the
// decode's way (attend, attend_bf16: a row's scores, softmax and value sums depend only on its
// own query, context and cache, hsum and transposed_hsum being the same tree); kTiles sends every
// run to attend_tile (a decode as a tile of its own), for bf16 over an odd block size, where
// attend_bf16's pairs of value rows would start at odd positions.
enum class Plan { kMixed, kOneByOne, kTiles };
constexpr int64_t kMinTileRows = 24;

std::vector<Task> plan_tasks(const int32_t* token_seqs, const int32_t* context_lens,
                             int64_t num_tokens, int64_t num_kv_heads, int64_t group,
                             int num_threads, Plan plan) {
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
                     (head_dim == 64 || head_dim == 128);  // attend_bf16 serves single tokens
  const Plan plan = !deterministic                ? Plan::kMixed
                    : pairs && block_size % 2 == 1 ? Plan::kTiles
                                                   : Plan::kOneByOne;
  const std::vector<Task> tasks = plan_tasks(token_seqs, context_lens, num_tokens, num_kv_heads,
                                             group, num_threads, plan);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  auto table_of = [&](int64_t t) {  // token t's sequence's block table
    return block_tables + (token_seqs ? token_seqs[t] : t) * max_blocks;
  };
  // What a decode-way token reads: its table from the window's first block, the context from
  // that block's first row, the rows of it before the window.
  struct Span {
    const int32_t* table;
    int64_t ctx, skip;
  };
  auto span_of = [&](int64_t t) {
    const int64_t ctx = context_lens[t];
    const WindowStart w = window_start(ctx, window, block_size);
    return Span{table_of(t) + w.first_block, ctx - w.first_block * block_size, w.skip};
  };
  std::atomic<int64_t> next_task{0};
#pragma omp parallel num_threads(num_threads)
  {
    if (new_kv.k) {
#pragma omp for  // and its barrier: every row is in place before anyone reads
      for (int64_t t = 0; t < num_tokens; ++t) {
        copy_row(k_cache + new_kv.slots[t] * token_stride, new_kv.k + t * new_kv.k_stride,
                 token_stride);
        copy_row(v_cache + new_kv.slots[t] * token_stride, new_kv.v + t * new_kv.v_stride,
                 token_stride);
      }
    }
    static thread_local Scratch scratch;
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
        if (head_dim == 64)
          attend_bf16<2>(ob, qb, kb, vb, span.table, span.ctx, span.skip, h0, h1, group,
                         block_size, token_stride, scale, bf16_scratch, next_keys);
        else
          attend_bf16<4>(ob, qb, kb, vb, span.table, span.ctx, span.skip, h0, h1, group,
                         block_size, token_stride, scale, bf16_scratch, next_keys);
      }
#endif
      else if (head_dim == 64)
        attend<T, C, 64 / kLanes>(o, qt, k_cache, v_cache, span.table, span.ctx, span.skip, h0,
                                  h1, group, head_dim, block_size, token_stride, scale, scratch,
                                  next_keys);
      else if (head_dim == 128)
        attend<T, C, 128 / kLanes>(o, qt, k_cache, v_cache, span.table, span.ctx, span.skip, h0,
                                   h1, group, head_dim, block_size, token_stride, scale, scratch,
                                   next_keys);
      else if (head_dim == 256)
        attend<T, C, 256 / kLanes>(o, qt, k_cache, v_cache, span.table, span.ctx, span.skip, h0,
                                   h1, group, head_dim, block_size, token_stride, scale, scratch,
                                   next_keys);
      else
        attend<T, C, 0>(o, qt, k_cache, v_cache, span.table, span.ctx, span.skip, h0, h1, group,
                        head_dim, block_size, token_stride, scale, scratch, next_keys);
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
        next_keys = KeyStream(k_cache, next.table, next.ctx, f.h0, f.h1, head_dim, block_size,
                              token_stride);
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

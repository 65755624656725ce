// Prefill attention in tiles (CPU): a run of a sequence's consecutive query tokens against
// one KV head, as two small matrix products around the softmax. Included by
// paged_attention.cpp, which decides what goes this way.
//
// A task holds R = n x g query rows (n tokens of one prefill chunk, token i seeing ctx0 + i
// positions) and works like a GEMM, kKeyChunk keys at a time:
//   scores  S[R, chunk] = Q K^T: kKeyTile keys at a time as vectors of positions (the K cache
//           stores them so, key_halves), kRowTile rows x kKeyTile keys of accumulators in
//           registers over the head dimension;
//   softmax per row over the chunk's keys of its own context (later keys get weight 0), folded
//           into the row's running max and sum (an online softmax): the output so far is
//           rescaled when the max grows;
//   values  O[R, head_dim] += P V: kValueKeys value rows are laid out for the products once,
//           then kRowTile rows x two vectors of the head dimension stay in registers over them.
// The scores of a chunk (R x kKeyChunk floats) stay in L2 however long the context. Chunks
// start at fixed key positions, so every query row's result depends only on its own query,
// context and cache, not on which other rows share its tile; paged_attention.cpp's decode
// (attend_decode) computes a lone token in this same arithmetic.
//
// The products (F, madd_step.h) are float FMAs (F32: queries scaled and every element converted
// to float once), or, for bf16 queries over a bf16 cache, vdpbf16ps on pairs of elements (BF16:
// half the instructions): queries and keys as they are, the scale applied to the scores, and
// the softmax weights rounded to bf16 (as flash attention rounds P) and normalised by the sum of
// their rounded values. Value rows are interleaved in pairs (bf16_pairs.h), so BF16's output
// accumulates in a permuted order, undone when stored.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_pairs.h"
#include "dispatch.h"
#include "madd_step.h"
#include "vec.h"

namespace conveyor {

constexpr int kRowTile = 6;           // query rows per micro-kernel: 6 x 2 accumulators
constexpr int kKeyTile = 2 * kLanes;  // keys per transposed tile (two vectors of scores)
constexpr int kValueKeys = 64;        // keys per pass of the values micro-kernel
constexpr int64_t kTileRows = 96;     // query rows a task aims for (tokens x group)
// Keys whose scores are held at once: a multiple of kKeyTile and of kValueKeys.
constexpr int64_t kKeyChunk = 512;

template <typename E>  // F::T: float, or bf16 as uint16_t
struct TileScratch {  // per thread, reused across tasks
  std::vector<E> q, vt, p;  // p: the softmax weights as E (BF16 only)
  std::vector<uint32_t> kt;  // key_halves' gathered lanes
  std::vector<float> scores, o, row_max, row_sum;
};

// A K cache stores each block's keys transposed, as 32-bit lanes: block b, KV head h holds
// [head_dim / P][block_size] lanes of P elements (P = 1 float, or a pair of bf16 dimensions
// 2l, 2l + 1), so that kLanes consecutive positions of one lane are one vector.
template <typename C>
constexpr int64_t kPerLane = 4 / sizeof(C);

// Position pos's key (pos counted from the table's first row) of KV head h: lane l lies at the
// returned pointer + l * block_size * P.
template <typename C>
inline const C* transposed_key(const C* k_cache, const int32_t* table, int64_t pos, int64_t h,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
  return k_cache + (table[pos / block_size] * num_kv_heads + h) * head_dim * block_size +
         pos % block_size * kPerLane<C>;
}

// A query row as score_rows takes it: F32 scales it (the scores then need no scale), BF16
// keeps it as it is (scores_scale: the scale the scores then take).
template <class F, typename T>
inline void query_row(typename F::T* dst, const T* src, int64_t head_dim, float scale) {
  if constexpr (F::kStep == 2)
    std::memcpy(dst, src, head_dim * sizeof(*dst));
  else
    for (int64_t d = 0; d < head_dim; d += kLanes) store(load(src + d) * scale, dst + d);
}

template <class F>
constexpr float scores_scale(float scale) {
  return F::kStep == 2 ? scale : 1.f;
}

// The keys of positions [k0, k0 + kKeyTile) of KV head h, as score_rows reads them: half s
// (kLanes keys) at halves[s], lane l at + l * stride elements (the returned stride). Where the
// block size is a multiple of kLanes each half lies in one block and is read in place; else
// the keys' lanes are gathered into kt ([head_dim / P][kKeyTile] lanes). Only positions in
// [lo, hi) are read (k0 and the positions relative to the table's first row): a half outside
// it reads its partner, a gathered key outside it is 0; either way its scores are not used.
template <typename C>
inline int64_t key_halves(const C* k_cache, const int32_t* table, int64_t h,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t k0,
                          int64_t lo, int64_t hi, uint32_t* kt, const C* halves[2]) {
  constexpr int64_t P = kPerLane<C>;
  auto keys_of = [&](int64_t pos) {
    return transposed_key(k_cache, table, pos, h, num_kv_heads, head_dim, block_size);
  };
  if (block_size % kLanes == 0) {
    for (int s = 0; s < 2; ++s) {
      const int64_t at = k0 + s * kLanes;
      halves[s] = at + kLanes > lo && at < hi ? keys_of(at) : nullptr;
    }
    if (!halves[0]) halves[0] = halves[1];
    if (!halves[1]) halves[1] = halves[0];
    return block_size * P;
  }
  for (int64_t j = 0; j < kKeyTile; ++j) {
    const int64_t pos = k0 + j;
    const C* keys = pos >= lo && pos < hi ? keys_of(pos) : nullptr;
    for (int64_t l = 0; l < head_dim / P; ++l) {
      uint32_t lane = 0;
      if (keys) std::memcpy(&lane, keys + l * block_size * P, sizeof lane);
      kt[l * kKeyTile + j] = lane;
    }
  }
  halves[0] = reinterpret_cast<const C*>(kt);
  halves[1] = reinterpret_cast<const C*>(kt + kLanes);
  return kKeyTile * P;
}

// s[r][v * kLanes + j] = scale * q[r] . (key j of halves[v]) for MR rows (q: [MR][head_dim] of
// F::T) and NK halves as key_halves gives them (lane l at + l * stride): a chain of F's
// products over the head dimension, lane by lane from zero, whatever MR and NK (F32 over a bf16
// cache takes a lane's two dimensions one after the other). each(l) runs before lane l's
// products (a decode's prefetches).
template <class F, int MR, int NK, typename C, typename Each = void (*)(int64_t)>
inline void score_rows(const typename F::T* q, int64_t head_dim, const C* const* halves,
                       int64_t stride, float* s, int64_t s_stride, float scale,
                       Each&& each = [](int64_t) {}) {
  constexpr int64_t P = kPerLane<C>;
  vfloat acc[MR][NK] = {};
  for (int64_t l = 0; l < head_dim / P; ++l) {
    each(l);
    if constexpr (F::kStep == P) {  // a lane is one step: a float, or BF16's pair
      decltype(F::vector(halves[0])) k[NK];
      for (int v = 0; v < NK; ++v) k[v] = F::vector(halves[v] + l * stride);
      for (int r = 0; r < MR; ++r) {
        const auto x = F::broadcast(q + r * head_dim + l * P);
        for (int v = 0; v < NK; ++v) F::madd(acc[r][v], x, k[v]);
      }
    } else {  // F32 over bf16 pairs: a pair's bits are the top halves of two floats
      vuint u[NK];
      for (int v = 0; v < NK; ++v) std::memcpy(&u[v], halves[v] + l * stride, sizeof u[v]);
      for (int r = 0; r < MR; ++r) {
        const auto x = F::broadcast(q + r * head_dim + 2 * l);
        for (int v = 0; v < NK; ++v) F::madd(acc[r][v], x, reinterpret_cast<vfloat>(u[v] << 16));
      }
      for (int r = 0; r < MR; ++r) {
        const auto x = F::broadcast(q + r * head_dim + 2 * l + 1);
        for (int v = 0; v < NK; ++v)
          F::madd(acc[r][v], x, reinterpret_cast<vfloat>(u[v] & 0xFFFF0000u));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NK; ++v) store(acc[r][v] * scale, s + r * s_stride + v * kLanes);
}

// o[r][d0 .. d0 + NV * kLanes) += sum_k p[r][k] * v[k][d0 ..] for MR rows, keys [0, n); vt
// holds the values as weigh_rows reads them (value_tile), a step of keys per head_dim lanes.
template <class F, int MR, int NV>
inline void weigh_rows(const typename F::T* p, int64_t p_stride, const typename F::T* vt,
                       int64_t n, float* o, int64_t head_dim, int64_t d0) {
  vfloat acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load(o + r * head_dim + d0 + c * kLanes);
  for (int64_t k = 0; k < n; k += F::kStep) {
    decltype(F::vector(vt)) v[NV];
    for (int c = 0; c < NV; ++c)
      v[c] = F::vector(vt + k * head_dim + (d0 + c * kLanes) * F::kStep);
    for (int r = 0; r < MR; ++r) {
      const auto w = F::broadcast(p + r * p_stride + k);
      for (int c = 0; c < NV; ++c) F::madd(acc[r][c], w, v[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) store(acc[r][c], o + r * head_dim + d0 + c * kLanes);
}

// vt = value rows [0, n) as weigh_rows reads them: F32, [n][head_dim] floats; BF16, per pair of
// rows [head_dim / 32][lo, hi] (bf16_pairs.h), a missing partner after an odd n as zeros.
template <class F, typename C>
inline void value_tile(typename F::T* vt, const C* const* rows, int64_t n, int64_t head_dim) {
  if constexpr (F::kStep == 1) {
    for (int64_t k = 0; k < n; ++k)
      for (int64_t d = 0; d < head_dim; d += kLanes)
        store(load(rows[k] + d), vt + k * head_dim + d);
  } else {
#ifdef __AVX512BF16__
    for (int64_t k = 0; k < n; k += 2)
      for (int64_t d = 0; d < head_dim; d += kPairDims) {
        const RowPairs v = interleave(rows[k] + d, k + 1 < n ? rows[k + 1] + d : nullptr);
        std::memcpy(vt + k * head_dim + 2 * d, &v.lo, sizeof v.lo);
        std::memcpy(vt + k * head_dim + 2 * d + 2 * kLanes, &v.hi, sizeof v.hi);
      }
#endif
  }
}

// A row of the output: o's sums times inv_sum, in order.
template <class F, typename T>
inline void store_output(const float* o, float inv_sum, T* out, int64_t head_dim) {
  if constexpr (F::kStep == 1) {
    for (int64_t d = 0; d < head_dim; d += kLanes) store(load(o + d) * inv_sum, out + d);
  } else {
#ifdef __AVX512BF16__
    for (int64_t d = 0; d < head_dim; d += kPairDims)
      store_in_order(load(o + d) * inv_sum, load(o + d + kLanes) * inv_sum, out + d);
#endif
  }
}

// Tokens [0, n) of one sequence (token i: query row q + i * q_stride, output row
// out + i * out_stride, context ctx0 + i positions) against KV head h and its `group` query
// heads. Row r of the tile is token r / group, query head h * group + r % group.
// F = BF16 takes T = C = uint16_t (bf16) and head_dim a multiple of 32.
// window > 0: a row sees only the last `window` positions of its context; keys of blocks that
// lie wholly before the first row's window are never read (their scores and values are zeros
// where a tile of keys straddles that point, and weigh nothing).
template <class F, typename T, typename C>
void attend_tile(T* out, int64_t out_stride, const T* q, int64_t q_stride, const C* k_cache,
                 const C* v_cache, const int32_t* table, int64_t ctx0, int64_t n, int64_t h,
                 int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                 float scale, int64_t window, TileScratch<typename F::T>& scratch) {
  using E = typename F::T;
  constexpr bool kBf16 = F::kStep == 2;
  const int64_t rows = n * group, ctx = ctx0 + n - 1;  // ctx: the last token's context
  // A row's scores: one chunk's, at most (a short context's fewer, rounded up to a key tile).
  const int64_t stride = std::min(kKeyChunk, (ctx + kKeyTile - 1) / kKeyTile * kKeyTile);
  E* qs = at_least(scratch.q, rows * head_dim);
  uint32_t* kt = at_least(scratch.kt, head_dim * kKeyTile);  // lanes, at most head_dim
  E* vt = at_least(scratch.vt, (kValueKeys + 1) * head_dim);
  float* scores = at_least(scratch.scores, rows * stride);
  // The weights the values take: the scores themselves in float, written over them; for BF16
  // their bf16 rounding, in an array of their own.
  E* p = kBf16 ? at_least(scratch.p, rows * stride) : reinterpret_cast<E*>(scores);
  scratch.o.assign(rows * head_dim, 0.f);
  scratch.row_max.assign(rows, -INFINITY);
  scratch.row_sum.assign(rows, 0.f);
  float* o = scratch.o.data();

  auto row_ctx = [&](int64_t r) { return ctx0 + r / group; };
  // A row's first visible position; the first position read (the start of row 0's window's
  // block): rows later in the tile start their windows later.
  auto row_lo = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, row_ctx(r) - window) : int64_t{0};
  };
  const int64_t first_read = row_lo(0) / block_size * block_size;
  alignas(64) static const C zero_row[256] = {};  // stands in for a row before first_read
  auto cache_row = [&](const C* cache, int64_t pos) {
    return cache + (table[pos / block_size] * block_size + pos % block_size) * token_stride +
           h * head_dim;
  };

  for (int64_t r = 0; r < rows; ++r)
    query_row<F>(qs + r * head_dim, q + r / group * q_stride + (h * group + r % group) * head_dim,
                 head_dim, scale);
  const float score_scale = scores_scale<F>(scale);

  const C* value_rows[kValueKeys];
  for (int64_t c0 = first_read / kKeyChunk * kKeyChunk; c0 < ctx; c0 += kKeyChunk) {
    const int64_t c1 = std::min(ctx, c0 + kKeyChunk);
    const int64_t width = (c1 - c0 + kKeyTile - 1) / kKeyTile * kKeyTile;  // scores per row

    // Scores, kKeyTile keys at a time; a row tile whose rows all end before the keys skips them.
    for (int64_t k0 = c0; k0 < c1; k0 += kKeyTile) {
      if (k0 + kKeyTile <= first_read) continue;  // every row's window starts later
      const C* half[2];
      const int64_t key_stride = key_halves(k_cache, table, h, token_stride / head_dim, head_dim,
                                            block_size, k0, first_read, c1, kt, half);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t m = std::min<int64_t>(kRowTile, rows - r0);
        if (k0 >= row_ctx(r0 + m - 1) || k0 + kKeyTile <= row_lo(r0)) continue;
        with_constant<kRowTile>(m, [&](auto mr) {
          score_rows<F, decltype(mr)::value, 2>(qs + r0 * head_dim, head_dim, half, key_stride,
                                                scores + r0 * stride + k0 - c0, stride,
                                                score_scale);
        });
      }
    }

    // Softmax over each row's own keys in the chunk (those of its window); the rest of the row
    // gets 0. A row whose context ends before the chunk, or whose window starts after it, takes
    // no part in it.
    for (int64_t r = 0; r < rows; ++r) {
      E* pr = p + r * stride;
      const int64_t own = std::min(c1, row_ctx(r)) - c0;
      const int64_t before = std::max(c0, row_lo(r)) - c0;  // keys before the row's window
      if (own <= before) {
        std::fill(pr, pr + width, E{});  // 0 as float and as bf16
      } else {
        std::fill(scores + r * stride, scores + r * stride + before, -INFINITY);
        const float rescale = softmax_fold(scores + r * stride, own, width, scratch.row_max[r],
                                           scratch.row_sum[r], pr);
        if (rescale != 1.f)
          for (int64_t d = 0; d < head_dim; d += kLanes)
            store(load(o + r * head_dim + d) * rescale, o + r * head_dim + d);
      }
    }

    // Values, kValueKeys keys at a time, two vectors of the head dimension per pass.
    for (int64_t k0 = c0; k0 < c1; k0 += kValueKeys) {
      if (k0 + kValueKeys <= first_read) continue;
      const int64_t nk = std::min<int64_t>(kValueKeys, c1 - k0);
      for (int64_t k = 0; k < nk; ++k)
        value_rows[k] = k0 + k < first_read ? zero_row : cache_row(v_cache, k0 + k);
      value_tile<F>(vt, value_rows, nk, head_dim);
      for (int64_t d0 = 0; d0 < head_dim; d0 += 2 * kLanes) {
        const bool pair = d0 + 2 * kLanes <= head_dim;
        for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
          const int64_t m = std::min<int64_t>(kRowTile, rows - r0);
          const int64_t keys = std::min(nk, row_ctx(r0 + m - 1) - k0);  // later ones weigh 0
          if (keys <= 0 || k0 + nk <= row_lo(r0)) continue;
          with_constant<kRowTile>(m, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            const E* pr = p + r0 * stride + k0 - c0;
            if (pair)
              weigh_rows<F, MR, 2>(pr, stride, vt, keys, o + r0 * head_dim, head_dim, d0);
            else
              weigh_rows<F, MR, 1>(pr, stride, vt, keys, o + r0 * head_dim, head_dim, d0);
          });
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r)
    store_output<F>(o + r * head_dim, 1.f / scratch.row_sum[r],
                    out + r / group * out_stride + (h * group + r % group) * head_dim, head_dim);
}

}  // namespace conveyor

// Prefill attention in tiles (CPU): a run of a sequence's consecutive query tokens against
// one KV head, as two small matrix products around the softmax. Included by
// paged_attention.cpp, which decides what goes this way.
//
// Token by token (paged_attention.cpp's attend), each key element read serves only the g query
// heads of its group, and the queries themselves do not fit in registers: that path is bound
// by loads. Here a task holds R = n x g query rows (n tokens of one prefill chunk, token i
// seeing ctx0 + i positions) and works like a GEMM, kKeyChunk keys at a time:
//   scores  S[R, chunk] = Q K^T: keys are transposed kKeyTile at a time, then kRowTile rows x
//           kKeyTile keys of accumulators stay in registers over the head dimension;
//   softmax per row over the chunk's keys of its own context (later keys get weight 0), folded
//           into the row's running max and sum (an online softmax): the output so far is
//           rescaled when the max grows;
//   values  O[R, head_dim] += P V: kRowTile rows x two vectors of a value row in registers,
//           over kValueKeys keys at a time.
// The scores of a chunk (R x kKeyChunk floats) stay in L2 however long the context. Chunks
// start at fixed key positions, so every query row's result depends only on its own query,
// context and cache, not on which other rows share its tile.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dispatch.h"
#include "vec.h"

namespace conveyor {

constexpr int kRowTile = 6;           // query rows per micro-kernel: 6 x 2 accumulators
constexpr int kKeyTile = 2 * kLanes;  // keys per transposed tile (two vectors of scores)
constexpr int kValueKeys = 64;        // keys per pass of the values micro-kernel
constexpr int64_t kTileRows = 96;     // query rows a task aims for (tokens x group)
// Keys whose scores are held at once: a multiple of kKeyTile and of kValueKeys.
constexpr int64_t kKeyChunk = 512;

struct TileScratch {  // per thread, reused across tasks
  std::vector<float> q, kt, scores, o, row_max, row_sum;
};

// s[r][0..kKeyTile) = q[r] . kt[.][j] for MR rows; kt is [head_dim][kKeyTile].
template <int MR>
inline void score_rows(const float* q, int64_t head_dim, const float* kt, float* s,
                       int64_t s_stride) {
  vfloat acc[MR][2] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const vfloat k0 = load(kt + d * kKeyTile), k1 = load(kt + d * kKeyTile + kLanes);
    for (int r = 0; r < MR; ++r) {
      const float x = q[r * head_dim + d];
      acc[r][0] += x * k0;
      acc[r][1] += x * k1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(acc[r][0], s + r * s_stride);
    store(acc[r][1], s + r * s_stride + kLanes);
  }
}

// o[r][d0 .. d0 + NV * kLanes) += sum_k p[r][k] * rows[k][d0 ..] for MR rows, keys [0, n).
template <int MR, int NV, typename C>
inline void weigh_rows(const float* p, int64_t p_stride, const C* const* rows, int64_t n,
                       float* o, int64_t head_dim, int64_t d0) {
  vfloat acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load(o + r * head_dim + d0 + c * kLanes);
  for (int64_t k = 0; k < n; ++k) {
    vfloat v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load(rows[k] + d0 + c * kLanes);
    for (int r = 0; r < MR; ++r) {
      const float w = p[r * p_stride + k];
      for (int c = 0; c < NV; ++c) acc[r][c] += w * v[c];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) store(acc[r][c], o + r * head_dim + d0 + c * kLanes);
}

// Tokens [0, n) of one sequence (token i: query row q + i * q_stride, output row
// out + i * out_stride, context ctx0 + i positions) against KV head h and its `group` query
// heads. Row r of the tile is token r / group, query head h * group + r % group.
template <typename T, typename C>
void attend_tile(T* out, int64_t out_stride, const T* q, int64_t q_stride, const C* k_cache,
                 const C* v_cache, const int32_t* table, int64_t ctx0, int64_t n, int64_t h,
                 int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                 float scale, TileScratch& scratch) {
  const int64_t rows = n * group, ctx = ctx0 + n - 1;  // ctx: the last token's context
  const int64_t chunks = head_dim / kLanes;
  // A row's scores: one chunk's, at most (a short context's fewer, rounded up to a key tile).
  const int64_t stride = std::min(kKeyChunk, (ctx + kKeyTile - 1) / kKeyTile * kKeyTile);
  scratch.q.resize(rows * head_dim);
  scratch.kt.resize(head_dim * kKeyTile);
  scratch.scores.resize(rows * stride);
  scratch.o.assign(rows * head_dim, 0.f);
  scratch.row_max.assign(rows, -INFINITY);
  scratch.row_sum.assign(rows, 0.f);
  float* qs = scratch.q.data();
  float* kt = scratch.kt.data();
  float* scores = scratch.scores.data();
  float* o = scratch.o.data();

  auto row_ctx = [&](int64_t r) { return ctx0 + r / group; };
  auto cache_row = [&](const C* cache, int64_t pos) {
    return cache + (table[pos / block_size] * block_size + pos % block_size) * token_stride +
           h * head_dim;
  };

  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + r / group * q_stride + (h * group + r % group) * head_dim;
    for (int64_t c = 0; c < chunks; ++c)
      store(load(src + c * kLanes) * scale, qs + r * head_dim + c * kLanes);
  }

  const C* key_rows[kKeyTile];
  const C* value_rows[kValueKeys];
  for (int64_t c0 = 0; c0 < ctx; c0 += kKeyChunk) {
    const int64_t c1 = std::min(ctx, c0 + kKeyChunk);
    const int64_t width = (c1 - c0 + kKeyTile - 1) / kKeyTile * kKeyTile;  // scores per row

    // Scores, kKeyTile keys at a time; a row tile whose rows all end before the keys skips them.
    for (int64_t k0 = c0; k0 < c1; k0 += kKeyTile) {
      const int64_t nk = std::min<int64_t>(kKeyTile, c1 - k0);
      for (int64_t k = 0; k < nk; ++k) key_rows[k] = cache_row(k_cache, k0 + k);
      for (int64_t half = 0; half < kKeyTile; half += kLanes)
        for (int64_t c = 0; c < chunks; ++c) {
          vfloat block[kLanes];
          for (int64_t j = 0; j < kLanes; ++j)
            block[j] = half + j < nk ? load(key_rows[half + j] + c * kLanes) : vfloat{};
          transpose(block);
          for (int64_t d = 0; d < kLanes; ++d)
            store(block[d], kt + (c * kLanes + d) * kKeyTile + half);
        }
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t m = std::min<int64_t>(kRowTile, rows - r0);
        if (k0 >= row_ctx(r0 + m - 1)) continue;
        with_constant<kRowTile>(m, [&](auto mr) {
          score_rows<decltype(mr)::value>(qs + r0 * head_dim, head_dim, kt,
                                          scores + r0 * stride + k0 - c0, stride);
        });
      }
    }

    // Softmax over each row's own keys in the chunk; the rest of the row gets 0. A row whose
    // context ends before the chunk takes no part in it.
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * stride;
      const int64_t own = std::min(c1, row_ctx(r)) - c0;
      if (own <= 0) {
        std::fill(s, s + width, 0.f);
        continue;
      }
      const float rescale = softmax_fold(s, own, width, scratch.row_max[r], scratch.row_sum[r]);
      if (rescale != 1.f)
        for (int64_t c = 0; c < chunks; ++c)
          store(load(o + r * head_dim + c * kLanes) * rescale, o + r * head_dim + c * kLanes);
    }

    // Values, kValueKeys keys at a time, two vectors of the head dimension per pass.
    for (int64_t k0 = c0; k0 < c1; k0 += kValueKeys) {
      const int64_t nk = std::min<int64_t>(kValueKeys, c1 - k0);
      for (int64_t k = 0; k < nk; ++k) value_rows[k] = cache_row(v_cache, k0 + k);
      for (int64_t d0 = 0; d0 < head_dim; d0 += 2 * kLanes) {
        const bool pair = d0 + 2 * kLanes <= head_dim;
        for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
          const int64_t m = std::min<int64_t>(kRowTile, rows - r0);
          const int64_t keys = std::min(nk, row_ctx(r0 + m - 1) - k0);  // later ones weigh 0
          if (keys <= 0) continue;
          with_constant<kRowTile>(m, [&](auto mr) {
            constexpr int MR = decltype(mr)::value;
            const float* p = scores + r0 * stride + k0 - c0;
            if (pair)
              weigh_rows<MR, 2>(p, stride, value_rows, keys, o + r0 * head_dim, head_dim, d0);
            else
              weigh_rows<MR, 1>(p, stride, value_rows, keys, o + r0 * head_dim, head_dim, d0);
          });
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + r / group * out_stride + (h * group + r % group) * head_dim;
    const float inv_sum = 1.f / scratch.row_sum[r];
    for (int64_t c = 0; c < chunks; ++c)
      store(load(o + r * head_dim + c * kLanes) * inv_sum, dst + c * kLanes);
  }
}

}  // namespace conveyor

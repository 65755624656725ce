// y = x @ W^T on the CPU's integer dot products, W kept as a GGUF file's own bytes (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, row by row as the file stores them), x rounded to 8 bits
// per row and block of 32 as llama.cpp rounds its activations (Q8_0):
//
//   d = max|x| / 127, q = rint(x / d) (in -127..127, ties to even), S = d * sum(q)
//
// Every one of these types holds, per sub-block of 16 or 32 weights, unsigned codes u and float32
// s, m from its scale bytes (quant_panels.cpp's quant_scales, gguf's values): w = u s + m (Q4_1,
// Q5_1, Q4_K, Q5_K) or w = (u - offset) s (Q4_0, Q5_0, Q6_K; Q8_0: signed codes, offset 0).
// Per output, row and activation block of 32, with integer sums I = sum u q over each sub-block
// and Q = sum q:
//
//   D = I - offset Q                      (exact: an int32, below 2^24, so exact as a float too)
//   v = D * s                             (Q6_K, two sub-blocks: v = fma(D1, s1, D0 * s0))
//   acc = fma(v, d, acc)                  (the block's scales, once per block)
//   acc = fma(m, S, acc)                  (the types with a minimum)
//
// from acc = 0, block by block along K. The integer sums are exact whatever computes them, and
// every float operation is one IEEE operation written out (a multiply whose product no add
// consumes, or an explicit fma), so no compiler contraction changes it: each output is the
// same bits on every build target (vpdpbusd with AVX512-VNNI or AVX-VNNI; vpmaddubsw +
// vpmaddwd on AVX2, Q8_0's signed codes through vpsignb as llama.cpp does; plain C++ on the
// baseline), whatever the number of rows, the rows beside it, or the threads (they split the
// outputs). docs/determinism.md.
//
// The micro-kernels. AVX512-VNNI (with BW): panels of 16 outputs, one per int32 lane, decoded
// once per call for all of K (nibbles split by masks and shifts, the high bits from their
// planes, 16 outputs' bytes transposed to lanes), then 4 rows at a time, per block of 32, eight
// vpdpbusd against the row's 4-byte groups broadcast and the float steps on 16 outputs at once:
// no horizontal sums. Elsewhere: per tile of kOut = 8 outputs and up to kRows rows, each block
// of 32 is decoded once from the file's bytes to 8 x 32 code bytes, then each row's 8 dot
// products are summed to 8 lanes (a tree of vphaddd: integer, exact) and the float work above
// runs across the 8 outputs. Rows are rounded to 8 bits once per call (int8_rows).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "int8_blocks.h"
#include "quant_panels.h"
#include "vec.h"

namespace {

using namespace conveyor;

constexpr int kOut = 8;  // outputs per tile: one vector of int32 or float lanes on AVX2
constexpr int kRows = 4;  // rows sharing a tile's decoded codes
constexpr int64_t kRowChunk = 64;  // rows a pass over the weight serves (their codes stay cached)

struct Geometry {
  int64_t block, block_bytes, header_at, offset;
  int subs;  // sub-blocks (own s, m) per block of 32 activations: 1, or 2 (Q6_K)
  bool minimum, signed_codes;
};

bool geometry(int64_t format, Geometry& g) {
  switch (format) {
    case kQ4_0: g = {32, 18, 0, 8, 1, false, false}; return true;
    case kQ4_1: g = {32, 20, 0, 0, 1, true, false}; return true;
    case kQ5_0: g = {32, 22, 0, 16, 1, false, false}; return true;
    case kQ5_1: g = {32, 24, 0, 0, 1, true, false}; return true;
    case kQ8_0: g = {32, 34, 0, 0, 1, false, true}; return true;
    case kQ4_K: g = {256, 144, 0, 0, 1, true, false}; return true;
    case kQ5_K: g = {256, 176, 0, 0, 1, true, false}; return true;
    case kQ6_K: g = {256, 210, 192, 32, 2, false, false}; return true;
    default: return false;
  }
}

inline uint32_t le32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The 32 codes of activation block t (0 .. block / 32 - 1) of a block b of the file's bytes.
template <int64_t F>
inline void decode(const uint8_t* b, int64_t t, uint8_t* u) {
  if constexpr (F == kQ4_0 || F == kQ4_1) {
    const uint8_t* qs = b + (F == kQ4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {
      u[i] = qs[i] & 0xF;
      u[i + 16] = qs[i] >> 4;
    }
  } else if constexpr (F == kQ5_0 || F == kQ5_1) {
    const int64_t head = F == kQ5_0 ? 2 : 4;
    const uint32_t qh = le32(b + head);
    const uint8_t* qs = b + head + 4;
    for (int i = 0; i < 16; ++i) {
      u[i] = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
      u[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
  } else if constexpr (F == kQ8_0) {
    std::memcpy(u, b + 2, 32);
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    const uint8_t* qs = b + (F == kQ4_K ? 16 : 48) + 32 * (t / 2);
    const int shift = 4 * static_cast<int>(t % 2);
    for (int i = 0; i < 32; ++i) u[i] = (qs[i] >> shift) & 0xF;
    if constexpr (F == kQ5_K) {
      const uint8_t* qh = b + 16;
      for (int i = 0; i < 32; ++i) u[i] |= ((qh[i] >> t) & 1) << 4;
    }
  } else {  // Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 scales, d
    const int64_t h = t / 4, c = t % 4;
    const uint8_t* ql = b + h * 64 + 32 * (c % 2);
    const uint8_t* qh = b + 128 + h * 32;
    const int low = 4 * static_cast<int>(c / 2), high = 2 * static_cast<int>(c);
    for (int i = 0; i < 32; ++i) u[i] = ((ql[i] >> low) & 0xF) | (((qh[i] >> high) & 3) << 4);
  }
}

// Integer dot products of kOut outputs' 32 codes with one row's 32 activations: lo[o] over
// the first 16, hi[o] over the last 16. Exact.
template <bool Signed>
inline void dots(const uint8_t (*u)[32], const int8_t* q, int32_t* lo, int32_t* hi) {
#ifdef __AVX2__
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  __m256i v[kOut];
  for (int o = 0; o < kOut; ++o) {
    __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(u[o]));
    __m256i x = a;
    if constexpr (Signed) {  // |w| (128 as an unsigned byte) times q with w's sign
      x = _mm256_sign_epi8(a, w);
      w = _mm256_sign_epi8(w, w);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    v[o] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
    v[o] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else  // pairs of products fit int16: |w| <= 63 or (signed) 128, |q| <= 127
    v[o] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
  }
  // lane l of v[o]: inputs 4l .. 4l + 3. Two rounds of pairwise sums leave, per 128-bit half,
  // four outputs' sums of that half's inputs.
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm256_permute2x128_si256(ab, cd, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm256_permute2x128_si256(ab, cd, 0x31));
#else
  for (int o = 0; o < kOut; ++o) {
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 16; ++i) {
      const int32_t w0 = Signed ? static_cast<int8_t>(u[o][i]) : u[o][i];
      const int32_t w1 = Signed ? static_cast<int8_t>(u[o][i + 16]) : u[o][i + 16];
      s0 += w0 * q[i];
      s1 += w1 * q[i + 16];
    }
    lo[o] = s0;
    hi[o] = s1;
  }
#endif
}

// y[0:R, 0:cols] for one tile of outputs [j0, j0 + cols) of part w.
template <int64_t F, int R, typename T>
void tile(T* y, int64_t ldy, const Int8Rows& a, int64_t r0, const Int8BlockPart& w,
          const Geometry& g, int64_t j0, int64_t cols, int64_t k) {
  const int64_t act_blocks = k / kActBlock, per_block = g.block / kActBlock;
  const int64_t row_bytes = k / g.block * g.block_bytes;
  constexpr int kSubs = 16;  // per block, at most (Q6_K: 256 / 16)
  const uint8_t* rows[kOut];
  for (int o = 0; o < kOut; ++o) rows[o] = w.data + (j0 + std::min<int64_t>(o, cols - 1)) * row_bytes;
  alignas(32) uint8_t u[kOut][32];
  float s[kSubs][kOut], m[kSubs][kOut];
  float acc[R][kOut] = {};
  for (int64_t bb = 0; bb < act_blocks; ++bb) {
    const int64_t blk = bb / per_block, t = bb % per_block;
    if (t == 0)
      for (int o = 0; o < kOut; ++o) {
        float so[kSubs], mo[kSubs];
        quant_scales(F, rows[o] + blk * g.block_bytes + g.header_at, so, mo);
        for (int64_t i = 0; i < per_block * g.subs; ++i) {
          s[i][o] = so[i];
          m[i][o] = mo[i];
        }
      }
    for (int o = 0; o < kOut; ++o) decode<F>(rows[o] + blk * g.block_bytes, t, u[o]);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * act_blocks + bb;
      alignas(32) int32_t lo[kOut], hi[kOut];
      dots<F == kQ8_0>(u, a.codes.data() + (r0 + r) * k + bb * kActBlock, lo, hi);
      const float d = a.scale[at], sum = a.sum[at];
      const int32_t q0 = a.halves[2 * at], q1 = a.halves[2 * at + 1];
      for (int o = 0; o < kOut; ++o) {
        float v;
        if (g.subs == 2) {
          const float* s0 = s[2 * t];
          const float* s1 = s[2 * t + 1];
          v = static_cast<float>(lo[o] - g.offset * q0) * s0[o];
          v = std::fma(static_cast<float>(hi[o] - g.offset * q1), s1[o], v);
        } else {
          v = static_cast<float>(lo[o] + hi[o] - g.offset * (q0 + q1)) * s[t][o];
        }
        acc[r][o] = std::fma(v, d, acc[r][o]);
        if (g.minimum) acc[r][o] = std::fma(m[t][o], sum, acc[r][o]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t o = 0; o < cols; ++o) store(acc[r][o], y + (r0 + r) * ldy + j0 + o);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CONVEYOR_INT8_PANELS 1
// The AVX512-VNNI kernel: outputs in panels of 16, one per int32 lane. A panel's codes are
// decoded once per call, for all of K, into a buffer that stays in L1/L2: per activation block
// of 32, 8 vectors whose lane o holds output o's codes 4g .. 4g + 3 (g = 0..7), all unsigned
// (Q8_0's codes + 128, offset 128: the same integer D), and its s (s0, s1 for Q6_K) and m as 16
// floats. Then per 4 rows, per block: lo = dpbusd over groups 0..3, hi over 4..7 against the
// row's 4-byte groups broadcast, and the float steps above on 16 outputs at once (each a
// vector IEEE operation in the scalar code's order): no horizontal sums.
constexpr int kPanel16 = 16;

// Lane o of g[j] (j = 0..3) = the 4 bytes at p[o] + off + 4j.
inline void transpose4(const uint8_t* const* p, int64_t off, __m512i* g) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_castsi128_si512(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j + 4] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j + 8] + off)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j + 12] + off)), 3);
    z[j] = v;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  g[0] = _mm512_unpacklo_epi64(t0, t2);
  g[1] = _mm512_unpackhi_epi64(t0, t2);
  g[2] = _mm512_unpacklo_epi64(t1, t3);
  g[3] = _mm512_unpackhi_epi64(t1, t3);
}

inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0xF)); }
inline __m512i high_nibbles(__m512i v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0xF));
}
// Adds 16 to each byte of c whose bit in `bits` (a byte mask per byte) is set in h.
inline __m512i fifth_bit(__m512i c, __m512i h, __m512i bits) {
  return _mm512_mask_add_epi8(c, _mm512_test_epi8_mask(h, bits), c, _mm512_set1_epi8(16));
}

inline __m512i header_dwords(const uint8_t* const* b, int64_t off) {
  alignas(64) uint32_t h[kPanel16];
  for (int o = 0; o < kPanel16; ++o) h[o] = le32(b[o] + off);
  return _mm512_load_si512(h);
}
inline __m512 halves_low(__m512i h) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)); }
inline __m512 halves_high(__m512i h) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
}

// A panel's decoded codes and scales, per activation block bb: codes[8 bb .. 8 bb + 7], s0, s1,
// m [bb].
struct PanelBuffer {
  std::vector<__m512i> codes;
  std::vector<__m512> s0, s1, m;
};

// Decodes file block blk of the 16 outputs b[o] (= their rows) into the activation blocks
// blk * per_block .. of `buf`.
template <int64_t F>
void decode_panel_block(const uint8_t* const* rows, int64_t blk, int64_t block_bytes,
                        PanelBuffer& buf) {
  const uint8_t* b[kPanel16];
  for (int o = 0; o < kPanel16; ++o) b[o] = rows[o] + blk * block_bytes;
  if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ5_0 || F == kQ5_1 || F == kQ8_0) {
    __m512i* c = buf.codes.data() + 8 * blk;
    const __m512i h = header_dwords(b, 0);
    buf.s0[blk] = halves_low(h);
    if constexpr (F == kQ4_1 || F == kQ5_1) buf.m[blk] = halves_high(h);
    if constexpr (F == kQ8_0) {
      transpose4(b, 2, c);
      transpose4(b, 18, c + 4);
      for (int g = 0; g < 8; ++g) c[g] = _mm512_xor_si512(c[g], _mm512_set1_epi8(-128));
    } else {
      constexpr int64_t qh_at = F == kQ5_0 ? 2 : 4;
      constexpr int64_t qs_at = F == kQ4_0 ? 2 : F == kQ4_1 ? 4 : qh_at + 4;
      __m512i p[4];
      transpose4(b, qs_at, p);
      for (int g = 0; g < 4; ++g) {
        c[g] = low_nibbles(p[g]);
        c[g + 4] = high_nibbles(p[g]);
      }
      if constexpr (F == kQ5_0 || F == kQ5_1) {
        const __m512i qh = header_dwords(b, qh_at);  // bit i: code i's fifth bit
        for (int g = 0; g < 8; ++g) {
          // byte g / 2 of each lane into its 4 bytes, byte j tested against bit 4 (g % 2) + j
          const int src = g / 2;
          const __m512i spread = _mm512_shuffle_epi8(
              qh, _mm512_set_epi8(12 + src, 12 + src, 12 + src, 12 + src, 8 + src, 8 + src,
                                  8 + src, 8 + src, 4 + src, 4 + src, 4 + src, 4 + src, src,
                                  src, src, src, 12 + src, 12 + src, 12 + src, 12 + src,
                                  8 + src, 8 + src, 8 + src, 8 + src, 4 + src, 4 + src, 4 + src,
                                  4 + src, src, src, src, src, 12 + src, 12 + src, 12 + src,
                                  12 + src, 8 + src, 8 + src, 8 + src, 8 + src, 4 + src,
                                  4 + src, 4 + src, 4 + src, src, src, src, src, 12 + src,
                                  12 + src, 12 + src, 12 + src, 8 + src, 8 + src, 8 + src,
                                  8 + src, 4 + src, 4 + src, 4 + src, 4 + src, src, src, src,
                                  src));
          const int sh = 4 * (g % 2);
          c[g] = fifth_bit(c[g], spread, _mm512_set1_epi32(static_cast<int>(
                                             (0x01u << sh) | (0x02u << sh) << 8 |
                                             (0x04u << sh) << 16 | (0x08u << sh) << 24)));
        }
      }
    }
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    constexpr int64_t qs_at = F == kQ4_K ? 16 : 48;
    __m512i* c = buf.codes.data() + 64 * blk;
    __m512i qh[8];
    if constexpr (F == kQ5_K) {
      transpose4(b, 16, qh);
      transpose4(b, 32, qh + 4);
    }
    for (int pair = 0; pair < 4; ++pair) {
      __m512i p[8];
      transpose4(b, qs_at + 32 * pair, p);
      transpose4(b, qs_at + 32 * pair + 16, p + 4);
      for (int g = 0; g < 8; ++g) {
        __m512i lo = low_nibbles(p[g]), hi = high_nibbles(p[g]);
        if constexpr (F == kQ5_K) {
          lo = fifth_bit(lo, qh[g], _mm512_set1_epi8(static_cast<char>(1 << (2 * pair))));
          hi = fifth_bit(hi, qh[g], _mm512_set1_epi8(static_cast<char>(1 << (2 * pair + 1))));
        }
        c[16 * pair + g] = lo;
        c[16 * pair + 8 + g] = hi;
      }
    }
    alignas(64) float s[8][kPanel16], m[8][kPanel16];
    for (int o = 0; o < kPanel16; ++o) {
      float so[16], mo[16];
      quant_scales(F, b[o], so, mo);
      for (int t = 0; t < 8; ++t) {
        s[t][o] = so[t];
        m[t][o] = mo[t];
      }
    }
    for (int t = 0; t < 8; ++t) {
      buf.s0[8 * blk + t] = _mm512_load_ps(s[t]);
      buf.m[8 * blk + t] = _mm512_load_ps(m[t]);
    }
  } else {  // Q6_K
    __m512i* c = buf.codes.data() + 64 * blk;
    for (int h = 0; h < 2; ++h) {
      __m512i ql[16], qh[8];
      for (int j = 0; j < 4; ++j) transpose4(b, h * 64 + 16 * j, ql + 4 * j);
      transpose4(b, 128 + h * 32, qh);
      transpose4(b, 128 + h * 32 + 16, qh + 4);
      for (int cc = 0; cc < 4; ++cc) {
        const __m512i* l = ql + 8 * (cc % 2);
        for (int g = 0; g < 8; ++g) {
          const __m512i low = cc / 2 ? high_nibbles(l[g]) : low_nibbles(l[g]);
          const int shift = 2 * cc;  // bits shift, shift + 1 to bits 4, 5
          const __m512i high = shift <= 4
              ? _mm512_slli_epi16(qh[g], 4 - shift) : _mm512_srli_epi16(qh[g], shift - 4);
          c[8 * (4 * h + cc) + g] =
              _mm512_or_si512(low, _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
        }
      }
    }
    alignas(64) float s[16][kPanel16];
    for (int o = 0; o < kPanel16; ++o) {
      float so[16], mo[16];
      quant_scales(F, b[o] + 192, so, mo);
      for (int j = 0; j < 16; ++j) s[j][o] = so[j];
    }
    for (int t = 0; t < 8; ++t) {
      buf.s0[8 * blk + t] = _mm512_load_ps(s[2 * t]);
      buf.s1[8 * blk + t] = _mm512_load_ps(s[2 * t + 1]);
    }
  }
}

// y[r0 .. r0 + R, j0 .. j0 + cols) from a decoded panel.
template <int64_t F, int R, typename T>
inline void panel_rows(T* y, int64_t ldy, const Int8Rows& a, int64_t r0, const PanelBuffer& buf,
                       const Geometry& g, int64_t j0, int64_t cols, int64_t k) {
  const int64_t act_blocks = k / kActBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int32_t offset = F == kQ8_0 ? 128 : static_cast<int32_t>(g.offset);
  for (int64_t bb = 0; bb < act_blocks; ++bb) {
    const __m512i* c = buf.codes.data() + 8 * bb;
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const int32_t* q = reinterpret_cast<const int32_t*>(a.codes.data() + (r0 + r) * k +
                                                          bb * kActBlock);
      lo[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], _mm512_set1_epi32(q[0]));
      hi[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[4], _mm512_set1_epi32(q[4]));
    }
    for (int gg = 1; gg < 4; ++gg)
      for (int r = 0; r < R; ++r) {
        const int32_t* q = reinterpret_cast<const int32_t*>(a.codes.data() + (r0 + r) * k +
                                                            bb * kActBlock);
        lo[r] = _mm512_dpbusd_epi32(lo[r], c[gg], _mm512_set1_epi32(q[gg]));
        hi[r] = _mm512_dpbusd_epi32(hi[r], c[gg + 4], _mm512_set1_epi32(q[gg + 4]));
      }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * act_blocks + bb;
      const __m512 d = _mm512_set1_ps(a.scale[at]);
      const int32_t q0 = a.halves[2 * at], q1 = a.halves[2 * at + 1];
      __m512 v;
      if constexpr (F == kQ6_K) {
        v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r], _mm512_set1_epi32(offset * q0))),
                          buf.s0[bb]);
        v = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r], _mm512_set1_epi32(offset * q1))),
            buf.s1[bb], v);
      } else {
        __m512i dsum = _mm512_add_epi32(lo[r], hi[r]);
        if (offset != 0) dsum = _mm512_sub_epi32(dsum, _mm512_set1_epi32(offset * (q0 + q1)));
        v = _mm512_mul_ps(_mm512_cvtepi32_ps(dsum), buf.s0[bb]);
      }
      acc[r] = _mm512_fmadd_ps(v, d, acc[r]);
      if (g.minimum) acc[r] = _mm512_fmadd_ps(buf.m[bb], _mm512_set1_ps(a.sum[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    T* out = y + (r0 + r) * ldy + j0;
    if (cols == kPanel16) {
      vfloat v;
      std::memcpy(&v, &acc[r], sizeof v);
      store(v, out);
    } else {
      alignas(64) float tmp[kPanel16];
      _mm512_store_ps(tmp, acc[r]);
      for (int64_t o = 0; o < cols; ++o) store(tmp[o], out + o);
    }
  }
}

template <int64_t F, typename T>
void gemm(T* y, int64_t ldy, const Int8Rows& a, const Int8BlockPart& w, int64_t m, int64_t k,
          int num_threads) {
  Geometry g;
  geometry(F, g);
  const int64_t panels = (w.n_out + kPanel16 - 1) / kPanel16;
  const int64_t row_bytes = k / g.block * g.block_bytes, file_blocks = k / g.block;
  const int64_t act_blocks = k / kActBlock;
#pragma omp parallel num_threads(num_threads)
  {
    PanelBuffer buf;
    buf.codes.resize(8 * act_blocks);
    buf.s0.resize(act_blocks);
    buf.s1.resize(F == kQ6_K ? act_blocks : 0);
    buf.m.resize(g.minimum ? act_blocks : 0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t j0 = p * kPanel16, cols = std::min<int64_t>(kPanel16, w.n_out - j0);
      const uint8_t* rows[kPanel16];
      for (int o = 0; o < kPanel16; ++o)
        rows[o] = w.data + (j0 + std::min<int64_t>(o, cols - 1)) * row_bytes;
      for (int64_t blk = 0; blk < file_blocks; ++blk)
        decode_panel_block<F>(rows, blk, g.block_bytes, buf);
      int64_t r = 0;
      for (; r + kRows <= m; r += kRows) panel_rows<F, kRows>(y, ldy, a, r, buf, g, j0, cols, k);
      with_constant<kRows - 1>(m - r, [&](auto rows_left) {
        panel_rows<F, decltype(rows_left)::value>(y, ldy, a, r, buf, g, j0, cols, k);
      });
    }
  }
}
#else
template <int64_t F, typename T>
void gemm(T* y, int64_t ldy, const Int8Rows& a, const Int8BlockPart& w, int64_t m, int64_t k,
          int num_threads) {
  Geometry g;
  geometry(F, g);
  const int64_t tiles = (w.n_out + kOut - 1) / kOut;
  for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
    const int64_t c1 = std::min(m, c0 + kRowChunk);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < tiles; ++p) {
      const int64_t j0 = p * kOut, cols = std::min<int64_t>(kOut, w.n_out - j0);
      int64_t r = c0;
      for (; r + kRows <= c1; r += kRows) tile<F, kRows>(y, ldy, a, r, w, g, j0, cols, k);
      with_constant<kRows - 1>(c1 - r, [&](auto rows) {
        tile<F, decltype(rows)::value>(y, ldy, a, r, w, g, j0, cols, k);
      });
    }
  }
}
#endif  // CONVEYOR_INT8_PANELS

inline float widen(float x) { return x; }
inline float widen(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

namespace conveyor {

int64_t int8_block_bytes(int64_t format, int64_t& block) {
  Geometry g;
  if (!geometry(format, g)) return 0;
  block = g.block;
  return g.block_bytes;
}

template <typename T>
void int8_rows(Int8Rows& out, const T* x, int64_t rows, int64_t k, int64_t x_stride,
               int num_threads) {
  const int64_t blocks = k / kActBlock;
  int8_t* codes = at_least(out.codes, rows * k);
  float* scale = at_least(out.scale, rows * blocks);
  float* sum = at_least(out.sum, rows * blocks);
  int32_t* halves = at_least(out.halves, 2 * rows * blocks);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
#ifdef CONVEYOR_INT8_PANELS
      {  // the same operations on 16 lanes: max is exact in any order, cvtps rounds to even
        const T* xb = x + r * x_stride + b * kActBlock;
        __m512 v[2];
        for (int h = 0; h < 2; ++h) {
          if constexpr (std::is_same_v<T, float>) {
            v[h] = _mm512_loadu_ps(xb + 16 * h);
          } else {
            v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16 * h))), 16));
          }
        }
        const __m512 mx = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]));
        const float amax = std::max(0.f, _mm512_reduce_max_ps(mx));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int8_t* q = codes + r * k + b * kActBlock;
        int32_t half[2];
        for (int h = 0; h < 2; ++h) {
          const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
          half[h] = _mm512_reduce_add_epi32(qi);
        }
        const int64_t at = r * blocks + b;
        scale[at] = d;
        sum[at] = d * static_cast<float>(half[0] + half[1]);
        halves[2 * at] = half[0];
        halves[2 * at + 1] = half[1];
        continue;
      }
#endif
      const T* xb = x + r * x_stride + b * kActBlock;
      float v[kActBlock], amax = 0.f;
      for (int i = 0; i < kActBlock; ++i) {
        v[i] = widen(xb[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = codes + r * k + b * kActBlock;
      int32_t half[2] = {0, 0};
      for (int i = 0; i < kActBlock; ++i) {
        const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * id));
        q[i] = static_cast<int8_t>(qi);
        half[i / 16] += qi;
      }
      const int64_t at = r * blocks + b;
      scale[at] = d;
      sum[at] = d * static_cast<float>(half[0] + half[1]);
      halves[2 * at] = half[0];
      halves[2 * at + 1] = half[1];
    }
  }
}

template <typename T>
void int8_block_gemm(T* y, int64_t ldy, const Int8Rows& a, const Int8BlockPart& w, int64_t m,
                     int64_t k, int num_threads) {
  switch (w.format) {
#define CONVEYOR_INT8_CASE(id) \
    case id: return gemm<id>(y, ldy, a, w, m, k, num_threads);
    CONVEYOR_INT8_CASE(kQ4_0)
    CONVEYOR_INT8_CASE(kQ4_1)
    CONVEYOR_INT8_CASE(kQ5_0)
    CONVEYOR_INT8_CASE(kQ5_1)
    CONVEYOR_INT8_CASE(kQ8_0)
    CONVEYOR_INT8_CASE(kQ4_K)
    CONVEYOR_INT8_CASE(kQ5_K)
    CONVEYOR_INT8_CASE(kQ6_K)
#undef CONVEYOR_INT8_CASE
  }
  std::abort();  // ops.cpp checks the format first
}

template <typename T>
void int8_block_matmul(T* y, const T* x, int64_t x_stride, const Int8BlockPart* parts,
                       int count, int64_t m, int64_t k, Int8Rows& scratch, int num_threads) {
  int64_t n = 0;
  for (int i = 0; i < count; ++i) n += parts[i].n_out;
  int8_rows(scratch, x, m, k, x_stride, num_threads);
  for (int i = 0, column = 0; i < count; column += parts[i++].n_out)
    int8_block_gemm(y + column, n, scratch, parts[i], m, k, num_threads);
}

#define CONVEYOR_INT8_TYPES(T)                                                               \
  template void int8_rows<T>(Int8Rows&, const T*, int64_t, int64_t, int64_t, int);           \
  template void int8_block_gemm<T>(T*, int64_t, const Int8Rows&, const Int8BlockPart&,       \
                                   int64_t, int64_t, int);                                   \
  template void int8_block_matmul<T>(T*, const T*, int64_t, const Int8BlockPart*, int,       \
                                     int64_t, int64_t, Int8Rows&, int);
CONVEYOR_INT8_TYPES(float)
CONVEYOR_INT8_TYPES(uint16_t)
#undef CONVEYOR_INT8_TYPES

}  // namespace conveyor

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
// The micro-kernels. AVX2 and up: panels of 16 outputs (AVX512-VNNI with BW: 512-bit vectors)
// or 8 (256-bit), one per int32 lane, decoded once per call for all of K (nibbles split by masks
// and shifts, the high bits from their planes, the outputs' bytes transposed to lanes), then 4
// rows at a time, per block of 32, eight dot products (vpdpbusd; on AVX2 vpmaddubsw + vpmaddwd)
// against the row's 4-byte groups broadcast and the float steps on the panel's outputs at once:
// no horizontal sums. The baseline: per tile of kOut = 8 outputs and up to kRows rows, each
// block of 32 decoded once to 8 x 32 code bytes, then each row's dot products in C++ and the
// float work above across the 8 outputs. Rows are rounded to 8 bits once per call (int8_rows).

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
  int64_t block, block_bytes, header_at, header_bytes, offset;
  int subs;  // sub-blocks (own s, m) per block of 32 activations: 1, or 2 (Q6_K)
  bool minimum, signed_codes;
  // The block's code bytes: the rest of it, before or after the scale bytes.
  constexpr int64_t code_at() const { return header_at ? 0 : header_bytes; }
};

// A type's block layout, at compile time where the type is; block 0 for a type the kernel
// does not read.
constexpr Geometry geometry(int64_t format) {
  switch (format) {
    case kQ4_0: return {32, 18, 0, 2, 8, 1, false, false};
    case kQ4_1: return {32, 20, 0, 4, 0, 1, true, false};
    case kQ5_0: return {32, 22, 0, 2, 16, 1, false, false};
    case kQ5_1: return {32, 24, 0, 4, 0, 1, true, false};
    case kQ8_0: return {32, 34, 0, 2, 0, 1, false, true};
    case kQ4_K: return {256, 144, 0, 16, 0, 1, true, false};
    case kQ5_K: return {256, 176, 0, 16, 0, 1, true, false};
    case kQ6_K: return {256, 210, 192, 18, 32, 2, false, false};
    default: return {};
  }
}

// The panel layout (int8_blocks.h): output `lane`'s file block, rebuilt from its panel block.
void unpack_lane(const uint8_t* chunk, const Geometry& g, int lanes, int lane, uint8_t* out) {
  for (int64_t i = 0; i < g.header_bytes; ++i)
    out[g.header_at + i] = chunk[(i / 2) * lanes * 2 + lane * 2 + i % 2];
  const uint8_t* codes = chunk + g.header_bytes * lanes;
  const int64_t code_bytes = g.block_bytes - g.header_bytes, at = g.code_at();
  for (int64_t i = 0; i < code_bytes; ++i)
    out[at + i] = codes[(i / 4) * lanes * 4 + lane * 4 + i % 4];
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
// the first 16, hi[o] over the last 16. Exact. (The baseline target's; SIMD targets take the
// panels below.)
template <bool Signed>
inline void dots(const uint8_t (*u)[32], const int8_t* q, int32_t* lo, int32_t* hi) {
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
}

// y[0:R, 0:cols] for panel p (outputs [p kOut, p kOut + cols)) of part w.
template <int64_t F, int R, typename T>
void tile(T* y, int64_t ldy, const Int8Rows& a, int64_t r0, const Int8BlockPart& w,
          const Geometry& g, int64_t p, int64_t cols, int64_t k) {
  const int64_t act_blocks = k / kActBlock, per_block = g.block / kActBlock;
  const int64_t file_blocks = k / g.block, j0 = p * kOut;
  constexpr int kSubs = 16;  // per block, at most (Q6_K: 256 / 16)
  constexpr int kMaxBlockBytes = 210;
  uint8_t blocks[kOut][kMaxBlockBytes];
  alignas(32) uint8_t u[kOut][32];
  float s[kSubs][kOut], m[kSubs][kOut];
  float acc[R][kOut] = {};
  for (int64_t bb = 0; bb < act_blocks; ++bb) {
    const int64_t blk = bb / per_block, t = bb % per_block;
    if (t == 0) {
      const uint8_t* chunk = w.data + (p * file_blocks + blk) * kOut * g.block_bytes;
      for (int o = 0; o < kOut; ++o) {
        unpack_lane(chunk, g, kOut, o, blocks[o]);
        float so[kSubs], mo[kSubs];
        quant_scales(F, blocks[o] + g.header_at, so, mo);
        for (int64_t i = 0; i < per_block * g.subs; ++i) {
          s[i][o] = so[i];
          m[i][o] = mo[i];
        }
      }
    }
    for (int o = 0; o < kOut; ++o) decode<F>(blocks[o], t, u[o]);
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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVEYOR_INT8_PANELS 1
// The SIMD kernel: outputs in panels of kLanesI (16 with AVX512-VNNI + BW, else 8), one per
// int32 lane. A panel's codes are decoded once per call, for all of K, into a buffer that stays
// in L1/L2: per activation block of 32, 8 vectors whose lane o holds output o's codes 4g .. 4g + 3
// (g = 0..7), and its s (s0, s1 for Q6_K) and m per lane. Then per 4 rows, per block: lo = the
// dot products over groups 0..3, hi over 4..7, against the row's 4-byte groups broadcast, and the
// float steps above on the panel's outputs at once (each a vector IEEE operation in the scalar
// code's order): no horizontal sums. The codes are unsigned but for Q8_0 without 512-bit VNNI,
// whose signed codes go through vpsignb (with it, Q8_0's codes + 128 and offset 128: the same D).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using VI = __m512i;
using VF = __m512;
constexpr int kLanesI = 16;
constexpr bool kQ8Unsigned = true;
inline VI unpacklo32(VI a, VI b) { return _mm512_unpacklo_epi32(a, b); }
inline VI unpackhi32(VI a, VI b) { return _mm512_unpackhi_epi32(a, b); }
inline VI unpacklo64(VI a, VI b) { return _mm512_unpacklo_epi64(a, b); }
inline VI unpackhi64(VI a, VI b) { return _mm512_unpackhi_epi64(a, b); }
inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI vxor(VI a, VI b) { return _mm512_xor_si512(a, b); }
inline VI srli16(VI a, int n) { return _mm512_srli_epi16(a, n); }
inline VI slli16(VI a, int n) { return _mm512_slli_epi16(a, n); }
inline VI bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline VI dwords(int v) { return _mm512_set1_epi32(v); }
inline VI add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI sub32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VI shuffle8(VI a, VI idx) { return _mm512_shuffle_epi8(a, idx); }
inline VI lane_bases() {  // dword k of each 16-byte lane: bytes 4k
  return _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                          0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C,
                          0x08080808, 0x04040404, 0);
}
// c + 16 in each byte whose bit `bits` (a one-bit mask per byte) is set in h; c's bit 4 is clear.
inline VI fifth_bit(VI c, VI h, VI bits) {
  return _mm512_mask_add_epi8(c, _mm512_test_epi8_mask(h, bits), c, _mm512_set1_epi8(16));
}
inline VI load_i(const void* p) { return _mm512_loadu_si512(p); }
inline VF halves(const uint8_t* h) {  // kLanesI fp16
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline VI words(const uint8_t* h) {  // kLanesI uint16, zero-extended
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline VI srli32(VI a, int n) { return _mm512_srli_epi32(a, n); }
inline VI slli32(VI a, int n) { return _mm512_slli_epi32(a, n); }
inline VI srai32(VI a, int n) { return _mm512_srai_epi32(a, n); }
inline VF negate(VF a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                                     _mm512_set1_epi32(INT32_MIN))); }
inline VF load_f(const float* p) { return _mm512_load_ps(p); }
inline void store_f(float* p, VF v) { _mm512_store_ps(p, v); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF set_f(float v) { return _mm512_set1_ps(v); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
#define CONVEYOR_DPBUSD 1
inline VI broadcast_group(int32_t a) { return _mm512_set1_epi32(a); }
template <bool Signed>
inline VI dot(VI acc, VI codes, VI x) {
  return _mm512_dpbusd_epi32(acc, codes, x);
}
#else
using VI = __m256i;
using VF = __m256;
constexpr int kLanesI = 8;
constexpr bool kQ8Unsigned = false;
inline VI unpacklo32(VI a, VI b) { return _mm256_unpacklo_epi32(a, b); }
inline VI unpackhi32(VI a, VI b) { return _mm256_unpackhi_epi32(a, b); }
inline VI unpacklo64(VI a, VI b) { return _mm256_unpacklo_epi64(a, b); }
inline VI unpackhi64(VI a, VI b) { return _mm256_unpackhi_epi64(a, b); }
inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI vxor(VI a, VI b) { return _mm256_xor_si256(a, b); }
inline VI srli16(VI a, int n) { return _mm256_srli_epi16(a, n); }
inline VI slli16(VI a, int n) { return _mm256_slli_epi16(a, n); }
inline VI bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline VI dwords(int v) { return _mm256_set1_epi32(v); }
inline VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI sub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI shuffle8(VI a, VI idx) { return _mm256_shuffle_epi8(a, idx); }
inline VI lane_bases() {
  return _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                          0x04040404, 0);
}
inline VI fifth_bit(VI c, VI h, VI bits) {
  const VI set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bits), bits);
  return _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
inline VI load_i(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VF halves(const uint8_t* h) {  // kLanesI fp16
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
inline VI words(const uint8_t* h) {  // kLanesI uint16, zero-extended
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
inline VI srli32(VI a, int n) { return _mm256_srli_epi32(a, n); }
inline VI broadcast_group(int32_t a) { return _mm256_set1_epi32(a); }
inline VI slli32(VI a, int n) { return _mm256_slli_epi32(a, n); }
inline VI srai32(VI a, int n) { return _mm256_srai_epi32(a, n); }
inline VF negate(VF a) { return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(a),
                                                                     _mm256_set1_epi32(INT32_MIN))); }
inline VF load_f(const float* p) { return _mm256_load_ps(p); }
inline void store_f(float* p, VF v) { _mm256_store_ps(p, v); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF set_f(float v) { return _mm256_set1_ps(v); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define CONVEYOR_DPBUSD 1
// acc + the 4-byte dot products of codes' lanes with x's (a row's 4 bytes, broadcast); Signed:
// codes are int8 (Q8_0), through |w| and x with w's sign.
template <bool Signed>
inline VI dot(VI acc, VI codes, VI x) {
  VI w = codes;
  if constexpr (Signed) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#endif
}
#else
// Without VNNI: the int16 sums of pairs of products of codes' bytes with a's (vpmaddubsw; Signed:
// as dot), summed further in int16 over a run of code vectors (pair_runs) before vpmaddwd widens
// them to the 4-byte dot products.
template <bool Signed>
inline VI pair_products(VI codes, VI x) {
  VI w = codes;
  if constexpr (Signed) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
  return _mm256_maddubs_epi16(w, x);
}
inline VI add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
inline VI widen_pairs(VI sums) { return _mm256_madd_epi16(sums, _mm256_set1_epi16(1)); }
#endif
#endif

inline VI low_nibbles(VI v) { return vand(v, bytes(0xF)); }
inline VI high_nibbles(VI v) { return vand(srli16(v, 4), bytes(0xF)); }

// A panel's decoded codes and scales, per activation block bb: codes[8 bb .. 8 bb + 7], s0, s1,
// m [bb].
struct IVec {
  VI v;
};
struct FVec {
  VF v;
};
struct PanelBuffer {
  std::vector<IVec> codes;
  std::vector<FVec> s0, s1, m;
  VI* code(int64_t i) { return &codes[i].v; }
  const VI* code(int64_t i) const { return &codes[i].v; }
};

// The types whose weights have a minimum (w = u s + m).
template <int64_t F>
constexpr bool kMinimum = geometry(F).minimum;

// One file block of a panel decoded (decode_panel_block with blk = 0): what a single row
// reads once, so it is decoded into locals and used at once.
template <int64_t F>
struct BlockBuffer {
  static constexpr int kBlocks = geometry(F).block / kActBlock;
  IVec codes[8 * kBlocks];
  FVec s0[kBlocks], s1[geometry(F).subs == 2 ? kBlocks : 1], m[kBlocks];
  VI* code(int64_t i) { return &codes[i].v; }
};

// A panel block (int8_blocks.h's layout): its scale bytes as kLanesI-lane vectors of 16-bit
// units, then its code bytes as vectors of 4-byte groups (lane o: output o's bytes 4j .. 4j + 3).
struct PanelBlock {
  const uint8_t* header;
  const uint8_t* codes;
  VF half(int unit) const { return halves(header + unit * 2 * kLanesI); }
  VI unit(int u) const { return words(header + u * 2 * kLanesI); }
  VI byte(int i) const { return vand(srli32(unit(i / 2), 8 * (i % 2)), dwords(0xFF)); }
  VI group(int j) const { return load_i(codes + j * 4 * kLanesI); }
};

// Decodes file block blk of a panel (`chunk`, its panel block) into activation blocks
// blk * per_block .. of `buf` (a PanelBuffer or a BlockBuffer).
template <int64_t F, class Buffer>
__attribute__((always_inline)) inline void decode_panel_block(const uint8_t* chunk,
                                                              const Geometry& geo, int64_t blk,
                                                              Buffer& buf) {
  const PanelBlock b{chunk, chunk + geo.header_bytes * kLanesI};
  if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ5_0 || F == kQ5_1 || F == kQ8_0) {
    VI* c = buf.code(8 * blk);
    buf.s0[blk].v = b.half(0);
    if constexpr (F == kQ4_1 || F == kQ5_1) buf.m[blk].v = b.half(1);
    if constexpr (F == kQ8_0) {
      for (int g = 0; g < 8; ++g) {
        c[g] = b.group(g);
        if constexpr (kQ8Unsigned) c[g] = vxor(c[g], bytes(0x80));
      }
    } else {
      constexpr int qs = F == kQ5_0 || F == kQ5_1 ? 1 : 0;  // Q5: qh first
      for (int g = 0; g < 4; ++g) {
        const VI p = b.group(qs + g);
        c[g] = low_nibbles(p);
        c[g + 4] = high_nibbles(p);
      }
      if constexpr (F == kQ5_0 || F == kQ5_1) {
        const VI qh = b.group(0);  // bit i: code i's fifth bit
        for (int g = 0; g < 8; ++g) {
          // byte g / 2 of each lane into its 4 bytes; byte j tested against bit 4 (g % 2) + j
          const VI spread = shuffle8(qh, add32(dwords((g / 2) * 0x01010101), lane_bases()));
          const int sh = 4 * (g % 2);
          c[g] = fifth_bit(c[g], spread,
                           dwords(static_cast<int>((0x01u << sh) | (0x02u << sh) << 8 |
                                                   (0x04u << sh) << 16 | (0x08u << sh) << 24)));
        }
      }
    }
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    constexpr int qs = F == kQ4_K ? 0 : 8;  // Q5_K: 32 bytes of fifth bits first
    VI* c = buf.code(64 * blk);
    VI qh[8];
    if constexpr (F == kQ5_K)
      for (int g = 0; g < 8; ++g) qh[g] = b.group(g);
    for (int pair = 0; pair < 4; ++pair) {  // activation blocks 2 pair (low), 2 pair + 1 (high)
      for (int g = 0; g < 8; ++g) {
        const VI p = b.group(qs + 8 * pair + g);
        VI lo = low_nibbles(p), hi = high_nibbles(p);
        if constexpr (F == kQ5_K) {
          lo = fifth_bit(lo, qh[g], bytes(1 << (2 * pair)));
          hi = fifth_bit(hi, qh[g], bytes(1 << (2 * pair + 1)));
        }
        c[16 * pair + g] = lo;
        c[16 * pair + 8 + g] = hi;
      }
    }
    // quant_scales' values, lane by lane: d, dmin, then 8 6-bit scales and minima in 12 bytes
    const VF d = b.half(0), dmin = b.half(1);
    VI q[12];
    for (int i = 0; i < 12; ++i) q[i] = b.byte(4 + i);
    const VI six = dwords(63), four = dwords(0xF);
    for (int t = 0; t < 8; ++t) {
      const VI sc = t < 4 ? vand(q[t], six)
                          : vor(vand(q[t + 4], four), slli32(srli32(q[t - 4], 6), 4));
      const VI mn = t < 4 ? vand(q[t + 4], six)
                          : vor(srli32(q[t + 4], 4), slli32(srli32(q[t], 6), 4));
      buf.s0[8 * blk + t].v = mul(d, to_float(sc));
      buf.m[8 * blk + t].v = negate(mul(dmin, to_float(mn)));
    }
  } else {  // Q6_K: activation block 4 h + c: low nibbles of ql[64 h + 32 (c % 2) ..] (high
            // for c >= 2), bits 2c, 2c + 1 of qh[128 + 32 h ..]
    VI* c = buf.code(64 * blk);
    for (int h = 0; h < 2; ++h) {
      VI ql[16], qh[8];
      for (int j = 0; j < 16; ++j) ql[j] = b.group(16 * h + j);
      for (int j = 0; j < 8; ++j) qh[j] = b.group(32 + 8 * h + j);
      for (int cc = 0; cc < 4; ++cc) {
        const VI* l = ql + 8 * (cc % 2);
        const int shift = 2 * cc;  // bits shift, shift + 1 to bits 4, 5 (of the same byte)
        for (int g = 0; g < 8; ++g) {
          const VI low = cc / 2 ? high_nibbles(l[g]) : low_nibbles(l[g]);
          const VI high = shift <= 4 ? slli16(qh[g], 4 - shift) : srli16(qh[g], shift - 4);
          c[8 * (4 * h + cc) + g] = vor(low, vand(high, bytes(0x30)));
        }
      }
    }
    // quant_scales' values: 16 int8 scales times d
    const VF d = b.half(8);
    for (int t = 0; t < 8; ++t) {
      const VI u = b.unit(t);  // scales 2t (low byte) and 2t + 1
      buf.s0[8 * blk + t].v = mul(d, to_float(srai32(slli32(u, 24), 24)));
      buf.s1[8 * blk + t].v = mul(d, to_float(srai32(slli32(u, 16), 24)));
    }
  }
}

// The 4 activation bytes code vector g (0..7) of a block meets: bytes 4 (g % 4) .. of the
// block's first half (g < 4) or its second.
inline int32_t group_of(const int8_t* row, int g) {
  int32_t q;
  std::memcpy(&q, row + 4 * (g % 4) + 16 * (g / 4), 4);
  return q;
}

#ifndef CONVEYOR_DPBUSD
// How many code vectors' pair sums (each two products u q, |q| <= 127) add up in int16 without
// overflow: the type's largest code decides (15: 8 vectors, 31: 4, 63: 2; Q8_0's |w| <= 128: 1).
// Q6_K's runs stay within a half of the block (it scales the halves apart).
template <int64_t F>
constexpr int pair_runs() {
  if constexpr (F == kQ8_0) return 1;
  if constexpr (F == kQ6_K) return 2;
  if constexpr (F == kQ5_0 || F == kQ5_1 || F == kQ5_K) return 4;
  return 8;
}
#endif

// lo[r], hi[r]: one activation block's exact integer dot products of a panel's code vectors
// c[0..7] with row r's 4-byte groups broadcast, x(r, g) (group_of): over the block's first 16
// codes and its last (without VNNI, summed into lo alone where the type has one scale per
// block). Each code vector is loaded once for the R rows.
template <int64_t F, int R, class X>
__attribute__((always_inline)) inline void block_dots(const VI* c, X&& x, VI (&lo)[R],
                                                      VI (&hi)[R]) {
  constexpr bool kSigned = F == kQ8_0 && !kQ8Unsigned;
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = zero_i();
#ifdef CONVEYOR_DPBUSD
  for (int gg = 0; gg < 4; ++gg) {
    const VI first = c[gg], second = c[gg + 4];
    for (int r = 0; r < R; ++r) {
      lo[r] = dot<kSigned>(lo[r], first, x(r, gg));
      hi[r] = dot<kSigned>(hi[r], second, x(r, gg + 4));
    }
  }
#else
  constexpr int run = pair_runs<F>();
  for (int g0 = 0; g0 < 8; g0 += run) {
    VI sums[R];
    for (int g = g0; g < g0 + run; ++g) {
      const VI codes = c[g];
      for (int r = 0; r < R; ++r) {
        const VI products = pair_products<kSigned>(codes, x(r, g));
        sums[r] = g == g0 ? products : add16(sums[r], products);
      }
    }
    for (int r = 0; r < R; ++r) {
      VI& acc32 = g0 < 4 || F != kQ6_K ? lo[r] : hi[r];
      acc32 = add32(acc32, widen_pairs(sums[r]));
    }
  }
#endif
}

// The float steps of the header's formula for one activation block `at` (row r's block bb: r
// (k / 32) + bb) of a row: acc + its contribution, from block_dots' lo, hi and the panel's
// scales s0 (s1: Q6_K's second half) and minimum m for that block.
template <int64_t F>
__attribute__((always_inline)) inline VF block_step(VF acc, VI lo, VI hi, const Int8Rows& a,
                                                    int64_t at, VF s0, VF s1, VF m) {
  constexpr int32_t offset = F == kQ8_0 && kQ8Unsigned ? 128 : geometry(F).offset;
  VF v;
  if constexpr (F == kQ6_K) {
    v = mul(to_float(sub32(lo, dwords(offset * a.halves[2 * at]))), s0);
    v = fma(to_float(sub32(hi, dwords(offset * a.halves[2 * at + 1]))), s1, v);
  } else {
    VI dsum = add32(lo, hi);
    if constexpr (offset != 0)
      dsum = sub32(dsum, dwords(offset * (a.halves[2 * at] + a.halves[2 * at + 1])));
    v = mul(to_float(dsum), s0);
  }
  acc = fma(v, set_f(a.scale[at]), acc);
  if constexpr (kMinimum<F>) acc = fma(m, set_f(a.sum[at]), acc);
  return acc;
}

// y[r0 .. r0 + R, j0 .. j0 + cols) = acc.
template <int R, typename T>
inline void store_rows(T* y, int64_t ldy, int64_t r0, int64_t j0, int64_t cols,
                       const VF (&acc)[R]) {
  for (int r = 0; r < R; ++r) {
    T* out = y + (r0 + r) * ldy + j0;
    if constexpr (sizeof(vfloat) == sizeof(VF)) {
      if (cols == kLanesI) {
        vfloat v;
        std::memcpy(&v, &acc[r], sizeof v);
        store(v, out);
        continue;
      }
    }
    alignas(64) float tmp[kLanesI];
    store_f(tmp, acc[r]);
    for (int64_t o = 0; o < cols; ++o) store(tmp[o], out + o);
  }
}

// y[r0 .. r0 + R, j0 .. j0 + cols) from a panel decoded for all of K.
template <int64_t F, int R, typename T>
inline void panel_rows(T* y, int64_t ldy, const Int8Rows& a, int64_t r0, const PanelBuffer& buf,
                       int64_t j0, int64_t cols, int64_t k) {
  const int64_t act_blocks = k / kActBlock;
  VF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero_f();
  for (int64_t bb = 0; bb < act_blocks; ++bb) {
    const int8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = a.codes.data() + (r0 + r) * k + bb * kActBlock;
    VI lo[R], hi[R];
    block_dots<F, R>(buf.code(8 * bb), [&](int r, int gg) {
      return broadcast_group(group_of(rows[r], gg));
    }, lo, hi);
    const VF s0 = buf.s0[bb].v;
    VF s1 = zero_f(), m = zero_f();
    if constexpr (F == kQ6_K) s1 = buf.s1[bb].v;
    if constexpr (kMinimum<F>) m = buf.m[bb].v;
    for (int r = 0; r < R; ++r)
      acc[r] = block_step<F>(acc[r], lo[r], hi[r], a, (r0 + r) * act_blocks + bb, s0, s1, m);
  }
  store_rows<R>(y, ldy, r0, j0, cols, acc);
}

// y[0, j0 .. j0 + cols) for a single row (a decode step of one sequence), x its 4-byte groups
// broadcast: nothing is reused across rows, so each file block is decoded into locals and used
// at once, and the row's groups are broadcast once per call, not once per panel.
template <int64_t F, typename T>
inline void panel_row(T* y, const Int8Rows& a, const IVec* x, const uint8_t* panel,
                      const Geometry& g, int64_t j0, int64_t cols, int64_t k) {
  constexpr int per_block = BlockBuffer<F>::kBlocks;
  VF acc[1] = {zero_f()};
  for (int64_t blk = 0; blk < k / g.block; ++blk) {
    BlockBuffer<F> buf;
    decode_panel_block<F>(panel + blk * kLanesI * g.block_bytes, g, 0, buf);
    for (int t = 0; t < per_block; ++t) {
      const IVec* xb = x + 8 * (blk * per_block + t);
      VI lo[1], hi[1];
      block_dots<F, 1>(buf.code(8 * t), [&](int, int gg) { return xb[gg].v; }, lo, hi);
      VF s1 = zero_f(), m = zero_f();
      if constexpr (F == kQ6_K) s1 = buf.s1[t].v;
      if constexpr (kMinimum<F>) m = buf.m[t].v;
      acc[0] = block_step<F>(acc[0], lo[0], hi[0], a, blk * per_block + t, buf.s0[t].v, s1, m);
    }
  }
  store_rows<1>(y, 0, 0, j0, cols, acc);
}

template <int64_t F, typename T>
void gemm(T* y, int64_t ldy, const Int8Rows& a, const Int8BlockPart& w, int64_t m, int64_t k,
          int num_threads) {
  constexpr Geometry g = geometry(F);
  const int64_t panels = (w.n_out + kLanesI - 1) / kLanesI;
  const int64_t file_blocks = k / g.block, act_blocks = k / kActBlock;
  if (m == 1) {
    static thread_local std::vector<IVec> groups;  // the calling thread's, reused across calls
    IVec* x = at_least(groups, 8 * act_blocks);
    for (int64_t bb = 0; bb < act_blocks; ++bb)
      for (int gg = 0; gg < 8; ++gg)
        x[8 * bb + gg].v = broadcast_group(group_of(a.codes.data() + bb * kActBlock, gg));
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p)
      panel_row<F>(y, a, x, w.data + p * file_blocks * kLanesI * g.block_bytes, g,
                   p * kLanesI, std::min<int64_t>(kLanesI, w.n_out - p * kLanesI), k);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    PanelBuffer buf;
    buf.codes.resize(8 * act_blocks);
    buf.s0.resize(act_blocks);
    buf.s1.resize(F == kQ6_K ? act_blocks : 0);
    buf.m.resize(g.minimum ? act_blocks : 0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t j0 = p * kLanesI, cols = std::min<int64_t>(kLanesI, w.n_out - j0);
      const uint8_t* panel = w.data + p * file_blocks * kLanesI * g.block_bytes;
      for (int64_t blk = 0; blk < file_blocks; ++blk)
        decode_panel_block<F>(panel + blk * kLanesI * g.block_bytes, g, blk, buf);
      int64_t r = 0;
      for (; r + kRows <= m; r += kRows) panel_rows<F, kRows>(y, ldy, a, r, buf, j0, cols, k);
      with_constant<kRows - 1>(m - r, [&](auto rows_left) {
        panel_rows<F, decltype(rows_left)::value>(y, ldy, a, r, buf, j0, cols, k);
      });
    }
  }
}
#else
template <int64_t F, typename T>
void gemm(T* y, int64_t ldy, const Int8Rows& a, const Int8BlockPart& w, int64_t m, int64_t k,
          int num_threads) {
  constexpr Geometry g = geometry(F);
  const int64_t tiles = (w.n_out + kOut - 1) / kOut;
  for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
    const int64_t c1 = std::min(m, c0 + kRowChunk);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < tiles; ++p) {
      const int64_t j0 = p * kOut, cols = std::min<int64_t>(kOut, w.n_out - j0);
      int64_t r = c0;
      for (; r + kRows <= c1; r += kRows) tile<F, kRows>(y, ldy, a, r, w, g, p, cols, k);
      with_constant<kRows - 1>(c1 - r, [&](auto rows) {
        tile<F, decltype(rows)::value>(y, ldy, a, r, w, g, p, cols, k);
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

// One block of 32 activations rounded to 8 bits: the codes into q, the sums of each half of 16
// into half; returns the scale d. The vector paths run the scalar one's operations lane by lane
// (max is exact in any order; cvtps rounds to nearest even, as nearbyint does), so every build
// target gives the same bits.
template <typename T>
inline float round_block(const T* xb, int8_t* q, int32_t half[2]) {
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && !defined(__AVX512F__))
  vfloat loaded[kActBlock / kLanes];  // vec.h's load: float, or bf16 widened
  for (int i = 0; i < kActBlock / kLanes; ++i) loaded[i] = load(xb + kLanes * i);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 v[2] = {(__m512)loaded[0], (__m512)loaded[1]};
  const __m512 mx = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]));
  const float amax = std::max(0.f, _mm512_reduce_max_ps(mx));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  for (int h = 0; h < 2; ++h) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
    half[h] = _mm512_reduce_add_epi32(qi);
  }
  return d;
#elif defined(__AVX2__) && !defined(__AVX512F__)
  const __m256 v[4] = {(__m256)loaded[0], (__m256)loaded[1], (__m256)loaded[2],
                       (__m256)loaded[3]};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 mx = _mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
      _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = std::max(0.f, _mm_cvtss_f32(m4));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
  // int32 -> int8 (|q| <= 127, no saturation); packs work per 128-bit lane, the permute undoes it
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                            _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  for (int h = 0; h < 2; ++h) {
    const __m256i s8 = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    half[h] = _mm_cvtsi128_si32(s4);
  }
  return d;
#else
  float v[kActBlock], amax = 0.f;
  for (int i = 0; i < kActBlock; ++i) {
    v[i] = widen(xb[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  half[0] = half[1] = 0;
  for (int i = 0; i < kActBlock; ++i) {
    const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * id));
    q[i] = static_cast<int8_t>(qi);
    half[i / 16] += qi;
  }
  return d;
#endif
}

}  // namespace

namespace conveyor {

int int8_panel_lanes() {
#ifdef CONVEYOR_INT8_PANELS
  return kLanesI;
#else
  return kOut;
#endif
}

int64_t int8_block_bytes(int64_t format, int64_t& block) {
  const Geometry g = geometry(format);
  if (g.block == 0) return 0;
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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * blocks + b;
      int32_t half[2];
      const float d = round_block(x + r * x_stride + b * kActBlock, codes + r * k + b * kActBlock,
                                  half);
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

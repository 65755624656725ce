// y = x @ W^T for a few float32 or bf16 rows x and a weight W kept as a GGUF file's quantized
// blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 weights along K) and the K-quants Q4_K,
// Q5_K, Q6_K (super-blocks of 256 with 6-bit or 8-bit sub-block scales and fp16 super-scales).
//
// Every one of these dequantizes, per sub-block of 16 or 32 weights, from an unsigned integer
// code u of at most 8 bits and float32 values s, m computed from the block's scale bytes exactly
// as gguf computes them: w = u s + m (Q4_1, Q5_1, Q4_K / Q5_K with s = d sc, m = -dmin mn) or
// w = (u - offset) s (Q4_0, Q5_0, Q8_0, Q6_K with s = d sc). u s is exact in float32 (at most 24
// significant bits), so fma(u, s, m) and u * s + m alike give gguf's float32 weight, bit for bit
// (signed zeros included).
//
// W is laid out by panels of kPanel outputs (layers/gguf_blocks.py's QuantPanels, a repacking of
// the file's bytes that adds none): per panel, the codes of each step of K (one k, kPanel
// outputs: a plane of nibbles, byte t holding outputs t and kLanes + t, then the bits above
// them), and per block the file's own scale bytes of each output. Each step converts its
// codes to the very weights the dense panels (panel_gemm.cpp) would hold and feeds them to the
// panel GEMM's loop, so every output is the panel GEMM's chain of multiply-adds over the whole
// of K, in one lane, from zero: the same bits as panel_gemm over the dequantized weight, whatever
// the number of rows (docs/determinism.md), at the file's bytes.
//
// bf16 rows run on vdpbf16ps where the build targets AVX512-BF16 (the weights rounded to bf16
// as a bf16 model's panels hold them); elsewhere they are widened to float32.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "madd_step.h"
#include "panel_gemm.h"
#include "quant_panels.h"
#include "vec.h"

namespace {

using namespace conveyor;
constexpr int kRows = 6;  // rows sharing one pass over W, as the panel GEMM's tiles
constexpr int kMaxSubs = 16;  // sub-blocks per block (Q6_K: 256 / 16)

float half_to_float(const uint8_t* p) {  // exact; no F16C on the baseline target
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24, exact
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A format: its layout and its scale bytes' decoding into s[sub], m[sub] (float32, gguf's).
template <int64_t F>
struct Format;

template <>
struct Format<kQ4_0> {
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 2, kBits = 4, kOffset = 8;
  static void scales(const uint8_t* h, float* s, float* m) {
    s[0] = half_to_float(h);
    m[0] = 0;
  }
};

template <>
struct Format<kQ4_1> {
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 4, kBits = 4, kOffset = 0;
  static void scales(const uint8_t* h, float* s, float* m) {
    s[0] = half_to_float(h);
    m[0] = half_to_float(h + 2);
  }
};

template <>
struct Format<kQ5_0> {
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 2, kBits = 5, kOffset = 16;
  static void scales(const uint8_t* h, float* s, float* m) {
    s[0] = half_to_float(h);
    m[0] = 0;
  }
};

template <>
struct Format<kQ5_1> {
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 4, kBits = 5, kOffset = 0;
  static void scales(const uint8_t* h, float* s, float* m) { Format<kQ4_1>::scales(h, s, m); }
};

template <>
struct Format<kQ8_0> {  // codes + 128, unsigned
  static constexpr int64_t kBlock = 32, kSub = 32, kHeader = 2, kBits = 8, kOffset = 128;
  static void scales(const uint8_t* h, float* s, float* m) {
    s[0] = half_to_float(h);
    m[0] = 0;
  }
};

template <>
struct Format<kQ4_K> {  // d, dmin, then 8 6-bit scales and 8 6-bit minima packed in 12 bytes
  static constexpr int64_t kBlock = 256, kSub = 32, kHeader = 16, kBits = 4, kOffset = 0;
  static void scales(const uint8_t* h, float* s, float* m) {
    const float d = half_to_float(h), dmin = half_to_float(h + 2);
    const uint8_t* q = h + 4;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      s[j] = d * static_cast<float>(sc);
      m[j] = -(dmin * static_cast<float>(mn));
    }
  }
};

template <>
struct Format<kQ5_K> {
  static constexpr int64_t kBlock = 256, kSub = 32, kHeader = 16, kBits = 5, kOffset = 0;
  static void scales(const uint8_t* h, float* s, float* m) { Format<kQ4_K>::scales(h, s, m); }
};

template <>
struct Format<kQ6_K> {  // 16 int8 scales, then d
  static constexpr int64_t kBlock = 256, kSub = 16, kHeader = 18, kBits = 6, kOffset = 32;
  static void scales(const uint8_t* h, float* s, float* m) {
    const float d = half_to_float(h + 16);
    for (int j = 0; j < 16; ++j) {
      s[j] = d * static_cast<float>(static_cast<int8_t>(h[j]));
      m[j] = 0;
    }
  }
};

template <class Fm>
constexpr int64_t step_bytes() {
  return kPanel * Fm::kBits / 8;
}

// kLanes bytes as int32 lanes.
inline vint widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
  return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  typedef uint8_t vbyte __attribute__((vector_size(kLanes)));
  vbyte b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vint);
#endif
}

template <int H, size_t... L>
inline vint lane_shifts(std::index_sequence<L...>) {
  return vint{static_cast<int32_t>(L * H)...};
}

// The kLanes H-bit fields of a little-endian bit string of kLanes * H bits, one a lane.
template <int H>
inline vint bit_fields(const uint8_t* p) {
  uint32_t word = 0;
  std::memcpy(&word, p, kLanes * H / 8);
  const vint shifts = lane_shifts<H>(std::make_index_sequence<kLanes>{});
  return ((vint{} + static_cast<int32_t>(word)) >> shifts) & ((1 << H) - 1);
}

// A step's codes: outputs 0 .. kLanes - 1 in q[0], the next kLanes in q[1].
template <class Fm>
inline void step_codes(const uint8_t* p, vint q[2]) {
  const vint nibbles = widen(p);
  q[0] = nibbles & 0xF;
  q[1] = (nibbles >> 4) & 0xF;
  if constexpr (Fm::kBits == 8) {
    const vint high = widen(p + kLanes);
    q[0] |= (high & 0xF) << 4;
    q[1] |= ((high >> 4) & 0xF) << 4;
  } else if constexpr (Fm::kBits > 4) {
    constexpr int H = Fm::kBits - 4;
    q[0] |= bit_fields<H>(p + kLanes) << 4;
    q[1] |= bit_fields<H>(p + kLanes + kLanes * H / 8) << 4;
  }
}

// A step's kPanel weights as two float vectors: u s + m, or (u - offset) s (exact products, so
// at most one rounding).
template <class Fm>
inline void step_weights(const uint8_t* p, const vfloat s[2], const vfloat m[2], vfloat w[2]) {
  vint q[2];
  step_codes<Fm>(p, q);
  for (int h = 0; h < 2; ++h) {
    if constexpr (Fm::kOffset)
      w[h] = __builtin_convertvector(q[h] - static_cast<int32_t>(Fm::kOffset), vfloat) * s[h];
    else
      w[h] = __builtin_convertvector(q[h], vfloat) * s[h] + m[h];
  }
}

// A step of the panel GEMM's loop: the two vectors of W it multiplies.
template <class F, class Fm>
struct Steps;

template <class Fm>
struct Steps<F32, Fm> {
  static void weights(const uint8_t* p, const vfloat s[2], const vfloat m[2], vfloat& w0,
                      vfloat& w1) {
    vfloat w[2];
    step_weights<Fm>(p, s, m, w);
    w0 = w[0];
    w1 = w[1];
  }
};

#ifdef __AVX512BF16__
template <class Fm>
struct Steps<BF16, Fm> {  // a step: a pair of k, words 2j + e = output j, k = 2i + e
  static void weights(const uint8_t* p, const vfloat s[2], const vfloat m[2], __m512bh& w0,
                      __m512bh& w1) {
    vfloat a[2], b[2];
    step_weights<Fm>(p, s, m, a);
    step_weights<Fm>(p + step_bytes<Fm>(), s, m, b);
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    __m512bh w[2];
    for (int h = 0; h < 2; ++h)  // round to nearest even, as torch's .to(bfloat16)
      w[h] = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps((__m512)a[h], hi, (__m512)b[h]),
                                 _mm512_permutex2var_ps((__m512)a[h], lo, (__m512)b[h]));
    w0 = w[0];
    w1 = w[1];
  }
};
#endif

template <typename T>
inline void store_row(const vfloat* acc, T* y, int64_t cols) {
  T row[kPanel];
  store(acc[0], row);
  store(acc[1], row + kLanes);
  std::memcpy(y, row, cols * sizeof(T));
}

// y[0:R, 0:cols] = x[0:R, :] @ panel^T: the panel GEMM's `tile`, W's vectors from the codes.
template <class F, class Fm, int R>
void quant_tile(typename F::T* y, int64_t ldy, const typename F::T* x, int64_t x_stride,
                const QuantPanel& w, int64_t panel, int64_t k, int64_t cols) {
  constexpr int64_t kSubs = Fm::kBlock / Fm::kSub, kStep = step_bytes<Fm>();
  const int64_t blocks = k / Fm::kBlock;
  const uint8_t* codes = w.codes + panel * k * kStep;
  const uint8_t* header = w.header + panel * blocks * kPanel * Fm::kHeader;
  float s[kSubs][kPanel], m[kSubs][kPanel];
  vfloat acc[R][2] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t j = 0; j < kPanel; ++j) {
      float sj[kSubs], mj[kSubs];
      Fm::scales(header + (b * kPanel + j) * Fm::kHeader, sj, mj);
      for (int64_t t = 0; t < kSubs; ++t) {
        s[t][j] = sj[t];
        m[t][j] = mj[t];
      }
    }
    for (int64_t t = 0; t < kSubs; ++t) {
      const vfloat sv[2] = {load(s[t]), load(s[t] + kLanes)};
      const vfloat mv[2] = {load(m[t]), load(m[t] + kLanes)};
      const int64_t first = b * Fm::kBlock + t * Fm::kSub;
      for (int64_t i = first; i < first + Fm::kSub; i += F::kStep) {
        decltype(F::vector(x)) w0, w1;
        Steps<F, Fm>::weights(codes + i * kStep, sv, mv, w0, w1);
        madd_rows<F>(acc, x + i, x_stride, w0, w1);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_row(acc[r], y + r * ldy, cols);
}

template <class F, class Fm>
void quant_gemm(typename F::T* y, int64_t ldy, const typename F::T* x, int64_t x_stride,
                const QuantPanel& w, int64_t m, int64_t n, int64_t k, int num_threads) {
  static_assert(Fm::kBlock / Fm::kSub <= kMaxSubs);
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
    typename F::T* yp = y + p * kPanel;
    int64_t r = 0;
    for (; r + kRows <= m; r += kRows)
      quant_tile<F, Fm, kRows>(yp + r * ldy, ldy, x + r * x_stride, x_stride, w, p, k, cols);
    with_constant<kRows - 1>(m - r, [&](auto rows) {
      quant_tile<F, Fm, decltype(rows)::value>(yp + r * ldy, ldy, x + r * x_stride, x_stride, w,
                                               p, k, cols);
    });
  }
}

template <class F>
void quant_dispatch(typename F::T* y, int64_t ldy, const typename F::T* x, int64_t x_stride,
                    const QuantPanel& w, int64_t m, int64_t n, int64_t k, int num_threads) {
  switch (w.format) {
#define CONVEYOR_QUANT_CASE(id) \
    case id: return quant_gemm<F, Format<id>>(y, ldy, x, x_stride, w, m, n, k, num_threads);
    CONVEYOR_QUANT_CASE(kQ4_0)
    CONVEYOR_QUANT_CASE(kQ4_1)
    CONVEYOR_QUANT_CASE(kQ5_0)
    CONVEYOR_QUANT_CASE(kQ5_1)
    CONVEYOR_QUANT_CASE(kQ8_0)
    CONVEYOR_QUANT_CASE(kQ4_K)
    CONVEYOR_QUANT_CASE(kQ5_K)
    CONVEYOR_QUANT_CASE(kQ6_K)
#undef CONVEYOR_QUANT_CASE
  }
  std::abort();  // ops.cpp checks the format first
}

template <class Fm>
QuantLayout layout_of() {
  return {Fm::kBlock, Fm::kHeader, Fm::kBits};
}

}  // namespace

namespace conveyor {

bool quant_layout(int64_t format, QuantLayout& layout) {
  switch (format) {
    case kQ4_0: layout = layout_of<Format<kQ4_0>>(); return true;
    case kQ4_1: layout = layout_of<Format<kQ4_1>>(); return true;
    case kQ5_0: layout = layout_of<Format<kQ5_0>>(); return true;
    case kQ5_1: layout = layout_of<Format<kQ5_1>>(); return true;
    case kQ8_0: layout = layout_of<Format<kQ8_0>>(); return true;
    case kQ4_K: layout = layout_of<Format<kQ4_K>>(); return true;
    case kQ5_K: layout = layout_of<Format<kQ5_K>>(); return true;
    case kQ6_K: layout = layout_of<Format<kQ6_K>>(); return true;
    default: return false;
  }
}

void quant_scales(int64_t format, const uint8_t* header, float* s, float* m) {
  switch (format) {
#define CONVEYOR_SCALES_CASE(id) \
    case id: return Format<id>::scales(header, s, m);
    CONVEYOR_SCALES_CASE(kQ4_0)
    CONVEYOR_SCALES_CASE(kQ4_1)
    CONVEYOR_SCALES_CASE(kQ5_0)
    CONVEYOR_SCALES_CASE(kQ5_1)
    CONVEYOR_SCALES_CASE(kQ8_0)
    CONVEYOR_SCALES_CASE(kQ4_K)
    CONVEYOR_SCALES_CASE(kQ5_K)
    CONVEYOR_SCALES_CASE(kQ6_K)
#undef CONVEYOR_SCALES_CASE
  }
  std::abort();  // callers check the format first
}

int64_t quant_step_bytes(const QuantLayout& layout) { return kPanel * layout.code_bits / 8; }

template <>
void quant_panel_gemm<float>(float* y, int64_t ldy, const float* x, int64_t x_stride,
                             const QuantPanel& w, int64_t m, int64_t n, int64_t k,
                             int num_threads) {
  quant_dispatch<F32>(y, ldy, x, x_stride, w, m, n, k, num_threads);
}

template <>
void quant_panel_gemm<uint16_t>(uint16_t* y, int64_t ldy, const uint16_t* x, int64_t x_stride,
                                const QuantPanel& w, int64_t m, int64_t n, int64_t k,
                                int num_threads) {
#ifdef __AVX512BF16__
  quant_dispatch<BF16>(y, ldy, x, x_stride, w, m, n, k, num_threads);
#else  // x widened to float32 (exact), y rounded to bf16 once
  std::vector<float> xf(m * k), yf(m * n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; i += kLanes)  // k: a multiple of 32
      store(load(x + r * x_stride + i), xf.data() + r * k + i);
  quant_dispatch<F32>(yf.data(), n, xf.data(), k, w, m, n, k, num_threads);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) store(yf[r * n + j], y + r * ldy + j);
#endif
}

}  // namespace conveyor

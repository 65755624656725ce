// y = x @ W^T for a few float32 or bf16 rows x and a weight W kept as a GGUF file's blocks (CPU).
//
// W [N, K] is stored in blocks of 32 weights along K, as GGUF stores them:
//
// * 4-bit (Q4_0 / Q4_1): 16 bytes of codes per block (byte j holds q[j] in its low nibble and
//   q[j + 16] in its high one), a scale d and a minimum m: w = d * q + m, q in 0..15;
// * 8-bit (Q8_0): 32 signed bytes per block and a scale d: w = d * q, q in -128..127.
//
// Per output and block, sum_j w_j x_j = d * sum_j q_j x_j (+ m * sum_j x_j), so the codes are
// converted once and feed every row (float32 vectors, or bf16 for vdpbf16ps where the CPU has
// AVX512-BF16); the block sums of x are computed once per call. At one to a few rows a matmul
// is bound by reading W, and these blocks are 0.75 (4-bit) or 1.13 (8-bit) bytes per weight
// against float32's 4 and bf16's 2. Threads split the outputs.
//
// Entry points in block_matmul.h; K is a multiple of 32 (ops.cpp checks).

#include <cstdint>
#include <cstring>
#include <vector>

#include "block_matmul.h"
#include "dispatch.h"
#include "vec.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif


namespace {

// 8-float vectors on every CPU, not vec.h's kLanes (16 with AVX-512): a block of 32 codes is
// four of them, and this loop keeps 4 + R live. 8 lanes are native on AVX2 and AVX-512 alike.
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v4u __attribute__((vector_size(16)));

constexpr int kBlock = 32;
constexpr int kMaxRows = 4;  // rows sharing one pass over W (their accumulators stay in registers)
constexpr int64_t kPrefetchRows = 8;  // how far ahead of its use an output's weights are fetched

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// A block's 32 codes as four vectors of floats, codes 0-7, 8-15, 16-23, 24-31. Each byte goes to
// its own 32-bit lane by a word shuffle and a per-lane shift (GCC 12 turns a uint8 -> float
// vector conversion into 32 scalar ones).
struct Q4 {
  static constexpr int kBytes = 16;
  static constexpr bool kHasMin = true;
  static void codes(const uint8_t* p, v8f q[4]) {
#ifdef __AVX2__
    // vpmovzxbd widens 8 bytes to 8 lanes in one instruction (GCC does not find it).
    const v8i first = (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));  // bytes 0-7
    const v8i second = (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    q[0] = __builtin_convertvector(first & 0xF, v8f);  // low nibbles: codes 0-7
    q[1] = __builtin_convertvector(second & 0xF, v8f);  // 8-15
    q[2] = __builtin_convertvector(first >> 4, v8f);  // high nibbles: codes 16-23
    q[3] = __builtin_convertvector(second >> 4, v8f);  // 24-31
#else
    const v8u shift = {0, 8, 16, 24, 0, 8, 16, 24};
    v4u words;
    std::memcpy(&words, p, sizeof words);
    const v8u first = __builtin_shufflevector(words, words, 0, 0, 0, 0, 1, 1, 1, 1);  // bytes 0-7
    const v8u second = __builtin_shufflevector(words, words, 2, 2, 2, 2, 3, 3, 3, 3);  // 8-15
    q[0] = __builtin_convertvector(v8i((first >> shift) & 0xF), v8f);  // low nibbles: q 0-7
    q[1] = __builtin_convertvector(v8i((second >> shift) & 0xF), v8f);
    q[2] = __builtin_convertvector(v8i((first >> (shift + 4)) & 0xF), v8f);  // high: q 16-23
    q[3] = __builtin_convertvector(v8i((second >> (shift + 4)) & 0xF), v8f);
#endif
  }
#ifdef __AVX512BF16__
  // Low nibbles (codes 0-15) then high ones (16-31) as 32 bytes, widened to 16-bit lanes, and
  // each code to its bf16 value by a 16-entry table lookup (vpermw).
  static __m512bh bf16_codes(const uint8_t* p) {
    typedef uint8_t v16b __attribute__((vector_size(16)));
    v16b bytes;
    std::memcpy(&bytes, p, sizeof bytes);
    const v16b lo = bytes & 0xF, hi = bytes >> 4;
    const __m256i q = (__m256i)__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                       11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                                       22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), bf16_table());
  }
  static __m512i bf16_table() {  // lane i (< 16): bf16(i)
    return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160,
                            0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0,
                            0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0);
  }
#endif
};

struct Q8 {
  static constexpr int kBytes = 32;
  static constexpr bool kHasMin = false;
  static void codes(const uint8_t* p, v8f q[4]) {
#ifdef __AVX2__
    // vpmovsxbd widens 8 signed bytes to 8 lanes in one instruction (GCC does not find it).
    for (int i = 0; i < 4; ++i)
      q[i] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * i))));
#else
    // Byte i of a word to the lane's top, then an arithmetic shift back sign-extends it.
    const v8i up = {24, 16, 8, 0, 24, 16, 8, 0};
    v8i words;
    std::memcpy(&words, p, sizeof words);
    const v8i parts[4] = {__builtin_shufflevector(words, words, 0, 0, 0, 0, 1, 1, 1, 1),
                          __builtin_shufflevector(words, words, 2, 2, 2, 2, 3, 3, 3, 3),
                          __builtin_shufflevector(words, words, 4, 4, 4, 4, 5, 5, 5, 5),
                          __builtin_shufflevector(words, words, 6, 6, 6, 6, 7, 7, 7, 7)};
    for (int i = 0; i < 4; ++i) q[i] = __builtin_convertvector((parts[i] << up) >> 24, v8f);
#endif
  }
#ifdef __AVX512BF16__
  // Two halves of 16 codes widened to int32 and converted to float, then packed to bf16
  // (exact: |q| <= 128 needs 8 significant bits).
  static __m512bh bf16_codes(const uint8_t* p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
#endif
};

// Output n's codes, scales and minima into the cache ahead of their use: the hardware
// prefetcher follows three streams less far.
template <class Format>
void prefetch_row(const uint8_t* codes, const float* scale, const float* minimum, int64_t n,
                  int64_t blocks) {
  const int64_t row_bytes = blocks * Format::kBytes;
  for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(codes + n * row_bytes + o, 0, 0);
  for (int64_t b = 0; b < blocks; b += 16) {  // 16 floats: a cache line
    __builtin_prefetch(scale + n * blocks + b, 0, 0);
    if constexpr (Format::kHasMin) __builtin_prefetch(minimum + n * blocks + b, 0, 0);
  }
}

// How a block of 32 codes meets a row's 32 activations, per activation type:
//
// * float32: the codes as four 8-float vectors (Format::codes), four multiply-adds, then the
//   block's scale.
// * bf16 with AVX512-BF16: the codes as 32 bf16 values (small integers, so exact) and one
//   vdpbf16ps against the row's 32 bf16 activations (16 float lanes, each a pair of products),
//   then the scale: the conversion is about half the float path's instructions and the x block
//   is one load. The products and their sums are exact or float32-rounded as in the float path;
//   only their order differs.
struct F32Activations {
  using T = float;
  using Acc = v8f;
  struct Codes { v8f q[4]; };
  template <class Format>
  static Codes codes(const uint8_t* p) {
    Codes c;
    Format::codes(p, c.q);
    return c;
  }
  static Acc add(Acc acc, const Codes& c, const float* xb, float d) {
    const v8f dot = (c.q[0] * load8(xb) + c.q[1] * load8(xb + 8)) +
                    (c.q[2] * load8(xb + 16) + c.q[3] * load8(xb + 24));
    return acc + d * dot;
  }
  static float total(Acc acc) { return hsum8(acc); }
  static float block_sum(const float* xb) {
    return hsum8(load8(xb) + load8(xb + 8) + load8(xb + 16) + load8(xb + 24));
  }
};

#ifdef __AVX512BF16__
struct BF16Activations {
  using T = uint16_t;
  using Acc = __m512;
  using Codes = __m512bh;
  template <class Format>
  static Codes codes(const uint8_t* p) { return Format::bf16_codes(p); }
  static Acc add(Acc acc, Codes c, const uint16_t* xb, float d) {
    const __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), c, (__m512bh)_mm512_loadu_si512(xb));
    return _mm512_fmadd_ps(_mm512_set1_ps(d), dot, acc);
  }
  static float total(Acc acc) { return conveyor::hsum(reinterpret_cast<conveyor::vfloat>(acc)); }
  static float block_sum(const uint16_t* xb) {  // x . 1 over the block, in float
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
    return total(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xb), ones));
  }
};
#endif

template <class Format, class A, int R>
void block_rows(typename A::T* y, const typename A::T* x, const float* x_sums,
                const uint8_t* codes, const float* scale, const float* minimum, int64_t n_out,
                int64_t k, int64_t x_stride, int64_t y_stride, int num_threads) {
  const int64_t blocks = k / kBlock;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < n_out; ++n) {
    const uint8_t* c = codes + n * blocks * Format::kBytes;
    const float* d = scale + n * blocks;
    if (n + kPrefetchRows < n_out)
      prefetch_row<Format>(codes, scale, minimum, n + kPrefetchRows, blocks);
    // Two accumulators a row, for even and odd blocks: each add waits on the last one's result,
    // and one chain a row left the multiply-add units idle half the time.
    typename A::Acc even[R] = {}, odd[R] = {};
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      const auto q0 = A::template codes<Format>(c + b * Format::kBytes);
      const auto q1 = A::template codes<Format>(c + (b + 1) * Format::kBytes);
      for (int r = 0; r < R; ++r) {
        even[r] = A::add(even[r], q0, x + r * x_stride + b * kBlock, d[b]);
        odd[r] = A::add(odd[r], q1, x + r * x_stride + (b + 1) * kBlock, d[b + 1]);
      }
    }
    if (b < blocks) {
      const auto q = A::template codes<Format>(c + b * Format::kBytes);
      for (int r = 0; r < R; ++r) even[r] = A::add(even[r], q, x + r * x_stride + b * kBlock, d[b]);
    }
    for (int r = 0; r < R; ++r) {
      float min_term = 0;  // sum_b m_b * sum(x over block b), in its own loop: in the one above,
      if constexpr (Format::kHasMin) {  // a scalar add chain per block held it back
        const float* m = minimum + n * blocks;
        const float* s = x_sums + r * blocks;
        v8f part = {};
        int64_t b = 0;
        for (; b + 8 <= blocks; b += 8) part += load8(m + b) * load8(s + b);
        min_term = hsum8(part);
        for (; b < blocks; ++b) min_term += m[b] * s[b];
      }
      conveyor::store(A::total(even[r] + odd[r]) + min_term, y + r * y_stride + n);
    }
  }
}

template <class Format, class A>
void blocks_gemm(typename A::T* y, const typename A::T* x, const uint8_t* codes,
                  const float* scale, const float* minimum, int64_t rows, int64_t n_out,
                  int64_t k, int64_t x_stride, int num_threads) {
  const int64_t blocks = k / kBlock;
  std::vector<float> x_sums(Format::kHasMin ? rows * blocks : 0);
  if constexpr (Format::kHasMin)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        x_sums[r * blocks + b] = A::block_sum(x + r * x_stride + b * kBlock);
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t r = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
    const float* sr = x_sums.data() + (Format::kHasMin ? r0 * blocks : 0);
    conveyor::with_constant<kMaxRows>(r, [&](auto rows) {
      block_rows<Format, A, decltype(rows)::value>(y + r0 * n_out, x + r0 * x_stride, sr, codes,
                                                   scale, minimum, n_out, k, x_stride, n_out,
                                                   num_threads);
    });
  }
}

// A bf16 x through the float32 kernel, on CPUs without AVX512-BF16: x widened to float32 (exact),
// y rounded to bf16 once.
template <class Format>
void block_matmul_widened(uint16_t* y, const uint16_t* x, const uint8_t* codes,
                          const float* scale, const float* minimum, int64_t rows, int64_t n_out,
                          int64_t k, int64_t x_stride, int num_threads) {
  std::vector<float> xf(rows * k), yf(rows * n_out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; i += conveyor::kLanes)  // k: a multiple of 32
      conveyor::store(conveyor::load(x + r * x_stride + i), xf.data() + r * k + i);
  blocks_gemm<Format, F32Activations>(yf.data(), xf.data(), codes, scale, minimum, rows, n_out,
                                       k, k, num_threads);
  for (int64_t i = 0; i < rows * n_out; ++i) conveyor::store(yf[i], y + i);
}

// x and y in float32 or bf16 (uint16_t), the activation path picked by type.
template <class Format>
void multiply(float* y, const float* x, const uint8_t* codes, const float* scale,
              const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
              int num_threads) {
  blocks_gemm<Format, F32Activations>(y, x, codes, scale, minimum, rows, n_out, k, x_stride,
                                      num_threads);
}

template <class Format>
void multiply(uint16_t* y, const uint16_t* x, const uint8_t* codes, const float* scale,
              const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
              int num_threads) {
#ifdef __AVX512BF16__
  blocks_gemm<Format, BF16Activations>(y, x, codes, scale, minimum, rows, n_out, k, x_stride,
                                       num_threads);
#else
  block_matmul_widened<Format>(y, x, codes, scale, minimum, rows, n_out, k, x_stride,
                               num_threads);
#endif
}

template <typename T>
void multiply_blocks(T* y, const T* x, const uint8_t* codes, const float* scale,
                     const float* minimum, int64_t rows, int64_t n_out, int64_t k,
                     int64_t x_stride, int num_threads) {
  if (minimum)
    multiply<Q4>(y, x, codes, scale, minimum, rows, n_out, k, x_stride, num_threads);
  else
    multiply<Q8>(y, x, codes, scale, minimum, rows, n_out, k, x_stride, num_threads);
}

}  // namespace

namespace conveyor {

void block_matmul(float* y, const float* x, const uint8_t* codes, const float* scale,
                  const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
                  int num_threads) {
  multiply_blocks(y, x, codes, scale, minimum, rows, n_out, k, x_stride, num_threads);
}

void block_matmul(uint16_t* y, const uint16_t* x, const uint8_t* codes, const float* scale,
                  const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
                  int num_threads) {
  multiply_blocks(y, x, codes, scale, minimum, rows, n_out, k, x_stride, num_threads);
}

}  // namespace conveyor

// y = x @ W^T for a few float32 rows x and a weight W kept as a GGUF file's blocks (CPU).
//
// W [N, K] is stored in blocks of 32 weights along K, as GGUF stores them:
//
// * 4-bit (Q4_0 / Q4_1): 16 bytes of codes per block (byte j holds q[j] in its low nibble and
//   q[j + 16] in its high one), a scale d and a minimum m: w = d * q + m, q in 0..15;
// * 8-bit (Q8_0): 32 signed bytes per block and a scale d: w = d * q, q in -128..127.
//
// Per output and block, sum_j w_j x_j = d * sum_j q_j x_j (+ m * sum_j x_j), so the codes become
// floats once and feed one multiply-add per row; the block sums of x are computed once per
// call. At one to a few rows a matmul is bound by reading W, and these blocks are 0.75 (4-bit)
// or 1.06 (8-bit) bytes per weight against float32's 4. Threads split the outputs.
//
// Built and loaded like paged_attention.cpp; K is a multiple of 32 (the Python side
// checks).

#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch.h"

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
};

// Output n's codes, scales and minima into the cache ahead of their use. The hardware
// prefetcher follows the three streams less far: the 8-bit lm_head at one row ran 1.1-1.2x
// faster so, the 4-bit layers 1.0-1.03x (docs/performance.md, change 26).
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

template <class Format, int R>
void block_rows(float* y, const float* x, const float* x_sums, const uint8_t* codes,
                const float* scale, const float* minimum, int64_t n_out, int64_t k,
                int64_t x_stride, int64_t y_stride, int num_threads) {
  const int64_t blocks = k / kBlock;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < n_out; ++n) {
    const uint8_t* c = codes + n * blocks * Format::kBytes;
    const float* d = scale + n * blocks;
    if (n + kPrefetchRows < n_out)
      prefetch_row<Format>(codes, scale, minimum, n + kPrefetchRows, blocks);
    v8f acc[R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      v8f q[4];
      Format::codes(c + b * Format::kBytes, q);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * x_stride + b * kBlock;
        const v8f dot = (q[0] * load8(xb) + q[1] * load8(xb + 8)) +
                        (q[2] * load8(xb + 16) + q[3] * load8(xb + 24));
        acc[r] += d[b] * dot;
      }
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
      y[r * y_stride + n] = hsum8(acc[r]) + min_term;
    }
  }
}

template <class Format>
void block_matmul(float* y, const float* x, const uint8_t* codes, const float* scale,
                  const float* minimum, int64_t rows, int64_t n_out, int64_t k, int64_t x_stride,
                  int num_threads) {
  const int64_t blocks = k / kBlock;
  std::vector<float> x_sums(Format::kHasMin ? rows * blocks : 0);
  if constexpr (Format::kHasMin)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * x_stride + b * kBlock;
        x_sums[r * blocks + b] = hsum8(load8(xb) + load8(xb + 8) + load8(xb + 16) + load8(xb + 24));
      }
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t r = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
    float* yr = y + r0 * n_out;
    const float* xr = x + r0 * x_stride;
    const float* sr = x_sums.data() + (Format::kHasMin ? r0 * blocks : 0);
    conveyor::with_constant<kMaxRows>(r, [&](auto rows) {
      block_rows<Format, decltype(rows)::value>(yr, xr, sr, codes, scale, minimum, n_out, k,
                                                x_stride, n_out, num_threads);
    });
  }
}

}  // namespace

// codes: [N, K / 2] bytes (4-bit) or [N, K] (8-bit); scale and minimum: [N, K / 32] floats
// (minimum unused for 8-bit).
extern "C" void block_matmul_f32(float* y, const float* x, const uint8_t* codes, const float* scale,
                                 const float* minimum, int64_t rows, int64_t n_out, int64_t k,
                                 int64_t x_stride, int bits, int num_threads) {
  if (bits == 4)
    block_matmul<Q4>(y, x, codes, scale, minimum, rows, n_out, k, x_stride, num_threads);
  else
    block_matmul<Q8>(y, x, codes, scale, minimum, rows, n_out, k, x_stride, num_threads);
}

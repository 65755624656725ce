// y = x @ W^T for a few float32 rows x and a weight W kept as 4-bit blocks (CPU).
//
// W [N, K] is stored as a GGUF Q4_0 / Q4_1 file stores it: blocks of 32 weights along K, each
// 16 bytes of codes (byte j holds q[j] in its low nibble and q[j + 16] in its high one) and a
// scale d and minimum m, so that w = d * q + m. Per output and block,
//
//   sum_j w_j x_j = d * sum_j q_j x_j + m * sum_j x_j
//
// so the codes become floats once and feed one multiply-add per row; the block sums of x are
// computed once per call. At one to a few rows a matmul is bound by reading W, and these blocks
// are 0.75 bytes per weight against float32's 4. Threads split the outputs.
//
// Built and loaded like paged_decode_attention.cpp; K is a multiple of 32 (the Python side
// checks).

#include <cstdint>
#include <cstring>
#include <vector>


namespace {

// 8-float vectors, not vec.h's 16: this loop keeps 4 + R of them live, and GCC 12 spills 16-wide
// ones to the stack on AVX2 (4x slower here). 8 lanes are native on AVX2 and AVX-512 alike.
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v4u __attribute__((vector_size(16)));

constexpr int kBlock = 32;
constexpr int kMaxRows = 4;  // rows sharing one pass over W (their accumulators stay in registers)
const v8u kShift = {0, 8, 16, 24, 0, 8, 16, 24};

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Codes j..j+7 of a block as floats: byte j into 32-bit lane j (words to lanes, then a shift per
// lane), the low or the high nibble. (GCC 12 turns a uint8 -> float vector conversion into
// scalar ones.)
inline v8f nibbles(v8u spread, int high) {
  return __builtin_convertvector(v8i((spread >> (kShift + 4 * high)) & 0xF), v8f);
}

template <int R>
void q4_rows(float* y, const float* x, const float* x_sums, const uint8_t* codes,
             const float* scale, const float* minimum, int64_t n_out, int64_t k, int64_t x_stride,
             int64_t y_stride, int num_threads) {
  const int64_t blocks = k / kBlock;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < n_out; ++n) {
    const uint8_t* c = codes + n * (k / 2);
    const float* d = scale + n * blocks;
    const float* m = minimum + n * blocks;
    v8f acc[R] = {};
    float min_acc[R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      v4u words;
      std::memcpy(&words, c + b * (kBlock / 2), sizeof words);
      const v8u first = __builtin_shufflevector(words, words, 0, 0, 0, 0, 1, 1, 1, 1);  // bytes 0-7
      const v8u second = __builtin_shufflevector(words, words, 2, 2, 2, 2, 3, 3, 3, 3);  // 8-15
      const v8f q0 = nibbles(first, 0), q1 = nibbles(second, 0);
      const v8f q2 = nibbles(first, 1), q3 = nibbles(second, 1);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * x_stride + b * kBlock;
        const v8f dot = (q0 * load8(xb) + q1 * load8(xb + 8)) +
                        (q2 * load8(xb + 16) + q3 * load8(xb + 24));
        acc[r] += d[b] * dot;
        min_acc[r] += m[b] * x_sums[r * blocks + b];
      }
    }
    for (int r = 0; r < R; ++r) y[r * y_stride + n] = hsum8(acc[r]) + min_acc[r];
  }
}

}  // namespace

extern "C" void q4_matmul_f32(float* y, const float* x, const uint8_t* codes, const float* scale,
                              const float* minimum, int64_t rows, int64_t n_out, int64_t k,
                              int64_t x_stride, int num_threads) {
  const int64_t blocks = k / kBlock;
  std::vector<float> x_sums(rows * blocks);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      x_sums[r * blocks + b] = hsum8(load8(x + r * x_stride + b * kBlock) +
                                     load8(x + r * x_stride + b * kBlock + 8) +
                                     load8(x + r * x_stride + b * kBlock + 16) +
                                     load8(x + r * x_stride + b * kBlock + 24));
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t r = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
    float* yr = y + r0 * n_out;
    const float* xr = x + r0 * x_stride;
    const float* sr = x_sums.data() + r0 * blocks;
    switch (r) {
      case 1: q4_rows<1>(yr, xr, sr, codes, scale, minimum, n_out, k, x_stride, n_out, num_threads); break;
      case 2: q4_rows<2>(yr, xr, sr, codes, scale, minimum, n_out, k, x_stride, n_out, num_threads); break;
      case 3: q4_rows<3>(yr, xr, sr, codes, scale, minimum, n_out, k, x_stride, n_out, num_threads); break;
      default: q4_rows<4>(yr, xr, sr, codes, scale, minimum, n_out, k, x_stride, n_out, num_threads); break;
    }
  }
}

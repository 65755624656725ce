// LoRA adapters' updates added to a projection's output, each row (token) under its own adapter
// (CPU): the batched per-row shape of Punica's "BGMV".
//
//   y[t] += (a[s] @ x[t]) @ b[s],  s = slots[t], over the first `width` of the stacks' R rows
//
//   a:     [num_slots, R, in] float32 (row r: the r-th row of the adapter's A)
//   b:     [num_slots, R, out] float32 (row r: the r-th column of its B, the scale folded in)
//   slots: [rows] int32; rows of slot 0 (the base model) are left untouched
//   x:     [rows, in] (row stride ldx), y: [rows, out] contiguous, both float, bf16 (uint16_t)
//          or fp16 (Half); the products run in float32 and y is rounded to its type once.
//
// Each row's arithmetic is fixed whatever else is in the call, so that a token's bits do not
// depend on its batch (deterministic inference): the shrink u[r] = a[s, r] . x[t] sums kLanes
// partial sums along `in`, in order, then hsum; the expand adds u[r] b[s, r, j] for r = 0 ..
// width - 1, in order, from zero, then adds that to y[t, j]. Rows of one slot go in groups that
// share each load of the stacks, and threads split the groups' rank blocks (shrink) and column
// blocks (expand): neither changes what any one row computes.
//
// Entry point in lora.h; in and out are multiples of kLanes (ops.cpp checks).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "lora.h"
#include "vec.h"

namespace conveyor {

inline float float_of_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

inline uint32_t bits_of_float(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof w);
  return w;
}

// fp16 <-> float one element at a time, rounding to nearest even with subnormals, infinities and
// NaN kept (the FP16 library's bit arithmetic, as c10::Half's): for CPUs without F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u, two_w = w + w;
  const float normalized = float_of_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = float_of_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return float_of_bits(sign | bits_of_float(two_w < (1u << 27) ? subnormal : normalized));
}

inline uint16_t float_to_half(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits_of_float(f);
  const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = float_of_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of_float(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline vfloat load(const Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<vfloat>(
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = half_to_float(p[i].bits);
  return v;
#endif
}

inline void store(vfloat v, Half* p) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < kLanes; ++i) p[i].bits = float_to_half(v[i]);
#endif
}

}  // namespace conveyor

namespace {

using namespace conveyor;

constexpr int kLoraGroupRows = 4;  // rows of one slot sharing each load of its stacks
// Per task: ranks of a shrink, vectors of columns of an expand (kLoraGroupRows times this many
// accumulators: 16 of AVX-512's 32 registers, 8 of AVX2's 16).
constexpr int kLoraRanks = kLanes == 16 ? 4 : 2;
constexpr int kLoraVectors = kLanes == 16 ? 4 : 2;
constexpr int64_t kLoraParallelWork = 1 << 17;  // multiply-adds below which one thread is faster

struct LoraGroup {  // rows order[first, first + count), all of slot `slot`
  int64_t first;
  int32_t count;
  int32_t slot;
};

// u[g][r] = a[r] . x[g] for G rows and R of a's rows, each over `in`.
template <int G, int R, typename T>
inline void lora_shrink(float* const* u, const T* const* x, const float* a, int64_t in) {
  vfloat acc[G][R] = {};
  for (int64_t k = 0; k < in; k += kLanes) {
    vfloat av[R];
    for (int r = 0; r < R; ++r) av[r] = load(a + r * in + k);
    for (int g = 0; g < G; ++g) {
      const vfloat xv = load(x[g] + k);
      for (int r = 0; r < R; ++r) acc[g][r] += xv * av[r];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) u[g][r] = hsum(acc[g][r]);
}

// y[g][0, V kLanes) += sum over r < width of u[g][r] b[r][0, V kLanes), for G rows; b's rows are
// `out` apart.
template <int G, int V, typename T>
inline void lora_expand(T* const* y, const float* const* u, const float* b, int64_t out,
                        int64_t width) {
  vfloat acc[G][V] = {};
  for (int64_t r = 0; r < width; ++r) {
    vfloat bv[V];
    for (int v = 0; v < V; ++v) {
      bv[v] = load(b + r * out + v * kLanes);
      // The stacks come from memory in a decode step (every layer's adapters are read once),
      // and the prefetchers do not follow `width` rows read a few lines at a time.
      __builtin_prefetch(b + r * out + (V + v) * kLanes);
    }
    for (int g = 0; g < G; ++g) {
      const vfloat ur = u[g][r] - vfloat{};  // a broadcast (see F32::broadcast)
      for (int v = 0; v < V; ++v) acc[g][v] += ur * bv[v];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) store(load(y[g] + v * kLanes) + acc[g][v], y[g] + v * kLanes);
}

}  // namespace

namespace conveyor {

template <typename T>
void lora_apply(T* y, const T* x, int64_t ldx, const float* a, const float* b,
                const int32_t* slots, int64_t rows, int64_t in, int64_t out, int64_t num_slots,
                int64_t rank, int64_t width, int num_threads) {
  if (width <= 0 || rows <= 0) return;
  // The rows under an adapter, slot by slot (a counting sort), then in groups.
  thread_local std::vector<int64_t> count, order;
  thread_local std::vector<LoraGroup> groups;
  thread_local std::vector<float> shrunk;  // [rows, width]: u of each row
  count.assign(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) ++count[slots[t] + 1];
  for (int64_t s = 1; s <= num_slots; ++s) count[s] += count[s - 1];
  const int64_t active = rows - count[1];
  if (active == 0) return;
  order.resize(rows);
  for (int64_t t = 0; t < rows; ++t) order[count[slots[t]]++] = t;  // count[s]: slot s's end
  groups.clear();
  for (int64_t i = rows - active, end; i < rows; i = end) {
    const int32_t slot = slots[order[i]];
    end = i;
    while (end < rows && end - i < kLoraGroupRows && slots[order[end]] == slot) ++end;
    groups.push_back({i, static_cast<int32_t>(end - i), slot});
  }
  float* u = at_least(shrunk, rows * width);
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  const int64_t rank_blocks = (width + kLoraRanks - 1) / kLoraRanks;
  const int64_t column_blocks = (out / kLanes + kLoraVectors - 1) / kLoraVectors;
  const int64_t* rows_of = order.data();
  const LoraGroup* group_of = groups.data();
#pragma omp parallel num_threads(num_threads) if (active * width * (in + out) >= kLoraParallelWork)
  {
    // Tasks go group by group, a thread's in one range: it streams through a[s, :width]
    // (contiguous), then along b[s]'s rows.
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_groups * rank_blocks; ++task) {
      const LoraGroup& g = group_of[task / rank_blocks];
      const int64_t r0 = task % rank_blocks * kLoraRanks;
      const T* xs[kLoraGroupRows];
      float* us[kLoraGroupRows];
      for (int i = 0; i < g.count; ++i) {
        const int64_t t = rows_of[g.first + i];
        xs[i] = x + t * ldx;
        us[i] = u + t * width + r0;
      }
      const float* ar = a + (g.slot * rank + r0) * in;
      with_constant<kLoraGroupRows>(g.count, [&](auto rows_c) {
        with_constant<kLoraRanks>(std::min<int64_t>(kLoraRanks, width - r0), [&](auto ranks_c) {
          lora_shrink<decltype(rows_c)::value, decltype(ranks_c)::value>(us, xs, ar, in);
        });
      });
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_groups * column_blocks; ++task) {
      const LoraGroup& g = group_of[task / column_blocks];
      const int64_t j = task % column_blocks * kLoraVectors * kLanes;
      T* ys[kLoraGroupRows];
      const float* us[kLoraGroupRows];
      for (int i = 0; i < g.count; ++i) {
        const int64_t t = rows_of[g.first + i];
        ys[i] = y + t * out + j;
        us[i] = u + t * width;
      }
      const float* bj = b + g.slot * rank * out + j;
      with_constant<kLoraGroupRows>(g.count, [&](auto rows_c) {
        with_constant<kLoraVectors>(std::min<int64_t>(kLoraVectors, (out - j) / kLanes),
                                    [&](auto vectors_c) {
          lora_expand<decltype(rows_c)::value, decltype(vectors_c)::value>(ys, us, bj, out,
                                                                           width);
        });
      });
    }
  }
}

template void lora_apply<float>(float*, const float*, int64_t, const float*, const float*,
                                const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                int64_t, int);
template void lora_apply<uint16_t>(uint16_t*, const uint16_t*, int64_t, const float*,
                                   const float*, const int32_t*, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, int);
template void lora_apply<Half>(Half*, const Half*, int64_t, const float*, const float*,
                               const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int);

}  // namespace conveyor

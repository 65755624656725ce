// The decoder layer's elementwise steps, each one pass over memory (CPU).
//
// In eager torch each of these is 3-8 ops, each reading and writing the whole activation; on a
// 4096-token prefill that is most of a layer's time outside the matmuls. Results are rounded to
// T wherever eager torch rounds (between its ops), so bf16 outputs match the eager path.
//
//   rms_norm:  [residual += x;] out = weight * T(h * rsqrt(mean(h^2) + eps)), h = residual or x
//   silu_mul:  out = T(silu(gate)) * up, gate_up = [gate | up] per row
//   gelu_tanh_mul: out = T(gelu_tanh(gate)) * up, as silu_mul (Gemma's MLP), where
//              gelu_tanh(g) = g/2 (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), is computed
//              as g / (1 + exp(-2u)), the same function (1 + tanh(u) = 2 / (1 + exp(-2u)))
//              on silu_mul's exp, without tanh's cancellation where u is very negative
//   rotary:    out = T(x * cos) + T(rotate_half(x) * sin), per head ("rotate_half" layout);
//              out may be x (each pair of halves is read before it is written)
//   argmax:    out[r] = the first index of row r's largest value (greedy sampling; a NaN
//              counts as the largest, as in torch.max)
//
// Rows are spread over OpenMP threads when there are enough of them. Widths are multiples of
// kLanes (ops.cpp checks). Entry points in fused_ops.h.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fused_ops.h"
#include "vec.h"

namespace {

constexpr int64_t kParallelElements = 1 << 14;  // below this, threads cost more than they save

}  // namespace

namespace conveyor {

template <typename T>
void rms_norm(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t dim,
              int64_t x_stride, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* res = residual ? residual + r * dim : nullptr;
    vfloat sq{};
    for (int64_t c = 0; c < dim; c += kLanes) {
      vfloat h = load(xr + c);
      if (res) {
        h = rounded(h + load(res + c), xr);
        store(h, res + c);
      }
      sq += h * h;
    }
    const float scale = 1.f / std::sqrt(hsum(sq) / dim + eps);
    const T* src = res ? res : xr;
    for (int64_t c = 0; c < dim; c += kLanes)
      store(load(weight + c) * rounded(load(src + c) * scale, src), out + r * dim + c);
  }
}

template <typename T>
void silu_mul(T* out, const T* gate_up, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inter;
    T* o = out + r * inter;
    // Eight vectors at a time, so that their exps (long dependency chains) overlap.
    in_batches<8>(inter, [&](int64_t c, auto batch) {
      constexpr int B = decltype(batch)::value;
      vfloat gv[B], e[B];
      for (int i = 0; i < B; ++i) {
        gv[i] = load(g + c + i * kLanes);
        e[i] = vexp(-gv[i]);
      }
      for (int i = 0; i < B; ++i)
        store(rounded(gv[i] / (1.f + e[i]), g) * load(g + inter + c + i * kLanes),
              o + c + i * kLanes);
    });
  }
}

template <typename T>
void gelu_tanh_mul(T* out, const T* gate_up, int64_t rows, int64_t inter, int num_threads) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi), as torch's kernel has it
  constexpr float kKappa = 0.044715f;
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inter;
    T* o = out + r * inter;
    in_batches<8>(inter, [&](int64_t c, auto batch) {  // exps overlap, as in silu_mul
      constexpr int B = decltype(batch)::value;
      vfloat gv[B], e[B];
      for (int i = 0; i < B; ++i) {
        gv[i] = load(g + c + i * kLanes);
        const vfloat u = (gv[i] + kKappa * (gv[i] * gv[i] * gv[i])) * kBeta;
        e[i] = vexp(u * -2.f);
      }
      for (int i = 0; i < B; ++i)
        store(rounded(gv[i] / (1.f + e[i]), g) * load(g + inter + c + i * kLanes),
              o + c + i * kLanes);
    });
  }
}

template <typename T>
void rotary(T* out, const T* x, const T* cos, const T* sin, int64_t rows, int64_t heads,
            int64_t head_dim, int64_t x_stride, int64_t out_stride, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* cr = cos + r * head_dim;
    const T* sr = sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + r * x_stride + h * head_dim;
      T* oh = out + r * out_stride + h * head_dim;
      for (int64_t c = 0; c < half; c += kLanes) {
        const vfloat lo = load(xh + c), hi = load(xh + half + c);  // out may be x
        // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin
        store(rounded(lo * load(cr + c), xh) + rounded(-hi * load(sr + c), xh), oh + c);
        store(rounded(hi * load(cr + half + c), xh) + rounded(lo * load(sr + half + c), xh),
              oh + half + c);
      }
    }
  }
}

template <typename T>
void argmax(int64_t* out, const T* x, int64_t rows, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * width >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * width;
    vfloat top = load(xr);  // lane-wise maxima, then the first index that holds the maximum
    vint nan = top != top;
    for (int64_t c = kLanes; c < width; c += kLanes) {
      const vfloat v = load(xr + c);
      top = v > top ? v : top;
      nan |= v != v;
    }
    bool any_nan = false;
    float best = top[0];
    for (int i = 0; i < kLanes; ++i) {
      any_nan |= nan[i] != 0;
      best = top[i] > best ? top[i] : best;
    }
    const vfloat wanted = vfloat{} + best;
    const vint none{};
    int64_t at = -1;
    for (int64_t c = 0; c < width && at < 0; c += kLanes) {
      const vfloat v = load(xr + c);
      const vint hit = any_nan ? v != v : v == wanted;
      if (std::memcmp(&hit, &none, sizeof hit) == 0) continue;  // no lane of this vector
      for (int i = 0; i < kLanes && at < 0; ++i)
        if (hit[i]) at = c + i;
    }
    out[r] = at;
  }
}

template void rms_norm<float>(float*, const float*, float*, const float*, int64_t, int64_t,
                             int64_t, float, int);
template void rms_norm<uint16_t>(uint16_t*, const uint16_t*, uint16_t*, const uint16_t*, int64_t,
                                int64_t, int64_t, float, int);
template void silu_mul<float>(float*, const float*, int64_t, int64_t, int);
template void silu_mul<uint16_t>(uint16_t*, const uint16_t*, int64_t, int64_t, int);
template void gelu_tanh_mul<float>(float*, const float*, int64_t, int64_t, int);
template void gelu_tanh_mul<uint16_t>(uint16_t*, const uint16_t*, int64_t, int64_t, int);
template void rotary<float>(float*, const float*, const float*, const float*, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int);
template void rotary<uint16_t>(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*,
                               int64_t, int64_t, int64_t, int64_t, int64_t, int);
template void argmax<float>(int64_t*, const float*, int64_t, int64_t, int);
template void argmax<uint16_t>(int64_t*, const uint16_t*, int64_t, int64_t, int);

}  // namespace conveyor

// The decoder layer's fused elementwise steps (fused_ops.cpp): T is float, or bf16 stored as
// uint16_t; widths are multiples of kLanes.

#pragma once

#include <cstdint>

namespace conveyor {

// [residual += x;] out = weight * T(h * rsqrt(mean(h^2) + eps)), h = residual (when given) or x;
// x's rows x_stride apart, the others' dim.
template <typename T>
void rms_norm(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t dim,
              int64_t x_stride, float eps, int num_threads);

// out [rows, inter] = T(silu(gate)) * up, gate_up [rows, 2 * inter] = [gate | up] per row.
template <typename T>
void silu_mul(T* out, const T* gate_up, int64_t rows, int64_t inter, int num_threads);

// out [rows, inter] = T(gelu_tanh(gate)) * up (Gemma's gating), gate_up as silu_mul's.
template <typename T>
void gelu_tanh_mul(T* out, const T* gate_up, int64_t rows, int64_t inter, int num_threads);

// Each head of each row rotated ("rotate_half" layout) by its row's cos and sin [rows,
// head_dim]; out may be x.
template <typename T>
void rotary(T* out, const T* x, const T* cos, const T* sin, int64_t rows, int64_t heads,
            int64_t head_dim, int64_t x_stride, int64_t out_stride, int num_threads);

// out[r] = the first index of row r's largest value (a NaN counts as the largest).
template <typename T>
void argmax(int64_t* out, const T* x, int64_t rows, int64_t width, int num_threads);

}  // namespace conveyor

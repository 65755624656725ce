// LoRA adapters' per-row updates (lora.cpp). T is float, bf16 stored as uint16_t, or fp16 (Half).

#pragma once

#include <cstdint>

namespace conveyor {

struct Half {  // an IEEE fp16 element: its own type, as uint16_t stands for bf16
  uint16_t bits;
};

// y[t] += (a[s] @ x[t]) @ b[s], s = slots[t] (0: untouched), over the first `width` of the
// stacks' `rank` rows: a [num_slots, rank, in], b [num_slots, rank, out] float32; x [rows, in]
// (row stride ldx), y [rows, out] contiguous.
template <typename T>
void lora_apply(T* y, const T* x, int64_t ldx, const float* a, const float* b,
                const int32_t* slots, int64_t rows, int64_t in, int64_t out, int64_t num_slots,
                int64_t rank, int64_t width, int num_threads);

}  // namespace conveyor

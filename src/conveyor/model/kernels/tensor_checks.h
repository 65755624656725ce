// The checks every torch entry point makes of its tensors before a raw kernel call (defined in
// ops.cpp, used there and by decode_layers_op.cpp): each fails with a RuntimeError naming the
// argument, so that a mismatch never reaches the kernels' pointer arithmetic. Only the
// translation units that include torch's headers include this one.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "int8_blocks.h"
#include "quant_panels.h"

namespace conveyor::ops {

using at::ScalarType;
using at::Tensor;

const char* dtype_name(ScalarType t);
void check_dtype(const Tensor& t, const char* name, ScalarType want);
void check_cpu(const Tensor& t, const char* name);
void check_contiguous(const Tensor& t, const char* name);
void check_shape(const Tensor& t, const char* name, at::IntArrayRef shape);
// A CPU tensor of `want`, `shape` and contiguous: a weight or an index tensor.
void check_tensor(const Tensor& t, const char* name, ScalarType want, at::IntArrayRef shape);
// Activations: float32, or bf16 (handed to the kernels as uint16_t).
void check_activation_dtype(const Tensor& t, const char* name);
void check_multiple(int64_t value, int64_t of, const char* what);
// Rows with unit stride: 2-D, the last dimension packed (a row stride is passed on).
Tensor unit_stride_rows(const Tensor& x, const char* name);
void check_like(const Tensor& t, const char* name, const Tensor& x, at::IntArrayRef shape);

// The weight layouts of the matmul kernels, of an [n, k] weight (`prefix` names it).
void check_panels(const Tensor& packed, const char* name, ScalarType dtype, int64_t n, int64_t k);
void check_block_panels(const Tensor& codes, const Tensor& scale,
                        const std::optional<Tensor>& minimum, const char* prefix, ScalarType dtype,
                        int64_t n, int64_t k);
void check_blocks(const Tensor& codes, const Tensor& scale, const std::optional<Tensor>& minimum,
                  const char* prefix, int64_t k);
QuantLayout check_quant_panels(int64_t format, const Tensor& codes, const Tensor& header,
                               const char* prefix, int64_t n, int64_t k);
std::vector<Int8BlockPart> int8_block_parts(const std::vector<int64_t>& formats,
                                            const std::vector<Tensor>& blocks,
                                            const std::vector<int64_t>& sizes, int64_t k,
                                            const std::string& prefix);

// cos or sin: a contiguous [rows, head_dim] or [rows, 1, head_dim] in x's dtype.
void check_angles(const Tensor& t, const char* name, const Tensor& x, int64_t rows,
                  int64_t head_dim);

struct CacheShape {
  int64_t num_blocks, block_size, num_kv_heads, head_dim;
};

CacheShape check_caches(const Tensor& k_cache, const Tensor& v_cache, const char* k_name,
                        const char* v_name);
// The index tensors of `tokens` query tokens over caches of `cache`'s shape, values included:
// every block, slot and sequence they name must exist (under a sliding `window`, the blocks
// from the window's first one on: the entries before it are never read).
void check_indices(const CacheShape& cache, int64_t tokens, const Tensor& block_tables,
                   const Tensor& context_lens, const std::optional<Tensor>& token_seqs,
                   const std::optional<Tensor>& slot_mapping, int64_t window = 0);

inline bool is_bf16(const Tensor& t) { return t.scalar_type() == at::kBFloat16; }
template <typename T>
T* data(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }
inline int threads() { return at::get_num_threads(); }

// Calls f with a null pointer of the activations' element type: float, or uint16_t for bf16.
template <typename F>
void with_type(const Tensor& t, F&& f) {
  if (is_bf16(t))
    f(static_cast<uint16_t*>(nullptr));
  else
    f(static_cast<float*>(nullptr));
}

}  // namespace conveyor::ops

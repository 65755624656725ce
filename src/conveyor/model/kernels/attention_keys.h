// KeyStream: a decode's next task's keys brought into L2 during this task's value pass, which
// reads from L2 and would otherwise leave memory idle.

#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace conveyor {

// A sequence's keys (KV heads [h0, h1) of its first `ctx` positions; a block stores a KV head's
// keys together, transposed: attention_tile.h) prefetched into L2 a block at a time:
// spread_over(n) paces them evenly over n calls of step(). Default-constructed, it prefetches
// nothing.
class KeyStream {
 public:
  KeyStream() = default;
  template <typename C>
  KeyStream(const C* k_cache, const int32_t* table, int64_t ctx, int64_t h0, int64_t h1,
            int64_t head_dim, int64_t block_size, int64_t token_stride)
      : cache_(reinterpret_cast<const char*>(k_cache + h0 * head_dim * block_size)),
        table_(table),
        blocks_((ctx + block_size - 1) / block_size),
        block_bytes_(token_stride * block_size * sizeof(C)),
        lines_(((h1 - h0) * head_dim * block_size * sizeof(C) + 63) / 64) {}

  void spread_over(int64_t steps) { per_step_ = steps > 0 ? (blocks_ + steps - 1) / steps : 0; }

  void step() {
    for (const int64_t end = std::min(blocks_, block_ + per_step_); block_ < end; ++block_) {
      const char* at = cache_ + table_[block_] * block_bytes_;
      for (int64_t line = 0; line < lines_; ++line) prefetch<2>(at + line * 64);
    }
  }

 private:
  const char* cache_ = nullptr;  // block 0's keys of KV head h0
  const int32_t* table_ = nullptr;
  int64_t blocks_ = 0, block_bytes_ = 0, lines_ = 0, per_step_ = 0;
  int64_t block_ = 0;  // the next block to fetch
};

}  // namespace conveyor

// Two rows of a bf16 matrix as the pairs vdpbf16ps multiplies (AVX512-BF16): a weighted sum of
// value rows, out += p_a a + p_z z, takes the rows interleaved by element, so that each 32-bit
// lane holds one dimension of both, against the weights' pair broadcast to every lane. Used by
// the decode (paged_attention.cpp) and prefill (attention_tile.h) attention kernels.
//
// Unpacking works within 128-bit lanes, so 32 dimensions come out as two vectors in a fixed
// permuted order (lo: dimension 8L + e, hi: 8L + 4 + e in lane 4L + e, e < 4); sums
// accumulated in that order are put back in order once, when stored.

#pragma once

#ifdef __AVX512BF16__

#include <immintrin.h>

#include <cstdint>

#include "vec.h"

namespace conveyor {

constexpr int kPairDims = 32;  // dimensions per pair of interleaved vectors

struct RowPairs {
  __m512bh lo, hi;
};

// Rows a and z, 32 dimensions each (z null: a row of zeros).
inline RowPairs interleave(const uint16_t* a, const uint16_t* z) {
  const __m512i x = _mm512_loadu_si512(a);
  const __m512i y = z ? _mm512_loadu_si512(z) : _mm512_setzero_si512();
  return {(__m512bh)_mm512_unpacklo_epi16(x, y), (__m512bh)_mm512_unpackhi_epi16(x, y)};
}

// 32 dimensions accumulated in interleave's order (lo, hi), stored in order.
inline void store_in_order(vfloat lo, vfloat hi, uint16_t* out) {
  // Dimension d: 128-bit lane L = d / 8, e = d % 8; lo lane 4L + e if e < 4, else hi lane
  // 4L + e - 4 (hi's lanes are numbered kLanes on in the shuffle).
  store(__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
        out);
  store(__builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                30, 31),
        out + kLanes);
}

}  // namespace conveyor

#endif  // __AVX512BF16__

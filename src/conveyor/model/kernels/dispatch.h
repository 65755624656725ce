// A runtime count made a compile-time constant, so that the loops it bounds unroll and their
// accumulators stay in registers: with_constant<N>(m, f) calls
// f(std::integral_constant<int, m>{}) for m in [1, N], and nothing otherwise.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace conveyor {

template <typename F, int... I>
inline void with_constant_among(int64_t m, F& f, std::integer_sequence<int, I...>) {
  ((m == I + 1 ? f(std::integral_constant<int, I + 1>{}) : void()), ...);
}

template <int N, typename F>
inline void with_constant(int64_t m, F&& f) {
  with_constant_among(m, f, std::make_integer_sequence<int, N>{});
}

}  // namespace conveyor

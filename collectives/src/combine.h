// Two values combined by a reduction, the same on the host (reduce.cc) and in the CUDA kernels
// (gpu/elementwise.cuh): integers wrap around (two's complement), u8 and u16 widened so that
// their product cannot overflow a signed int; avg sums (the caller divides). C++17, for nvcc.
#pragma once

#include <type_traits>

#include "r2ccl/coll/types.h"

#if defined(__CUDACC__)
#define R2CCL_COMBINE_INLINE __host__ __device__ __forceinline__
#else
#define R2CCL_COMBINE_INLINE [[gnu::always_inline]] inline
#endif

namespace r2ccl::coll {

template <RedOp Op, class T>
R2CCL_COMBINE_INLINE T combine(T a, T b) {
  if constexpr (Op == RedOp::kSum || Op == RedOp::kAvg) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  } else if constexpr (Op == RedOp::kProd) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
      return static_cast<T>(
          static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
    } else {
      return a * b;
    }
  } else if constexpr (Op == RedOp::kMin) {
    return b < a ? b : a;
  } else {
    return a < b ? b : a;
  }
}

}  // namespace r2ccl::coll

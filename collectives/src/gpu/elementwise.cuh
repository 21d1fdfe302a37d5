// Element arithmetic shared by the CUDA kernels (reduce.cu, nvlink.cu): half and bfloat16
// widened to float and rounded back to nearest-even; integers wrap around as on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "../combine.h"
#include "r2ccl/coll/types.h"

namespace r2ccl::coll::gpu::detail {

template <class T>
struct Acc {
  using type = T;
};
template <>
struct Acc<__half> {
  using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
};

template <class T>
__device__ __forceinline__ typename Acc<T>::type widen(T x) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return x;
}

template <class T>
__device__ __forceinline__ T narrow(typename Acc<T>::type x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else
    return x;
}

template <RedOp Op, class A>
__device__ __forceinline__ A apply(A a, A b) {
  return combine<Op>(a, b);
}

template <class T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load

template <class T>
struct Type {
  using type = T;
};

// Calls fn(Type<T>{}, std::integral_constant<RedOp, Op>{}) for the element type of
// `t` and the kernel's reduction for `op` (avg runs as a sum; the kernels divide when told).
template <class Fn>
cudaError_t dispatch(DataType t, RedOp op, Fn&& fn) {
  auto by_op = [&](auto type) -> cudaError_t {
    switch (op) {
      case RedOp::kSum:
      case RedOp::kAvg:
        return fn(type, std::integral_constant<RedOp, RedOp::kSum>{});
      case RedOp::kProd:
        return fn(type, std::integral_constant<RedOp, RedOp::kProd>{});
      case RedOp::kMin:
        return fn(type, std::integral_constant<RedOp, RedOp::kMin>{});
      case RedOp::kMax:
        return fn(type, std::integral_constant<RedOp, RedOp::kMax>{});
    }
    return cudaErrorInvalidValue;
  };
  switch (t) {
    case DataType::kF32:
      return by_op(Type<float>{});
    case DataType::kF16:
      return by_op(Type<__half>{});
    case DataType::kBF16:
      return by_op(Type<__nv_bfloat16>{});
    case DataType::kF64:
      return by_op(Type<double>{});
    case DataType::kI32:
      return by_op(Type<std::int32_t>{});
    case DataType::kI64:
      return by_op(Type<std::int64_t>{});
    case DataType::kU8:
      return by_op(Type<std::uint8_t>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace r2ccl::coll::gpu::detail

// The reduction kernels: one grid-stride loop per (type, reduction), 16 bytes per thread and
// step where every pointer is aligned to it, element by element otherwise and for the tail.
#include <cstdint>
#include <type_traits>

#include "elementwise.cuh"
#include "launch.h"

namespace r2ccl::coll::gpu::detail {
namespace {

template <class T, RedOp Op>
__device__ __forceinline__ typename Acc<T>::type element(const ReduceArgs& a, std::size_t i) {
  using A = typename Acc<T>::type;
  A acc = widen(static_cast<const T*>(a.src[0])[i]);
  for (int k = 1; k < a.n; ++k)
    acc = apply<Op>(acc, widen(static_cast<const T*>(a.src[k])[i]));
  if constexpr (std::is_floating_point_v<A>) {
    if (a.divide_by > 0) acc = acc / static_cast<A>(a.divide_by);
  }
  return acc;
}

template <class T, RedOp Op>
__global__ void reduce_kernel(ReduceArgs a) {
  using A = typename Acc<T>::type;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t done = 0;
  if (a.vector) {
    const std::size_t packs = a.count / kPack<T>;
    for (std::size_t p = tid; p < packs; p += stride) {
      T e[kPack<T>];
      uint4 v = static_cast<const uint4*>(a.src[0])[p];
      memcpy(e, &v, sizeof v);
      A acc[kPack<T>];
#pragma unroll
      for (int j = 0; j < kPack<T>; ++j)
        acc[j] = widen(e[j]);
      for (int k = 1; k < a.n; ++k) {
        v = static_cast<const uint4*>(a.src[k])[p];
        memcpy(e, &v, sizeof v);
#pragma unroll
        for (int j = 0; j < kPack<T>; ++j)
          acc[j] = apply<Op>(acc[j], widen(e[j]));
      }
#pragma unroll
      for (int j = 0; j < kPack<T>; ++j) {
        if constexpr (std::is_floating_point_v<A>) {
          if (a.divide_by > 0) acc[j] = acc[j] / static_cast<A>(a.divide_by);
        }
        e[j] = narrow<T>(acc[j]);
      }
      memcpy(&v, e, sizeof v);
      static_cast<uint4*>(a.dst)[p] = v;
    }
    done = packs * kPack<T>;
  }
  for (std::size_t i = done + tid; i < a.count; i += stride)
    static_cast<T*>(a.dst)[i] = narrow<T>(element<T, Op>(a, i));
}

template <class T, RedOp Op>
cudaError_t launch(const ReduceArgs& a, cudaStream_t stream) {
  constexpr unsigned kThreads = 512;
  constexpr std::size_t kMaxBlocks = 1024;  // the grid-stride loop covers the rest
  const std::size_t units = a.vector ? (a.count + kPack<T> - 1) / kPack<T> : a.count;
  std::size_t blocks = (units + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks == 0) blocks = 1;
  reduce_kernel<T, Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reduce(const ReduceArgs& args, DataType t, RedOp op, cudaStream_t stream) {
  return dispatch(t, op, [&](auto type, auto red) {
    return launch<typename decltype(type)::type, decltype(red)::value>(args, stream);
  });
}

}  // namespace r2ccl::coll::gpu::detail

// The kernels' launchers (reduce.cu), behind the checks of reduce.cc. Private to r2ccl_coll_gpu;
// C++17, as the kernels are compiled (collectives/CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "r2ccl/coll/types.h"

namespace r2ccl::coll::gpu::detail {

inline constexpr int kReduceInputs = 8;  // gpu::kMaxInputs

struct ReduceArgs {
  void* dst = nullptr;
  const void* src[kReduceInputs] = {};
  int n = 0;
  std::size_t count = 0;
  int divide_by = 0;    // > 0: divide every result by it (float types)
  bool vector = false;  // every pointer is 16-byte aligned: 16-byte loads and stores
};

// Launches the kernel for `t` and `op` (checked by the caller: a supported pair, count > 0).
cudaError_t launch_reduce(const ReduceArgs& args, DataType t, RedOp op, cudaStream_t stream);

}  // namespace r2ccl::coll::gpu::detail

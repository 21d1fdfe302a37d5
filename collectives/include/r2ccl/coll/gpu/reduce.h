// Reduction kernels on device memory, stream-ordered: nothing is allocated, nothing waits on the
// host, so the calls can be captured in a CUDA graph. Element by element they give what the host
// kernels (r2ccl/coll/reduce.h) give: integers wrap around; half and bfloat16 are widened to
// float, reduced, and rounded to nearest-even once per result.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>

#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll::gpu {

// The most inputs one reduce_n call takes (a one-shot all-reduce over 8 GPUs reads 8 buffers).
inline constexpr std::size_t kMaxInputs = 8;

// dst[i] = srcs[0][i] op srcs[1][i] op ... for `count` elements, on `stream`. dst may be one of
// the inputs. Half and bfloat16 accumulate in float and are rounded once. With `divide_by` > 0
// (avg over that many ranks) the result is divided by it before it is stored; avg with
// `divide_by` 0 reduces as a sum. Inputs are read with 16-byte loads where every pointer is
// 16-byte aligned (element loads otherwise). Errors name what was wrong: no inputs or more than
// kMaxInputs, a null pointer with a non-zero count, avg on an integer type, a launch failure.
Status reduce_n(void* dst, std::span<const void* const> srcs, std::size_t count, DataType t,
                RedOp op, int divide_by, cudaStream_t stream);

// dst[i] = a[i] op b[i] (avg reduces as a sum: finish_avg divides at the end).
Status reduce(void* dst, const void* a, const void* b, std::size_t count, DataType t, RedOp op,
              cudaStream_t stream);

// buf[i] /= n (float types only; the last step of an avg).
Status finish_avg(void* buf, std::size_t count, DataType t, int n, cudaStream_t stream);

}  // namespace r2ccl::coll::gpu

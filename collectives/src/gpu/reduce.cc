#include "r2ccl/coll/gpu/reduce.h"

#include <fmt/format.h>

#include <cstdint>

#include "launch.h"
#include "r2ccl/coll/gpu/device.h"

namespace r2ccl::coll::gpu {

static_assert(kMaxInputs == detail::kReduceInputs);

Status reduce_n(void* dst, std::span<const void* const> srcs, std::size_t count, DataType t,
                RedOp op, int divide_by, cudaStream_t stream) {
  if (Status st = check_type_and_op(t, op); !st) return st.with_context("gpu reduce");
  if (srcs.empty() || srcs.size() > kMaxInputs)
    return {ErrorCode::kInvalidArgument,
            fmt::format("gpu reduce: {} inputs (1 to {})", srcs.size(), kMaxInputs)};
  if (divide_by < 0 || (divide_by > 0 && op != RedOp::kAvg))
    return {
        ErrorCode::kInvalidArgument,
        fmt::format("gpu reduce: divide by {} (only avg divides, by a positive count)", divide_by)};
  if (count == 0) return Status::ok();
  if (dst == nullptr)
    return {ErrorCode::kInvalidArgument,
            fmt::format("gpu reduce: the output is null (count {})", count)};
  detail::ReduceArgs a;
  a.dst = dst;
  a.n = static_cast<int>(srcs.size());
  a.count = count;
  a.divide_by = divide_by;
  bool aligned = reinterpret_cast<std::uintptr_t>(dst) % 16 == 0;
  for (std::size_t k = 0; k < srcs.size(); ++k) {
    if (srcs[k] == nullptr)
      return {ErrorCode::kInvalidArgument,
              fmt::format("gpu reduce: input {} is null (count {})", k, count)};
    a.src[k] = srcs[k];
    aligned = aligned && reinterpret_cast<std::uintptr_t>(srcs[k]) % 16 == 0;
  }
  a.vector = aligned;
  return cuda_status(detail::launch_reduce(a, t, op, stream),
                     fmt::format("gpu reduce of {} {} ({})", count, type_name(t), redop_name(op)));
}

Status reduce(void* dst, const void* a, const void* b, std::size_t count, DataType t, RedOp op,
              cudaStream_t stream) {
  const void* srcs[] = {a, b};
  return reduce_n(dst, srcs, count, t, op, 0, stream);
}

Status finish_avg(void* buf, std::size_t count, DataType t, int n, cudaStream_t stream) {
  if (n <= 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("gpu avg: divide by {} (a positive count of ranks)", n)};
  const void* srcs[] = {buf};
  return reduce_n(buf, srcs, count, t, RedOp::kAvg, n, stream);
}

}  // namespace r2ccl::coll::gpu

#include "r2ccl/coll/gpu/device.h"

#include <fmt/format.h>

namespace r2ccl::coll::gpu {

Status cuda_status(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::ok();
  ErrorCode code = ErrorCode::kInternal;
  switch (e) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidDevice:
      code = ErrorCode::kInvalidArgument;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorMemoryAllocation:
      code = ErrorCode::kUnavailable;
      break;
    default:
      break;
  }
  return {code, fmt::format("{}: {}", what, cudaGetErrorString(e))};
}

Status available() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return {ErrorCode::kUnavailable, fmt::format("no CUDA device: {}", cudaGetErrorString(e))};
  }
  if (n == 0) return {ErrorCode::kUnavailable, "no CUDA device: none found"};
  return Status::ok();
}

std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kPinnedHost:
      return "pinned host";
    case MemoryKind::kDevice:
      return "device";
    case MemoryKind::kManaged:
      return "managed";
  }
  return "unknown";
}

PointerInfo pointer_info(const void* p) {
  PointerInfo info;
  if (p == nullptr) return info;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky, but leave nothing behind for the caller's next check
    return info;
  }
  switch (a.type) {
    case cudaMemoryTypeHost:
      info.kind = MemoryKind::kPinnedHost;
      break;
    case cudaMemoryTypeDevice:
      info.kind = MemoryKind::kDevice;
      info.device = a.device;
      break;
    case cudaMemoryTypeManaged:
      info.kind = MemoryKind::kManaged;
      info.device = a.device;
      break;
    default:
      break;
  }
  return info;
}

}  // namespace r2ccl::coll::gpu

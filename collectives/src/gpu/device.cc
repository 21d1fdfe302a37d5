#include "r2ccl/coll/gpu/device.h"

#include <fmt/format.h>

#include <atomic>

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

namespace {

// The two driver calls has_context() needs, from the runtime's entry points (no link to libcuda).
using CtxGetCurrent = int (*)(void**);
using PrimaryCtxGetState = int (*)(int, unsigned*, int*);
struct Driver {
  CtxGetCurrent ctx_get_current = nullptr;
  PrimaryCtxGetState primary_state = nullptr;
  int devices = 0;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    if (cudaGetDeviceCount(&x.devices) != cudaSuccess) {
      (void)cudaGetLastError();
      x.devices = 0;
      return x;
    }
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      x.ctx_get_current = reinterpret_cast<CtxGetCurrent>(fn);
    fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                         cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      x.primary_state = reinterpret_cast<PrimaryCtxGetState>(fn);
    (void)cudaGetLastError();
    return x;
  }();
  return d;
}

}  // namespace

bool has_context() {
  // Contexts are not given back in a process that uses the GPU: once seen, always there.
  static std::atomic<bool> seen{false};
  if (seen.load(std::memory_order_relaxed)) return true;
  const Driver& d = driver();
  if (d.devices == 0) return false;
  // Without the entry points, assume a context may exist (the query then behaves as before).
  if (d.ctx_get_current == nullptr || d.primary_state == nullptr) return true;
  void* current = nullptr;
  bool found = d.ctx_get_current(&current) == 0 && current != nullptr;
  for (int dev = 0; dev < d.devices && !found; ++dev) {
    unsigned flags = 0;
    int active = 0;
    found = d.primary_state(dev, &flags, &active) == 0 && active != 0;
  }
  if (found) seen.store(true, std::memory_order_relaxed);
  return found;
}

CurrentDevice::CurrentDevice() {
  if (cudaGetDevice(&saved_) != cudaSuccess) {
    (void)cudaGetLastError();
    saved_ = -1;
  }
}

CurrentDevice::~CurrentDevice() {
  if (saved_ >= 0) (void)cudaSetDevice(saved_);
}

PointerInfo pointer_info(const void* p) {
  PointerInfo info;
  if (p == nullptr || !has_context()) return info;
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

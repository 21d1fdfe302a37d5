// CUDA memory for the KV benchmark and the KV engine's GPU test, through the driver loaded here
// with dlopen: what uses it builds without CUDA, and says plainly where there is no driver or
// no device. Device (cuMemAlloc) or managed (cuMemAllocManaged) memory on one GPU, filled and
// read back by synchronous copies.
#pragma once

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/runtime/status.h"

namespace r2ccl::bench {

class CudaBuffer {
 public:
  enum class Kind { kDevice, kManaged };

  // `bytes` of `kind` memory on GPU `device` (its primary context, made current here).
  static Result<std::unique_ptr<CudaBuffer>> make(int device, std::size_t bytes,
                                                  Kind kind = Kind::kDevice) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr)
      return Status(ErrorCode::kUnavailable, "no CUDA driver here (libcuda.so.1 does not load)");
    std::unique_ptr<CudaBuffer> b(new CudaBuffer(lib));
    if (!b->ok_)
      return Status(ErrorCode::kUnavailable, "the CUDA driver lacks a function this needs");
    int count = 0;
    R2CCL_RETURN_IF_ERROR(b->check(b->init_(0), "cuInit"));
    R2CCL_RETURN_IF_ERROR(b->check(b->count_(&count), "cuDeviceGetCount"));
    if (device < 0 || device >= count)
      return Status(ErrorCode::kUnavailable,
                    fmt::format("no CUDA device {} here ({} device(s))", device, count));
    R2CCL_RETURN_IF_ERROR(b->check(b->get_(&b->dev_, device), "cuDeviceGet"));
    R2CCL_RETURN_IF_ERROR(b->check(b->retain_(&b->ctx_, b->dev_), "cuDevicePrimaryCtxRetain"));
    b->retained_ = true;
    R2CCL_RETURN_IF_ERROR(b->check(b->set_(b->ctx_), "cuCtxSetCurrent"));
    if (kind == Kind::kDevice)
      R2CCL_RETURN_IF_ERROR(b->check(b->alloc_(&b->ptr_, bytes), "cuMemAlloc"));
    else
      R2CCL_RETURN_IF_ERROR(b->check(b->managed_(&b->ptr_, bytes, 1 /* CU_MEM_ATTACH_GLOBAL */),
                                     "cuMemAllocManaged"));
    b->bytes_ = bytes;
    return b;
  }

  ~CudaBuffer() {
    if (ptr_ != 0) free_(ptr_);
    if (retained_) release_(dev_);
    dlclose(lib_);
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  std::span<std::byte> span() const {
    return {reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(ptr_)), bytes_};
  }
  Status upload(std::span<const std::byte> host, std::size_t offset = 0) {
    if (offset > bytes_ || host.size() > bytes_ - offset)
      return {ErrorCode::kInvalidArgument, "upload past the end of the CUDA buffer"};
    return check(htod_(ptr_ + offset, host.data(), host.size()), "cuMemcpyHtoD");
  }
  Result<std::vector<std::byte>> download(std::size_t offset, std::size_t n) {
    if (offset > bytes_ || n > bytes_ - offset)
      return Status(ErrorCode::kInvalidArgument, "download past the end of the CUDA buffer");
    std::vector<std::byte> out(n);
    R2CCL_RETURN_IF_ERROR(check(dtoh_(out.data(), ptr_ + offset, n), "cuMemcpyDtoH"));
    return out;
  }

 private:
  using Ptr = unsigned long long;
  explicit CudaBuffer(void* lib) : lib_(lib) {
    ok_ = sym("cuInit", init_) && sym("cuDeviceGetCount", count_) && sym("cuDeviceGet", get_) &&
          sym("cuDevicePrimaryCtxRetain", retain_) &&
          sym("cuDevicePrimaryCtxRelease_v2", release_) && sym("cuCtxSetCurrent", set_) &&
          sym("cuMemAlloc_v2", alloc_) && sym("cuMemAllocManaged", managed_) &&
          sym("cuMemFree_v2", free_) && sym("cuMemcpyHtoD_v2", htod_) &&
          sym("cuMemcpyDtoH_v2", dtoh_);
  }
  template <typename F>
  bool sym(const char* name, F& fn) {
    fn = reinterpret_cast<F>(dlsym(lib_, name));
    return fn != nullptr;
  }
  Status check(int r, const char* what) const {
    if (r == 0) return Status::ok();
    return {ErrorCode::kUnavailable, fmt::format("{} failed: CUDA error {}", what, r)};
  }

  void* lib_;
  bool ok_ = false;
  int (*init_)(unsigned) = nullptr;
  int (*count_)(int*) = nullptr;
  int (*get_)(int*, int) = nullptr;
  int (*retain_)(void**, int) = nullptr;
  int (*release_)(int) = nullptr;
  int (*set_)(void*) = nullptr;
  int (*alloc_)(Ptr*, std::size_t) = nullptr;
  int (*managed_)(Ptr*, std::size_t, unsigned) = nullptr;
  int (*free_)(Ptr) = nullptr;
  int (*htod_)(Ptr, const void*, std::size_t) = nullptr;
  int (*dtoh_)(void*, Ptr, std::size_t) = nullptr;
  int dev_ = 0;
  void* ctx_ = nullptr;
  bool retained_ = false;
  Ptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace r2ccl::bench

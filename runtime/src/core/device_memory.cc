#include "r2ccl/runtime/device_memory.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

namespace r2ccl {

namespace {

// The driver API's types and values (cuda.h), so that the build needs no CUDA.
using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
using CUdevice = int;
constexpr CUresult kSuccess = 0;
constexpr int kAttrContext = 1;             // CU_POINTER_ATTRIBUTE_CONTEXT
constexpr int kAttrMemoryType = 2;          // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrIsManaged = 8;           // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr int kAttrDeviceOrdinal = 9;       // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;   // CU_MEMORYTYPE_DEVICE
constexpr unsigned kStreamNonBlocking = 1;  // CU_STREAM_NON_BLOCKING

struct Driver {
  CUresult (*get_attribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*push)(CUcontext) = nullptr;
  CUresult (*pop)(CUcontext*) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_sync)(CUstream) = nullptr;
  CUresult (*dtoh)(void*, CUdeviceptr, std::size_t, CUstream) = nullptr;
  CUresult (*htod)(CUdeviceptr, const void*, std::size_t, CUstream) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;

  std::string error(CUresult r) const {
    const char* text = nullptr;
    if (error_string != nullptr && error_string(r, &text) == kSuccess && text != nullptr)
      return fmt::format("{} (CUDA error {})", text, r);
    return fmt::format("CUDA error {}", r);
  }
};

template <typename F>
bool find(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  return fn != nullptr;
}

// The path of the CUDA driver library (libcuda.so*) this process loaded, or empty. A walk of the
// loaded objects (well under a microsecond): a dlopen of a name that is not loaded, RTLD_NOLOAD or
// not, searches the library path on the file system (some 20 us of failed opens), which every
// registration would pay where there is no CUDA.
std::string loaded_cuda_driver() {
  std::string path;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) -> int {
        const char* name = info->dlpi_name;
        if (name == nullptr) return 0;
        const char* slash = std::strrchr(name, '/');
        if (std::strncmp(slash != nullptr ? slash + 1 : name, "libcuda.so", 10) != 0) return 0;
        *static_cast<std::string*>(out) = name;
        return 1;
      },
      &path);
  return path;
}

// The driver this process loaded, or null. Looked up again while it is absent: the application
// may load CUDA after r2ccl started.
const Driver* driver() {
  static std::mutex mutex;
  static std::unique_ptr<Driver> found;
  static std::atomic<const Driver*> ready{nullptr};
  if (const Driver* d = ready.load(std::memory_order_acquire)) return d;
  std::lock_guard lock(mutex);
  if (found) return found.get();
  // RTLD_NOLOAD: only a library that is already loaded (the reference taken is kept, so the
  // functions stay valid).
  const std::string path = loaded_cuda_driver();
  if (path.empty()) return nullptr;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  auto d = std::make_unique<Driver>();
  if (!find(lib, "cuPointerGetAttribute", d->get_attribute) ||
      !find(lib, "cuDeviceGet", d->device_get) ||
      !find(lib, "cuDevicePrimaryCtxRetain", d->primary_retain) ||
      !find(lib, "cuCtxPushCurrent_v2", d->push) || !find(lib, "cuCtxPopCurrent_v2", d->pop) ||
      !find(lib, "cuStreamCreate", d->stream_create) ||
      !find(lib, "cuStreamSynchronize", d->stream_sync) ||
      !find(lib, "cuMemcpyDtoHAsync_v2", d->dtoh) || !find(lib, "cuMemcpyHtoDAsync_v2", d->htod)) {
    dlclose(lib);
    return nullptr;
  }
  (void)find(lib, "cuGetErrorString", d->error_string);
  found = std::move(d);
  ready.store(found.get(), std::memory_order_release);
  return found.get();
}

// The memory of one CUDA context: copies go on a non-blocking stream of that context (so they
// wait for no work of the application's streams), one stream per thread (so the progress
// thread's copies never wait behind another thread's).
class CudaMemory final : public DeviceMemory {
 public:
  CudaMemory(const Driver& driver, CUcontext context, int device)
      : driver_(driver), context_(context), device_(device) {}

  std::string describe() const override {
    return fmt::format("CUDA device memory (device {})", device_);
  }

  Status to_host(std::byte* dst, const std::byte* src, std::size_t n) const override {
    return copy(n, "to the host", [&](CUstream s) {
      return driver_.dtoh(dst, reinterpret_cast<CUdeviceptr>(src), n, s);
    });
  }

  Status to_device(std::byte* dst, const std::byte* src, std::size_t n) const override {
    return copy(n, "to the device", [&](CUstream s) {
      return driver_.htod(reinterpret_cast<CUdeviceptr>(dst), src, n, s);
    });
  }

 private:
  template <typename F>
  Status copy(std::size_t n, const char* where, F&& issue) const {
    if (n == 0) return Status::ok();
    if (CUresult r = driver_.push(context_); r != kSuccess)
      return failed("making its context current", r);
    // Made on a thread's first copy in the context, and kept for the thread's life.
    thread_local std::map<CUcontext, CUstream> streams;
    CUstream& stream = streams[context_];
    CUresult r = kSuccess;
    if (stream == nullptr) r = driver_.stream_create(&stream, kStreamNonBlocking);
    if (r == kSuccess) r = issue(stream);
    if (r == kSuccess) r = driver_.stream_sync(stream);
    CUcontext popped = nullptr;
    (void)driver_.pop(&popped);
    if (r != kSuccess) return failed(fmt::format("copying {} bytes {}", n, where), r);
    return Status::ok();
  }

  Status failed(const std::string& what, CUresult r) const {
    return {ErrorCode::kInternal, fmt::format("{}: {}: {}", describe(), what, driver_.error(r))};
  }

  const Driver& driver_;
  CUcontext context_;
  int device_;
};

}  // namespace

const DeviceMemory* cuda_memory_of(const void* p) {
  const Driver* d = p != nullptr ? driver() : nullptr;
  if (d == nullptr) return nullptr;
  const auto ptr = reinterpret_cast<CUdeviceptr>(p);
  // Unknown to the driver (plain host memory), or the driver not initialised: host memory.
  // These queries need no current context and make none.
  unsigned type = 0;
  if (d->get_attribute(&type, kAttrMemoryType, ptr) != kSuccess) return nullptr;
  unsigned managed = 0;  // a bool in the driver's documentation: zeroed, whatever its width
  if (d->get_attribute(&managed, kAttrIsManaged, ptr) != kSuccess) managed = 0;
  if (managed == 0 && type != kMemoryTypeDevice) return nullptr;  // pinned or registered host
  int device = -1;
  if (d->get_attribute(&device, kAttrDeviceOrdinal, ptr) != kSuccess) return nullptr;
  CUcontext context = nullptr;
  if (d->get_attribute(&context, kAttrContext, ptr) != kSuccess) context = nullptr;
  if (context == nullptr) {  // memory of no one context (the VMM API's): the primary one
    CUdevice dev = 0;
    if (d->device_get(&dev, device) != kSuccess || d->primary_retain(&context, dev) != kSuccess)
      return nullptr;
  }
  static std::mutex mutex;
  static std::map<CUcontext, std::unique_ptr<CudaMemory>> known;
  std::lock_guard lock(mutex);
  auto& m = known[context];
  if (!m) m = std::make_unique<CudaMemory>(*d, context, device);
  return m.get();
}

Status copy_to_host(const DeviceMemory* memory, std::byte* dst, const std::byte* src,
                    std::size_t n) {
  if (memory != nullptr) return memory->to_host(dst, src, n);
  if (n > 0) std::memcpy(dst, src, n);
  return Status::ok();
}

Status copy_from_host(const DeviceMemory* memory, std::byte* dst, const std::byte* src,
                      std::size_t n) {
  if (memory != nullptr) return memory->to_device(dst, src, n);
  if (n > 0) std::memcpy(dst, src, n);
  return Status::ok();
}

}  // namespace r2ccl

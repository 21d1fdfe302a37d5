#include "memory_kind.h"

#include <dlfcn.h>

#include <atomic>

namespace r2ccl::kv {

namespace {

// The driver API's types and values (cuda.h), so that the build needs no CUDA.
using CUresult = int;
using CUdeviceptr = unsigned long long;
using GetAttribute = CUresult (*)(void* data, int attribute, CUdeviceptr ptr);
constexpr CUresult kSuccess = 0;
constexpr int kAttrMemoryType = 2;         // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrIsManaged = 8;          // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr int kAttrDeviceOrdinal = 9;      // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE

// cuPointerGetAttribute of the driver this process loaded, or null. Looked up again while the
// driver is absent: the application may load CUDA after the engine was made.
GetAttribute driver() {
  static std::atomic<GetAttribute> found{nullptr};
  if (GetAttribute fn = found.load(std::memory_order_acquire)) return fn;
  // RTLD_NOLOAD: only a library that is already loaded (its reference is kept, so the pointer
  // stays valid).
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  auto fn = reinterpret_cast<GetAttribute>(dlsym(lib, "cuPointerGetAttribute"));
  if (fn == nullptr) {
    dlclose(lib);
    return nullptr;
  }
  found.store(fn, std::memory_order_release);
  return fn;
}

}  // namespace

PointerInfo pointer_info(const void* p) {
  PointerInfo info;
  GetAttribute get = p != nullptr ? driver() : nullptr;
  if (get == nullptr) return info;
  const auto ptr = reinterpret_cast<CUdeviceptr>(p);
  // Unknown to the driver (plain host memory), or the driver not initialised: host memory.
  // These queries need no current context and create none.
  unsigned type = 0;
  if (get(&type, kAttrMemoryType, ptr) != kSuccess) return info;
  unsigned managed = 0;  // a bool in the driver's documentation: zeroed, whatever its width
  if (get(&managed, kAttrIsManaged, ptr) != kSuccess) managed = 0;
  if (managed == 0 && type != kMemoryTypeDevice) return info;  // host (pinned or registered)
  info.kind = managed != 0 ? PointerKind::kManaged : PointerKind::kDevice;
  int device = -1;
  if (get(&device, kAttrDeviceOrdinal, ptr) == kSuccess) info.device = device;
  return info;
}

}  // namespace r2ccl::kv

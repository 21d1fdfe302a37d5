// CUDA devices and the memory behind a pointer. Part of r2ccl_coll_gpu, built where CMake finds
// nvcc (R2CCL_CUDA); nothing here needs a GPU to be present until it is called.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "r2ccl/runtime/status.h"

namespace r2ccl::coll::gpu {

// A CUDA call's error as a Status that names the call: "cudaMemcpyAsync: invalid argument".
Status cuda_status(cudaError_t e, std::string_view what);

// OK where at least one CUDA device can be used; otherwise why not ("no CUDA device: the CUDA
// driver is not installed", "no CUDA device: no device found").
Status available();

enum class MemoryKind : std::uint8_t { kHost, kPinnedHost, kDevice, kManaged };
std::string_view memory_kind_name(MemoryKind kind);

struct PointerInfo {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // the device the memory lives on, for kDevice and kManaged
};
// What memory `p` points into (cudaPointerGetAttributes). Memory the CUDA driver does not know,
// null included, is kHost; so is every pointer on a machine without a driver, and every pointer
// while the process has no CUDA context (device memory needs one, and the query would make one).
PointerInfo pointer_info(const void* p);

// Whether this process has a CUDA context: a primary context active on some device, or one
// current on the calling thread. Asks the driver without making one.
bool has_context();

// Restores the calling thread's current device when it leaves scope.
class CurrentDevice {
 public:
  CurrentDevice();
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int saved_ = -1;
};

}  // namespace r2ccl::coll::gpu

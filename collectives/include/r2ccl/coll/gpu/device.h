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
// null included, is kHost; so is every pointer on a machine without a driver.
PointerInfo pointer_info(const void* p);

}  // namespace r2ccl::coll::gpu

// Memory the CPU must not address directly (a GPU's), moved only through its own copies.
//
// A region registered over such memory carries its DeviceMemory: the tcp provider then stages
// what it sends through host memory (a copy out of the device per fragment) and what it receives
// (into a host landing buffer, then a copy into the device before the write is confirmed), and
// the channel's eager path and the KV engine's checksums copy the same way. A confirmed write
// is therefore in device memory, visible to any later work on the device.
//
// cuda_memory_of() recognises CUDA device and managed memory through the CUDA driver that the
// process has already loaded (dlopen with RTLD_NOLOAD): the build needs no CUDA, and a process
// that never used CUDA neither loads the driver nor makes a context.
#pragma once

#include <cstddef>
#include <string>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // "CUDA device memory (device 0)", for errors.
  virtual std::string describe() const = 0;
  // Copies `n` bytes out of the device at `src` into host memory at `dst`, or host bytes into
  // the device at `dst`; returns once they are there.
  virtual Status to_host(std::byte* dst, const std::byte* src, std::size_t n) const = 0;
  virtual Status to_device(std::byte* dst, const std::byte* src, std::size_t n) const = 0;
};

// CUDA's memory for the device (or managed memory) that holds `p`; null for host memory, or
// where this process has not loaded CUDA's driver. The objects live for the process.
const DeviceMemory* cuda_memory_of(const void* p);

// Copies out of (into) memory that is device memory when `memory` is set, host memory else.
Status copy_to_host(const DeviceMemory* memory, std::byte* dst, const std::byte* src,
                    std::size_t n);
Status copy_from_host(const DeviceMemory* memory, std::byte* dst, const std::byte* src,
                      std::size_t n);

}  // namespace r2ccl

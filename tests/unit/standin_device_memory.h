// A stand-in for a GPU's memory where there is none: host memory that holds every byte XORed
// with its own mask, reached through DeviceMemory's copies (which undo and redo the mask). Give
// the two sides of a transfer different masks: a byte that went around the copies (read or
// written in place, as host memory would be) then comes out wrong, so a test that checks every
// byte through the stand-in proves the copies were used. Copies can
// be made to fail, to test what a failed device copy does.
#pragma once

#include <atomic>
#include <cstddef>
#include <span>
#include <vector>

#include "r2ccl/runtime/device_memory.h"

namespace r2ccl::test {

class StandinDeviceMemory final : public DeviceMemory {
 public:
  explicit StandinDeviceMemory(std::byte mask) : mask_(mask) {}

  std::string describe() const override { return "stand-in device memory"; }

  Status to_host(std::byte* dst, const std::byte* src, std::size_t n) const override {
    if (fail_to_host.load())
      return {ErrorCode::kInternal, "stand-in device memory: copy out failed"};
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = src[i] ^ mask_;
    copies_out.fetch_add(1);
    return Status::ok();
  }

  Status to_device(std::byte* dst, const std::byte* src, std::size_t n) const override {
    if (fail_to_device.load())
      return {ErrorCode::kInternal, "stand-in device memory: copy in failed"};
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = src[i] ^ mask_;
    copies_in.fetch_add(1);
    return Status::ok();
  }

  // What the device holds, as host bytes (and the reverse), for a test's own set-up and checks.
  std::vector<std::byte> read(std::span<const std::byte> device) const {
    std::vector<std::byte> out(device.size());
    for (std::size_t i = 0; i < device.size(); ++i)
      out[i] = device[i] ^ mask_;
    return out;
  }
  void write(std::span<std::byte> device, std::span<const std::byte> host) const {
    for (std::size_t i = 0; i < host.size() && i < device.size(); ++i)
      device[i] = host[i] ^ mask_;
  }

  std::atomic<bool> fail_to_host{false}, fail_to_device{false};
  mutable std::atomic<std::uint64_t> copies_out{0}, copies_in{0};

 private:
  std::byte mask_;
};

}  // namespace r2ccl::test

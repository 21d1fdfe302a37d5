// Registered memory: each region is registered on every rail's NIC up front (multi-NIC
// registration), so a chunk can be re-sent on any rail without registering on the failure path.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "r2ccl/runtime/device_memory.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/status.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

struct Region {
  std::uint64_t id = 0;
  std::byte* base = nullptr;
  std::size_t length = 0;
  std::vector<std::uint64_t> keys;  // one per device (rail NIC)
  MemoryAccess access = MemoryAccess::kRemoteWrite;
  // Device memory (a GPU's): every byte in or out goes through its copies. Null: host memory.
  const DeviceMemory* device = nullptr;
};
using RegionPtr = std::shared_ptr<const Region>;

// What a peer needs to write into a region: its length and per-rail keys.
struct RemoteRegion {
  std::uint64_t id = 0;
  std::uint64_t length = 0;
  std::vector<std::uint64_t> keys;
  void encode(ByteWriter& w) const;
  static RemoteRegion decode(ByteReader& r);
};

// Whether the region lets peers write into it; the error names `what` and how to register it.
Status check_remote_writable(const RegionPtr& region, const char* what);

// Whether [offset, offset + length) lies in the registered region; the error names `what`.
Status check_region(const RegionPtr& region, std::size_t offset, std::size_t length,
                    const char* what);

class MemoryRegistry {
 public:
  explicit MemoryRegistry(Provider& provider) : provider_(provider) {}
  ~MemoryRegistry();  // deregisters whatever is left
  MemoryRegistry(const MemoryRegistry&) = delete;
  MemoryRegistry& operator=(const MemoryRegistry&) = delete;

  // Registers [base, base+length) on every device; all or nothing. Only kRemoteWrite regions
  // can be received into or written by peers. `device`: the memory is that device's; null:
  // CUDA memory where the driver says so (cuda_memory_of), host memory otherwise.
  Result<RegionPtr> register_region(void* base, std::size_t length,
                                    MemoryAccess access = MemoryAccess::kRemoteWrite,
                                    const DeviceMemory* device = nullptr);
  Status deregister_region(std::uint64_t id);
  std::size_t size() const;

 private:
  Provider& provider_;
  mutable std::mutex mutex_;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, RegionPtr> regions_;
};

}  // namespace r2ccl

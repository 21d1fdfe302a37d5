#include "r2ccl/runtime/memory.h"

#include <fmt/format.h>

#include "r2ccl/runtime/log.h"

namespace r2ccl {

void RemoteRegion::encode(ByteWriter& w) const {
  w.u64(id).u64(length).u32(static_cast<std::uint32_t>(keys.size()));
  for (auto k : keys)
    w.u64(k);
}

RemoteRegion RemoteRegion::decode(ByteReader& r) {
  RemoteRegion rr;
  rr.id = r.u64();
  rr.length = r.u64();
  const auto n = r.u32();
  for (std::uint32_t i = 0; i < n && i < 64 && r.ok(); ++i)
    rr.keys.push_back(r.u64());
  return rr;
}

MemoryRegistry::~MemoryRegistry() {
  std::lock_guard lock(mutex_);
  for (auto& [id, region] : regions_)
    for (std::size_t d = 0; d < region->keys.size(); ++d)
      (void)provider_.deregister_memory(d, region->keys[d]);
}

Status check_remote_writable(const RegionPtr& region, const char* what) {
  if (region && region->access != MemoryAccess::kRemoteWrite)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the region is registered for local access only; register it with "
                        "MemoryAccess::kRemoteWrite to let peers write into it",
                        what)};
  return Status::ok();
}

Result<RegionPtr> MemoryRegistry::register_region(void* base, std::size_t length,
                                                  MemoryAccess access, const DeviceMemory* device) {
  if (base == nullptr && length > 0)
    return Status(ErrorCode::kInvalidArgument, "cannot register a null buffer");
  auto region = std::make_shared<Region>();
  region->base = static_cast<std::byte*>(base);
  region->length = length;
  region->access = access;
  region->device = device != nullptr ? device : cuda_memory_of(base);
  const std::size_t ndev = provider_.devices().size();
  for (std::size_t d = 0; d < ndev; ++d) {
    auto key = provider_.register_memory(d, base, length, access, region->device);
    if (!key) {
      for (std::size_t u = 0; u < region->keys.size(); ++u)
        (void)provider_.deregister_memory(u, region->keys[u]);
      return key.status().with_context(
          fmt::format("registering {} bytes on {}", length, provider_.devices()[d].name));
    }
    region->keys.push_back(*key);
  }
  std::lock_guard lock(mutex_);
  region->id = next_id_++;
  regions_[region->id] = region;
  return RegionPtr(region);
}

Status MemoryRegistry::deregister_region(std::uint64_t id) {
  RegionPtr region;
  {
    std::lock_guard lock(mutex_);
    auto it = regions_.find(id);
    if (it == regions_.end())
      return {ErrorCode::kNotFound, fmt::format("no registered region with id {}", id)};
    region = it->second;
    regions_.erase(it);
  }
  // Every device, whatever one of them says: a key left registered would keep the memory
  // remote-writable after the caller frees it. The first failure is the one reported.
  Status first = Status::ok();
  for (std::size_t d = 0; d < region->keys.size(); ++d)
    if (Status st = provider_.deregister_memory(d, region->keys[d]); !st && first.is_ok())
      first = st;
  return first;
}

std::size_t MemoryRegistry::size() const {
  std::lock_guard lock(mutex_);
  return regions_.size();
}

Status check_region(const RegionPtr& region, std::size_t offset, std::size_t length,
                    const char* what) {
  if (!region)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the buffer is not registered (null region)", what)};
  if (offset > region->length || length > region->length - offset)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: {} bytes at offset {} exceed the registered region of {} bytes", what,
                        length, offset, region->length)};
  return Status::ok();
}

}  // namespace r2ccl

// The registration cache of the host collectives (as UCX's rcache, NCCL's user buffer
// registration): a buffer that is not inside one the user registered (register_buffer) keeps its
// registration after the operation, so that the next operation on it (a serving loop, a training
// step, Python's tensors) skips registering on every NIC and deregistering again.
//
// Entries are whole 4 KiB pages, keyed by address range and access: a lookup of [p, p + bytes)
// hits an entry whose range holds it and whose access covers the one asked for (kRemoteWrite
// covers kLocal). Entries never overlap: a registration that overlaps entries replaces them (and
// takes in the ranges of those whose access it covers, when the union stays within the byte
// cap, so that buffers sharing a page do not keep replacing each other). Bounded by an entry
// count and a byte count; the least recently used go first.
//
// An entry is deregistered only once nothing uses it: acquire() hands out a Lease that holds it
// for one operation, and an entry dropped (evicted, invalidated) while leased is deregistered
// when its last lease goes (Fabric::deregister_memory acts at once, and the tcp provider closes
// a rail whose data still lands in the region).
//
// Correctness: a cached registration outlives the caller's use of the buffer. Where the
// provider's registration pins pages (verbs without on-demand paging), a buffer freed and
// allocated again at the same address would be reached through the old pages: such a cache is
// safe only while the application invalidates (invalidate(), Communicator::invalidate_cache)
// what it frees. registration_cache_applies() says where the communicator uses one.
//
// Thread safety: every method may be called from any thread (one mutex). A registration runs
// under it (an invalidation waits for one in progress); deregistrations run after it is released.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll {

// Whether a communicator caches registrations: `mode` is R2CCL_REG_CACHE (auto, on, off),
// `provider_capabilities` the fabric's provider's ProviderCapability flags. auto: only where
// kCapRegistrationFollowsMappings (a freed and remapped buffer is then reached as it is now).
bool registration_cache_applies(std::string_view mode, std::uint32_t provider_capabilities);

class RegistrationCache {
 public:
  static constexpr std::size_t kPage = 4096;
  struct Limits {
    std::size_t max_entries = 64;
    std::size_t max_bytes = std::size_t{1} << 30;  // registered bytes of every entry together
  };
  using Register = std::function<Result<RegionPtr>(void* base, std::size_t length, MemoryAccess)>;
  using Deregister = std::function<Status(const RegionPtr&)>;
  RegistrationCache(Limits limits, Register reg, Deregister dereg);
  // Deregisters every entry. No lease may be left.
  ~RegistrationCache();
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  struct Slot;
  // A region that holds the buffer, and the buffer's offset in it; it stays registered while the
  // lease lives. Must not outlive the cache.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { release(); }
    const RegionPtr& region() const;
    std::size_t offset() const { return offset_; }
    explicit operator bool() const { return slot_ != nullptr; }
    void release();

   private:
    friend class RegistrationCache;
    RegistrationCache* cache_ = nullptr;
    std::shared_ptr<Slot> slot_;
    std::size_t offset_ = 0;
  };

  // The entry holding [p, p + bytes) with `access` (registering one on a miss). A buffer larger
  // than the byte cap is registered for this lease only (deregistered when it goes). The error
  // is the registration's.
  Result<Lease> acquire(const void* p, std::size_t bytes, MemoryAccess access);
  // Drops every entry that overlaps [p, p + bytes) (bytes 0: the byte at p), deregistered now or
  // when its last lease goes; how many. A deregistration that fails is logged.
  std::size_t invalidate(const void* p, std::size_t bytes);
  // Drops every entry.
  std::size_t clear();

  struct Stats {
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;
    std::uint64_t registrations = 0;    // regions registered (cached ones, and one-lease ones)
    std::uint64_t deregistrations = 0;  // regions deregistered
    std::uint64_t evictions = 0;        // entries dropped for the bounds
    std::uint64_t replaced = 0;         // entries replaced by an overlapping registration
    std::uint64_t invalidations = 0;    // entries dropped by invalidate() and clear()
    std::size_t entries = 0;            // entries now
    std::size_t bytes = 0;              // their registered bytes
  };
  Stats stats() const;
  const Limits& limits() const { return limits_; }

 private:
  using SlotPtr = std::shared_ptr<Slot>;
  void release(const SlotPtr& slot);
  // Takes the entry out of the map; the region is deregistered once no lease holds it (it is
  // added to `now` when none does). Under mutex_.
  void drop(std::map<std::uintptr_t, SlotPtr>::iterator it, std::vector<RegionPtr>& now);
  void deregister(const std::vector<RegionPtr>& regions);

  const Limits limits_;
  const Register register_;
  const Deregister deregister_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, SlotPtr> entries_;  // by start address; never overlapping
  std::size_t bytes_ = 0;
  std::uint64_t tick_ = 0;  // last use, for LRU
  Stats stats_;
};

}  // namespace r2ccl::coll

#include "r2ccl/coll/reg_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "r2ccl/runtime/log.h"

namespace r2ccl::coll {

bool registration_cache_applies(std::string_view mode, std::uint32_t provider_capabilities) {
  if (mode == "on") return true;
  if (mode == "off") return false;
  return (provider_capabilities & kCapRegistrationFollowsMappings) != 0;
}

struct RegistrationCache::Slot {
  // A new registration, with the lease of the operation that made it.
  Slot(RegionPtr r, std::uintptr_t from, std::uintptr_t to, MemoryAccess a, std::uint64_t tick,
       bool in_entries)
      : region(std::move(r)),
        lo(from),
        hi(to),
        access(a),
        leases(1),
        used(tick),
        cached(in_entries) {}

  RegionPtr region;
  std::uintptr_t lo = 0, hi = 0;  // the registered range
  MemoryAccess access = MemoryAccess::kLocal;
  std::size_t leases = 0;
  std::uint64_t used = 0;  // tick of the last acquire
  bool cached = true;      // in entries_ (false: dropped, or registered for one lease)
};

namespace {

bool covers(MemoryAccess have, MemoryAccess want) {
  return have == MemoryAccess::kRemoteWrite || want == MemoryAccess::kLocal;
}

}  // namespace

RegistrationCache::Lease& RegistrationCache::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    cache_ = std::exchange(other.cache_, nullptr);
    slot_ = std::move(other.slot_);
    other.slot_.reset();
    offset_ = std::exchange(other.offset_, 0);
  }
  return *this;
}

const RegionPtr& RegistrationCache::Lease::region() const {
  static const RegionPtr none;
  return slot_ ? slot_->region : none;
}

void RegistrationCache::Lease::release() {
  if (slot_ && cache_) cache_->release(slot_);
  slot_.reset();
  cache_ = nullptr;
  offset_ = 0;
}

RegistrationCache::RegistrationCache(Limits limits, Register reg, Deregister dereg)
    : limits_(limits), register_(std::move(reg)), deregister_(std::move(dereg)) {}

RegistrationCache::~RegistrationCache() {
  (void)clear();
}

Result<RegistrationCache::Lease> RegistrationCache::acquire(const void* p, std::size_t bytes,
                                                            MemoryAccess access) {
  if (p == nullptr || bytes == 0)
    return Status(ErrorCode::kInvalidArgument, "registration cache: a null or empty buffer");
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (bytes > std::numeric_limits<std::uintptr_t>::max() - a - kPage)
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("registration cache: {} bytes at {} run past the address space", bytes, p));
  const std::uintptr_t end = a + bytes;
  const std::uintptr_t lo = a & ~std::uintptr_t{kPage - 1};
  const std::uintptr_t hi = (end + kPage - 1) & ~std::uintptr_t{kPage - 1};
  Lease lease;
  lease.cache_ = this;
  std::vector<RegionPtr> now;  // deregistered once the lock is released
  {
    std::lock_guard lock(mutex_);
    ++tick_;
    // The entry that starts last at or before p is the only one that can hold it.
    auto at = entries_.upper_bound(a);
    if (at != entries_.begin()) {
      const SlotPtr& s = std::prev(at)->second;
      if (s->hi >= end && covers(s->access, access)) {
        ++stats_.hits;
        s->used = tick_;
        ++s->leases;
        lease.slot_ = s;
        lease.offset_ = a - s->lo;
        return Result<Lease>(std::move(lease));
      }
    }
    ++stats_.misses;
    if (hi - lo > limits_.max_bytes) {
      // Larger than the whole cache: registered for this lease alone, as without a cache.
      auto region = register_(const_cast<void*>(p), bytes, access);
      if (!region) return region.status();
      ++stats_.registrations;
      lease.slot_ = std::make_shared<Slot>(std::move(*region), a, end, access, tick_,
                                           /*in_entries=*/false);
      return Result<Lease>(std::move(lease));
    }
    // The entries overlapping [lo, hi): from the one before lo's that reaches past lo, to the
    // last starting before hi.
    auto first = entries_.upper_bound(lo);
    if (first != entries_.begin() && std::prev(first)->second->hi > lo) --first;
    const auto last = entries_.lower_bound(hi);
    // Their ranges join the new one where its access covers theirs (a buffer next to another in
    // the same page then hits the joined entry instead of replacing its neighbour each time).
    std::uintptr_t jlo = lo, jhi = hi;
    for (auto i = first; i != last; ++i)
      if (covers(access, i->second->access)) {
        jlo = std::min(jlo, i->second->lo);
        jhi = std::max(jhi, i->second->hi);
      }
    Result<RegionPtr> region = Status(ErrorCode::kInternal, "not registered");
    std::uintptr_t rlo = lo, rhi = hi;
    if ((jlo != lo || jhi != hi) && jhi - jlo <= limits_.max_bytes) {
      region = register_(reinterpret_cast<void*>(jlo), jhi - jlo, access);
      if (region) rlo = jlo, rhi = jhi;
    }
    if (!region) region = register_(reinterpret_cast<void*>(lo), hi - lo, access);
    if (!region) return region.status();
    ++stats_.registrations;
    for (auto i = first; i != last;) {
      auto next = std::next(i);
      ++stats_.replaced;
      drop(i, now);
      i = next;
    }
    auto slot = std::make_shared<Slot>(std::move(*region), rlo, rhi, access, tick_,
                                       /*in_entries=*/true);
    entries_.emplace(rlo, slot);
    bytes_ += rhi - rlo;
    // The bounds: the least recently used go (never the new one).
    while (entries_.size() > limits_.max_entries || bytes_ > limits_.max_bytes) {
      auto victim = entries_.end();
      for (auto i = entries_.begin(); i != entries_.end(); ++i)
        if (i->second != slot &&
            (victim == entries_.end() || i->second->used < victim->second->used))
          victim = i;
      if (victim == entries_.end()) break;
      ++stats_.evictions;
      drop(victim, now);
    }
    lease.slot_ = std::move(slot);
    lease.offset_ = a - rlo;
  }
  deregister(now);
  return Result<Lease>(std::move(lease));
}

void RegistrationCache::drop(std::map<std::uintptr_t, SlotPtr>::iterator it,
                             std::vector<RegionPtr>& now) {
  SlotPtr s = std::move(it->second);
  entries_.erase(it);
  bytes_ -= s->hi - s->lo;
  s->cached = false;
  if (s->leases == 0) now.push_back(s->region);
}

void RegistrationCache::release(const SlotPtr& slot) {
  RegionPtr region;
  {
    std::lock_guard lock(mutex_);
    if (slot->leases > 0) --slot->leases;
    if (slot->leases == 0 && !slot->cached) region = slot->region;
  }
  if (region) deregister({region});
}

void RegistrationCache::deregister(const std::vector<RegionPtr>& regions) {
  for (const auto& r : regions) {
    Status st = deregister_(r);
    {
      std::lock_guard lock(mutex_);
      ++stats_.deregistrations;
    }
    if (!st)
      R2CCL_WARN("registration cache: deregistering {} bytes at {}: {}", r->length,
                 static_cast<const void*>(r->base), st.to_string());
  }
}

std::size_t RegistrationCache::invalidate(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = bytes > std::numeric_limits<std::uintptr_t>::max() - a
                                 ? std::numeric_limits<std::uintptr_t>::max()
                                 : a + std::max<std::size_t>(bytes, 1);
  std::vector<RegionPtr> now;
  std::size_t dropped = 0;
  {
    std::lock_guard lock(mutex_);
    auto first = entries_.upper_bound(a);
    if (first != entries_.begin() && std::prev(first)->second->hi > a) --first;
    const auto last = entries_.lower_bound(end);
    for (auto i = first; i != last;) {
      auto next = std::next(i);
      drop(i, now);
      ++dropped;
      i = next;
    }
    stats_.invalidations += dropped;
  }
  deregister(now);
  return dropped;
}

std::size_t RegistrationCache::clear() {
  std::vector<RegionPtr> now;
  std::size_t dropped = 0;
  {
    std::lock_guard lock(mutex_);
    while (!entries_.empty()) {
      drop(entries_.begin(), now);
      ++dropped;
    }
    stats_.invalidations += dropped;
  }
  deregister(now);
  return dropped;
}

RegistrationCache::Stats RegistrationCache::stats() const {
  std::lock_guard lock(mutex_);
  Stats s = stats_;
  s.entries = entries_.size();
  s.bytes = bytes_;
  return s;
}

}  // namespace r2ccl::coll

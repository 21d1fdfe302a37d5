// The registration cache (coll/reg_cache.h): on its own with a stand-in registrar (hits,
// sub-ranges, access, pages, bounds and LRU, invalidation, leases that outlive a drop, joined
// neighbours, errors), where a communicator uses one (by the provider's capabilities and
// R2CCL_REG_CACHE), and through communicators over loopback tcp rails: every result byte-checked,
// registrations counted, and memory unmapped and mapped again at the same address.
#include "r2ccl/coll/reg_cache.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "coll_test_util.h"

namespace r2ccl::coll {
namespace {

constexpr std::size_t kPage = RegistrationCache::kPage;

// Registers by making a Region (no NIC); counts what is registered now.
struct Registrar {
  std::map<const Region*, std::pair<std::uintptr_t, std::size_t>> live;
  std::uint64_t next_id = 1;
  int fail_next = 0;  // the next n registrations fail
  RegistrationCache::Register reg() {
    return [this](void* base, std::size_t n, MemoryAccess access) -> Result<RegionPtr> {
      if (fail_next > 0) {
        --fail_next;
        return Status(ErrorCode::kUnavailable, fmt::format("no room for {} bytes", n));
      }
      auto r = std::make_shared<Region>();
      r->id = next_id++;
      r->base = static_cast<std::byte*>(base);
      r->length = n;
      r->access = access;
      live[r.get()] = {reinterpret_cast<std::uintptr_t>(base), n};
      return RegionPtr(r);
    };
  }
  RegistrationCache::Deregister dereg() {
    return [this](const RegionPtr& r) -> Status {
      if (live.erase(r.get()) == 0) return {ErrorCode::kNotFound, "deregistered twice"};
      return Status::ok();
    };
  }
};

// A page-aligned arena to carve buffers from (its addresses are never touched).
struct Arena {
  std::vector<std::byte> bytes = std::vector<std::byte>(64 * kPage + kPage);
  std::byte* at(std::size_t offset) {
    auto base = (reinterpret_cast<std::uintptr_t>(bytes.data()) + kPage - 1) & ~(kPage - 1);
    return reinterpret_cast<std::byte*>(base) + offset;
  }
};

TEST(RegistrationCache, HitsReuseOneRegistrationOfWholePages) {
  Registrar r;
  Arena a;
  RegistrationCache cache({}, r.reg(), r.dereg());
  std::byte* p = a.at(100);  // not page-aligned, 3 pages long: it spans 4
  {
    auto l = cache.acquire(p, 3 * kPage, MemoryAccess::kRemoteWrite);
    ASSERT_TRUE(l.is_ok()) << l.status().to_string();
    EXPECT_EQ(l->region()->base, a.at(0));
    EXPECT_EQ(l->region()->length, 4 * kPage);
    EXPECT_EQ(l->offset(), 100u);
  }
  for (int i = 0; i < 3; ++i) {
    auto l = cache.acquire(p, 3 * kPage, MemoryAccess::kRemoteWrite);
    ASSERT_TRUE(l.is_ok());
    EXPECT_EQ(l->offset(), 100u);
  }
  // A sub-range hits, at its own offset; local access is covered by remote-write access.
  auto sub = cache.acquire(a.at(2 * kPage + 5), 1000, MemoryAccess::kLocal);
  ASSERT_TRUE(sub.is_ok());
  EXPECT_EQ(sub->offset(), 2 * kPage + 5);
  const auto s = cache.stats();
  EXPECT_EQ(s.registrations, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits, 4u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 4 * kPage);
  EXPECT_EQ(r.live.size(), 1u);
}

TEST(RegistrationCache, WiderAccessReplacesTheEntryOnceItsLeaseIsGone) {
  Registrar r;
  Arena a;
  RegistrationCache cache({}, r.reg(), r.dereg());
  auto local = cache.acquire(a.at(0), kPage, MemoryAccess::kLocal);
  ASSERT_TRUE(local.is_ok());
  const Region* old = local->region().get();
  // Remote write is not covered by a local registration: a new one replaces it ...
  auto remote = cache.acquire(a.at(0), kPage, MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(remote.is_ok());
  EXPECT_NE(remote->region().get(), old);
  EXPECT_EQ(cache.stats().replaced, 1u);
  EXPECT_EQ(cache.stats().entries, 1u);
  // ... but the first stays registered while its lease holds it (an operation in flight).
  EXPECT_EQ(r.live.count(old), 1u);
  local->release();
  EXPECT_EQ(r.live.count(old), 0u);
  EXPECT_EQ(r.live.size(), 1u);
  // And a local use now hits the remote-write entry.
  auto again = cache.acquire(a.at(0), kPage, MemoryAccess::kLocal);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->region().get(), remote->region().get());
}

TEST(RegistrationCache, BoundedByEntriesLeastRecentlyUsedFirst) {
  Registrar r;
  Arena a;
  RegistrationCache cache({4, std::size_t{1} << 30}, r.reg(), r.dereg());
  for (std::size_t i = 0; i < 4; ++i)
    ASSERT_TRUE(cache.acquire(a.at(2 * i * kPage), kPage, MemoryAccess::kLocal).is_ok());
  // Buffer 0 used again: buffer 1 is now the least recently used.
  ASSERT_TRUE(cache.acquire(a.at(0), kPage, MemoryAccess::kLocal).is_ok());
  ASSERT_TRUE(cache.acquire(a.at(8 * kPage), kPage, MemoryAccess::kLocal).is_ok());
  auto s = cache.stats();
  EXPECT_EQ(s.entries, 4u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(r.live.size(), 4u);
  std::set<std::uintptr_t> bases;
  for (const auto& [region, range] : r.live)
    bases.insert(range.first);
  EXPECT_EQ(bases.count(reinterpret_cast<std::uintptr_t>(a.at(2 * kPage))), 0u) << "not evicted";
  EXPECT_EQ(bases.count(reinterpret_cast<std::uintptr_t>(a.at(0))), 1u) << "evicted though used";
  // Buffer 0 still hits; buffer 1 misses.
  const auto misses = s.misses;
  ASSERT_TRUE(cache.acquire(a.at(0), kPage, MemoryAccess::kLocal).is_ok());
  EXPECT_EQ(cache.stats().misses, misses);
  ASSERT_TRUE(cache.acquire(a.at(2 * kPage), kPage, MemoryAccess::kLocal).is_ok());
  EXPECT_EQ(cache.stats().misses, misses + 1);
}

TEST(RegistrationCache, BoundedByBytesAndLargerBuffersAreRegisteredForTheirLeaseAlone) {
  Registrar r;
  Arena a;
  RegistrationCache cache({64, 4 * kPage}, r.reg(), r.dereg());
  ASSERT_TRUE(cache.acquire(a.at(0), 2 * kPage, MemoryAccess::kLocal).is_ok());
  ASSERT_TRUE(cache.acquire(a.at(4 * kPage), 2 * kPage, MemoryAccess::kLocal).is_ok());
  EXPECT_EQ(cache.stats().bytes, 4 * kPage);
  // A third one pushes the first (least recently used) out.
  ASSERT_TRUE(cache.acquire(a.at(8 * kPage), kPage, MemoryAccess::kLocal).is_ok());
  auto s = cache.stats();
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.bytes, 3 * kPage);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(r.live.size(), 2u);
  // Larger than the cap: registered exactly, for the lease alone, and nothing cached is evicted.
  {
    auto big = cache.acquire(a.at(16 * kPage + 8), 5 * kPage, MemoryAccess::kRemoteWrite);
    ASSERT_TRUE(big.is_ok());
    EXPECT_EQ(big->region()->base, a.at(16 * kPage + 8));
    EXPECT_EQ(big->region()->length, 5 * kPage);
    EXPECT_EQ(big->offset(), 0u);
    EXPECT_EQ(r.live.size(), 3u);
    EXPECT_EQ(cache.stats().entries, 2u);
  }
  EXPECT_EQ(r.live.size(), 2u);
}

TEST(RegistrationCache, InvalidationDropsOverlappingEntriesOnly) {
  Registrar r;
  Arena a;
  RegistrationCache cache({}, r.reg(), r.dereg());
  for (std::size_t i = 0; i < 3; ++i)
    ASSERT_TRUE(cache.acquire(a.at(4 * i * kPage), 2 * kPage, MemoryAccess::kLocal).is_ok());
  // One byte of the second entry's last page, nothing of the others.
  EXPECT_EQ(cache.invalidate(a.at(6 * kPage - 1), 1), 1u);
  EXPECT_EQ(cache.stats().entries, 2u);
  EXPECT_EQ(r.live.size(), 2u);
  // A range spanning the gap between the two others drops both.
  EXPECT_EQ(cache.invalidate(a.at(kPage), 8 * kPage), 2u);
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(cache.stats().invalidations, 3u);
  EXPECT_TRUE(r.live.empty());
  EXPECT_EQ(cache.invalidate(a.at(0), 64 * kPage), 0u);
  // The next use registers afresh.
  ASSERT_TRUE(cache.acquire(a.at(0), kPage, MemoryAccess::kLocal).is_ok());
  EXPECT_EQ(cache.stats().registrations, 4u);
}

TEST(RegistrationCache, AnEntryInvalidatedWhileLeasedIsDeregisteredWhenTheLeaseGoes) {
  Registrar r;
  Arena a;
  RegistrationCache cache({}, r.reg(), r.dereg());
  auto l = cache.acquire(a.at(0), kPage, MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(l.is_ok());
  // From another thread, as an application's deregistration may come.
  std::thread([&] { EXPECT_EQ(cache.invalidate(a.at(0), kPage), 1u); }).join();
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_EQ(r.live.size(), 1u) << "deregistered while an operation still uses it";
  EXPECT_EQ(cache.stats().deregistrations, 0u);
  RegistrationCache::Lease moved = std::move(*l);
  EXPECT_EQ(r.live.size(), 1u);
  moved.release();
  EXPECT_TRUE(r.live.empty());
  EXPECT_EQ(cache.stats().deregistrations, 1u);
}

TEST(RegistrationCache, NeighboursSharingAPageJoinInsteadOfReplacingEachOther) {
  Registrar r;
  Arena a;
  RegistrationCache cache({}, r.reg(), r.dereg());
  // Two buffers that meet inside page 2.
  std::byte* x = a.at(0);
  std::byte* y = a.at(2 * kPage + 100);
  ASSERT_TRUE(cache.acquire(x, 2 * kPage + 100, MemoryAccess::kLocal).is_ok());
  ASSERT_TRUE(cache.acquire(y, 2 * kPage, MemoryAccess::kLocal).is_ok());
  auto s = cache.stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, 5 * kPage);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(cache.acquire(x, 2 * kPage + 100, MemoryAccess::kLocal).is_ok());
    ASSERT_TRUE(cache.acquire(y, 2 * kPage, MemoryAccess::kLocal).is_ok());
  }
  EXPECT_EQ(cache.stats().registrations, 2u);
  EXPECT_EQ(r.live.size(), 1u);
  // A local-only request does not widen a remote-write neighbour: it replaces it instead.
  ASSERT_TRUE(cache.acquire(a.at(8 * kPage), kPage, MemoryAccess::kRemoteWrite).is_ok());
  auto l = cache.acquire(a.at(8 * kPage + kPage / 2), kPage, MemoryAccess::kLocal);
  ASSERT_TRUE(l.is_ok());
  EXPECT_EQ(l->region()->access, MemoryAccess::kLocal);
  EXPECT_EQ(l->region()->base, a.at(8 * kPage));
  EXPECT_EQ(l->region()->length, 2 * kPage);
}

TEST(RegistrationCache, ARegistrationErrorIsReturnedAndNothingIsCached) {
  Registrar r;
  Arena a;
  RegistrationCache cache({}, r.reg(), r.dereg());
  r.fail_next = 1;
  auto l = cache.acquire(a.at(0), kPage, MemoryAccess::kLocal);
  ASSERT_FALSE(l.is_ok());
  EXPECT_EQ(l.status().message(), fmt::format("no room for {} bytes", kPage));
  EXPECT_EQ(cache.stats().entries, 0u);
  auto bad = cache.acquire(nullptr, 10, MemoryAccess::kLocal);
  EXPECT_EQ(bad.status().message(), "registration cache: a null or empty buffer");
  // A joined range that cannot be registered falls back to the buffer's own pages.
  ASSERT_TRUE(cache.acquire(a.at(0), kPage + 1, MemoryAccess::kLocal).is_ok());
  r.fail_next = 1;
  auto next = cache.acquire(a.at(kPage + 8), kPage, MemoryAccess::kLocal);
  ASSERT_TRUE(next.is_ok()) << next.status().to_string();
  EXPECT_EQ(next->region()->base, a.at(kPage));
  EXPECT_EQ(next->region()->length, 2 * kPage);
}

TEST(RegistrationCache, DestroyingItDeregistersEverything) {
  Registrar r;
  Arena a;
  {
    RegistrationCache cache({}, r.reg(), r.dereg());
    for (std::size_t i = 0; i < 5; ++i)
      ASSERT_TRUE(cache.acquire(a.at(2 * i * kPage), kPage, MemoryAccess::kLocal).is_ok());
    EXPECT_EQ(r.live.size(), 5u);
  }
  EXPECT_TRUE(r.live.empty());
}

// auto caches only where a registration follows the mappings (tcp); verbs pins pages.
TEST(RegistrationCache, UsedByDefaultOnlyWhereRegistrationsFollowTheMappings) {
  const std::uint32_t tcp = kCapRegistrationFollowsMappings;
  const std::uint32_t verbs = 0;
  EXPECT_TRUE(registration_cache_applies("auto", tcp));
  EXPECT_FALSE(registration_cache_applies("auto", verbs));
  EXPECT_TRUE(registration_cache_applies("on", verbs));
  EXPECT_FALSE(registration_cache_applies("off", tcp));
}

// ---- through communicators (two ranks as threads, loopback tcp rails)

float value(int rank, int round, std::size_t i) {
  return static_cast<float>(rank * 100 + round * 7 + static_cast<int>(i % 251));
}

TEST(RegistrationCacheComm, AllReducesReuseTheirRegistrationsAndAreRight) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  EXPECT_NE(comms[0]->fabric().provider_capabilities() & kCapRegistrationFollowsMappings, 0u);
  test::on_all(comms, [](int r, Communicator& c) {
    ASSERT_NE(c.registration_cache(), nullptr) << "tcp's registrations follow the mappings";
    const std::size_t n = 1 << 18;  // 1 MiB
    std::vector<float> send(n), recv(n);
    std::size_t regions = 0;
    for (int round = 0; round < 5; ++round) {
      for (std::size_t i = 0; i < n; ++i)
        send[i] = value(r, round, i);
      ASSERT_TRUE(c.all_reduce(send.data(), recv.data(), n, DataType::kF32, RedOp::kSum));
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(recv[i], value(0, round, i) + value(1, round, i))
            << "round " << round << ", " << i;
      if (round == 0) regions = c.fabric().registered_regions();
      EXPECT_EQ(c.fabric().registered_regions(), regions) << "round " << round;
    }
    const auto s = c.registration_cache()->stats();
    EXPECT_EQ(s.registrations, 2u);  // the send buffer (local), the receive buffer
    EXPECT_EQ(s.misses, 2u);
    EXPECT_EQ(s.hits, 8u);
    EXPECT_EQ(s.entries, 2u);
    // In place, and point to point, through the same entries.
    ASSERT_TRUE(c.all_reduce(recv.data(), recv.data(), n, DataType::kF32, RedOp::kMax));
    EXPECT_EQ(recv[5], value(0, 4, 5) + value(1, 4, 5));
    ASSERT_TRUE(c.group_start());
    ASSERT_TRUE(c.send(send.data(), n, DataType::kF32, 1 - r));
    ASSERT_TRUE(c.recv(recv.data(), n, DataType::kF32, 1 - r));
    ASSERT_TRUE(c.group_end());
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[i], value(1 - r, 4, i)) << i;
    EXPECT_EQ(c.registration_cache()->stats().registrations, 2u);
  });
}

TEST(RegistrationCacheComm, OffRegistersEachOperationsBuffersForItAlone) {
  auto comms = test::make_comms(2, {{"R2CCL_REG_CACHE", "off"}});
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int r, Communicator& c) {
    EXPECT_EQ(c.registration_cache(), nullptr);
    const std::size_t n = 1 << 18;
    std::vector<float> send(n), recv(n);
    for (int round = 0; round < 2; ++round) {
      for (std::size_t i = 0; i < n; ++i)
        send[i] = value(r, round, i);
      const std::size_t before = c.fabric().registered_regions();
      ASSERT_TRUE(c.all_reduce(send.data(), recv.data(), n, DataType::kF32, RedOp::kSum));
      // The scratch region may have been made by the first; nothing of the buffers stays.
      if (round > 0) {
        EXPECT_EQ(c.fabric().registered_regions(), before);
      }
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(recv[i], value(0, round, i) + value(1, round, i)) << i;
    }
    EXPECT_EQ(c.invalidate_cache(send.data(), n * sizeof(float)), 0u);
  });
}

// Memory unmapped and mapped again at the same address: after invalidate_cache the next
// operation registers afresh; without it tcp's cached registration reaches the new pages (it
// names addresses), so the results are right either way.
TEST(RegistrationCacheComm, MemoryMappedAgainAtTheSameAddress) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int r, Communicator& c) {
    const std::size_t n = 1 << 18, bytes = n * sizeof(float);
    const auto map_at = [&](void* where) {
      void* p = mmap(where, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | (where ? MAP_FIXED_NOREPLACE : 0), -1, 0);
      return p == MAP_FAILED ? nullptr : static_cast<float*>(p);
    };
    float* buf = map_at(nullptr);
    ASSERT_NE(buf, nullptr);
    const auto round_trip = [&](int round) {
      for (std::size_t i = 0; i < n; ++i)
        buf[i] = value(r, round, i);
      ASSERT_TRUE(c.all_reduce(buf, buf, n, DataType::kF32, RedOp::kSum));
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(buf[i], value(0, round, i) + value(1, round, i))
            << "round " << round << ", " << i;
    };
    round_trip(0);
    const auto& cache = *c.registration_cache();
    const auto first = cache.stats().registrations;
    ASSERT_GE(cache.stats().entries, 1u);
    // Invalidated, unmapped, mapped again: a fresh registration.
    EXPECT_GE(c.invalidate_cache(buf, bytes), 1u);
    EXPECT_EQ(cache.stats().entries, 0u);
    ASSERT_EQ(munmap(buf, bytes), 0);
    float* again = map_at(buf);
    ASSERT_EQ(again, buf) << "the address was taken meanwhile";
    round_trip(1);
    EXPECT_GT(cache.stats().registrations, first);
    // Unmapped and mapped again without telling the cache: the entry hits, and reaches the new
    // pages.
    const auto before = cache.stats();
    ASSERT_EQ(munmap(buf, bytes), 0);
    ASSERT_EQ(map_at(buf), buf) << "the address was taken meanwhile";
    round_trip(2);
    EXPECT_EQ(cache.stats().registrations, before.registrations);
    EXPECT_GT(cache.stats().hits, before.hits);
    EXPECT_EQ(munmap(buf, bytes), 0);
  });
}

// A buffer the user registers takes over from the cache, and its deregistration drops what the
// cache holds of its range.
TEST(RegistrationCacheComm, UserRegistrationsDropCachedOnes) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int r, Communicator& c) {
    // Whole pages of their own, so that what the cache holds of each is known exactly.
    const std::size_t n = 1 << 17;
    std::vector<float> pool_memory(2 * n + 2048 + kPage), other_memory(n + kPage);
    const auto page_aligned = [](std::vector<float>& v) {
      return reinterpret_cast<float*>((reinterpret_cast<std::uintptr_t>(v.data()) + kPage - 1) &
                                      ~(kPage - 1));
    };
    float* pool = page_aligned(pool_memory);
    const std::size_t pool_bytes = (2 * n + 2048) * sizeof(float);
    float* other = page_aligned(other_memory);
    float* send = pool;
    float* recv = pool + n + 1024;  // a page after the send buffer
    const auto run = [&](int round) {
      for (std::size_t i = 0; i < n; ++i)
        send[i] = value(r, round, i);
      ASSERT_TRUE(c.all_reduce(send, recv, n, DataType::kF32, RedOp::kSum));
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(recv[i], value(0, round, i) + value(1, round, i)) << i;
    };
    run(0);
    const auto& cache = *c.registration_cache();
    EXPECT_EQ(cache.stats().entries, 2u);
    auto h = c.register_buffer(pool, pool_bytes);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    EXPECT_EQ(cache.stats().entries, 0u);
    const auto before = cache.stats();
    run(1);
    EXPECT_EQ(cache.stats().hits, before.hits) << "the user's registration is used";
    EXPECT_EQ(cache.stats().misses, before.misses);
    // Cached again outside the user's buffer, then dropped with it.
    ASSERT_TRUE(c.all_reduce(other, recv, n, DataType::kF32, RedOp::kSum));
    EXPECT_EQ(cache.stats().entries, 1u);
    ASSERT_TRUE(c.deregister_buffer(*h));
    EXPECT_EQ(cache.stats().entries, 1u) << "other's entry is not in the pool";
    run(2);
    EXPECT_EQ(cache.stats().entries, 3u);
    auto again = c.register_buffer(pool, pool_bytes);
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
    EXPECT_EQ(cache.stats().entries, 1u);
    ASSERT_TRUE(c.deregister_buffer(*again));
  });
}

}  // namespace
}  // namespace r2ccl::coll

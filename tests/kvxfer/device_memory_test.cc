// KV pools are host memory only for now (review N-M4): CUDA device and managed memory are
// refused at registration, by name; pinned host memory registers. Needs a CUDA device (label
// gpu): the test loads the driver itself, which the engine never does.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include "../unit/test_util.h"
#include "r2ccl/kv/engine.h"

namespace r2ccl::kv {
namespace {

// Device and managed memory are refused by name (review N-M4): the tcp rail would copy into them
// on the host. Pinned host memory registers. Needs a CUDA device; the test loads the driver
// itself (the engine never does).
TEST(KvEngine, DeviceAndManagedMemoryAreRefusedByName) {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (cuda == nullptr) GTEST_SKIP() << "no CUDA driver (libcuda.so.1)";
  auto sym = [&](const char* name) { return dlsym(cuda, name); };
  using Ptr = unsigned long long;
  auto cu_init = reinterpret_cast<int (*)(unsigned)>(sym("cuInit"));
  auto cu_count = reinterpret_cast<int (*)(int*)>(sym("cuDeviceGetCount"));
  auto cu_retain = reinterpret_cast<int (*)(void**, int)>(sym("cuDevicePrimaryCtxRetain"));
  auto cu_release = reinterpret_cast<int (*)(int)>(sym("cuDevicePrimaryCtxRelease_v2"));
  auto cu_set = reinterpret_cast<int (*)(void*)>(sym("cuCtxSetCurrent"));
  auto cu_alloc = reinterpret_cast<int (*)(Ptr*, std::size_t)>(sym("cuMemAlloc_v2"));
  auto cu_managed =
      reinterpret_cast<int (*)(Ptr*, std::size_t, unsigned)>(sym("cuMemAllocManaged"));
  auto cu_free = reinterpret_cast<int (*)(Ptr)>(sym("cuMemFree_v2"));
  auto cu_host = reinterpret_cast<int (*)(void**, std::size_t)>(sym("cuMemAllocHost_v2"));
  auto cu_free_host = reinterpret_cast<int (*)(void*)>(sym("cuMemFreeHost"));
  ASSERT_TRUE(cu_init && cu_count && cu_retain && cu_release && cu_set && cu_alloc && cu_managed &&
              cu_free && cu_host && cu_free_host);
  int devices = 0;
  if (cu_init(0) != 0 || cu_count(&devices) != 0 || devices == 0) GTEST_SKIP() << "no CUDA device";
  void* ctx = nullptr;
  ASSERT_EQ(cu_retain(&ctx, 0), 0);
  ASSERT_EQ(cu_set(ctx), 0);
  constexpr std::size_t kBytes = 4096;
  Ptr device = 0, managed = 0;
  void* pinned = nullptr;
  ASSERT_EQ(cu_alloc(&device, kBytes), 0);
  ASSERT_EQ(cu_managed(&managed, kBytes, 1 /* CU_MEM_ATTACH_GLOBAL */), 0);
  ASSERT_EQ(cu_host(&pinned, kBytes), 0);
  {
    auto cfg = parse_config(test::env_of({{"R2CCL_NICS", "127.0.80.1"}}));
    ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
    auto endpoint = Endpoint::create(*cfg, EndpointOptions{});
    ASSERT_TRUE(endpoint.is_ok()) << endpoint.status().to_string();
    auto engine = KvEngine::create(**endpoint, EngineOptions{});
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    auto& e = **engine;
    const auto layout = KvLayout::layer_major(1, 4, 1024, 1);
    auto span_of = [](Ptr p) {
      return std::span<std::byte>(reinterpret_cast<std::byte*>(p), kBytes);
    };
    std::vector<std::byte> host(kBytes);
    EXPECT_EQ(
        e.register_pool({std::span<std::byte>(host), span_of(device)}, layout).status().message(),
        fmt::format("register_pool: buffer 1 of the pool ({}, 4096 bytes) is CUDA device "
                    "memory (of device 0): KV pools must be host memory for now",
                    reinterpret_cast<const void*>(device)));
    EXPECT_EQ(e.register_pool({span_of(managed)}, layout).status().message(),
              fmt::format("register_pool: buffer 0 of the pool ({}, 4096 bytes) is CUDA managed "
                          "memory (of device 0): KV pools must be host memory for now",
                          reinterpret_cast<const void*>(managed)));
    auto pool =
        e.register_pool({std::span<std::byte>(static_cast<std::byte*>(pinned), kBytes)}, layout);
    ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
    EXPECT_TRUE(e.unregister_pool(*pool).is_ok());
  }
  cu_free(device);
  cu_free(managed);
  cu_free_host(pinned);
  cu_release(0);
}

}  // namespace
}  // namespace r2ccl::kv

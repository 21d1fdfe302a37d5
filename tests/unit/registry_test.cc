#include <gtest/gtest.h>

#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/provider/progress.h"

namespace r2ccl {
namespace {

TEST(Registry, RegistersOnEveryRailWithDistinctKeys) {
  ProgressEngine engine;
  auto p = make_tcp_provider(
      engine, {{"127.0.0.41", "127.0.0.41", -1, "", ""}, {"127.0.0.42", "127.0.0.42", -1, "", ""}},
      {});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  MemoryRegistry reg(**p);
  std::vector<std::byte> a(4096), b(100);
  auto ra = reg.register_region(a.data(), a.size());
  auto rb = reg.register_region(b.data(), b.size());
  ASSERT_TRUE(ra.is_ok() && rb.is_ok());
  EXPECT_EQ((*ra)->keys.size(), 2u);
  EXPECT_NE((*ra)->keys[0], (*ra)->keys[1]);
  EXPECT_NE((*ra)->keys[0], (*rb)->keys[0]);
  EXPECT_NE((*ra)->id, (*rb)->id);
  EXPECT_EQ((*ra)->length, 4096u);
  EXPECT_EQ(reg.size(), 2u);

  EXPECT_TRUE(reg.deregister_region((*ra)->id).is_ok());
  EXPECT_EQ(reg.size(), 1u);
  // The keys are gone from the provider too.
  auto again = (*p)->deregister_memory(0, (*ra)->keys[0]);
  EXPECT_EQ(again.code(), ErrorCode::kNotFound);
  EXPECT_NE(again.message().find("is not registered on 127.0.0.41"), std::string::npos);

  auto twice = reg.deregister_region((*ra)->id);
  EXPECT_EQ(twice.code(), ErrorCode::kNotFound);
  EXPECT_EQ(twice.message(), "no registered region with id " + std::to_string((*ra)->id));
}

TEST(Registry, ADeviceThatFailsDoesNotKeepTheOthersRegistered) {
  ProgressEngine engine;
  auto p = make_tcp_provider(
      engine, {{"127.0.0.44", "127.0.0.44", -1, "", ""}, {"127.0.0.45", "127.0.0.45", -1, "", ""}},
      {});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  MemoryRegistry reg(**p);
  std::vector<std::byte> a(4096);
  auto r = reg.register_region(a.data(), a.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(r.is_ok());
  const auto keys = (*r)->keys;
  // The first device no longer knows its key: deregistering the region fails there...
  ASSERT_TRUE((*p)->deregister_memory(0, keys[0]).is_ok());
  const Status st = reg.deregister_region((*r)->id);
  EXPECT_EQ(st.code(), ErrorCode::kNotFound);
  EXPECT_NE(st.message().find("is not registered on 127.0.0.44"), std::string::npos)
      << st.message();
  // ...and the second device's key is gone all the same.
  EXPECT_EQ((*p)->deregister_memory(1, keys[1]).code(), ErrorCode::kNotFound);
  EXPECT_EQ(reg.size(), 0u);
}

TEST(Registry, RefusesANullBuffer) {
  ProgressEngine engine;
  auto p = make_tcp_provider(engine, {{"127.0.0.43", "127.0.0.43", -1, "", ""}}, {});
  ASSERT_TRUE(p.is_ok());
  MemoryRegistry reg(**p);
  auto r = reg.register_region(nullptr, 10);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), "cannot register a null buffer");
  EXPECT_TRUE(reg.register_region(nullptr, 0).is_ok());  // an empty region is fine
}

}  // namespace
}  // namespace r2ccl

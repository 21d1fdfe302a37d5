#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/log.h"
#include "test_util.h"

namespace r2ccl {
namespace {

using test::env_of;

TEST(Config, DefaultsWhenNothingIsSet) {
  auto c = parse_config(env_of({}));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->log_level, LogLevel::kWarn);
  EXPECT_FALSE(c->rank.has_value());
  EXPECT_FALSE(c->bootstrap.has_value());
  EXPECT_EQ(c->provider, "tcp");
  EXPECT_EQ(c->chunk_size, 512u * 1024);
  EXPECT_EQ(c->rail_window, 2u * 1024 * 1024);
  EXPECT_EQ(c->timeout.count(), 30000);
  EXPECT_EQ(c->bootstrap_timeout.count(), 30000);
  EXPECT_EQ(c->bootstrap_token, Token{});
  EXPECT_TRUE(c->nics.empty());
}

TEST(Config, ParsesEveryVariable) {
  auto c = parse_config(env_of({{"R2CCL_LOG", "DEBUG"},
                                {"R2CCL_RANK", "3"},
                                {"R2CCL_NRANKS", "4"},
                                {"R2CCL_BOOTSTRAP", "198.19.0.1:29500"},
                                {"R2CCL_BOOTSTRAP_TOKEN", "00112233445566778899aabbccddeeff"},
                                {"R2CCL_BOOTSTRAP_TIMEOUT", "1500ms"},
                                {"R2CCL_SOCKET_IFNAME", "eth0"},
                                {"R2CCL_NICS", "eth1, eth2,eth3"},
                                {"R2CCL_PROVIDER", "tcp"},
                                {"R2CCL_CHUNK_SIZE", "64K"},
                                {"R2CCL_RAIL_WINDOW", "1MiB"},
                                {"R2CCL_TIMEOUT", "2s"},
                                {"R2CCL_CONNECT_TIMEOUT", "0.5s"}}));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->log_level, LogLevel::kDebug);
  EXPECT_EQ(*c->rank, 3);
  EXPECT_EQ(*c->nranks, 4);
  EXPECT_EQ(c->bootstrap->host, "198.19.0.1");
  EXPECT_EQ(c->bootstrap->port, 29500);
  EXPECT_EQ(token_to_hex(c->bootstrap_token), "00112233445566778899aabbccddeeff");
  EXPECT_EQ(c->bootstrap_timeout.count(), 1500);
  EXPECT_EQ(c->socket_ifname, "eth0");
  EXPECT_EQ(c->nics, (std::vector<std::string>{"eth1", "eth2", "eth3"}));
  EXPECT_EQ(c->chunk_size, 65536u);
  EXPECT_EQ(c->rail_window, 1u << 20);
  EXPECT_EQ(c->timeout.count(), 2000);
  EXPECT_EQ(c->connect_timeout.count(), 500);
}

TEST(Config, GpuFlags) {
  auto d = parse_config(env_of({}));
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_TRUE(d->gpu_tune);
  EXPECT_TRUE(d->gpu_nccl);
  auto c = parse_config(env_of({{"R2CCL_GPU_TUNE", "0"}, {"R2CCL_GPU_NCCL", " 0 "}}));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_FALSE(c->gpu_tune);
  EXPECT_FALSE(c->gpu_nccl);
  auto bad = parse_config(env_of({{"R2CCL_GPU_NCCL", "off"}}));
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("R2CCL_GPU_NCCL"), std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("0 or 1"), std::string::npos) << bad.status().message();
}

TEST(Config, MetricsAddressIsADottedQuad) {
  auto c = parse_config(env_of({{"R2CCL_METRICS_ADDR", " 198.18.0.1 "}}));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->metrics_addr, "198.18.0.1");
  for (const char* bad : {"198.18.0.1x", "198.18.0", "198.18.0.256", "198. 18.0.1", "localhost"}) {
    auto b = parse_config(env_of({{"R2CCL_METRICS_ADDR", bad}}));
    ASSERT_FALSE(b.is_ok()) << bad;
    EXPECT_NE(b.status().message().find("R2CCL_METRICS_ADDR"), std::string::npos)
        << b.status().message();
    EXPECT_NE(b.status().message().find("an IPv4 address"), std::string::npos)
        << b.status().message();
  }
}

TEST(Config, TakesRankAndSizeFromMpirun) {
  auto c = parse_config(env_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(*c->rank, 1);
  EXPECT_EQ(*c->nranks, 2);
  // R2CCL_* wins over mpirun's variables.
  auto d =
      parse_config(env_of({{"R2CCL_RANK", "0"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"PMI_SIZE", "2"}}));
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(*d->rank, 0);
  EXPECT_EQ(*d->nranks, 2);
}

struct BadValue {
  const char* name;
  const char* value;
  const char* allowed;  // part of the message saying what is allowed
};

class ConfigBadValue : public testing::TestWithParam<BadValue> {};

TEST_P(ConfigBadValue, StopsWithAMessageNamingVariableValueAndWhatIsAllowed) {
  const auto& p = GetParam();
  std::map<std::string, std::string> vars{{p.name, p.value}};
  if (std::string(p.name) == "R2CCL_RANK") vars["R2CCL_NRANKS"] = "2";
  auto c = parse_config(env_of(vars));
  ASSERT_FALSE(c.is_ok()) << p.name << "=" << p.value << " was accepted";
  EXPECT_EQ(c.status().code(), ErrorCode::kConfig);
  const std::string m = c.status().message();
  EXPECT_NE(m.find(p.name), std::string::npos) << m;
  EXPECT_NE(m.find(std::string("'") + p.value + "'"), std::string::npos) << m;
  EXPECT_NE(m.find(p.allowed), std::string::npos) << m;
}

INSTANTIATE_TEST_SUITE_P(
    EveryVariable, ConfigBadValue,
    testing::Values(BadValue{"R2CCL_LOG", "loud", "one of error, warn, info, debug, trace"},
                    BadValue{"R2CCL_RANK", "2", "an integer from 0 to 1"},
                    BadValue{"R2CCL_RANK", "-1", "an integer from 0 to 1"},
                    BadValue{"R2CCL_NRANKS", "0", "an integer from 1"},
                    BadValue{"R2CCL_NRANKS", "two", "an integer from 1"},
                    BadValue{"R2CCL_BOOTSTRAP", "198.19.0.1", "host:port"},
                    BadValue{"R2CCL_BOOTSTRAP", "h:70000", "host:port"},
                    BadValue{"R2CCL_BOOTSTRAP_TOKEN", "abc", "32 hexadecimal digits"},
                    BadValue{"R2CCL_BOOTSTRAP_TOKEN", "zz112233445566778899aabbccddeeff",
                             "32 hexadecimal digits"},
                    BadValue{"R2CCL_BOOTSTRAP_TIMEOUT", "soon", "a duration"},
                    BadValue{"R2CCL_TIMEOUT", "5parsecs", "a duration"},
                    BadValue{"R2CCL_CONNECT_TIMEOUT", "1ms", "at least 10ms"},
                    BadValue{"R2CCL_NICS", "eth1,,eth2", "no empty entries"},
                    BadValue{"R2CCL_NICS", "eth1,eth1", "each NIC once"},
                    BadValue{"R2CCL_PROVIDER", "carrier-pigeon", "tcp"},
                    BadValue{"R2CCL_IB_RETRY_CNT", "7", "an integer from 0 to 6"},
                    BadValue{"R2CCL_IB_TIMEOUT", "0", "an integer from 1 to 31"},
                    BadValue{"R2CCL_IB_GID_INDEX", "-2", "an integer from 0 to 65535"},
                    BadValue{"R2CCL_CHUNK_SIZE", "abc", "a size from 4K to 64M"},
                    BadValue{"R2CCL_CHUNK_SIZE", "1K", "a size from 4K to 64M"},
                    BadValue{"R2CCL_DEGRADED_PROBE_BYTES", "4K",
                             "0 (no probe) or a size from 64K to 1G"},
                    BadValue{"R2CCL_DEGRADED_PROBE_BYTES", "2G", "a size from 0 to 1G"},
                    BadValue{"R2CCL_RAIL_WINDOW", "4K", "a size from 512K to 1G"},
                    BadValue{"R2CCL_REG_CACHE", "sometimes", "auto, on or off"},
                    BadValue{"R2CCL_REG_CACHE_BYTES", "64K", "a size from 1M to 256G"},
                    BadValue{"R2CCL_REG_CACHE_BYTES", "1T", "a size from 1M to 256G"}),
    [](const testing::TestParamInfo<BadValue>& i) {
      std::string n = std::string(i.param.name).substr(6) + "_" + std::to_string(i.index);
      return n;
    });

TEST(Config, SizesAndDurations) {
  EXPECT_EQ(*parse_size("4096"), 4096u);
  EXPECT_EQ(*parse_size("4k"), 4096u);
  EXPECT_EQ(*parse_size("2MiB"), 2u << 20);
  EXPECT_EQ(*parse_size("1G"), 1u << 30);
  EXPECT_FALSE(parse_size("99999999999999999999G").is_ok());
  EXPECT_FALSE(parse_size("12Q").is_ok());
  EXPECT_EQ(parse_duration("250ms")->count(), 250);
  EXPECT_EQ(parse_duration("2m")->count(), 120000);
  EXPECT_EQ(parse_duration("3")->count(), 3000);
  EXPECT_FALSE(parse_duration("3 fortnights").is_ok());
  EXPECT_EQ(format_size(512 * 1024), "512K");
  EXPECT_EQ(format_size(1000), "1000");
}

// A variable bounded by another follows it when only the other is set, so that no single
// setting makes an inconsistent configuration.
TEST(Config, BoundedVariablesFollowTheirBoundWhenUnset) {
  auto slow_probes = parse_config(test::env_of({{"R2CCL_PROBE_INTERVAL", "1s"}}));
  ASSERT_TRUE(slow_probes.is_ok()) << slow_probes.status().to_string();
  EXPECT_EQ(slow_probes->probe_timeout, std::chrono::milliseconds(10000));
  auto long_holddown = parse_config(test::env_of({{"R2CCL_HOLDDOWN", "60s"}}));
  ASSERT_TRUE(long_holddown.is_ok());
  EXPECT_EQ(long_holddown->holddown_max, std::chrono::milliseconds(60000));
  auto big_chunks = parse_config(test::env_of({{"R2CCL_CHUNK_SIZE", "64M"}}));
  ASSERT_TRUE(big_chunks.is_ok());
  EXPECT_EQ(big_chunks->rail_window, std::size_t{64} << 20);
  // Set explicitly, the bound is still enforced, naming the variable.
  auto both = parse_config(
      test::env_of({{"R2CCL_PROBE_INTERVAL", "1s"}, {"R2CCL_PROBE_TIMEOUT", "500ms"}}));
  ASSERT_FALSE(both.is_ok());
  EXPECT_NE(both.status().message().find("R2CCL_PROBE_TIMEOUT"), std::string::npos)
      << both.status().message();
}

TEST(Config, RegistrationCache) {
  auto d = parse_config(test::env_of({}));
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->reg_cache, "auto");
  EXPECT_EQ(d->reg_cache_bytes, std::size_t{1} << 30);
  auto c =
      parse_config(test::env_of({{"R2CCL_REG_CACHE", " On "}, {"R2CCL_REG_CACHE_BYTES", "4G"}}));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->reg_cache, "on");
  EXPECT_EQ(c->reg_cache_bytes, std::size_t{4} << 30);
  auto off = parse_config(test::env_of({{"R2CCL_REG_CACHE", "off"}}));
  ASSERT_TRUE(off.is_ok());
  EXPECT_EQ(off->reg_cache, "off");
}

// docs/CONFIGURATION.md is the reference the code generates, byte for byte.
TEST(Config, ReferenceIsTheCodesTable) {
  std::ifstream in(std::string(R2CCL_SOURCE_DIR) + "/docs/CONFIGURATION.md");
  ASSERT_TRUE(in.good()) << "docs/CONFIGURATION.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(ss.str(), config_reference_markdown())
      << "docs/CONFIGURATION.md differs from the code's table; regenerate it with "
         "`build/bin/r2ccl-perf --print-config-reference > docs/CONFIGURATION.md`";
}

// A peer that can make a line be logged (a refused connection) cannot flood the log: a call site
// writes at most kBurst lines per window, and the next line after a pause counts those held back.
// The first world's rank names the process's lines; a later one (a split) does not relabel them.
TEST(Log, TheFirstRankClaimedNamesTheProcess) {
  const int before = log_rank();
  set_log_rank(-1);
  EXPECT_TRUE(claim_log_rank(3));
  EXPECT_EQ(log_rank(), 3);
  EXPECT_FALSE(claim_log_rank(1));
  EXPECT_EQ(log_rank(), 3);
  set_log_rank(before);
}

TEST(LogLimiter, WritesABurstThenCountsWhatItHoldsBack) {
  LogLimiter limiter;
  const auto t0 = LogLimiter::Clock::time_point{} + std::chrono::hours(1);
  std::uint64_t dropped = 99;
  for (int i = 0; i < LogLimiter::kBurst; ++i) {
    ASSERT_TRUE(limiter.admit(t0 + std::chrono::milliseconds(i), dropped)) << i;
    EXPECT_EQ(dropped, 0u);
  }
  for (int i = 0; i < 1000; ++i)
    ASSERT_FALSE(limiter.admit(t0 + std::chrono::seconds(1), dropped)) << i;
  ASSERT_FALSE(limiter.admit(t0 + LogLimiter::kWindow - std::chrono::milliseconds(1), dropped));
  ASSERT_TRUE(limiter.admit(t0 + LogLimiter::kWindow, dropped));
  EXPECT_EQ(dropped, 1001u);
  ASSERT_TRUE(limiter.admit(t0 + LogLimiter::kWindow, dropped));
  EXPECT_EQ(dropped, 0u);
}

}  // namespace
}  // namespace r2ccl

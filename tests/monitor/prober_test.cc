#include "r2ccl/monitor/prober.h"

#include <gtest/gtest.h>

#include <thread>

#include "net_util.h"

namespace r2ccl::mon {
namespace {

using std::chrono::milliseconds;

ProbeTarget loopback_target(std::uint16_t port) {
  ProbeSpec spec;
  spec.device = "lo";
  spec.peer = "127.0.0.1";
  spec.port = port;
  spec.port_given = true;
  return ProbeTarget{spec, "127.0.0.1"};
}

// Polls `status` until `done` holds for the first target (at most 10 s).
template <typename Done>
ProbeStatus wait_for(const Prober& p, Done done) {
  ProbeStatus s;
  for (int i = 0; i < 200; ++i) {
    s = p.status().at(0);
    if (done(s)) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return s;
}

TEST(Prober, EchoAndProbeOverLoopback) {
  ProberConfig config;
  config.echo_port = 0;  // any free port
  config.echo_address = "127.0.0.1";
  config.interval = milliseconds(10);
  config.timeout = milliseconds(500);
  config.window = 10;
  auto responder = Prober::start(config);
  ASSERT_TRUE(responder) << responder.status().to_string();
  const std::uint16_t port = (*responder)->echo_port();
  ASSERT_NE(port, 0);

  ProberConfig probing = config;
  probing.echo_port = std::nullopt;
  probing.targets = {loopback_target(port)};
  auto prober = Prober::start(probing);
  ASSERT_TRUE(prober) << prober.status().to_string();
  EXPECT_EQ((*prober)->echo_port(), 0);
  const auto s = wait_for(**prober, [](const ProbeStatus& st) {
    return st.stats.window_count >= 10 && st.stats.loss_ratio == 0.0;
  });
  EXPECT_EQ(s.device, "lo");
  EXPECT_EQ(s.peer, "127.0.0.1:" + std::to_string(port));
  EXPECT_EQ(s.stats.window_count, 10u);
  EXPECT_EQ(s.stats.loss_ratio, 0.0);
  ASSERT_TRUE(s.stats.rtt_mean_seconds.has_value());
  EXPECT_GT(*s.stats.rtt_mean_seconds, 0.0);
  EXPECT_LT(*s.stats.rtt_mean_seconds, 0.5);
  EXPECT_FALSE(s.degraded);
  EXPECT_GE((*responder)->echo_replies(), 10u);
}

TEST(Prober, NoResponderMeansLossAndDegraded) {
  const std::uint16_t port = test::free_port(/*udp=*/true);
  ASSERT_NE(port, 0);
  ProberConfig config;
  config.echo_port = std::nullopt;
  config.interval = milliseconds(10);
  config.timeout = milliseconds(50);
  config.window = 5;
  config.targets = {loopback_target(port)};
  auto prober = Prober::start(config);
  ASSERT_TRUE(prober) << prober.status().to_string();
  const auto s =
      wait_for(**prober, [](const ProbeStatus& st) { return st.stats.window_count >= 5; });
  EXPECT_EQ(s.stats.loss_ratio, 1.0);
  EXPECT_FALSE(s.stats.rtt_mean_seconds.has_value());
  EXPECT_TRUE(s.degraded);
}

TEST(Prober, UnusableSourceAddressCountsAsLoss) {
  ProberConfig config;
  config.echo_port = std::nullopt;
  config.interval = milliseconds(10);
  config.window = 4;
  ProbeTarget t = loopback_target(9);
  t.local_address = "not-an-address";
  config.targets = {t};
  auto prober = Prober::start(config);  // starts anyway: the NIC may get its address later
  ASSERT_TRUE(prober) << prober.status().to_string();
  const auto s =
      wait_for(**prober, [](const ProbeStatus& st) { return st.stats.window_count >= 4; });
  EXPECT_EQ(s.stats.loss_ratio, 1.0);
  EXPECT_TRUE(s.degraded);
}

TEST(Prober, EchoPortInUseIsNamed) {
  const std::uint16_t port = test::free_port(/*udp=*/true);
  ASSERT_NE(port, 0);
  test::PortHolder holder(port, /*udp=*/true);
  ASSERT_TRUE(holder.ok());
  ProberConfig config;
  config.echo_port = port;
  config.echo_address = "127.0.0.1";
  auto prober = Prober::start(config);
  ASSERT_FALSE(prober);
  EXPECT_NE(prober.status().message().find(std::to_string(port)), std::string::npos)
      << prober.status().message();
  EXPECT_NE(prober.status().message().find("already in use"), std::string::npos)
      << prober.status().message();
}

TEST(Prober, StopsPromptly) {
  ProberConfig config;
  config.echo_port = 0;
  config.echo_address = "127.0.0.1";
  config.interval = std::chrono::seconds(30);
  config.targets = {loopback_target(9)};
  auto prober = Prober::start(config);
  ASSERT_TRUE(prober);
  const auto t0 = std::chrono::steady_clock::now();
  prober->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

}  // namespace
}  // namespace r2ccl::mon

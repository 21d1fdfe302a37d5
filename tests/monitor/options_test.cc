#include "r2ccl/monitor/options.h"

#include <gtest/gtest.h>

#include <initializer_list>

#include "fake_sysfs.h"
#include "r2ccl/monitor/collector.h"

namespace r2ccl::mon {
namespace {

using test::FakeSysfs;

CommandLine parse(std::initializer_list<const char*> args) {
  std::vector<const char*> argv = {"r2ccl-monitor"};
  argv.insert(argv.end(), args.begin(), args.end());
  return parse_command_line(static_cast<int>(argv.size()), argv.data());
}

void expect_usage_error(const CommandLine& cl, const std::string& mentions) {
  EXPECT_FALSE(cl.options.has_value());
  EXPECT_EQ(cl.exit_code, kExitUsage);
  EXPECT_NE(cl.output.find(mentions), std::string::npos) << cl.output;
}

TEST(CommandLine, Defaults) {
  const auto cl = parse({"--listen", "127.0.0.1:9464"});
  ASSERT_TRUE(cl.options) << cl.output;
  const auto& o = *cl.options;
  EXPECT_EQ(o.listen.host, "127.0.0.1");
  EXPECT_EQ(o.listen.port, 9464);
  EXPECT_TRUE(o.nics.empty());
  EXPECT_TRUE(o.probes.empty());
  EXPECT_EQ(o.probe_interval, std::chrono::milliseconds(100));
  EXPECT_EQ(o.probe_timeout, std::chrono::milliseconds(1000));
  EXPECT_EQ(o.probe_window, 20u);
  EXPECT_EQ(o.echo_port, kDefaultEchoPort);
  EXPECT_EQ(o.sysfs_root, "/sys");
}

TEST(CommandLine, Everything) {
  const auto cl = parse({"--listen",
                         "0.0.0.0:9100",
                         "--nics",
                         "eth1,eth2,eth1",
                         "--probe",
                         "eth1=198.18.1.2",
                         "--probe",
                         "eth2=198.18.2.2:4000",
                         "--probe-interval",
                         "250ms",
                         "--probe-timeout",
                         "2s",
                         "--probe-window",
                         "8",
                         "--echo-port",
                         "4001",
                         "--sysfs-root",
                         "/tmp/x",
                         "--log",
                         "debug"});
  ASSERT_TRUE(cl.options) << cl.output;
  const auto& o = *cl.options;
  EXPECT_EQ(o.nics, (std::vector<std::string>{"eth1", "eth2"}));
  ASSERT_EQ(o.probes.size(), 2u);
  EXPECT_EQ(o.probes[0].port, 4001);  // follows --echo-port
  EXPECT_EQ(o.probes[1].port, 4000);
  EXPECT_EQ(o.probe_interval, std::chrono::milliseconds(250));
  EXPECT_EQ(o.probe_timeout, std::chrono::milliseconds(2000));
  EXPECT_EQ(o.probe_window, 8u);
  EXPECT_EQ(o.echo_port, 4001);
  EXPECT_EQ(o.sysfs_root, "/tmp/x");
  EXPECT_EQ(o.log_level, LogLevel::kDebug);
}

TEST(CommandLine, HelpAndVersion) {
  auto cl = parse({"--help"});
  EXPECT_FALSE(cl.options);
  EXPECT_EQ(cl.exit_code, 0);
  EXPECT_NE(cl.output.find("--probe-interval"), std::string::npos) << cl.output;
  cl = parse({"--version"});
  EXPECT_EQ(cl.exit_code, 0);
  EXPECT_NE(cl.output.find(monitor_version()), std::string::npos) << cl.output;
}

TEST(CommandLine, Errors) {
  expect_usage_error(parse({}), "--listen");
  expect_usage_error(parse({"--listen", "9464"}), "'9464'");
  expect_usage_error(parse({"--listen", "localhost:9464"}), "'localhost:9464'");
  expect_usage_error(parse({"--listen", "127.0.0.1:0"}), "'127.0.0.1:0'");
  expect_usage_error(parse({"--listen", "127.0.0.1:70000"}), "'127.0.0.1:70000'");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--bogus"}), "--bogus");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--probe", "eth1"}), "'eth1'");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--probe-interval", "soon"}),
                     "--probe-interval 'soon'");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--probe-interval", "0ms"}),
                     "--probe-interval '0ms'");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--probe-timeout", "5m"}),
                     "--probe-timeout '5m'");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--probe-window", "0"}),
                     "--probe-window 0");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--echo-port", "70000"}),
                     "--echo-port 70000");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--log", "loud"}), "'loud'");
  expect_usage_error(parse({"--listen", "127.0.0.1:9464", "--probe", "eth1=198.18.1.2", "--probe",
                            "eth1=198.18.1.2"}),
                     "twice");
}

Result<std::string> fake_address(const std::string& device) {
  if (device == "eth1") return std::string("198.18.1.1");
  if (device == "eth2") return std::string("198.18.2.1");
  return Status(ErrorCode::kNotFound, "interface '" + device + "' has no IPv4 address");
}

class PlanTest : public ::testing::Test {
 protected:
  PlanTest() {
    fake.add_nic("eth1", true);
    fake.add_nic("eth2", true);
    fake.add_nic("eth3", true);
  }
  Result<MonitorPlan> plan(std::initializer_list<const char*> args) {
    std::vector<const char*> all = {"--listen", "127.0.0.1:9464"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<const char*> argv = {"r2ccl-monitor"};
    argv.insert(argv.end(), all.begin(), all.end());
    const auto cl = parse_command_line(static_cast<int>(argv.size()), argv.data());
    EXPECT_TRUE(cl.options) << cl.output;
    if (!cl.options) return Status(ErrorCode::kInvalidArgument, cl.output);
    return plan_monitor(*cl.options, SysfsReader(fake.root()), fake_address);
  }
  FakeSysfs fake;
};

TEST_F(PlanTest, Resolves) {
  auto p = plan({"--nics", "eth1,eth2", "--probe", "eth1=198.18.1.2", "--probe-window", "5"});
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ(p->nics, (std::vector<std::string>{"eth1", "eth2"}));
  ASSERT_EQ(p->prober.targets.size(), 1u);
  EXPECT_EQ(p->prober.targets[0].local_address, "198.18.1.1");
  EXPECT_EQ(p->prober.targets[0].spec.peer, "198.18.1.2");
  EXPECT_EQ(p->prober.window, 5u);
  EXPECT_EQ(p->prober.echo_port, kDefaultEchoPort);
  p = plan({"--echo-port", "0"});
  ASSERT_TRUE(p);
  EXPECT_FALSE(p->prober.echo_port.has_value());
}

TEST_F(PlanTest, UnknownNicIsNamed) {
  auto p = plan({"--nics", "eth1,eth9"});
  ASSERT_FALSE(p);
  EXPECT_NE(p.status().message().find("unknown NIC 'eth9'"), std::string::npos)
      << p.status().message();
  EXPECT_NE(p.status().message().find("eth1, eth2, eth3"), std::string::npos)
      << p.status().message();
  p = plan({"--probe", "eth7=198.18.1.2"});
  ASSERT_FALSE(p);
  EXPECT_NE(p.status().message().find("unknown NIC 'eth7' in --probe"), std::string::npos)
      << p.status().message();
}

TEST_F(PlanTest, ProbeNicOutsideNics) {
  auto p = plan({"--nics", "eth1", "--probe", "eth2=198.18.2.2"});
  ASSERT_FALSE(p);
  EXPECT_NE(p.status().message().find("'eth2' is not in --nics"), std::string::npos)
      << p.status().message();
}

TEST_F(PlanTest, ProbeNicWithoutAddress) {
  auto p = plan({"--probe", "eth3=198.18.3.2"});
  ASSERT_FALSE(p);
  EXPECT_NE(p.status().message().find("eth3"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("no IPv4 address"), std::string::npos)
      << p.status().message();
}

}  // namespace
}  // namespace r2ccl::mon

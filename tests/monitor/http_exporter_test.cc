#include "r2ccl/monitor/http_exporter.h"

#include <gtest/gtest.h>

#include "fake_sysfs.h"
#include "net_util.h"
#include "r2ccl/monitor/collector.h"

namespace r2ccl::mon {
namespace {

TEST(HttpExporter, ServesMetricsAndHealthz) {
  test::FakeSysfs fake;
  fake.add_nic("eth1", true);
  auto collector = std::make_shared<NicHealthCollector>(SysfsReader(fake.root()),
                                                        std::vector<std::string>{}, nullptr);
  const std::uint16_t port = test::free_port();
  ASSERT_NE(port, 0);
  auto http = HttpExporter::start(HostPort{"127.0.0.1", port}, collector);
  ASSERT_TRUE(http) << http.status().to_string();
  EXPECT_EQ((*http)->port(), port);

  const std::string health = test::http_get(port, "/healthz");
  EXPECT_EQ(health.rfind("HTTP/1.1 200", 0), 0u) << health;
  EXPECT_EQ(health.substr(health.size() - 3), "ok\n") << health;

  std::string metrics = test::http_get(port, "/metrics");
  EXPECT_EQ(metrics.rfind("HTTP/1.1 200", 0), 0u) << metrics;
  EXPECT_NE(metrics.find("r2ccl_nic_up{device=\"eth1\"} 1"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("# HELP r2ccl_build_info"), std::string::npos) << metrics;

  fake.set_link("eth1", false);  // shows on the very next scrape
  metrics = test::http_get(port, "/metrics");
  EXPECT_NE(metrics.find("r2ccl_nic_up{device=\"eth1\"} 0"), std::string::npos) << metrics;

  const std::string missing = test::http_get(port, "/nothing-here");
  EXPECT_NE(missing.find(" 404 "), std::string::npos) << missing;
}

TEST(HttpExporter, PortInUseIsNamed) {
  const std::uint16_t port = test::free_port();
  ASSERT_NE(port, 0);
  test::PortHolder holder(port, /*udp=*/false);
  ASSERT_TRUE(holder.ok());
  auto collector = std::make_shared<NicHealthCollector>(SysfsReader("/nonexistent"),
                                                        std::vector<std::string>{}, nullptr);
  auto http = HttpExporter::start(HostPort{"127.0.0.1", port}, collector);
  ASSERT_FALSE(http);
  const std::string msg = http.status().message();
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
  EXPECT_NE(msg.find("already in use"), std::string::npos) << msg;
}

TEST(HttpExporter, BadAddressIsNamed) {
  auto collector = std::make_shared<NicHealthCollector>(SysfsReader("/nonexistent"),
                                                        std::vector<std::string>{}, nullptr);
  auto http = HttpExporter::start(HostPort{"not-an-ip", 9464}, collector);
  ASSERT_FALSE(http);
  EXPECT_NE(http.status().message().find("'not-an-ip'"), std::string::npos)
      << http.status().message();
}

}  // namespace
}  // namespace r2ccl::mon

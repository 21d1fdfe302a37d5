#include "r2ccl/monitor/collector.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include <map>
#include <set>

#include "fake_sysfs.h"

namespace r2ccl::mon {
namespace {

using prometheus::MetricFamily;
using test::FakeSysfs;

// value of family `name` for the sample whose labels include all of `labels`.
std::optional<double> value(const std::vector<MetricFamily>& families, const std::string& name,
                            const std::map<std::string, std::string>& labels) {
  for (const auto& f : families) {
    if (f.name != name) continue;
    for (const auto& m : f.metric) {
      bool match = true;
      for (const auto& [k, v] : labels) {
        bool found = false;
        for (const auto& l : m.label)
          found = found || (l.name == k && l.value == v);
        match = match && found;
      }
      if (!match) continue;
      return f.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    }
  }
  return std::nullopt;
}

const MetricFamily* family(const std::vector<MetricFamily>& families, const std::string& name) {
  for (const auto& f : families)
    if (f.name == name) return &f;
  return nullptr;
}

ProbeStatus probe(const std::string& device, const std::string& peer, double loss,
                  std::optional<double> rtt, bool degraded) {
  ProbeStatus s;
  s.device = device;
  s.peer = peer;
  s.stats.loss_ratio = loss;
  s.stats.rtt_mean_seconds = rtt;
  s.degraded = degraded;
  return s;
}

TEST(Collector, ExportsTheDocumentedFamiliesWithHelp) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  NicHealthCollector c(SysfsReader(fake.root()), {}, nullptr);
  const auto families = c.Collect();
  const std::set<std::string> want = {"r2ccl_build_info",
                                      "r2ccl_nic_up",
                                      "r2ccl_nic_degraded",
                                      "r2ccl_nic_carrier_changes_total",
                                      "r2ccl_nic_speed_bytes_per_second",
                                      "r2ccl_nic_rx_bytes_total",
                                      "r2ccl_nic_tx_bytes_total",
                                      "r2ccl_nic_errors_total",
                                      "r2ccl_nic_probe_rtt_seconds",
                                      "r2ccl_nic_probe_loss_ratio"};
  std::set<std::string> got;
  for (const auto& f : families) {
    got.insert(f.name);
    EXPECT_FALSE(f.help.empty()) << f.name;
    const bool is_counter = f.name.size() > 6 && f.name.substr(f.name.size() - 6) == "_total";
    EXPECT_EQ(f.type == prometheus::MetricType::Counter, is_counter) << f.name;
  }
  EXPECT_EQ(got, want);  // no verbs device in the fake tree: no r2ccl_ib_* families
  EXPECT_EQ(value(families, "r2ccl_build_info", {{"version", monitor_version()}}), 1.0);
  // The documented table lists every exported family.
  std::set<std::string> documented;
  for (const auto& f : exported_families())
    documented.insert(f.name);
  for (const auto& name : want)
    EXPECT_TRUE(documented.count(name)) << name;
}

TEST(Collector, NicValues) {
  FakeSysfs fake;
  fake.add_nic("eth1", true, 100000);
  fake.add_nic("eth2", false, -1);
  fake.add_loopback();
  fake.set_stat("eth1", "rx_bytes", 100);
  fake.set_stat("eth1", "tx_bytes", 200);
  fake.set_stat("eth1", "rx_dropped", 3);
  fake.write("class/net/eth1/carrier_changes", "6");
  NicHealthCollector c(SysfsReader(fake.root()), {}, nullptr);
  const auto f = c.Collect();
  EXPECT_EQ(value(f, "r2ccl_nic_up", {{"device", "eth1"}}), 1.0);
  EXPECT_EQ(value(f, "r2ccl_nic_up", {{"device", "eth2"}}), 0.0);
  EXPECT_FALSE(value(f, "r2ccl_nic_up", {{"device", "lo"}}));  // loopback is not exported
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth1"}}), 0.0);
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth2"}}), 1.0);  // link down
  EXPECT_EQ(value(f, "r2ccl_nic_speed_bytes_per_second", {{"device", "eth1"}}), 12.5e9);
  EXPECT_FALSE(value(f, "r2ccl_nic_speed_bytes_per_second", {{"device", "eth2"}}));
  EXPECT_EQ(value(f, "r2ccl_nic_carrier_changes_total", {{"device", "eth1"}}), 6.0);
  EXPECT_EQ(value(f, "r2ccl_nic_rx_bytes_total", {{"device", "eth1"}}), 100.0);
  EXPECT_EQ(value(f, "r2ccl_nic_tx_bytes_total", {{"device", "eth1"}}), 200.0);
  EXPECT_EQ(value(f, "r2ccl_nic_errors_total",
                  {{"device", "eth1"}, {"direction", "rx"}, {"kind", "dropped"}}),
            3.0);
  EXPECT_EQ(value(f, "r2ccl_nic_errors_total",
                  {{"device", "eth1"}, {"direction", "tx"}, {"kind", "errors"}}),
            0.0);
}

TEST(Collector, LinkChangeShowsOnTheNextScrape) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  NicHealthCollector c(SysfsReader(fake.root()), {"eth1"}, nullptr);
  EXPECT_EQ(value(c.Collect(), "r2ccl_nic_up", {{"device", "eth1"}}), 1.0);
  fake.set_link("eth1", false);
  EXPECT_EQ(value(c.Collect(), "r2ccl_nic_up", {{"device", "eth1"}}), 0.0);
  fake.set_link("eth1", true);
  EXPECT_EQ(value(c.Collect(), "r2ccl_nic_up", {{"device", "eth1"}}), 1.0);
}

TEST(Collector, RestrictedNicsAndVanishedNic) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  fake.add_nic("eth2", true);
  NicHealthCollector c(SysfsReader(fake.root()), {"eth2"}, nullptr);
  auto f = c.Collect();
  EXPECT_FALSE(value(f, "r2ccl_nic_up", {{"device", "eth1"}}));
  EXPECT_EQ(value(f, "r2ccl_nic_up", {{"device", "eth2"}}), 1.0);
  fake.remove("class/net/eth2");  // unplugged / driver unloaded
  f = c.Collect();
  EXPECT_EQ(value(f, "r2ccl_nic_up", {{"device", "eth2"}}), 0.0);
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth2"}}), 1.0);
  EXPECT_FALSE(value(f, "r2ccl_nic_rx_bytes_total", {{"device", "eth2"}}));
}

TEST(Collector, ProbesMakeANicDegraded) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  fake.add_nic("eth2", true);
  std::vector<ProbeStatus> probes = {probe("eth1", "198.18.1.2", 0.0, 0.0002, false),
                                     probe("eth2", "198.18.2.2", 0.75, 0.0003, true)};
  NicHealthCollector c(SysfsReader(fake.root()), {}, [&] { return probes; });
  auto f = c.Collect();
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth1"}}), 0.0);
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth2"}}), 1.0);
  EXPECT_EQ(value(f, "r2ccl_nic_up", {{"device", "eth2"}}), 1.0);  // the link is fine
  EXPECT_EQ(value(f, "r2ccl_nic_probe_loss_ratio", {{"device", "eth2"}, {"peer", "198.18.2.2"}}),
            0.75);
  EXPECT_EQ(value(f, "r2ccl_nic_probe_rtt_seconds", {{"device", "eth1"}, {"peer", "198.18.1.2"}}),
            0.0002);
  // No answered probe: no RTT sample, but the loss is there.
  probes = {probe("eth1", "198.18.1.2", 1.0, std::nullopt, true)};
  f = c.Collect();
  EXPECT_FALSE(value(f, "r2ccl_nic_probe_rtt_seconds", {{"device", "eth1"}}));
  EXPECT_EQ(value(f, "r2ccl_nic_probe_loss_ratio", {{"device", "eth1"}}), 1.0);
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth1"}}), 1.0);
  EXPECT_EQ(value(f, "r2ccl_nic_degraded", {{"device", "eth2"}}), 0.0);
}

TEST(Collector, VerbsPorts) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  fake.add_ib_port("mlx5_0", "1", true);
  fake.add_ib_port("mlx5_1", "1", false);
  NicHealthCollector c(SysfsReader(fake.root()), {}, nullptr);
  const auto f = c.Collect();
  EXPECT_EQ(value(f, "r2ccl_ib_port_up", {{"device", "mlx5_0"}, {"port", "1"}}), 1.0);
  EXPECT_EQ(value(f, "r2ccl_ib_port_up", {{"device", "mlx5_1"}, {"port", "1"}}), 0.0);
  EXPECT_EQ(value(f, "r2ccl_ib_port_rate_bytes_per_second", {{"device", "mlx5_0"}}), 12.5e9);
  EXPECT_EQ(value(f, "r2ccl_ib_port_rx_bytes_total", {{"device", "mlx5_0"}}), 4000.0);
  EXPECT_EQ(value(f, "r2ccl_ib_port_errors_total", {{"device", "mlx5_0"}, {"kind", "link_downed"}}),
            1.0);
  ASSERT_NE(family(f, "r2ccl_ib_port_up"), nullptr);
  EXPECT_FALSE(family(f, "r2ccl_ib_port_up")->help.empty());
}

TEST(Collector, TextExposition) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  NicHealthCollector c(SysfsReader(fake.root()), {}, [] {
    return std::vector<ProbeStatus>{probe("eth1", "198.18.1.2", 0.0, 0.001, false)};
  });
  const std::string text = prometheus::TextSerializer().Serialize(c.Collect());
  EXPECT_NE(text.find("# HELP r2ccl_nic_up "), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE r2ccl_nic_rx_bytes_total counter"), std::string::npos) << text;
  EXPECT_NE(text.find("r2ccl_nic_up{device=\"eth1\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("r2ccl_nic_probe_loss_ratio{device=\"eth1\",peer=\"198.18.1.2\"} 0"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace r2ccl::mon

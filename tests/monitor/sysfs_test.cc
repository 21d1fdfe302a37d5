#include "r2ccl/monitor/sysfs.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "fake_sysfs.h"

namespace r2ccl::mon {
namespace {

using test::FakeSysfs;

std::optional<std::uint64_t> error_value(const NicReading& r, const std::string& direction,
                                         const std::string& kind) {
  for (const auto& e : r.errors)
    if (e.direction == direction && e.kind == kind) return e.value;
  return std::nullopt;
}

TEST(Sysfs, ReadsAnUpNic) {
  FakeSysfs fake;
  fake.add_nic("eth1", true, 25000);
  fake.set_stat("eth1", "rx_bytes", 1234);
  fake.set_stat("eth1", "tx_bytes", 5678);
  fake.set_stat("eth1", "rx_crc_errors", 7);
  fake.set_stat("eth1", "tx_dropped", 9);
  fake.write("class/net/eth1/carrier_changes", "4");
  SysfsReader reader(fake.root());
  const NicReading r = reader.read_nic("eth1");
  EXPECT_TRUE(r.present);
  EXPECT_TRUE(r.up);
  EXPECT_EQ(r.operstate, "up");
  ASSERT_TRUE(r.carrier.has_value());
  EXPECT_TRUE(*r.carrier);
  ASSERT_TRUE(r.speed_bytes_per_second.has_value());
  EXPECT_DOUBLE_EQ(*r.speed_bytes_per_second, 25000e6 / 8);
  EXPECT_EQ(r.carrier_changes, 4u);
  EXPECT_EQ(r.rx_bytes, 1234u);
  EXPECT_EQ(r.tx_bytes, 5678u);
  EXPECT_EQ(error_value(r, "rx", "crc"), 7u);
  EXPECT_EQ(error_value(r, "tx", "dropped"), 9u);
  EXPECT_EQ(error_value(r, "rx", "errors"), 0u);
  // Counters the device does not have are left out, not reported as 0.
  EXPECT_FALSE(error_value(r, "tx", "heartbeat").has_value());
}

TEST(Sysfs, DownLinkAndUnknownSpeed) {
  FakeSysfs fake;
  fake.add_nic("eth2", false, -1);
  SysfsReader reader(fake.root());
  const NicReading r = reader.read_nic("eth2");
  EXPECT_TRUE(r.present);
  EXPECT_FALSE(r.up);
  EXPECT_EQ(r.operstate, "down");
  EXPECT_FALSE(r.carrier.has_value());
  EXPECT_FALSE(r.speed_bytes_per_second.has_value());
}

TEST(Sysfs, CarrierWithoutOperUpIsNotUp) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  fake.write("class/net/eth1/operstate", "lowerlayerdown");
  EXPECT_FALSE(SysfsReader(fake.root()).read_nic("eth1").up);
  fake.write("class/net/eth1/operstate", "unknown");  // tun, dummy: no operstate, carrier 1
  EXPECT_TRUE(SysfsReader(fake.root()).read_nic("eth1").up);
  fake.write("class/net/eth1/operstate", "up");
  fake.write("class/net/eth1/carrier", "0");
  EXPECT_FALSE(SysfsReader(fake.root()).read_nic("eth1").up);
}

TEST(Sysfs, EveryReadIsFresh) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  SysfsReader reader(fake.root());
  EXPECT_TRUE(reader.read_nic("eth1").up);
  fake.set_link("eth1", false);
  EXPECT_FALSE(reader.read_nic("eth1").up);
  fake.set_link("eth1", true);
  EXPECT_TRUE(reader.read_nic("eth1").up);
}

TEST(Sysfs, MissingNic) {
  FakeSysfs fake;
  fake.add_nic("eth1", true);
  SysfsReader reader(fake.root());
  EXPECT_FALSE(reader.has_nic("eth9"));
  EXPECT_FALSE(reader.has_nic("../net"));
  EXPECT_FALSE(reader.has_nic(""));
  const NicReading r = reader.read_nic("eth9");
  EXPECT_FALSE(r.present);
  EXPECT_FALSE(r.up);
  EXPECT_FALSE(r.rx_bytes.has_value());
}

TEST(Sysfs, DefaultNicsSkipLoopback) {
  FakeSysfs fake;
  fake.add_loopback("lo");
  fake.add_nic("eth2", true);
  fake.add_nic("eth1", false);
  SysfsReader reader(fake.root());
  EXPECT_EQ(reader.all_nics(), (std::vector<std::string>{"eth1", "eth2", "lo"}));
  EXPECT_EQ(reader.default_nics(), (std::vector<std::string>{"eth1", "eth2"}));
  EXPECT_TRUE(reader.is_loopback("lo"));
  EXPECT_FALSE(reader.is_loopback("eth1"));
}

TEST(Sysfs, NoSysfsAtAll) {
  SysfsReader reader("/nonexistent/r2ccl-sysfs");
  EXPECT_TRUE(reader.all_nics().empty());
  EXPECT_TRUE(reader.read_ib_ports().empty());
}

TEST(Sysfs, IbPorts) {
  FakeSysfs fake;
  fake.add_ib_port("mlx5_0", "1", true);
  fake.add_ib_port("mlx5_1", "1", false);
  SysfsReader reader(fake.root());
  const auto ports = reader.read_ib_ports();
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_EQ(ports[0].device, "mlx5_0");
  EXPECT_EQ(ports[0].port, "1");
  EXPECT_EQ(ports[0].state, "ACTIVE");
  EXPECT_TRUE(ports[0].active);
  EXPECT_FALSE(ports[1].active);
  EXPECT_EQ(ports[1].state, "DOWN");
  ASSERT_TRUE(ports[0].rate_bytes_per_second.has_value());
  EXPECT_DOUBLE_EQ(*ports[0].rate_bytes_per_second, 100e9 / 8);
  EXPECT_EQ(ports[0].rx_bytes, 4000u);  // 32-bit words
  EXPECT_EQ(ports[0].tx_bytes, 1000u);
  const auto symbol = std::find_if(ports[0].errors.begin(), ports[0].errors.end(),
                                   [](const auto& e) { return e.kind == "symbol_error"; });
  ASSERT_NE(symbol, ports[0].errors.end());
  EXPECT_EQ(symbol->value, 3u);
}

TEST(Sysfs, ParseIbRate) {
  EXPECT_DOUBLE_EQ(parse_ib_rate("100 Gb/sec (4X EDR)").value(), 12.5e9);
  EXPECT_DOUBLE_EQ(parse_ib_rate("2.5 Gb/sec (1X SDR)").value(), 2.5e9 / 8);
  EXPECT_DOUBLE_EQ(parse_ib_rate("10 Mb/sec").value(), 10e6 / 8);
  EXPECT_FALSE(parse_ib_rate("fast").has_value());
  EXPECT_FALSE(parse_ib_rate("x Gb/sec").has_value());
  EXPECT_FALSE(parse_ib_rate("100 furlongs").has_value());
}

}  // namespace
}  // namespace r2ccl::mon

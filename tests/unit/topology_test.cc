#include <gtest/gtest.h>

#include <algorithm>

#include "r2ccl/runtime/topology.h"

namespace r2ccl {
namespace {

TEST(Topology, FindsLoopbackWithItsAddress) {
  auto t = discover_topology();
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  auto lo = std::find_if(t->interfaces.begin(), t->interfaces.end(),
                         [](const auto& i) { return i.name == "lo"; });
  ASSERT_NE(lo, t->interfaces.end());
  EXPECT_TRUE(lo->loopback);
  EXPECT_EQ(lo->ipv4, "127.0.0.1");
  EXPECT_TRUE(lo->pci_bus_id.empty());  // not a PCI device
  EXPECT_EQ(*interface_ipv4("lo"), "127.0.0.1");
}

TEST(Topology, UnknownInterfaceIsNamedWithWhatExists) {
  auto a = interface_ipv4("nosuch0");
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("no interface named 'nosuch0' on this host (have: "),
            std::string::npos);
  EXPECT_NE(a.status().message().find("lo"), std::string::npos);
}

TEST(Topology, RailsByNameAndByLocalAddress) {
  auto t = discover_topology();
  ASSERT_TRUE(t.is_ok());
  auto rails = select_rails(*t, {"lo", "127.0.0.12"}, "");
  ASSERT_TRUE(rails.is_ok()) << rails.status().to_string();
  ASSERT_EQ(rails->size(), 2u);
  EXPECT_EQ((*rails)[0].name, "lo");
  EXPECT_EQ((*rails)[0].address, "127.0.0.1");
  EXPECT_EQ((*rails)[1].name, "127.0.0.12");
  EXPECT_EQ((*rails)[1].address, "127.0.0.12");
}

TEST(Topology, BadRailEntriesAreNamed) {
  auto t = discover_topology();
  ASSERT_TRUE(t.is_ok());
  auto a = select_rails(*t, {"lo", "nosuch0"}, "");
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("R2CCL_NICS: no interface named 'nosuch0' on this host"),
            std::string::npos)
      << a.status().message();
  auto b = select_rails(*t, {"198.18.255.254"}, "");
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().message(), "R2CCL_NICS: '198.18.255.254' is not an address of this host");
}

// A NIC that is down is a rail all the same (rail i pairs NIC i of every host: a host that left
// one out would pair the wrong NICs); it joins once its link is up.
TEST(Topology, DefaultRailsSkipLoopbackAndTheControlInterfaceButKeepNicsThatAreDown) {
  Topology t;
  t.interfaces = {{"lo", "127.0.0.1", true, true, -1, "", ""},
                  {"eth0", "198.19.0.1", true, false, -1, "", ""},
                  {"eth1", "198.18.1.1", true, false, 0, "0000:17:00.0", "mlx5_0"},
                  {"eth2", "198.18.2.1", false, false, -1, "", ""},
                  {"eth3", "", true, false, -1, "", ""},
                  {"eth4", "198.18.4.1", true, false, 1, "", ""}};
  auto rails = select_rails(t, {}, "198.19.0.1");
  ASSERT_TRUE(rails.is_ok());
  ASSERT_EQ(rails->size(), 3u);
  EXPECT_EQ((*rails)[0].name, "eth1");
  EXPECT_EQ((*rails)[0].numa_node, 0);
  EXPECT_EQ((*rails)[0].pci_bus_id, "0000:17:00.0");
  EXPECT_EQ((*rails)[1].name, "eth2");
  EXPECT_EQ((*rails)[2].name, "eth4");

  Topology only_control;
  only_control.interfaces = {{"lo", "127.0.0.1", true, true, -1, "", ""},
                             {"eth0", "198.19.0.1", true, false, -1, "", ""}};
  auto none = select_rails(only_control, {}, "198.19.0.1");
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("no NIC to use as a rail"), std::string::npos);
  EXPECT_NE(none.status().message().find("set R2CCL_NICS"), std::string::npos);
}

}  // namespace
}  // namespace r2ccl

#include <gtest/gtest.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/topology.h"
#include "topology/link_watcher.h"

namespace r2ccl {
namespace {

TEST(Topology, ParsesExactlyADottedQuad) {
  using Quad = std::array<std::uint8_t, 4>;
  EXPECT_EQ(parse_ipv4("198.18.0.1"), (Quad{198, 18, 0, 1}));
  EXPECT_EQ(parse_ipv4("255.255.255.255"), (Quad{255, 255, 255, 255}));
  EXPECT_EQ(parse_ipv4("0.0.0.0"), (Quad{0, 0, 0, 0}));
  using namespace std::string_view_literals;
  for (std::string_view bad : {" 1.2.3.4"sv, "1. 2.3.4"sv, "1.2.3.4 "sv, "1.2.3"sv, "1.2.3.4.5"sv,
                               "256.1.1.1"sv, "+1.2.3.4"sv, "-1.2.3.4"sv, "1.2.3.4x"sv, ""sv,
                               "1.2.3.4\0junk"sv, "1111111111111111111.2.3.4"sv})
    EXPECT_FALSE(parse_ipv4(bad).has_value()) << bad;
}

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

TEST(Topology, HostAddressesAreEveryInterfaceAddressAndAllOfLoopback) {
  auto t = discover_topology();
  ASSERT_TRUE(t.is_ok());
  const auto mine = host_ipv4_addresses();
  for (const auto& i : t->interfaces) {
    if (i.ipv4.empty()) continue;
    EXPECT_NE(std::find(mine.begin(), mine.end(), i.ipv4), mine.end()) << i.name;
    EXPECT_TRUE(is_host_address(i.ipv4)) << i.name;
  }
  EXPECT_TRUE(is_host_address("127.0.0.1"));
  EXPECT_TRUE(is_host_address("127.0.0.37"));  // all of 127/8, though only .1 is assigned
  EXPECT_FALSE(is_host_address(""));
  // TEST-NET-3, never assigned here.
  EXPECT_FALSE(is_host_address("203.0.113.77"));
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

// Review M8: a storm of link events overflows the watcher's netlink socket (ENOBUFS). The
// watcher must not stop there: it discards the stale events still queued, re-reads every
// interface and reports what changed, so a NIC that went down during the storm is reported
// down. Runs in a child process in a network namespace of its own (its loopback is the only
// interface, toggled freely); the storm is made while the watcher's progress thread is held.
namespace storm {
enum Exit : int { kOk = 0, kNoResync = 10, kDownNotReported = 11, kSetup = 12, kSkip = 77 };

bool set_lo(int fd, bool up, int mtu) {
  ifreq req{};
  std::strcpy(req.ifr_name, "lo");
  if (mtu > 0) {
    req.ifr_mtu = mtu;
    return ::ioctl(fd, SIOCSIFMTU, &req) == 0;
  }
  if (::ioctl(fd, SIOCGIFFLAGS, &req) != 0) return false;
  req.ifr_flags = static_cast<short>(up ? (req.ifr_flags | IFF_UP) : (req.ifr_flags & ~IFF_UP));
  return ::ioctl(fd, SIOCSIFFLAGS, &req) == 0;
}

int child() {
  if (::unshare(CLONE_NEWNET) != 0) return kSkip;
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || !set_lo(fd, true, 0)) return kSetup;
  ProgressEngine engine;
  std::mutex m;
  std::vector<bool> lo;  // what the watcher reported for lo, in order
  auto w = LinkWatcher::start(engine, [&](const std::string& name, bool running) {
    std::lock_guard l(m);
    if (name == "lo") lo.push_back(running);
  });
  if (!w.is_ok()) return kSetup;
  bool ok = true;
  engine.call([&] {
    // Every MTU change is one RTM_NEWLINK of an interface that stays up: 4000 of them are far
    // more than a netlink socket's default buffer holds. Then lo goes down: that event is lost.
    for (int i = 0; i < 4000 && ok; ++i)
      ok = set_lo(fd, true, i % 2 == 0 ? 1400 : 1500);
    ok = ok && set_lo(fd, false, 0);
  });
  if (!ok) return kSetup;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool down = false;
  while (!down && std::chrono::steady_clock::now() < until) {  // bounded: 20 s
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::lock_guard l(m);
    down = !lo.empty() && !lo.back();
  }
  const auto resyncs = (*w)->resyncs();
  (*w)->stop();
  ::close(fd);
  if (resyncs == 0) return kNoResync;
  return down ? kOk : kDownNotReported;
}
}  // namespace storm

TEST(LinkWatcher, AnEventStormThatOverflowsTheSocketEndsInAResyncThatReportsTheLinkDown) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) ::_exit(storm::child());
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 600 && done == 0; ++i) {  // bounded: 60 s
    done = ::waitpid(pid, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (done == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the watcher's child process hung";
  }
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << WTERMSIG(status);
  const int code = WEXITSTATUS(status);
  if (code == storm::kSkip)
    GTEST_SKIP() << "needs a network namespace of its own (unshare(CLONE_NEWNET) was refused: "
                    "run as root)";
  EXPECT_NE(code, storm::kSetup) << "could not set up loopback in the test's namespace";
  EXPECT_NE(code, storm::kNoResync) << "the storm did not overflow the socket (no ENOBUFS seen)";
  EXPECT_NE(code, storm::kDownNotReported)
      << "lo went down during the storm and the watcher never reported it";
  EXPECT_EQ(code, storm::kOk);
}

}  // namespace
}  // namespace r2ccl

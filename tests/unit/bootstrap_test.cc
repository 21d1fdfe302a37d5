#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <map>
#include <thread>

#include "bootstrap/frames.h"
#include "r2ccl/runtime/bootstrap.h"
#include "test_util.h"

namespace r2ccl {
namespace {

using std::chrono::milliseconds;

BootstrapOptions options(int rank, int nranks, std::uint16_t port,
                         milliseconds timeout = milliseconds(5000)) {
  BootstrapOptions o;
  o.rank = rank;
  o.nranks = nranks;
  o.root = HostPort{"127.0.0.1", port};
  o.timeout = timeout;
  return o;
}

Bytes info_of(int rank) {
  return ByteWriter().str("rank-" + std::to_string(rank)).take();
}

std::future<Result<std::unique_ptr<Bootstrap>>> join_async(BootstrapOptions o) {
  return std::async(std::launch::async, [o] { return Bootstrap::join(o, info_of(o.rank)); });
}

TEST(Bootstrap, FourRanksRendezvousAllGatherAndBarrier) {
  const auto port = test::free_port();
  std::vector<std::future<Result<std::unique_ptr<Bootstrap>>>> futures;
  for (int r = 3; r >= 0; --r)
    futures.push_back(join_async(options(r, 4, port)));  // rank 0 last
  std::vector<std::unique_ptr<Bootstrap>> ranks(4);
  for (auto& f : futures) {
    auto b = f.get();
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    const int r = (*b)->rank();
    ranks[static_cast<std::size_t>(r)] = std::move(*b);
  }
  for (int r = 0; r < 4; ++r) {
    const auto& info = ranks[static_cast<std::size_t>(r)]->rank_info();
    ASSERT_EQ(info.size(), 4u);
    for (int p = 0; p < 4; ++p)
      EXPECT_EQ(info[static_cast<std::size_t>(p)], info_of(p));
    EXPECT_EQ(ranks[static_cast<std::size_t>(r)]->control_address(), "127.0.0.1");
  }
  // Two rounds of all-gather on the control path, then a barrier.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::future<Result<std::vector<Bytes>>>> gathers;
    for (int r = 0; r < 4; ++r)
      gathers.push_back(std::async(std::launch::async, [&, r] {
        Bytes mine = ByteWriter().u32(static_cast<std::uint32_t>(100 * round + r)).take();
        return ranks[static_cast<std::size_t>(r)]->allgather(mine, milliseconds(5000));
      }));
    for (auto& g : gathers) {
      auto all = g.get();
      ASSERT_TRUE(all.is_ok()) << all.status().to_string();
      ASSERT_EQ(all->size(), 4u);
      for (std::uint32_t p = 0; p < 4; ++p) {
        ByteReader rd((*all)[p]);
        EXPECT_EQ(rd.u32(), 100u * static_cast<std::uint32_t>(round) + p);
      }
    }
  }
  std::vector<std::future<Status>> barriers;
  for (int r = 0; r < 4; ++r)
    barriers.push_back(std::async(std::launch::async, [&, r] {
      return ranks[static_cast<std::size_t>(r)]->barrier(milliseconds(5000));
    }));
  for (auto& b : barriers)
    EXPECT_TRUE(b.get().is_ok());
}

// A world of two ranks meets through `id` (rank 0 in this process, as the id requires).
void meet_two(const UniqueId& id) {
  Config config;
  config.bootstrap_timeout = milliseconds(5000);
  auto o0 = BootstrapOptions::from_unique_id(id, 0, 2, config);
  auto o1 = BootstrapOptions::from_unique_id(id, 1, 2, config);
  ASSERT_TRUE(o0.is_ok() && o1.is_ok());
  auto f1 = join_async(*o1);
  auto b0 = Bootstrap::join(*o0, info_of(0));
  auto b1 = f1.get();
  ASSERT_TRUE(b0.is_ok()) << b0.status().to_string();
  ASSERT_TRUE(b1.is_ok()) << b1.status().to_string();
  EXPECT_EQ((*b1)->rank_info()[0], info_of(0));
}

TEST(Bootstrap, UniqueIdCarriesAddressAndRandomToken) {
  auto id = UniqueId::create("127.0.0.1");
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  auto id2 = UniqueId::create("127.0.0.1");
  ASSERT_TRUE(id2.is_ok());
  EXPECT_NE(token_to_hex(*id->token()), token_to_hex(*id2->token()));
  EXPECT_EQ(id->address()->host, "127.0.0.1");
  EXPECT_NE(id->address()->port, 0);

  meet_two(*id);

  // The second id's root is still waiting; somebody with the first id's token cannot join it.
  Config config;
  config.bootstrap_timeout = milliseconds(5000);
  auto wrong = BootstrapOptions::from_unique_id(*id2, 1, 2, config);
  wrong->token = *id->token();
  wrong->timeout = milliseconds(2000);
  auto w = Bootstrap::join(*wrong, info_of(1));
  ASSERT_FALSE(w.is_ok());
  EXPECT_NE(w.status().message().find("wrong bootstrap token"), std::string::npos)
      << w.status().message();
}

TEST(Bootstrap, WrongTokenIsRefusedAndRankZeroTimesOutNamingIt) {
  const auto port = test::free_port();
  auto o0 = options(0, 2, port, milliseconds(1500));
  auto f0 = join_async(o0);
  auto o1 = options(1, 2, port, milliseconds(1500));
  o1.token[0] = 0x42;
  auto b1 = Bootstrap::join(o1, info_of(1));
  ASSERT_FALSE(b1.is_ok());
  EXPECT_EQ(b1.status().code(), ErrorCode::kBootstrap);
  EXPECT_NE(b1.status().message().find("wrong bootstrap token: it does not match rank 0's"),
            std::string::npos)
      << b1.status().message();
  auto b0 = f0.get();
  ASSERT_FALSE(b0.is_ok());
  const std::string m = b0.status().message();
  EXPECT_NE(m.find("timed out after 1500ms waiting at rank 0 (127.0.0.1:" + std::to_string(port) +
                   ") for rank(s) 1 to join (1 of 2 joined)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("refused: 127.0.0.1:"), std::string::npos) << m;
  EXPECT_NE(m.find("wrong bootstrap token"), std::string::npos) << m;
}

// A raw TCP connection to rank 0's listener (retried while it starts); -1 if it never answers.
int connect_raw(std::uint16_t port) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < until) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(milliseconds(20));
  }
  return -1;
}

// Whether the peer closed the connection within `limit` (reading and discarding what it sent).
bool closed_within(int fd, milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  char buf[512];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) > 0 && ::recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
  return false;
}

// Before its hello is accepted a connection is bounded: a frame over 4 KiB is not allocated but
// dropped, a connection that says nothing is dropped at the hello deadline, and the rendezvous
// of the real ranks is not disturbed.
TEST(Bootstrap, UnauthenticatedConnectionsAreBoundedAndDropped) {
  const auto port = test::free_port();
  auto f0 = join_async(options(0, 2, port, milliseconds(15000)));
  const int big = connect_raw(port);
  ASSERT_GE(big, 0);
  // Header: magic "R2BS", type 1 (hello), this build's version, length 1 GiB: refused for its
  // size, not its version.
  Bytes h = ByteWriter().u32(0x53423252).u16(1).u16(bootstrap_wire::kVersion).u32(1u << 30).take();
  ASSERT_EQ(::send(big, h.data(), h.size(), MSG_NOSIGNAL), static_cast<ssize_t>(h.size()));
  EXPECT_TRUE(closed_within(big, milliseconds(3000)));
  ::close(big);
  const int idle = connect_raw(port);
  ASSERT_GE(idle, 0);
  EXPECT_TRUE(closed_within(idle, milliseconds(13000)));  // the hello deadline is 10 s
  ::close(idle);
  auto b1 = Bootstrap::join(options(1, 2, port), info_of(1));
  ASSERT_TRUE(b1.is_ok()) << b1.status().to_string();
  auto b0 = f0.get();
  ASSERT_TRUE(b0.is_ok()) << b0.status().to_string();
}

// A raw TCP connection to rank 0's listener from `source` (an address of this host, 127.0.0.x on
// loopback), retried while it starts; -1 if it never answers.
int connect_from(const char* source, std::uint16_t port) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < until) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in from{};
    from.sin_family = AF_INET;
    inet_pton(AF_INET, source, &from.sin_addr);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) == 0 &&
        ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0)
      return fd;
    ::close(fd);
    std::this_thread::sleep_for(milliseconds(20));
  }
  return -1;
}

// Whether rank 0 sent this connection its challenge (it holds the connection, waiting for the
// hello) rather than closing it unanswered; waits up to 5 s for either.
bool challenged(int fd) {
  pollfd p{fd, POLLIN, 0};
  char buf[64];
  return ::poll(&p, 1, 5000) > 0 && ::recv(fd, buf, sizeof buf, 0) > 0;
}

// One host cannot keep the ranks out of the rendezvous: it holds at most 16 connections that have
// not said hello (the next ones are closed at once, unanswered), and a rank from another address
// joins meanwhile, long before the 10 s hello deadline would free anything.
TEST(Bootstrap, OneSourceHoldsAtMostSixteenSilentConnectionsAndARankStillJoins) {
  const auto port = test::free_port();
  auto f0 = join_async(options(0, 2, port, milliseconds(15000)));
  std::vector<int> silent;
  std::size_t held = 0;
  for (int i = 0; i < 64; ++i) {
    const int fd = connect_from("127.0.70.1", port);
    ASSERT_GE(fd, 0);
    silent.push_back(fd);
    if (challenged(fd)) ++held;
  }
  EXPECT_EQ(held, 16u);
  auto b1 = Bootstrap::join(options(1, 2, port, milliseconds(5000)), info_of(1));
  ASSERT_TRUE(b1.is_ok()) << b1.status().to_string();
  auto b0 = f0.get();
  ASSERT_TRUE(b0.is_ok()) << b0.status().to_string();
  for (int fd : silent)
    ::close(fd);
}

// Several hosts together hold at most 64 such connections: the next one, a rank's, sheds the
// oldest instead of being turned away.
TEST(Bootstrap, PastSixtyFourSilentConnectionsTheOldestIsShedAndARankJoins) {
  const auto port = test::free_port();
  auto f0 = join_async(options(0, 2, port, milliseconds(15000)));
  std::vector<int> silent;
  for (int source = 1; source <= 4; ++source) {
    const std::string from = "127.0.71." + std::to_string(source);
    for (int i = 0; i < 16; ++i) {
      const int fd = connect_from(from.c_str(), port);
      ASSERT_GE(fd, 0);
      silent.push_back(fd);
      ASSERT_TRUE(challenged(fd)) << from;
    }
  }
  auto b1 = Bootstrap::join(options(1, 2, port, milliseconds(5000)), info_of(1));
  ASSERT_TRUE(b1.is_ok()) << b1.status().to_string();
  auto b0 = f0.get();
  ASSERT_TRUE(b0.is_ok()) << b0.status().to_string();
  EXPECT_TRUE(closed_within(silent.front(), milliseconds(3000)));  // the oldest was shed
  for (int fd : silent)
    ::close(fd);
}

// A job on an address outside loopback does not start without a token, unless told to by name.
TEST(Bootstrap, NoTokenOutsideLoopbackIsRefusedUnlessTheUserOptsOut) {
  std::map<std::string, std::string> vars{
      {"R2CCL_RANK", "0"}, {"R2CCL_NRANKS", "2"}, {"R2CCL_BOOTSTRAP", "198.18.7.1:29500"}};
  auto cfg = parse_config(test::env_of(vars));
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto o = BootstrapOptions::from_config(*cfg);
  ASSERT_FALSE(o.is_ok());
  EXPECT_EQ(o.status().code(), ErrorCode::kConfig);
  EXPECT_NE(o.status().message().find("R2CCL_BOOTSTRAP_TOKEN is not set, and rank 0 "
                                      "(198.18.7.1:29500) is reachable outside loopback"),
            std::string::npos)
      << o.status().message();
  vars["R2CCL_INSECURE_NO_TOKEN"] = "1";
  EXPECT_TRUE(BootstrapOptions::from_config(*parse_config(test::env_of(vars))).is_ok());
  vars.erase("R2CCL_INSECURE_NO_TOKEN");
  vars["R2CCL_BOOTSTRAP_TOKEN"] = "00112233445566778899aabbccddeeff";
  EXPECT_TRUE(BootstrapOptions::from_config(*parse_config(test::env_of(vars))).is_ok());
  vars.erase("R2CCL_BOOTSTRAP_TOKEN");
  vars["R2CCL_BOOTSTRAP"] = "127.0.0.1:29500";  // loopback: only this host's processes
  EXPECT_TRUE(BootstrapOptions::from_config(*parse_config(test::env_of(vars))).is_ok());
}

// Whether something listens on loopback `port` now (one attempt).
bool listening(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// Ids never used cannot pile up listeners: past 64 waiting, the oldest is closed. Its id still
// works: rank 0 listens again on its port when it joins.
TEST(Bootstrap, UnusedUniqueIdsAreBoundedAndTheOldestStillRendezvous) {
  auto first = UniqueId::create("127.0.0.1");
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  const std::uint16_t first_port = first->address()->port;
  EXPECT_TRUE(listening(first_port));
  std::vector<UniqueId> more;
  for (int i = 0; i < 64; ++i) {
    auto id = UniqueId::create("127.0.0.1");
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    more.push_back(*id);
  }
  EXPECT_FALSE(listening(first_port));
  EXPECT_TRUE(listening(more.back().address()->port));

  meet_two(*first);
}

// A unique-id world whose size on the wire is out of range is refused, not allocated.
TEST(Bootstrap, AWorldSizeOutOfRangeIsRefused) {
  auto id = UniqueId::create("127.0.0.1");
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  auto cfg = parse_config(test::env_of({}));
  ASSERT_TRUE(cfg.is_ok());
  auto o = BootstrapOptions::from_unique_id(*id, 1, 1 << 20, *cfg);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  o->timeout = milliseconds(3000);
  auto b = Bootstrap::join(*o, info_of(1));
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("a world of 1048576 ranks (1..65536 are possible)"),
            std::string::npos)
      << b.status().message();
}

TEST(Bootstrap, MismatchedWorldSizeIsRefused) {
  const auto port = test::free_port();
  auto f0 = join_async(options(0, 2, port, milliseconds(1500)));
  auto b1 = Bootstrap::join(options(1, 3, port, milliseconds(1500)), info_of(1));
  ASSERT_FALSE(b1.is_ok());
  EXPECT_NE(
      b1.status().message().find("world size mismatch: this process has 3 ranks, rank 0 has 2"),
      std::string::npos)
      << b1.status().message();
  EXPECT_FALSE(f0.get().is_ok());
}

TEST(Bootstrap, RankOutOfRangeIsRefusedLocallyAndByTheRoot) {
  auto local = Bootstrap::join(options(5, 2, 1), info_of(5));
  ASSERT_FALSE(local.is_ok());
  EXPECT_EQ(local.status().message(), "rank 5 is out of range for a world of 2 ranks (0..1)");

  // A peer that lies about the world size and rank is refused by rank 0 too.
  const auto port = test::free_port();
  auto f0 = join_async(options(0, 2, port, milliseconds(1500)));
  auto liar = Bootstrap::join(options(2, 2, port, milliseconds(1500)), info_of(2));
  ASSERT_FALSE(liar.is_ok());
  EXPECT_EQ(liar.status().message(), "rank 2 is out of range for a world of 2 ranks (0..1)");
  EXPECT_FALSE(f0.get().is_ok());
}

TEST(Bootstrap, TwoProcessesClaimingOneRank) {
  const auto port = test::free_port();
  auto f0 = join_async(options(0, 3, port));
  auto f1 = join_async(options(1, 3, port));
  // Wait until the first rank 1 is in (it blocks until all have joined; give it time to connect).
  std::this_thread::sleep_for(milliseconds(300));
  auto dup = Bootstrap::join(options(1, 3, port), info_of(1));
  ASSERT_FALSE(dup.is_ok());
  EXPECT_NE(dup.status().message().find(
                "rank 1 is already taken by another process (connected from 127.0.0.1:"),
            std::string::npos)
      << dup.status().message();
  auto b2 = Bootstrap::join(options(2, 3, port), info_of(2));
  EXPECT_TRUE(b2.is_ok()) << b2.status().to_string();
  auto b0 = f0.get();  // rank 0 (and its root) stays alive below
  auto b1 = f1.get();
  EXPECT_TRUE(b0.is_ok());
  EXPECT_TRUE(b1.is_ok());
  // After the rendezvous a late claimant is told so.
  auto late = Bootstrap::join(options(1, 3, port, milliseconds(1000)), info_of(1));
  ASSERT_FALSE(late.is_ok());
  EXPECT_NE(late.status().message().find("joined after the rendezvous of all 3 ranks completed"),
            std::string::npos)
      << late.status().message();
}

TEST(Bootstrap, UnreachableRankZeroFailsAfterTheTimeoutNamingTheAddress) {
  const auto port = test::free_port();  // nobody listens there
  const auto t0 = std::chrono::steady_clock::now();
  auto b = Bootstrap::join(options(1, 2, port, milliseconds(700)), info_of(1));
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kBootstrap);
  EXPECT_NE(b.status().message().find(
                "could not reach rank 0 at 127.0.0.1:" + std::to_string(port) + " within 700ms"),
            std::string::npos)
      << b.status().message();
  EXPECT_NE(b.status().message().find("Connection refused"), std::string::npos)
      << b.status().message();
  EXPECT_LT(took, std::chrono::seconds(10));  // generous: only catches a hang
}

TEST(Bootstrap, RankZeroCannotListenOnAForeignAddress) {
  auto b = Bootstrap::join(
      BootstrapOptions{0, 1, HostPort{"198.18.255.254", 29999}, {}, milliseconds(500), ""}, {});
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("rank 0 cannot listen on 198.18.255.254:29999"),
            std::string::npos)
      << b.status().message();
}

TEST(Bootstrap, ARankLeavingFailsTheOthersCollectivesInsteadOfHanging) {
  const auto port = test::free_port();
  auto f1 = join_async(options(1, 2, port));
  auto b0 = Bootstrap::join(options(0, 2, port), info_of(0));
  ASSERT_TRUE(b0.is_ok());
  auto b1 = f1.get();
  ASSERT_TRUE(b1.is_ok());
  b1->reset();  // rank 1 goes away
  auto r = (*b0)->allgather({}, milliseconds(3000));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("rank 1 (127.0.0.1:"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("left the control path"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace r2ccl

// The verbs provider between two real RDMA devices (Soft-RoCE in the test VM, tests/rdma/):
// R2CCL_TEST_VERBS names them, "rxe_h0n0,rxe_h1n0" (two hosts' NICs on one rail). Without it
// every test skips, saying so. Plus raw TCP peers that speak (or break) the handshake described
// at the top of runtime/src/verbs_provider.cc.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "common/handshake.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/provider/provider.h"
#include "rail_recorder.h"

namespace r2ccl {
namespace {

using std::chrono::milliseconds;

using test::Recorder;
using test::token_of;

std::vector<std::string> test_devices() {
  std::vector<std::string> out;
  const char* v = std::getenv("R2CCL_TEST_VERBS");
  if (v == nullptr) return out;
  std::string s = v;
  std::size_t pos = 0;
  while (pos < s.size()) {
    auto c = s.find(',', pos);
    if (c == std::string::npos) c = s.size();
    out.push_back(s.substr(pos, c - pos));
    pos = c + 1;
  }
  return out;
}

#define REQUIRE_DEVICES()                                                                     \
  if (test_devices().size() < 2)                                                              \
  GTEST_SKIP() << "R2CCL_TEST_VERBS does not name two verbs devices; tests/rdma/run.sh runs " \
                  "these tests in a VM with Soft-RoCE"

Result<std::unique_ptr<Provider>> make(ProgressEngine& engine, const std::string& dev,
                                       std::uint8_t token = 7, int gid_index = -1,
                                       int ib_timeout = 10) {
  auto topo = discover_topology();
  if (!topo) return topo.status();
  Config c;
  c.nics = {dev};
  c.ib_gid_index = gid_index;
  c.ib_timeout = ib_timeout;
  c.ib_retry_cnt = 3;
  return make_verbs_provider(engine, *topo, c, token_of(token));
}

class VerbsProviderTest : public testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_DEVICES();
    const auto devs = test_devices();
    auto a = make(engine_, devs[0]);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    auto b = make(engine_, devs[1]);
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    a_ = std::move(*a);
    b_ = std::move(*b);
    b_->set_accept_handler([this](std::shared_ptr<Rail> r) {
      std::lock_guard l(m_);
      r->start(&b_events_);
      accepted_.push_back(std::move(r));
      return true;
    });
  }
  void TearDown() override {
    engine_.call([this] {
      for (auto& r : accepted_)
        r->fence();
      if (rail_a_) rail_a_->fence();
    });
  }

  Result<std::shared_ptr<Rail>> open(const Token& token, const Bytes& endpoint) {
    std::promise<Result<std::shared_ptr<Rail>>> done;
    RailHello hello{
        token, 7, 1, 0, 0, std::make_shared<const Bytes>(Bytes{std::byte{0x5a}, std::byte{0xa5}})};
    a_->connect(0, endpoint, hello, milliseconds(8000),
                [&](Result<std::shared_ptr<Rail>> r) { done.set_value(std::move(r)); });
    auto r = done.get_future().get();
    if (r.is_ok()) engine_.call([&] { (*r)->start(&a_events_); });
    return r;
  }
  Result<std::shared_ptr<Rail>> open() { return open(token_of(7), b_->endpoint(0)); }

  ProgressEngine engine_;
  std::unique_ptr<Provider> a_, b_;
  Recorder a_events_, b_events_;
  std::mutex m_;
  std::vector<std::shared_ptr<Rail>> accepted_;
  std::shared_ptr<Rail> rail_a_;
};

Bytes pattern(std::size_t n, unsigned seed) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i)
    b[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
  return b;
}

TEST_F(VerbsProviderTest, DevicesAreMatchedToTheirInterfaces) {
  const auto& n = a_->devices().at(0);
  EXPECT_EQ(n.name, test_devices()[0]);
  EXPECT_FALSE(n.netdev.empty());
  EXPECT_FALSE(n.address.empty());
  EXPECT_EQ(a_->name(), "verbs");
  // ibv_reg_mr pins the pages: the collectives' registration cache stays off under verbs unless
  // R2CCL_REG_CACHE=on.
  EXPECT_EQ(a_->capabilities() & kCapRegistrationFollowsMappings, 0u);
}

TEST_F(VerbsProviderTest, WritesAndControlMessagesArriveIntactBothWays) {
  Bytes dst(1 << 20, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(key.is_ok()) << key.status().to_string();
  Bytes src = pattern(300000, 1);
  auto skey = a_->register_memory(0, src.data(), src.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(skey.is_ok());
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  EXPECT_NE(rail_a_->describe().find("QPN"), std::string::npos) << rail_a_->describe();

  ASSERT_TRUE(
      engine_.call([&] {
               return rail_a_->post_write({src.data() + 5, 200000, *key, 1000, 42, 9});
             })
          .is_ok());
  ASSERT_TRUE(a_events_.wait([&] { return !a_events_.confirmed.empty(); }));
  EXPECT_EQ(a_events_.confirmed[0], 9u);
  ASSERT_TRUE(b_events_.wait([&] { return !b_events_.arrived.empty(); }));
  EXPECT_EQ(b_events_.arrived[0], std::make_pair(42u, std::size_t{200000}));
  EXPECT_EQ(std::memcmp(dst.data() + 1000, src.data() + 5, 200000), 0);
  EXPECT_EQ(dst[999], std::byte{0});
  EXPECT_EQ(dst[1000 + 200000], std::byte{0});

  // Control: one short message, one of several fragments (with a cookie: confirmed once the
  // peer's handler ran), and one back the other way.
  const Bytes small{std::byte{1}, std::byte{2}};
  const Bytes big = pattern(20000, 3);
  ASSERT_TRUE(
      engine_.call([&] { return rail_a_->post_control(std::make_shared<const Bytes>(small), 0); })
          .is_ok());
  ASSERT_TRUE(
      engine_.call([&] { return rail_a_->post_control(std::make_shared<const Bytes>(big), 77); })
          .is_ok());
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.control.size() == 2; }));
  EXPECT_EQ(b_events_.control[0], small);
  EXPECT_EQ(b_events_.control[1], big);
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.confirmed.size() == 2; }));
  EXPECT_EQ(a_events_.confirmed[1], 77u);
  ASSERT_TRUE(engine_
                  .call([&] {
                    return accepted_.at(0)->post_control(
                        std::make_shared<const Bytes>(Bytes{std::byte{5}}), 0);
                  })
                  .is_ok());
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.control.size() == 1; }));
  EXPECT_EQ(a_events_.control[0], Bytes{std::byte{5}});
  EXPECT_EQ(accepted_[0]->hello().src_incarnation, 7u);
  EXPECT_EQ(accepted_[0]->hello().dst_incarnation, 1u);
  ASSERT_TRUE(accepted_[0]->hello().description);
  EXPECT_EQ(*accepted_[0]->hello().description, (Bytes{std::byte{0x5a}, std::byte{0xa5}}));
  EXPECT_TRUE(a_events_.failed.empty());
  EXPECT_TRUE(b_events_.failed.empty());
}

TEST_F(VerbsProviderTest, MoreWritesThanTheQueuesHoldAllLand) {
  constexpr std::size_t kWrites = 1500, kLen = 4096;
  Bytes dst(kWrites * kLen, std::byte{0});
  Bytes src = pattern(dst.size(), 5);
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto skey = a_->register_memory(0, src.data(), src.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(key.is_ok() && skey.is_ok());
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  engine_.call([&] {
    for (std::size_t i = 0; i < kWrites; ++i)
      ASSERT_TRUE(rail_a_
                      ->post_write({src.data() + i * kLen, kLen, *key, i * kLen,
                                    static_cast<std::uint32_t>(i), 1000 + i})
                      .is_ok());
  });
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.confirmed.size() == kWrites; }))
      << a_events_.confirmed.size();
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.arrived.size() == kWrites; }));
  EXPECT_EQ(dst, src);
  for (std::size_t i = 0; i < kWrites; ++i) {
    EXPECT_EQ(a_events_.confirmed[i], 1000 + i);  // one queue pair: in order
    EXPECT_EQ(b_events_.arrived[i].first, i);
  }
}

TEST_F(VerbsProviderTest, AWriteOutsideTheRegionIsRefusedAsABugAndTheRailFails) {
  Bytes dst(4096, std::byte{0});
  Bytes src(100, std::byte{0x5a});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto skey = a_->register_memory(0, src.data(), src.size(), MemoryAccess::kRemoteWrite);
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  engine_.call([&] { (void)rail_a_->post_write({src.data(), 100, *key, 4050, 1, 1}); });
  ASSERT_TRUE(a_events_.wait([&] { return !a_events_.refused.empty(); }));
  EXPECT_EQ(a_events_.refused[0].first, 1u);
  const auto& why = a_events_.refused[0].second;
  EXPECT_NE(why.find("RDMA write of 100 bytes at offset 4050"), std::string::npos) << why;
  EXPECT_NE(why.find("a bug, not a NIC fault"), std::string::npos) << why;
  ASSERT_TRUE(a_events_.wait([&] { return !a_events_.failed.empty(); }));
  EXPECT_NE(a_events_.failed[0].find("queue pair in error"), std::string::npos)
      << a_events_.failed[0];
  for (auto b : dst)
    ASSERT_EQ(b, std::byte{0});
}

// Past the send queue, posts wait in the rail; once 64 MiB wait, one more is refused as
// back-pressure (kNoResource, saying what is queued), and everything accepted still lands.
// Empty writes fill the send queue, so that the 4 MiB ones all wait behind it.
TEST_F(VerbsProviderTest, PostsBeyondTheQueueBoundAreRefusedAsBackPressure) {
  constexpr std::size_t kFill = 256, kLen = std::size_t{4} << 20, kBig = 16;
  Bytes src = pattern(kLen, 9);
  Bytes dst((kBig + 1) * kLen, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto skey = a_->register_memory(0, src.data(), src.size(), MemoryAccess::kLocal);
  ASSERT_TRUE(key.is_ok() && skey.is_ok());
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  std::size_t big = 0;
  Status refused, control, urgent;
  const auto message = std::make_shared<const Bytes>(Bytes{std::byte{0x42}, std::byte{0x43}});
  engine_.call([&] {
    for (std::size_t i = 0; i < kFill; ++i)
      ASSERT_TRUE(rail_a_->post_write({src.data(), 0, *key, 0, 0, i}).is_ok());
    for (std::size_t i = 0; i <= kBig && refused.is_ok(); ++i) {
      refused = rail_a_->post_write({src.data(), kLen, *key, i * kLen, 1, kFill + i});
      if (refused.is_ok()) ++big;
    }
    // A control message waits its turn too, unless it is urgent (failover's): that one is taken.
    control = rail_a_->post_control(message, 0);
    urgent = rail_a_->post_urgent_control(message, 0);
  });
  EXPECT_EQ(control.code(), ErrorCode::kNoResource) << control.to_string();
  EXPECT_TRUE(urgent.is_ok()) << urgent.to_string();
  ASSERT_FALSE(refused.is_ok()) << "every write was queued";
  EXPECT_EQ(refused.code(), ErrorCode::kNoResource) << refused.to_string();
  EXPECT_NE(refused.message().find("posts (67108864 bytes) queued behind its full send queue"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(big, kBig);
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.confirmed.size() == kFill + big; }))
      << a_events_.confirmed.size() << " of " << kFill + big;
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.arrived.size() == kFill + big; }));
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.control.size() == 1; }));
  EXPECT_EQ(b_events_.control[0], *message);
  for (std::size_t i = 0; i < big; ++i)
    ASSERT_TRUE(
        std::equal(src.begin(), src.end(), dst.begin() + static_cast<std::ptrdiff_t>(i * kLen)))
        << "write " << i;
  // Drained: the rail takes posts again.
  auto st = engine_.call([&] {
    return rail_a_->post_write({src.data(), kLen, *key, big * kLen, 2, 9999});
  });
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.confirmed.size() == kFill + big + 1; }));
  EXPECT_TRUE(
      std::equal(src.begin(), src.end(), dst.begin() + static_cast<std::ptrdiff_t>(big * kLen)));
}

// A source inside a large registration is found however many smaller ones were registered inside
// it before the source's address (a pool, then buffers carved out of it and registered too).
TEST_F(VerbsProviderTest, ASourceBehindManyNestedRegistrationsIsFound) {
  constexpr std::size_t kNested = 100, kPiece = 64, kLen = 4096;
  Bytes src = pattern(kNested * kPiece + kLen, 7);
  Bytes dst(kLen, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto whole = a_->register_memory(0, src.data(), src.size(), MemoryAccess::kLocal);
  ASSERT_TRUE(key.is_ok() && whole.is_ok());
  for (std::size_t i = 0; i < kNested; ++i)
    ASSERT_TRUE(
        a_->register_memory(0, src.data() + i * kPiece, kPiece, MemoryAccess::kLocal).is_ok());
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  const std::byte* from = src.data() + kNested * kPiece;
  auto st = engine_.call([&] { return rail_a_->post_write({from, kLen, *key, 0, 0, 1}); });
  ASSERT_TRUE(st.is_ok()) << st.message();
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.arrived.size() == 1; }));
  EXPECT_TRUE(std::equal(dst.begin(), dst.end(), from));
}

TEST_F(VerbsProviderTest, AnUnregisteredSourceIsAClearError) {
  Bytes dst(4096);
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto r = open();
  ASSERT_TRUE(r.is_ok());
  rail_a_ = *r;
  Bytes src(64);
  auto st = engine_.call([&] { return rail_a_->post_write({src.data(), 64, *key, 0, 0, 1}); });
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("is not in memory registered on " + test_devices()[0]),
            std::string::npos)
      << st.message();
}

TEST_F(VerbsProviderTest, TheWrongTokenIsRefused) {
  auto r = open(token_of(8), b_->endpoint(0));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("wrong token"), std::string::npos) << r.status().message();
  EXPECT_EQ(b_->counters().dropped_connections, 1u);
  EXPECT_TRUE(accepted_.empty());
}

TEST(VerbsProvider, UnknownDeviceAndMissingGidIndexAreClearErrors) {
  REQUIRE_DEVICES();
  ProgressEngine engine;
  auto r = make(engine, "rxe_bogus");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kConfig);
  EXPECT_NE(r.status().message().find("no verbs device named 'rxe_bogus' (have: "),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find(test_devices()[0]), std::string::npos);
  auto g = make(engine, test_devices()[0], 7, 99);
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find("R2CCL_IB_GID_INDEX=99: " + test_devices()[0] +
                                      " port 1 has no GID at index 99"),
            std::string::npos)
      << g.status().message();
}

// --- raw TCP peers speaking the handshake ---------------------------------------------------

// u32 magic | u32 length | body, little-endian (ByteWriter).
Bytes frame(const Bytes& body) {
  ByteWriter w;
  w.u32(0x52325642).u32(static_cast<std::uint32_t>(body.size())).raw(body.data(), body.size());
  return w.take();
}
// A queue pair's connection details as the handshake carries them.
Bytes qp_info(std::uint32_t qpn, const std::string& gid_ipv4) {
  ByteWriter w;
  std::array<std::uint8_t, 16> gid{};
  gid[10] = gid[11] = 0xff;
  in_addr a{};
  inet_pton(AF_INET, gid_ipv4.c_str(), &a);
  std::memcpy(&gid[12], &a, 4);
  w.u32(qpn).u32(0x1234).u16(0).u8(3).raw(gid.data(), gid.size());
  return w.take();
}

// The connector's hello (answering `challenge` with token `t`) followed by its QP details.
Bytes hello_and_qp(const Token& t, const crypto::Nonce& challenge, std::uint32_t qpn,
                   const std::string& gid_ipv4) {
  RailHello h;
  h.token = t;
  h.dst_incarnation = 1;
  crypto::Nonce client{};
  Bytes out = *encode_hello(h, challenge, &client);
  const Bytes q = qp_info(qpn, gid_ipv4);
  out.insert(out.end(), q.begin(), q.end());
  return out;
}

// Reads one handshake frame (u32 magic | u32 length | body); its body, empty on error.
Bytes read_frame(int fd) {
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::array<std::byte, 8> head{};
  if (::recv(fd, head.data(), head.size(), MSG_WAITALL) != 8) return {};
  ByteReader r(head);
  r.u32();
  Bytes body(r.u32());
  if (body.size() > 4096 ||
      ::recv(fd, body.data(), body.size(), MSG_WAITALL) != static_cast<ssize_t>(body.size()))
    return {};
  return body;
}

std::pair<std::string, std::uint16_t> parse_endpoint(const Bytes& ep) {
  ByteReader r(ep);
  auto host = r.str(64);
  return {host, r.u16()};
}

// A raw connection to `endpoint`, from `source` (an address of this host) where given; -1 if it
// cannot connect.
int tcp_connect(const Bytes& endpoint, const char* source = nullptr) {
  auto [host, port] = parse_endpoint(endpoint);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (source != nullptr) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    inet_pton(AF_INET, source, &from.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

Bytes read_all(int fd) {
  Bytes out;
  std::array<std::byte, 4096> buf{};
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (int i = 0; i < 100; ++i) {
    const auto n = ::read(fd, buf.data(), buf.size());
    if (n <= 0) break;
    out.insert(out.end(), buf.begin(), buf.begin() + n);
  }
  return out;
}

TEST_F(VerbsProviderTest, APeerThatSendsABadQpnIsRefusedWithTheReason) {
  const int fd = tcp_connect(b_->endpoint(0));
  ASSERT_GE(fd, 0);
  const Bytes challenge_bytes = read_frame(fd);
  ASSERT_EQ(challenge_bytes.size(), kChallengeSize);
  crypto::Nonce challenge{};
  std::memcpy(challenge.data(), challenge_bytes.data(), challenge.size());
  const Bytes f = frame(hello_and_qp(token_of(7), challenge, 0, a_->devices()[0].address));
  ASSERT_EQ(::write(fd, f.data(), f.size()), static_cast<ssize_t>(f.size()));
  const Bytes reply = read_all(fd);
  ::close(fd);
  ASSERT_GT(reply.size(), 9u);
  ByteReader r(reply);
  EXPECT_EQ(r.u32(), 0x52325642u);
  (void)r.u32();
  EXPECT_EQ(r.u8(), 0u);  // refused
  const std::string why = r.str(1024);
  EXPECT_NE(why.find("the peer sent an invalid QPN 0x0"), std::string::npos) << why;
  EXPECT_EQ(b_->counters().dropped_connections, 1u);
  EXPECT_TRUE(accepted_.empty());
}

// Whoever reaches a rail port cannot pin its file descriptors (review N-M6), as with tcp: one
// source holds at most 16 connections that have not sent their hello; the next is closed at once,
// without a challenge, and a peer from another address still connects meanwhile.
TEST_F(VerbsProviderTest, ASourceHoldsABoundedNumberOfConnectionsBeforeTheirHello) {
  constexpr std::size_t kAllowed = 16;
  std::vector<int> idle;
  for (std::size_t i = 0; i < kAllowed; ++i) {
    idle.push_back(tcp_connect(b_->endpoint(0), "127.0.70.1"));
    ASSERT_GE(idle.back(), 0);
    // Its challenge arrived: the acceptor holds it, waiting for the hello.
    ASSERT_EQ(read_frame(idle.back()).size(), kChallengeSize);
  }
  EXPECT_EQ(b_->counters().dropped_connections, 0u);
  for (std::size_t i = 0; i < 4; ++i) {
    const int extra = tcp_connect(b_->endpoint(0), "127.0.70.1");
    ASSERT_GE(extra, 0);
    EXPECT_TRUE(read_frame(extra).empty());  // closed, no challenge
    ::close(extra);
  }
  EXPECT_EQ(b_->counters().dropped_connections, 4u);
  // a_ connects from its own NIC's address, another source: its rail is accepted.
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  for (int fd : idle)
    ::close(fd);
}

// A fake acceptor that answers every handshake with `qpn` (then stays silent).
class FakeAcceptor {
 public:
  FakeAcceptor(const std::string& address, std::uint32_t qpn, const std::string& gid_ipv4) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    inet_pton(AF_INET, address.c_str(), &sa.sin_addr);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    socklen_t len = sizeof sa;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    ::listen(fd_, 4);
    thread_ = std::thread([this, qpn, gid_ipv4] {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      crypto::Nonce challenge{};
      challenge.fill(0x42);
      const Bytes cf = frame(Bytes(reinterpret_cast<const std::byte*>(challenge.data()),
                                   reinterpret_cast<const std::byte*>(challenge.data()) + 16));
      (void)::write(c, cf.data(), cf.size());
      const Bytes hello = read_frame(c);
      auto accepted = accept_hello(hello, token_of(7), challenge);
      if (!accepted) {
        ::close(c);
        return;
      }
      ByteWriter w;
      w.u8(1);
      const Bytes ack = *encode_ack(token_of(7), accepted->client, challenge);
      w.raw(ack.data(), ack.size());
      const Bytes q = qp_info(qpn, gid_ipv4);
      w.raw(q.data(), q.size());
      const Bytes f = frame(w.take());
      (void)::write(c, f.data(), f.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ::close(c);
    });
  }
  ~FakeAcceptor() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  Bytes endpoint(const std::string& address) const {
    return ByteWriter().str(address).u16(port_).take();
  }

 private:
  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::thread thread_;
};

TEST_F(VerbsProviderTest, AnAcceptorThatAnswersWithABadQpnFailsTheConnectClearly) {
  const std::string addr = b_->devices()[0].address;
  {
    FakeAcceptor fake(addr, 0x1000000, addr);  // out of range
    auto r = open(token_of(7), fake.endpoint(addr));
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("invalid QPN 0x1000000"), std::string::npos)
        << r.status().message();
  }
  {
    FakeAcceptor fake(addr, 0xabcdef, addr);  // well-formed, but no such queue pair
    const auto t0 = std::chrono::steady_clock::now();
    auto r = open(token_of(7), fake.endpoint(addr));
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("did not answer"), std::string::npos)
        << r.status().message();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(8));  // not a hang
  }
}

TEST_F(VerbsProviderTest, APortGoingDownFailsItsRails) {
  if (std::getenv("RDMA_VM") == nullptr) GTEST_SKIP() << "needs the test VM's rdma-vm-nic";
  auto r = open();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  const std::string netdev = a_->devices()[0].netdev;
  ASSERT_EQ(std::system(("rdma-vm-nic down " + netdev).c_str()), 0);
  Bytes dst(4096);
  Bytes src(4096, std::byte{1});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto skey = a_->register_memory(0, src.data(), src.size(), MemoryAccess::kRemoteWrite);
  engine_.call([&] { (void)rail_a_->post_write({src.data(), 4096, *key, 0, 0, 1}); });
  const bool failed = a_events_.wait([&] { return !a_events_.failed.empty(); });
  EXPECT_EQ(std::system(("rdma-vm-nic up " + netdev).c_str()), 0);
  ASSERT_TRUE(failed);
  EXPECT_NE(a_events_.failed[0].find(test_devices()[0]), std::string::npos) << a_events_.failed[0];
  EXPECT_TRUE(a_events_.confirmed.empty());
}

}  // namespace
}  // namespace r2ccl

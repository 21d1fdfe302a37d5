// The tcp provider between two providers on loopback addresses, plus a raw socket that speaks
// (or breaks) the wire format described at the top of runtime/src/tcp_provider.cc.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "common/handshake.h"
#include "common/pending_hellos.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/provider/provider.h"
#include "rail_recorder.h"
#include "tcp/frame.h"

namespace r2ccl {
namespace {

using std::chrono::milliseconds;

using test::Recorder;
using test::token_of;

RailNic nic(const std::string& a) {
  return RailNic{a, a, -1, "", ""};
}

class TcpProviderTest : public testing::Test {
 protected:
  void SetUp() override {
    auto a = make_tcp_provider(engine_, {nic("127.0.0.51")}, token_of(7));
    auto b = make_tcp_provider(engine_, {nic("127.0.0.52")}, token_of(7));
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    a_ = std::move(*a);
    b_ = std::move(*b);
    b_->set_accept_handler([this](std::shared_ptr<Rail> r) {
      std::lock_guard l(m_);
      r->start(&b_events_);
      // Under the recorder's lock, and notified: a test may be waiting for it.
      b_events_.push([&] { accepted_.push_back(std::move(r)); });
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

  // Opens a rail a -> b with the given token.
  Result<std::shared_ptr<Rail>> open(const Token& token) {
    std::promise<Result<std::shared_ptr<Rail>>> done;
    RailHello hello{
        token, 7, 1, 0, 0, std::make_shared<const Bytes>(Bytes{std::byte{0x5a}, std::byte{0xa5}})};
    a_->connect(0, b_->endpoint(0), hello, milliseconds(3000),
                [&](Result<std::shared_ptr<Rail>> r) { done.set_value(std::move(r)); });
    auto r = done.get_future().get();
    if (r.is_ok()) engine_.call([&] { (*r)->start(&a_events_); });
    return r;
  }

  ProgressEngine engine_;
  std::unique_ptr<Provider> a_, b_;
  Recorder a_events_, b_events_;
  std::mutex m_;
  std::vector<std::shared_ptr<Rail>> accepted_;
  std::shared_ptr<Rail> rail_a_;
};

TEST_F(TcpProviderTest, WriteLandsInTheRegisteredRegionAndIsConfirmed) {
  std::vector<std::byte> dst(1 << 20, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(key.is_ok());
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  EXPECT_NE(rail_a_->describe().find("127.0.0.51 127.0.0.51:"), std::string::npos)
      << rail_a_->describe();

  std::vector<std::byte> src(100000);
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<std::byte>(i * 7 + 3);
  ASSERT_TRUE(
      engine_.call([&] {
               return rail_a_->post_write({src.data(), src.size(), *key, 1000, 42, 9});
             })
          .is_ok());
  ASSERT_TRUE(a_events_.wait([&] { return !a_events_.confirmed.empty(); }));
  EXPECT_EQ(a_events_.confirmed[0], 9u);
  ASSERT_TRUE(b_events_.wait([&] { return !b_events_.arrived.empty(); }));
  EXPECT_EQ(b_events_.arrived[0], std::make_pair(42u, src.size()));
  EXPECT_EQ(std::memcmp(dst.data() + 1000, src.data(), src.size()), 0);
  EXPECT_EQ(dst[999], std::byte{0});
  EXPECT_EQ(dst[1000 + src.size()], std::byte{0});

  // A control message in each direction.
  ASSERT_TRUE(engine_
                  .call([&] {
                    return rail_a_->post_control(
                        std::make_shared<const Bytes>(Bytes{std::byte{1}, std::byte{2}}), 77);
                  })
                  .is_ok());
  ASSERT_TRUE(b_events_.wait([&] { return !b_events_.control.empty(); }));
  EXPECT_EQ(b_events_.control[0], (Bytes{std::byte{1}, std::byte{2}}));
  // With a cookie, the peer confirms it handled the message.
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.confirmed.size() == 2; }));
  EXPECT_EQ(a_events_.confirmed[1], 77u);
  EXPECT_EQ(accepted_[0]->hello().src_incarnation, 7u);
  EXPECT_EQ(accepted_[0]->hello().dst_incarnation, 1u);
  ASSERT_TRUE(accepted_[0]->hello().description);
  EXPECT_EQ(*accepted_[0]->hello().description, (Bytes{std::byte{0x5a}, std::byte{0xa5}}));
}

// The age of the peer kernel's last acknowledgement (TCP_INFO), a sign of life that needs no
// probe: small right after a confirmed exchange, growing while nothing is sent, unknown once the
// rail is closed.
TEST_F(TcpProviderTest, TheAgeOfThePeersLastAcknowledgementIsReadFromTheKernel) {
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  rail_a_ = *r;
  ASSERT_TRUE(engine_
                  .call([&] {
                    return rail_a_->post_control(std::make_shared<const Bytes>(Bytes{std::byte{1}}),
                                                 5);
                  })
                  .is_ok());
  ASSERT_TRUE(a_events_.wait([&] { return !a_events_.confirmed.empty(); }));
  const auto fresh = engine_.call([&] { return rail_a_->since_acknowledged(); });
  ASSERT_TRUE(fresh.has_value());
  EXPECT_LT(*fresh, std::chrono::seconds(10));  // bound only: a busy machine may be slow
  std::this_thread::sleep_for(milliseconds(300));
  const auto later = engine_.call([&] { return rail_a_->since_acknowledged(); });
  ASSERT_TRUE(later.has_value());
  EXPECT_GE(*later, milliseconds(250));  // nothing was sent since: nothing was acknowledged
  engine_.call([&] { rail_a_->fence(); });
  EXPECT_FALSE(engine_.call([&] { return rail_a_->since_acknowledged(); }).has_value());
}

// A large write streams into a region; the receiver deregisters the region mid-way (and then
// reuses the memory): no byte of the write lands after deregister_memory returned, and a rail
// that was streaming into it is closed, saying why.
TEST_F(TcpProviderTest, NoByteLandsInARegionAfterItsDeregistrationReturns) {
  constexpr std::size_t kLen = std::size_t{48} << 20;
  std::vector<std::byte> dst(kLen, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(key.is_ok());
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok());
  rail_a_ = *r;
  std::vector<std::byte> src(kLen, std::byte{0x5a});
  engine_.call([&] { (void)rail_a_->post_write({src.data(), kLen, *key, 0, 1, 1}); });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto first = reinterpret_cast<volatile const std::uint8_t*>(dst.data());
  while (*first == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  ASSERT_EQ(*first, 0x5a) << "the write never started landing";
  ASSERT_TRUE(b_->deregister_memory(0, *key).is_ok());
  std::fill(dst.begin(), dst.end(), std::byte{0x11});  // freed and reused by its owner
  // Whatever was still on its way is refused or cut off: give it time to (not) arrive.
  ASSERT_TRUE(a_events_.wait([&] {
    return !a_events_.refused.empty() || !a_events_.failed.empty() || !a_events_.confirmed.empty();
  }));
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(std::count(dst.begin(), dst.end(), std::byte{0x11}), static_cast<std::ptrdiff_t>(kLen));
  std::lock_guard l(b_events_.m);
  for (const auto& why : b_events_.failed)
    EXPECT_NE(why.find("that a write was landing in was deregistered"), std::string::npos) << why;
}

// The sending side: a large write is queued from a region that is deregistered at once and then
// unmapped. The rail still holding the write's frames is closed, saying why, before
// deregister_memory returns: nothing reads the unmapped pages (which would crash), and every
// byte that landed is the source's.
TEST_F(TcpProviderTest, NoByteIsReadFromARegionAfterItsDeregistrationReturns) {
  constexpr std::size_t kLen = std::size_t{48} << 20;
  std::vector<std::byte> dst(kLen, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  ASSERT_TRUE(key.is_ok());
  void* mapped = mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* src = static_cast<std::byte*>(mapped);
  std::fill(src, src + kLen, std::byte{0x5a});
  auto skey = a_->register_memory(0, src, kLen, MemoryAccess::kLocal);
  ASSERT_TRUE(skey.is_ok());
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok());
  rail_a_ = *r;
  Status deregistered;
  engine_.call([&] {  // on the loop: the frames are still queued when the deregistration comes
    ASSERT_TRUE(rail_a_->post_write({src, kLen, *key, 0, 1, 1}).is_ok());
    deregistered = a_->deregister_memory(0, *skey);
  });
  ASSERT_TRUE(deregistered.is_ok()) << deregistered.to_string();
  ASSERT_EQ(munmap(mapped, kLen), 0);
  ASSERT_TRUE(a_events_.wait([&] { return !a_events_.failed.empty(); }));
  EXPECT_NE(a_events_.failed[0].find("that a write was being sent from was deregistered"),
            std::string::npos)
      << a_events_.failed[0];
  EXPECT_TRUE(a_events_.confirmed.empty());
  std::this_thread::sleep_for(milliseconds(200));  // what was on the wire lands, or not
  std::lock_guard l(b_events_.m);
  EXPECT_EQ(std::count(dst.begin(), dst.end(), std::byte{0x5a}) +
                std::count(dst.begin(), dst.end(), std::byte{0}),
            static_cast<std::ptrdiff_t>(kLen));
  EXPECT_TRUE(b_events_.arrived.empty());
}

// Least privilege: memory registered for local access (what is only sent from) has a key, but
// a peer's write naming it is refused and nothing lands; the rail stays up.
TEST_F(TcpProviderTest, AWriteIntoLocalOnlyMemoryIsRefused) {
  std::vector<std::byte> dst(4096, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kLocal);
  ASSERT_TRUE(key.is_ok());
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok());
  rail_a_ = *r;
  std::vector<std::byte> src(100, std::byte{0x5a});
  engine_.call([&] { (void)rail_a_->post_write({src.data(), 100, *key, 0, 1, 1}); });
  ASSERT_TRUE(a_events_.wait([&] { return a_events_.refused.size() == 1; }));
  EXPECT_NE(
      a_events_.refused[0].second.find("a region registered for local access only on 127.0.0.52"),
      std::string::npos)
      << a_events_.refused[0].second;
  EXPECT_EQ(std::count(dst.begin(), dst.end(), std::byte{0}), 4096);
  EXPECT_TRUE(a_events_.failed.empty());
  EXPECT_TRUE(b_->deregister_memory(0, *key).is_ok());
}

TEST_F(TcpProviderTest, WriteOutsideTheRegionIsRefusedAndReportedAndTheRailStaysUp) {
  std::vector<std::byte> dst(4096, std::byte{0});
  auto key = b_->register_memory(0, dst.data(), dst.size(), MemoryAccess::kRemoteWrite);
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok());
  rail_a_ = *r;
  std::vector<std::byte> src(100, std::byte{0x5a});
  engine_.call([&] {
    (void)rail_a_->post_write({src.data(), 100, *key, 4050, 1, 1});   // 54 bytes past the end
    (void)rail_a_->post_write({src.data(), 100, *key + 1, 0, 2, 2});  // unknown key
    (void)rail_a_->post_write({src.data(), 100, *key, 3996, 3, 3});   // exactly fits
  });
  ASSERT_TRUE(a_events_.wait(
      [&] { return a_events_.refused.size() == 2 && a_events_.confirmed.size() == 1; }));
  EXPECT_EQ(a_events_.refused[0].first, 1u);
  EXPECT_NE(
      a_events_.refused[0].second.find(
          "write of 100 bytes at offset 4050 falls outside the registered region of 4096 bytes"),
      std::string::npos)
      << a_events_.refused[0].second;
  EXPECT_EQ(a_events_.refused[1].first, 2u);
  EXPECT_NE(a_events_.refused[1].second.find("which is not registered on 127.0.0.52"),
            std::string::npos);
  EXPECT_EQ(a_events_.confirmed[0], 3u);
  EXPECT_EQ(b_->counters().refused_writes, 2u);
  EXPECT_TRUE(a_events_.failed.empty());
  EXPECT_TRUE(b_events_.failed.empty());
  for (std::size_t i = 0; i < 3996; ++i)
    ASSERT_EQ(dst[i], std::byte{0}) << i;
  EXPECT_EQ(dst[4095], std::byte{0x5a});
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.arrived.size() == 1; }));
  EXPECT_EQ(b_events_.arrived[0].first, 3u);
}

TEST_F(TcpProviderTest, AProviderWithTheWrongTokenIsDropped) {
  auto r = open(token_of(8));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("wrong token?"), std::string::npos) << r.status().message();
  EXPECT_EQ(b_->counters().dropped_connections, 1u);
  EXPECT_TRUE(accepted_.empty());
}

// --- raw sockets speaking the wire format ---------------------------------------------------

class RawPeer {
 public:
  // Connects from `source` (an IPv4 address of this host) where given.
  explicit RawPeer(const Bytes& endpoint, const char* source = nullptr) {
    ByteReader r(endpoint);
    std::string host = r.str();
    const auto port = r.u16();
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (source != nullptr) {
      sockaddr_in from{};
      from.sin_family = AF_INET;
      inet_pton(AF_INET, source, &from.sin_addr);
      if (::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) return;
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    inet_pton(AF_INET, host.c_str(), &a.sin_addr);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~RawPeer() { ::close(fd_); }
  bool connected() const { return connected_; }

  // A frame header (tcp/frame.h) with its checksum, or with the checksum off by one.
  static Bytes header(std::uint16_t magic, std::uint8_t op, std::uint64_t key, std::uint64_t offset,
                      std::uint32_t length, std::uint64_t cookie = 0, std::uint32_t imm = 0,
                      bool corrupt = false) {
    Bytes b = ByteWriter()
                  .u16(magic)
                  .u8(op)
                  .u8(0)
                  .u32(imm)
                  .u64(key)
                  .u64(offset)
                  .u32(length)
                  .u32(0)
                  .u64(cookie)
                  .take();
    tcp_frame::HeaderBytes h;
    std::copy(b.begin(), b.end(), h.begin());
    store_le(b.data() + tcp_frame::kChecksumAt, tcp_frame::checksum(h) + (corrupt ? 1u : 0u));
    return b;
  }
  void send(const Bytes& b) {
    ASSERT_EQ(::send(fd_, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size()));
  }
  // Reads the acceptor's challenge and answers it with a hello made with token `t`.
  void hello(const Token& t) {
    ASSERT_EQ(read_some(40 + kChallengeSize), static_cast<ssize_t>(40 + kChallengeSize));
    send(hello_frame(t));
  }
  // The hello answering the challenge last read.
  Bytes hello_frame(const Token& t) {
    crypto::Nonce challenge{};
    std::memcpy(challenge.data(), last_.data() + 40, challenge.size());
    RailHello h;
    h.token = t;
    h.dst_incarnation = 1;
    crypto::Nonce client{};
    auto payload = encode_hello(h, challenge, &client);
    if (!payload) return {};
    Bytes frame = header(0x3252, 1, 0, 0, static_cast<std::uint32_t>(payload->size()));
    frame.insert(frame.end(), payload->begin(), payload->end());
    return frame;
  }
  // Sends what the socket takes; false where the peer closed it.
  bool try_send(const Bytes& b) {
    return ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size());
  }
  // Bytes read until EOF, reset or `want` bytes (kept in last_); -1 on timeout.
  ssize_t read_some(std::size_t want) {
    std::vector<std::byte>& buf = last_;
    buf.assign(want, std::byte{0});
    std::size_t got = 0;
    while (got < want) {
      ssize_t n = ::recv(fd_, buf.data() + got, want - got, 0);
      if (n == 0) break;
      if (n < 0) {
        if (errno == ECONNRESET) break;  // closed abortively
        return -1;
      }
      got += static_cast<std::size_t>(n);
    }
    return static_cast<ssize_t>(got);
  }
  void close_now() { ::shutdown(fd_, SHUT_RDWR); }

 private:
  std::vector<std::byte> last_;
  int fd_ = -1;
  bool connected_ = false;
};

TEST_F(TcpProviderTest, AConnectionWithoutTheTokenIsDropped) {
  RawPeer p(b_->endpoint(0));
  ASSERT_TRUE(p.connected());
  p.hello(token_of(99));
  EXPECT_EQ(p.read_some(40), 0);  // closed without a handshake reply
  EXPECT_EQ(b_->counters().dropped_connections, 1u);
  EXPECT_TRUE(accepted_.empty());

  RawPeer q(b_->endpoint(0));
  q.send(Bytes(40, std::byte{0x11}));  // not even a hello
  // The challenge, then the connection closes.
  EXPECT_EQ(q.read_some(40 + kChallengeSize + 1), static_cast<ssize_t>(40 + kChallengeSize));
  EXPECT_EQ(b_->counters().dropped_connections, 2u);
}

// A provider destroyed while a connection is half way through its handshake ends that handshake:
// the right hello arriving afterwards is answered by nothing (the handshake's handlers capture
// the provider, so they must not run on), and the connection is closed.
TEST_F(TcpProviderTest, AHandshakeUnderWayEndsWithItsProvider) {
  RawPeer p(b_->endpoint(0));
  ASSERT_EQ(p.read_some(40 + kChallengeSize), static_cast<ssize_t>(40 + kChallengeSize));
  const Bytes hello = p.hello_frame(token_of(7));
  ASSERT_FALSE(hello.empty());
  b_.reset();
  (void)p.try_send(hello);
  EXPECT_EQ(p.read_some(40 + kAckSize), 0);  // closed, no reply
  EXPECT_TRUE(accepted_.empty());
  // The loop runs on, and the other provider still works.
  std::atomic<bool> ran{false};
  engine_.call([&] { ran = true; });
  EXPECT_TRUE(ran);
}

// Whoever reaches a rail port cannot pin its file descriptors: one source holds at most 16
// connections that have not sent their hello; the next is closed at once, without a challenge,
// and a peer from another address still connects meanwhile.
TEST_F(TcpProviderTest, ASourceHoldsABoundedNumberOfConnectionsBeforeTheirHello) {
  constexpr std::size_t kAllowed = 16;
  std::vector<std::unique_ptr<RawPeer>> idle;
  for (std::size_t i = 0; i < kAllowed; ++i) {
    idle.push_back(std::make_unique<RawPeer>(b_->endpoint(0)));
    ASSERT_TRUE(idle.back()->connected());
    // Its challenge arrived: the acceptor holds it, waiting for the hello.
    ASSERT_EQ(idle.back()->read_some(40 + kChallengeSize),
              static_cast<ssize_t>(40 + kChallengeSize));
  }
  EXPECT_EQ(b_->counters().dropped_connections, 0u);
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < 4; ++i) {
    RawPeer extra(b_->endpoint(0));
    ASSERT_TRUE(extra.connected());
    EXPECT_EQ(extra.read_some(40 + kChallengeSize), 0);  // closed, no challenge
  }
  // Closed at once, not by the 5 s hello deadline.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  EXPECT_EQ(b_->counters().dropped_connections, 4u);
  // a_ connects from 127.0.0.51, another source: its rail is accepted.
  auto r = open(token_of(7));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  rail_a_ = *r;
  // Once the idle ones are gone, the source may connect again.
  idle.clear();
  bool accepted_again = false;
  for (int attempt = 0; attempt < 50 && !accepted_again; ++attempt) {
    RawPeer again(b_->endpoint(0));
    accepted_again =
        again.read_some(40 + kChallengeSize) == static_cast<ssize_t>(40 + kChallengeSize);
    if (!accepted_again) std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_TRUE(accepted_again);
}

// Many sources together hold at most 256 such connections: the next one sheds the oldest.
TEST_F(TcpProviderTest, PastTheBoundTheOldestConnectionWithoutAHelloIsShed) {
  constexpr std::size_t kSources = 16, kEach = 16;  // 256 in all
  std::vector<std::unique_ptr<RawPeer>> idle;
  for (std::size_t s = 0; s < kSources; ++s) {
    const std::string source = fmt::format("127.0.60.{}", s + 1);
    for (std::size_t i = 0; i < kEach; ++i) {
      idle.push_back(std::make_unique<RawPeer>(b_->endpoint(0), source.c_str()));
      ASSERT_TRUE(idle.back()->connected()) << source;
      ASSERT_EQ(idle.back()->read_some(40 + kChallengeSize),
                static_cast<ssize_t>(40 + kChallengeSize));
    }
  }
  EXPECT_EQ(b_->counters().dropped_connections, 0u);
  RawPeer newest(b_->endpoint(0), "127.0.60.100");
  ASSERT_TRUE(newest.connected());
  EXPECT_EQ(newest.read_some(40 + kChallengeSize), static_cast<ssize_t>(40 + kChallengeSize));
  EXPECT_EQ(idle.front()->read_some(1), 0);  // the oldest was closed
  EXPECT_EQ(b_->counters().dropped_connections, 1u);
}

// The bound itself (common/pending_hellos.h), which the tcp and verbs acceptors and the bootstrap
// root share: one source past its share is refused, naming it, while others are still admitted;
// a settled connection makes room for its source again.
TEST(PendingHellos, ASourcePastItsShareIsRefusedWhileOthersAreAdmitted) {
  PendingHellos<int> pending(2, 8);
  auto a1 = std::make_shared<int>(1), a2 = std::make_shared<int>(2), a3 = std::make_shared<int>(3);
  auto b1 = std::make_shared<int>(4);
  ASSERT_TRUE(pending.admit(a1, "10.0.0.1").is_ok());
  ASSERT_TRUE(pending.admit(a2, "10.0.0.1").is_ok());
  auto refused = pending.admit(a3, "10.0.0.1");
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kNoResource);
  EXPECT_EQ(refused.status().message(),
            "2 connections from 10.0.0.1 are already waiting for their hello");
  auto other = pending.admit(b1, "10.0.0.2");
  ASSERT_TRUE(other.is_ok());
  EXPECT_EQ(*other, nullptr);  // nothing shed
  EXPECT_EQ(pending.size(), 3u);
  pending.settle(a1.get());
  pending.settle(a1.get());  // idempotent
  EXPECT_EQ(pending.from("10.0.0.1"), 1u);
  EXPECT_TRUE(pending.admit(a3, "10.0.0.1").is_ok());
  EXPECT_EQ(pending.from("10.0.0.1"), 2u);
}

// Past the total the oldest connection is shed (returned to be closed, no longer counted), and one
// destroyed without being settled does not hold its place for ever.
TEST(PendingHellos, PastTheTotalTheOldestIsShedAndTheGoneAreForgotten) {
  PendingHellos<int> pending(4, 3);
  std::vector<std::shared_ptr<int>> conns;
  for (int i = 0; i < 3; ++i) {
    conns.push_back(std::make_shared<int>(i));
    ASSERT_TRUE(pending.admit(conns.back(), fmt::format("10.0.1.{}", i)).is_ok());
  }
  auto newest = std::make_shared<int>(3);
  auto shed = pending.admit(newest, "10.0.1.3");
  ASSERT_TRUE(shed.is_ok());
  EXPECT_EQ(*shed, conns[0]);
  EXPECT_EQ(pending.size(), 3u);
  EXPECT_EQ(pending.from("10.0.1.0"), 0u);
  EXPECT_EQ(pending.shed_reason(), "shed: 3 connections were waiting for their hello");
  pending.settle(conns[0].get());  // already gone: ignored
  EXPECT_EQ(pending.size(), 3u);
  // The oldest left (conns[1]) is destroyed without settle(): the next admission drops its entry
  // instead of shedding a live connection.
  conns[1].reset();
  auto later = std::make_shared<int>(4);
  auto none = pending.admit(later, "10.0.1.4");
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(*none, nullptr);
  EXPECT_EQ(pending.size(), 3u);
  EXPECT_EQ(pending.from("10.0.1.1"), 0u);
}

// Plays the acceptor for one connection of `connector` (a raw listener on 127.0.0.53): sends the
// challenge `nonce`, records what the connector sends until it waits for the acknowledgement,
// then closes; `result` is the connect's outcome.
Bytes record_hello(Provider& connector, const Token& token, std::byte nonce, Status* result) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.53", &a.sin_addr);
  EXPECT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(::listen(lfd, 1), 0);
  socklen_t len = sizeof a;
  EXPECT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  RailHello hello;
  hello.token = token;
  hello.dst_incarnation = 1;
  std::promise<Status> done;
  connector.connect(0, encode_endpoint("127.0.0.53", ntohs(a.sin_port)), hello, milliseconds(5000),
                    [&](Result<std::shared_ptr<Rail>> r) { done.set_value(r.status()); });
  std::vector<std::byte> got;
  const int fd = ::accept(lfd, nullptr, nullptr);
  if (fd >= 0) {
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    Bytes challenge = RawPeer::header(0x3252, 7, 0, 0, kChallengeSize);
    challenge.resize(challenge.size() + kChallengeSize, nonce);
    (void)::send(fd, challenge.data(), challenge.size(), MSG_NOSIGNAL);
    std::array<std::byte, 4096> buf{};
    while (true) {  // the hello frame, until the connector waits for the acknowledgement
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 300) <= 0) break;
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      got.insert(got.end(), buf.begin(), buf.begin() + n);
    }
    ::close(fd);  // no acknowledgement: the connector gives up
  }
  auto fut = done.get_future();
  *result = fut.wait_for(std::chrono::seconds(10)) == std::future_status::ready
                ? fut.get()
                : Status(ErrorCode::kTimeout, "the connect did not end");
  ::close(lfd);
  return got;
}

// The connector answers the challenge with an HMAC: the token's bytes appear nowhere in what it
// sends, and a listener that does not know the token cannot complete the handshake.
TEST_F(TcpProviderTest, TheTokenNeverCrossesTheWire) {
  const Token token = token_of(7);
  Status st;
  const Bytes got = record_hello(*a_, token, std::byte{0x42}, &st);
  ASSERT_GT(got.size(), 40u) << "no hello came";
  const std::vector<std::byte> secret(token.size(), std::byte{7});
  EXPECT_EQ(std::search(got.begin(), got.end(), secret.begin(), secret.end()), got.end());
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("during the handshake"), std::string::npos) << st.message();
}

// A genuine hello recorded from one connection does not open another: every acceptor's
// challenge is fresh, so the replayed MAC does not answer it.
TEST_F(TcpProviderTest, AReplayedHelloIsRefused) {
  Status st;
  const Bytes recorded = record_hello(*a_, token_of(7), std::byte{0x42}, &st);
  ASSERT_GT(recorded.size(), 40u);
  RawPeer p(b_->endpoint(0));
  ASSERT_TRUE(p.connected());
  ASSERT_EQ(p.read_some(40 + kChallengeSize), static_cast<ssize_t>(40 + kChallengeSize));
  p.send(recorded);
  EXPECT_EQ(p.read_some(40), 0);  // closed without a handshake reply
  EXPECT_EQ(b_->counters().dropped_connections, 1u);
  std::lock_guard l(m_);
  EXPECT_TRUE(accepted_.empty());
}

TEST_F(TcpProviderTest, AMalformedFrameClosesOnlyThatRail) {
  auto good = open(token_of(7));
  ASSERT_TRUE(good.is_ok());
  rail_a_ = *good;
  RawPeer p(b_->endpoint(0));
  p.hello(token_of(7));
  ASSERT_EQ(p.read_some(40 + kAckSize), 72);  // HELLO_ACK and its proof
  ASSERT_TRUE(b_events_.wait([&] { return accepted_.size() == 2; }));
  p.send(RawPeer::header(0xdead, 3, 0, 0, 0));
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.failed.size() == 1; }));
  EXPECT_NE(b_events_.failed[0].find("malformed frame: bad magic 0xdead"), std::string::npos)
      << b_events_.failed[0];
  EXPECT_EQ(p.read_some(40), 0);  // that rail is closed

  // An unknown op and an oversized control message are malformed too.
  RawPeer q(b_->endpoint(0));
  q.hello(token_of(7));
  ASSERT_EQ(q.read_some(40 + kAckSize), 72);
  q.send(RawPeer::header(0x3252, 77, 0, 0, 0));
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.failed.size() == 2; }));
  EXPECT_NE(b_events_.failed[1].find("unknown frame op 77"), std::string::npos)
      << b_events_.failed[1];
  RawPeer s(b_->endpoint(0));
  s.hello(token_of(7));
  ASSERT_EQ(s.read_some(40 + kAckSize), 72);
  s.send(RawPeer::header(0x3252, 6, 0, 0, 0xffffffffu));
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.failed.size() == 3; }));
  EXPECT_NE(b_events_.failed[2].find("control message of 4294967295 bytes"), std::string::npos)
      << b_events_.failed[2];

  // A header whose checksum does not match (corrupted on the way): nothing of it is acted on.
  RawPeer c(b_->endpoint(0));
  c.hello(token_of(7));
  ASSERT_EQ(c.read_some(40 + kAckSize), 72);
  Bytes corrupt = RawPeer::header(0x3252, 6, 0, 0, 4, 0, 0, true);
  corrupt.resize(corrupt.size() + 4, std::byte{7});
  c.send(corrupt);
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.failed.size() == 4; }));
  EXPECT_NE(b_events_.failed[3].find("malformed frame: header checksum 0x"), std::string::npos)
      << b_events_.failed[3];
  EXPECT_NE(b_events_.failed[3].find("(the header was corrupted on the way)"), std::string::npos)
      << b_events_.failed[3];
  EXPECT_TRUE(b_events_.control.empty());

  // The well-behaved rail still works.
  ASSERT_TRUE(engine_
                  .call([&] {
                    return rail_a_->post_control(std::make_shared<const Bytes>(Bytes{std::byte{9}}),
                                                 0);
                  })
                  .is_ok());
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.control.size() == 1; }));
  EXPECT_TRUE(a_events_.failed.empty());
}

TEST_F(TcpProviderTest, ATruncatedFrameClosesThatRail) {
  RawPeer p(b_->endpoint(0));
  p.hello(token_of(7));
  ASSERT_EQ(p.read_some(40 + kAckSize), 72);
  Bytes h = RawPeer::header(0x3252, 6, 0, 0, 100);
  h.resize(h.size() + 10, std::byte{1});  // 10 of the 100 announced bytes
  p.send(h);
  p.close_now();
  ASSERT_TRUE(b_events_.wait([&] { return b_events_.failed.size() == 1; }));
  EXPECT_NE(b_events_.failed[0].find("truncated frame on rail"), std::string::npos)
      << b_events_.failed[0];
  EXPECT_NE(b_events_.failed[0].find("in the middle of a frame payload"), std::string::npos)
      << b_events_.failed[0];
  EXPECT_TRUE(b_events_.control.empty());
}

// The frame header round-trips, and flipping any one of its bits is caught by the checksum
// (or, in the magic, by the magic): a corrupted header is never acted on.
TEST(TcpFrame, EveryFlippedBitOfAHeaderIsCaught) {
  const tcp_frame::Header h{
      tcp_frame::Op::kWrite, 1, 0x1234, 0xfeedface12345678, 1 << 20, 65536, 42};
  const auto bytes = tcp_frame::encode(h);
  auto back = tcp_frame::decode(bytes);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->op, h.op);
  EXPECT_EQ(back->flags, h.flags);
  EXPECT_EQ(back->imm, h.imm);
  EXPECT_EQ(back->key, h.key);
  EXPECT_EQ(back->offset, h.offset);
  EXPECT_EQ(back->length, h.length);
  EXPECT_EQ(back->cookie, h.cookie);
  // CRC-32C, as any other implementation computes it (bitwise, reflected 0x82F63B78).
  std::uint32_t crc = 0xffffffff;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (i >= tcp_frame::kChecksumAt && i < tcp_frame::kChecksumAt + 4) continue;
    crc ^= static_cast<std::uint8_t>(bytes[i]);
    for (int k = 0; k < 8; ++k)
      crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  EXPECT_EQ(load_le(bytes.data() + tcp_frame::kChecksumAt, 4), crc ^ 0xffffffffu);
  for (std::size_t bit = 0; bit < bytes.size() * 8; ++bit) {
    auto flipped = bytes;
    flipped[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    auto r = tcp_frame::decode(flipped);
    ASSERT_FALSE(r.is_ok()) << "bit " << bit;
    EXPECT_EQ(r.status().code(), ErrorCode::kProtocol);
    EXPECT_NE(r.status().message().find(bit < 16 ? "bad magic" : "header checksum"),
              std::string::npos)
        << r.status().message();
  }
}

TEST(TcpProvider, NeedsANicAndAValidAddress) {
  ProgressEngine engine;
  auto none = make_tcp_provider(engine, {}, {});
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().message(), "the tcp provider needs at least one NIC");
  auto foreign = make_tcp_provider(engine, {nic("198.18.255.254")}, {});
  ASSERT_FALSE(foreign.is_ok());
  EXPECT_NE(foreign.status().message().find("cannot listen on 198.18.255.254"), std::string::npos);
}

}  // namespace
}  // namespace r2ccl

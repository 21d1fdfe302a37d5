// The rail health state machine with a synthetic clock.
#include "health/health.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include "health/prober.h"
#include "r2ccl/runtime/probe_protocol.h"
#include "r2ccl/runtime/provider/progress.h"

namespace r2ccl {
namespace {

using namespace std::chrono_literals;
using TP = RailHealth::TimePoint;

HealthConfig config() {
  return HealthConfig{200ms, 2000ms, 1000ms, 4000ms, 5};
}

class Health : public testing::Test {
 protected:
  TP t0 = TP{} + 1000s;
  RailHealth h{config(), t0};
  TP at(std::chrono::milliseconds ms) const { return t0 + ms; }
  // Probe replies every 20 ms in [from, to).
  void probes(std::chrono::milliseconds from, std::chrono::milliseconds to) {
    for (auto t = from; t < to; t += 20ms)
      h.on_probe_reply(at(t), 100us);
  }
};

TEST_F(Health, ConnectedRailIsUpAndUsable) {
  EXPECT_EQ(h.state(), RailState::kDown);
  EXPECT_FALSE(h.usable());
  h.on_connected(at(0ms));
  EXPECT_EQ(h.state(), RailState::kUp);
  EXPECT_TRUE(h.usable());
  probes(0ms, 500ms);
  EXPECT_EQ(h.tick(at(500ms), false, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.state(), RailState::kUp);
}

TEST_F(Health, SilenceMakesItSuspectThenDownAtTheProbeTimeout) {
  h.on_connected(at(0ms));
  h.on_heard(at(10ms));
  EXPECT_EQ(h.tick(at(100ms), false, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.state(), RailState::kUp);
  EXPECT_EQ(h.tick(at(115ms), false, at(0ms)), HealthAction::kNone);  // 105 ms of silence
  EXPECT_EQ(h.state(), RailState::kSuspect);
  EXPECT_FALSE(h.usable());
  h.on_heard(at(150ms));  // it answers again
  EXPECT_EQ(h.state(), RailState::kUp);
  EXPECT_EQ(h.tick(at(349ms), false, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.tick(at(350ms), false, at(0ms)), HealthAction::kFence);  // 200 ms: black hole
  EXPECT_EQ(h.state(), RailState::kDown);
  EXPECT_NE(h.last_error().find("no probe reply or data for 200ms"), std::string::npos)
      << h.last_error();
  EXPECT_EQ(h.last_detection(), 200ms);
  EXPECT_EQ(h.failovers(), 1u);
  EXPECT_EQ(h.flaps(), 1u);
}

// A sign of life read late (the kernel's acknowledgement, whose age is read at a tick) may be
// older than one already heard: it never moves the silence back.
TEST_F(Health, AnOlderSignOfLifeChangesNothing) {
  h.on_connected(at(0ms));
  h.on_heard(at(50ms));
  h.on_heard(at(20ms));
  EXPECT_EQ(h.tick(at(230ms), false, at(0ms)), HealthAction::kNone);  // 180 ms, not 210 ms
  EXPECT_EQ(h.state(), RailState::kSuspect);
  h.on_heard(at(40ms));  // still older: still SUSPECT
  EXPECT_EQ(h.state(), RailState::kSuspect);
  EXPECT_EQ(h.silence(at(230ms)), 180ms);
  EXPECT_EQ(h.tick(at(250ms), false, at(0ms)), HealthAction::kFence);
  EXPECT_NE(h.last_error().find("for 200ms"), std::string::npos) << h.last_error();
}

// A congested rail whose probes take 150-250 ms to come back is slow, not dead: the silence it
// may keep grows with its measured round trips and their variance (never past four probe
// timeouts), so 300 ms without a reply is not a black hole there, as it is on a fast rail.
TEST_F(Health, TheSilenceLimitFollowsTheMeasuredRoundTrips) {
  h.on_connected(at(0ms));
  EXPECT_EQ(h.silence_limit(), 200ms);  // nothing measured: the probe timeout
  probes(0ms, 400ms);                   // 100 us round trips
  EXPECT_EQ(h.silence_limit(), 200ms);
  for (int i = 0; i < 40; ++i)
    h.on_probe_reply(at(400ms + i * 20ms), i % 2 ? 150ms : 250ms);
  const auto limit = h.silence_limit();
  EXPECT_GT(limit, 400ms);
  EXPECT_LE(limit, 800ms);
  const auto last = at(400ms + 39 * 20ms);
  EXPECT_EQ(h.tick(last + 300ms, false, last), HealthAction::kNone);
  EXPECT_EQ(h.tick(last + std::chrono::ceil<std::chrono::milliseconds>(limit), false, last),
            HealthAction::kFence);
  // However long the round trips, the limit stays bounded.
  RailHealth slow{config(), t0};
  slow.on_connected(at(0ms));
  for (int i = 0; i < 40; ++i)
    slow.on_probe_reply(at(i * 20ms), 5s);
  EXPECT_EQ(slow.silence_limit(), 800ms);
}

TEST_F(Health, UnconfirmedDataWithoutProgressStalls) {
  h.on_connected(at(0ms));
  probes(0ms, 2100ms);  // probes fine, data stuck
  EXPECT_EQ(h.tick(at(1999ms), true, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.tick(at(2000ms), true, at(0ms)), HealthAction::kFence);
  EXPECT_NE(h.last_error().find("stalled"), std::string::npos);
}

TEST_F(Health, LinkDownFencesAtOnceAndTheSameFailureReportedTwiceIsOneFlap) {
  h.on_connected(at(0ms));
  EXPECT_EQ(h.on_failure(at(10ms), "rank 1 reported: link down"), HealthAction::kFence);
  EXPECT_EQ(h.on_link(at(11ms), false), HealthAction::kNone);  // our own report of it, later
  EXPECT_EQ(h.flaps(), 1u);
  EXPECT_EQ(h.failovers(), 1u);
  EXPECT_EQ(h.holddown(), 1000ms);
}

TEST_F(Health, ReadmittedOnlyAfterGoodProbesOverTheHoldDown) {
  h.on_connected(at(0ms));
  EXPECT_EQ(h.on_link(at(100ms), false), HealthAction::kFence);
  EXPECT_EQ(h.on_link(at(300ms), true), HealthAction::kNone);
  EXPECT_EQ(h.state(), RailState::kDown);
  h.on_probe_reply(at(320ms), 50us);
  EXPECT_EQ(h.state(), RailState::kProbing);
  EXPECT_FALSE(h.usable());
  probes(340ms, 1400ms);
  EXPECT_EQ(h.tick(at(1299ms), false, at(0ms)), HealthAction::kNone);  // < 1 s stable
  EXPECT_EQ(h.tick(at(1305ms), false, at(0ms)), HealthAction::kReadmit);
  h.on_connected(at(1310ms));
  EXPECT_EQ(h.state(), RailState::kUp);
}

TEST_F(Health, WhileProbingOnlyAProbeTimeoutOfSilenceIsAFlap) {
  h.on_connected(at(0ms));
  EXPECT_EQ(h.on_link(at(100ms), false), HealthAction::kFence);
  EXPECT_EQ(h.on_link(at(300ms), true), HealthAction::kNone);
  h.on_probe_reply(at(320ms), 50us);
  ASSERT_EQ(h.state(), RailState::kProbing);
  // Replies pause for 150 ms (the probe timeout is 200 ms): a busy moment, not a flap.
  EXPECT_EQ(h.tick(at(470ms), false, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.state(), RailState::kProbing);
  EXPECT_EQ(h.flaps(), 1u);
  // 200 ms without a reply: the rail is down again, one more flap.
  EXPECT_EQ(h.tick(at(520ms), false, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.state(), RailState::kDown);
  EXPECT_EQ(h.flaps(), 2u);
  EXPECT_NE(h.last_error().find("probes stopped answering"), std::string::npos);
}

TEST_F(Health, EachFlapDoublesTheHoldDownUpToTheCapAndStabilityHalvesIt) {
  h.on_connected(at(0ms));
  auto t = 0ms;
  for (int i = 0; i < 6; ++i) {  // down 200 ms, up 200 ms, probes answer while up
    t += 100ms;
    h.on_link(at(t), false);
    t += 200ms;
    h.on_link(at(t), true);
    probes(t + 10ms, t + 200ms);
    EXPECT_EQ(h.tick(at(t + 190ms), false, at(0ms)), HealthAction::kNone) << "flap " << i;
    t += 200ms;
  }
  EXPECT_EQ(h.flaps(), 6u);
  EXPECT_EQ(h.holddown(), 4000ms);  // 1, 2, 4, capped at 4
  // Stable since the last link-up (at t - 200 ms): re-admitted only after the 4 s hold-down.
  probes(t, t + 5000ms);
  EXPECT_EQ(h.tick(at(t + 3700ms), false, at(0ms)), HealthAction::kNone);
  EXPECT_EQ(h.tick(at(t + 3850ms), false, at(0ms)), HealthAction::kReadmit);
  h.on_connected(at(t + 4100ms));
  probes(t + 4100ms, t + 13000ms);
  h.tick(at(t + 8200ms), false, at(0ms));
  EXPECT_EQ(h.holddown(), 2000ms);  // halves after a stable hold-down period
  h.tick(at(t + 10300ms), false, at(0ms));
  EXPECT_EQ(h.holddown(), 1000ms);
  h.tick(at(t + 12000ms), false, at(0ms));
  EXPECT_EQ(h.holddown(), 1000ms);  // never below the configured one
}

TEST_F(Health, DegradedStaysUsable) {
  h.on_connected(at(0ms));
  h.set_degraded(true);
  EXPECT_EQ(h.state(), RailState::kDegraded);
  EXPECT_TRUE(h.usable());
  h.set_degraded(false);
  EXPECT_EQ(h.state(), RailState::kUp);
}

// Review C4: probes go out in the clear every interval, so they carry a tag derived from the job
// token (an HMAC), never any part of the token itself. The probe is caught on a plain UDP socket.
TEST(Prober, AProbeCarriesATagDerivedFromTheTokenAndNoByteRunOfIt) {
  const int catcher = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(catcher, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  ASSERT_EQ(::bind(catcher, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::getsockname(catcher, reinterpret_cast<sockaddr*>(&sa), &len), 0);

  Token token{};
  for (std::size_t i = 0; i < token.size(); ++i)
    token[i] = static_cast<std::uint8_t>(0xA0 + i);
  ProgressEngine engine;
  auto prober = Prober::open(engine, {RailNic{"lo", "127.0.0.1", -1, "", ""}}, token, 42,
                             std::chrono::milliseconds(10), [](int, std::uint32_t, auto) {});
  ASSERT_TRUE(prober.is_ok()) << prober.status().to_string();
  engine.call([&] { (*prober)->add_target(3, 99, 0, "127.0.0.1", ntohs(sa.sin_port)); });

  std::array<std::uint8_t, 512> got{};
  pollfd pfd{catcher, POLLIN, 0};
  ASSERT_EQ(::poll(&pfd, 1, 10000), 1) << "no probe within 10 s";
  const ssize_t n = ::recv(catcher, got.data(), got.size(), 0);
  (*prober)->stop();
  ::close(catcher);
  ASSERT_EQ(n, static_cast<ssize_t>(ProbePacket::kSize));
  const auto p = ProbePacket::decode(got.data(), static_cast<std::size_t>(n));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->type, ProbePacket::Type::kRequest);
  EXPECT_EQ(p->dst, 99u);
  EXPECT_EQ(p->peer, 3u);
  EXPECT_NE(p->tag, 0u);
  // No run of 3 consecutive token bytes anywhere in the datagram.
  for (std::size_t i = 0; i + 3 <= token.size(); ++i) {
    const auto* at = std::search(got.begin(), got.begin() + n, token.begin() + i,
                                 token.begin() + static_cast<std::ptrdiff_t>(i) + 3);
    EXPECT_EQ(at, got.begin() + n) << "token bytes " << i << ".." << i + 2 << " in the probe";
  }
}

// A UDP socket of the test on `address` (port chosen by the kernel).
int udp_socket(const char* address, sockaddr_in* bound) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, address, &sa.sin_addr);
  socklen_t len = sizeof sa;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0)
    return -1;
  *bound = sa;
  return fd;
}

// The next probe request to `fd` for `peer`, waited for at most 10 s.
std::optional<ProbePacket> next_request(int fd, std::uint32_t peer) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  std::array<std::uint8_t, 512> buf{};
  while (std::chrono::steady_clock::now() < until) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 100) != 1) continue;
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n <= 0) continue;
    auto p = ProbePacket::decode(buf.data(), static_cast<std::size_t>(n));
    if (p && p->type == ProbePacket::Type::kRequest && p->peer == peer) return p;
  }
  return std::nullopt;
}

void send_packet(int fd, const ProbePacket& p, const sockaddr_in& to) {
  const auto bytes = p.encode();
  ASSERT_EQ(::sendto(fd, bytes.data(), bytes.size(), 0, reinterpret_cast<const sockaddr*>(&to),
                     sizeof to),
            static_cast<ssize_t>(bytes.size()));
}

// Review m6: the probe tag is the same for every probe of the job, so a reply counts only if it
// answers a probe that was sent and not answered yet, from where that probe went. Replies from
// another address, with a sequence never sent, and a second copy of an answered one are ignored;
// the genuine one counts once. A genuine reply for another peer, sent last on the same socket,
// marks the end (datagrams on one socket are handled in order).
TEST(Prober, OnlyAReplyToAnUnansweredProbeFromWhereItWentCounts) {
  sockaddr_in responder_at{}, elsewhere_at{};
  const int responder = udp_socket("127.0.0.1", &responder_at);
  const int elsewhere = udp_socket("127.0.0.2", &elsewhere_at);
  ASSERT_GE(responder, 0);
  ASSERT_GE(elsewhere, 0);
  Token token{};
  token.fill(0x33);
  std::mutex m;
  std::condition_variable cv;
  std::vector<int> replies;  // the peer of each reply that counted
  ProgressEngine engine;
  auto prober = Prober::open(engine, {RailNic{"lo", "127.0.0.1", -1, "", ""}}, token, 42,
                             std::chrono::milliseconds(10), [&](int peer, std::uint32_t, auto) {
                               std::lock_guard lock(m);
                               replies.push_back(peer);
                               cv.notify_all();
                             });
  ASSERT_TRUE(prober.is_ok()) << prober.status().to_string();
  sockaddr_in prober_at{};
  prober_at.sin_family = AF_INET;
  prober_at.sin_port = htons((*prober)->port(0));
  inet_pton(AF_INET, "127.0.0.1", &prober_at.sin_addr);
  engine.call([&] {
    (*prober)->add_target(3, 99, 0, "127.0.0.1", ntohs(responder_at.sin_port));
    (*prober)->add_target(4, 100, 0, "127.0.0.1", ntohs(responder_at.sin_port));
  });

  auto request = next_request(responder, 3);
  ASSERT_TRUE(request.has_value()) << "no probe within 10 s";
  const ProbePacket reply = request->reply();
  send_packet(elsewhere, reply, prober_at);  // from another address
  ProbePacket never_sent = reply;
  never_sent.sequence += 1000;
  send_packet(responder, never_sent, prober_at);
  send_packet(responder, reply, prober_at);  // the genuine one
  send_packet(responder, reply, prober_at);  // again
  auto marker = next_request(responder, 4);
  ASSERT_TRUE(marker.has_value()) << "no probe within 10 s";
  send_packet(responder, marker->reply(), prober_at);
  {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(
        lock, 10s, [&] { return std::find(replies.begin(), replies.end(), 4) != replies.end(); }));
    EXPECT_EQ(std::count(replies.begin(), replies.end(), 3), 1);
  }
  (*prober)->stop();
  ::close(responder);
  ::close(elsewhere);
}

// Standalone endpoints have tokens of their own: a channel's probes carry the tag of the token
// that authenticated it (the endpoint that was dialled), and the dialling side answers that tag
// once it accepted it. Without accept_tag a probe with another endpoint's tag is not answered.
TEST(Prober, EndpointsWithTheirOwnTokensAnswerTheChannelsTag) {
  Token token_a{}, token_b{};
  token_a.fill(0x11);
  token_b.fill(0x22);
  const std::uint64_t channel_tag = Prober::tag_of(token_b);  // A dialled B
  ASSERT_NE(channel_tag, Prober::tag_of(token_a));
  std::mutex m;
  std::condition_variable cv;
  int a_heard = 0, b_heard = 0;
  auto counter = [&](int& n) {
    return [&](int, std::uint32_t, auto) {
      std::lock_guard lock(m);
      ++n;
      cv.notify_all();
    };
  };
  ProgressEngine engine;
  const RailNic lo{"lo", "127.0.0.1", -1, "", ""};
  auto a = Prober::open(engine, {lo}, token_a, 1, std::chrono::milliseconds(10), counter(a_heard));
  auto b = Prober::open(engine, {lo}, token_b, 2, std::chrono::milliseconds(10), counter(b_heard));
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  engine.call([&] {
    (*a)->add_target(7, 2, 0, "127.0.0.1", (*b)->port(0), channel_tag);
    (*b)->add_target(8, 1, 0, "127.0.0.1", (*a)->port(0), channel_tag);
  });
  {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return a_heard >= 3; })) << "B never answered A";
    // A has not accepted B's tag yet: B's probes (thirty of them meanwhile) go unanswered.
    cv.wait_for(lock, 300ms, [&] { return b_heard > 0; });
    EXPECT_EQ(b_heard, 0);
  }
  engine.call([&] { (*a)->accept_tag(channel_tag); });
  {
    std::unique_lock lock(m);
    EXPECT_TRUE(cv.wait_for(lock, 10s, [&] { return b_heard >= 3; })) << "A never answered B";
  }
  (*a)->stop();
  (*b)->stop();
}

}  // namespace
}  // namespace r2ccl

#include "r2ccl/monitor/probe.h"

#include <gtest/gtest.h>

namespace r2ccl::mon {
namespace {

using std::chrono::milliseconds;

TEST(ProbeSpec, Parses) {
  auto s = parse_probe_spec("eth1=198.18.1.2");
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(s->device, "eth1");
  EXPECT_EQ(s->peer, "198.18.1.2");
  EXPECT_EQ(s->port, kDefaultEchoPort);
  EXPECT_EQ(s->peer_label(), "198.18.1.2");

  s = parse_probe_spec("eth2=198.18.2.2:4000");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->port, 4000);
  EXPECT_EQ(s->peer_label(), "198.18.2.2:4000");

  s = parse_probe_spec("eth2=198.18.2.2", 1234);  // the default follows --echo-port
  ASSERT_TRUE(s);
  EXPECT_EQ(s->port, 1234);
  EXPECT_EQ(s->peer_label(), "198.18.2.2");
}

TEST(ProbeSpec, RejectsWithTheArgument) {
  for (const char* bad : {"eth1", "=198.18.1.2", "eth1=", "eth1=host.example", "eth1=1.2.3",
                          "eth1=198.18.1.2:0", "eth1=198.18.1.2:70000", "eth1=198.18.1.2:x"}) {
    auto s = parse_probe_spec(bad);
    ASSERT_FALSE(s) << bad;
    EXPECT_NE(s.status().message().find(bad), std::string::npos) << s.status().message();
  }
}

TEST(ProbePacket, RoundTrip) {
  ProbePacket p;
  p.type = ProbePacket::Type::kReply;
  p.peer = 0xdeadbeef;
  p.tag = 7;
  p.src = 0x1111;
  p.dst = 0x2222;
  p.rail = 3;
  p.sequence = 0x0102030405060708ULL;
  p.send_time_ns = 42;
  const auto bytes = p.encode();
  ASSERT_EQ(bytes.size(), 56u);
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 4), "R2PB");
  EXPECT_EQ(bytes[40], 0x08);  // little-endian sequence
  auto q = ProbePacket::decode(bytes.data(), bytes.size());
  ASSERT_TRUE(q);
  EXPECT_EQ(q->type, ProbePacket::Type::kReply);
  EXPECT_EQ(q->peer, 0xdeadbeefu);
  EXPECT_EQ(q->tag, 7u);
  EXPECT_EQ(q->src, 0x1111u);
  EXPECT_EQ(q->dst, 0x2222u);
  EXPECT_EQ(q->rail, 3u);
  EXPECT_EQ(q->sequence, 0x0102030405060708ULL);
  EXPECT_EQ(q->send_time_ns, 42u);
}

TEST(ProbePacket, RejectsMalformed) {
  ProbePacket p;
  auto bytes = p.encode();
  EXPECT_FALSE(ProbePacket::decode(bytes.data(), bytes.size() - 1));
  EXPECT_FALSE(ProbePacket::decode(nullptr, 0));
  auto bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_FALSE(ProbePacket::decode(bad_magic.data(), bad_magic.size()));
  auto bad_version = bytes;
  bad_version[4] = 9;
  EXPECT_FALSE(ProbePacket::decode(bad_version.data(), bad_version.size()));
  auto bad_type = bytes;
  bad_type[5] = 3;
  EXPECT_FALSE(ProbePacket::decode(bad_type.data(), bad_type.size()));
}

class WindowTest : public ::testing::Test {
 protected:
  Clock::time_point t0 = Clock::time_point() + std::chrono::hours(1);
  Clock::time_point at(int ms) const { return t0 + milliseconds(ms); }
};

TEST_F(WindowTest, EmptyWindow) {
  ProbeWindow w(10, milliseconds(1000));
  const auto s = w.stats();
  EXPECT_EQ(s.window_count, 0u);
  EXPECT_EQ(s.loss_ratio, 0.0);
  EXPECT_FALSE(s.rtt_mean_seconds.has_value());
  EXPECT_FALSE(s.degraded(10));
}

TEST_F(WindowTest, RttMeanAndLoss) {
  ProbeWindow w(10, milliseconds(1000));
  w.sent(1, at(0));
  w.sent(2, at(100));
  w.sent(3, at(200));
  w.sent(4, at(300));
  EXPECT_EQ(w.answered(1, at(2)), milliseconds(2));
  EXPECT_EQ(w.answered(2, at(104)), milliseconds(4));
  EXPECT_EQ(w.stats().pending, 2u);
  w.expire(at(1250));  // 3 (sent at 200) is past the 1 s timeout, 4 (sent at 300) is not
  auto s = w.stats();
  EXPECT_EQ(s.window_count, 3u);
  EXPECT_EQ(s.window_lost, 1u);
  EXPECT_EQ(s.pending, 1u);
  EXPECT_DOUBLE_EQ(s.loss_ratio, 1.0 / 3.0);
  ASSERT_TRUE(s.rtt_mean_seconds.has_value());
  EXPECT_NEAR(*s.rtt_mean_seconds, 0.003, 1e-12);
  EXPECT_NEAR(*s.rtt_last_seconds, 0.004, 1e-12);
  EXPECT_EQ(s.sent_total, 4u);
  EXPECT_EQ(s.lost_total, 1u);
  EXPECT_FALSE(s.degraded(10));
}

TEST_F(WindowTest, LateDuplicateAndUnknownRepliesAreIgnored) {
  ProbeWindow w(10, milliseconds(100));
  w.sent(1, at(0));
  w.expire(at(150));
  EXPECT_FALSE(w.answered(1, at(160)));   // too late: already lost
  EXPECT_FALSE(w.answered(99, at(160)));  // never sent
  w.sent(2, at(200));
  EXPECT_TRUE(w.answered(2, at(201)));
  EXPECT_FALSE(w.answered(2, at(202)));  // duplicate
  const auto s = w.stats();
  EXPECT_EQ(s.window_count, 2u);
  EXPECT_EQ(s.window_lost, 1u);
}

TEST_F(WindowTest, ReplyAfterTheTimeoutCountsAsLost) {
  ProbeWindow w(10, milliseconds(100));
  w.sent(1, at(0));
  EXPECT_FALSE(w.answered(1, at(150)));  // expire() did not run yet, but it is too late
  EXPECT_EQ(w.stats().window_lost, 1u);
}

TEST_F(WindowTest, SlidesOverTheLastCapacityProbes) {
  ProbeWindow w(4, milliseconds(1000));
  std::uint64_t seq = 0;
  for (int i = 0; i < 4; ++i)
    w.send_failed(++seq);  // link down: four losses
  EXPECT_DOUBLE_EQ(w.stats().loss_ratio, 1.0);
  EXPECT_TRUE(w.stats().degraded(4));
  for (int i = 0; i < 2; ++i) {  // two good probes push two losses out
    w.sent(++seq, at(i * 10));
    w.answered(seq, at(i * 10 + 1));
  }
  EXPECT_DOUBLE_EQ(w.stats().loss_ratio, 0.5);
  EXPECT_TRUE(w.stats().degraded(4));  // ≥ 50% is degraded
  w.sent(++seq, at(100));
  w.answered(seq, at(101));
  EXPECT_DOUBLE_EQ(w.stats().loss_ratio, 0.25);
  EXPECT_FALSE(w.stats().degraded(4));
  EXPECT_EQ(w.stats().window_count, 4u);
  EXPECT_EQ(w.stats().sent_total, 7u);
  EXPECT_EQ(w.stats().lost_total, 4u);
}

TEST_F(WindowTest, SendFailedAfterSentCountsOnce) {
  ProbeWindow w(10, milliseconds(1000));
  w.sent(1, at(0));
  w.send_failed(1);
  const auto s = w.stats();
  EXPECT_EQ(s.sent_total, 1u);
  EXPECT_EQ(s.lost_total, 1u);
  EXPECT_EQ(s.pending, 0u);
}

TEST_F(WindowTest, NoVerdictFromTooFewProbes) {
  ProbeWindow w(20, milliseconds(1000));
  w.send_failed(1);
  w.send_failed(2);
  EXPECT_DOUBLE_EQ(w.stats().loss_ratio, 1.0);
  EXPECT_FALSE(w.stats().degraded(20));  // 2 < kMinProbesForVerdict
  w.send_failed(3);
  EXPECT_TRUE(w.stats().degraded(20));
  // A window smaller than the minimum decides once it is full.
  ProbeWindow small(1, milliseconds(1000));
  small.send_failed(1);
  EXPECT_TRUE(small.stats().degraded(1));
}

TEST_F(WindowTest, PendingIsBounded) {
  ProbeWindow w(2, milliseconds(1000));
  for (std::uint64_t s = 1; s <= 1000; ++s)
    w.sent(s, at(0));  // never expired, never answered
  EXPECT_LE(w.stats().pending, 2u * 4 + 64);
  EXPECT_EQ(w.stats().window_count, 2u);
}

}  // namespace
}  // namespace r2ccl::mon

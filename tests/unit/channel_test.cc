#include <gtest/gtest.h>

#include "channel/ledger.h"
#include "channel/scheduler.h"
#include "r2ccl/runtime/telemetry.h"

namespace r2ccl {
namespace {

TEST(ChunkImm, RoundTrips) {
  const auto imm = ChunkImm::encode(4095, ChunkImm::kMaxChunks - 1);
  EXPECT_EQ(ChunkImm::slot(imm), 4095u);
  EXPECT_EQ(ChunkImm::index(imm), ChunkImm::kMaxChunks - 1);
  EXPECT_EQ(ChunkImm::slot(ChunkImm::encode(7, 0)), 7u);
}

TEST(ArrivalSet, CountsEachChunkOnceAndIgnoresOutOfRange) {
  ArrivalSet s(130);
  EXPECT_FALSE(s.complete());
  EXPECT_TRUE(s.mark(0));
  EXPECT_FALSE(s.mark(0));  // delivered twice counts once
  EXPECT_FALSE(s.mark(130));
  EXPECT_TRUE(s.mark(129));
  EXPECT_EQ(s.count(), 2u);
  auto missing = s.missing();
  EXPECT_EQ(missing.size(), 128u);
  EXPECT_EQ(missing.front(), 1u);
  for (std::uint32_t i = 0; i < 130; ++i)
    s.mark(i);
  EXPECT_TRUE(s.complete());
  EXPECT_TRUE(ArrivalSet(0).complete());
}

TEST(InflightLedger, KeepsChunksUntilConfirmedAndHandsBackARailsChunks) {
  InflightLedger l;
  const auto a = l.add({1, 0, 0, 0, 100});
  const auto b = l.add({1, 1, 1, 100, 100});
  const auto c = l.add({2, 0, 1, 0, 50});
  const auto d = l.add({2, 1, 0, 50, 50});
  EXPECT_NE(a, 0u);
  EXPECT_EQ(l.size(), 4u);
  EXPECT_EQ(l.bytes_on_rail(1), 150u);
  auto ca = l.confirm(a);
  ASSERT_TRUE(ca.has_value());
  EXPECT_EQ(ca->message, 1u);
  EXPECT_FALSE(l.confirm(a).has_value());  // a repeated confirmation is harmless
  auto lost = l.take_rail(1);
  ASSERT_EQ(lost.size(), 2u);
  EXPECT_EQ(lost[0].message, 1u);  // ordered by message, then index
  EXPECT_EQ(lost[1].message, 2u);
  EXPECT_FALSE(l.confirm(b).has_value());  // taken for replay: a late ack does not count
  EXPECT_FALSE(l.confirm(c).has_value());
  auto gone = l.take_message(2);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].index, 1u);
  EXPECT_FALSE(l.confirm(d).has_value());
  EXPECT_EQ(l.size(), 0u);
}

TEST(RailScheduler, RespectsTheWindowAndSkipsUnusableRails) {
  RailScheduler s(3, 1000);
  s.set_usable(2, false);
  std::vector<int> picks(3, 0);
  for (int i = 0; i < 10; ++i) {
    auto r = s.pick(400);
    if (!r) break;
    ++picks[*r];
  }
  EXPECT_EQ(picks[0], 2);  // 2 x 400 fits a 1000-byte window, a third does not
  EXPECT_EQ(picks[1], 2);
  EXPECT_EQ(picks[2], 0);
  EXPECT_FALSE(s.pick(400).has_value());
  s.release(0, 400);
  EXPECT_EQ(s.pick(400), std::optional<std::size_t>(0));
  // An idle rail always takes a chunk, even one larger than the window.
  s.set_usable(2, true);
  EXPECT_EQ(s.pick(5000), std::optional<std::size_t>(2));
  EXPECT_EQ(s.usable_count(), 3u);
}

TEST(RailScheduler, EarliestFinishGivesASlowRailItsShareAndTheTailToFastRails) {
  // Rail 1 is a quarter as fast; windows large enough not to matter.
  RailScheduler s(2, 1ull << 40);
  s.set_bandwidth(0, 4e6);
  s.set_bandwidth(1, 1e6);
  std::vector<int> picks(2, 0);
  for (int i = 0; i < 500; ++i)
    ++picks[*s.pick(1000)];
  EXPECT_EQ(picks[0], 400);
  EXPECT_EQ(picks[1], 100);
  EXPECT_DOUBLE_EQ(s.weight(0), 1.0);
  EXPECT_DOUBLE_EQ(s.weight(1), 0.25);
  // With little queued, a chunk goes to the fast rail: it finishes there sooner.
  RailScheduler t(2, 1ull << 40);
  t.set_bandwidth(0, 4e6);
  t.set_bandwidth(1, 1e6);
  EXPECT_EQ(t.pick(1000), std::optional<std::size_t>(0));
  EXPECT_EQ(t.pick(1000), std::optional<std::size_t>(0));
  EXPECT_EQ(t.pick(1000), std::optional<std::size_t>(0));
  // The fourth ties (4000/4e6 == 1000/1e6); after five, rail 0 has four and rail 1 one.
  t.pick(1000);
  t.pick(1000);
  EXPECT_EQ(t.inflight(0), 4000u);
  EXPECT_EQ(t.inflight(1), 1000u);
}

TEST(RailScheduler, WaitsForAFullFastRailRatherThanUseAMuchSlowerOne) {
  RailScheduler s(2, 2000);
  s.set_bandwidth(0, 100e6);
  s.set_bandwidth(1, 1e6);
  EXPECT_EQ(s.pick(1000), std::optional<std::size_t>(0));
  EXPECT_EQ(s.pick(1000), std::optional<std::size_t>(0));
  EXPECT_FALSE(s.pick(1000).has_value());  // rail 1 would take 1 ms; rail 0 frees up in 20 us
  s.release(0, 1000);
  EXPECT_EQ(s.pick(1000), std::optional<std::size_t>(0));
  // Comparable rails share.
  RailScheduler t(2, 2000);
  t.set_bandwidth(0, 2e6);
  t.set_bandwidth(1, 1.5e6);
  EXPECT_EQ(t.pick(1000), std::optional<std::size_t>(0));
  EXPECT_EQ(t.pick(1000), std::optional<std::size_t>(1));  // 0.67 ms there beats 1 ms on rail 0
}

TEST(RailScheduler, UnmeasuredRailsCountAsFastAsTheBestMeasuredOne) {
  RailScheduler s(3, 1ull << 40);
  EXPECT_DOUBLE_EQ(s.weight(0), 1.0);  // nothing measured: all equal
  s.set_bandwidth(0, 5e9);
  EXPECT_DOUBLE_EQ(s.bandwidth(1), 5e9);
  s.set_bandwidth(2, 1e9);
  std::vector<int> picks(3, 0);
  for (int i = 0; i < 110; ++i)
    ++picks[*s.pick(1000)];
  EXPECT_EQ(picks[0], 50);
  EXPECT_EQ(picks[1], 50);
  EXPECT_EQ(picks[2], 10);
  s.clear_bandwidth(0);
  EXPECT_DOUBLE_EQ(s.bandwidth(0), 1e9);  // now the best measured one is rail 2
}

// The rail event log keeps the latest events, oldest dropped first, and counts what it dropped.
TEST(RailEventLog, KeepsTheLatestEventsAndCountsTheDropped) {
  RailEventLog log;
  const std::size_t n = RailEventLog::kMaxEvents + 5;
  for (std::size_t i = 0; i < n; ++i)
    log.add(RailEvent{static_cast<std::int64_t>(i), 1, 0, "eth1", "failed", ""});
  const auto events = log.snapshot();
  ASSERT_EQ(events.size(), RailEventLog::kMaxEvents);
  EXPECT_EQ(events.front().wall_ns, 5);
  EXPECT_EQ(events.back().wall_ns, static_cast<std::int64_t>(n - 1));
  EXPECT_EQ(log.dropped(), 5u);
}

}  // namespace
}  // namespace r2ccl

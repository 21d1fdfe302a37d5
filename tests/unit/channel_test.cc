#include <gtest/gtest.h>

#include "r2ccl/runtime/channel.h"

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

TEST(RailScheduler, SharesFollowWeights) {
  RailScheduler s(2, 1ull << 40);
  s.set_weight(0, 3.0);
  s.set_weight(1, 1.0);
  std::vector<int> picks(2, 0);
  for (int i = 0; i < 400; ++i)
    ++picks[*s.pick(1000)];
  EXPECT_EQ(picks[0], 300);
  EXPECT_EQ(picks[1], 100);
}

TEST(RailScheduler, ARailComingBackStartsLevelInsteadOfTakingEverything) {
  RailScheduler s(2, 1ull << 40);
  s.set_usable(1, false);
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(s.pick(1000), std::optional<std::size_t>(0));
  s.set_usable(1, true);
  std::vector<int> picks(2, 0);
  for (int i = 0; i < 10; ++i)
    ++picks[*s.pick(1000)];
  EXPECT_EQ(picks[0], 5);
  EXPECT_EQ(picks[1], 5);
}

}  // namespace
}  // namespace r2ccl

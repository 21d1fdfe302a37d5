// The communicator's API beyond the data: bad input, R2CCL_CHECK, deadlines, groups, split,
// abort; and the reduction kernels on their own.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "coll_test_util.h"
#include "r2ccl/coll/reduce.h"
#include "r2ccl/coll/verify.h"

namespace r2ccl::coll {
namespace {

TEST(Reduce, HalfAndBfloat16RoundTripAndRoundToNearestEven) {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f})
    EXPECT_EQ(half_to_float(float_to_half(f)), f);
  EXPECT_TRUE(std::isinf(half_to_float(float_to_half(1e6f))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  // 1 + 2^-8 lies halfway between two bfloat16 values: ties go to the even one (1.0).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Reduce, EveryTypeAndOperationOnARaggedLength) {
  // 1000 elements: whole vector blocks plus a tail.
  const std::size_t n = 1000;
  std::vector<float> a(n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(static_cast<int>(i % 13) - 6);
    b[i] = static_cast<float>(static_cast<int>(i % 7) - 3);
  }
  for (DataType t : kAllTypes) {
    for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax}) {
      const std::size_t e = type_size(t);
      std::vector<std::byte> x(n * e), y(n * e), d(n * e);
      auto put = [&](std::vector<std::byte>& buf, std::size_t i, double v) {
        set_element(buf.data(), i, t, v);
      };
      for (std::size_t i = 0; i < n; ++i) {
        put(x, i, a[i]);
        put(y, i, b[i]);
      }
      reduce(d.data(), x.data(), y.data(), n, t, op);
      std::vector<std::byte> want(n * e);
      for (std::size_t i = 0; i < n; ++i) {
        double va = a[i], vb = b[i];
        if (t == DataType::kU8) {  // unsigned: -3 is 253
          va = static_cast<std::uint8_t>(static_cast<int>(va));
          vb = static_cast<std::uint8_t>(static_cast<int>(vb));
        }
        double v = op == RedOp::kSum    ? va + vb
                   : op == RedOp::kProd ? va * vb
                   : op == RedOp::kMin  ? std::min(va, vb)
                                        : std::max(va, vb);
        if (t == DataType::kU8) v = static_cast<std::uint8_t>(static_cast<std::int64_t>(v));
        put(want, i, v);
      }
      EXPECT_EQ(d, want) << type_name(t) << " " << redop_name(op);
    }
  }
  // Signed sums wrap like two's complement instead of overflowing.
  std::int32_t big = std::numeric_limits<std::int32_t>::max(), one = 1, out = 0;
  reduce(&out, &big, &one, 1, DataType::kI32, RedOp::kSum);
  EXPECT_EQ(out, std::numeric_limits<std::int32_t>::min());
  // avg divides once at the end.
  std::vector<std::uint16_t> h{float_to_half(3.0f), float_to_half(-9.0f)};
  finish_avg(h.data(), h.size(), DataType::kF16, 3);
  EXPECT_EQ(half_to_float(h[0]), 1.0f);
  EXPECT_EQ(half_to_float(h[1]), -3.0f);
}

TEST(Types, NamesParseAndBadNamesAreExplained) {
  EXPECT_EQ(*parse_type("bfloat16"), DataType::kBF16);
  EXPECT_EQ(*parse_type("BF16"), DataType::kBF16);
  EXPECT_EQ(*parse_type("half"), DataType::kF16);
  EXPECT_EQ(*parse_type("uint8"), DataType::kU8);
  EXPECT_EQ(*parse_redop("avg"), RedOp::kAvg);
  auto bad = parse_type("float128");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(),
            "unknown data type 'float128': expected float, half, bfloat16, double, int32, int64 "
            "or uint8 (or f32, f16, bf16, f64, i32, i64, u8)");
  EXPECT_EQ(parse_redop("mean").status().message(),
            "unknown reduction 'mean': expected sum, prod, min, max or avg");
  EXPECT_EQ(check_type_and_op(DataType::kI32, RedOp::kAvg).message(),
            "reduction avg is not supported for int32: it needs a floating-point type (an integer "
            "mean would truncate)");
}

TEST(Plans, EverySendMeetsAReceiveOfTheSameLength) {
  // The simulator's view: all ranks' plans, matched per ordered pair in plan order.
  for (int p = 1; p <= 6; ++p)
    for (CollOp op : {CollOp::kAllReduce, CollOp::kAllGather, CollOp::kReduceScatter,
                      CollOp::kBroadcast, CollOp::kReduce, CollOp::kBarrier})
      for (Algo a : {Algo::kRing, Algo::kOneShot, Algo::kTwoShot})
        for (std::size_t count : {std::size_t{1}, std::size_t{5}, std::size_t{1} << 20}) {
          CollDesc d{op, count, DataType::kF32, RedOp::kSum, p - 1, false};
          std::map<std::pair<int, int>, std::vector<std::size_t>> sent, received;
          for (int r = 0; r < p; ++r) {
            auto plan = make_plan(d, r, p, a);
            ASSERT_TRUE(plan.is_ok());
            for (const auto& ph : plan->phases)
              for (const auto& s : ph.comm) {
                ASSERT_NE(s.peer, r);
                if (s.bytes == 0) continue;
                if (s.kind == Step::Kind::kSend) sent[{r, s.peer}].push_back(s.bytes);
                if (s.kind == Step::Kind::kRecv) received[{s.peer, r}].push_back(s.bytes);
              }
          }
          EXPECT_EQ(sent, received)
              << coll_op_name(op) << " " << algo_name(a) << " p=" << p << " count=" << count;
        }
}

TEST(Plans, AutoPicksDirectForSmallAndRingForLarge) {
  CollDesc small{CollOp::kAllReduce, 16, DataType::kF32, RedOp::kSum, 0, false};
  CollDesc large{CollOp::kAllReduce, 1 << 20, DataType::kF32, RedOp::kSum, 0, false};
  EXPECT_EQ(choose_algo(small, 4, Algo::kAuto), Algo::kOneShot);
  EXPECT_EQ(choose_algo(large, 4, Algo::kAuto), Algo::kRing);
  EXPECT_EQ(choose_algo(large, 4, Algo::kTwoShot), Algo::kTwoShot);
  EXPECT_EQ(parse_algo("tree").status().message(),
            "unknown algorithm 'tree': expected auto, ring, oneshot, twoshot, balance, r2cc or "
            "weighted");
}

// Two ranks: one-shot where it takes fewer rounds and handshakes than the ring's two halves.
TEST(Plans, TwoRanksWeighRoundsAndHandshakes) {
  const auto allreduce = [](std::size_t bytes) {
    return CollDesc{CollOp::kAllReduce, bytes / 4, DataType::kF32, RedOp::kSum, 0, false};
  };
  constexpr std::size_t kOneRail = 64 << 10, kRails = 8 << 10;
  EXPECT_EQ(choose_algo(allreduce(64 << 10), 2, Algo::kAuto, kOneRail), Algo::kOneShot);   // 1 : 2
  EXPECT_EQ(choose_algo(allreduce(128 << 10), 2, Algo::kAuto, kOneRail), Algo::kRing);     // 2 : 2
  EXPECT_EQ(choose_algo(allreduce(256 << 10), 2, Algo::kAuto, kOneRail), Algo::kOneShot);  // 2 : 4
  EXPECT_EQ(choose_algo(allreduce(1 << 20), 2, Algo::kAuto, kOneRail), Algo::kOneShot);
  EXPECT_EQ(choose_algo(allreduce(2 << 20), 2, Algo::kAuto, kOneRail), Algo::kRing);    // too large
  EXPECT_EQ(choose_algo(allreduce(64 << 10), 2, Algo::kAuto, kRails), Algo::kOneShot);  // 2 : 4
  EXPECT_EQ(choose_algo(allreduce(256 << 10), 2, Algo::kAuto, 0), Algo::kRing);  // limit unknown
  EXPECT_EQ(choose_algo(allreduce(256 << 10), 4, Algo::kAuto, kOneRail), Algo::kRing);  // 4 ranks
  EXPECT_EQ(choose_algo(allreduce(256 << 10), 2, Algo::kRing, kOneRail), Algo::kRing);  // asked for
  const CollDesc gather{CollOp::kAllGather, 64 << 10, DataType::kF32, RedOp::kSum, 0, false};
  EXPECT_EQ(choose_algo(gather, 2, Algo::kAuto, kOneRail), Algo::kRing);  // all-reduce only
}

TEST(Communicator, BadInputIsRefusedWithTheReasonAndTheCommunicatorStaysUsable) {
  auto comms = test::make_comms(3);
  ASSERT_EQ(comms.size(), 3u);
  test::on_all(comms, [](int r, Communicator& c) {
    std::vector<float> a(8, 1.0f), b(8, 0.0f);
    auto msg = [](const Status& st) { return st.is_ok() ? std::string("OK") : st.message(); };
    EXPECT_EQ(msg(c.all_reduce(nullptr, b.data(), 8, DataType::kF32, RedOp::kSum)),
              "allreduce: the send buffer is null (count 8)");
    EXPECT_EQ(msg(c.all_reduce(a.data(), nullptr, 8, DataType::kF32, RedOp::kSum)),
              "allreduce: the receive buffer is null (count 8)");
    EXPECT_EQ(msg(c.all_gather(a.data(), b.data(), std::numeric_limits<std::size_t>::max() / 2,
                               DataType::kF32)),
              fmt::format("allgather: count {} of float (4 bytes each, times 3 ranks) overflows "
                          "the largest buffer size",
                          std::numeric_limits<std::size_t>::max() / 2));
    EXPECT_EQ(msg(c.all_reduce(a.data(), b.data(), 8, DataType::kI32, RedOp::kAvg)),
              "allreduce: reduction avg is not supported for int32: it needs a floating-point "
              "type (an integer mean would truncate)");
    EXPECT_EQ(msg(c.all_reduce(a.data(), b.data(), 8, static_cast<DataType>(42), RedOp::kSum)),
              "allreduce: unsupported data type (value 42)");
    EXPECT_EQ(msg(c.all_reduce(a.data(), b.data(), 8, DataType::kF32, static_cast<RedOp>(9))),
              "allreduce: unsupported reduction (value 9)");
    EXPECT_EQ(msg(c.broadcast(a.data(), b.data(), 8, DataType::kF32, 3)),
              "broadcast: root 3 is out of range (0..2)");
    EXPECT_EQ(msg(c.reduce(a.data(), b.data(), 8, DataType::kF32, RedOp::kSum, -1)),
              "reduce: root -1 is out of range (0..2)");
    EXPECT_EQ(msg(c.send(a.data(), 8, DataType::kF32, 7)), "send: peer 7 is out of range (0..2)");
    EXPECT_EQ(msg(c.recv(nullptr, 8, DataType::kF32, 0)), "recv: the buffer is null (count 8)");
    EXPECT_EQ(msg(c.group_end()), "group_end: no group was started (group_start)");
    // Still usable: a real all-reduce right after.
    for (auto& x : a)
      x = static_cast<float>(r + 1);
    ASSERT_TRUE(c.all_reduce(a.data(), b.data(), 8, DataType::kF32, RedOp::kSum).is_ok());
    for (float x : b)
      EXPECT_EQ(x, 6.0f);
    // Reduce: non-root ranks may pass a null receive buffer; broadcast: a null send buffer.
    ASSERT_TRUE(
        c.reduce(a.data(), r == 1 ? b.data() : nullptr, 8, DataType::kF32, RedOp::kMax, 1).is_ok());
    if (r == 1) {
      for (float x : b)
        EXPECT_EQ(x, 3.0f);
    }
    std::vector<std::int64_t> v(5, r == 2 ? 77 : 0);
    ASSERT_TRUE(c.broadcast(r == 2 ? v.data() : nullptr, v.data(), 5, DataType::kI64, 2).is_ok());
    for (auto x : v)
      EXPECT_EQ(x, 77);
  });
}

TEST(Communicator, CheckFailsEveryRankOnAMismatchAndStaysUsable) {
  auto comms = test::make_comms(3, {{"R2CCL_CHECK", "1"}});
  ASSERT_EQ(comms.size(), 3u);
  test::on_all(comms, [](int r, Communicator& c) {
    std::vector<float> a(12, 1.0f), b(36, 0.0f);
    Status st = r == 1 ? c.all_gather(a.data(), b.data(), 12, DataType::kF32)
                       : c.all_reduce(a.data(), b.data(), 12, DataType::kF32, RedOp::kSum);
    EXPECT_EQ(st.message(),
              "mismatched collective (R2CCL_CHECK=1): rank 0 called allreduce(count 12, float, "
              "sum) but rank 1 called allgather(count 12, float)");
    st = c.all_reduce(a.data(), b.data(), r == 2 ? 11 : 12, DataType::kF32, RedOp::kSum);
    EXPECT_EQ(st.message(),
              "mismatched collective (R2CCL_CHECK=1): rank 0 called allreduce(count 12, float, "
              "sum) but rank 2 called allreduce(count 11, float, sum)");
    st = c.broadcast(a.data(), a.data(), 12, DataType::kF32, r == 0 ? 1 : 0);
    EXPECT_EQ(st.message(),
              "mismatched collective (R2CCL_CHECK=1): rank 0 called broadcast(count 12, float, "
              "root 1) but rank 1 called broadcast(count 12, float, root 0)");
    ASSERT_TRUE(c.all_reduce(a.data(), b.data(), 12, DataType::kF32, RedOp::kSum).is_ok());
    for (int i = 0; i < 12; ++i)
      EXPECT_EQ(b[static_cast<std::size_t>(i)], 3.0f);
  });
}

TEST(Communicator, CheckNamesAMismatchAcrossTheDegradedModeThreshold) {
  // Ranks 0 and 1 reach degraded mode's agreement (4000 bytes), rank 2 not (400): the check's
  // diagnosis, not a failed agreement exchange.
  auto comms = test::make_comms(3, {{"R2CCL_CHECK", "1"}, {"R2CCL_DEGRADED_MIN_BYTES", "1K"}});
  ASSERT_EQ(comms.size(), 3u);
  test::on_all(comms, [](int r, Communicator& c) {
    std::vector<float> a(1000, 1.0f), b(1000, 0.0f);
    Status st = c.all_reduce(a.data(), b.data(), r == 2 ? 100 : 1000, DataType::kF32, RedOp::kSum);
    EXPECT_EQ(st.message(),
              "mismatched collective (R2CCL_CHECK=1): rank 0 called allreduce(count 1000, float, "
              "sum) but rank 2 called allreduce(count 100, float, sum)");
    ASSERT_TRUE(c.all_reduce(a.data(), b.data(), 1000, DataType::kF32, RedOp::kSum).is_ok());
    for (float x : b)
      EXPECT_EQ(x, 3.0f);
  });
}

TEST(Communicator, WithoutCheckASizeMismatchFailsInsteadOfHanging) {
  auto comms = test::make_comms(2, {{"R2CCL_TIMEOUT", "3s"}, {"R2CCL_ALGO", "ring"}});
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int r, Communicator& c) {
    std::vector<float> a(200, 1.0f), b(200);
    const auto t0 = std::chrono::steady_clock::now();
    Status st = c.all_reduce(a.data(), b.data(), r == 0 ? 100 : 200, DataType::kF32, RedOp::kSum);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("allreduce(count"), std::string::npos) << st.message();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15)) << st.message();
  });
  // A rank whose peer never joins the collective fails at the deadline, naming it.
  test::on_all(comms, [](int r, Communicator& c) {
    if (r != 0) return;
    Status st = c.barrier();
    EXPECT_EQ(st.code(), ErrorCode::kTimeout) << st.to_string();
    EXPECT_NE(st.message().find("barrier"), std::string::npos) << st.message();
  });
}

// Rank 0 refuses a collective (a null buffer) that ranks 1 and 2 start: they post their messages
// (the small ones complete at once, eagerly) and fail at the deadline. Once the ranks meet again
// (as an application does after a failure, on its own path), the next collectives pair every
// message with its own operation's: every rank gets the right sums, none of the stale 100s.
TEST(Communicator, ACollectiveThatFailedOnSomeRanksLeavesNothingForTheNext) {
  auto comms = test::make_comms(3, {{"R2CCL_TIMEOUT", "500ms"}});
  ASSERT_EQ(comms.size(), 3u);
  std::barrier meet(3);
  test::on_all(comms, [&meet](int r, Communicator& c) {
    for (std::size_t count : {std::size_t{1000}, std::size_t{300000}}) {
      std::vector<float> a(count, 100.0f), b(count, 0.0f);
      Status st =
          c.all_reduce(r == 0 ? nullptr : a.data(), b.data(), count, DataType::kF32, RedOp::kSum);
      if (r == 0)
        EXPECT_EQ(st.message(),
                  fmt::format("allreduce: the send buffer is null (count {})", count));
      else
        EXPECT_FALSE(st.is_ok());
      meet.arrive_and_wait();
      for (int round = 0; round < 3; ++round) {
        std::fill(a.begin(), a.end(), static_cast<float>(r + 1 + round));
        ASSERT_TRUE(c.all_reduce(a.data(), b.data(), count, DataType::kF32, RedOp::kSum).is_ok())
            << "count " << count << ", round " << round;
        EXPECT_EQ(std::count(b.begin(), b.end(), static_cast<float>(6 + 3 * round)),
                  static_cast<std::ptrdiff_t>(count))
            << "count " << count << ", round " << round;
      }
    }
  });
}

// Legal programs may be unbalanced: a root's small broadcasts complete once queued (eagerly), so
// a root can run a hundred collectives ahead of a rank that is busy, and then start a large one
// whose request-to-send reaches that rank 101 epochs ahead of it. The same holds for non-root
// ranks running reduces ahead of a busy root. Nothing is cut off: every byte arrives on every
// rank once the busy ones join, and no asynchronous error is raised.
TEST(Communicator, RanksFarAheadOfABusyRankAreNotCutOff) {
  auto comms = test::make_comms(3);
  ASSERT_EQ(comms.size(), 3u);
  constexpr int kSmall = 100;
  constexpr std::size_t kLarge = (std::size_t{1} << 20) + 3;
  const auto small_count = [](int i) { return static_cast<std::size_t>(1 + 37 * i % 1500); };
  const auto byte_of = [](int i, std::size_t k) {
    return static_cast<std::uint8_t>((k * 131 + static_cast<std::size_t>(i) * 17 + 5) & 0xff);
  };
  test::on_all(comms, [&](int r, Communicator& c) {
    // Broadcasts from rank 0, which runs ahead of ranks 1 and 2 (they sleep first).
    if (r != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (int i = 0; i <= kSmall; ++i) {
      const std::size_t n = i < kSmall ? small_count(i) : kLarge;
      std::vector<std::uint8_t> buf(n);
      if (r == 0)
        for (std::size_t k = 0; k < n; ++k)
          buf[k] = byte_of(i, k);
      ASSERT_TRUE(c.broadcast(buf.data(), buf.data(), n, DataType::kU8, 0).is_ok())
          << "rank " << r << ", broadcast " << i;
      for (std::size_t k = 0; k < n; ++k)
        ASSERT_EQ(buf[k], byte_of(i, k)) << "rank " << r << ", broadcast " << i << ", byte " << k;
    }
    // Reduces to rank 0, which is busy now while ranks 1 and 2 run ahead of it.
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (int i = 0; i <= kSmall; ++i) {
      const std::size_t n = i < kSmall ? small_count(i) : kLarge / 4;
      std::vector<std::int32_t> in(n), out(n, -1);
      for (std::size_t k = 0; k < n; ++k)
        in[k] = static_cast<std::int32_t>(k * 7 + static_cast<std::size_t>(i + r * 1000));
      ASSERT_TRUE(c.reduce(in.data(), out.data(), n, DataType::kI32, RedOp::kSum, 0).is_ok())
          << "rank " << r << ", reduce " << i;
      if (r != 0) continue;
      for (std::size_t k = 0; k < n; ++k)
        ASSERT_EQ(out[k],
                  static_cast<std::int32_t>(3 * (k * 7 + static_cast<std::size_t>(i)) + 3000))
            << "reduce " << i << ", element " << k;
    }
    EXPECT_TRUE(c.async_error().is_ok()) << "rank " << r << ": " << c.async_error().to_string();
  });
}

TEST(Communicator, GroupedSendsAndReceivesRunTogether) {
  auto comms = test::make_comms(4);
  ASSERT_EQ(comms.size(), 4u);
  test::on_all(comms, [](int r, Communicator& c) {
    const int p = c.size();
    // Everyone sends to the next and receives from the previous: without a group each blocking
    // send would wait for a receive nobody has posted yet.
    std::vector<std::int32_t> out(100001), in(100001, -1), self_in(3, 0), self_out{1, 2, 3};
    std::iota(out.begin(), out.end(), r * 1000);
    ASSERT_TRUE(c.group_start().is_ok());
    ASSERT_TRUE(c.send(out.data(), out.size(), DataType::kI32, (r + 1) % p).is_ok());
    ASSERT_TRUE(c.recv(in.data(), in.size(), DataType::kI32, (r + p - 1) % p).is_ok());
    ASSERT_TRUE(c.send(self_out.data(), 3, DataType::kI32, r).is_ok());
    ASSERT_TRUE(c.recv(self_in.data(), 3, DataType::kI32, r).is_ok());
    ASSERT_TRUE(c.group_end().is_ok());
    for (std::size_t i = 0; i < in.size(); ++i)
      ASSERT_EQ(in[i], static_cast<std::int32_t>(((r + p - 1) % p) * 1000 + static_cast<int>(i)));
    EXPECT_EQ(self_in, self_out);
    EXPECT_EQ(c.all_reduce(out.data(), in.data(), 4, DataType::kI32, RedOp::kSum).is_ok(), true);
    EXPECT_EQ(c.group_start().is_ok(), true);
    EXPECT_EQ(c.barrier().message(),
              "barrier: collectives cannot be queued in a group (only send and recv can)");
    EXPECT_TRUE(c.group_end().is_ok());
  });
}

TEST(Communicator, SplitByColorAndKey) {
  auto comms = test::make_comms(4);
  ASSERT_EQ(comms.size(), 4u);
  test::on_all(comms, [](int r, Communicator& c) {
    // Evens and odds, reversed by key; rank 3 joins none.
    const int color = r == 3 ? -1 : r % 2;
    auto sub = c.split(color, -r);
    ASSERT_TRUE(sub.is_ok()) << sub.status().to_string();
    if (r == 3) {
      EXPECT_EQ(*sub, nullptr);
      return;
    }
    auto& s = **sub;
    EXPECT_EQ(s.size(), r % 2 == 0 ? 2 : 1);
    if (r % 2 == 0) {
      EXPECT_EQ(s.rank(), r == 2 ? 0 : 1);
    }
    std::vector<std::int64_t> v{r + 1, 10 * (r + 1)}, out(2);
    const Status st = s.all_reduce(v.data(), out.data(), 2, DataType::kI64, RedOp::kSum);
    ASSERT_TRUE(st.is_ok()) << "rank " << r << ": " << st.to_string();
    if (r % 2 == 0) {
      EXPECT_EQ(out, (std::vector<std::int64_t>{4, 40}));
    } else {
      EXPECT_EQ(out, v);
    }
    // The parent still works beside it.
  });
  test::on_all(comms, [](int, Communicator& c) {
    std::int32_t one = 1, sum = 0;
    ASSERT_TRUE(c.all_reduce(&one, &sum, 1, DataType::kI32, RedOp::kSum).is_ok());
    EXPECT_EQ(sum, 4);
  });
}

TEST(Communicator, AbortFailsLaterOperationsWithTheReason) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int, Communicator& c) {
    c.abort();
    float x = 1, y = 0;
    Status st = c.all_reduce(&x, &y, 1, DataType::kF32, RedOp::kSum);
    EXPECT_EQ(st.code(), ErrorCode::kAborted);
    EXPECT_EQ(st.message(), "allreduce: the communicator was aborted");
    EXPECT_EQ(c.async_error().code(), ErrorCode::kAborted);
  });
}

// abort() from another thread (a watchdog's) while a collective blocks: the collective fails
// with the reason instead of waiting for its deadline.
TEST(Communicator, AbortFromAnotherThreadEndsABlockedCollective) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  std::vector<float> a(1 << 18, 1.0f), b(1 << 18);
  // Rank 1 never joins: rank 0's all-reduce waits for it until the watchdog aborts.
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    comms[0]->abort();
  });
  const auto start = std::chrono::steady_clock::now();
  Status st = comms[0]->all_reduce(a.data(), b.data(), a.size(), DataType::kF32, RedOp::kSum);
  watchdog.join();
  EXPECT_EQ(st.code(), ErrorCode::kAborted) << st.to_string();
  EXPECT_NE(st.message().find("aborted"), std::string::npos) << st.message();
  // Well before the operation's own deadline (R2CCL_TIMEOUT, 30 s).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// Buffers registered with the communicator are used in place by every operation inside them
// (at any offset); overlapping registrations and unknown handles are refused, saying why.
TEST(Communicator, RegisteredBuffersAreUsedInPlace) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int r, Communicator& c) {
    std::vector<float> pool(3 << 18);  // 3 MiB: a send and a receive buffer inside, and room
    auto handle = c.register_buffer(pool.data(), pool.size() * sizeof(float));
    ASSERT_TRUE(handle.is_ok()) << handle.status().to_string();
    auto overlap = c.register_buffer(pool.data() + 100, 4096);
    EXPECT_EQ(overlap.status().message(),
              "register_buffer: the buffer overlaps one that is registered already");
    float* send = pool.data() + 7;
    float* recv = pool.data() + (1 << 18) + 64;  // after the send buffer, not overlapping it
    const std::size_t n = 1 << 18;
    for (std::size_t i = 0; i < n; ++i)
      send[i] = static_cast<float>((i % 1000) + r);
    ASSERT_TRUE(c.all_reduce(send, recv, n, DataType::kF32, RedOp::kSum).is_ok());
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[i], static_cast<float>(2 * (i % 1000) + 1)) << i;
    // Point to point inside it as well.
    ASSERT_TRUE(c.group_start().is_ok());
    (void)c.send(send, n, DataType::kF32, 1 - r);
    (void)c.recv(recv, n, DataType::kF32, 1 - r);
    ASSERT_TRUE(c.group_end().is_ok());
    for (std::size_t i = 0; i < n; i += 997)
      ASSERT_EQ(recv[i], static_cast<float>((i % 1000) + 1 - r)) << i;
    EXPECT_TRUE(c.deregister_buffer(*handle).is_ok());
    EXPECT_EQ(c.deregister_buffer(*handle).message(),
              fmt::format("deregister_buffer: no buffer is registered with handle {}", *handle));
  });
}

TEST(Communicator, DurationsArePublishedPerOperationAndAlgorithm) {
  auto comms = test::make_comms(2);
  ASSERT_EQ(comms.size(), 2u);
  test::on_all(comms, [](int, Communicator& c) {
    std::vector<float> a(1 << 19, 1.0f), b(1 << 19);  // 2 MiB: the ring, also for two ranks
    ASSERT_TRUE(c.all_reduce(a.data(), b.data(), 4, DataType::kF32, RedOp::kSum).is_ok());
    ASSERT_TRUE(c.all_reduce(a.data(), b.data(), a.size(), DataType::kF32, RedOp::kSum).is_ok());
    std::map<std::string, std::uint64_t> seen;
    c.fabric().metrics().for_each([](const auto&) {},
                                  [&](const MetricRegistry::Histogram& h) {
                                    if (h.name != "r2ccl_collective_duration_seconds") return;
                                    seen[h.labels[0].second + "/" + h.labels[1].second] =
                                        h.histogram.count();
                                  });
    EXPECT_EQ(seen, (std::map<std::string, std::uint64_t>{{"allreduce/oneshot", 1},
                                                          {"allreduce/ring", 1}}));
  });
}

}  // namespace
}  // namespace r2ccl::coll

// TwoLevel (coll/two_level.h): collectives over nodes of several ranks, made of a communicator
// inside the node and one across nodes per local index. Here both levels are host communicators
// (ranks as threads over loopback rails), split from one, so that every block's place, every
// root and the scratch between the levels are checked element by element against what NCCL's
// calls of the same names give; DeviceComm runs the same code over NVLink and the staged rails.
#include "r2ccl/coll/two_level.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>

#include "coll_test_util.h"

namespace r2ccl::coll {
namespace {

class HostLevel final : public Level {
 public:
  explicit HostLevel(Communicator& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  Status all_reduce(const void* s, void* r, std::size_t n, DataType t, RedOp op, void*) override {
    return c_.all_reduce(s, r, n, t, op);
  }
  Status all_gather(const void* s, void* r, std::size_t n, DataType t, void*) override {
    return c_.all_gather(s, r, n, t);
  }
  Status reduce_scatter(const void* s, void* r, std::size_t n, DataType t, RedOp op,
                        void*) override {
    return c_.reduce_scatter(s, r, n, t, op);
  }
  Status broadcast(const void* s, void* r, std::size_t n, DataType t, int root, void*) override {
    return c_.broadcast(s, r, n, t, root);
  }
  Status reduce(const void* s, void* r, std::size_t n, DataType t, RedOp op, int root,
                void*) override {
    return c_.reduce(s, r, n, t, op, root);
  }
  Status send(const void* b, std::size_t n, DataType t, int peer, void*) override {
    return c_.send(b, n, t, peer);
  }
  Status recv(void* b, std::size_t n, DataType t, int peer, void*) override {
    return c_.recv(b, n, t, peer);
  }
  Status group_start() override { return c_.group_start(); }
  Status group_end() override { return c_.group_end(); }

 private:
  Communicator& c_;
};

// Host memory, filled with a pattern so that a level that read scratch before writing it shows;
// every acquisition must be released.
class CountingScratch final : public Scratch {
 public:
  Result<void*> acquire(std::size_t bytes, void*) override {
    auto& b = held_.emplace_back(bytes, std::byte{0x5a});
    ++acquired_;
    return static_cast<void*>(b.data());
  }
  Status release(void* p, void*) override {
    for (auto it = held_.begin(); it != held_.end(); ++it)
      if (it->data() == p) {
        held_.erase(it);
        return Status::ok();
      }
    return {ErrorCode::kInvalidArgument, "released twice or never acquired"};
  }
  std::size_t held() const { return held_.size(); }
  int acquired() const { return acquired_; }

 private:
  std::vector<std::vector<std::byte>> held_;
  int acquired_ = 0;
};

// A failed call names what went wrong.
testing::AssertionResult ok(const Status& s) {
  if (s.is_ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << s.to_string();
}
#define ASSERT_OK(call) ASSERT_TRUE(ok(call))

// Element i of rank r's send: whole numbers, so sums in f32 are exact.
float input(int rank, std::size_t i) {
  return static_cast<float>((rank + 1) * 100 + static_cast<int>(i % 89));
}

struct Shape {
  int nodes, per_node;
};

// Runs fn(rank, two-level communicator, scratch) on every rank of nodes x per_node.
void on_two_levels(Shape shape, const std::function<void(int, TwoLevel&, CountingScratch&)>& fn) {
  const int n = shape.nodes * shape.per_node;
  auto comms = test::make_comms(n);
  ASSERT_EQ(comms.size(), static_cast<std::size_t>(n));
  test::on_all(comms, [&](int r, Communicator& c) {
    const int node = r / shape.per_node, local = r % shape.per_node;
    auto inside = c.split(node, local);
    ASSERT_TRUE(inside.is_ok()) << inside.status().to_string();
    auto across = c.split(local, node);
    ASSERT_TRUE(across.is_ok()) << across.status().to_string();
    HostLevel in(**inside), ac(**across);
    CountingScratch scratch;
    TwoLevel two(in, ac, scratch);
    ASSERT_EQ(two.rank(), r);
    ASSERT_EQ(two.nodes(), shape.nodes);
    ASSERT_EQ(two.per_node(), shape.per_node);
    fn(r, two, scratch);
    EXPECT_EQ(scratch.held(), 0u) << "rank " << r << " kept scratch";
    // Every rank is done with both levels before any destroys them: a rank that returns from
    // its part of a collective and closes its communicator while the root still receives is
    // reported to the root as gone.
    EXPECT_TRUE(ok(c.barrier()));
  });
}

void every_collective(Shape shape) {
  const int n = shape.nodes * shape.per_node;
  const auto un = static_cast<std::size_t>(n);
  auto sum = [n](std::size_t i) {
    float s = 0;
    for (int q = 0; q < n; ++q)
      s += input(q, i);
    return s;
  };
  on_two_levels(shape, [&](int r, TwoLevel& two, CountingScratch& scratch) {
    const auto ur = static_cast<std::size_t>(r);
    for (const std::size_t count : {std::size_t{1}, std::size_t{6}, std::size_t{1000}}) {
      SCOPED_TRACE("count " + std::to_string(count) + ", rank " + std::to_string(r));
      std::vector<float> send(count * un), recv(count * un);
      for (std::size_t i = 0; i < send.size(); ++i)
        send[i] = input(r, i);
      const std::size_t whole = count * static_cast<std::size_t>(shape.per_node);
      ASSERT_OK(
          two.all_reduce(send.data(), recv.data(), whole, DataType::kF32, RedOp::kSum, nullptr));
      for (std::size_t i = 0; i < whole; ++i)
        ASSERT_EQ(recv[i], sum(i)) << "all-reduce, element " << i;
      // All-gather, apart and in place.
      for (const bool in_place : {false, true}) {
        std::fill(recv.begin(), recv.end(), -1.0f);
        const float* from = send.data();
        if (in_place) {
          std::copy_n(send.begin(), count, recv.begin() + static_cast<long>(ur * count));
          from = recv.data() + ur * count;
        }
        ASSERT_OK(two.all_gather(from, recv.data(), count, DataType::kF32, nullptr));
        for (std::size_t q = 0; q < un; ++q)
          for (std::size_t i = 0; i < count; ++i)
            ASSERT_EQ(recv[q * count + i], input(static_cast<int>(q), i))
                << "all-gather" << (in_place ? " in place" : "") << ", block " << q << ", " << i;
      }
      // Reduce-scatter, apart and in place.
      for (const bool in_place : {false, true}) {
        std::vector<float> work = send;
        float* to = in_place ? work.data() + ur * count : recv.data();
        ASSERT_OK(two.reduce_scatter(work.data(), to, count, DataType::kF32, RedOp::kSum, nullptr));
        for (std::size_t i = 0; i < count; ++i)
          ASSERT_EQ(to[i], sum(ur * count + i))
              << "reduce-scatter" << (in_place ? " in place" : "") << ", element " << i;
      }
      // From and to every root; in place on the root for reduce.
      for (int root = 0; root < n; ++root) {
        std::fill(recv.begin(), recv.end(), -1.0f);
        ASSERT_OK(two.broadcast(send.data(), recv.data(), count, DataType::kF32, root, nullptr));
        for (std::size_t i = 0; i < count; ++i)
          ASSERT_EQ(recv[i], input(root, i)) << "broadcast from " << root << ", element " << i;
        std::vector<float> work = send;
        std::fill(recv.begin(), recv.end(), -1.0f);
        float* to = (root == r && root % 2 == 1) ? work.data() : recv.data();
        ASSERT_OK(two.reduce(work.data(), to, count, DataType::kF32, RedOp::kMax, root, nullptr));
        if (r == root) {
          for (std::size_t i = 0; i < count; ++i)
            ASSERT_EQ(to[i], input(n - 1, i)) << "reduce (max) to " << root << ", element " << i;
        } else {
          EXPECT_EQ(recv[0], -1.0f) << "reduce wrote off the root";
          EXPECT_EQ(work, send) << "reduce changed a send buffer off the root";
        }
      }
    }
    EXPECT_GT(scratch.acquired(), 0);
  });
}

TEST(TwoLevel, TwoNodesOfTwoGiveWhatOneFlatCommunicatorGives) {
  every_collective({2, 2});
}

TEST(TwoLevel, ThreeNodesOfTwoGiveWhatOneFlatCommunicatorGives) {
  every_collective({3, 2});
}

TEST(TwoLevel, TwoNodesOfThreeGiveWhatOneFlatCommunicatorGives) {
  every_collective({2, 3});
}

TEST(TwoLevel, BadCallsAreRefusedByName) {
  on_two_levels({2, 2}, [](int, TwoLevel& two, CountingScratch&) {
    std::vector<float> a(8), b(8);
    const Status root = two.broadcast(a.data(), b.data(), 8, DataType::kF32, 4, nullptr);
    EXPECT_EQ(root.message(), "two-level broadcast: root 4 is not a rank (0..3)");
    const Status red = two.reduce(a.data(), b.data(), 8, DataType::kF32, RedOp::kSum, -1, nullptr);
    EXPECT_EQ(red.message(), "two-level reduce: root -1 is not a rank (0..3)");
    const Status odd = two.all_reduce(a.data(), b.data(), 7, DataType::kF32, RedOp::kSum, nullptr);
    EXPECT_EQ(odd.message(), "two-level all-reduce: 7 elements do not split into 2 parts");
  });
}

TEST(TwoLevel, OnlyRanksNumberedNodeByNodeAreBlocked) {
  EXPECT_TRUE(TwoLevel::blocked({0, 0, 1, 1}, {0, 1, 0, 1}, 2));
  EXPECT_FALSE(TwoLevel::blocked({0, 1, 0, 1}, {0, 0, 1, 1}, 2));  // round robin
  EXPECT_FALSE(TwoLevel::blocked({0, 0, 1}, {0, 1, 0}, 0));        // nodes of different sizes
  EXPECT_FALSE(TwoLevel::blocked({0, 0}, {0}, 2));
}

}  // namespace
}  // namespace r2ccl::coll

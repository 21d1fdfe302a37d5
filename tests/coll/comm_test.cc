// coll::Comm, the one communicator of host and device memory: on host buffers (no stream) every
// call runs on the host communicator, as the C ABI's do; a stream with host buffers, a collective
// inside a group, and a group ended without a start are refused by name. Three ranks as threads
// over loopback rails. (Its GPU side runs in the GPU tests and through the C ABI.)
#include "r2ccl/coll/comm.h"

#include <gtest/gtest.h>

#include <thread>

#include "coll_test_util.h"
#include "r2ccl/coll/verify.h"

namespace r2ccl::coll {
namespace {

constexpr int kRanks = 3;
constexpr std::size_t kCount = 1000;

std::vector<std::unique_ptr<Comm>> make(int n) {
  std::vector<std::unique_ptr<Comm>> out;
  for (auto& c : test::make_comms(n))
    out.push_back(std::make_unique<Comm>(std::move(c)));
  return out;
}

void on_all(std::vector<std::unique_ptr<Comm>>& comms, const std::function<void(int, Comm&)>& fn) {
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] { fn(static_cast<int>(r), *comms[r]); });
  for (auto& t : threads)
    t.join();
}

float input(int rank, std::size_t i) {
  return static_cast<float>(rank * 1000 + static_cast<int>(i % 997));
}

TEST(Comm, HostBuffersRunOnTheHostCommunicator) {
  auto comms = make(kRanks);
  ASSERT_EQ(comms.size(), static_cast<std::size_t>(kRanks));
  on_all(comms, [](int r, Comm& c) {
    std::vector<float> send(kCount * kRanks), recv(kCount * kRanks);
    for (std::size_t i = 0; i < send.size(); ++i)
      send[i] = input(r, i);
    auto sum = [](std::size_t i) {
      float s = 0;
      for (int q = 0; q < kRanks; ++q)
        s += input(q, i);
      return s;
    };
    ASSERT_TRUE(c.all_reduce(send.data(), recv.data(), kCount, DataType::kF32, RedOp::kSum));
    for (std::size_t i = 0; i < kCount; ++i)
      ASSERT_EQ(recv[i], sum(i)) << "all-reduce, element " << i;
    ASSERT_TRUE(c.all_gather(send.data(), recv.data(), kCount, DataType::kF32));
    for (int q = 0; q < kRanks; ++q)
      for (std::size_t i = 0; i < kCount; ++i)
        ASSERT_EQ(recv[static_cast<std::size_t>(q) * kCount + i], input(q, i)) << "all-gather";
    ASSERT_TRUE(c.reduce_scatter(send.data(), recv.data(), kCount, DataType::kF32, RedOp::kSum));
    for (std::size_t i = 0; i < kCount; ++i)
      ASSERT_EQ(recv[i], sum(static_cast<std::size_t>(r) * kCount + i)) << "reduce-scatter";
    ASSERT_TRUE(c.broadcast(send.data(), recv.data(), kCount, DataType::kF32, 1));
    for (std::size_t i = 0; i < kCount; ++i)
      ASSERT_EQ(recv[i], input(1, i)) << "broadcast";
    ASSERT_TRUE(c.reduce(send.data(), recv.data(), kCount, DataType::kF32, RedOp::kSum, 2));
    if (r == 2) {
      for (std::size_t i = 0; i < kCount; ++i)
        ASSERT_EQ(recv[i], sum(i)) << "reduce";
    }
    // A ring in one group: to the next rank, from the previous one.
    std::vector<float> got(kCount);
    ASSERT_TRUE(c.group_start());
    ASSERT_TRUE(c.send(send.data(), kCount, DataType::kF32, (r + 1) % kRanks));
    ASSERT_TRUE(c.recv(got.data(), kCount, DataType::kF32, (r + kRanks - 1) % kRanks));
    ASSERT_TRUE(c.group_end());
    for (std::size_t i = 0; i < kCount; ++i)
      ASSERT_EQ(got[i], input((r + kRanks - 1) % kRanks, i)) << "send/recv";
    ASSERT_TRUE(c.barrier());
    EXPECT_TRUE(c.error());
  });
}

TEST(Comm, MisuseIsRefusedByName) {
  auto comms = make(2);
  on_all(comms, [](int, Comm& c) {
    std::vector<float> a(16), b(16);
    int stream_stand_in = 0;  // any non-null stream: host buffers take none
    const Status with_stream =
        c.all_reduce(a.data(), b.data(), a.size(), DataType::kF32, RedOp::kSum, &stream_stand_in);
    EXPECT_NE(with_stream.message().find("all-reduce: "), std::string::npos)
        << with_stream.message();
    EXPECT_NE(with_stream.message().find("stream must be NULL"), std::string::npos)
        << with_stream.message();
    ASSERT_TRUE(c.group_start());
    EXPECT_EQ(c.all_gather(a.data(), b.data(), 8, DataType::kF32).message(),
              "all-gather: a group holds sends and receives only");
    ASSERT_TRUE(c.group_end());
    EXPECT_EQ(c.group_end().message(), "group_end without group_start");
    EXPECT_TRUE(c.barrier());
  });
}

}  // namespace
}  // namespace r2ccl::coll

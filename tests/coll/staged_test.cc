// The staged path (device memory across nodes) with the host stand-in for the device: ranks as
// threads over loopback rails, each with a HostStream as its stream. Every result is checked
// element by element against the reduction of every rank's input.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "coll_test_util.h"
#include "r2ccl/coll/host_staging.h"
#include "r2ccl/coll/staged.h"
#include "r2ccl/coll/verify.h"

namespace r2ccl::coll {
namespace {

using test::make_comms;
using test::on_all;

struct Rank {
  std::unique_ptr<StagedComm> staged;
  std::unique_ptr<HostStream> stream;
};

// Small chunks and a window of 2, so that every call of a few thousand elements runs in many
// chunks through a reused window.
std::vector<Rank> make_staged(std::vector<std::unique_ptr<Communicator>>& comms,
                              StagedComm::Options options = {4096, 2}) {
  std::vector<Rank> ranks(comms.size());
  auto device = std::make_shared<HostStagingDevice>();
  on_all(comms, [&](int r, Communicator& c) {
    auto made = StagedComm::create(c, device, options);
    ASSERT_TRUE(made) << made.status().to_string();
    ranks[static_cast<std::size_t>(r)].staged = std::move(*made);
    ranks[static_cast<std::size_t>(r)].stream = std::make_unique<HostStream>();
  });
  return ranks;
}

void close_all(std::vector<std::unique_ptr<Communicator>>& comms, std::vector<Rank>& ranks) {
  on_all(comms, [&](int r, Communicator&) {
    auto& me = ranks[static_cast<std::size_t>(r)];
    me.stream->synchronize();
    EXPECT_TRUE(me.staged->close()) << me.staged->error().to_string();
  });
}

double value(int rank, std::size_t i, std::uint64_t round, RedOp op, DataType t) {
  std::byte tmp[8];
  set_element(tmp, 0, t, test_value(rank, i, round, op));
  return get_element(tmp, 0, t);
}

// Runs `op` on every rank with fresh inputs and checks every element of every rank's output.
void check_op(std::vector<std::unique_ptr<Communicator>>& comms, std::vector<Rank>& ranks,
              CollOp op, DataType t, RedOp red, std::size_t count, std::uint64_t round) {
  const int p = static_cast<int>(comms.size());
  const auto pz = static_cast<std::size_t>(p);
  const std::size_t e = type_size(t);
  const int root = 1 % p;
  on_all(comms, [&](int me, Communicator&) {
    auto& rk = ranks[static_cast<std::size_t>(me)];
    const std::size_t send_n = op == CollOp::kReduceScatter ? count * pz : count;
    const std::size_t recv_n = op == CollOp::kAllGather ? count * pz : count;
    std::vector<std::byte> send(send_n * e), recv(recv_n * e, std::byte{0xEE});
    for (std::size_t i = 0; i < send_n; ++i)
      set_element(send.data(), i, t, test_value(me, i, round, red));
    void* s = rk.stream.get();
    Status st = Status::ok();
    switch (op) {
      case CollOp::kAllReduce:
        st = rk.staged->all_reduce(send.data(), recv.data(), count, t, red, s);
        break;
      case CollOp::kAllGather:
        st = rk.staged->all_gather(send.data(), recv.data(), count, t, s);
        break;
      case CollOp::kReduceScatter:
        st = rk.staged->reduce_scatter(send.data(), recv.data(), count, t, red, s);
        break;
      case CollOp::kBroadcast:
        st = rk.staged->broadcast(send.data(), recv.data(), count, t, root, s);
        break;
      case CollOp::kReduce:
        st = rk.staged->reduce(send.data(), recv.data(), count, t, red, root, s);
        break;
      case CollOp::kBarrier:
        break;
    }
    ASSERT_TRUE(st) << st.to_string();
    rk.stream->synchronize();
    ASSERT_TRUE(rk.staged->error()) << rk.staged->error().to_string();
    if (op == CollOp::kReduce && me != root) {
      for (auto b : recv)
        ASSERT_EQ(b, std::byte{0xEE}) << "reduce wrote a non-root's receive buffer";
      return;
    }
    std::vector<double> in(pz);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < recv_n; ++i) {
      const std::byte* got = recv.data() + i * e;
      if (op == CollOp::kAllGather || op == CollOp::kBroadcast) {
        const int src = op == CollOp::kBroadcast ? root : static_cast<int>(i / count);
        wrong += get_element(got, 0, t) !=
                 value(src, op == CollOp::kBroadcast ? i : i % count, round, red, t);
        continue;
      }
      const std::size_t at =
          op == CollOp::kReduceScatter ? static_cast<std::size_t>(me) * count + i : i;
      for (int q = 0; q < p; ++q)
        in[static_cast<std::size_t>(q)] = value(q, at, round, red, t);
      wrong += !matches_reduction(got, in, t, red);
    }
    EXPECT_EQ(wrong, 0u) << "rank " << me << ": " << wrong << " of " << recv_n << " elements wrong";
  });
}

TEST(Staged, EveryOperationAndTypeInManyChunks) {
  auto comms = make_comms(3);
  auto ranks = make_staged(comms);
  std::uint64_t round = 0;
  for (CollOp op : {CollOp::kAllReduce, CollOp::kAllGather, CollOp::kReduceScatter,
                    CollOp::kBroadcast, CollOp::kReduce})
    for (DataType t : {DataType::kF32, DataType::kBF16, DataType::kF16, DataType::kI32})
      for (std::size_t count : {std::size_t{1}, std::size_t{777}, std::size_t{5000}})
        check_op(comms, ranks, op, t, op == CollOp::kAllReduce ? RedOp::kSum : RedOp::kMax, count,
                 ++round);
  close_all(comms, ranks);
}

TEST(Staged, ACallOfMoreChunksThanTheWordsTakesSeveralDoorbells) {
  auto comms = make_comms(2);
  auto ranks = make_staged(comms);
  // 4096-byte chunks: 4097 chunks, past the 4096 words of one doorbell.
  check_op(comms, ranks, CollOp::kAllReduce, DataType::kF32, RedOp::kSum, 4096 * 1024 + 5, 1);
  close_all(comms, ranks);
}

TEST(Staged, AGraphReplaysWithFreshInputsAndItsCallsGoWithIt) {
  auto comms = make_comms(2);
  auto ranks = make_staged(comms);
  const std::size_t n = 3000;
  on_all(comms, [&](int me, Communicator&) {
    auto& rk = ranks[static_cast<std::size_t>(me)];
    std::vector<float> send(n), recv(n);
    rk.stream->begin_capture();
    ASSERT_TRUE(rk.staged->all_reduce(send.data(), recv.data(), n, DataType::kF32, RedOp::kSum,
                                      rk.stream.get()));
    ASSERT_TRUE(
        rk.staged->all_gather(send.data(), recv.data(), n / 2, DataType::kF32, rk.stream.get()));
    auto graph = rk.stream->end_capture();
    ASSERT_GT(graph->size(), 0u);
    EXPECT_EQ(rk.staged->calls_run(), 0u) << "capturing ran a call";
    for (int replay = 0; replay < 25; ++replay) {
      for (std::size_t i = 0; i < n; ++i)
        send[i] = static_cast<float>(replay * 1000 + me * 7 + static_cast<int>(i % 100));
      rk.stream->launch(*graph);
      rk.stream->synchronize();
      ASSERT_TRUE(rk.staged->error()) << rk.staged->error().to_string();
      // The all-gather ran last: its first half is rank 0's first n/2, the second rank 1's.
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t j = i % (n / 2);
        const int src = static_cast<int>(i / (n / 2));
        const float want = static_cast<float>(replay * 1000 + src * 7 + static_cast<int>(j % 100));
        ASSERT_EQ(recv[i], want) << "replay " << replay << " element " << i;
      }
    }
    EXPECT_EQ(rk.staged->calls_run(), 50u);
    graph.reset();  // its calls' descriptions go; an eager call still runs
  });
  check_op(comms, ranks, CollOp::kAllReduce, DataType::kF32, RedOp::kSum, 10, 99);
  close_all(comms, ranks);
}

TEST(Staged, SendAndReceiveInGroupsAcrossPieces) {
  auto comms = make_comms(3);
  auto ranks = make_staged(comms);
  on_all(comms, [&](int me, Communicator&) {
    auto& rk = ranks[static_cast<std::size_t>(me)];
    const int to = (me + 1) % 3, from = (me + 2) % 3;
    // A ring exchange of different sizes per rank, then a message to one neighbour only.
    const std::size_t out_n = 3000 + static_cast<std::size_t>(me) * 1111;
    const std::size_t in_n = 3000 + static_cast<std::size_t>(from) * 1111;
    std::vector<std::int32_t> out(out_n), in(in_n, -7);
    for (std::size_t i = 0; i < out_n; ++i)
      out[i] = static_cast<std::int32_t>(me * 100000 + static_cast<int>(i));
    ASSERT_TRUE(rk.staged->group_start());
    ASSERT_TRUE(rk.staged->recv(in.data(), in_n, DataType::kI32, from, rk.stream.get()));
    ASSERT_TRUE(rk.staged->send(out.data(), out_n, DataType::kI32, to, rk.stream.get()));
    ASSERT_TRUE(rk.staged->group_end());
    rk.stream->synchronize();
    ASSERT_TRUE(rk.staged->error()) << rk.staged->error().to_string();
    for (std::size_t i = 0; i < in_n; ++i)
      ASSERT_EQ(in[i], from * 100000 + static_cast<int>(i)) << "element " << i;
    std::vector<std::int32_t> alone(5000, me);
    if (me == 0) {
      ASSERT_TRUE(rk.staged->send(alone.data(), 5000, DataType::kI32, 2, rk.stream.get()));
    }
    if (me == 2) {
      ASSERT_TRUE(rk.staged->recv(alone.data(), 5000, DataType::kI32, 0, rk.stream.get()));
    }
    rk.stream->synchronize();
    if (me == 2) {
      for (auto v : alone)
        ASSERT_EQ(v, 0);
    }
  });
  close_all(comms, ranks);
}

TEST(Staged, BadArgumentsAreRefusedByName) {
  auto comms = make_comms(2);
  auto ranks = make_staged(comms);
  auto& rk = ranks[0];
  std::vector<float> buf(64);
  void* s = rk.stream.get();
  Status st = rk.staged->send(buf.data(), 64, DataType::kF32, 0, s);
  EXPECT_NE(st.message().find("peer 0 is not another rank"), std::string::npos) << st.to_string();
  st = rk.staged->broadcast(buf.data(), buf.data(), 64, DataType::kF32, 5, s);
  EXPECT_NE(st.message().find("root 5 is not a rank"), std::string::npos) << st.to_string();
  st = rk.staged->all_reduce(nullptr, buf.data(), 64, DataType::kF32, RedOp::kSum, s);
  EXPECT_NE(st.message().find("send buffer is null"), std::string::npos) << st.to_string();
  ASSERT_TRUE(rk.staged->group_start());
  for (int i = 0; i < 9; ++i)
    ASSERT_TRUE(rk.staged->send(buf.data(), 64, DataType::kF32, 1, s));
  st = rk.staged->group_end();
  EXPECT_NE(st.message().find("9 sends and 0 receives in one group"), std::string::npos)
      << st.to_string();
  EXPECT_TRUE(rk.staged->error()) << "a refused call failed the communicator";
  close_all(comms, ranks);
}

TEST(Staged, DifferentChunkOptionsOnTwoRanksAreRefused) {
  auto comms = make_comms(2);
  auto device = std::make_shared<HostStagingDevice>();
  on_all(comms, [&](int r, Communicator& c) {
    StagedComm::Options o{r == 0 ? std::size_t{8192} : std::size_t{4096}, 2};
    auto made = StagedComm::create(c, device, o);
    ASSERT_FALSE(made);
    EXPECT_NE(made.status().message().find("other chunk options"), std::string::npos)
        << made.status().to_string();
  });
}

TEST(Staged, AnAbortReleasesTheStreamWithAllOnesNotAStaleResult) {
  auto comms = make_comms(2);
  auto ranks = make_staged(comms);
  // A first call leaves a right result in the staging slots.
  check_op(comms, ranks, CollOp::kAllReduce, DataType::kF32, RedOp::kSum, 500, 1);
  auto& rk = ranks[0];
  std::vector<float> send(500, 1.0f), recv(500, 0.0f);
  // Rank 1 never makes this call: rank 0's thread waits for it in the host all-reduce.
  ASSERT_TRUE(rk.staged->all_reduce(send.data(), recv.data(), 500, DataType::kF32, RedOp::kSum,
                                    rk.stream.get()));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  rk.staged->abort("the test gave up on rank 1");
  const auto t0 = std::chrono::steady_clock::now();
  rk.stream->synchronize();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  for (float v : recv)
    ASSERT_TRUE(std::isnan(v)) << "a failed call left " << v << " in its output";
  const Status e = rk.staged->error();
  EXPECT_EQ(e.code(), ErrorCode::kAborted);
  EXPECT_NE(e.message().find("the test gave up on rank 1"), std::string::npos) << e.to_string();
  const Status later = rk.staged->all_reduce(send.data(), recv.data(), 500, DataType::kF32,
                                             RedOp::kSum, rk.stream.get());
  EXPECT_NE(later.message().find("the test gave up on rank 1"), std::string::npos)
      << later.to_string();
  ranks[1].stream->synchronize();
}

}  // namespace
}  // namespace r2ccl::coll

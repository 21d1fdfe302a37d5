// Every collective x type x reduction x algorithm x 2-8 ranks x sizes (0, 1, odd, fewer elements
// than ranks, non-multiples of the chunk size), in place and out of place, against a reference
// each rank computes itself. Integers must be bit-exact; floats are fed small integers (whose
// sums and products are exact in every float type) so they must be exact too, except avg, which
// must be within rounding of the reference and bit-identical on every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include "coll_test_util.h"
#include "r2ccl/coll/reduce.h"
#include "r2ccl/coll/verify.h"

namespace r2ccl::coll {
namespace {

struct Case {
  CollOp op;
  DataType type;
  RedOp redop;
  Algo algo;
  std::size_t count;
  bool in_place;
  int root;
  std::string name() const {
    return fmt::format("{} {} {} algo={} count={} {} root={}", coll_op_name(op), type_name(type),
                       redop_name(redop), algo_name(algo), count,
                       in_place ? "in-place" : "out-of-place", root);
  }
};

bool reduces(CollOp op) {
  return op == CollOp::kAllReduce || op == CollOp::kReduceScatter || op == CollOp::kReduce;
}

std::vector<Case> all_cases(int p) {
  std::vector<Case> out;
  const std::size_t sizes[] = {0, 1, 7, static_cast<std::size_t>(p - 1), 1000, 40001};
  int k = 0;
  for (CollOp op : {CollOp::kAllReduce, CollOp::kReduceScatter, CollOp::kReduce, CollOp::kAllGather,
                    CollOp::kBroadcast}) {
    std::vector<Algo> algos{Algo::kRing, Algo::kOneShot};
    if (op == CollOp::kAllReduce) algos.push_back(Algo::kTwoShot);
    for (DataType t : kAllTypes) {
      for (RedOp r : kAllRedOps) {
        if (!reduces(op) && r != RedOp::kSum) continue;
        if (r == RedOp::kAvg && !is_float(t)) continue;
        for (Algo a : algos)
          for (std::size_t n : sizes) {
            // The largest size once per (op, type, reduction), with the ring.
            if (n == 40001 && a != Algo::kRing) continue;
            ++k;
            out.push_back({op, t, r, a, n, k % 2 == 0, k % p});
          }
      }
    }
  }
  return out;
}

double input_value(int r, std::size_t i, RedOp op) {
  return test_value(r, i, 0, op);
}

constexpr std::size_t kGuard = 64;  // bytes past every output that must stay untouched

// Runs one case on one rank and checks its output; returns a digest of the output for the
// cross-rank comparison.
std::uint64_t run_case(Communicator& c, const Case& k, std::vector<std::string>& errors) {
  const int p = c.size(), r = c.rank();
  const std::size_t e = type_size(k.type), n = k.count;
  auto input = [&](int rank, std::vector<std::byte>& buf, std::size_t elems, std::size_t first) {
    for (std::size_t i = 0; i < elems; ++i)
      set_element(buf.data(), i, k.type, input_value(rank, first + i, k.redop));
  };
  // Element counts of the send and receive sides.
  const std::size_t send_elems =
      k.op == CollOp::kReduceScatter ? n * static_cast<std::size_t>(p) : n;
  const std::size_t recv_elems = k.op == CollOp::kAllGather ? n * static_cast<std::size_t>(p) : n;
  std::vector<std::byte> mine(send_elems * e);
  input(r, mine, send_elems, 0);
  std::vector<std::byte> big(std::max(send_elems, recv_elems) * e + kGuard, std::byte{0xEE});
  std::vector<std::byte> sendbuf;
  const void* send = nullptr;
  std::byte* recv = big.data();
  Status st;
  if (k.in_place) {
    switch (k.op) {
      case CollOp::kAllGather:
        std::copy(mine.begin(), mine.end(), big.begin() + static_cast<std::ptrdiff_t>(r * n * e));
        send = big.data() + static_cast<std::size_t>(r) * n * e;
        break;
      case CollOp::kReduceScatter:
        std::copy(mine.begin(), mine.end(), big.begin());
        send = big.data();
        recv = big.data() + static_cast<std::size_t>(r) * n * e;
        break;
      default:
        std::copy(mine.begin(), mine.end(), big.begin());
        send = big.data();
        break;
    }
  } else {
    sendbuf = mine;
    sendbuf.resize(mine.size() + kGuard, std::byte{0xEE});
    send = sendbuf.data();
  }
  switch (k.op) {
    case CollOp::kAllReduce:
      st = c.all_reduce(send, recv, n, k.type, k.redop);
      break;
    case CollOp::kAllGather:
      st = c.all_gather(send, recv, n, k.type);
      break;
    case CollOp::kReduceScatter:
      st = c.reduce_scatter(send, recv, n, k.type, k.redop);
      break;
    case CollOp::kBroadcast:
      st = c.broadcast(send, recv, n, k.type, k.root);
      break;
    case CollOp::kReduce:
      st = c.reduce(send, recv, n, k.type, k.redop, k.root);
      break;
    case CollOp::kBarrier:
      break;
  }
  auto fail = [&](const std::string& why) {
    if (errors.size() < 20) errors.push_back(fmt::format("rank {}: {}: {}", r, k.name(), why));
  };
  if (!st) {
    fail(st.to_string());
    return 0;
  }
  if (!k.in_place)
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (sendbuf[i] != mine[i])
        return fail(fmt::format("the send buffer changed at byte {}", i)), 0;
  if (k.op == CollOp::kReduce && r != k.root) return 1;  // nothing to check on this rank
  std::uint64_t digest = 1469598103934665603ull;
  std::vector<std::byte> want(e);
  std::vector<double> in(static_cast<std::size_t>(p));
  std::vector<std::byte> tmp(e);
  for (std::size_t i = 0; i < recv_elems; ++i) {
    switch (k.op) {
      case CollOp::kAllGather: {
        set_element(want.data(), 0, k.type,
                    input_value(static_cast<int>(i / std::max<std::size_t>(n, 1)),
                                i % std::max<std::size_t>(n, 1), k.redop));
        break;
      }
      case CollOp::kBroadcast:
        set_element(want.data(), 0, k.type, input_value(k.root, i, k.redop));
        break;
      default: {
        const std::size_t first =
            k.op == CollOp::kReduceScatter ? static_cast<std::size_t>(r) * n : 0;
        for (int q = 0; q < p; ++q) {
          set_element(tmp.data(), 0, k.type, input_value(q, first + i, k.redop));
          in[static_cast<std::size_t>(q)] = get_element(tmp.data(), 0, k.type);
        }
      }
    }
    const std::byte* got = recv + i * e;
    if (reduces(k.op) ? !matches_reduction(got, in, k.type, k.redop)
                      : std::memcmp(got, want.data(), e) != 0) {
      std::string expected = reduces(k.op) ? "the reduction of"
                                           : fmt::format("{}", get_element(want.data(), 0, k.type));
      if (reduces(k.op))
        for (double x : in)
          expected += fmt::format(" {}", x);
      return fail(fmt::format("element {}: {} where {} was expected", i,
                              get_element(got, 0, k.type), expected)),
             0;
    }
    for (std::size_t b = 0; b < e; ++b)
      digest = (digest ^ static_cast<std::uint8_t>(got[b])) * 1099511628211ull;
  }
  // Past the output: in place, the bytes after it may be other ranks' input; the guard after
  // the whole buffer must stay untouched either way.
  const std::byte* end =
      k.in_place ? big.data() + std::max(send_elems, recv_elems) * e : recv + recv_elems * e;
  for (std::size_t g = 0; g < kGuard && end + g < big.data() + big.size(); ++g)
    if (end[g] != std::byte{0xEE})
      return fail(fmt::format("wrote {} bytes past the output", g + 1)), 0;
  // Reduce-scatter's outputs differ by rank: only the others are compared across ranks.
  return k.op == CollOp::kReduceScatter ? 1 : digest;
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, EveryOpTypeReductionAlgorithmAndSizeMatchesTheReference) {
  const int p = GetParam();
  const auto cases = all_cases(p);
  std::vector<std::vector<std::uint64_t>> digests(static_cast<std::size_t>(p));
  std::mutex m;
  std::vector<std::string> errors;
  for (Algo a : {Algo::kRing, Algo::kOneShot, Algo::kTwoShot}) {
    auto comms = test::make_comms(p, {{"R2CCL_ALGO", std::string(algo_name(a))}});
    ASSERT_EQ(comms.size(), static_cast<std::size_t>(p));
    test::on_all(comms, [&](int r, Communicator& c) {
      std::vector<std::string> mine;
      for (const auto& k : cases) {
        if (k.algo != a) continue;
        digests[static_cast<std::size_t>(r)].push_back(run_case(c, k, mine));
        EXPECT_EQ(c.last_algo(),
                  k.count == 0
                      ? c.last_algo()
                      : choose_algo({k.op, k.count, k.type, k.redop, k.root, k.in_place}, p, a));
      }
      std::lock_guard<std::mutex> lock(m);
      errors.insert(errors.end(), mine.begin(), mine.end());
    });
  }
  for (const auto& e : errors)
    ADD_FAILURE() << e;
  // Every rank that has the result holds the same bits (floats included).
  for (int r = 1; r < p; ++r) {
    ASSERT_EQ(digests[static_cast<std::size_t>(r)].size(), digests[0].size());
    for (std::size_t i = 0; i < digests[0].size(); ++i) {
      const auto a = digests[0][i], b = digests[static_cast<std::size_t>(r)][i];
      if (a > 1 && b > 1) {
        EXPECT_EQ(a, b) << "rank " << r << " differs from rank 0 in case " << i;
      }
    }
  }
}

// The degraded-mode all-reduce plans (lanes, rail masks, weighted shards) on a table where some
// ranks are slower: rank p/2 kept one rail of two at half the bandwidth, and, for the weighted
// plan, rank 0 at three quarters on both rails too. Every case of every type and reduction.
TEST_P(Collectives, DegradedPlansMatchTheReference) {
  const int p = GetParam();
  std::vector<Case> cases;
  for (const auto& k : all_cases(p))
    if (k.op == CollOp::kAllReduce && k.algo == Algo::kRing) cases.push_back(k);
  for (Algo a : {Algo::kR2cc, Algo::kWeighted}) {
    auto comms = test::make_comms(
        p, {{"R2CCL_ALGO", std::string(algo_name(a))}, {"R2CCL_DEGRADED_MIN_BYTES", "0"}});
    ASSERT_EQ(comms.size(), static_cast<std::size_t>(p));
    std::vector<std::vector<std::uint64_t>> digests(static_cast<std::size_t>(p));
    std::mutex m;
    std::vector<std::string> errors;
    test::on_all(comms, [&](int r, Communicator& c) {
      c.set_link_source([r, p, a] {
        if (r == p / 2) return Communicator::LinkEstimate{0.5e9, 0b01};
        if (r == 0 && a == Algo::kWeighted && p > 2)
          return Communicator::LinkEstimate{0.75e9, 0b11};
        return Communicator::LinkEstimate{1e9, 0b11};
      });
      std::vector<std::string> mine;
      for (auto k : cases) {
        k.algo = a;
        digests[static_cast<std::size_t>(r)].push_back(run_case(c, k, mine));
        if (k.count > 0) {
          EXPECT_EQ(c.last_algo(), a) << k.name();
        }
      }
      if (r == 0 && p > 1) {
        const auto& net = c.agreed_network();
        EXPECT_EQ(net.bandwidth.size(), static_cast<std::size_t>(p));
        EXPECT_EQ(net.rails_up[static_cast<std::size_t>(p / 2)], 0b01u);
      }
      std::lock_guard<std::mutex> lock(m);
      errors.insert(errors.end(), mine.begin(), mine.end());
    });
    for (const auto& e : errors)
      ADD_FAILURE() << algo_name(a) << ": " << e;
    for (int r = 1; r < p; ++r)
      for (std::size_t i = 0; i < digests[0].size(); ++i)
        EXPECT_EQ(digests[0][i], digests[static_cast<std::size_t>(r)][i])
            << algo_name(a) << ": rank " << r << " differs from rank 0 in " << cases[i].name();
  }
}

// Degraded mode agrees on the first large all-reduce and then only after some rank's links
// changed: the call that carries the change runs on the old table, the next one agrees, and every
// rank agrees at the same call. Every result is checked.
TEST(Agreement, OnlyWhenSomeRanksLinksChanged) {
  constexpr int p = 4;
  auto comms = test::make_comms(p, {{"R2CCL_DEGRADED_MIN_BYTES", "4K"}});
  ASSERT_EQ(comms.size(), static_cast<std::size_t>(p));
  constexpr int kCalls = 9, kChangeAt = 4;  // rank 2 loses a rail before its 5th call
  std::vector<std::vector<std::uint64_t>> agreements(p);
  std::vector<std::vector<std::uint64_t>> rails_of_2(p);
  std::mutex m;
  std::vector<std::string> errors;
  test::on_all(comms, [&](int r, Communicator& c) {
    int calls = 0;
    c.set_link_source([r, &calls] {
      if (r == 2 && calls >= kChangeAt) return Communicator::LinkEstimate{0.5e9, 0b01};
      return Communicator::LinkEstimate{1e9, 0b11};
    });
    std::vector<std::int32_t> in(4096), out(4096);
    for (; calls < kCalls; ++calls) {
      for (std::size_t i = 0; i < in.size(); ++i)
        in[i] = static_cast<std::int32_t>(i) * (r + 1) + calls;
      Status st = c.all_reduce(in.data(), out.data(), in.size(), DataType::kI32, RedOp::kSum);
      std::lock_guard<std::mutex> lock(m);
      if (!st) {
        errors.push_back(fmt::format("rank {} call {}: {}", r, calls, st.message()));
        return;
      }
      for (std::size_t i = 0; i < out.size(); ++i) {
        const auto want = static_cast<std::int32_t>(i) * (p * (p + 1) / 2) + p * calls;
        if (out[i] != want) {
          errors.push_back(
              fmt::format("rank {} call {}: element {} is {}, not {}", r, calls, i, out[i], want));
          break;
        }
      }
      agreements[static_cast<std::size_t>(r)].push_back(c.agreements());
      rails_of_2[static_cast<std::size_t>(r)].push_back(c.agreed_network().rails_up.at(2));
    }
  });
  for (const auto& e : errors)
    ADD_FAILURE() << e;
  ASSERT_TRUE(errors.empty());
  for (int r = 0; r < p; ++r) {
    std::vector<std::uint64_t> want_agreements, want_rails;
    for (int call = 0; call < kCalls; ++call) {
      want_agreements.push_back(call <= kChangeAt ? 1 : 2);
      want_rails.push_back(call <= kChangeAt ? 0b11 : 0b01);
    }
    EXPECT_EQ(agreements[static_cast<std::size_t>(r)], want_agreements) << "rank " << r;
    EXPECT_EQ(rails_of_2[static_cast<std::size_t>(r)], want_rails) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Range(2, 9),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return fmt::format("p{}", p.param);
                         });

}  // namespace
}  // namespace r2ccl::coll

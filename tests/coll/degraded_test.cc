// Degraded mode's plans, cost model and simulator: the plans pair up and finish on the simulator
// for every shape tried, the simulator's timing follows from first principles on small cases,
// reproduces R²CCL's model for Balance and R2CC-AllReduce, and the weighted plan stays near the
// lower bound.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <map>

#include "r2ccl/coll/degraded.h"
#include "r2ccl/coll/reduce.h"
#include "r2ccl/coll/sim.h"
#include "r2ccl/coll/verify.h"

namespace r2ccl::coll {
namespace {

CollDesc allreduce(std::size_t count, DataType t = DataType::kF32, bool in_place = false) {
  return CollDesc{CollOp::kAllReduce, count, t, RedOp::kSum, 0, in_place};
}

// Every send has its receive, same size, in the same order per pair.
void expect_pairs(const std::vector<Plan>& plans, const std::string& what) {
  std::map<std::pair<int, int>, std::vector<std::size_t>> sent, received;
  for (int r = 0; r < static_cast<int>(plans.size()); ++r)
    for (const auto& ph : plans[static_cast<std::size_t>(r)].phases)
      for (const auto& s : ph.comm) {
        ASSERT_NE(s.peer, r) << what;
        if (s.bytes == 0) continue;
        if (s.kind == Step::Kind::kSend) sent[{r, s.peer}].push_back(s.bytes);
        if (s.kind == Step::Kind::kRecv) received[{s.peer, r}].push_back(s.bytes);
      }
  EXPECT_EQ(sent, received) << what;
}

// Every rank's plan, make(rank) for ranks 0..p-1; the first failure otherwise.
template <class Make>
Result<std::vector<Plan>> every_rank(int p, Make&& make) {
  std::vector<Plan> plans;
  for (int r = 0; r < p; ++r) {
    auto plan = make(r);
    if (!plan) return plan.status().with_context(fmt::format("rank {}'s plan", r));
    plans.push_back(std::move(*plan));
  }
  return plans;
}

TEST(DegradedPlans, PairUpAndFinishInTheSimulatorForEveryShape) {
  for (int p : {2, 3, 4, 5, 8})
    for (int slow : {0, p / 2, p - 1})
      for (int shape = 0; shape < 3; ++shape)
        for (std::size_t count : {1u, 7u, 1000u, 1u << 18})
          for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted}) {
            // shape 0: the slow rank lost two of four rails; 1: slow on all four (no rails
            // known); 2: two slow ranks.
            Network net;
            net.latency_s = 20e-6;
            for (int r = 0; r < p; ++r) {
              const bool hit = r == slow || (shape == 2 && r == (slow + 1) % p);
              net.bandwidth.push_back(hit ? 0.5e9 : 1e9);
              if (shape == 0) net.rails_up.push_back(hit ? 0b0011 : 0b1111);
            }
            const std::string what = fmt::format("{} p={} slow={} shape={} count={}", algo_name(a),
                                                 p, slow, shape, count);
            auto made =
                every_rank(p, [&](int r) { return make_plan(allreduce(count), r, p, a, &net); });
            ASSERT_TRUE(made.is_ok()) << what << ": " << made.status().message();
            const std::vector<Plan>& plans = *made;
            for (const Plan& plan : plans)
              EXPECT_EQ(plan.algo, a) << what;
            expect_pairs(plans, what);
            SimNetwork sn;
            for (int r = 0; r < p; ++r)
              sn.rail_bps.push_back(std::vector<double>(4, net.bandwidth[r] / 4));
            sn.latency_s = net.latency_s;
            auto res = simulate(plans, sn);
            ASSERT_TRUE(res.is_ok()) << what << ": " << res.status().message();
            EXPECT_GT(res->seconds, 0) << what;
          }
}

// Runs every rank's plan on memory, by the executor's rules (a lane's phases in order, lanes
// side by side, a join waits for every earlier phase, a phase is posted only after every earlier
// phase with a message to or from the same peer in the same direction; a pair's messages match
// in plan order), and returns each rank's receive buffer. A message moves once both ends posted
// it; a phase's reductions run once its messages moved. Fails the test on a hang.
std::vector<std::vector<std::byte>> run_on_memory(const std::vector<Plan>& plans, const CollDesc& d,
                                                  const std::vector<std::vector<std::byte>>& in,
                                                  const std::string& what) {
  const int p = static_cast<int>(plans.size());
  const std::size_t elem = type_size(d.type);
  struct Rank {
    std::vector<std::byte> buf[3];
    std::vector<std::vector<std::uint32_t>> lanes;
    std::vector<std::size_t> cursor;
    std::vector<int> state;  // per phase: 0 waiting, 1 posted, 2 done
    std::vector<std::size_t> pending;
    std::vector<std::vector<std::uint32_t>> after;
  };
  std::vector<Rank> ranks(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& rk = ranks[static_cast<std::size_t>(r)];
    const Plan& plan = plans[static_cast<std::size_t>(r)];
    rk.buf[0] = in[static_cast<std::size_t>(r)];
    rk.buf[1].assign(d.count * elem, std::byte{0xee});
    if (d.in_place) rk.buf[1] = rk.buf[0];
    rk.buf[2].assign(plan.scratch_bytes, std::byte{0xdd});
    rk.lanes.resize(plan.lanes);
    rk.cursor.assign(plan.lanes, 0);
    rk.state.assign(plan.phases.size(), 0);
    rk.pending.assign(plan.phases.size(), 0);
    rk.after.resize(plan.phases.size());
    std::map<std::pair<int, bool>, std::uint32_t> last;
    for (std::uint32_t i = 0; i < plan.phases.size(); ++i) {
      rk.lanes.at(plan.phases[i].lane).push_back(i);
      for (const auto& st : plan.phases[i].comm) {
        if (st.bytes == 0) continue;
        auto [it, fresh] = last.try_emplace({st.peer, st.kind == Step::Kind::kSend}, i);
        if (!fresh && it->second != i) {
          rk.after[i].push_back(it->second);
          it->second = i;
        }
      }
    }
  }
  // The buffer a step's reference names (in place: the send buffer is the receive buffer).
  const auto ptr = [&](int r, const Ref& ref) {
    auto& rk = ranks[static_cast<std::size_t>(r)];
    const int b = d.in_place && ref.buf == Buf::kSend ? 1 : static_cast<int>(ref.buf);
    return rk.buf[b].data() + ref.offset;
  };
  struct Posted {
    int rank;
    std::uint32_t phase;
    const Step* step;
  };
  std::map<std::pair<int, int>, std::deque<Posted>> sends, recvs;  // by (sender, receiver)
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      auto& rk = ranks[static_cast<std::size_t>(r)];
      const Plan& plan = plans[static_cast<std::size_t>(r)];
      for (std::size_t l = 0; l < rk.lanes.size(); ++l) {
        if (rk.cursor[l] >= rk.lanes[l].size()) continue;
        const std::uint32_t i = rk.lanes[l][rk.cursor[l]];
        const Phase& ph = plan.phases[i];
        if (rk.state[i] == 0) {
          bool ok = std::all_of(rk.after[i].begin(), rk.after[i].end(),
                                [&](std::uint32_t j) { return rk.state[j] >= 1; });
          if (ph.join)
            for (std::uint32_t j = 0; j < i && ok; ++j)
              ok = rk.state[j] == 2;
          if (!ok) continue;
          rk.state[i] = 1;
          progress = true;
          for (const auto& st : ph.comm) {
            if (st.bytes == 0) continue;
            ++rk.pending[i];
            const bool out = st.kind == Step::Kind::kSend;
            auto& q = out ? sends[{r, st.peer}] : recvs[{st.peer, r}];
            q.push_back({r, i, &st});
            auto& s = sends[out ? std::pair{r, st.peer} : std::pair{st.peer, r}];
            auto& v = recvs[out ? std::pair{r, st.peer} : std::pair{st.peer, r}];
            while (!s.empty() && !v.empty()) {
              const Posted a = s.front(), b = v.front();
              s.pop_front();
              v.pop_front();
              EXPECT_EQ(a.step->bytes, b.step->bytes) << what;
              std::memcpy(ptr(b.rank, b.step->dst), ptr(a.rank, a.step->a),
                          std::min(a.step->bytes, b.step->bytes));
              --ranks[static_cast<std::size_t>(a.rank)].pending[a.phase];
              --ranks[static_cast<std::size_t>(b.rank)].pending[b.phase];
            }
          }
        }
        if (rk.state[i] == 1 && rk.pending[i] == 0) {
          for (const auto& st : ph.compute) {
            if (st.bytes == 0) continue;
            if (st.kind == Step::Kind::kReduce)
              coll::reduce(ptr(r, st.dst), ptr(r, st.a), ptr(r, st.b), st.bytes / elem, d.type,
                           d.redop);
            if (st.kind == Step::Kind::kCopy) std::memmove(ptr(r, st.dst), ptr(r, st.a), st.bytes);
            if (st.kind == Step::Kind::kAvg) finish_avg(ptr(r, st.dst), st.bytes / elem, d.type, p);
          }
          rk.state[i] = 2;
          ++rk.cursor[l];
          progress = true;
        }
      }
    }
  }
  std::vector<std::vector<std::byte>> out;
  for (int r = 0; r < p; ++r) {
    const auto& rk = ranks[static_cast<std::size_t>(r)];
    for (std::size_t l = 0; l < rk.lanes.size(); ++l)
      if (rk.cursor[l] < rk.lanes[l].size()) {
        ADD_FAILURE() << what << ": rank " << r << " hangs in lane " << l << " at phase "
                      << rk.lanes[l][rk.cursor[l]] + 1;
        return {};
      }
    out.push_back(rk.buf[1]);
  }
  return out;
}

// Every rank's result against the reference, element by element.
void expect_allreduce(const std::vector<Plan>& plans, const CollDesc& d, const std::string& what) {
  const int p = static_cast<int>(plans.size());
  const std::size_t elem = type_size(d.type);
  std::vector<std::vector<std::byte>> in(static_cast<std::size_t>(p),
                                         std::vector<std::byte>(d.count * elem));
  for (int r = 0; r < p; ++r)
    for (std::size_t i = 0; i < d.count; ++i)
      set_element(in[static_cast<std::size_t>(r)].data(), i, d.type, test_value(r, i, 7, d.redop));
  const auto out = run_on_memory(plans, d, in, what);
  ASSERT_EQ(out.size(), static_cast<std::size_t>(p)) << what;
  std::vector<double> inputs(static_cast<std::size_t>(p));
  for (std::size_t i = 0; i < d.count; ++i) {
    for (int r = 0; r < p; ++r)
      inputs[static_cast<std::size_t>(r)] =
          get_element(in[static_cast<std::size_t>(r)].data(), i, d.type);
    for (int r = 0; r < p; ++r)
      if (!matches_reduction(out[static_cast<std::size_t>(r)].data() + i * elem, inputs, d.type,
                             d.redop)) {
        ADD_FAILURE() << what << ": rank " << r << " element " << i << " is "
                      << get_element(out[static_cast<std::size_t>(r)].data(), i, d.type);
        return;
      }
  }
}

// The degraded plans at sizes the loopback tests cannot reach (up to 96 ranks, and nodes of
// several ranks), run on memory: every element on every rank is the reduction of the inputs.
TEST(DegradedPlans, ComputeTheRightSumsAtScale) {
  for (int p : {16, 33, 96})
    for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted})
      for (double slow : {0.5, 0.875})
        for (std::size_t count : {5u, 4099u}) {
          Network net;
          for (int r = 0; r < p; ++r) {
            const bool hit = r == p / 3 || (a == Algo::kWeighted && r == p - 1);
            net.bandwidth.push_back(hit ? slow * 1e9 : 1e9);
            net.rails_up.push_back(hit && slow < 0.6 ? 0b0011 : 0b1111);
          }
          const CollDesc d{CollOp::kAllReduce, count, DataType::kI32, RedOp::kSum, 0, count == 5};
          auto plans = every_rank(p, [&](int r) { return make_plan(d, r, p, a, &net); });
          ASSERT_TRUE(plans.is_ok()) << plans.status().message();
          expect_allreduce(*plans, d,
                           fmt::format("{} p={} slow={} count={}", algo_name(a), p, slow, count));
        }
  Cluster c;
  c.nodes = 12;
  c.gpus = 4;
  c.failed = {5};
  c.lost_nics = 3;
  c.intra_bps = 1e11;
  const Network net = c.network();
  for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted}) {
    const CollDesc d{CollOp::kAllReduce, 5003, DataType::kF32, RedOp::kAvg, 0, false};
    auto plans = every_rank(
        c.ranks(), [&](int r) { return make_hierarchical_plan(d, r, c.nodes, c.gpus, a, &net); });
    ASSERT_TRUE(plans.is_ok()) << plans.status().message();
    expect_allreduce(*plans, d, fmt::format("hierarchical {} 12x4 avg", algo_name(a)));
  }
}

// The weighted plan's grid form (make_plan takes it from kWeightedGridFrom ranks) for shapes
// whose last row is short (its members own several columns), with no slow rank, one, two, and
// all but one: every element right on every rank, in place or not, sum and avg, and the plans
// finish on the simulator.
TEST(DegradedPlans, TheWeightedGridComputesTheRightSumsForEveryShape) {
  for (int p : {1, 2, 3, 5, 7, 10, 13, 17, 31})
    for (int shape = 0; shape < 4; ++shape)
      for (std::size_t count : {1u, 7u, 1000u}) {
        Network net;
        net.latency_s = 20e-6;
        for (int r = 0; r < p; ++r) {
          const bool hit = (shape == 1 && r == p / 2) || (shape == 2 && (r == 0 || r == p - 1)) ||
                           (shape == 3 && r > 0);
          net.bandwidth.push_back(hit ? 0.5e9 : 1e9);
        }
        for (const CollDesc& d :
             {CollDesc{CollOp::kAllReduce, count, DataType::kI32, RedOp::kSum, 0, false},
              CollDesc{CollOp::kAllReduce, count, DataType::kF32, RedOp::kAvg, 0, true}}) {
          const std::string what = fmt::format("grid p={} shape={} count={} {}", p, shape, count,
                                               d.in_place ? "avg in place" : "sum");
          auto plans = every_rank(p, [&](int r) { return make_weighted_grid_plan(d, r, p, net); });
          ASSERT_TRUE(plans.is_ok()) << what << ": " << plans.status().message();
          expect_pairs(*plans, what);
          expect_allreduce(*plans, d, what);
          SimNetwork sn;
          for (int r = 0; r < p; ++r)
            sn.rail_bps.push_back(std::vector<double>(4, net.bandwidth[r] / 4));
          sn.latency_s = net.latency_s;
          auto res = simulate(*plans, sn);
          ASSERT_TRUE(res.is_ok()) << what << ": " << res.status().message();
        }
      }
  Network net;
  EXPECT_EQ(make_weighted_grid_plan(allreduce(8), 3, 3, net).status().message(),
            "rank 3 of 3 ranks");
  const CollDesc gather{CollOp::kAllGather, 8, DataType::kF32, RedOp::kSum, 0, false};
  EXPECT_EQ(make_weighted_grid_plan(gather, 0, 3, net).status().message(),
            "the weighted grid is an all-reduce, not allgather");
}

// At scale a rank of a grid sends a few messages per row and column, not one per rank. 400
// ranks, one slow: the weighted plan's grid is 19 x 21, whose ranks send at most 18 + 20 + 21 +
// 18 messages in a phase (the four stages of four chunks, the column's all-gather to the slow
// rank too); R2CC-AllReduce's exchange shares its sums along rows of 20 and then across 19 full
// rows (the 19 ranks of the short last row send their pieces to each of the 380 in full rows).
// The direct exchanges send 2 x 399.
TEST(DegradedPlans, GridsSendAFewMessagesPerRowAndColumnAPhase) {
  const int p = 400;
  Network net;
  net.bandwidth.assign(p, 1e9);
  net.bandwidth[7] = 0.5e9;
  net.latency_s = 5e-6;
  const CollDesc d = allreduce(std::size_t{16} << 20);
  for (Algo a : {Algo::kWeighted, Algo::kR2cc})
    for (int r : {0, 7, 399}) {
      auto plan = make_plan(d, r, p, a, &net);
      ASSERT_TRUE(plan.is_ok()) << plan.status().message();
      std::size_t most = 0;
      for (const auto& ph : plan->phases)
        most = std::max<std::size_t>(
            most, std::count_if(ph.comm.begin(), ph.comm.end(),
                                [](const Step& s) { return s.kind == Step::Kind::kSend; }));
      const std::string what = fmt::format("{} rank {}", algo_name(a), r);
      // The slow rank sends a piece to every owner (the 399 others) a chunk, and so does a rank
      // of R2CC's short row (the last 19) to the full rows.
      if (r == 7 || (a == Algo::kR2cc && r == 399))
        EXPECT_LE(most, std::size_t{399}) << what;
      else
        EXPECT_LE(most, a == Algo::kWeighted ? std::size_t{4 * 19 + 1} : std::size_t{20 + 2 * 19})
            << what;
      EXPECT_GT(plan->phases.size(), 4u) << what;
    }
}

TEST(DegradedPlans, HierarchicalPlansPairUp) {
  Cluster c;
  c.nodes = 4;
  c.gpus = 3;
  c.nics = 4;
  c.failed = {1};
  c.lost_nics = 2;
  c.intra_bps = 1e11;
  const Network net = c.network();
  for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted})
    for (std::size_t count : {5u, 1000u, 99999u}) {
      const std::string what = fmt::format("{} count={}", algo_name(a), count);
      auto plans = every_rank(c.ranks(), [&](int r) {
        return make_hierarchical_plan(allreduce(count), r, c.nodes, c.gpus, a, &net);
      });
      ASSERT_TRUE(plans.is_ok()) << what << ": " << plans.status().message();
      expect_pairs(*plans, what);
      auto res = simulate(*plans, c.sim_network());
      ASSERT_TRUE(res.is_ok()) << what << ": " << res.status().message();
    }
}

// A node's ranks run its local rank 0's hierarchical plan turned by their local index, where the
// shards are equal and every local index sees the same table: the same phases, sizes and rails,
// each peer (m, q) as (m, q + local).
TEST(DegradedPlans, HierarchicalPlansRotateWithTheLocalIndex) {
  Cluster c;
  c.nodes = 6;
  c.gpus = 4;
  c.nics = 4;
  c.failed = {2};
  c.lost_nics = 1;
  const Network net = c.network();
  for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted}) {
    const CollDesc d = allreduce(4000);
    ASSERT_TRUE(hierarchical_plans_rotate(d, c.nodes, c.gpus, &net));
    auto plans = every_rank(
        c.ranks(), [&](int r) { return make_hierarchical_plan(d, r, c.nodes, c.gpus, a, &net); });
    ASSERT_TRUE(plans.is_ok()) << plans.status().message();
    for (int r = 0; r < c.ranks(); ++r) {
      const int local = r % c.gpus;
      const Plan& mine = (*plans)[static_cast<std::size_t>(r)];
      const Plan& first = (*plans)[static_cast<std::size_t>(r - local)];
      const std::string what = fmt::format("{} rank {}", algo_name(a), r);
      ASSERT_EQ(mine.phases.size(), first.phases.size()) << what;
      for (std::size_t i = 0; i < mine.phases.size(); ++i) {
        const Phase &x = mine.phases[i], &y = first.phases[i];
        EXPECT_EQ(x.lane, y.lane) << what;
        EXPECT_EQ(x.join, y.join) << what;
        ASSERT_EQ(x.comm.size(), y.comm.size()) << what;
        for (std::size_t j = 0; j < x.comm.size(); ++j) {
          const Step &s = x.comm[j], &t = y.comm[j];
          EXPECT_EQ(s.kind, t.kind) << what;
          EXPECT_EQ(s.bytes, t.bytes) << what;
          EXPECT_EQ(s.rails, t.rails) << what;
          EXPECT_EQ(s.peer, t.peer - t.peer % c.gpus + (t.peer + local) % c.gpus) << what;
        }
        ASSERT_EQ(x.compute.size(), y.compute.size()) << what;
        for (std::size_t j = 0; j < x.compute.size(); ++j)
          EXPECT_EQ(x.compute[j].bytes, y.compute[j].bytes) << what;
      }
    }
  }
  // Unequal shards, or a rank that sees another table than its node's first: no rotation.
  EXPECT_FALSE(hierarchical_plans_rotate(allreduce(4001), c.nodes, c.gpus, &net));
  Network odd = net;
  odd.bandwidth[5] /= 2;
  EXPECT_FALSE(hierarchical_plans_rotate(allreduce(4000), c.nodes, c.gpus, &odd));
  odd = net;
  odd.rails_up[7] = 1;
  EXPECT_FALSE(hierarchical_plans_rotate(allreduce(4000), c.nodes, c.gpus, &odd));
}

// Simulating one rank per node (the others take its times) gives the whole job's simulation:
// every rank's finish, the messages and the bytes, for every plan, with NICs lost on several
// nodes or every NIC slowed, with latency, across the grids' sizes; and where the ranks of a node
// do not run turned plans it simulates every rank.
TEST(Simulator, OneRankPerNodeGivesTheWholeJobsTimes) {
  struct Shape {
    int nodes, gpus;
    std::vector<int> failed;
    bool shaped;
    double latency_s;
  };
  for (const Shape& sh : {Shape{6, 4, {2}, false, 5e-6}, Shape{9, 8, {4}, true, 0},
                          Shape{70, 2, {0, 33}, false, 2e-6}}) {
    Cluster c;
    c.nodes = sh.nodes;
    c.gpus = sh.gpus;
    c.nics = 4;
    c.failed = sh.failed;
    c.shaped = sh.shaped;
    c.slow = sh.shaped ? 0.6 : 1;
    c.lost_nics = sh.shaped ? 0 : 2;
    c.intra_bps = 1e11;
    c.latency_s = sh.latency_s;
    for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted})
      for (std::size_t count : {std::size_t{1} << 22, (std::size_t{1} << 22) + 1}) {
        const CollDesc d = allreduce(count, DataType::kBF16);
        const std::string what =
            fmt::format("{}x{} {} count={}", sh.nodes, sh.gpus, algo_name(a), count);
        auto one = simulate(c, d, a);
        auto every = simulate(c, d, a, nullptr, false);
        ASSERT_TRUE(one.is_ok()) << what << ": " << one.status().message();
        ASSERT_TRUE(every.is_ok()) << what << ": " << every.status().message();
        EXPECT_EQ(one->folded, count % static_cast<std::size_t>(sh.gpus) == 0 ? sh.gpus : 1)
            << what;
        EXPECT_EQ(every->folded, 1) << what;
        EXPECT_EQ(one->messages, every->messages) << what;
        EXPECT_NEAR(one->bytes, every->bytes, 1e-9 * every->bytes) << what;
        EXPECT_NEAR(one->seconds, every->seconds, 1e-9 * every->seconds) << what;
        ASSERT_EQ(one->finish.size(), every->finish.size()) << what;
        for (std::size_t r = 0; r < every->finish.size(); ++r)
          EXPECT_NEAR(one->finish[r], every->finish[r], 1e-9 * every->seconds)
              << what << " rank " << r;
      }
  }
  // The table the plans are made from differs at one rank of a node: every rank is simulated.
  Cluster c;
  c.nodes = 5;
  c.gpus = 2;
  c.failed = {1};
  c.lost_nics = 2;
  c.intra_bps = 1e11;
  Network net = c.network();
  net.bandwidth[3] *= 0.9;
  const CollDesc d = allreduce(std::size_t{1} << 20, DataType::kBF16);
  auto r = simulate(c, d, Algo::kWeighted, &net);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->folded, 1);
}

// Every rank's direct (one-shot) plan of a 1 MB `op` rooted at rank 0.
std::vector<Plan> direct_plans(CollOp op, int p) {
  const CollDesc d{op, 1000000, DataType::kU8, RedOp::kSum, 0, false};
  std::vector<Plan> plans;
  for (int r = 0; r < p; ++r)
    plans.push_back(*make_plan(d, r, p, Algo::kOneShot));
  return plans;
}

TEST(Simulator, AMessageTakesTheLatencyPlusItsBytesOverTheSlowerEnd) {
  const auto plans = direct_plans(CollOp::kBroadcast, 2);
  SimNetwork sn;
  sn.rail_bps = {{1e9, 1e9}, {0.5e9, 0}};  // rank 1 receives on one rail of 0.5 GB/s
  sn.latency_s = 1e-3;
  auto res = simulate(plans, sn);
  ASSERT_TRUE(res.is_ok()) << res.status().message();
  EXPECT_NEAR(res->seconds, 1e-3 + 1e6 / 0.5e9, 1e-9);
  EXPECT_EQ(res->messages, 1u);
}

TEST(Simulator, MessagesIntoOnePortShareIt) {
  // Ranks 1 and 2 each send 1 MB to rank 0: its one port of 1 GB/s takes 2 ms for both.
  const auto plans = direct_plans(CollOp::kReduce, 3);
  SimNetwork sn;
  sn.rail_bps = {{1e9}, {1e9}, {1e9}};
  auto res = simulate(plans, sn);
  ASSERT_TRUE(res.is_ok());
  EXPECT_NEAR(res->seconds, 2e-3, 1e-9);
  EXPECT_NEAR(res->finish[1], 2e-3, 1e-9);
}

TEST(Simulator, ASendNobodyReceivesIsAHangAndSizesMustAgree) {
  Plan sender, receiver;
  Phase ph;
  ph.comm.push_back(Step{Step::Kind::kSend, 1, {}, {}, {}, 100, Step::kAllRails});
  sender.phases.push_back(ph);
  SimNetwork sn;
  sn.rail_bps = {{1e9}, {1e9}};
  auto hang = simulate({sender, receiver}, sn);
  ASSERT_FALSE(hang.is_ok());
  EXPECT_EQ(hang.status().message(), "the plans hang: rank 0 waits in lane 0 at phase 1 of 1");
  Phase rph;
  rph.comm.push_back(Step{Step::Kind::kRecv, 0, {}, {}, {}, 99, Step::kAllRails});
  receiver.phases.push_back(rph);
  auto sizes = simulate({sender, receiver}, sn);
  ASSERT_FALSE(sizes.is_ok());
  EXPECT_EQ(sizes.status().message(),
            "the plans disagree: message 1 from rank 0 to 1 is 100 bytes at the sender and 99 at "
            "the receiver");
}

TEST(Simulator, ARailMaskKeepsAMessageOnItsRails) {
  auto plans = direct_plans(CollOp::kBroadcast, 2);
  for (auto& ph : plans[0].phases)
    for (auto& s : ph.comm)
      s.rails = 0b01;
  SimNetwork sn;
  sn.rail_bps = {{1e9, 1e9}, {1e9, 1e9}};
  auto one = simulate(plans, sn);
  ASSERT_TRUE(one.is_ok());
  EXPECT_NEAR(one->seconds, 1e-3, 1e-9);  // rail 0 only
  sn.rail_bps = {{0, 1e9}, {1e9, 1e9}};   // rail 0 down at the sender: any rail left
  auto other = simulate(plans, sn);
  ASSERT_TRUE(other.is_ok());
  EXPECT_NEAR(other->seconds, 1e-3, 1e-9);
}

// R²CCL's model: Balance 1/(1-X), R2CC-AllReduce 1 + nX/(2(n-1)(1-X)) of the fault-free ring;
// the weighted plan within 3% of T_LB and never slower than R2CC-AllReduce.
TEST(DegradedModel, SimulatorReproducesR2cclAndWeightedNearsTheLowerBound) {
  for (int n : {3, 8, 16, 64})
    for (auto [num, den] : {std::pair{1, 8}, {1, 4}, {1, 3}, {1, 2}}) {
      const double x = static_cast<double>(num) / den;
      Cluster c;
      c.nodes = n;
      c.nics = 24;
      c.failed = {0};
      c.lost_nics = 24 * num / den;
      const CollDesc d = allreduce(std::size_t{64} << 20, DataType::kBF16);
      Cluster healthy = c;
      healthy.failed.clear();
      const double t0 = predict_seconds(Algo::kRing, d, healthy.network());
      const std::string what = fmt::format("n={} X={}/{}", n, num, den);
      auto time = [&](Algo a) {
        auto r = simulate(c, d, a);
        EXPECT_TRUE(r.is_ok()) << what;
        return r.is_ok() ? r->seconds / t0 : 0;
      };
      const double balance = time(Algo::kBalance), r2cc = time(Algo::kR2cc),
                   weighted = time(Algo::kWeighted);
      EXPECT_NEAR(balance / (1 / (1 - x)), 1, 0.01) << what;
      EXPECT_NEAR(r2cc / (1 + n * x / (2 * (n - 1) * (1 - x))), 1, 0.01) << what;
      const double bound = lower_bound_seconds(d, c.network()) / t0;
      EXPECT_LE(weighted / bound, 1.03) << what;
      EXPECT_GE(weighted / bound, 1.0) << what;
      EXPECT_LE(weighted, r2cc) << what;
      // The cost model the automatic choice uses agrees with the simulator here.
      for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted})
        EXPECT_NEAR(predict_seconds(a, d, c.network()) / t0, time(a), 0.01 * time(a))
            << what << " " << algo_name(a);
      EXPECT_EQ(choose_degraded(d, c.network()), Algo::kWeighted) << what;
    }
}

// Past kWeightedGridFrom ranks the weighted plan is the grid: still within 3% of T_LB in the
// simulator (256 nodes, one lost 1/8 or 1/4 of its NICs), its cost model within 1% of the
// simulation, and the automatic choice.
TEST(DegradedModel, TheWeightedGridStaysNearTheLowerBoundAtScale) {
  for (int lost : {1, 2}) {
    Cluster c;
    c.nodes = 256;
    c.nics = 8;
    c.failed = {100};
    c.lost_nics = lost;
    const CollDesc d = allreduce(std::size_t{64} << 20, DataType::kBF16);
    const std::string what = fmt::format("256 nodes, one lost {} of 8 NICs", lost);
    auto r = simulate(c, d, Algo::kWeighted);
    ASSERT_TRUE(r.is_ok()) << what << ": " << r.status().message();
    const double bound = lower_bound_seconds(d, c.network());
    EXPECT_LE(r->seconds / bound, 1.03) << what;
    EXPECT_GE(r->seconds / bound, 1.0) << what;
    EXPECT_NEAR(predict_seconds(Algo::kWeighted, d, c.network()) / r->seconds, 1, 0.01) << what;
    EXPECT_EQ(choose_degraded(d, c.network()), Algo::kWeighted) << what;
    // A grid's messages, not the direct exchange's 2 x 255 per rank and chunk.
    EXPECT_LT(r->messages, std::uint64_t{256} * 2 * 255 * weighted_chunks(d, c.network()) / 4)
        << what;
  }
}

// Past kR2ccGridFrom ranks R2CC-AllReduce shares its exchange's sums on a grid: its simulated
// time stays within 1% of R²CCL's model (one pipeline step more) and of its own cost model.
TEST(DegradedModel, R2ccOnAGridKeepsToR2cclsModelAtScale) {
  const int n = 256;
  Cluster c;
  c.nodes = n;
  c.nics = 24;
  c.failed = {0};
  c.lost_nics = 6;
  const double x = 0.25;
  const CollDesc d = allreduce(std::size_t{128} << 20, DataType::kBF16);
  Cluster healthy = c;
  healthy.failed.clear();
  const double t0 = predict_seconds(Algo::kRing, d, healthy.network());
  auto r = simulate(c, d, Algo::kR2cc);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_NEAR(r->seconds / t0 / (1 + n * x / (2 * (n - 1) * (1 - x))), 1, 0.01);
  EXPECT_NEAR(predict_seconds(Algo::kR2cc, d, c.network()) / r->seconds, 1, 0.01);
}

TEST(DegradedModel, WeightedSharesMakeTrafficFollowBandwidth) {
  // Equal ranks own equal shares.
  for (double s : weighted_shares({2, 2, 2, 2}))
    EXPECT_DOUBLE_EQ(s, 0.25);
  // One rank at 3/4 of 8: (1 + (p-2) s_i) / b_i is the same for every rank.
  const std::vector<double> b{1, 1, 1, 0.75, 1, 1, 1, 1};
  const auto s = weighted_shares(b);
  double sum = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    sum += s[i];
    EXPECT_NEAR((1 + 6 * s[i]) / b[i], (1 + 6 * s[0]) / b[0], 1e-12);
  }
  EXPECT_NEAR(sum, 1, 1e-12);
  // At half the bandwidth or less the slow rank owns nothing (it is bound by its own N).
  EXPECT_EQ(weighted_shares({1, 1, 1, 0.5})[3], 0);
}

// The agreement's settling: a rank measured faster than the rest, or within 30% of the (lower)
// median, counts as the median; one well under it, or with rails lost, is degraded by that much.
TEST(DegradedModel, SettlingKeepsOnlyRanksWellUnderTheOthers) {
  const std::vector<std::uint64_t> four(4, 0b1111);
  auto net = [](std::vector<double> b) {
    Network n;
    n.bandwidth = std::move(b);
    return n;
  };
  const auto fast_one = settle_bandwidths({2.2e9, 1.3e9, 1.4e9, 1.0e9}, four);
  EXPECT_EQ(fast_one, std::vector<double>(4, 1.3e9));  // the lower median
  EXPECT_FALSE(is_degraded(net(fast_one)));
  const auto shaped = settle_bandwidths({1.0e9, 0.5e9, 1.1e9, 0.95e9}, four);
  EXPECT_TRUE(is_degraded(net(shaped)));
  EXPECT_NEAR(shaped[1] / shaped[0], 0.5, 1.0 / 32);
  const auto lost =
      settle_bandwidths({1.0e9, 0.52e9, 1.0e9, 1.0e9}, {0b1111, 0b0011, 0b1111, 0b1111});
  EXPECT_DOUBLE_EQ(lost[1] / lost[0], 0.5);
}

TEST(DegradedModel, LatencyDecidesThePipelineAndTheChoiceIsTheCheapest) {
  Cluster c;
  c.nodes = 8;
  c.failed = {0};
  c.lost_nics = 1;
  c.latency_s = 50e-6;
  const Network net = c.network();
  EXPECT_FALSE(is_degraded(Cluster{}.network()));
  EXPECT_TRUE(is_degraded(net));
  // A small message is all latency: one chunk (a direct reduce-scatter and all-gather, two
  // rounds against the ring's fourteen). A large one is pipelined only as deep as it pays: with
  // one NIC of eight lost the slow rank has time to spare and one chunk is within 1% of the
  // deepest pipeline; with half its NICs lost its sends and receives must overlap.
  EXPECT_EQ(weighted_chunks(allreduce(4096), net), 1);
  EXPECT_EQ(weighted_chunks(allreduce(64u << 20), net), 1);
  Cluster half = c;
  half.lost_nics = 4;
  const int deep = weighted_chunks(allreduce(64u << 20), half.network());
  EXPECT_GT(deep, 1);
  for (std::size_t count : {4096u, 1u << 20, 64u << 20}) {
    const Algo best = choose_degraded(allreduce(count), net);
    for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted})
      EXPECT_LE(predict_seconds(best, allreduce(count), net),
                predict_seconds(a, allreduce(count), net))
          << count << " " << algo_name(a);
  }
}

}  // namespace
}  // namespace r2ccl::coll

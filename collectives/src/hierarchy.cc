// All-reduce across nodes of several ranks each: inside the node, across nodes per local rank,
// inside the node again.
#include <fmt/format.h>

#include "plan_steps.h"
#include "r2ccl/coll/degraded.h"

namespace r2ccl::coll {

using namespace plan_steps;

namespace {

// The ranks of local index `local`, one per node: their entries of the table.
Network local_network(const Network& net, int nodes, int gpus, int local) {
  Network sub;
  sub.latency_s = net.latency_s;
  const bool rails = net.rails_up.size() == net.bandwidth.size();
  for (int m = 0; m < nodes && !net.bandwidth.empty(); ++m) {
    const auto r = static_cast<std::size_t>(m * gpus + local);
    sub.bandwidth.push_back(net.bandwidth[r]);
    if (rails) sub.rails_up.push_back(net.rails_up[r]);
  }
  return sub;
}

}  // namespace

Result<Plan> make_hierarchical_plan(const CollDesc& d, int rank, int nodes, int gpus, Algo algo,
                                    const Network* net) {
  if (d.op != CollOp::kAllReduce)
    return Status(ErrorCode::kInvalidArgument, "hierarchical plans are all-reduces");
  if (nodes < 1 || gpus < 1 || rank < 0 || rank >= nodes * gpus)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("rank {} of {} nodes x {} ranks", rank, nodes, gpus));
  const int p = nodes * gpus;
  if (net && !net->bandwidth.empty() && net->bandwidth.size() != static_cast<std::size_t>(p))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("the network has {} ranks, the plan {}", net->bandwidth.size(), p));
  const std::size_t elem = type_size(d.type);
  const int node = rank / gpus, local = rank % gpus;
  const auto peer = [&](int q) { return node * gpus + q; };
  const Segments seg{d.count, elem, gpus};
  const std::size_t mine = seg.len(local), slot = seg.max_len();
  Plan plan;
  const bool split = gpus > 1;
  // Inside the node: every local rank's piece of this rank's shard, reduced here in local order.
  std::size_t scratch = 0;
  if (split) {
    scratch = slot * static_cast<std::size_t>(gpus);
    Phase ph;
    for (int i = 1; i < gpus; ++i) {
      const int q = mod(local - i, gpus);
      ph.comm.push_back(recv(peer(q), at(Buf::kScratch, slot * static_cast<std::size_t>(q)), mine));
    }
    for (int i = 1; i < gpus; ++i) {
      const int q = mod(local + i, gpus);
      ph.comm.push_back(send(peer(q), at(Buf::kSend, seg.off(q)), seg.len(q)));
    }
    const Ref own = at(Buf::kSend, seg.off(local));
    const Ref own_slot = at(Buf::kScratch, slot * static_cast<std::size_t>(local));
    if (d.in_place) ph.compute.push_back(copy(own_slot, own, mine));
    chain(
        ph.compute, gpus, at(Buf::kRecv, seg.off(local)), mine,
        [&](int i) {
          return i == local ? (d.in_place ? own_slot : own)
                            : at(Buf::kScratch, slot * static_cast<std::size_t>(i));
        },
        false);
    plan.phases.push_back(std::move(ph));
  }
  // Across nodes: this shard among the ranks of the same local index, one per node.
  CollDesc sub = d;
  sub.count = mine / elem;
  sub.in_place = split || d.in_place;
  const Network subnet = net ? local_network(*net, nodes, gpus, local) : Network{};
  R2CCL_ASSIGN_OR_RETURN(auto across, make_plan(sub, node, nodes, algo, net ? &subnet : nullptr));
  const std::size_t base = seg.off(local);
  const auto move = [&](Ref& r) {
    if (r.buf == Buf::kScratch) {
      r.offset += scratch;
    } else {
      if (split) r.buf = Buf::kRecv;  // the shard, reduced inside the node, is in place there
      r.offset += base;
    }
  };
  // Each lane but the first starts only once the reduce-scatter inside the node is done (lane 0
  // runs after it anyway): its first phase joins.
  std::vector<bool> started(across.lanes, false);
  for (auto& ph : across.phases) {
    if (split && ph.lane > 0 && !started[ph.lane]) ph.join = true;
    if (ph.lane < started.size()) started[ph.lane] = true;
    for (auto& s : ph.comm) {
      s.peer = s.peer * gpus + local;
      move(s.kind == Step::Kind::kRecv ? s.dst : s.a);
    }
    for (auto& s : ph.compute) {
      move(s.a);
      if (s.kind == Step::Kind::kReduce) move(s.b);
      move(s.dst);
    }
    plan.phases.push_back(std::move(ph));
  }
  plan.lanes = across.lanes;
  plan.algo = across.algo;
  plan.scratch_bytes = scratch + across.scratch_bytes;
  // Inside the node again: every shard to every local rank, once both lanes are done.
  if (split) {
    Phase ph;
    ph.join = true;
    for (int i = 1; i < gpus; ++i) {
      const int q = mod(local - i, gpus);
      ph.comm.push_back(recv(peer(q), at(Buf::kRecv, seg.off(q)), seg.len(q)));
    }
    for (int i = 1; i < gpus; ++i)
      ph.comm.push_back(send(peer(mod(local + i, gpus)), at(Buf::kRecv, base), mine));
    plan.phases.push_back(std::move(ph));
  }
  return plan;
}

bool hierarchical_plans_rotate(const CollDesc& d, int nodes, int gpus, const Network* net) {
  if (gpus < 1 || nodes < 1 || d.count % static_cast<std::size_t>(gpus) != 0) return false;
  if (!net) return true;
  const auto same = [&](const auto& v) {
    if (v.empty()) return true;
    if (v.size() != static_cast<std::size_t>(nodes) * static_cast<std::size_t>(gpus)) return false;
    for (std::size_t r = 0; r < v.size(); ++r)
      if (v[r] != v[r - r % static_cast<std::size_t>(gpus)]) return false;
    return true;
  };
  return same(net->bandwidth) && same(net->rails_up);
}

double predict_hierarchical_seconds(Algo algo, const CollDesc& d, int nodes, int gpus,
                                    const Network& net, double intra_bps) {
  const std::size_t elem = type_size(d.type);
  const Segments seg{d.count, elem, gpus};
  double inside = 0;
  if (gpus > 1)
    inside = 2 * (net.latency_s + static_cast<double>((gpus - 1) * seg.max_len()) / intra_bps);
  double across = 0;
  for (int local = 0; local < gpus; ++local) {
    CollDesc part = d;
    part.count = seg.len(local) / elem;
    across = std::max(across, predict_seconds(algo, part, local_network(net, nodes, gpus, local)));
  }
  return inside + across;
}

}  // namespace r2ccl::coll

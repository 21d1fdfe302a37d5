#include "r2ccl/coll/plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "plan_steps.h"

namespace r2ccl::coll {
namespace {

using namespace plan_steps;

// ---- all-reduce

Plan allreduce_ring(const CollDesc& d, int r, int p, std::size_t elem) {
  std::vector<int> all(static_cast<std::size_t>(p));
  for (int i = 0; i < p; ++i)
    all[static_cast<std::size_t>(i)] = i;
  Plan plan;
  plan.scratch_bytes = ring_scratch(d.count, elem, p);
  ring_allreduce(plan, elem, {all, r, 0, d.count, 0, 0, d.redop == RedOp::kAvg, Step::kAllRails});
  return plan;
}

// Everyone sends everything to everyone; each rank reduces all inputs in rank order.
Plan allreduce_oneshot(const CollDesc& d, int r, int p, std::size_t elem) {
  const std::size_t n = d.count * elem;
  Plan plan;
  plan.scratch_bytes = n * static_cast<std::size_t>(p);  // slot i: rank i's input
  Phase ph;
  for (int i = 1; i < p; ++i)
    ph.comm.push_back(recv(mod(r - i, p), at(Buf::kScratch, n * mod(r - i, p)), n));
  for (int i = 1; i < p; ++i)
    ph.comm.push_back(send(mod(r + i, p), at(Buf::kSend, 0), n));
  // In place, the chain would overwrite this rank's input before using it: keep a copy.
  if (d.in_place) ph.compute.push_back(copy(at(Buf::kScratch, n * r), at(Buf::kSend, 0), n));
  chain(
      ph.compute, p, at(Buf::kRecv, 0), n,
      [&](int i) { return i == r && !d.in_place ? at(Buf::kSend, 0) : at(Buf::kScratch, n * i); },
      d.redop == RedOp::kAvg);
  plan.phases.push_back(std::move(ph));
  return plan;
}

// Direct reduce-scatter (each rank reduces its segment from all inputs) then direct all-gather.
Plan allreduce_twoshot(const CollDesc& d, int r, int p, std::size_t elem) {
  Segments seg{d.count, elem, p};
  const std::size_t mine = seg.len(r), slot = seg.max_len();
  Plan plan;
  plan.scratch_bytes = slot * static_cast<std::size_t>(p);
  Phase rs;
  for (int i = 1; i < p; ++i) {
    const int from = mod(r - i, p);
    rs.comm.push_back(recv(from, at(Buf::kScratch, slot * from), mine));
  }
  for (int i = 1; i < p; ++i) {
    const int to = mod(r + i, p);
    rs.comm.push_back(send(to, at(Buf::kSend, seg.off(to)), seg.len(to)));
  }
  if (d.in_place)
    rs.compute.push_back(copy(at(Buf::kScratch, slot * r), at(Buf::kSend, seg.off(r)), mine));
  chain(
      rs.compute, p, at(Buf::kRecv, seg.off(r)), mine,
      [&](int i) {
        return i == r && !d.in_place ? at(Buf::kSend, seg.off(r)) : at(Buf::kScratch, slot * i);
      },
      d.redop == RedOp::kAvg);
  plan.phases.push_back(std::move(rs));
  Phase ag;
  for (int i = 1; i < p; ++i) {
    const int from = mod(r - i, p);
    ag.comm.push_back(recv(from, at(Buf::kRecv, seg.off(from)), seg.len(from)));
  }
  for (int i = 1; i < p; ++i)
    ag.comm.push_back(send(mod(r + i, p), at(Buf::kRecv, seg.off(r)), mine));
  plan.phases.push_back(std::move(ag));
  return plan;
}

// ---- all-gather: rank i's block goes to [i*n, (i+1)*n) of every receive buffer

Plan allgather(const CollDesc& d, int r, int p, std::size_t elem, bool ring) {
  const std::size_t n = d.count * elem;
  Plan plan;
  auto own = [&](Phase& ph) {
    if (!d.in_place) ph.compute.push_back(copy(at(Buf::kRecv, n * r), at(Buf::kSend, 0), n));
  };
  if (!ring) {
    Phase ph;
    for (int i = 1; i < p; ++i) {
      const int from = mod(r - i, p);
      ph.comm.push_back(recv(from, at(Buf::kRecv, n * from), n));
    }
    for (int i = 1; i < p; ++i)
      ph.comm.push_back(send(mod(r + i, p), at(Buf::kSend, 0), n));
    own(ph);
    plan.phases.push_back(std::move(ph));
    return plan;
  }
  const int next = mod(r + 1, p), prev = mod(r - 1, p);
  for (int s = 0; s + 1 < p; ++s) {
    Phase ph;
    const int out = mod(r - s, p), in = mod(r - s - 1, p);
    ph.comm.push_back(send(next, s == 0 ? at(Buf::kSend, 0) : at(Buf::kRecv, n * out), n));
    ph.comm.push_back(recv(prev, at(Buf::kRecv, n * in), n));
    if (s == 0) own(ph);
    plan.phases.push_back(std::move(ph));
  }
  if (p == 1) {
    Phase ph;
    own(ph);
    plan.phases.push_back(std::move(ph));
  }
  return plan;
}

// ---- reduce-scatter: block i of every send buffer, reduced, lands in rank i's receive buffer

Plan reducescatter(const CollDesc& d, int r, int p, std::size_t elem, bool ring) {
  const std::size_t n = d.count * elem;
  const bool average = d.redop == RedOp::kAvg;
  Plan plan;
  if (!ring || p == 1) {
    plan.scratch_bytes = n * static_cast<std::size_t>(p);
    Phase ph;
    for (int i = 1; i < p; ++i) {
      const int from = mod(r - i, p);
      ph.comm.push_back(recv(from, at(Buf::kScratch, n * from), n));
    }
    for (int i = 1; i < p; ++i) {
      const int to = mod(r + i, p);
      ph.comm.push_back(send(to, at(Buf::kSend, n * to), n));
    }
    if (d.in_place) ph.compute.push_back(copy(at(Buf::kScratch, n * r), at(Buf::kSend, n * r), n));
    chain(
        ph.compute, p, at(Buf::kRecv, 0), n,
        [&](int i) {
          return i == r && !d.in_place ? at(Buf::kSend, n * r) : at(Buf::kScratch, n * i);
        },
        average);
    plan.phases.push_back(std::move(ph));
    return plan;
  }
  // Ring: at step s this rank sends its running sum of block r-s-1 and receives block r-s-2's;
  // the last step's sum is block r, complete.
  plan.scratch_bytes = 2 * n;  // [0, n): running sum; [n, 2n): what arrives
  const int next = mod(r + 1, p), prev = mod(r - 1, p);
  const Ref acc = at(Buf::kScratch, 0), tmp = at(Buf::kScratch, n);
  for (int s = 0; s + 1 < p; ++s) {
    Phase ph;
    const int out = mod(r - s - 1, p), in = mod(r - s - 2, p);
    ph.comm.push_back(send(next, s == 0 ? at(Buf::kSend, n * out) : acc, n));
    ph.comm.push_back(recv(prev, tmp, n));
    const bool last = s + 2 == p;
    const Ref dst = last ? at(Buf::kRecv, 0) : acc;
    ph.compute.push_back(reduce(dst, at(Buf::kSend, n * in), tmp, n));
    if (last && average) ph.compute.push_back(avg(dst, n));
    plan.phases.push_back(std::move(ph));
  }
  return plan;
}

// ---- broadcast: a chain from the root, pipelined in slices; direct for small messages

Plan broadcast(const CollDesc& d, int r, int p, std::size_t elem, bool ring) {
  const std::size_t n = d.count * elem;
  Plan plan;
  const int pos = mod(r - d.root, p);
  if (pos == 0 && !d.in_place) {
    Phase ph;
    ph.compute.push_back(copy(at(Buf::kRecv, 0), at(Buf::kSend, 0), n));
    plan.phases.push_back(std::move(ph));
  }
  if (p == 1) return plan;
  if (!ring) {
    Phase ph;
    if (pos == 0)
      for (int i = 1; i < p; ++i)
        ph.comm.push_back(send(mod(r + i, p), at(Buf::kSend, 0), n));
    else
      ph.comm.push_back(recv(d.root, at(Buf::kRecv, 0), n));
    plan.phases.push_back(std::move(ph));
    return plan;
  }
  // Slices of at least 256 KiB (whole elements), at most 64 of them.
  const std::size_t slice_elems =
      std::max<std::size_t>({1, (256u << 10) / elem, (d.count + 63) / 64});
  const std::size_t slices = (d.count + slice_elems - 1) / slice_elems;
  const int next = mod(r + 1, p), prev = mod(r - 1, p);
  auto slice = [&](std::size_t k) {
    const std::size_t first = k * slice_elems;
    return std::pair{first * elem, (std::min(d.count, first + slice_elems) - first) * elem};
  };
  const auto total = static_cast<long>(slices) + p - 2;
  for (long t = 0; t < total; ++t) {
    Phase ph;
    const long out = t - pos, in = t - pos + 1;
    if (pos >= 1 && in >= 0 && in < static_cast<long>(slices)) {
      auto [off, len] = slice(static_cast<std::size_t>(in));
      ph.comm.push_back(recv(prev, at(Buf::kRecv, off), len));
    }
    if (pos < p - 1 && out >= 0 && out < static_cast<long>(slices)) {
      auto [off, len] = slice(static_cast<std::size_t>(out));
      ph.comm.push_back(send(next, at(pos == 0 ? Buf::kSend : Buf::kRecv, off), len));
    }
    if (!ph.comm.empty()) plan.phases.push_back(std::move(ph));
  }
  return plan;
}

// ---- reduce: ring reduce-scatter of p segments, then every segment to the root; direct for small

Plan reduce_to_root(const CollDesc& d, int r, int p, std::size_t elem, bool ring) {
  const std::size_t n = d.count * elem;
  const bool average = d.redop == RedOp::kAvg;
  const bool root = r == d.root;
  Plan plan;
  if (!ring || p == 1) {
    if (!root) {
      Phase ph;
      ph.comm.push_back(send(d.root, at(Buf::kSend, 0), n));
      plan.phases.push_back(std::move(ph));
      return plan;
    }
    plan.scratch_bytes = n * static_cast<std::size_t>(p);
    Phase ph;
    for (int i = 1; i < p; ++i) {
      const int from = mod(r - i, p);
      ph.comm.push_back(recv(from, at(Buf::kScratch, n * from), n));
    }
    if (d.in_place) ph.compute.push_back(copy(at(Buf::kScratch, n * r), at(Buf::kSend, 0), n));
    chain(
        ph.compute, p, at(Buf::kRecv, 0), n,
        [&](int i) { return i == r && !d.in_place ? at(Buf::kSend, 0) : at(Buf::kScratch, n * i); },
        average);
    plan.phases.push_back(std::move(ph));
    return plan;
  }
  // Reduce-scatter (segment i ends at rank i), in scratch except the root's own segment.
  Segments seg{d.count, elem, p};
  const std::size_t slot = seg.max_len();
  plan.scratch_bytes = 3 * slot;  // running sum, arrivals, this rank's finished segment
  const Ref acc = at(Buf::kScratch, 0), tmp = at(Buf::kScratch, slot);
  const Ref done = root ? at(Buf::kRecv, seg.off(r)) : at(Buf::kScratch, 2 * slot);
  const int next = mod(r + 1, p), prev = mod(r - 1, p);
  for (int s = 0; s + 1 < p; ++s) {
    Phase ph;
    const int out = mod(r - s - 1, p), in = mod(r - s - 2, p);
    ph.comm.push_back(send(next, s == 0 ? at(Buf::kSend, seg.off(out)) : acc, seg.len(out)));
    ph.comm.push_back(recv(prev, tmp, seg.len(in)));
    const bool last = s + 2 == p;
    // In place at the root, its own segment of the send buffer is the destination: reading it
    // first (a) and writing it (dst) in one element-wise step is safe.
    const Ref dst = last ? done : acc;
    ph.compute.push_back(reduce(dst, at(Buf::kSend, seg.off(in)), tmp, seg.len(in)));
    if (last && average) ph.compute.push_back(avg(dst, seg.len(in)));
    plan.phases.push_back(std::move(ph));
  }
  Phase gather;
  if (root) {
    for (int i = 1; i < p; ++i) {
      const int from = mod(r - i, p);
      gather.comm.push_back(recv(from, at(Buf::kRecv, seg.off(from)), seg.len(from)));
    }
  } else {
    gather.comm.push_back(send(d.root, done, seg.len(r)));
  }
  plan.phases.push_back(std::move(gather));
  return plan;
}

// ---- barrier: one byte to and from every peer

Plan barrier(int r, int p) {
  Plan plan;
  plan.algo = Algo::kOneShot;
  plan.scratch_bytes = static_cast<std::size_t>(p);
  Phase ph;
  for (int i = 1; i < p; ++i)
    ph.comm.push_back(
        recv(mod(r - i, p), at(Buf::kScratch, static_cast<std::size_t>(mod(r - i, p))), 1));
  for (int i = 1; i < p; ++i)
    ph.comm.push_back(send(mod(r + i, p), at(Buf::kScratch, static_cast<std::size_t>(r)), 1));
  if (p > 1) plan.phases.push_back(std::move(ph));
  return plan;
}

}  // namespace

namespace plan_steps {

void ring_allreduce(Plan& plan, std::size_t elem, const RingPart& part) {
  const int p = static_cast<int>(part.members.size());
  const int r = part.me;
  Segments seg{part.count, elem, p};
  const std::size_t base = part.first * elem;
  const auto member = [&](int i) { return part.members[static_cast<std::size_t>(mod(i, p))]; };
  const int next = member(r + 1), prev = member(r - 1);
  const Ref tmp = at(Buf::kScratch, part.scratch_at);
  // Reduce-scatter: after step s this rank holds the partial sum of segment r-s-1 over s+2 ranks.
  for (int s = 0; s + 1 < p; ++s) {
    Phase ph;
    ph.lane = part.lane;
    const int out = mod(r - s, p), in = mod(r - s - 1, p);
    ph.comm.push_back(send(next, at(s == 0 ? Buf::kSend : Buf::kRecv, base + seg.off(out)),
                           seg.len(out), part.rails));
    ph.comm.push_back(recv(prev, tmp, seg.len(in)));
    ph.compute.push_back(reduce(at(Buf::kRecv, base + seg.off(in)),
                                at(Buf::kSend, base + seg.off(in)), tmp, seg.len(in)));
    if (part.average && s + 2 == p)
      ph.compute.push_back(avg(at(Buf::kRecv, base + seg.off(in)), seg.len(in)));
    plan.phases.push_back(std::move(ph));
  }
  // All-gather of the reduced segments: this rank owns segment r+1.
  for (int s = 0; s + 1 < p; ++s) {
    Phase ph;
    ph.lane = part.lane;
    const int out = mod(r + 1 - s, p), in = mod(r - s, p);
    ph.comm.push_back(send(next, at(Buf::kRecv, base + seg.off(out)), seg.len(out), part.rails));
    ph.comm.push_back(recv(prev, at(Buf::kRecv, base + seg.off(in)), seg.len(in)));
    plan.phases.push_back(std::move(ph));
  }
}

}  // namespace plan_steps

std::string_view coll_op_name(CollOp op) {
  switch (op) {
    case CollOp::kAllReduce:
      return "allreduce";
    case CollOp::kAllGather:
      return "allgather";
    case CollOp::kReduceScatter:
      return "reducescatter";
    case CollOp::kBroadcast:
      return "broadcast";
    case CollOp::kReduce:
      return "reduce";
    case CollOp::kBarrier:
      return "barrier";
  }
  return "?";
}

std::string_view algo_name(Algo a) {
  switch (a) {
    case Algo::kAuto:
      return "auto";
    case Algo::kRing:
      return "ring";
    case Algo::kOneShot:
      return "oneshot";
    case Algo::kTwoShot:
      return "twoshot";
    case Algo::kBalance:
      return "balance";
    case Algo::kR2cc:
      return "r2cc";
    case Algo::kWeighted:
      return "weighted";
  }
  return "?";
}

bool is_degraded_algo(Algo a) {
  return a == Algo::kBalance || a == Algo::kR2cc || a == Algo::kWeighted;
}

Result<Algo> parse_algo(std::string_view text) {
  for (Algo a : {Algo::kAuto, Algo::kRing, Algo::kOneShot, Algo::kTwoShot, Algo::kBalance,
                 Algo::kR2cc, Algo::kWeighted})
    if (algo_name(a) == text) return a;
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("unknown algorithm '{}': expected auto, ring, oneshot, twoshot, "
                            "balance, r2cc or weighted",
                            text));
}

std::size_t send_bytes(const CollDesc& d, int p) {
  const std::size_t n = d.count * type_size(d.type);
  return d.op == CollOp::kReduceScatter ? n * static_cast<std::size_t>(p) : n;
}

std::size_t recv_bytes(const CollDesc& d, int p) {
  const std::size_t n = d.count * type_size(d.type);
  return d.op == CollOp::kAllGather ? n * static_cast<std::size_t>(p) : n;
}

Algo choose_algo(const CollDesc& d, int nranks, Algo requested, std::size_t eager_bytes) {
  if (d.op == CollOp::kBarrier) return Algo::kOneShot;
  if (requested != Algo::kAuto) {
    // The degraded-mode plans are all-reduces; for the other operations Balance is the ring.
    if (is_degraded_algo(requested) && d.op != CollOp::kAllReduce)
      return nranks <= 1 ? Algo::kOneShot : Algo::kRing;
    // Two-shot is an all-reduce algorithm; elsewhere it means "direct" like one-shot.
    if (requested == Algo::kTwoShot && d.op != CollOp::kAllReduce) return Algo::kOneShot;
    return requested;
  }
  if (nranks <= 1) return Algo::kOneShot;
  const std::size_t n = send_bytes(d, nranks);
  if (n <= kDirectThreshold) return Algo::kOneShot;
  // Two ranks: one-shot and the ring move the same bytes (each rank sends n), the ring in two
  // rounds of n/2. A round costs a message's latency, and a message above the eager limit a
  // handshake more (its clear-to-send): one-shot wins where it takes fewer of them. Measured on
  // loopback (one rail, 64 KiB eager), one-shot against the ring: 64 KiB 0.6x the time (1 round
  // against 2), 128 KiB 1.3x (2 against 2: the ring's eager halves win), 256 KiB 0.6-0.8x (2
  // against 4); on the testbed (four rails, 8 KiB eager) 32-256 KiB 0.95x, 1 MiB 0.7-0.95x.
  if (nranks == 2 && d.op == CollOp::kAllReduce && eager_bytes > 0 && n <= kTwoRankDirectMax) {
    const auto cost = [&](std::size_t message, int rounds) {
      return rounds * (message > eager_bytes ? 2 : 1);
    };
    if (cost(n, 1) < cost((n + 1) / 2, 2)) return Algo::kOneShot;
  }
  return Algo::kRing;
}

Result<Plan> make_plan(const CollDesc& d, int r, int p, Algo algo, const Network* net) {
  if (p < 1 || r < 0 || r >= p)
    return Status(ErrorCode::kInvalidArgument, fmt::format("rank {} of {} ranks", r, p));
  if (d.op == CollOp::kBarrier) return barrier(r, p);
  const std::size_t elem = type_size(d.type);
  if (elem == 0) return Status(ErrorCode::kInvalidArgument, "unsupported data type");
  algo = choose_algo(d, p, algo);
  const bool ring = algo == Algo::kRing;
  Plan plan;
  switch (d.op) {
    case CollOp::kAllReduce:
      if (p == 1)
        plan = allreduce_oneshot(d, r, p, elem);
      else if (algo == Algo::kR2cc || algo == Algo::kWeighted)
        plan = degraded_allreduce(d, r, p, elem, algo, net);
      else if (algo == Algo::kRing || algo == Algo::kBalance)
        plan = allreduce_ring(d, r, p, elem);
      else if (algo == Algo::kTwoShot)
        plan = allreduce_twoshot(d, r, p, elem);
      else
        plan = allreduce_oneshot(d, r, p, elem);
      break;
    case CollOp::kAllGather:
      plan = allgather(d, r, p, elem, ring);
      break;
    case CollOp::kReduceScatter:
      plan = reducescatter(d, r, p, elem, ring);
      break;
    case CollOp::kBroadcast:
      plan = broadcast(d, r, p, elem, ring);
      break;
    case CollOp::kReduce:
      plan = reduce_to_root(d, r, p, elem, ring);
      break;
    case CollOp::kBarrier:
      break;
  }
  plan.algo = algo;
  return plan;
}

}  // namespace r2ccl::coll

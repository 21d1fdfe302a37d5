// The degraded-mode all-reduce plans (R2CC-AllReduce, weighted) and their cost model.
#include "r2ccl/coll/degraded.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include "plan_steps.h"

namespace r2ccl::coll {
namespace {

using namespace plan_steps;

constexpr int kMaxChunks = 64;

std::vector<double> rates_of(const Network* net, int p) {
  std::vector<double> b(static_cast<std::size_t>(p), 1.0);
  if (net && net->bandwidth.size() == static_cast<std::size_t>(p))
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = std::isfinite(net->bandwidth[i]) && net->bandwidth[i] > 0 ? net->bandwidth[i] : 1e-9;
  return b;
}

// Splits n elements by `frac` (largest remainders get the leftover elements, lower index first on
// ties): the same on every rank, which computes it from the same numbers.
std::vector<std::size_t> split(std::size_t n, const std::vector<double>& frac) {
  const std::size_t p = frac.size();
  std::vector<std::size_t> out(p);
  std::vector<std::pair<double, std::size_t>> rest;
  std::size_t used = 0;
  for (std::size_t i = 0; i < p; ++i) {
    const double want = frac[i] * static_cast<double>(n);
    out[i] = std::min(n - used, static_cast<std::size_t>(std::floor(want)));
    used += out[i];
    rest.emplace_back(want - static_cast<double>(out[i]), i);
  }
  std::stable_sort(rest.begin(), rest.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (std::size_t k = 0; used < n; k = (k + 1) % p, ++used)
    ++out[rest[k].second];
  return out;
}

// Chunk k of C over `count` elements: [first(k), first(k+1)).
std::size_t chunk_first(std::size_t count, int chunks, int k) {
  return count / static_cast<std::size_t>(chunks) * static_cast<std::size_t>(k) +
         std::min(count % static_cast<std::size_t>(chunks), static_cast<std::size_t>(k));
}

int chunks_for(double transfer_s, double latency_s, std::size_t max_chunks) {
  double c = latency_s > 0 ? std::sqrt(transfer_s / latency_s) : kMaxChunks;
  c = std::clamp(std::round(c), 1.0, static_cast<double>(kMaxChunks));
  return static_cast<int>(
      std::min<std::size_t>(static_cast<std::size_t>(c), std::max<std::size_t>(max_chunks, 1)));
}

// A pipeline no deeper than it pays for: every chunk is a round of messages among all the ranks
// (p^2 of them for the weighted plan), so the fewest chunks (of 1, 2, 4, ...) whose predicted
// time is within `slack` of the deepest pipeline's (`most`) is taken. `seconds(c)`: the
// predicted time with c chunks.
template <class Seconds>
int fewest_chunks(int most, double slack, Seconds seconds) {
  if (most <= 1) return most;
  const double best = seconds(most);
  for (int c = 1; c < most; c *= 2)
    if (seconds(c) <= best * (1 + slack)) return c;
  return most;
}
constexpr double kWeightedSlack = 0.01;
// R2CC-AllReduce keeps to R²CCL's model (whose exchange is pipelined without end) within 0.3%.
constexpr double kR2ccSlack = 0.003;

// The weighted plan's time with `chunks` equal chunks, each rank's shard of a chunk its share of
// it (the plan's rounding to whole elements left out): a step of the reduce-scatter alone, then
// chunks - 1 steps of a reduce-scatter beside an all-gather, then an all-gather alone.
double weighted_seconds(const std::vector<double>& b, const std::vector<double>& shares,
                        double bytes, double latency_s, int chunks) {
  const std::size_t p = b.size();
  double rs = 0, both = 0, ag = 0;
  for (std::size_t i = 0; i < p; ++i) {
    const double mine = shares[i] * bytes;  // per unit of data (one chunk = bytes / chunks)
    const double rs_out = bytes - mine, rs_in = static_cast<double>(p - 1) * mine;
    const double ag_out = static_cast<double>(p - 1) * mine, ag_in = bytes - mine;
    rs = std::max(rs, std::max(rs_out, rs_in) / b[i]);
    ag = std::max(ag, std::max(ag_out, ag_in) / b[i]);
    both = std::max(both, std::max(rs_out + ag_out, rs_in + ag_in) / b[i]);
  }
  const double c = chunks;
  return (c + 1) * latency_s + (rs + (c - 1) * both + ag) / c;
}

// ---- weighted: shard offsets of every chunk

struct WeightedLayout {
  int chunks = 1;
  std::vector<std::vector<std::size_t>> first;  // [chunk][rank], elements from the buffer start
  std::size_t len(int k, int i) const {
    return first[static_cast<std::size_t>(k)][static_cast<std::size_t>(i) + 1] -
           first[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)];
  }
  std::size_t at(int k, int i) const {
    return first[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)];
  }
};

WeightedLayout weighted_layout(const CollDesc& d, const std::vector<double>& b, int chunks) {
  const auto shares = weighted_shares(b);
  WeightedLayout w;
  w.chunks = chunks;
  for (int k = 0; k < chunks; ++k) {
    const std::size_t base = chunk_first(d.count, chunks, k);
    const auto counts = split(chunk_first(d.count, chunks, k + 1) - base, shares);
    std::vector<std::size_t> f(counts.size() + 1, base);
    for (std::size_t i = 0; i < counts.size(); ++i)
      f[i + 1] = f[i] + counts[i];
    w.first.push_back(std::move(f));
  }
  return w;
}

Plan weighted_plan(const CollDesc& d, int r, int p, std::size_t elem, const Network* net) {
  const auto b = rates_of(net, p);
  const Network n{b, net ? net->latency_s : 0, {}};
  const WeightedLayout w = weighted_layout(d, b, weighted_chunks(d, n));
  const int C = w.chunks;
  std::size_t slot = 0;
  for (int k = 0; k < C; ++k)
    slot = std::max(slot, w.len(k, r) * elem);
  Plan plan;
  plan.scratch_bytes = slot * static_cast<std::size_t>(p);
  const bool average = d.redop == RedOp::kAvg;
  for (int k = 0; k <= C; ++k) {
    Phase ph;
    if (k < C) {  // reduce-scatter of chunk k: every rank's piece of this rank's shard comes here
      const std::size_t mine = w.len(k, r) * elem;
      for (int i = 1; i < p; ++i) {
        const int from = mod(r - i, p);
        ph.comm.push_back(
            recv(from, at(Buf::kScratch, slot * static_cast<std::size_t>(from)), mine));
      }
      for (int i = 1; i < p; ++i) {
        const int to = mod(r + i, p);
        ph.comm.push_back(send(to, at(Buf::kSend, w.at(k, to) * elem), w.len(k, to) * elem));
      }
      const Ref own = at(Buf::kSend, w.at(k, r) * elem);
      const Ref own_slot = at(Buf::kScratch, slot * static_cast<std::size_t>(r));
      if (d.in_place) ph.compute.push_back(copy(own_slot, own, mine));
      chain(
          ph.compute, p, at(Buf::kRecv, w.at(k, r) * elem), mine,
          [&](int i) {
            return i == r ? (d.in_place ? own_slot : own)
                          : at(Buf::kScratch, slot * static_cast<std::size_t>(i));
          },
          average);
    }
    if (k > 0) {  // all-gather of chunk k-1
      for (int i = 1; i < p; ++i) {
        const int from = mod(r - i, p);
        ph.comm.push_back(
            recv(from, at(Buf::kRecv, w.at(k - 1, from) * elem), w.len(k - 1, from) * elem));
      }
      for (int i = 1; i < p; ++i)
        ph.comm.push_back(
            send(mod(r + i, p), at(Buf::kRecv, w.at(k - 1, r) * elem), w.len(k - 1, r) * elem));
    }
    plan.phases.push_back(std::move(ph));
  }
  return plan;
}

// ---- R2CC-AllReduce

struct R2ccLayout {
  int degraded = -1;         // -1: no rank is slower than the others (plain ring)
  std::vector<int> healthy;  // ascending
  double beta = 1;           // the degraded rank's bandwidth over the slowest healthy rank's
  std::size_t main = 0;      // elements [0, main) go round the ring of all ranks
  std::size_t tail = 0;      // [main, main + tail) among the healthy ranks
  int chunks = 1;            // the tail's pipelined exchange with the degraded rank
  double b_degraded = 1, b_healthy = 1;
  // The main ring's rails and the tail ring's: the rails the degraded rank still has, and those
  // it lost (idle on the healthy ranks otherwise). All rails for both where that is not known or
  // it lost none (it is slow on all of them).
  std::uint64_t shared = Step::kAllRails, spare = Step::kAllRails;
};

R2ccLayout r2cc_layout(const CollDesc& d, const std::vector<double>& b, double latency_s,
                       const std::vector<std::uint64_t>& rails_up) {
  R2ccLayout l;
  const int p = static_cast<int>(b.size());
  if (p < 3) return l;
  const int slow = static_cast<int>(std::min_element(b.begin(), b.end()) - b.begin());
  double bh = std::numeric_limits<double>::infinity();
  for (int i = 0; i < p; ++i)
    if (i != slow) bh = std::min(bh, b[static_cast<std::size_t>(i)]);
  const double beta = b[static_cast<std::size_t>(slow)] / bh;
  if (!(beta < 1)) return l;
  // Align the tail to 16 bytes' worth of elements, like R²CCL's.
  const std::size_t elem = type_size(d.type);
  const std::size_t align = std::max<std::size_t>(1, 16 / std::max<std::size_t>(elem, 1));
  std::size_t tail =
      static_cast<std::size_t>(std::llround((1 - beta) * static_cast<double>(d.count)));
  tail -= tail % align;
  if (tail == 0 || tail >= d.count) return l;
  l.degraded = slow;
  for (int i = 0; i < p; ++i)
    if (i != slow) l.healthy.push_back(i);
  l.beta = beta;
  l.main = d.count - tail;
  l.tail = tail;
  l.b_degraded = b[static_cast<std::size_t>(slow)];
  l.b_healthy = bh;
  // The exchange's pipeline: deep enough that its fill costs at most kR2ccSlack of the whole,
  // each of its chunks being a round of h^2 messages among the healthy ranks.
  const double tail_s = static_cast<double>(tail * elem) / l.b_degraded;
  const double rest_s = 2.0 * (p - 1) / p * static_cast<double>(l.main * elem) / l.b_degraded;
  l.chunks =
      fewest_chunks(chunks_for(tail_s, latency_s, tail / static_cast<std::size_t>(p - 1)),
                    kR2ccSlack, [&](int k) { return rest_s + (k + 1) * (latency_s + tail_s / k); });
  if (rails_up.size() == b.size()) {
    std::uint64_t healthy = Step::kAllRails;
    for (int i : l.healthy)
      healthy &= rails_up[static_cast<std::size_t>(i)];
    const std::uint64_t kept = rails_up[static_cast<std::size_t>(slow)];
    if ((healthy & ~kept) != 0 && (healthy & kept) != 0) {
      l.shared = healthy & kept;
      l.spare = healthy & ~kept;
    }
  }
  return l;
}

// Predicted step times of the three parts (seconds), shared by the plan (to order its lanes'
// phases) and the cost model.
struct R2ccTimes {
  double main_step, tail_step, exchange_step;
  int main_steps, tail_steps, exchange_steps;
};

R2ccTimes r2cc_times(const R2ccLayout& l, std::size_t elem, int p, double latency_s) {
  R2ccTimes t{};
  const double main_seg = static_cast<double>(Segments{l.main, elem, p}.max_len());
  const double tail_seg = static_cast<double>(Segments{l.tail, elem, p - 1}.max_len());
  // The main ring runs at the degraded rank's pace; the healthy ranks' ring of the tail gets what
  // that leaves of their bandwidth.
  const double left = std::max(l.b_healthy - l.b_degraded, l.b_healthy * 1e-6);
  t.main_step = latency_s + main_seg / l.b_degraded;
  t.tail_step = latency_s + tail_seg / left;
  const double piece = static_cast<double>(l.tail * elem) / l.chunks;
  t.exchange_step = latency_s + piece / l.b_degraded;
  t.main_steps = 2 * (p - 1);
  t.tail_steps = 2 * (p - 2);
  t.exchange_steps = l.chunks + 1;
  return t;
}

struct Timed {
  double start;
  Phase phase;
};

Plan r2cc_plan(const CollDesc& d, int r, int p, std::size_t elem, const Network* net) {
  const auto b = rates_of(net, p);
  const double latency = net ? net->latency_s : 0;
  const R2ccLayout l =
      r2cc_layout(d, b, latency, net ? net->rails_up : std::vector<std::uint64_t>{});
  std::vector<int> all(static_cast<std::size_t>(p));
  std::iota(all.begin(), all.end(), 0);
  const bool average = d.redop == RedOp::kAvg;
  Plan plan;
  if (l.degraded < 0) {  // nobody is slower: the ring
    plan.scratch_bytes = ring_scratch(d.count, elem, p);
    ring_allreduce(plan, elem, {all, r, 0, d.count, 0, 0, average, Step::kAllRails});
    return plan;
  }
  const R2ccTimes t = r2cc_times(l, elem, p, latency);
  const int h = p - 1;
  // Scratch: the main ring's, then the healthy ring's, then one piece of the tail exchange.
  const std::size_t s0 = ring_scratch(l.main, elem, p);
  const std::size_t s1 = s0 + ring_scratch(l.tail, elem, h);
  std::size_t piece_max = 0;
  auto piece = [&](int k, int j) {  // chunk k's piece j of the tail, elements from buffer start
    const std::size_t c0 = chunk_first(l.tail, l.chunks, k);
    Segments s{chunk_first(l.tail, l.chunks, k + 1) - c0, elem, h};
    return std::pair{(l.main + c0) * elem + s.off(j), s.len(j)};
  };
  for (int k = 0; k < l.chunks; ++k)
    piece_max = std::max(piece_max, piece(k, 0).second);
  plan.scratch_bytes = s1 + piece_max;
  plan.lanes = 2;

  std::vector<Timed> phases;
  auto take = [&](Plan& part, double start, double step) {
    for (std::size_t i = 0; i < part.phases.size(); ++i)
      phases.push_back({start + step * static_cast<double>(i), std::move(part.phases[i])});
  };
  // Lane 0: the main part round the ring of all ranks.
  Plan main_ring;
  ring_allreduce(main_ring, elem, {all, r, 0, l.main, 0, 0, average, l.shared});
  take(main_ring, 0, t.main_step);
  const double main_end = t.main_step * t.main_steps;
  const double tail_end = t.tail_step * t.tail_steps;
  const double exchange_start = std::max(main_end, tail_end);
  if (r == l.degraded) {
    // After its ring: its tail to the healthy ranks, a piece to each, chunk by chunk; the sums
    // come back a chunk later.
    for (int k = 0; k <= l.chunks; ++k) {
      Phase ph;
      ph.lane = 0;
      if (k < l.chunks)
        for (int j = 0; j < h; ++j) {
          auto [off, len] = piece(k, j);
          ph.comm.push_back(send(l.healthy[static_cast<std::size_t>(j)], at(Buf::kSend, off), len));
        }
      if (k > 0)
        for (int j = 0; j < h; ++j) {
          auto [off, len] = piece(k - 1, j);
          ph.comm.push_back(recv(l.healthy[static_cast<std::size_t>(j)], at(Buf::kRecv, off), len));
        }
      phases.push_back({main_end + t.exchange_step * k, std::move(ph)});
    }
  } else {
    // Lane 1: the tail round the healthy ranks' ring, the other way round from the main ring (so
    // that the two rings share no link direction where p > 3).
    std::vector<int> ring(l.healthy.rbegin(), l.healthy.rend());
    const int me = static_cast<int>(std::find(ring.begin(), ring.end(), r) - ring.begin());
    const int mine =
        static_cast<int>(std::find(l.healthy.begin(), l.healthy.end(), r) - l.healthy.begin());
    Plan tail_ring;
    ring_allreduce(tail_ring, elem, {ring, me, l.main, l.tail, 1, s0, false, l.spare});
    take(tail_ring, 0, t.tail_step);
    // Then: the degraded rank's piece of each chunk is added to this rank's piece of the healthy
    // sum, and the result goes back to it and to every other healthy rank.
    const Ref arrived = at(Buf::kScratch, s1);
    for (int k = 0; k <= l.chunks; ++k) {
      Phase ph;
      ph.lane = 1;
      if (k < l.chunks) {
        auto [off, len] = piece(k, mine);
        ph.comm.push_back(recv(l.degraded, arrived, len));
        ph.compute.push_back(reduce(at(Buf::kRecv, off), at(Buf::kRecv, off), arrived, len));
        if (average) ph.compute.push_back(avg(at(Buf::kRecv, off), len));
      }
      if (k > 0) {
        for (int j = 0; j < h; ++j) {
          if (j == mine) continue;
          auto [off, len] = piece(k - 1, j);
          ph.comm.push_back(recv(l.healthy[static_cast<std::size_t>(j)], at(Buf::kRecv, off), len));
        }
        auto [off, len] = piece(k - 1, mine);
        ph.comm.push_back(send(l.degraded, at(Buf::kRecv, off), len));
        for (int j = 0; j < h; ++j)
          if (j != mine)
            ph.comm.push_back(
                send(l.healthy[static_cast<std::size_t>(j)], at(Buf::kRecv, off), len));
      }
      phases.push_back({exchange_start + t.exchange_step * k, std::move(ph)});
    }
  }
  // Plan order follows the predicted start times, the same on every rank: messages between a
  // pair in different lanes are then posted in the order both sides expect.
  std::stable_sort(phases.begin(), phases.end(), [](const Timed& x, const Timed& y) {
    return x.start < y.start || (x.start == y.start && x.phase.lane < y.phase.lane);
  });
  for (auto& ph : phases)
    plan.phases.push_back(std::move(ph.phase));
  return plan;
}

}  // namespace

namespace plan_steps {

Plan degraded_allreduce(const CollDesc& d, int r, int p, std::size_t elem, Algo algo,
                        const Network* net) {
  return algo == Algo::kWeighted ? weighted_plan(d, r, p, elem, net)
                                 : r2cc_plan(d, r, p, elem, net);
}

}  // namespace plan_steps

bool is_degraded(const Network& net) {
  if (net.bandwidth.size() < 2) return false;
  const auto [lo, hi] = std::minmax_element(net.bandwidth.begin(), net.bandwidth.end());
  return *lo < kDegradedBelow * *hi;
}

std::vector<double> weighted_shares(const std::vector<double>& bandwidth) {
  const std::size_t p = bandwidth.size();
  std::vector<double> s(p, 0);
  if (p == 0) return s;
  const double total = std::accumulate(bandwidth.begin(), bandwidth.end(), 0.0);
  if (p <= 2 || !(total > 0)) {
    for (std::size_t i = 0; i < p; ++i)
      s[i] = total > 0 ? bandwidth[i] / total : 1.0 / static_cast<double>(p);
    return s;
  }
  // Rank i moves (1 + (p-2) s_i) N each way; make that c * b_i for the owners H, with the s_i
  // summing to 1: c = (p - 2 + |H|) / sum_H b. A rank whose s_i would be negative owns nothing
  // (it still sends its N and receives the result).
  std::vector<bool> owns(p, true);
  for (std::size_t round = 0; round < p; ++round) {
    double sum = 0;
    std::size_t m = 0;
    for (std::size_t i = 0; i < p; ++i)
      if (owns[i]) sum += bandwidth[i], ++m;
    const double c = (static_cast<double>(p) - 2 + static_cast<double>(m)) / sum;
    bool changed = false;
    for (std::size_t i = 0; i < p; ++i) {
      s[i] = owns[i] ? (c * bandwidth[i] - 1) / (static_cast<double>(p) - 2) : 0;
      if (owns[i] && s[i] < 0) owns[i] = false, changed = true;
    }
    if (!changed) break;
  }
  for (auto& x : s)
    x = std::max(x, 0.0);
  const double sum = std::accumulate(s.begin(), s.end(), 0.0);
  for (auto& x : s)
    x /= sum;
  return s;
}

std::vector<double> settle_bandwidths(const std::vector<double>& measured,
                                      const std::vector<std::uint64_t>& rails) {
  std::vector<double> per_rail;
  for (std::size_t i = 0; i < measured.size(); ++i) {
    const int n = std::popcount(rails[i]);
    per_rail.push_back(n > 0 ? measured[i] / n : 0);
  }
  std::vector<double> sorted = per_rail;
  std::sort(sorted.begin(), sorted.end());
  // The lower median: with an even count, the slower of the middle two, so that ranks measured
  // fast cannot make the rest look slow.
  const double median = sorted.empty() ? 0 : sorted[(sorted.size() - 1) / 2];
  std::vector<double> out;
  double fastest = 0;
  for (std::size_t i = 0; i < measured.size(); ++i) {
    double r = per_rail[i];
    // Faster than the median counts as the median: a rank measured fast (its probe ran while
    // the others' met something passing) must not make every other rank look slow.
    if (median > 0 && (std::abs(r / median - 1) <= 0.3 || r > median)) r = median;
    out.push_back(r * std::popcount(rails[i]));
    fastest = std::max(fastest, out.back());
  }
  for (auto& b : out) {
    const double r = fastest > 0 ? b / fastest : 1;
    b = r >= 0.9 ? fastest : fastest * std::max(1.0, std::round(r * 32)) / 32;
  }
  return out;
}

double lower_bound_seconds(const CollDesc& d, const Network& net) {
  const auto& b = net.bandwidth;
  if (b.size() < 2) return 0;
  const double n = static_cast<double>(d.count * type_size(d.type));
  const double p = static_cast<double>(b.size());
  const double lo = *std::min_element(b.begin(), b.end());
  const double sum = std::accumulate(b.begin(), b.end(), 0.0);
  return std::max(n / lo, 2 * (p - 1) * n / sum);
}

int weighted_chunks(const CollDesc& d, const Network& net) {
  const int p = static_cast<int>(net.bandwidth.size());
  const int most = chunks_for(lower_bound_seconds(d, net), net.latency_s,
                              d.count / static_cast<std::size_t>(std::max(p, 1)));
  if (p < 2 || most <= 1) return most;
  const auto b = rates_of(&net, p);
  const auto shares = weighted_shares(b);
  const double bytes = static_cast<double>(d.count * type_size(d.type));
  return fewest_chunks(most, kWeightedSlack,
                       [&](int c) { return weighted_seconds(b, shares, bytes, net.latency_s, c); });
}

int r2cc_chunks(const CollDesc& d, const Network& net) {
  return r2cc_layout(d, rates_of(&net, static_cast<int>(net.bandwidth.size())), net.latency_s,
                     net.rails_up)
      .chunks;
}

double predict_seconds(Algo algo, const CollDesc& d, const Network& net) {
  const int p = static_cast<int>(net.bandwidth.size());
  if (p < 2) return 0;
  const std::size_t elem = type_size(d.type);
  const auto b = rates_of(&net, p);
  const double lo = *std::min_element(b.begin(), b.end());
  const double ring =
      2.0 * (p - 1) *
      (net.latency_s + static_cast<double>(Segments{d.count, elem, p}.max_len()) / lo);
  switch (algo) {
    case Algo::kR2cc: {
      const R2ccLayout l = r2cc_layout(d, b, net.latency_s, net.rails_up);
      if (l.degraded < 0) return ring;
      const R2ccTimes t = r2cc_times(l, elem, p, net.latency_s);
      return std::max(t.main_step * t.main_steps, t.tail_step * t.tail_steps) +
             t.exchange_step * t.exchange_steps;
    }
    case Algo::kWeighted: {
      const WeightedLayout w = weighted_layout(d, b, weighted_chunks(d, net));
      double total = 0;
      for (int k = 0; k <= w.chunks; ++k) {
        double step = 0;
        for (int i = 0; i < p; ++i) {
          double out = 0, in = 0;
          if (k < w.chunks) {
            const double chunk = static_cast<double>(w.at(k, p) - w.at(k, 0));
            out += chunk - static_cast<double>(w.len(k, i));
            in += static_cast<double>(p - 1) * static_cast<double>(w.len(k, i));
          }
          if (k > 0) {
            const double chunk = static_cast<double>(w.at(k - 1, p) - w.at(k - 1, 0));
            out += static_cast<double>(p - 1) * static_cast<double>(w.len(k - 1, i));
            in += chunk - static_cast<double>(w.len(k - 1, i));
          }
          step = std::max(
              step, std::max(out, in) * static_cast<double>(elem) / b[static_cast<std::size_t>(i)]);
        }
        total += net.latency_s + step;
      }
      return total;
    }
    default:
      return ring;
  }
}

Algo choose_degraded(const CollDesc& d, const Network& net) {
  Algo best = Algo::kBalance;
  double best_s = predict_seconds(Algo::kBalance, d, net);
  for (Algo a : {Algo::kR2cc, Algo::kWeighted}) {
    const double s = predict_seconds(a, d, net);
    if (s < best_s) best = a, best_s = s;
  }
  return best;
}

}  // namespace r2ccl::coll

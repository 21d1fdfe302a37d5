// The degraded-mode all-reduce plans (R2CC-AllReduce, weighted) and their cost model.
#include "r2ccl/coll/degraded.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/format.h>

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

// ---- weighted at scale: a grid of the full-speed ranks, the slow ones beside it

// From kWeightedGridFrom ranks, the ranks at full speed (within kDegradedBelow of the fastest)
// form a grid of `rows` rows of `m` (the last row may be shorter). Every chunk is split into m
// column ranges and each column into `rows` sub-ranges. Four stages per chunk, a phase apart:
// (1) a row reduce-scatters the chunk by columns (member c owns column c; in a row of q < m
// members, member c % q owns it), (2) the owners of a column reduce-scatter it into sub-ranges,
// where the slow ranks' pieces are added too, (3) they all-gather the sub-ranges and return each
// to the slow ranks, (4) the row all-gathers its columns. A slow rank owns nothing: it sends its
// data (a piece to each sub-range's owner) and receives the result, N each way, in two lanes.
struct GridLayout {
  std::vector<int> grid, slow;  // ranks, ascending
  int m = 1, rows = 1, chunks = 1;
  std::size_t count = 0;

  int size() const { return static_cast<int>(grid.size()); }
  int row_size(int row) const { return std::min(m, size() - row * m); }
  int member(int row, int j) const { return grid[static_cast<std::size_t>(row * m + j)]; }
  int owner(int row, int c) const { return member(row, c % row_size(row)); }
  // The columns grid member `i` (its index in `grid`) owns, ascending.
  std::vector<int> cols_of(int i) const {
    std::vector<int> out;
    for (int c = i % m; c < m; c += row_size(i / m))
      out.push_back(c);
    return out;
  }
  // Element offsets from the buffer's start.
  std::size_t chunk(int k) const { return chunk_first(count, chunks, k); }
  std::size_t col(int k, int c) const {
    return chunk(k) + Segments{chunk(k + 1) - chunk(k), 1, m}.first(c);
  }
  std::size_t col_len(int k, int c) const { return col(k, c + 1) - col(k, c); }
  std::size_t sub(int k, int c, int r) const {
    return col(k, c) + Segments{col_len(k, c), 1, rows}.first(r);
  }
  std::size_t sub_len(int k, int c, int r) const { return sub(k, c, r + 1) - sub(k, c, r); }
};

GridLayout grid_layout(const CollDesc& d, const std::vector<double>& b, int chunks) {
  GridLayout g;
  g.count = d.count;
  g.chunks = chunks;
  const double top = *std::max_element(b.begin(), b.end());
  for (int i = 0; i < static_cast<int>(b.size()); ++i)
    (b[static_cast<std::size_t>(i)] >= kDegradedBelow * top ? g.grid : g.slow).push_back(i);
  // The shape: the busiest rank's traffic per chunk (full rows: 2(m-1)/m, plus the column's
  // stages; the last row's members may own several columns) within 0.5% of the least any shape
  // gives, and of those the fewest messages per rank.
  const int h = g.size();
  const double slow = static_cast<double>(g.slow.size());
  const auto load = [&](int m) {
    const int rows = (h + m - 1) / m, q = h - (rows - 1) * m;
    const double col = (2.0 * (rows - 1) + slow) / (static_cast<double>(m) * rows);
    const auto member = [&](int o, int in_row) {
      return (static_cast<double>(m - o) + static_cast<double>((in_row - 1) * o)) / m + o * col;
    };
    double most = rows > 1 ? member(1, m) : 0;
    most = std::max(most, member((m + q - 1) / q, q));
    return std::max(most, member(m / q, q));
  };
  double least = std::numeric_limits<double>::infinity();
  for (int m = 1; m <= h; ++m)
    least = std::min(least, load(m));
  int fewest = std::numeric_limits<int>::max();
  for (int m = 1; m <= h; ++m) {
    const int rows = (h + m - 1) / m;
    if (load(m) <= least * 1.005 && m + rows < fewest) fewest = m + rows, g.m = m;
  }
  g.rows = (h + g.m - 1) / g.m;
  return g;
}

// The grid plan's time with `chunks` chunks (rounding to whole elements left out), the healthy
// ranks' phases taken in step.
double grid_seconds(const GridLayout& g, const std::vector<double>& b, double bytes,
                    double latency_s) {
  const double nk = bytes / g.chunks, m = g.m, rows = g.rows;
  const double slow = static_cast<double>(g.slow.size());
  // [rank in grid][stage] bytes out and in, per chunk.
  std::vector<std::array<std::array<double, 2>, 4>> st(g.grid.size());
  for (int i = 0; i < g.size(); ++i) {
    const double o = static_cast<double>(g.cols_of(i).size());
    const double q = g.row_size(i / g.m);
    const double col = nk / m, sub = col / rows;
    st[static_cast<std::size_t>(i)] = {{{nk * (m - o) / m, (q - 1) * o * col},
                                        {o * (rows - 1) * sub, o * (rows - 1 + slow) * sub},
                                        {o * (rows - 1 + slow) * sub, o * (rows - 1) * sub},
                                        {(q - 1) * o * col, nk * (m - o) / m}}};
  }
  // A phase ends once its busiest rank moved its stages, once the slow ranks' pieces of the
  // chunk it reduces came in (they stream them from the start), and once the slowest of them
  // took the results the phase returns to it.
  double slow_s = 0;  // per chunk, the slowest slow rank's
  for (int s : g.slow)
    slow_s = std::max(slow_s, nk / b[static_cast<std::size_t>(s)]);
  // The busiest rank's time for the stages [lo, hi] (a phase's), each pair computed once.
  std::array<std::array<double, 4>, 4> busiest{};
  for (auto& row : busiest)
    row.fill(-1);
  double end = 0;
  for (int j = 0; j < g.chunks + 3; ++j) {
    const int lo = std::max(0, j - g.chunks + 1), hi = std::min(3, j);
    double& step = busiest[static_cast<std::size_t>(lo)][static_cast<std::size_t>(hi)];
    if (step < 0) {
      step = 0;
      for (int i = 0; i < g.size(); ++i) {
        double out = 0, in = 0;
        for (int s = lo; s <= hi; ++s) {
          out += st[static_cast<std::size_t>(i)][static_cast<std::size_t>(s)][0];
          in += st[static_cast<std::size_t>(i)][static_cast<std::size_t>(s)][1];
        }
        step = std::max(step, std::max(out, in) / b[static_cast<std::size_t>(g.grid[i])]);
      }
    }
    end += latency_s + (j >= 2 && j <= g.chunks + 1 ? std::max(step, slow_s) : step);
    if (j >= 1 && j <= g.chunks) end = std::max(end, latency_s + j * slow_s);
  }
  return end;
}

// The deepest pipeline the weighted plans consider for `d` on `net`.
int most_chunks(const CollDesc& d, const Network& net) {
  return chunks_for(lower_bound_seconds(d, net), net.latency_s,
                    d.count / std::max<std::size_t>(net.bandwidth.size(), 1));
}

// The grid for `d` on bandwidths `b` (as rates_of makes them), with its pipeline's depth.
GridLayout planned_grid(const CollDesc& d, const std::vector<double>& b, double latency_s) {
  GridLayout g = grid_layout(d, b, 1);
  const double bytes = static_cast<double>(d.count * type_size(d.type));
  g.chunks = fewest_chunks(most_chunks(d, Network{b, latency_s, {}}), kWeightedSlack, [&](int c) {
    g.chunks = c;
    return grid_seconds(g, b, bytes, latency_s);
  });
  return g;
}

Plan grid_plan(const CollDesc& d, int r, std::size_t elem, const GridLayout& g) {
  Plan plan;
  const int C = g.chunks, S = static_cast<int>(g.slow.size());
  if (std::binary_search(g.slow.begin(), g.slow.end(), r)) {
    plan.lanes = 2;
    for (int k = 0; k < C; ++k) {
      Phase out, in;
      in.lane = 1;
      for (int c = 0; c < g.m; ++c)
        for (int row = 0; row < g.rows; ++row) {
          const std::size_t n = g.sub_len(k, c, row) * elem;
          if (n == 0) continue;
          out.comm.push_back(send(g.owner(row, c), at(Buf::kSend, g.sub(k, c, row) * elem), n));
          in.comm.push_back(recv(g.owner(row, c), at(Buf::kRecv, g.sub(k, c, row) * elem), n));
        }
      plan.phases.push_back(std::move(out));
      plan.phases.push_back(std::move(in));
    }
    return plan;
  }
  const int i =
      static_cast<int>(std::lower_bound(g.grid.begin(), g.grid.end(), r) - g.grid.begin());
  const int row = i / g.m, pos = i % g.m, q = g.row_size(row);
  const std::vector<int> cols = g.cols_of(i);
  const auto nc = static_cast<std::size_t>(cols.size());
  // Scratch: per owned column, a slot per row member (stage 1), then a slot per column peer and
  // slow rank (stage 2).
  std::size_t slot1 = 0, slot2 = 0;
  for (int k = 0; k < C; ++k)
    for (int c : cols) {
      slot1 = std::max(slot1, g.col_len(k, c) * elem);
      slot2 = std::max(slot2, g.sub_len(k, c, row) * elem);
    }
  const std::size_t base2 = nc * static_cast<std::size_t>(q) * slot1;
  const auto per2 = static_cast<std::size_t>(g.rows + S);
  plan.scratch_bytes = base2 + nc * per2 * slot2;
  const auto slot_1 = [&](std::size_t ci, int j) {
    return at(Buf::kScratch,
              (ci * static_cast<std::size_t>(q) + static_cast<std::size_t>(j)) * slot1);
  };
  const auto slot_2 = [&](std::size_t ci, int t) {
    return at(Buf::kScratch, base2 + (ci * per2 + static_cast<std::size_t>(t)) * slot2);
  };
  const bool average = d.redop == RedOp::kAvg;
  for (int j = 0; j < C + 3; ++j) {
    Phase ph;
    std::vector<Step> recvs, sends;
    if (const int k = j; k < C) {  // (1) the row's reduce-scatter by columns
      for (int y = 0; y < q; ++y) {
        if (y == pos) continue;
        for (int c : g.cols_of(row * g.m + y))
          if (const std::size_t n = g.col_len(k, c) * elem; n > 0)
            sends.push_back(send(g.member(row, y), at(Buf::kSend, g.col(k, c) * elem), n));
      }
      for (std::size_t ci = 0; ci < nc; ++ci) {
        const std::size_t n = g.col_len(k, cols[ci]) * elem;
        if (n == 0) continue;
        for (int y = 0; y < q; ++y)
          if (y != pos) recvs.push_back(recv(g.member(row, y), slot_1(ci, y), n));
        const Ref own = at(Buf::kSend, g.col(k, cols[ci]) * elem);
        const Ref dst = at(Buf::kRecv, g.col(k, cols[ci]) * elem);
        if (q == 1) {
          if (!d.in_place) ph.compute.push_back(copy(dst, own, n));
          continue;
        }
        // Own data first, then the others in row order (dst may be own: in place).
        chain(
            ph.compute, q, dst, n,
            [&](int t) { return t == 0 ? own : slot_1(ci, t <= pos ? t - 1 : t); }, false);
      }
    }
    if (const int k = j - 1; k >= 0 && k < C) {  // (2) the column's reduce-scatter
      for (std::size_t ci = 0; ci < nc; ++ci) {
        const int c = cols[ci];
        const std::size_t n = g.sub_len(k, c, row) * elem;
        for (int t = 0; t < g.rows; ++t)
          if (const std::size_t m = g.sub_len(k, c, t) * elem; t != row && m > 0)
            sends.push_back(send(g.owner(t, c), at(Buf::kRecv, g.sub(k, c, t) * elem), m));
        if (n == 0) continue;
        for (int t = 0; t < g.rows; ++t)
          if (t != row) recvs.push_back(recv(g.owner(t, c), slot_2(ci, t), n));
        for (int s = 0; s < S; ++s)
          recvs.push_back(recv(g.slow[static_cast<std::size_t>(s)], slot_2(ci, g.rows + s), n));
        const Ref dst = at(Buf::kRecv, g.sub(k, c, row) * elem);
        // This row's sum first (it lies at dst), then the other rows', then the slow ranks'.
        chain(
            ph.compute, g.rows + S, dst, n,
            [&](int t) {
              if (t == 0) return dst;
              return t <= row ? slot_2(ci, t - 1) : slot_2(ci, t);
            },
            average);
      }
    }
    if (const int k = j - 2; k >= 0 && k < C) {  // (3) the column's all-gather, and the slow ranks
      for (std::size_t ci = 0; ci < nc; ++ci) {
        const int c = cols[ci];
        const std::size_t n = g.sub_len(k, c, row) * elem;
        const Ref mine = at(Buf::kRecv, g.sub(k, c, row) * elem);
        for (int t = 0; t < g.rows; ++t)
          if (const std::size_t m = g.sub_len(k, c, t) * elem; t != row && m > 0)
            recvs.push_back(recv(g.owner(t, c), at(Buf::kRecv, g.sub(k, c, t) * elem), m));
        if (n == 0) continue;
        for (int t = 0; t < g.rows; ++t)
          if (t != row) sends.push_back(send(g.owner(t, c), mine, n));
        for (int s : g.slow)
          sends.push_back(send(s, mine, n));
      }
    }
    if (const int k = j - 3; k >= 0 && k < C) {  // (4) the row's all-gather
      for (int y = 0; y < q; ++y) {
        if (y == pos) continue;
        for (int c : g.cols_of(row * g.m + y))
          if (const std::size_t n = g.col_len(k, c) * elem; n > 0)
            recvs.push_back(recv(g.member(row, y), at(Buf::kRecv, g.col(k, c) * elem), n));
        for (int c : cols)
          if (const std::size_t n = g.col_len(k, c) * elem; n > 0)
            sends.push_back(send(g.member(row, y), at(Buf::kRecv, g.col(k, c) * elem), n));
      }
    }
    ph.comm = std::move(recvs);
    ph.comm.insert(ph.comm.end(), sends.begin(), sends.end());
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
  // From kR2ccGridFrom ranks the healthy ranks share the exchange's sums in two steps, along rows
  // of `m` and then across them, so the exchange takes a step more.
  int m = 0;
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
  const int h = p - 1;
  if (p >= kR2ccGridFrom) l.m = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(h))));
  const int fill = l.m > 0 ? 2 : 1;
  // The exchange's pipeline: deep enough that its fill costs at most kR2ccSlack of the whole,
  // each of its chunks being a round of messages among the healthy ranks.
  const double tail_s = static_cast<double>(tail * elem) / l.b_degraded;
  const double rest_s = 2.0 * (p - 1) / p * static_cast<double>(l.main * elem) / l.b_degraded;
  l.chunks = fewest_chunks(chunks_for(tail_s, latency_s, tail / static_cast<std::size_t>(p - 1)),
                           kR2ccSlack,
                           [&](int k) { return rest_s + (k + fill) * (latency_s + tail_s / k); });
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
  t.exchange_steps = l.chunks + (l.m > 0 ? 2 : 1);
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
    // sum, and the result goes back to it and to every other healthy rank: directly, or (from
    // kR2ccGridFrom ranks) to the others of its row, and a step later the row's pieces (one
    // block) to one rank of each other row, the one at its place in the row (modulo the row's
    // length where rows differ).
    const Ref arrived = at(Buf::kScratch, s1);
    const int m = l.m > 0 ? l.m : h, rows = (h + m - 1) / m;
    const int row = mine / m, place = mine % m;
    const auto row_len = [&](int o) { return std::min(m, h - o * m); };
    const auto block = [&](int k, int o) {  // row o's pieces of chunk k: (offset, bytes)
      const auto first = piece(k, o * m), last = piece(k, o * m + row_len(o) - 1);
      return std::pair{first.first, last.first + last.second - first.first};
    };
    for (int k = 0; k < t.exchange_steps; ++k) {
      Phase ph;
      ph.lane = 1;
      if (k < l.chunks) {
        auto [off, len] = piece(k, mine);
        ph.comm.push_back(recv(l.degraded, arrived, len));
        ph.compute.push_back(reduce(at(Buf::kRecv, off), at(Buf::kRecv, off), arrived, len));
        if (average) ph.compute.push_back(avg(at(Buf::kRecv, off), len));
      }
      if (k > 0 && k <= l.chunks) {  // along the row (every healthy rank's one row without a grid)
        for (int j = row * m; j < row * m + row_len(row); ++j) {
          if (j == mine) continue;
          auto [off, len] = piece(k - 1, j);
          ph.comm.push_back(recv(l.healthy[static_cast<std::size_t>(j)], at(Buf::kRecv, off), len));
        }
        auto [off, len] = piece(k - 1, mine);
        ph.comm.push_back(send(l.degraded, at(Buf::kRecv, off), len));
        for (int j = row * m; j < row * m + row_len(row); ++j)
          if (j != mine)
            ph.comm.push_back(
                send(l.healthy[static_cast<std::size_t>(j)], at(Buf::kRecv, off), len));
      }
      if (k > 1 && k <= l.chunks + 1 && rows > 1) {  // across the rows
        // A full row's block goes to the rank at the same place of every other row; a short
        // last row's ranks send their pieces to every rank of the full rows instead (as many
        // bytes as a full row's rank sends).
        const int full = h / m, last = full * m;
        const auto healthy = [&](int j) { return l.healthy[static_cast<std::size_t>(j)]; };
        for (int o = 0; o < full; ++o)
          if (o != row) {
            auto [off, len] = block(k - 2, o);
            ph.comm.push_back(recv(healthy(o * m + place), at(Buf::kRecv, off), len));
          }
        if (row < full) {
          for (int j = last; j < h; ++j) {
            auto [off, len] = piece(k - 2, j);
            ph.comm.push_back(recv(healthy(j), at(Buf::kRecv, off), len));
          }
          auto [off, len] = block(k - 2, row);
          for (int o = 0; o < full; ++o)
            if (o != row) ph.comm.push_back(send(healthy(o * m + place), at(Buf::kRecv, off), len));
          if (last + place < h)
            ph.comm.push_back(send(healthy(last + place), at(Buf::kRecv, off), len));
        } else {
          auto [off, len] = piece(k - 2, mine);
          for (int j = 0; j < last; ++j)
            ph.comm.push_back(send(healthy(j), at(Buf::kRecv, off), len));
        }
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
  if (algo != Algo::kWeighted) return r2cc_plan(d, r, p, elem, net);
  if (p < kWeightedGridFrom) return weighted_plan(d, r, p, elem, net);
  return grid_plan(d, r, elem, planned_grid(d, rates_of(net, p), net ? net->latency_s : 0));
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
  const int most = most_chunks(d, net);
  if (p < 2 || most <= 1) return most;
  const auto b = rates_of(&net, p);
  if (p >= kWeightedGridFrom) return planned_grid(d, b, net.latency_s).chunks;
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
      if (p >= kWeightedGridFrom)
        return grid_seconds(planned_grid(d, b, net.latency_s), b,
                            static_cast<double>(d.count * elem), net.latency_s);
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

Result<Plan> make_weighted_grid_plan(const CollDesc& d, int rank, int nranks, const Network& net) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return Status(ErrorCode::kInvalidArgument, fmt::format("rank {} of {} ranks", rank, nranks));
  if (d.op != CollOp::kAllReduce)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("the weighted grid is an all-reduce, not {}", coll_op_name(d.op)));
  const std::size_t elem = type_size(d.type);
  if (elem == 0) return Status(ErrorCode::kInvalidArgument, "unsupported data type");
  return grid_plan(d, rank, elem, planned_grid(d, rates_of(&net, nranks), net.latency_s));
}

}  // namespace r2ccl::coll

#include "r2ccl/coll/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <queue>
#include <unordered_map>

namespace r2ccl::coll {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr std::uint32_t kNone = std::numeric_limits<std::uint32_t>::max();

// One rank's plan as the simulator keeps it: flat arrays, a phase being a range of comm steps.
// A message is named by its channel (sender, receiver) and its place among the channel's
// messages, which both ends count alike.
struct CommRef {
  std::uint64_t bytes;
  std::uint64_t rails;
  std::uint32_t chan;
  std::uint32_t ord;
  bool is_send;
};
struct PhaseInfo {
  double compute_bytes = 0;
  std::uint32_t lane = 0;
  std::uint32_t first = 0, count = 0;     // comm steps [first, first + count)
  std::uint32_t firsts = 0, nfirsts = 0;  // (channel end, first ord) entries
  std::uint32_t remaining = 0;            // messages not yet complete
  std::uint32_t next = kNone;             // the next phase of its lane
  bool join = false;
  bool done = false;
};
struct RankState {
  std::vector<PhaseInfo> phases;
  std::vector<CommRef> comm;
  // Per phase, for each channel end it uses: the end and the phase's first ord on it. The phase
  // may be posted once every earlier step on those ends was.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> firsts;
  std::uint32_t lane0 = 0, lanes = 0;  // its lanes in Sim::lanes_
  std::size_t done_prefix = 0;         // phases [0, done_prefix) all complete
  std::size_t lanes_left = 0;
  double finish = 0;
};

// A lane of a rank: the phase it is at (kNone: finished), and whether that phase is posted.
struct LaneState {
  std::uint32_t current = kNone;
  bool busy = false;
};

struct MessageKey {
  std::uint32_t chan, ord;
};
struct Message {
  std::uint64_t send_bytes = 0, recv_bytes = 0, rails = 0;
  std::uint32_t send_phase = 0, recv_phase = 0;
  bool sent = false, received = false, done = false;
};
// A (sender, receiver) pair: the messages from the oldest not yet done on, and the rate-sharing
// units its messages use (one per rail group, then inside a node). The steps each end posted are
// in Sim::posted_.
struct Channel {
  int src = 0, dst = 0;        // simulated ranks
  int turn = 0;                // folded: the receiver is dst's rank `turn` local indices on
  std::uint32_t head_ord = 0;  // the message at pending[head]
  std::size_t head = 0;
  std::vector<Message> pending;
  std::vector<int> units;
};

// A message moving: its bytes left as of `since`. Its rate and the units it moves on are in
// Sim's dense per-flow arrays, which rates() reads for every flow it visits.
struct Flow {
  MessageKey key;
  double left = 0, since = 0;
  std::uint64_t version = 0;
  bool live = false;
};
struct FlowRate {
  double rate = 0;
  std::uint64_t round = 0;  // the last rates() call that set its rate
  std::uint32_t units = 0;  // how many: they are at Sim::flow_units_[flow * unit_stride()]
};
// A (sender, receiver, rail group) channel: one share of its two ports, split equally among the
// messages on it. What rates() reads of it is in Sim's dense per-unit arrays; here are its
// messages and its places in its ports' lists of busy units (while it carries a message).
struct Unit {
  std::vector<int> flows;
  std::uint32_t at_out = 0, at_in = 0;
};
// An entry of a port's list of busy units: the unit and its port at the other end.
struct PortUnit {
  int unit, other;
};

// Flows' finish times: (flow, its version then) grouped by time, the times in a min-heap. The
// flows of a ring's step all finish at one time, so a push is mostly a lookup, and the heap holds
// few times. A time's flows come out ordered by flow id, then version.
class FinishQueue {
 public:
  using Entry = std::pair<int, std::uint64_t>;
  bool empty() const { return times_.empty(); }
  double earliest() const { return times_.top(); }
  void push(double t, int flow, std::uint64_t version) {
    auto [it, fresh] = at_.try_emplace(t);
    if (fresh) times_.push(t);
    it->second.emplace_back(flow, version);
  }
  std::vector<Entry>& earliest_bucket() { return at_.find(times_.top())->second; }
  std::vector<Entry> take_earliest() {
    auto node = at_.extract(times_.top());
    times_.pop();
    std::vector<Entry> out = std::move(node.mapped());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::priority_queue<double, std::vector<double>, std::greater<>> times_;
  std::unordered_map<double, std::vector<Entry>> at_;
};

struct Event {
  double t;
  int kind;  // 0: a message starts moving, 1: a phase's compute ended
  MessageKey key;
  int rank;
  std::uint32_t lane;
  bool operator>(const Event& o) const { return t > o.t; }
};

class Sim {
 public:
  // Plans are added one rank at a time (kept in a compact form of their own), then run().
  // `fold` > 1: simulated rank r stands for the ranks r * fold .. r * fold + fold - 1 of a node,
  // each running r's plan turned by its local index (hierarchical_plans_rotate); r's plan is
  // that of rank r * fold, its peers named as in the whole job, and `net` describes the
  // simulated ranks. The max-min rates of such a job are the same at every rank of a node (they
  // are unique, so they keep its symmetry), so the ranks a simulated one stands for move alike:
  // a message to (node m, local q) is the simulated channel to m turned by q.
  Sim(int ranks, const SimNetwork& net, int fold = 1) : net_(net), p_(ranks), fold_(fold) {
    ranks_.resize(static_cast<std::size_t>(ranks));
  }
  void add(int r, const Plan& plan) { prepare(r, plan); }

  Result<SimResult> run() {
    if (static_cast<int>(net_.rail_bps.size()) != p_)
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("the network describes the rails of {} ranks for {} plans",
                                net_.rail_bps.size(), p_));
    chan_index_ = {};
    group_rails();
    const std::size_t ports = static_cast<std::size_t>(p_) * (groups_.size() + 1) * 2;
    port_units_.resize(ports);
    cap_.assign(ports, 0);
    key_.assign(ports, 0);
    count_.assign(ports, 0);
    port_mark_.assign(ports, 0);
    for (int r = 0; r < p_; ++r)
      R2CCL_RETURN_IF_ERROR(post_ready(r));
    while (!done_now_.empty()) {
      const auto [r, lane] = done_now_.back();
      done_now_.pop_back();
      R2CCL_RETURN_IF_ERROR(phase_done(r, lane));
    }
    while (true) {
      if (!dirty_ports_.empty()) rates();
      drop_stale_finishes();
      const double tf = finishes_.empty() ? kInf : finishes_.earliest();
      const double te = events_.empty() ? kInf : events_.top().t;
      const double t = std::min(tf, te);
      if (t == kInf) break;
      now_ = t;
      const double until = now_ + 1e-12 * std::max(1.0, now_);
      while (!finishes_.empty() && finishes_.earliest() <= until) {
        for (const auto& [f, v] : finishes_.take_earliest()) {
          const Flow& fl = flows_[static_cast<std::size_t>(f)];
          if (fl.live && fl.version == v) finish_flow(f);
        }
      }
      while (true) {
        if (!done_now_.empty()) {
          const auto [r, lane] = done_now_.back();
          done_now_.pop_back();
          R2CCL_RETURN_IF_ERROR(phase_done(r, lane));
        } else if (!events_.empty() && events_.top().t <= until) {
          Event e = events_.top();
          events_.pop();
          if (e.kind == 0) {
            R2CCL_RETURN_IF_ERROR(start_message(e.key));
          } else {
            R2CCL_RETURN_IF_ERROR(phase_done(e.rank, e.lane));
          }
        } else {
          break;
        }
      }
    }
    SimResult out;
    out.finish.resize(ranks_.size());
    for (int r = 0; r < p_; ++r) {
      const auto& rs = ranks_[static_cast<std::size_t>(r)];
      if (rs.lanes_left > 0) {
        for (std::uint32_t l = 0; l < rs.lanes; ++l)
          if (const std::uint32_t at = lanes_[rs.lane0 + l].current; at != kNone)
            return Status(ErrorCode::kInternal,
                          fmt::format("the plans hang: rank {} waits in lane {} at phase {} of {}",
                                      r * fold_, l, at + 1, rs.phases.size()));
      }
      out.finish[static_cast<std::size_t>(r)] = rs.finish;
      out.seconds = std::max(out.seconds, rs.finish);
    }
    if (fold_ > 1) {
      std::vector<double> every;
      every.reserve(out.finish.size() * static_cast<std::size_t>(fold_));
      for (double f : out.finish)
        every.insert(every.end(), static_cast<std::size_t>(fold_), f);
      out.finish = std::move(every);
    }
    out.messages = messages_ * static_cast<std::uint64_t>(fold_);
    out.bytes = bytes_ * fold_;
    out.folded = fold_;
    return out;
  }

 private:
  // The channel from simulated rank src to dst's rank `turn` local indices on.
  std::uint32_t channel(int src, int dst, int turn) {
    const auto key = ((static_cast<std::uint64_t>(src) * static_cast<std::uint64_t>(fold_) +
                       static_cast<std::uint64_t>(turn))
                      << 32) |
                     static_cast<std::uint32_t>(dst);
    auto [it, fresh] = chan_index_.try_emplace(key, static_cast<std::uint32_t>(channels_.size()));
    if (fresh) {
      channels_.emplace_back();
      posted_.insert(posted_.end(), {0, 0});
      channels_.back().src = src;
      channels_.back().dst = dst;
      channels_.back().turn = turn;
    }
    return it->second;
  }
  // A channel's ends as ranks of the whole job (src's first rank and the one it sends to).
  int job_src(const Channel& ch) const { return ch.src * fold_; }
  int job_dst(const Channel& ch) const { return ch.dst * fold_ + ch.turn; }

  void prepare(int r, const Plan& plan) {
    auto& rs = ranks_[static_cast<std::size_t>(r)];
    // Per (peer, direction) of this rank: its channel end, steps so far, last phase seen in + 1.
    std::unordered_map<std::uint64_t, std::uint32_t> pair_index;
    struct End {
      std::uint32_t end, next = 0, seen_in = 0;
    };
    std::vector<End> ends;
    std::vector<std::uint32_t> last, first_of;  // per lane: its last phase so far, its first
    rs.phases.reserve(plan.phases.size());
    for (const auto& ph : plan.phases) {
      PhaseInfo info;
      info.lane = ph.lane;
      info.join = ph.join;
      info.first = static_cast<std::uint32_t>(rs.comm.size());
      info.firsts = static_cast<std::uint32_t>(rs.firsts.size());
      const auto phase_mark = static_cast<std::uint32_t>(rs.phases.size()) + 1;
      for (const auto& s : ph.comm) {
        if (s.bytes == 0) continue;
        const bool is_send = s.kind == Step::Kind::kSend;
        const auto key = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(s.peer)) << 1) |
                         (is_send ? 1 : 0);
        auto [it, fresh] = pair_index.try_emplace(key, static_cast<std::uint32_t>(ends.size()));
        if (fresh) {
          // Peer (m, q) of rank (r, 0): a send goes to m turned by q; a receive comes from the
          // rank (m, 0) stands for whose message lands at (r, -q).
          const int m = s.peer / fold_, q = s.peer % fold_;
          const std::uint32_t chan =
              is_send ? channel(r, m, q) : channel(m, r, (fold_ - q) % fold_);
          ends.push_back({chan * 2 + (is_send ? 1 : 0)});
        }
        End& e = ends[it->second];
        const std::uint32_t ord = e.next++;
        rs.comm.push_back({s.bytes, s.rails, e.end >> 1, ord, is_send});
        ++info.count;
        if (e.seen_in != phase_mark) {
          e.seen_in = phase_mark;
          rs.firsts.emplace_back(e.end, ord);
          ++info.nfirsts;
        }
      }
      for (const auto& s : ph.compute)
        info.compute_bytes += static_cast<double>(s.bytes);
      if (last.size() <= ph.lane) {
        last.resize(ph.lane + 1, kNone);
        first_of.resize(ph.lane + 1, kNone);
      }
      const auto id = static_cast<std::uint32_t>(rs.phases.size());
      if (last[ph.lane] == kNone)
        first_of[ph.lane] = id;
      else
        rs.phases[last[ph.lane]].next = id;
      last[ph.lane] = id;
      rs.phases.push_back(info);
    }
    rs.lane0 = static_cast<std::uint32_t>(lanes_.size());
    rs.lanes = static_cast<std::uint32_t>(last.size());
    for (std::size_t l = 0; l < last.size(); ++l) {
      lanes_.push_back({first_of[l], false});
      rs.lanes_left += lanes_.back().current == kNone ? 0 : 1;
    }
  }

  // The channel's message `ord`, made if neither end posted it yet.
  static Message& message(Channel& c, std::uint32_t ord) {
    const std::size_t i = c.head + (ord - c.head_ord);
    if (i >= c.pending.size()) c.pending.resize(i + 1);
    return c.pending[i];
  }
  static void retire(Channel& c, std::uint32_t ord) {
    c.pending[c.head + (ord - c.head_ord)].done = true;
    while (c.head < c.pending.size() && c.pending[c.head].done) {
      ++c.head;
      ++c.head_ord;
    }
    if (c.head == c.pending.size()) {
      c.pending.clear();
      c.head = 0;
    } else if (c.head >= 16 && 2 * c.head >= c.pending.size()) {
      c.pending.erase(c.pending.begin(), c.pending.begin() + static_cast<std::ptrdiff_t>(c.head));
      c.head = 0;
    }
  }

  // Posts every lane's next phase that may go now (posting one may let another lane go).
  Status post_ready(int r) {
    auto& rs = ranks_[static_cast<std::size_t>(r)];
    for (bool progress = true; progress;) {
      progress = false;
      for (std::uint32_t l = 0; l < rs.lanes; ++l) {
        LaneState& lane = lanes_[rs.lane0 + l];
        if (lane.busy || lane.current == kNone) continue;
        const std::uint32_t id = lane.current;
        PhaseInfo& ph = rs.phases[id];
        if (ph.join && rs.done_prefix < id) continue;
        bool ready = true;
        for (std::uint32_t j = ph.firsts; j < ph.firsts + ph.nfirsts && ready; ++j) {
          const auto [end, ord] = rs.firsts[j];
          ready = posted_[end] == ord;
        }
        if (!ready) continue;
        progress = true;
        lane.busy = true;
        ph.remaining = ph.count;
        for (std::uint32_t j = ph.first; j < ph.first + ph.count; ++j) {
          const CommRef& c = rs.comm[j];
          Channel& ch = channels_[c.chan];
          ++posted_[c.chan * 2 + (c.is_send ? 1 : 0)];
          Message& m = message(ch, c.ord);
          if (c.is_send) {
            m.sent = true, m.send_bytes = c.bytes, m.send_phase = id, m.rails = c.rails;
          } else {
            m.received = true, m.recv_bytes = c.bytes, m.recv_phase = id;
          }
          if (m.sent && m.received) {
            if (m.send_bytes != m.recv_bytes)
              return Status(
                  ErrorCode::kInternal,
                  fmt::format("the plans disagree: message {} from rank {} to {} is {} "
                              "bytes at the sender and {} at the receiver",
                              c.ord + 1, job_src(ch), job_dst(ch), m.send_bytes, m.recv_bytes));
            if (net_.latency_s > 0)
              events_.push({now_ + net_.latency_s, 0, {c.chan, c.ord}, 0, 0});
            else
              R2CCL_RETURN_IF_ERROR(start_message({c.chan, c.ord}));
          }
        }
        if (ph.count == 0) compute_done(r, id);
      }
    }
    return Status::ok();
  }

  void compute_done(int r, std::uint32_t id) {
    const auto& ph = ranks_[static_cast<std::size_t>(r)].phases[id];
    const double t = net_.reduce_bps > 0 ? ph.compute_bytes / net_.reduce_bps : 0;
    if (t > 0)
      events_.push({now_ + t, 1, {}, r, ph.lane});
    else
      done_now_.emplace_back(r, ph.lane);
  }

  Status phase_done(int r, std::uint32_t lane) {
    auto& rs = ranks_[static_cast<std::size_t>(r)];
    LaneState& ls = lanes_[rs.lane0 + lane];
    const std::uint32_t id = ls.current;
    rs.phases[id].done = true;
    while (rs.done_prefix < rs.phases.size() && rs.phases[rs.done_prefix].done)
      ++rs.done_prefix;
    ls.busy = false;
    ls.current = rs.phases[id].next;
    if (ls.current == kNone) {
      rs.finish = std::max(rs.finish, now_);
      --rs.lanes_left;
    }
    return post_ready(r);
  }

  bool same_node(int a, int b) const {
    return !net_.node.empty() &&
           net_.node[static_cast<std::size_t>(a)] == net_.node[static_cast<std::size_t>(b)];
  }

  // A message moves on its node's link, or on some of the rail groups.
  std::size_t unit_stride() const { return std::max<std::size_t>(1, groups_.size()); }
  int* flow_units(int f) { return &flow_units_[static_cast<std::size_t>(f) * unit_stride()]; }

  int new_flow() {
    if (!free_flows_.empty()) {
      const int f = free_flows_.back();
      free_flows_.pop_back();
      return f;
    }
    flows_.emplace_back();
    flow_rate_.emplace_back();
    flow_units_.resize(flows_.size() * unit_stride());
    return static_cast<int>(flows_.size() - 1);
  }

  // The channel's unit on rail group g (groups_.size(): inside the node). Units stay once made
  // (a ring uses the same ones step after step); idle ones take no share.
  int unit_of(Channel& ch, std::size_t g) {
    if (ch.units.empty()) ch.units.assign(groups_.size() + 1, -1);
    int& u = ch.units[g];
    if (u < 0) {
      const int out = port(ch.src, g, false), in = port(ch.dst, g, true);
      units_.emplace_back();
      unit_ports_.push_back({out, in});
      unit_rate_.push_back(0);
      unit_flows_.push_back(0);
      unit_mark_.push_back(0);
      share_.push_back(0);
      u = static_cast<int>(units_.size() - 1);
    }
    return u;
  }

  // A unit joins its ports' busy lists with its first message and leaves them with its last.
  void set_busy(int u, bool busy) {
    Unit& un = units_[static_cast<std::size_t>(u)];
    const auto [out, in] = unit_ports_[static_cast<std::size_t>(u)];
    for (const bool is_in : {false, true}) {
      auto& list = port_units_[static_cast<std::size_t>(is_in ? in : out)];
      std::uint32_t& at = is_in ? un.at_in : un.at_out;
      if (busy) {
        at = static_cast<std::uint32_t>(list.size());
        list.push_back({u, is_in ? out : in});
        continue;
      }
      const PortUnit last = list.back();
      list[at] = last;
      Unit& moved = units_[static_cast<std::size_t>(last.unit)];
      (is_in ? moved.at_in : moved.at_out) = at;
      list.pop_back();
    }
  }

  Status start_message(const MessageKey& key) {
    Channel& ch = channels_[key.chan];
    const Message& m = ch.pending[ch.head + (key.ord - ch.head_ord)];
    ++messages_;
    bytes_ += static_cast<double>(m.send_bytes);
    const int f = new_flow();
    Flow& fl = flows_[static_cast<std::size_t>(f)];
    fl.key = key;
    fl.left = static_cast<double>(m.send_bytes);
    fl.since = now_;
    fl.live = true;
    ++fl.version;
    int* const units = flow_units(f);
    std::uint32_t n = 0;
    if (same_node(ch.src, ch.dst) && net_.intra_bps > 0) {
      units[n++] = unit_of(ch, groups_.size());
    } else {
      for (bool any : {false, true}) {
        for (std::size_t g = 0; g < groups_.size(); ++g)
          if ((any || (groups_[g].rails & m.rails) != 0) && group_cap(ch.src, g) > 0 &&
              group_cap(ch.dst, g) > 0)
            units[n++] = unit_of(ch, g);
        if (n > 0) break;
      }
      if (n == 0)
        return Status(
            ErrorCode::kInvalidArgument,
            fmt::format("no rail is up at both rank {} and rank {}", job_src(ch), job_dst(ch)));
    }
    flow_rate_[static_cast<std::size_t>(f)].rate = 0;
    flow_rate_[static_cast<std::size_t>(f)].units = n;
    for (std::uint32_t i = 0; i < n; ++i) {
      const auto u = static_cast<std::size_t>(units[i]);
      units_[u].flows.push_back(f);
      unit_mark_[u] |= kTouched;
      if (++unit_flows_[u] == 1) set_busy(units[i], true);
      touch(unit_ports_[u][0]);
    }
    return Status::ok();
  }

  void finish_flow(int f) {
    Flow& fl = flows_[static_cast<std::size_t>(f)];
    fl.live = false;
    const int* const units = flow_units(f);
    for (std::uint32_t i = 0; i < flow_rate_[static_cast<std::size_t>(f)].units; ++i) {
      const auto u = static_cast<std::size_t>(units[i]);
      std::erase(units_[u].flows, f);
      unit_mark_[u] |= kTouched;
      if (--unit_flows_[u] == 0) set_busy(units[i], false);
      touch(unit_ports_[u][0]);
      touch(unit_ports_[u][1]);
    }
    flow_rate_[static_cast<std::size_t>(f)].rate = 0;  // a free flow has no units and no rate
    flow_rate_[static_cast<std::size_t>(f)].units = 0;
    free_flows_.push_back(f);
    const MessageKey key = fl.key;
    Channel& ch = channels_[key.chan];
    const Message& m = ch.pending[ch.head + (key.ord - ch.head_ord)];
    const std::uint32_t send_phase = m.send_phase, recv_phase = m.recv_phase;
    retire(ch, key.ord);
    for (auto [r, id] : {std::pair{ch.src, send_phase}, std::pair{ch.dst, recv_phase}}) {
      auto& rs = ranks_[static_cast<std::size_t>(r)];
      if (--rs.phases[id].remaining == 0) compute_done(r, id);
    }
  }

  // Drops the earliest finishes that are stale (their flow ended or changed rate since), until
  // the earliest time has a live one.
  void drop_stale_finishes() {
    while (!finishes_.empty()) {
      auto& b = finishes_.earliest_bucket();
      std::erase_if(b, [&](const std::pair<int, std::uint64_t>& e) {
        const Flow& fl = flows_[static_cast<std::size_t>(e.first)];
        return !fl.live || fl.version != e.second;
      });
      if (!b.empty()) return;
      (void)finishes_.take_earliest();
    }
  }

  void touch(int port) {
    if (port_mark_[static_cast<std::size_t>(port)] == 0) {
      port_mark_[static_cast<std::size_t>(port)] = 1;
      dirty_ports_.push_back(port);
    }
  }

  // Rails every rank sees alike (the same bandwidth at every rank, in the same steps' masks) move
  // as one: the fluid model gives them the same rates.
  void group_rails() {
    std::size_t rails = 0;
    for (const auto& r : net_.rail_bps)
      rails = std::max(rails, r.size());
    rails = std::min<std::size_t>(rails, 64);
    std::vector<std::uint64_t> masks;
    for (const auto& rs : ranks_)
      for (const auto& c : rs.comm)
        if (c.is_send && std::find(masks.begin(), masks.end(), c.rails) == masks.end())
          masks.push_back(c.rails);
    std::vector<std::vector<double>> signature(rails);
    for (std::size_t i = 0; i < rails; ++i) {
      for (const auto& r : net_.rail_bps)
        signature[i].push_back(i < r.size() ? r[i] : 0);
      for (auto m : masks)
        signature[i].push_back(static_cast<double>((m >> i) & 1));
    }
    for (std::size_t i = 0; i < rails; ++i) {
      auto it = std::find_if(groups_.begin(), groups_.end(),
                             [&](const Group& g) { return signature[g.first] == signature[i]; });
      if (it == groups_.end()) {
        groups_.push_back({i, 0, {}, 0});
        it = groups_.end() - 1;
      }
      it->rails |= std::uint64_t{1} << i;
      ++it->count;
    }
    for (auto& g : groups_)
      for (const auto& r : net_.rail_bps)
        g.cap.push_back(g.first < r.size() ? r[g.first] * static_cast<double>(g.count) : 0);
  }
  double group_cap(int rank, std::size_t g) const {
    return groups_[g].cap[static_cast<std::size_t>(rank)];
  }
  int port(int rank, std::size_t group, bool in) const {
    return static_cast<int>((static_cast<std::size_t>(rank) * (groups_.size() + 1) + group) * 2 +
                            (in ? 1 : 0));
  }
  double capacity(int port) const {
    const std::size_t slot = static_cast<std::size_t>(port) / 2;
    const std::size_t group = slot % (groups_.size() + 1);
    const int rank = static_cast<int>(slot / (groups_.size() + 1));
    return group == groups_.size() ? net_.intra_bps : group_cap(rank, group);
  }

  // New rates for the channels connected (through shared ports) to a port whose channels
  // changed: max-min fair shares by progressive filling (the port with the smallest fair share
  // fixes its channels' rates at that share, what they take is removed from their other port,
  // repeat); then every message on a channel gets an equal part of its rate.
  void rates() {
    // The connected part of the port-channel graph around the changed ports.
    auto& ports = scratch_ports_;
    auto& units = scratch_units_;
    ports.clear();
    units.clear();
    for (int p : dirty_ports_) {
      port_mark_[static_cast<std::size_t>(p)] = 2;
      ports.push_back(p);
    }
    dirty_ports_.clear();
    for (std::size_t i = 0; i < ports.size(); ++i)
      for (const PortUnit& pu : port_units_[static_cast<std::size_t>(ports[i])]) {
        std::uint8_t& mark = unit_mark_[static_cast<std::size_t>(pu.unit)];
        if ((mark & kFixed) != 0) continue;
        mark |= kFixed;  // reused here as "seen"; cleared before the filling
        units.push_back(pu.unit);
        if (port_mark_[static_cast<std::size_t>(pu.other)] != 2) {
          port_mark_[static_cast<std::size_t>(pu.other)] = 2;
          ports.push_back(pu.other);
        }
      }
    for (int p : ports) {
      const auto up = static_cast<std::size_t>(p);
      port_mark_[up] = 0;
      cap_[up] = capacity(p);
      count_[up] = static_cast<std::uint32_t>(port_units_[up].size());
    }
    for (int u : units)
      unit_mark_[static_cast<std::size_t>(u)] &= ~kFixed;
    // A min-heap of (fair share, port) in a vector kept between calls. A port's share only rises
    // as the ports before it fix their channels (what a channel takes is at most the share it
    // leaves), so a port keeps its entry until it comes up (then, if its share rose, it goes
    // back in at the new one); only a share that fell (by rounding) is pushed at once. The
    // order the ports are settled in is the same as re-pushing every change.
    auto& heap = scratch_heap_;
    heap.clear();
    const auto later = [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
      return a.first > b.first || (a.first == b.first && a.second > b.second);
    };
    const auto push = [&](double share, int port) {
      key_[static_cast<std::size_t>(port)] = share;
      heap.emplace_back(share, port);
      std::push_heap(heap.begin(), heap.end(), later);
    };
    for (int p : ports)
      if (count_[static_cast<std::size_t>(p)] > 0)
        push(cap_[static_cast<std::size_t>(p)] / count_[static_cast<std::size_t>(p)], p);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      auto [s, p] = heap.back();
      heap.pop_back();
      const auto up = static_cast<std::size_t>(p);
      if (count_[up] == 0 || s != key_[up]) continue;  // settled, or a later entry stands
      if (const double now = cap_[up] / count_[up]; now != s) {
        push(now, p);
        continue;
      }
      for (const PortUnit& pu : port_units_[up]) {
        const auto u = static_cast<std::size_t>(pu.unit);
        if ((unit_mark_[u] & kFixed) != 0) continue;
        unit_mark_[u] |= kFixed;
        const double rate = std::max(s, 0.0);
        unit_rate_[u] = rate;
        const auto uo = static_cast<std::size_t>(pu.other);
        cap_[uo] = std::max(0.0, cap_[uo] - rate);
        if (--count_[uo] > 0 && cap_[uo] / count_[uo] < key_[uo])
          push(cap_[uo] / count_[uo], pu.other);
      }
      count_[up] = 0;
    }
    // Each message's part of its channels' rates. Only the messages on a channel whose part
    // changed, or that a message joined or left, can have a new rate.
    auto& changed = scratch_changed_;
    changed.clear();
    std::size_t visits = 0;
    for (int u : units) {
      const auto i = static_cast<std::size_t>(u);
      const std::uint8_t mark = unit_mark_[i];
      unit_mark_[i] = 0;
      const double share = unit_rate_[i] / static_cast<double>(unit_flows_[i]);
      if (share == share_[i] && (mark & kTouched) == 0) continue;
      share_[i] = share;
      changed.push_back(u);
      visits += unit_flows_[i];
    }
    // Those messages: their bytes so far at the old rate, then the new rate. Where they are many
    // of all, every flow is looked at in order (an unchanged one sums to its rate as it was).
    if (visits * 8 >= flows_.size()) {
      for (std::size_t f = 0; f < flows_.size(); ++f)
        set_rate(static_cast<int>(f));
      return;
    }
    ++round_;
    for (int u : changed)
      for (int f : units_[static_cast<std::size_t>(u)].flows) {
        FlowRate& fr = flow_rate_[static_cast<std::size_t>(f)];
        if (fr.round == round_) continue;
        fr.round = round_;
        set_rate(f);
      }
  }

  // A flow's rate as the sum of its units' parts; when that changed, its bytes so far at the old
  // rate and its new finish.
  void set_rate(int f) {
    FlowRate& fr = flow_rate_[static_cast<std::size_t>(f)];
    double rate = 0;
    const int* const on = flow_units(f);
    for (std::uint32_t i = 0; i < fr.units; ++i)
      rate += share_[static_cast<std::size_t>(on[i])];
    if (rate == fr.rate) return;  // its finish as scheduled still holds
    Flow& fl = flows_[static_cast<std::size_t>(f)];
    fl.left = std::max(0.0, fl.left - fr.rate * (now_ - fl.since));
    fl.since = now_;
    fr.rate = rate;
    ++fl.version;
    if (rate > 0) finishes_.push(now_ + fl.left / rate, f, fl.version);
  }

  const SimNetwork& net_;
  int p_;
  int fold_ = 1;
  std::vector<RankState> ranks_;
  std::vector<LaneState> lanes_;  // every rank's, a rank's together
  std::vector<Channel> channels_;
  std::vector<std::uint32_t> posted_;  // per channel end (2 chan + 1 for sends): steps posted
  std::unordered_map<std::uint64_t, std::uint32_t> chan_index_;  // (src, dst), while adding plans
  // rates()'s working lists, kept between calls.
  std::vector<int> scratch_ports_, scratch_units_, scratch_changed_;
  std::uint64_t round_ = 0;  // rates() calls so far
  std::vector<std::pair<double, int>> scratch_heap_;
  std::vector<Flow> flows_;
  std::vector<FlowRate> flow_rate_;
  std::vector<int> free_flows_;
  // Per unit: its messages, and (dense, for rates()) its ports (out, in), rate, message count,
  // marks, and each of its messages' part of its rate as last set.
  std::vector<Unit> units_;
  std::vector<std::array<int, 2>> unit_ports_;
  std::vector<double> unit_rate_;
  std::vector<std::uint32_t> unit_flows_;
  static constexpr std::uint8_t kFixed = 1;    // in the progressive filling under way
  static constexpr std::uint8_t kTouched = 2;  // a message started or ended on it since
  std::vector<std::uint8_t> unit_mark_;
  std::vector<double> share_;
  std::vector<int> flow_units_;  // per flow, unit_stride() entries: the units it moves on
  std::vector<std::vector<PortUnit>> port_units_;  // per port, its units that carry messages
  std::vector<int> dirty_ports_;
  std::vector<std::uint8_t> port_mark_;  // 1: dirty, 2: in the part being recomputed
  FinishQueue finishes_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  std::vector<std::pair<int, std::uint32_t>> done_now_;  // (rank, lane): phases done at now_
  struct Group {
    std::size_t first;  // a rail of the group
    std::uint64_t rails;
    std::vector<double> cap;  // per rank, all its rails together
    std::size_t count = 0;
  };
  std::vector<Group> groups_;
  std::vector<double> cap_, key_;  // rates(): per port, capacity left and its heap entry's share
  std::vector<std::uint32_t> count_;
  double now_ = 0;
  std::uint64_t messages_ = 0;
  double bytes_ = 0;
};

}  // namespace

Result<SimResult> simulate(const std::vector<Plan>& plans, const SimNetwork& net) {
  Sim sim(static_cast<int>(plans.size()), net);
  for (std::size_t r = 0; r < plans.size(); ++r)
    sim.add(static_cast<int>(r), plans[r]);
  return sim.run();
}

SimNetwork Cluster::sim_network() const {
  SimNetwork s;
  const double per_rank = nic_bps / gpus;
  for (int n = 0; n < nodes; ++n) {
    const bool hit = std::find(failed.begin(), failed.end(), n) != failed.end();
    for (int g = 0; g < gpus; ++g) {
      std::vector<double> rails(static_cast<std::size_t>(nics), per_rank);
      for (int i = 0; i < nics && hit; ++i) {
        if (shaped)
          rails[static_cast<std::size_t>(i)] *= slow;
        else if (i >= nics - lost_nics)
          rails[static_cast<std::size_t>(i)] = 0;
      }
      s.rail_bps.push_back(std::move(rails));
      s.node.push_back(n);
    }
  }
  s.intra_bps = gpus > 1 ? intra_bps : 0;
  s.latency_s = latency_s;
  return s;
}

Network Cluster::network() const {
  Network net;
  net.latency_s = latency_s;
  for (const auto& rails : sim_network().rail_bps) {
    double sum = 0;
    std::uint64_t up = 0;
    for (std::size_t i = 0; i < rails.size() && i < 64; ++i) {
      sum += rails[i];
      if (rails[i] > 0) up |= std::uint64_t{1} << i;
    }
    net.bandwidth.push_back(sum);
    net.rails_up.push_back(up);
  }
  return net;
}

Result<SimResult> simulate(const Cluster& c, const CollDesc& d, Algo algo, const Network* plan_net,
                           bool fold) {
  const Network net = plan_net ? *plan_net : c.network();
  SimNetwork sn = c.sim_network();
  // One rank per node where the others run its plan turned and have the same rails.
  bool rotate = fold && c.gpus > 1 && hierarchical_plans_rotate(d, c.nodes, c.gpus, &net);
  for (int r = 0; r < c.ranks() && rotate; ++r)
    rotate = sn.rail_bps[static_cast<std::size_t>(r)] ==
             sn.rail_bps[static_cast<std::size_t>(r - r % c.gpus)];
  const int step = rotate ? c.gpus : 1;
  if (rotate) {
    SimNetwork one;
    one.intra_bps = sn.intra_bps;
    one.latency_s = sn.latency_s;
    one.reduce_bps = sn.reduce_bps;
    for (int n = 0; n < c.nodes; ++n) {
      one.rail_bps.push_back(sn.rail_bps[static_cast<std::size_t>(n * c.gpus)]);
      one.node.push_back(n);
    }
    sn = std::move(one);
  }
  Sim sim(c.ranks() / step, sn, step);
  for (int r = 0; r < c.ranks(); r += step) {
    auto plan = c.gpus > 1 ? make_hierarchical_plan(d, r, c.nodes, c.gpus, algo, &net)
                           : make_plan(d, r, c.ranks(), algo, &net);
    if (!plan) return plan.status();
    sim.add(r / step, *plan);
  }
  return sim.run();
}

}  // namespace r2ccl::coll

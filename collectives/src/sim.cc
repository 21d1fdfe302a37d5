#include "r2ccl/coll/sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <unordered_map>

namespace r2ccl::coll {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A comm step that moves bytes, with its place in the plan order of its (peer, direction).
struct CommRef {
  int peer;
  bool is_send;
  std::uint32_t ord;
  std::size_t bytes;
  std::uint64_t rails;
};
struct PhaseInfo {
  std::uint32_t lane;
  std::vector<CommRef> comm;
  // (pair key, the ord of the phase's first step on that pair): the phase may be posted once
  // every earlier step on each of its pairs was.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> firsts;
  double compute_bytes = 0;
};
struct RankState {
  std::vector<PhaseInfo> phases;
  std::vector<std::vector<std::uint32_t>> lanes;  // phase indices per lane, in plan order
  std::vector<std::size_t> cursor;
  std::vector<bool> busy;
  std::vector<std::uint32_t> remaining;  // per phase: messages not yet complete
  std::unordered_map<std::uint64_t, std::uint32_t> posted;
  std::size_t lanes_left = 0;
  double finish = 0;
};

std::uint64_t pair_key(int peer, bool is_send) {
  return (static_cast<std::uint64_t>(peer) << 1) | (is_send ? 1 : 0);
}

struct Message {
  double send_ready = -1, recv_ready = -1;
  std::size_t send_bytes = 0, recv_bytes = 0;
  std::uint64_t rails = 0;
  std::uint32_t send_phase = 0, recv_phase = 0;
};
struct MessageKey {
  int src, dst;
  std::uint32_t ord;
  bool operator==(const MessageKey&) const = default;
};
struct MessageHash {
  std::size_t operator()(const MessageKey& k) const {
    return std::hash<std::uint64_t>()((static_cast<std::uint64_t>(k.src) << 42) ^
                                      (static_cast<std::uint64_t>(k.dst) << 21) ^ k.ord);
  }
};

struct Flow {
  MessageKey key;
  double left;  // bytes
  double size;
  double rate = 0;
  std::vector<int> groups;  // rail groups it moves on; empty: inside the node
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
  Sim(const std::vector<Plan>& plans, const SimNetwork& net)
      : net_(net), p_(static_cast<int>(plans.size())) {
    ranks_.resize(plans.size());
    for (int r = 0; r < p_; ++r)
      prepare(r, plans[static_cast<std::size_t>(r)]);
    group_rails();
    const std::size_t ports = static_cast<std::size_t>(p_) * (groups_.size() + 1) * 2;
    cap_.assign(ports, 0);
    count_.assign(ports, 0);
    version_.assign(ports, 0);
  }

  Result<SimResult> run() {
    if (static_cast<int>(net_.rail_bps.size()) != p_)
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("the network describes the rails of {} ranks for {} plans",
                                net_.rail_bps.size(), p_));
    for (int r = 0; r < p_; ++r)
      R2CCL_RETURN_IF_ERROR(post_ready(r));
    bool dirty = true;
    while (true) {
      if (dirty) rates();
      dirty = false;
      double t = events_.empty() ? kInf : events_.top().t;
      for (const auto& f : flows_)
        if (f.rate > 0) t = std::min(t, now_ + f.left / f.rate);
      if (t == kInf) break;
      const double dt = t - now_;
      now_ = t;
      for (auto& f : flows_)
        f.left -= f.rate * dt;
      // Messages done (to a relative precision: rates come from sums of shares).
      for (std::size_t i = 0; i < flows_.size();) {
        auto& f = flows_[i];
        if (f.left <= 1e-9 * (f.size + 1)) {
          const MessageKey key = f.key;
          flows_[i] = flows_.back();
          flows_.pop_back();
          dirty = true;
          R2CCL_RETURN_IF_ERROR(finish_message(key));
        } else {
          ++i;
        }
      }
      while (!events_.empty() && events_.top().t <= now_) {
        Event e = events_.top();
        events_.pop();
        if (e.kind == 0) {
          R2CCL_RETURN_IF_ERROR(start_message(e.key));
          dirty = true;
        } else {
          auto& rs = ranks_[static_cast<std::size_t>(e.rank)];
          rs.busy[e.lane] = false;
          if (++rs.cursor[e.lane] == rs.lanes[e.lane].size()) {
            rs.finish = std::max(rs.finish, now_);
            --rs.lanes_left;
          }
          R2CCL_RETURN_IF_ERROR(post_ready(e.rank));
        }
      }
    }
    SimResult out;
    out.finish.resize(ranks_.size());
    for (int r = 0; r < p_; ++r) {
      const auto& rs = ranks_[static_cast<std::size_t>(r)];
      if (rs.lanes_left > 0) {
        for (std::uint32_t l = 0; l < rs.lanes.size(); ++l)
          if (rs.cursor[l] < rs.lanes[l].size())
            return Status(ErrorCode::kInternal,
                          fmt::format("the plans hang: rank {} waits in lane {} at phase {} of {}",
                                      r, l, rs.lanes[l][rs.cursor[l]] + 1, rs.phases.size()));
      }
      out.finish[static_cast<std::size_t>(r)] = rs.finish;
      out.seconds = std::max(out.seconds, rs.finish);
    }
    out.messages = messages_;
    out.bytes = bytes_;
    return out;
  }

 private:
  void prepare(int r, const Plan& plan) {
    auto& rs = ranks_[static_cast<std::size_t>(r)];
    std::unordered_map<std::uint64_t, std::uint32_t> next;
    for (const auto& ph : plan.phases) {
      PhaseInfo info;
      info.lane = ph.lane;
      for (const auto& s : ph.comm) {
        if (s.bytes == 0) continue;
        const bool is_send = s.kind == Step::Kind::kSend;
        const std::uint64_t k = pair_key(s.peer, is_send);
        const std::uint32_t ord = next[k]++;
        info.comm.push_back({s.peer, is_send, ord, s.bytes, s.rails});
        if (std::none_of(info.firsts.begin(), info.firsts.end(),
                         [&](const auto& f) { return f.first == k; }))
          info.firsts.emplace_back(k, ord);
      }
      for (const auto& s : ph.compute)
        info.compute_bytes += static_cast<double>(s.bytes);
      if (rs.lanes.size() <= ph.lane) rs.lanes.resize(ph.lane + 1);
      rs.lanes[ph.lane].push_back(static_cast<std::uint32_t>(rs.phases.size()));
      rs.phases.push_back(std::move(info));
    }
    rs.cursor.assign(rs.lanes.size(), 0);
    rs.busy.assign(rs.lanes.size(), false);
    rs.remaining.assign(rs.phases.size(), 0);
    for (const auto& l : rs.lanes)
      rs.lanes_left += l.empty() ? 0 : 1;
  }

  // Posts every lane's next phase that may go now (posting one may let another lane go).
  Status post_ready(int r) {
    auto& rs = ranks_[static_cast<std::size_t>(r)];
    for (bool progress = true; progress;) {
      progress = false;
      for (std::uint32_t l = 0; l < rs.lanes.size(); ++l) {
        if (rs.busy[l] || rs.cursor[l] >= rs.lanes[l].size()) continue;
        const std::uint32_t id = rs.lanes[l][rs.cursor[l]];
        const PhaseInfo& ph = rs.phases[id];
        bool ready = true;
        for (const auto& [k, ord] : ph.firsts)
          if (rs.posted[k] != ord) ready = false;
        if (!ready) continue;
        progress = true;
        rs.busy[l] = true;
        rs.remaining[id] = static_cast<std::uint32_t>(ph.comm.size());
        for (const auto& c : ph.comm) {
          ++rs.posted[pair_key(c.peer, c.is_send)];
          const MessageKey key =
              c.is_send ? MessageKey{r, c.peer, c.ord} : MessageKey{c.peer, r, c.ord};
          Message& m = messages_in_[key];
          if (c.is_send) {
            m.send_ready = now_, m.send_bytes = c.bytes, m.send_phase = id, m.rails = c.rails;
          } else {
            m.recv_ready = now_, m.recv_bytes = c.bytes, m.recv_phase = id;
          }
          if (m.send_ready >= 0 && m.recv_ready >= 0) {
            if (m.send_bytes != m.recv_bytes)
              return Status(ErrorCode::kInternal,
                            fmt::format("the plans disagree: message {} from rank {} to {} is {} "
                                        "bytes at the sender and {} at the receiver",
                                        key.ord + 1, key.src, key.dst, m.send_bytes, m.recv_bytes));
            events_.push({now_ + net_.latency_s, 0, key, 0, 0});
          }
        }
        if (ph.comm.empty()) compute_done(r, id);
      }
    }
    return Status::ok();
  }

  void compute_done(int r, std::uint32_t id) {
    const auto& ph = ranks_[static_cast<std::size_t>(r)].phases[id];
    const double t = net_.reduce_bps > 0 ? ph.compute_bytes / net_.reduce_bps : 0;
    events_.push({now_ + t, 1, {}, r, ph.lane});
  }

  bool same_node(int a, int b) const {
    return !net_.node.empty() &&
           net_.node[static_cast<std::size_t>(a)] == net_.node[static_cast<std::size_t>(b)];
  }

  Status start_message(const MessageKey& key) {
    const Message& m = messages_in_.at(key);
    ++messages_;
    bytes_ += static_cast<double>(m.send_bytes);
    Flow f{key, static_cast<double>(m.send_bytes), static_cast<double>(m.send_bytes), 0, {}};
    if (!(same_node(key.src, key.dst) && net_.intra_bps > 0)) {
      for (bool any : {false, true}) {
        for (std::size_t g = 0; g < groups_.size(); ++g)
          if ((any || (groups_[g].rails & m.rails) != 0) && group_cap(key.src, g) > 0 &&
              group_cap(key.dst, g) > 0)
            f.groups.push_back(static_cast<int>(g));
        if (!f.groups.empty()) break;
      }
      if (f.groups.empty())
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("no rail is up at both rank {} and rank {}", key.src, key.dst));
    }
    flows_.push_back(std::move(f));
    return Status::ok();
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
      for (const auto& ph : rs.phases)
        for (const auto& c : ph.comm)
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

  Status finish_message(const MessageKey& key) {
    auto it = messages_in_.find(key);
    const Message m = it->second;
    messages_in_.erase(it);
    for (auto [r, id] : {std::pair{key.src, m.send_phase}, std::pair{key.dst, m.recv_phase}}) {
      auto& rs = ranks_[static_cast<std::size_t>(r)];
      if (--rs.remaining[id] == 0) compute_done(r, id);
    }
    return Status::ok();
  }

  double capacity(int port) const {
    const std::size_t slot = static_cast<std::size_t>(port) / 2;
    const std::size_t group = slot % (groups_.size() + 1);
    const int rank = static_cast<int>(slot / (groups_.size() + 1));
    return group == groups_.size() ? net_.intra_bps : group_cap(rank, group);
  }

  // Rates: a channel per ordered pair of ranks (its rails' connections) shares each port
  // max-min fairly with the other pairs' (progressive filling: the port with the smallest fair
  // share fixes its pairs' rates at that share, what they take is removed from their other port,
  // repeat); the messages in flight on one channel share its rate equally (the channel serves them
  // round-robin).
  void rates() {
    std::unordered_map<std::uint64_t, std::size_t> pair_of;
    struct Pair {
      int out, in;
      std::uint32_t messages = 0;
      double rate = -1;
    };
    std::vector<Pair> pairs;
    std::vector<std::size_t> flow_pair;  // the pairs of flow f: [flow_first[f], flow_first[f+1])
    std::vector<std::size_t> flow_first{0};
    const auto ports = static_cast<std::uint64_t>(cap_.size());
    auto add = [&](int out, int in) {
      const auto key = static_cast<std::uint64_t>(out) * ports + static_cast<std::uint64_t>(in);
      auto [it, fresh] = pair_of.try_emplace(key, pairs.size());
      if (fresh) pairs.push_back({out, in});
      ++pairs[it->second].messages;
      flow_pair.push_back(it->second);
    };
    for (const auto& f : flows_) {
      if (f.groups.empty())
        add(port(f.key.src, groups_.size(), false), port(f.key.dst, groups_.size(), true));
      for (int g : f.groups)
        add(port(f.key.src, static_cast<std::size_t>(g), false),
            port(f.key.dst, static_cast<std::size_t>(g), true));
      flow_first.push_back(flow_pair.size());
    }
    std::vector<int> touched;
    for (const auto& pr : pairs)
      for (int port : {pr.out, pr.in})
        if (count_[static_cast<std::size_t>(port)]++ == 0) touched.push_back(port);
    std::vector<std::size_t> start(touched.size() + 1, 0);
    std::unordered_map<int, std::size_t> index;
    for (std::size_t i = 0; i < touched.size(); ++i) {
      index[touched[i]] = i;
      start[i + 1] = start[i] + count_[static_cast<std::size_t>(touched[i])];
      cap_[static_cast<std::size_t>(touched[i])] = capacity(touched[i]);
    }
    std::vector<std::size_t> fill(start.begin(), start.end() - 1);
    std::vector<std::size_t> on(start.back());
    for (std::size_t i = 0; i < pairs.size(); ++i)
      for (int port : {pairs[i].out, pairs[i].in})
        on[fill[index[port]]++] = i;
    using Entry = std::tuple<double, int, std::uint64_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
    auto share = [&](int port) {
      return cap_[static_cast<std::size_t>(port)] / count_[static_cast<std::size_t>(port)];
    };
    for (int port : touched)
      heap.emplace(share(port), port, version_[static_cast<std::size_t>(port)]);
    while (!heap.empty()) {
      auto [s, port, v] = heap.top();
      heap.pop();
      const auto up = static_cast<std::size_t>(port);
      if (v != version_[up] || count_[up] == 0) continue;
      ++version_[up];
      const std::size_t i = index[port];
      for (std::size_t j = start[i]; j < start[i + 1]; ++j) {
        Pair& pr = pairs[on[j]];
        if (pr.rate >= 0) continue;
        pr.rate = std::max(s, 0.0);
        --count_[up];
        const int other = pr.out == port ? pr.in : pr.out;
        const auto uo = static_cast<std::size_t>(other);
        cap_[uo] = std::max(0.0, cap_[uo] - pr.rate);
        if (--count_[uo] > 0) heap.emplace(share(other), other, ++version_[uo]);
      }
      count_[up] = 0;
    }
    for (int port : touched)
      count_[static_cast<std::size_t>(port)] = 0;
    for (std::size_t f = 0; f < flows_.size(); ++f) {
      flows_[f].rate = 0;
      for (std::size_t j = flow_first[f]; j < flow_first[f + 1]; ++j) {
        const Pair& pr = pairs[flow_pair[j]];
        flows_[f].rate += std::max(pr.rate, 0.0) / pr.messages;
      }
    }
  }

  const SimNetwork& net_;
  int p_;
  std::vector<RankState> ranks_;
  std::unordered_map<MessageKey, Message, MessageHash> messages_in_;
  std::vector<Flow> flows_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  struct Group {
    std::size_t first;  // a rail of the group
    std::uint64_t rails;
    std::vector<double> cap;  // per rank, all its rails together
    std::size_t count = 0;
  };
  std::vector<Group> groups_;
  std::vector<double> cap_;
  std::vector<std::uint32_t> count_;
  std::vector<std::uint64_t> version_;
  double now_ = 0;
  std::uint64_t messages_ = 0;
  double bytes_ = 0;
};

}  // namespace

Result<SimResult> simulate(const std::vector<Plan>& plans, const SimNetwork& net) {
  Sim sim(plans, net);
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

Result<SimResult> simulate(const Cluster& c, const CollDesc& d, Algo algo) {
  const Network net = c.network();
  std::vector<Plan> plans;
  plans.reserve(static_cast<std::size_t>(c.ranks()));
  for (int r = 0; r < c.ranks(); ++r) {
    auto plan = make_plan(d, r, c.ranks(), algo, &net);
    if (!plan) return plan.status();
    plans.push_back(std::move(*plan));
  }
  return simulate(plans, c.sim_network());
}

}  // namespace r2ccl::coll

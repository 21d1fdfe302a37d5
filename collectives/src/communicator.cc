#include "r2ccl/coll/communicator.h"

#include <fmt/format.h>

#include <boost/container/small_vector.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "r2ccl/coll/reduce.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl::coll {
namespace {

using Clock = std::chrono::steady_clock;

std::string describe(const CollDesc& d) {
  std::string s = fmt::format("{}(count {}, {}", coll_op_name(d.op), d.count, type_name(d.type));
  if (d.op == CollOp::kAllReduce || d.op == CollOp::kReduceScatter || d.op == CollOp::kReduce)
    s += fmt::format(", {}", redop_name(d.redop));
  if (d.op == CollOp::kBroadcast || d.op == CollOp::kReduce) s += fmt::format(", root {}", d.root);
  return s + ")";
}

bool reduces(CollOp op) {
  return op == CollOp::kAllReduce || op == CollOp::kReduceScatter || op == CollOp::kReduce;
}

// The agreement header of R2CCL_CHECK=1.
constexpr std::uint32_t kCheckMagic = 0x52324348;  // "R2CH"
constexpr std::size_t kHeaderBytes = 32;

Bytes encode_header(const CollDesc& d, Algo algo, std::uint64_t seq) {
  ByteWriter w;
  w.u32(kCheckMagic)
      .u8(static_cast<std::uint8_t>(d.op))
      .u8(static_cast<std::uint8_t>(d.type))
      .u8(static_cast<std::uint8_t>(d.redop))
      .u8(static_cast<std::uint8_t>(algo))
      .u32(static_cast<std::uint32_t>(d.root))
      .u64(d.count)
      .u64(seq);
  Bytes b = w.take();
  b.resize(kHeaderBytes);
  return b;
}

struct Header {
  CollDesc d;
  Algo algo = Algo::kAuto;
  std::uint64_t seq = 0;
  bool valid = false;
};

Header decode_header(const std::byte* p) {
  ByteReader r(std::span<const std::byte>(p, kHeaderBytes));
  Header h;
  if (r.u32() != kCheckMagic) return h;
  h.d.op = static_cast<CollOp>(r.u8());
  h.d.type = static_cast<DataType>(r.u8());
  h.d.redop = static_cast<RedOp>(r.u8());
  h.algo = static_cast<Algo>(r.u8());
  h.d.root = static_cast<int>(r.u32());
  h.d.count = r.u64();
  h.seq = r.u64();
  h.valid = r.ok();
  return h;
}

bool same(const Header& a, const Header& b) {
  if (a.d.op != b.d.op || a.d.count != b.d.count || a.d.type != b.d.type || a.algo != b.algo)
    return false;
  if (reduces(a.d.op) && a.d.redop != b.d.redop) return false;
  if ((a.d.op == CollOp::kBroadcast || a.d.op == CollOp::kReduce) && a.d.root != b.d.root)
    return false;
  return true;
}

// A rail's line rate, bytes per second: the kernel interface's speed (sysfs, Mbit/s), or the
// verbs port's rate ("100 Gb/sec (4X EDR)"); none where neither is known (a virtual interface
// that reports none, a NIC named by address).
std::optional<double> line_rate_bps(const RailNic& nic) {
  const auto read = [](const std::string& path) -> std::optional<std::string> {
    std::ifstream in(path);
    std::string line;
    if (!in || !std::getline(in, line)) return std::nullopt;
    return line;
  };
  const auto number = [](const std::string& text) -> std::optional<double> {
    double v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end == text.data() || !(v > 0) || !std::isfinite(v))
      return std::nullopt;
    return v;
  };
  if (!nic.netdev.empty() && nic.netdev.find('/') == std::string::npos) {
    if (auto t = read("/sys/class/net/" + nic.netdev + "/speed"))
      if (auto mbit = number(*t)) return *mbit * 1e6 / 8;
  }
  if (!nic.name.empty() && nic.name.find('/') == std::string::npos) {
    if (auto t = read("/sys/class/infiniband/" + nic.name + "/ports/1/rate"))
      if (auto gbit = number(*t)) return *gbit * 1e9 / 8;
  }
  return std::nullopt;
}

// One transfer of a round: a receive into or a send from [offset, offset+bytes) of a region.
struct Transfer {
  bool recv = false;
  int peer = -1;
  RegionPtr region;
  std::size_t offset = 0;
  std::size_t bytes = 0;
  std::uint64_t rails = kAllRails;
};

// Posts the receives first (their clear-to-sends go out before the data that needs them), then
// the sends, and waits for every one (so no transfer still reads or writes a buffer once this
// returns); gives the first error.
// A round's transfers: a few per peer, kept without allocating for small worlds.
using Transfers = boost::container::small_vector<Transfer, 8>;

using Ops = boost::container::small_vector<OpPtr, 8>;

// Posts the receives first (their clear-to-sends go out before the data that needs them), then
// the sends; gives the first error (nothing after it is posted).
Status post(Fabric& f, const Transfers& transfers, Ops& ops) {
  for (bool recv : {true, false})
    for (const auto& t : transfers) {
      if (t.recv != recv) continue;
      auto op = recv ? f.irecv(t.peer, t.region, t.offset, t.bytes)
                     : f.isend(t.peer, t.region, t.offset, t.bytes, t.rails);
      if (!op) return op.status();
      ops.push_back(*op);
    }
  return Status::ok();
}

Status post_and_wait(Fabric& f, const Transfers& transfers) {
  Ops ops;
  Status first = post(f, transfers, ops);
  for (const auto& op : ops) {
    Status st = f.wait(op);
    if (!st && first.is_ok()) first = std::move(st);
  }
  return first;
}

// Runs a plan of several lanes: each lane's phases in order, the lanes side by side.
Status run_lanes(Fabric& fabric, const Plan& plan,
                 const std::function<Transfers(const Phase&)>& transfers_of,
                 const std::function<void(const Phase&)>& compute) {
  const std::size_t n = plan.phases.size();
  // A phase is posted only after the phase before it (in plan order) with a message to or from
  // the same peer in the same direction: both sides then post a pair's messages in one order.
  std::vector<std::vector<std::uint32_t>> after(n);
  std::unordered_map<std::uint64_t, std::uint32_t> last;
  std::vector<std::vector<std::uint32_t>> lanes(plan.lanes);
  for (std::uint32_t i = 0; i < n; ++i) {
    const Phase& ph = plan.phases[i];
    if (ph.lane >= plan.lanes)
      return {ErrorCode::kInternal, fmt::format("phase {} is in lane {} of a plan of {} lanes",
                                                i + 1, ph.lane, plan.lanes)};
    lanes[ph.lane].push_back(i);
    for (const auto& s : ph.comm) {
      if (s.bytes == 0) continue;
      const std::uint64_t key =
          (static_cast<std::uint64_t>(s.peer) << 1) | (s.kind == Step::Kind::kSend ? 1 : 0);
      auto [it, fresh] = last.try_emplace(key, i);
      if (!fresh && it->second != i) {
        after[i].push_back(it->second);
        it->second = i;
      }
    }
  }
  struct Lane {
    std::size_t cursor = 0;
    bool active = false;
    Ops ops;
  };
  std::vector<Lane> state(plan.lanes);
  std::vector<bool> posted(n, false), completed(n, false);
  std::size_t completed_prefix = 0;  // phases [0, completed_prefix) all completed
  const auto complete = [&](std::size_t i) {
    completed[i] = true;
    while (completed_prefix < n && completed[completed_prefix])
      ++completed_prefix;
  };
  Status first;
  std::size_t failed_at = 0;
  std::vector<OpPtr> waiting;
  while (first.is_ok()) {
    for (bool progress = true; progress && first.is_ok();) {
      progress = false;
      for (std::uint32_t l = 0; l < plan.lanes && first.is_ok(); ++l) {
        Lane& lane = state[l];
        if (lane.active || lane.cursor >= lanes[l].size()) continue;
        const std::uint32_t i = lanes[l][lane.cursor];
        if (plan.phases[i].join && completed_prefix < i) continue;
        if (!std::all_of(after[i].begin(), after[i].end(), [&](auto j) { return posted[j]; }))
          continue;
        progress = true;
        posted[i] = true;
        if (Status st = post(fabric, transfers_of(plan.phases[i]), lane.ops); !st) {
          first = std::move(st), failed_at = i;
          break;
        }
        lane.active = !lane.ops.empty();
        if (!lane.active) {
          compute(plan.phases[i]);
          ++lane.cursor;
          complete(i);
        }
      }
    }
    if (!first.is_ok()) break;
    // Wait only while no lane has finished its phase: a finished lane goes on at once (its next
    // phase may be what a peer needs before anything this rank waits for can arrive).
    waiting.clear();
    bool lane_done = false;
    for (const auto& lane : state) {
      if (!lane.active) continue;
      const std::size_t before = waiting.size();
      for (const auto& op : lane.ops)
        if (!op->done()) waiting.push_back(op);
      lane_done |= waiting.size() == before;
    }
    const bool any_active =
        std::any_of(state.begin(), state.end(), [](const Lane& lane) { return lane.active; });
    if (!any_active) {
      for (std::uint32_t l = 0; l < plan.lanes; ++l)
        if (state[l].cursor < lanes[l].size())
          return {ErrorCode::kInternal,
                  fmt::format("the plan cannot go on: lane {} waits at step {} of {}", l,
                              lanes[l][state[l].cursor] + 1, n)};
      return Status::ok();
    }
    if (Status st = lane_done ? Status::ok() : fabric.wait_any(waiting); !st) {
      first = std::move(st);
      break;
    }
    for (std::uint32_t l = 0; l < plan.lanes; ++l) {
      Lane& lane = state[l];
      if (!lane.active || !std::all_of(lane.ops.begin(), lane.ops.end(),
                                       [](const OpPtr& op) { return op->done(); }))
        continue;
      const std::uint32_t i = lanes[l][lane.cursor];
      for (const auto& op : lane.ops)
        if (Status st = op->status(); !st && first.is_ok()) first = std::move(st), failed_at = i;
      lane.ops.clear();
      lane.active = false;
      if (!first.is_ok()) break;
      compute(plan.phases[i]);
      ++lane.cursor;
      complete(i);
    }
  }
  // Nothing may still read or write the buffers once this returns.
  for (auto& lane : state)
    for (const auto& op : lane.ops)
      (void)fabric.wait(op);
  return first.with_context(fmt::format("step {} of {}", failed_at + 1, n));
}

}  // namespace

// Registrations of the caller's buffers for one operation.
// The regions of one operation: a buffer inside one of the communicator's registered buffers
// uses it; any other above `cached_above` bytes comes from the registration cache where the
// communicator has one (held for the operation: an entry dropped meanwhile is deregistered after
// it); the rest is registered for the operation and deregistered after it. Small buffers (often
// on the stack) and device memory never go through the cache. Without a communicator (the
// probe's own buffer), every buffer is registered for the operation.
struct Communicator::Registered {
  explicit Registered(Fabric& f) : fabric(f) {}
  explicit Registered(const Communicator& c)
      : fabric(*c.fabric_), owner(&c), cache(c.reg_cache_.get()), cached_above(kStageLimit) {}
  Registered(const Registered&) = delete;
  Registered& operator=(const Registered&) = delete;
  Fabric& fabric;
  const Communicator* owner = nullptr;
  RegistrationCache* cache = nullptr;
  std::size_t cached_above = 0;
  std::vector<RegionPtr> regions;
  boost::container::small_vector<RegistrationCache::Lease, 2> leases;
  ~Registered() {
    leases.clear();
    for (auto& r : regions)
      (void)fabric.deregister_memory(r);
  }
  // The region and the buffer's offset in it.
  Result<std::pair<RegionPtr, std::size_t>> add(const void* p, std::size_t bytes,
                                                MemoryAccess access) {
    if (!p || bytes == 0) return std::pair<RegionPtr, std::size_t>{};
    if (owner)
      if (auto hit = owner->registered(p, bytes); hit.first) return hit;
    if (cache && bytes > cached_above && cuda_memory_of(p) == nullptr) {
      R2CCL_ASSIGN_OR_RETURN(auto lease, cache->acquire(p, bytes, access));
      std::pair<RegionPtr, std::size_t> at{lease.region(), lease.offset()};
      leases.push_back(std::move(lease));
      return at;
    }
    R2CCL_ASSIGN_OR_RETURN(auto r, fabric.register_memory(const_cast<void*>(p), bytes, access));
    regions.push_back(r);
    return std::pair<RegionPtr, std::size_t>{r, 0};
  }
};

Result<std::unique_ptr<Communicator>> Communicator::from_env() {
  R2CCL_ASSIGN_OR_RETURN(auto cfg, parse_config(process_env()));
  R2CCL_ASSIGN_OR_RETURN(auto boot, BootstrapOptions::from_config(cfg));
  return create(cfg, boot);
}

Result<std::unique_ptr<Communicator>> Communicator::from_unique_id(const UniqueId& id, int rank,
                                                                   int nranks) {
  R2CCL_ASSIGN_OR_RETURN(auto cfg, parse_config(process_env()));
  R2CCL_ASSIGN_OR_RETURN(auto boot, BootstrapOptions::from_unique_id(id, rank, nranks, cfg));
  return create(cfg, boot);
}

Result<std::unique_ptr<Communicator>> Communicator::create(const Config& config,
                                                           const BootstrapOptions& boot) {
  R2CCL_ASSIGN_OR_RETURN(auto algo, parse_algo(config.algo));
  R2CCL_ASSIGN_OR_RETURN(auto fabric, Fabric::create(config, boot));
  std::unique_ptr<Communicator> c(new Communicator(std::move(fabric)));
  c->requested_algo_ = algo;
  // The rails' line rates, for degraded mode's estimate of this rank's links (the first 64).
  const auto& nics = c->fabric_->nics();
  for (std::size_t i = 0; i < std::min<std::size_t>(nics.size(), 64); ++i)
    c->line_bps_.push_back(line_rate_bps(nics[i]).value_or(kNominalRailBps));
  // The registration cache only where a registration that outlives its buffer stays correct
  // (the provider's registrations follow the mappings, tcp), unless R2CCL_REG_CACHE says
  // otherwise; a pinning provider (verbs) registers each operation's buffers for it alone.
  Fabric* f = c->fabric_.get();
  const std::uint32_t caps = f->provider_capabilities();
  if (registration_cache_applies(config.reg_cache, caps)) {
    if (config.reg_cache == "on" && (caps & kCapRegistrationFollowsMappings) == 0)
      R2CCL_INFO(
          "R2CCL_REG_CACHE=on with a provider whose registrations pin pages: buffers passed to "
          "collectives must be invalidated (invalidate_cache, r2cclCommInvalidateCache) before "
          "they are freed");
    c->reg_cache_ = std::make_unique<RegistrationCache>(
        RegistrationCache::Limits{kRegCacheEntries, config.reg_cache_bytes},
        [f](void* base, std::size_t n, MemoryAccess access) {
          return f->register_memory(base, n, access);
        },
        [f](const RegionPtr& region) { return f->deregister_memory(region); });
  }
  return c;
}

Communicator::Communicator(std::unique_ptr<Fabric> fabric) : fabric_(std::move(fabric)) {}

Communicator::~Communicator() {
  reg_cache_.reset();
  if (scratch_region_) (void)fabric_->deregister_memory(scratch_region_);
}

LatencyHistogram& Communicator::duration(CollOp op, Algo algo) {
  auto& h = durations_[{op, algo}];
  if (!h)
    h = &fabric_->metrics()
             .histogram(
                 "r2ccl_collective_duration_seconds",
                 "Time one collective took on this rank, by operation and algorithm.",
                 {{"op", std::string(coll_op_name(op))}, {"algo", std::string(algo_name(algo))}})
             .histogram;
  return *h;
}

Result<RegionPtr> Communicator::scratch(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 64);
  if (scratch_region_ && scratch_.size() >= bytes) return scratch_region_;
  if (scratch_region_) {
    (void)fabric_->deregister_memory(scratch_region_);
    scratch_region_.reset();
  }
  scratch_.assign(std::max(bytes, scratch_.size() * 2), std::byte{0});
  R2CCL_ASSIGN_OR_RETURN(scratch_region_,
                         fabric_->register_memory(scratch_.data(), scratch_.size()));
  return scratch_region_;
}

Status Communicator::validate(const CollDesc& d, const Buffers& b) const {
  const int p = size();
  const std::string what = std::string(coll_op_name(d.op));
  if (reduces(d.op)) {
    if (Status st = check_type_and_op(d.type, d.redop); !st) return st.with_context(what);
  } else if (Status st = check_type(d.type); !st) {
    return st.with_context(what);
  }
  if ((d.op == CollOp::kBroadcast || d.op == CollOp::kReduce) && (d.root < 0 || d.root >= p))
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: root {} is out of range (0..{})", what, d.root, p - 1)};
  const std::size_t elem = type_size(d.type);
  const std::size_t per_rank = d.op == CollOp::kAllGather || d.op == CollOp::kReduceScatter
                                   ? static_cast<std::size_t>(p)
                                   : 1;
  if (d.count > std::numeric_limits<std::size_t>::max() / elem / per_rank ||
      d.count * elem * per_rank > (std::size_t{1} << 47))
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: count {} of {} ({} bytes each{}) overflows the largest buffer size",
                        what, d.count, type_name(d.type), elem,
                        per_rank > 1 ? fmt::format(", times {} ranks", p) : "")};
  if (d.count == 0) return Status::ok();
  const bool root = rank() == d.root;
  const bool need_send = d.op != CollOp::kBroadcast || root;
  const bool need_recv = d.op != CollOp::kReduce || root;
  if (need_send && !b.send)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the send buffer is null (count {})", what, d.count)};
  if (need_recv && !b.recv)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the receive buffer is null (count {})", what, d.count)};
  return Status::ok();
}

Status Communicator::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                                RedOp op) {
  return run({CollOp::kAllReduce, count, type, op, 0, false}, {send, recv});
}
Status Communicator::all_gather(const void* send, void* recv, std::size_t count, DataType type) {
  return run({CollOp::kAllGather, count, type, RedOp::kSum, 0, false}, {send, recv});
}
Status Communicator::reduce_scatter(const void* send, void* recv, std::size_t count, DataType type,
                                    RedOp op) {
  return run({CollOp::kReduceScatter, count, type, op, 0, false}, {send, recv});
}
Status Communicator::broadcast(const void* send, void* recv, std::size_t count, DataType type,
                               int root) {
  return run({CollOp::kBroadcast, count, type, RedOp::kSum, root, false}, {send, recv});
}
Status Communicator::reduce(const void* send, void* recv, std::size_t count, DataType type,
                            RedOp op, int root) {
  return run({CollOp::kReduce, count, type, op, root, false}, {send, recv});
}
Status Communicator::barrier() {
  return run({CollOp::kBarrier, 0, DataType::kU8, RedOp::kSum, 0, false}, {});
}

Status Communicator::run(const CollDesc& desc, Buffers b) {
  CollDesc d = desc;
  const std::string name(coll_op_name(d.op));
  if (aborted_) return {ErrorCode::kAborted, name + ": the communicator was aborted"};
  // Every call starts an epoch, whatever becomes of it: the ranks count their calls alike, and
  // what one rank posted for a collective that failed elsewhere cannot pair with this one.
  fabric_->set_epoch(++epoch_);
  if (group_depth_ > 0)
    return {ErrorCode::kInvalidArgument,
            name + ": collectives cannot be queued in a group (only send and recv can)"};
  R2CCL_RETURN_IF_ERROR(validate(d, b));
  const std::size_t elem = type_size(d.type);
  const auto r = static_cast<std::size_t>(rank());
  switch (d.op) {
    case CollOp::kAllGather:
      d.in_place = b.send && b.recv &&
                   static_cast<const std::byte*>(b.send) ==
                       static_cast<const std::byte*>(b.recv) + r * d.count * elem;
      break;
    case CollOp::kReduceScatter:
      d.in_place = b.send && b.recv &&
                   static_cast<const std::byte*>(b.recv) ==
                       static_cast<const std::byte*>(b.send) + r * d.count * elem;
      break;
    default:
      d.in_place = b.send && b.send == b.recv;
      break;
  }
  // R2CCL_CHECK first: ranks that disagree on the call may also disagree on whether degraded
  // mode's agreement runs, and then its exchange would fail without saying why. The header
  // carries the algorithm each rank was asked for; the one it then picks follows from the call
  // and the agreed network alike on every rank.
  if (config().check) R2CCL_RETURN_IF_ERROR(check_agreement(d, requested_algo_));
  Algo algo = Algo::kAuto;
  const bool agreed = agrees(d);
  if (agreed) {
    const LinkEstimate now = link_source_ ? link_source_() : measure_links();
    if (last_estimate_ && !(*last_estimate_ == now)) ++link_generation_;
    last_estimate_ = now;
    if (agreement_due_) {
      auto net = agree();
      if (!net) return net.status();
      agreed_ = std::move(*net);
      agreement_due_ = false;
    }
    algo = degraded_algo(d);
  } else {
    algo = auto_algo(d);
  }
  if (d.count == 0 && d.op != CollOp::kBarrier) return Status::ok();
  const auto same_net = [](const Network& x, const Network& y) {
    return x.bandwidth == y.bandwidth && x.rails_up == y.rails_up && x.latency_s == y.latency_s;
  };
  if (!(last_plan_.valid && last_plan_.desc == d && last_plan_.requested == requested_algo_ &&
        last_plan_.algo == algo && last_plan_.gossip == agreed &&
        (!is_degraded_algo(algo) || same_net(last_plan_.net, agreed_)))) {
    last_plan_.valid = false;
    R2CCL_ASSIGN_OR_RETURN(last_plan_.plan,
                           make_plan(d, rank(), size(), algo, agreed ? &agreed_ : nullptr));
    last_plan_.desc = d;
    last_plan_.requested = requested_algo_;
    last_plan_.algo = algo;
    last_plan_.net = agreed ? agreed_ : Network{};
    last_plan_.gossip = agreed;
    if (agreed) last_plan_.where = add_gossip(last_plan_.plan);
    last_plan_.valid = true;
  }
  const Plan& plan = last_plan_.plan;
  last_algo_ = plan.algo;
  const auto t0 = Clock::now();
  auto what = [&] {
    return fmt::format("{} ({}) on rank {} of {}", describe(d), algo_name(plan.algo), rank(),
                       size());
  };
  // A reference: no allocation per operation.
  Status st = execute(plan, d, b, std::ref(what), agreed ? &last_plan_.where : nullptr);
  if (agreed) {
    // Every rank saw the same generations, so every rank decides alike. After a failure the
    // ranks may have seen different things: they agree again (and where one rank's call failed
    // and another's did not, the next call fails on both, and the one after agrees on both).
    if (!st || gossip_ != agreed_generations_) agreement_due_ = true;
  }
  if (st)
    duration(d.op, plan.algo).observe(std::chrono::duration<double>(Clock::now() - t0).count());
  return st;
}

Communicator::Gossip Communicator::add_gossip(Plan& plan) const {
  const int p = size();
  Gossip g{(plan.scratch_bytes + 7) / 8 * 8};
  plan.scratch_bytes = g.at + 8 * static_cast<std::size_t>(p);
  if (plan.phases.empty()) plan.phases.emplace_back();
  auto& first = plan.phases.front().comm;
  std::vector<Step> steps;
  const auto slot = [&](int i) {
    return Ref{Buf::kScratch, g.at + 8 * static_cast<std::size_t>(i)};
  };
  for (int i = 1; i < p; ++i) {
    const int from = (rank() - i + p) % p;
    steps.push_back(Step{Step::Kind::kRecv, from, {}, {}, slot(from), 8, Step::kAllRails});
  }
  for (int i = 1; i < p; ++i)
    steps.push_back(
        Step{Step::Kind::kSend, (rank() + i) % p, slot(rank()), {}, {}, 8, Step::kAllRails});
  first.insert(first.begin(), steps.begin(), steps.end());
  return g;
}

Algo Communicator::auto_algo(const CollDesc& d) const {
  const std::size_t eager = size() == 2 ? fabric_->eager_limit(1 - rank()) : 0;
  return choose_algo(d, size(), requested_algo_, eager);
}

bool Communicator::agrees(const CollDesc& d) const {
  if (d.op != CollOp::kAllReduce || size() < 2 || d.count == 0) return false;
  if (config().degraded_algo == "off") return false;
  if (requested_algo_ != Algo::kAuto && !is_degraded_algo(requested_algo_)) return false;
  return d.count * type_size(d.type) >= config().degraded_min_bytes;
}

Algo Communicator::degraded_algo(const CollDesc& d) const {
  if (is_degraded_algo(requested_algo_)) return requested_algo_;
  if (!is_degraded(agreed_)) return auto_algo(d);
  const std::string& want = config().degraded_algo;
  if (want == "auto") return choose_degraded(d, agreed_);
  auto a = parse_algo(want);
  return a ? *a : choose_degraded(d, agreed_);
}

Communicator::LinkEstimate Communicator::measure_links() const {
  const std::size_t k = line_bps_.size();
  // A rail counts where it is up to some peer: fully, or, where the channel found it degraded
  // (well under its sibling rails), at its weight against the fastest of them, in steps of 1/32
  // (so that a weight that wanders a little is not a change of the rank's links).
  std::vector<double> weight(k, 0);
  for (const auto& s : fabric_->rail_snapshot()) {
    if (s.rail >= k) continue;
    double w = 0;
    if (s.state == RailState::kUp) w = 1;
    if (s.state == RailState::kDegraded)
      w = std::max(1.0, std::round(std::clamp(s.weight, 0.0, 1.0) * 32)) / 32;
    weight[s.rail] = std::max(weight[s.rail], w);
  }
  // Each at its line rate: rates measured on single rails wander with the traffic far more than
  // a lost or degraded rail changes them. A rank slow on every rail is the probe's to see.
  LinkEstimate e;
  for (std::size_t i = 0; i < k; ++i) {
    if (weight[i] <= 0) continue;
    e.rails |= std::uint64_t{1} << i;
    e.bandwidth += weight[i] * line_bps_[i];
  }
  return e;
}

Result<double> Communicator::probe(std::size_t bytes) {
  const int p = size();
  if (bytes == 0 || p < 2) return 0.0;
  // A buffer of its own, gone after the agreement (the scratch buffer stays for good).
  std::vector<std::byte> buf(2 * bytes);
  Registered reg(*fabric_);
  R2CCL_ASSIGN_OR_RETURN(auto at, reg.add(buf.data(), buf.size(), MemoryAccess::kRemoteWrite));
  const RegionPtr& region = at.first;
  double best = 0;
  for (int shift : {1, 2}) {
    if (shift == 2 && p < 3) break;
    const int from = (rank() - shift + p) % p, to = (rank() + shift) % p;
    // First 8 bytes each way with the same two ranks, untimed: once they have moved, both
    // partners have reached the probe, so the timed transfer does not count a wait for a late
    // rank (which would make the early one look slow).
    Transfers hello;
    hello.push_back({true, from, region, bytes, 8, kAllRails});
    hello.push_back({false, to, region, 0, 8, kAllRails});
    R2CCL_RETURN_IF_ERROR(post_and_wait(*fabric_, hello));
    // Twice: a transfer slowed by something passing (another process on the CPU, a burst of
    // other traffic) is not the link's rate; the faster one is kept.
    for (int again = 0; again < 2; ++again) {
      Transfers t;
      t.push_back({true, from, region, bytes, bytes, kAllRails});
      t.push_back({false, to, region, 0, bytes, kAllRails});
      const auto t0 = Clock::now();
      R2CCL_RETURN_IF_ERROR(post_and_wait(*fabric_, t));
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (s > 0) best = std::max(best, static_cast<double>(bytes) / s);
    }
  }
  return best;
}

Result<std::vector<std::byte>> Communicator::exchange(const Bytes& mine) {
  const std::size_t n = mine.size();
  std::vector<std::byte> all(n * static_cast<std::size_t>(size()));
  std::byte* own = all.data() + n * static_cast<std::size_t>(rank());
  std::copy(mine.begin(), mine.end(), own);
  const CollDesc gather{CollOp::kAllGather, n, DataType::kU8, RedOp::kSum, 0, true};
  R2CCL_ASSIGN_OR_RETURN(auto plan, make_plan(gather, rank(), size(), Algo::kOneShot));
  R2CCL_RETURN_IF_ERROR(
      execute(plan, gather, {own, all.data()}, [] { return std::string("the exchange"); }));
  return all;
}

Result<Network> Communicator::agree() {
  const int p = size();
  LinkEstimate mine =
      last_estimate_ ? *last_estimate_ : (link_source_ ? link_source_() : measure_links());
  // The probe caps the line rates: a rank slow on every rail alike shows only there. An embedder's
  // own estimate (set_link_source) is taken as it is.
  if (!link_source_) {
    auto probed = probe(config().degraded_probe_bytes);
    if (!probed) return probed.status().with_context("the timed probe of degraded mode");
    if (*probed > 0) mine.bandwidth = std::min(mine.bandwidth, *probed);
  }
  constexpr std::size_t kRecord = 32;
  ByteWriter w;
  w.u64(std::bit_cast<std::uint64_t>(mine.bandwidth))
      .u64(mine.rails)
      .u64(static_cast<std::uint64_t>(std::min(exchange_s_, 3600.0) * 1e9))
      .u64(link_generation_);
  const auto t0 = Clock::now();
  auto gathered = exchange(w.take());
  if (!gathered) return gathered.status().with_context("the bandwidth agreement of degraded mode");
  const std::vector<std::byte>& all = *gathered;
  exchange_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
  Network net;
  std::vector<std::uint64_t> generations;
  double quickest_exchange = std::numeric_limits<double>::infinity();
  for (int i = 0; i < p; ++i) {
    ByteReader r(
        std::span<const std::byte>(all.data() + kRecord * static_cast<std::size_t>(i), kRecord));
    const double b = std::bit_cast<double>(r.u64());
    const std::uint64_t rails = r.u64();
    const double exchange = static_cast<double>(r.u64()) * 1e-9;
    generations.push_back(r.u64());
    if (!r.ok() || !std::isfinite(b) || b < 0 || !(exchange >= 0 && exchange <= 3600))
      return Status(ErrorCode::kProtocol,
                    fmt::format("the bandwidth agreement of degraded mode: rank {} sent a "
                                "malformed record (bandwidth {}, exchange {} s)",
                                i, b, exchange));
    net.bandwidth.push_back(b);
    net.rails_up.push_back(rails);
    // An exchange that waited for a late rank says nothing of the network: only a quick one
    // counts (the quickest is taken below).
    if (exchange > 0) quickest_exchange = std::min(quickest_exchange, exchange);
  }
  agreed_generations_ = std::move(generations);
  ++agreements_;
  net.bandwidth = settle_bandwidths(net.bandwidth, net.rails_up);
  // The last rank to reach the exchange waited least: its time is the network's, the others'
  // include the wait for it. A phase of a plan costs about two of those (a request to send, then
  // the data). Rounded to a power of two microseconds, so that the cached plan is rebuilt only
  // when the latency really changed.
  net.latency_s = std::isfinite(quickest_exchange)
                      ? std::exp2(std::round(std::log2(2 * quickest_exchange * 1e6))) * 1e-6
                      : 0;
  return net;
}

Status Communicator::check_agreement(const CollDesc& d, Algo algo) {
  const int p = size();
  const Bytes mine = encode_header(d, algo, op_seq_++);
  if (p == 1) return Status::ok();
  auto gathered = exchange(mine);
  if (!gathered)
    return gathered.status().with_context(
        fmt::format("R2CCL_CHECK exchange before {}", coll_op_name(d.op)));
  const std::vector<std::byte>& headers = *gathered;
  std::vector<Header> all;
  for (int i = 0; i < p; ++i)
    all.push_back(decode_header(headers.data() + kHeaderBytes * static_cast<std::size_t>(i)));
  for (int i = 1; i < p; ++i) {
    if (all[static_cast<std::size_t>(i)].valid && same(all[0], all[static_cast<std::size_t>(i)]))
      continue;
    const auto& h = all[static_cast<std::size_t>(i)];
    const auto& h0 = all[0];
    std::string theirs =
        h.valid ? describe(h.d) : std::string("something that is not a collective");
    std::string ours = describe(h0.d);
    if (h.valid && h.algo != h0.algo && describe(h.d) == ours) {
      theirs += fmt::format(" with algorithm {}", algo_name(h.algo));
      ours += fmt::format(" with algorithm {}", algo_name(h0.algo));
    }
    return {ErrorCode::kInvalidArgument,
            fmt::format("mismatched collective (R2CCL_CHECK=1): rank 0 called {} but rank {} "
                        "called {}",
                        ours, i, theirs)};
  }
  return Status::ok();
}

Status Communicator::execute(const Plan& plan, const CollDesc& d, const Buffers& b,
                             const std::function<std::string()>& what, const Gossip* gossip) {
  const int p = size();
  const bool root = rank() == d.root;
  const bool barrier = d.op == CollOp::kBarrier;
  const auto* send = static_cast<const std::byte*>(b.send);
  auto* recv = static_cast<std::byte*>(b.recv);
  const std::size_t sb =
      !barrier && (d.op != CollOp::kBroadcast || root) && send ? send_bytes(d, p) : 0;
  const std::size_t rb =
      !barrier && (d.op != CollOp::kReduce || root) && recv ? recv_bytes(d, p) : 0;
  // Where each buffer of the plan lives: a region and the buffer's offset in it.
  struct Bound {
    RegionPtr region;
    std::size_t base = 0;
  } bound[3];  // Buf::kSend, kRecv, kScratch
  auto& bsend = bound[static_cast<int>(Buf::kSend)];
  auto& brecv = bound[static_cast<int>(Buf::kRecv)];
  auto& bscratch = bound[static_cast<int>(Buf::kScratch)];
  Registered reg(*this);
  // Small operations run in this communicator's own registered memory: the caller's buffers
  // are copied in and the result copied out, which costs less than registering them (a system
  // call and pinning under verbs) for each operation.
  const bool staged = std::max(sb, rb) <= kStageLimit && sb + rb > 0;
  std::size_t stage_bytes = 0;
  const std::size_t stage_at = (plan.scratch_bytes + 63) / 64 * 64;
  const std::byte* span_lo = nullptr;
  if (staged) {
    if (d.in_place && sb > 0 && rb > 0) {
      // The buffers overlap: stage the span they cover, so that they overlap in the copy too.
      span_lo = std::min<const std::byte*>(send, recv);
      stage_bytes =
          static_cast<std::size_t>(std::max<const std::byte*>(send + sb, recv + rb) - span_lo);
      bsend.base = stage_at + static_cast<std::size_t>(send - span_lo);
      brecv.base = stage_at + static_cast<std::size_t>(recv - span_lo);
    } else {
      bsend.base = stage_at;
      brecv.base = stage_at + (sb + 63) / 64 * 64;
      stage_bytes = brecv.base - stage_at + rb;
    }
  }
  if (plan.scratch_bytes > 0 || staged) {
    R2CCL_ASSIGN_OR_RETURN(bscratch.region, scratch(stage_at + stage_bytes));
  }
  if (gossip) {
    const std::uint64_t mine = link_generation_;
    std::memcpy(bscratch.region->base + gossip->at + 8 * static_cast<std::size_t>(rank()), &mine,
                8);
  }
  if (staged) {
    if (sb > 0) bsend.region = bscratch.region;
    if (rb > 0) brecv.region = bscratch.region;
    std::byte* base = bscratch.region->base;
    if (span_lo)
      std::memcpy(base + stage_at, span_lo, stage_bytes);
    else if (sb > 0)
      std::memcpy(base + bsend.base, send, sb);
  } else {
    if (sb > 0) {
      // The send buffer is only read (plans never receive into it): peers get no write access.
      R2CCL_ASSIGN_OR_RETURN(auto at, reg.add(send, sb, MemoryAccess::kLocal));
      std::tie(bsend.region, bsend.base) = at;
    }
    if (rb > 0) {
      R2CCL_ASSIGN_OR_RETURN(auto at, reg.add(recv, rb, MemoryAccess::kRemoteWrite));
      std::tie(brecv.region, brecv.base) = at;
    }
  }
  auto at = [&](const Ref& ref) -> const Bound& { return bound[static_cast<int>(ref.buf)]; };
  auto ptr = [&](const Ref& ref) -> std::byte* {
    const auto& bd = at(ref);
    return bd.region ? bd.region->base + bd.base + ref.offset : nullptr;
  };
  const std::size_t elem = type_size(d.type);
  const auto transfers_of = [&](const Phase& phase) {
    Transfers transfers;
    for (const auto& s : phase.comm) {
      if (s.bytes == 0) continue;
      const bool is_recv = s.kind == Step::Kind::kRecv;
      const Ref& ref = is_recv ? s.dst : s.a;
      transfers.push_back(
          {is_recv, s.peer, at(ref).region, at(ref).base + ref.offset, s.bytes, s.rails});
    }
    return transfers;
  };
  const auto compute = [&](const Phase& phase) {
    for (const auto& s : phase.compute) {
      if (s.bytes == 0) continue;
      switch (s.kind) {
        case Step::Kind::kReduce:
          coll::reduce(ptr(s.dst), ptr(s.a), ptr(s.b), s.bytes / elem, d.type, d.redop);
          break;
        case Step::Kind::kCopy:
          std::memmove(ptr(s.dst), ptr(s.a), s.bytes);
          break;
        case Step::Kind::kAvg:
          finish_avg(ptr(s.dst), s.bytes / elem, d.type, p);
          break;
        case Step::Kind::kSend:
        case Step::Kind::kRecv:
          break;
      }
    }
  };
  if (plan.lanes > 1) {
    if (Status st = run_lanes(*fabric_, plan, transfers_of, compute); !st)
      return st.with_context(what());
  } else {
    for (std::size_t ph = 0; ph < plan.phases.size(); ++ph) {
      const auto& phase = plan.phases[ph];
      Status st = post_and_wait(*fabric_, transfers_of(phase));
      if (!st)
        return st.with_context(
            fmt::format("{}, step {} of {}", what(), ph + 1, plan.phases.size()));
      compute(phase);
    }
  }
  if (staged && rb > 0) std::memcpy(recv, ptr(Ref{Buf::kRecv, 0}), rb);
  if (gossip) {
    gossip_.resize(static_cast<std::size_t>(p));
    std::memcpy(gossip_.data(), bscratch.region->base + gossip->at, 8 * gossip_.size());
  }
  return Status::ok();
}

// ---- point to point

Status Communicator::check_p2p(const void* buf, std::size_t count, DataType type, int peer,
                               const char* what) const {
  if (aborted_) return {ErrorCode::kAborted, fmt::format("{}: the communicator was aborted", what)};
  if (Status st = check_type(type); !st) return st.with_context(what);
  if (peer < 0 || peer >= size())
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: peer {} is out of range (0..{})", what, peer, size() - 1)};
  if (count > (std::size_t{1} << 47) / type_size(type))
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: count {} of {} overflows the largest buffer size", what, count,
                        type_name(type))};
  if (count > 0 && !buf)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the buffer is null (count {})", what, count)};
  return Status::ok();
}

Status Communicator::send(const void* buf, std::size_t count, DataType type, int peer) {
  R2CCL_RETURN_IF_ERROR(check_p2p(buf, count, type, peer, "send"));
  P2p op{true, const_cast<void*>(buf), count * type_size(type), peer};
  if (group_depth_ > 0) {
    group_.push_back(op);
    return Status::ok();
  }
  return run_p2p({op});
}

Status Communicator::recv(void* buf, std::size_t count, DataType type, int peer) {
  R2CCL_RETURN_IF_ERROR(check_p2p(buf, count, type, peer, "recv"));
  P2p op{false, buf, count * type_size(type), peer};
  if (group_depth_ > 0) {
    group_.push_back(op);
    return Status::ok();
  }
  return run_p2p({op});
}

Status Communicator::group_start() {
  ++group_depth_;
  return Status::ok();
}

Status Communicator::group_end() {
  if (group_depth_ == 0)
    return {ErrorCode::kInvalidArgument, "group_end: no group was started (group_start)"};
  if (--group_depth_ > 0) return Status::ok();
  std::vector<P2p> ops;
  ops.swap(group_);
  return run_p2p(ops);
}

Status Communicator::run_p2p(const std::vector<P2p>& list) {
  Registered reg(*this);
  R2CCL_ASSIGN_OR_RETURN(auto empty, scratch(1));  // zero-byte messages need some region
  Transfers transfers;
  for (const auto& o : list) {
    R2CCL_ASSIGN_OR_RETURN(
        auto at,
        reg.add(o.buf, o.bytes, o.is_send ? MemoryAccess::kLocal : MemoryAccess::kRemoteWrite));
    transfers.push_back({!o.is_send, o.peer, at.first ? at.first : empty, at.second, o.bytes});
  }
  return post_and_wait(*fabric_, transfers);
}

// ---- lifecycle

Result<std::unique_ptr<Communicator>> Communicator::split(int color, int key) {
  if (aborted_) return Status(ErrorCode::kAborted, "split: the communicator was aborted");
  const auto timeout = config().timeout;
  auto& boot = fabric_->bootstrap();
  ByteWriter w;
  w.u32(static_cast<std::uint32_t>(color)).u32(static_cast<std::uint32_t>(key));
  R2CCL_ASSIGN_OR_RETURN(auto all, boot.allgather(w.bytes(), timeout));
  struct Member {
    int color, key, rank;
  };
  std::vector<Member> members;
  for (int i = 0; i < size(); ++i) {
    ByteReader r(all[static_cast<std::size_t>(i)]);
    Member m{static_cast<int>(r.u32()), static_cast<int>(r.u32()), i};
    if (!r.ok())
      return Status(ErrorCode::kProtocol, fmt::format("split: rank {} sent a malformed color", i));
    if (m.color == color && color >= 0) members.push_back(m);
  }
  std::sort(members.begin(), members.end(), [](const Member& a, const Member& b) {
    return a.key != b.key ? a.key < b.key : a.rank < b.rank;
  });
  // The first member of each new communicator creates its unique id; a second all-gather hands
  // the ids out.
  Bytes id_bytes;
  UniqueId id;
  const bool leader = color >= 0 && members.front().rank == rank();
  if (leader) {
    R2CCL_ASSIGN_OR_RETURN(id, UniqueId::create(boot.control_address()));
    id_bytes.assign(reinterpret_cast<const std::byte*>(id.bytes.data()),
                    reinterpret_cast<const std::byte*>(id.bytes.data()) + UniqueId::kSize);
  }
  R2CCL_ASSIGN_OR_RETURN(auto ids, boot.allgather(id_bytes, timeout));
  if (color < 0) return std::unique_ptr<Communicator>{};
  const auto& theirs = ids[static_cast<std::size_t>(members.front().rank)];
  if (theirs.size() != UniqueId::kSize)
    return Status(ErrorCode::kProtocol, "split: the new communicator's first rank sent no id");
  std::memcpy(id.bytes.data(), theirs.data(), UniqueId::kSize);
  int new_rank = 0;
  while (members[static_cast<std::size_t>(new_rank)].rank != rank())
    ++new_rank;
  Config cfg = config();
  cfg.rank.reset();
  cfg.nranks.reset();
  R2CCL_ASSIGN_OR_RETURN(auto opts, BootstrapOptions::from_unique_id(
                                        id, new_rank, static_cast<int>(members.size()), cfg));
  return create(cfg, opts);
}

Result<Communicator::BufferHandle> Communicator::register_buffer(void* base, std::size_t bytes) {
  if (base == nullptr || bytes == 0)
    return Status(ErrorCode::kInvalidArgument, "register_buffer: a null or empty buffer");
  const auto* b = static_cast<const std::byte*>(base);
  std::lock_guard lock(buffers_mutex_);
  // Registered buffers do not overlap, so that the one holding an operation's buffer is unique.
  auto next = buffers_.lower_bound(b);
  const bool overlaps_next = next != buffers_.end() && next->first < b + bytes;
  const bool overlaps_prev =
      next != buffers_.begin() && std::prev(next)->first + std::prev(next)->second->length > b;
  if (overlaps_next || overlaps_prev)
    return Status(ErrorCode::kInvalidArgument,
                  "register_buffer: the buffer overlaps one that is registered already");
  R2CCL_ASSIGN_OR_RETURN(auto region,
                         fabric_->register_memory(base, bytes, MemoryAccess::kRemoteWrite));
  buffers_.emplace(b, region);
  // Operations on it use this registration from now on: cached ones of its range go.
  if (reg_cache_) (void)reg_cache_->invalidate(base, bytes);
  return static_cast<BufferHandle>(region->id);
}

Status Communicator::deregister_buffer(BufferHandle handle) {
  RegionPtr region;
  {
    std::lock_guard lock(buffers_mutex_);
    auto it = std::find_if(buffers_.begin(), buffers_.end(),
                           [&](const auto& kv) { return kv.second->id == handle; });
    if (it == buffers_.end())
      return {ErrorCode::kInvalidArgument,
              fmt::format("deregister_buffer: no buffer is registered with handle {}", handle)};
    region = std::move(it->second);
    buffers_.erase(it);
  }
  // The buffer is likely freed next: nothing cached may name its range either.
  if (reg_cache_) (void)reg_cache_->invalidate(region->base, region->length);
  return fabric_->deregister_memory(region);
}

std::size_t Communicator::invalidate_cache(const void* base, std::size_t bytes) {
  return reg_cache_ ? reg_cache_->invalidate(base, bytes) : 0;
}

std::pair<RegionPtr, std::size_t> Communicator::registered(const void* p, std::size_t bytes) const {
  const auto* b = static_cast<const std::byte*>(p);
  std::lock_guard lock(buffers_mutex_);
  auto it = buffers_.upper_bound(b);
  if (it == buffers_.begin()) return {};
  --it;
  const auto offset = static_cast<std::size_t>(b - it->first);
  if (offset > it->second->length || bytes > it->second->length - offset) return {};
  return {it->second, offset};
}

void Communicator::abort() {
  if (aborted_.exchange(true)) return;
  fabric_->abort(fmt::format("the communicator was aborted on rank {}", rank()));
}

Status Communicator::async_error() const {
  return fabric_->async_error();
}

}  // namespace r2ccl::coll

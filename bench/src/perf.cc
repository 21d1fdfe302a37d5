// r2ccl-perf: benchmarks in the style of nccl-tests.
//
//   R2CCL_RANK=0 R2CCL_NRANKS=2 R2CCL_BOOTSTRAP=198.19.0.1:29500 r2ccl-perf allreduce -b 8 -e 64M
//   -d bf16 -o sum -c 1
//
// sendrecv: every rank sends to rank+1 and receives from rank-1 (as nccl-tests' sendrecv);
// allreduce, allgather, reducescatter, broadcast, reduce: the communicator's collectives, with
// nccl-tests' sizes, columns and bus-bandwidth factors. Rank 0 prints the table. Exit status: 0
// when every check passed, 1 when any element was wrong, 2 on bad arguments or any operation
// error.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/coll/host_staging.h"
#include "r2ccl/coll/staged.h"
#include "r2ccl/coll/verify.h"
#include "r2ccl/monitor/job_metrics.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/fabric.h"
#include "r2ccl/runtime/log.h"

namespace {

using r2ccl::Bytes;
using r2ccl::Fabric;
using r2ccl::Result;
using r2ccl::Status;
using Clock = std::chrono::steady_clock;
using r2ccl::coll::CollOp;
using r2ccl::coll::Communicator;
using r2ccl::coll::DataType;
using r2ccl::coll::RedOp;

struct Options {
  std::string op = "sendrecv";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  double step_factor = 2;
  int iters = 20;
  int warmup = 5;
  int settle = 0;  // untimed operations of the smallest size before the first row
  int check = 0;
  bool rails = false;
  std::string json_path;
  double duration = 0;       // > 0: iterate for this many seconds instead of -n
  bool keep_going = false;   // with --duration: a failed round is reported, not fatal
  bool oneway = false;       // sendrecv: even ranks send, odd ranks receive
  std::string events_path;   // rail events as JSON lines
  std::string samples_path;  // with --duration: per-rail counters over time, as JSON lines
  bool latency = false;      // time every timed operation: percentiles on rank 0
  std::string type = "float";
  std::string redop = "sum";
  int root = 0;
  bool staged = false;      // device-memory path with the host stand-in for a device
  bool graph = false;       // with --staged: each size captured once and replayed
  bool registered = false;  // --register
};

// One reading of every rail's counters (--rail-samples), taken between rounds.
struct RailSample {
  std::int64_t wall_ns = 0;  // CLOCK_REALTIME, as the rail events
  std::vector<r2ccl::RailSnapshot> rails;
};
constexpr auto kSampleEvery = std::chrono::milliseconds(200);
constexpr std::size_t kMaxSamples = 100000;  // about 5.5 hours at one every 200 ms

std::int64_t wall_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void write_samples(const std::string& path, const std::vector<RailSample>& samples) {
  std::ofstream out(path);
  for (const auto& s : samples) {
    nlohmann::json rails = nlohmann::json::array();
    for (const auto& r : s.rails)
      rails.push_back({{"peer", r.peer},
                       {"rail", r.rail},
                       {"nic", r.nic},
                       {"remote_nic", r.remote_nic},
                       {"state", std::string(r2ccl::rail_state_name(r.state))},
                       {"tx_bytes", r.tx_bytes},
                       {"rx_bytes", r.rx_bytes},
                       {"replayed_chunks", r.replayed_chunks},
                       {"replayed_bytes", r.replayed_bytes}});
    out << nlohmann::json{{"wall_ns", s.wall_ns}, {"rails", rails}}.dump() << "\n";
  }
}

// p1, p50, p90, p99 and the maximum of `v` (nearest rank; v is sorted here).
std::array<double, 5> percentiles(std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  const auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
  };
  return {at(0.01), at(0.50), at(0.90), at(0.99), v.back()};
}

// The byte at `i` of the message rank `src` sends in round `round`.
void fill_pattern(std::byte* p, std::size_t n, int src, std::uint64_t round) {
  std::uint64_t seed = (static_cast<std::uint64_t>(src) + 1) * 0x9E3779B97F4A7C15ull ^
                       (round * 0xD1B54A32D192ED03ull);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t x = (seed + (i >> 3) * 0xBF58476D1CE4E5B9ull);
    p[i] = static_cast<std::byte>((x ^ (x >> 29)) >> (8 * (i & 7)));
  }
}

std::uint64_t count_wrong(const std::byte* p, std::size_t n, int src, std::uint64_t round) {
  std::vector<std::byte> want(n);
  fill_pattern(want.data(), n, src, round);
  std::uint64_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i)
    wrong += p[i] != want[i];
  return wrong;
}

struct Gathered {
  double max_seconds = 0;
  std::uint64_t wrong = 0;
  std::string error;  // every failed rank's error, one per line
};

// Agrees on results across ranks over the control path: max time, total wrong, every error.
Result<Gathered> gather(Fabric& f, double seconds, std::uint64_t wrong, const std::string& error) {
  r2ccl::ByteWriter w;
  std::uint64_t bits;
  std::memcpy(&bits, &seconds, sizeof bits);
  w.u64(bits).u64(wrong).str(error);
  R2CCL_ASSIGN_OR_RETURN(auto all, f.bootstrap().allgather(w.bytes(), 2 * f.config().timeout +
                                                                          std::chrono::seconds(5)));
  Gathered g;
  for (std::size_t r = 0; r < all.size(); ++r) {
    r2ccl::ByteReader rd(all[r]);
    std::uint64_t b = rd.u64();
    double s;
    std::memcpy(&s, &b, sizeof s);
    g.max_seconds = std::max(g.max_seconds, s);
    g.wrong += rd.u64();
    std::string e = rd.str();
    // Every failed rank's own error: a rank that waits on another names only the symptom.
    if (!e.empty()) g.error += fmt::format("{}rank {}: {}", g.error.empty() ? "" : "\n  ", r, e);
  }
  return g;
}

// One benchmarked operation: its sizes, timing runs and checked runs.
class Bench {
 public:
  virtual ~Bench() = default;
  virtual Status init() = 0;
  // The size actually run for a requested size (whole elements; all-gather and reduce-scatter:
  // a multiple of the rank count), and its element count as nccl-tests prints it.
  virtual std::size_t round_bytes(std::size_t bytes) const { return bytes; }
  virtual std::size_t count(std::size_t bytes) const { return bytes; }
  virtual Status run_once(std::size_t bytes) = 0;
  // One checked round: fresh data per round, outputs poisoned first; returns wrong elements.
  virtual Result<std::uint64_t> checked(std::size_t bytes, std::uint64_t round) = 0;
  // nccl-tests' bus bandwidth factor.
  virtual double busbw_factor() const { return 1.0; }
  virtual std::string type() const { return "uint8"; }
  virtual std::string redop() const { return "none"; }
  virtual int root() const { return -1; }
  virtual std::string algo() const { return "p2p"; }
  // Degraded mode: the table the ranks agreed on last (empty when none was).
  virtual nlohmann::json agreed() const { return nullptr; }
  // Lines the ranks up before the timed rounds: by default on the bootstrap's control path; a
  // collective bench uses its own barrier, on the rails (as MPI benchmarks use MPI_Barrier).
  virtual Status barrier(Fabric& f) { return f.bootstrap().barrier(f.config().timeout); }
  // The fabric whose rails carry the data (its counters and events are reported).
  virtual Fabric* rails() { return nullptr; }
};

// Every rank sends to rank+1 and receives from rank-1 over the fabric.
// With `oneway`, data flows one way per pair: even ranks send to rank+1, odd ranks receive from
// rank-1 (a link's one-directional rate, as ib_write_bw measures it).
class SendRecv final : public Bench {
 public:
  SendRecv(Fabric& f, std::size_t max_bytes, bool oneway)
      : f_(f), oneway_(oneway), send_(max_bytes), recv_(max_bytes) {}

  Status init() override {
    auto s = f_.register_memory(send_.data(), send_.size());
    if (!s) return s.status();
    auto r = f_.register_memory(recv_.data(), recv_.size());
    if (!r) return r.status();
    send_region_ = *s;
    recv_region_ = *r;
    return Status::ok();
  }

  Status run_once(std::size_t bytes) override {
    const int me = f_.rank();
    const int n = f_.nranks();
    const int to = (me + 1) % n;
    const int from = (me - 1 + n) % n;
    if (oneway_) {
      auto op = me % 2 == 0 ? f_.isend(to, send_region_, 0, bytes)
                            : f_.irecv(from, recv_region_, 0, bytes);
      if (!op) return op.status();
      return f_.wait(*op);
    }
    auto rop = f_.irecv(from, recv_region_, 0, bytes);
    if (!rop) return rop.status();
    auto sop = f_.isend(to, send_region_, 0, bytes);
    if (!sop) return sop.status();
    Status st = f_.wait(*sop);
    Status rt = f_.wait(*rop);
    if (!st) return st;
    return rt;
  }

  // One checked round: distinct data per round, receive buffer poisoned first.
  Result<std::uint64_t> checked(std::size_t bytes, std::uint64_t round) override {
    const int from = (f_.rank() - 1 + f_.nranks()) % f_.nranks();
    fill_pattern(send_.data(), bytes, f_.rank(), round);
    std::fill_n(recv_.begin(), bytes, std::byte{0xEE});
    R2CCL_RETURN_IF_ERROR(run_once(bytes));
    if (oneway_ && f_.rank() % 2 == 0) return std::uint64_t{0};  // a sender receives nothing
    return count_wrong(recv_.data(), bytes, from, round);
  }

 private:
  Fabric& f_;
  bool oneway_;
  std::vector<std::byte> send_;
  std::vector<std::byte> recv_;
  r2ccl::RegionPtr send_region_;
  r2ccl::RegionPtr recv_region_;
};

// A collective through the communicator, with nccl-tests' size conventions: the size is the
// all-reduce/broadcast/reduce buffer, all-gather's receive buffer, reduce-scatter's send buffer.
class Collective final : public Bench {
 public:
  // staged: through StagedComm with the host stand-in for a device (its stream a HostStream);
  // graph: each size's call captured once and replayed from then on.
  // registered: the buffers are registered with the communicator once (register_buffer), so
  // that no operation registers them itself.
  Collective(Communicator& c, CollOp op, DataType t, RedOp r, int root, std::size_t max_bytes,
             bool staged, bool graph, bool registered)
      : c_(c),
        op_(op),
        t_(t),
        r_(r),
        root_(root),
        send_(max_bytes + 64),
        recv_(max_bytes + 64),
        staged_(staged),
        graph_(graph),
        registered_(registered) {}

  Status init() override {
    if (root_ < 0 || root_ >= c_.size())
      return {r2ccl::ErrorCode::kInvalidArgument,
              fmt::format("root {} is out of range (0..{})", root_, c_.size() - 1)};
    R2CCL_RETURN_IF_ERROR(uses_redop() ? r2ccl::coll::check_type_and_op(t_, r_) : Status::ok());
    if (registered_) {
      if (staged_)
        return {r2ccl::ErrorCode::kInvalidArgument, "--register applies to host collectives only"};
      for (auto* v : {&send_, &recv_}) {
        auto h = c_.register_buffer(v->data(), v->size());
        if (!h) return h.status().with_context("--register");
      }
    }
    if (!staged_) return Status::ok();
    r2ccl::coll::StagedComm::Options options;
    options.chunk_bytes = c_.config().gpu_staging_chunk;
    options.window = c_.config().gpu_staging_window;
    R2CCL_ASSIGN_OR_RETURN(staged_comm_,
                           r2ccl::coll::StagedComm::create(
                               c_, std::make_shared<r2ccl::coll::HostStagingDevice>(), options));
    stream_ = std::make_unique<r2ccl::coll::HostStream>();
    return Status::ok();
  }
  Fabric* rails() override {
    return staged_comm_ ? &staged_comm_->communicator().fabric() : nullptr;
  }
  std::size_t round_bytes(std::size_t bytes) const override {
    const std::size_t unit = r2ccl::coll::type_size(t_) * (per_rank() ? p() : 1);
    return bytes / unit * unit;
  }
  std::size_t count(std::size_t bytes) const override { return bytes / r2ccl::coll::type_size(t_); }
  double busbw_factor() const override {
    const double n = static_cast<double>(p());
    if (op_ == CollOp::kAllReduce) return 2 * (n - 1) / n;
    if (per_rank()) return (n - 1) / n;
    return 1;
  }
  std::string type() const override { return std::string(r2ccl::coll::type_name(t_)); }
  std::string redop() const override {
    return uses_redop() ? std::string(r2ccl::coll::redop_name(r_)) : "none";
  }
  int root() const override { return has_root() ? root_ : -1; }
  std::string algo() const override {
    if (staged_) return graph_ ? "staged, graph" : "staged";
    return std::string(r2ccl::coll::algo_name(c_.last_algo()));
  }
  nlohmann::json agreed() const override {
    const auto& net = c_.agreed_network();
    if (net.bandwidth.empty()) return nullptr;
    return {{"bandwidth_bps", net.bandwidth},
            {"rails_up", net.rails_up},
            {"agreements", c_.agreements()},
            {"latency_s", net.latency_s},
            {"degraded", r2ccl::coll::is_degraded(net)},
            {"plan", algo()}};
  }
  Status barrier(Fabric&) override { return c_.barrier(); }

  Status run_once(std::size_t bytes) override {
    if (staged_) return run_staged(bytes);
    const std::size_t n = count(bytes) / (per_rank() ? p() : 1);  // the call's count argument
    switch (op_) {
      case CollOp::kAllReduce:
        return c_.all_reduce(send_.data(), recv_.data(), n, t_, r_);
      case CollOp::kAllGather:
        return c_.all_gather(send_.data(), recv_.data(), n, t_);
      case CollOp::kReduceScatter:
        return c_.reduce_scatter(send_.data(), recv_.data(), n, t_, r_);
      case CollOp::kBroadcast:
        return c_.broadcast(send_.data(), recv_.data(), n, t_, root_);
      case CollOp::kReduce:
        return c_.reduce(send_.data(), recv_.data(), n, t_, r_, root_);
      case CollOp::kBarrier:
        return c_.barrier();
    }
    return Status::ok();
  }

  Result<std::uint64_t> checked(std::size_t bytes, std::uint64_t round) override {
    using r2ccl::coll::test_value;
    const std::size_t total = count(bytes), e = r2ccl::coll::type_size(t_);
    const std::size_t n = total / (per_rank() ? p() : 1);
    const int me = c_.rank();
    const std::size_t send_elems = op_ == CollOp::kAllGather ? n : total;
    for (std::size_t i = 0; i < send_elems; ++i)
      r2ccl::coll::set_element(send_.data(), i, t_, test_value(me, i, round, r_));
    std::fill_n(recv_.begin(), bytes, std::byte{0xEE});
    R2CCL_RETURN_IF_ERROR(run_once(bytes));
    if (op_ == CollOp::kReduce && me != root_) return std::uint64_t{0};
    const std::size_t recv_elems = op_ == CollOp::kReduceScatter ? n : total;
    std::uint64_t wrong = 0;
    std::vector<double> in(static_cast<std::size_t>(p()));
    std::byte tmp[8];
    auto value = [&](int rank, std::size_t i) {  // as stored in the type
      r2ccl::coll::set_element(tmp, 0, t_, test_value(rank, i, round, r_));
      return r2ccl::coll::get_element(tmp, 0, t_);
    };
    for (std::size_t i = 0; i < recv_elems; ++i) {
      const std::byte* got = recv_.data() + i * e;
      if (op_ == CollOp::kAllGather || op_ == CollOp::kBroadcast) {
        const int src = op_ == CollOp::kBroadcast ? root_ : static_cast<int>(i / n);
        const double want = value(src, op_ == CollOp::kBroadcast ? i : i % n);
        wrong += r2ccl::coll::get_element(got, 0, t_) != want;
        continue;
      }
      const std::size_t at =
          op_ == CollOp::kReduceScatter ? static_cast<std::size_t>(me) * n + i : i;
      for (int q = 0; q < c_.size(); ++q)
        in[static_cast<std::size_t>(q)] = value(q, at);
      wrong += !r2ccl::coll::matches_reduction(got, in, t_, r_);
    }
    return wrong;
  }

 private:
  std::size_t p() const { return static_cast<std::size_t>(c_.size()); }
  bool per_rank() const { return op_ == CollOp::kAllGather || op_ == CollOp::kReduceScatter; }
  bool uses_redop() const {
    return op_ == CollOp::kAllReduce || op_ == CollOp::kReduceScatter || op_ == CollOp::kReduce;
  }
  bool has_root() const { return op_ == CollOp::kBroadcast || op_ == CollOp::kReduce; }

  Status enqueue_staged(std::size_t n) {
    void* s = stream_.get();
    auto& g = *staged_comm_;
    switch (op_) {
      case CollOp::kAllReduce:
        return g.all_reduce(send_.data(), recv_.data(), n, t_, r_, s);
      case CollOp::kAllGather:
        return g.all_gather(send_.data(), recv_.data(), n, t_, s);
      case CollOp::kReduceScatter:
        return g.reduce_scatter(send_.data(), recv_.data(), n, t_, r_, s);
      case CollOp::kBroadcast:
        return g.broadcast(send_.data(), recv_.data(), n, t_, root_, s);
      case CollOp::kReduce:
        return g.reduce(send_.data(), recv_.data(), n, t_, r_, root_, s);
      case CollOp::kBarrier:
        break;
    }
    return Status::ok();
  }
  Status run_staged(std::size_t bytes) {
    const std::size_t n = count(bytes) / (per_rank() ? p() : 1);
    if (!graph_) {
      R2CCL_RETURN_IF_ERROR(enqueue_staged(n));
    } else {
      auto& graph = graphs_[bytes];
      if (!graph) {
        stream_->begin_capture();
        const Status st = enqueue_staged(n);
        graph = stream_->end_capture();
        R2CCL_RETURN_IF_ERROR(st);
      }
      stream_->launch(*graph);
    }
    stream_->synchronize();
    return staged_comm_->error();
  }

  Communicator& c_;
  CollOp op_;
  DataType t_;
  RedOp r_;
  int root_;
  std::vector<std::byte> send_, recv_;
  bool staged_ = false, graph_ = false, registered_ = false;
  std::unique_ptr<r2ccl::coll::StagedComm> staged_comm_;
  std::unique_ptr<r2ccl::coll::HostStream> stream_;  // after the communicator: goes first
  std::map<std::size_t, std::unique_ptr<r2ccl::coll::HostGraph>> graphs_;
};

std::string mbps(double bytes, double seconds) {
  return seconds > 0 ? fmt::format("{:.2f}", bytes / seconds / 1e6) : "-";
}

int run(const Options& o) {
  auto cfg = r2ccl::parse_config(r2ccl::process_env());
  if (!cfg) {
    fmt::print(stderr, "r2ccl-perf: {}\n", cfg.status().message());
    return 2;
  }
  r2ccl::set_log_level(cfg->log_level);
  auto minb = r2ccl::parse_size(o.min_bytes);
  auto maxb = r2ccl::parse_size(o.max_bytes);
  if (!minb || !maxb || *minb > *maxb || o.step_factor <= 1 || o.iters < 1 || o.warmup < 0 ||
      o.settle < 0) {
    fmt::print(stderr,
               "r2ccl-perf: bad sizes: -b {} -e {} -f {} -n {} -w {} -W {} (need -b <= -e, -f > 1, "
               "-n >= 1, -w >= 0, -W >= 0)\n",
               o.min_bytes, o.max_bytes, o.step_factor, o.iters, o.warmup, o.settle);
    return 2;
  }
  auto type = r2ccl::coll::parse_type(o.type);
  auto redop = r2ccl::coll::parse_redop(o.redop);
  for (const Status& st : {type.status(), redop.status()})
    if (!st) {
      fmt::print(stderr, "r2ccl-perf: {}\n", st.message());
      return 2;
    }
  auto boot = r2ccl::BootstrapOptions::from_config(*cfg);
  if (!boot) {
    fmt::print(stderr, "r2ccl-perf: {}\n", boot.status().message());
    return 2;
  }
  auto comm = Communicator::create(*cfg, *boot);
  if (!comm) {
    fmt::print(stderr, "r2ccl-perf: rank {}: {}\n", boot->rank, comm.status().to_string());
    return 2;
  }
  Fabric& f = (*comm)->fabric();
  auto metrics = r2ccl::mon::JobMetrics::start(*cfg, f);  // when R2CCL_METRICS_PORT is set
  const bool root = f.rank() == 0;
  std::unique_ptr<Bench> made;
  if (o.oneway && o.op != "sendrecv") {
    fmt::print(stderr, "r2ccl-perf: --oneway applies to sendrecv only, not {}\n", o.op);
    return 2;
  }
  if (o.op == "sendrecv") {
    if (o.oneway && f.nranks() % 2 != 0) {
      fmt::print(stderr, "r2ccl-perf: --oneway needs an even number of ranks, not {}\n",
                 f.nranks());
      return 2;
    }
    made = std::make_unique<SendRecv>(f, *maxb, o.oneway);
  } else {
    CollOp op = CollOp::kAllReduce;  // the command line admits only the five names below
    for (CollOp c : {CollOp::kAllReduce, CollOp::kAllGather, CollOp::kReduceScatter,
                     CollOp::kBroadcast, CollOp::kReduce})
      if (r2ccl::coll::coll_op_name(c) == o.op) op = c;
    made = std::make_unique<Collective>(**comm, op, *type, *redop, o.root, *maxb, o.staged, o.graph,
                                        o.registered);
  }
  Bench& bench = *made;
  if (Status st = bench.init(); !st) {
    fmt::print(stderr, "r2ccl-perf: rank {}: {}\n", f.rank(), st.to_string());
    return 2;
  }
  Fabric& rails = bench.rails() != nullptr ? *bench.rails() : f;
  if (o.graph && !o.staged) {
    fmt::print(stderr, "r2ccl-perf: --graph applies to --staged only\n");
    return 2;
  }

  nlohmann::json report;
  report["op"] = o.op;
  report["nranks"] = f.nranks();
  report["rails"] = f.nics().size();
  report["results"] = nlohmann::json::array();
  if (root) {
    fmt::print(
        "# r2ccl-perf {}: {} ranks, {} rail(s) per rank ({}), chunk {}, provider {}\n", o.op,
        f.nranks(), f.nics().size(),
        [&] {
          std::string s;
          for (const auto& n : f.nics())
            s += (s.empty() ? "" : ",") + n.name;
          return s;
        }(),
        r2ccl::format_size(f.config().chunk_size), f.config().provider);
    fmt::print("#\n# {:>12} {:>12} {:>8} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}  {}\n", "size",
               "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "algo");
    fmt::print("# {:>12} {:>12} {:>8} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}\n", "(B)", "(elements)",
               "", "", "", "(us)", "(GB/s)", "(GB/s)", "");
  }
  int exit_code = 0;
  int failed_rounds = 0;
  int good_rounds = 0;
  double busbw_sum = 0;
  int rows = 0;
  std::uint64_t round = 0;
  std::vector<r2ccl::RailSnapshot> before, after;
  std::vector<r2ccl::RailEvent> events;  // as of the end of the timed work (not the peer's exit)
  double last_seconds = 0;
  std::vector<double> op_us;  // --latency: this size's operations, one by one
  // --duration: each verified round's start (seconds into the size's run), time and plan, as
  // this rank saw them.
  struct Round {
    double start_s, wall_s, seconds;
    std::string algo;
  };
  constexpr std::size_t kMaxRounds = 100000;
  std::vector<Round> rounds;
  std::vector<std::string> tails;  // --latency: the percentile lines, printed after the table
  for (int i = 0; i < o.settle && exit_code == 0; ++i)
    if (Status st = bench.run_once(bench.round_bytes(*minb)); !st) {
      fmt::print(stderr, "r2ccl-perf: rank {}: settling before the first size failed: {}\n",
                 f.rank(), st.to_string());
      exit_code = 1;
    }
  for (std::size_t requested = *minb; requested <= *maxb && exit_code == 0;) {
    const std::size_t bytes = bench.round_bytes(requested);
    std::string error;
    std::uint64_t wrong = 0;
    for (int i = 0; i < o.warmup && error.empty(); ++i)
      if (Status st = bench.run_once(bytes); !st) error = st.to_string();
    if (error.empty())
      if (Status st = bench.barrier(f); !st) error = st.to_string();
    before = rails.rail_snapshot();
    const auto t0 = Clock::now();
    int iters = 0;
    std::vector<RailSample> samples;
    auto sampled = t0;
    if (!o.samples_path.empty()) samples.push_back({wall_now_ns(), before});
    if (o.duration > 0) {
      // Until time is up (rank 0's clock decides, every round, on the control path); with -c 1
      // every round carries fresh data and is verified, so faults injected meanwhile are checked.
      bool stop = false;
      while (!stop && error.empty()) {
        std::string failed;
        const auto round_start = Clock::now();
        const double round_wall = static_cast<double>(wall_now_ns()) * 1e-9;
        if (o.check) {
          auto w = bench.checked(bytes, ++round);
          if (w)
            wrong += *w;
          else
            failed = w.status().to_string();
        } else if (Status st = bench.run_once(bytes); !st) {
          failed = st.to_string();
        }
        if (!failed.empty()) {
          if (!o.keep_going) {
            error = failed;
          } else {
            // Report it, remember it for the exit status, and go on with the next round.
            fmt::print(stderr, "r2ccl-perf: rank {}: round {} failed: {}\n", f.rank(), iters,
                       failed);
            ++failed_rounds;
          }
        } else {
          ++good_rounds;
          if (rounds.size() < kMaxRounds)
            rounds.push_back({std::chrono::duration<double>(round_start - t0).count(), round_wall,
                              std::chrono::duration<double>(Clock::now() - round_start).count(),
                              bench.algo()});
        }
        ++iters;
        if (!o.samples_path.empty() && Clock::now() - sampled >= kSampleEvery &&
            samples.size() < kMaxSamples) {
          sampled = Clock::now();
          samples.push_back({wall_now_ns(), rails.rail_snapshot()});
        }
        const bool up = std::chrono::duration<double>(Clock::now() - t0).count() >= o.duration;
        // Ranks may leave a round up to a deadline apart (one fails at it, another is still
        // making progress): the vote waits for that.
        auto votes = f.bootstrap().allgather(r2ccl::ByteWriter().u8(up ? 1 : 0).bytes(),
                                             2 * f.config().timeout + std::chrono::seconds(5));
        if (!votes) {
          if (error.empty()) error = votes.status().to_string();
          break;
        }
        stop = !(*votes)[0].empty() && (*votes)[0][0] != std::byte{0};
      }
    } else {
      op_us.clear();
      for (; iters < o.iters && error.empty(); ++iters) {
        const auto a = o.latency ? Clock::now() : Clock::time_point{};
        if (Status st = bench.run_once(bytes); !st) error = st.to_string();
        if (o.latency)
          op_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - a).count());
      }
    }
    iters = std::max(iters, 1);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    after = rails.rail_snapshot();
    events = rails.rail_events();
    if (!o.samples_path.empty()) {
      samples.push_back({wall_now_ns(), after});
      // Every rank writes its own file (PATH.rankN); the last size's run is the one kept.
      write_samples(fmt::format("{}.rank{}", o.samples_path, f.rank()), samples);
    }
    if (o.check && error.empty() && o.duration <= 0) {
      auto w = bench.checked(bytes, ++round);
      if (w)
        wrong = *w;
      else
        error = w.status().to_string();
    }
    if (!rounds.empty()) {
      auto& list = report["rounds"] = nlohmann::json::array();
      for (const auto& r : rounds)
        list.push_back({{"bytes", bytes},
                        {"start_s", r.start_s},
                        {"wall_s", r.wall_s},
                        {"seconds", r.seconds},
                        {"algo", r.algo}});
      rounds.clear();
    }
    auto g = gather(f, seconds / iters, wrong, error);
    if (!g) {
      // This rank's own error first: it is the cause (the exchange failing follows from it).
      if (!error.empty()) fmt::print(stderr, "r2ccl-perf: rank {}: {}\n", f.rank(), error);
      fmt::print(stderr, "r2ccl-perf: rank {}: {}\n", f.rank(), g.status().to_string());
      return 2;
    }
    last_seconds = g->max_seconds * iters;
    const double algbw = static_cast<double>(bytes) / g->max_seconds / 1e9;
    const double busbw = algbw * bench.busbw_factor();
    if (!g->error.empty()) {
      if (root) fmt::print(stderr, "r2ccl-perf: {} bytes failed: {}\n", bytes, g->error);
      exit_code = 2;
      break;
    }
    if (g->wrong) exit_code = std::max(exit_code, 1);
    busbw_sum += busbw;
    ++rows;
    if (root)
      fmt::print("  {:>12} {:>12} {:>8} {:>6} {:>5} {:>10.1f} {:>8.3f} {:>8.3f} {:>7}  {}\n", bytes,
                 bench.count(bytes), bench.type(), bench.redop(), bench.root(),
                 g->max_seconds * 1e6, algbw, busbw, o.check ? std::to_string(g->wrong) : "N/A",
                 bench.algo());
    std::fflush(stdout);
    report["results"].push_back({{"bytes", bytes},
                                 {"iters", iters},
                                 {"count", bench.count(bytes)},
                                 {"type", bench.type()},
                                 {"redop", bench.redop()},
                                 {"algo", bench.algo()},
                                 {"time_us", g->max_seconds * 1e6},
                                 {"algbw_gbps", algbw},
                                 {"busbw_gbps", busbw},
                                 {"wrong", o.check ? nlohmann::json(g->wrong) : nlohmann::json()}});
    if (o.latency && !op_us.empty()) {
      const auto p = percentiles(op_us);
      report["results"].back()["latency_us"] = {
          {"p1", p[0]}, {"p50", p[1]}, {"p90", p[2]}, {"p99", p[3]}, {"max", p[4]}};
      tails.push_back(fmt::format("  {:>12} {:>8} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>10.1f}",
                                  bytes, op_us.size(), p[0], p[1], p[2], p[3], p[4]));
    }
    const auto next = static_cast<std::size_t>(static_cast<double>(requested) * o.step_factor);
    requested = next > requested ? next : requested + 1;
  }
  if (root && rows > 0) {
    fmt::print("# Out of bounds values : {} {}\n", exit_code == 1 ? "some" : "0",
               exit_code == 0 ? "OK" : "FAILED");
    fmt::print("# Avg bus bandwidth    : {:.4f} GB/s\n#\n", busbw_sum / rows);
  }
  if (const auto agreed = bench.agreed(); !agreed.is_null()) {
    report["agreed"] = agreed;
    if (root) {
      std::string ranks;
      for (std::size_t i = 0; i < agreed["bandwidth_bps"].size(); ++i)
        ranks += fmt::format(" {:.1f}/{:#x}", agreed["bandwidth_bps"][i].get<double>() / 1e6,
                             agreed["rails_up"][i].get<std::uint64_t>());
      fmt::print(
          "# Degraded mode: ranks agreed on (MB/s / rails up){}; latency {:.3f} ms; {}; "
          "last plan {}\n#\n",
          ranks, agreed["latency_s"].get<double>() * 1e3,
          agreed["degraded"].get<bool>() ? "unequal" : "equal", agreed["plan"].get<std::string>());
    }
  }
  report["avg_busbw_gbps"] = rows ? busbw_sum / rows : 0.0;
  if (root && !tails.empty()) {
    fmt::print("# Time of each operation on rank 0 (us), percentiles over the timed iterations:\n");
    fmt::print("# {:>12} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10}\n", "size (B)", "ops", "p1", "p50",
               "p90", "p99", "max");
    for (const auto& line : tails)
      fmt::print("{}\n", line);
  }

  // Per-rail bytes and throughput of the last (largest) size's timed iterations, on this rank.
  nlohmann::json rail_rows = nlohmann::json::array();
  for (std::size_t i = 0; i < after.size() && i < before.size(); ++i) {
    const auto& a = after[i];
    const auto& b = before[i];
    const double tx = static_cast<double>(a.tx_bytes - b.tx_bytes);
    const double rx = static_cast<double>(a.rx_bytes - b.rx_bytes);
    rail_rows.push_back({{"peer", a.peer},
                         {"rail", a.rail},
                         {"nic", a.nic},
                         {"remote_nic", a.remote_nic},
                         {"state", std::string(r2ccl::rail_state_name(a.state))},
                         {"tx_bytes", tx},
                         {"rx_bytes", rx},
                         {"tx_mbps", last_seconds > 0 ? tx / last_seconds / 1e6 : 0.0},
                         {"replayed_chunks", a.replayed_chunks},
                         {"failovers", a.failovers},
                         {"flaps", a.flaps},
                         {"weight", a.weight},
                         {"bandwidth_bps", a.bandwidth_bps}});
  }
  report["rail_stats"] = rail_rows;
  if (!o.events_path.empty()) {
    // Every rank writes its own file: PATH.rankN.
    std::ofstream ev(fmt::format("{}.rank{}", o.events_path, f.rank()));
    for (const auto& e : events)
      ev << nlohmann::json{{"wall_ns", e.wall_ns}, {"rank", f.rank()}, {"peer", e.peer},
                           {"rail", e.rail},       {"nic", e.nic},     {"kind", e.kind},
                           {"detail", e.detail}}
                .dump()
         << "\n";
    // The final state of every rail (flaps, hold-down, failovers).
    for (const auto& r : after)
      ev << nlohmann::json{{"kind", "final"},
                           {"rank", f.rank()},
                           {"peer", r.peer},
                           {"rail", r.rail},
                           {"nic", r.nic},
                           {"state", std::string(r2ccl::rail_state_name(r.state))},
                           {"flaps", r.flaps},
                           {"failovers", r.failovers},
                           {"holddown_ms", r.holddown_ms},
                           {"replayed_chunks", r.replayed_chunks},
                           {"weight", r.weight},
                           {"bandwidth_bps", r.bandwidth_bps},
                           {"tx_bytes", r.tx_bytes},
                           {"epoch", r.epoch}}
                .dump()
         << "\n";
  }
  if (o.rails && root) {
    double total = 0;
    for (const auto& r : rail_rows)
      total += r["tx_bytes"].get<double>();
    fmt::print("# Per-rail traffic of rank 0, last size's timed iterations ({:.3f} s):\n",
               last_seconds);
    fmt::print("# {:>4} {:>4} {:<22} {:>9} {:>12} {:>12} {:>7} {:>10}\n", "peer", "rail",
               "nic -> remote nic", "state", "tx (MB)", "rx (MB)", "share", "tx MB/s");
    for (const auto& r : rail_rows) {
      const double tx = r["tx_bytes"].get<double>();
      fmt::print("  {:>4} {:>4} {:<22} {:>9} {:>12.2f} {:>12.2f} {:>6.1f}% {:>10}\n",
                 r["peer"].get<int>(), r["rail"].get<int>(),
                 r["nic"].get<std::string>() + " -> " + r["remote_nic"].get<std::string>(),
                 r["state"].get<std::string>(), tx / 1e6, r["rx_bytes"].get<double>() / 1e6,
                 total > 0 ? 100.0 * tx / total : 0.0, mbps(tx, last_seconds));
    }
    fmt::print("  total tx {:.2f} MB in {:.3f} s = {} MB/s\n", total / 1e6, last_seconds,
               mbps(total, last_seconds));
  }
  if (root && !o.json_path.empty()) {
    std::ofstream out(o.json_path);
    out << report.dump(2) << "\n";
  }
  if (o.keep_going)
    fmt::print(stderr, "r2ccl-perf: rank {}: {} round(s) completed, {} failed\n", f.rank(),
               good_rounds, failed_rounds);
  if (root && o.check) {
    if (exit_code == 0 && failed_rounds > 0)
      fmt::print(
          "# Check: every byte of the {} completed round(s) verified on every rank; {} round(s) "
          "failed\n",
          good_rounds, failed_rounds);
    else
      fmt::print("# Check: {}\n", exit_code == 0 ? "every byte verified on every rank" : "FAILED");
  }
  if (failed_rounds > 0) exit_code = std::max(exit_code, 2);
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"r2ccl-perf: nccl-tests style benchmarks over r2ccl's multi-rail fabric"};
  Options o;
  bool print_reference = false;
  app.add_option("op", o.op, "operation")
      ->check(CLI::IsMember(
          {"sendrecv", "allreduce", "allgather", "reducescatter", "broadcast", "reduce"}));
  app.add_option("-o,--op", o.redop, "reduction: sum prod min max avg");
  app.add_option("-d,--datatype", o.type,
                 "float half bfloat16 double int32 int64 uint8 (or f32 f16 bf16 f64 i32 i64 u8)");
  app.add_option("-r,--root", o.root, "root rank of broadcast and reduce");
  app.add_option("-b,--minbytes", o.min_bytes, "smallest size (e.g. 8, 4K, 1M)");
  app.add_option("-e,--maxbytes", o.max_bytes, "largest size");
  app.add_option("-f,--stepfactor", o.step_factor, "multiply the size by this between rows");
  app.add_option("-n,--iters", o.iters, "timed iterations per size");
  app.add_option("-w,--warmup_iters", o.warmup, "warm-up iterations per size");
  app.add_option("-W,--settle", o.settle,
                 "untimed operations of the smallest size before the first (they let the "
                 "processes settle onto cores)");
  app.add_option("-c,--check", o.check, "1: check every byte on every rank");
  app.add_flag("--staged", o.staged,
               "collectives through the staged device path (StagedComm), with host threads "
               "standing in for the GPU and its stream");
  app.add_flag("--graph", o.graph, "with --staged: each size's call captured once and replayed");
  app.add_flag("--register", o.registered,
               "register the buffers with the communicator once, before the first operation");
  app.add_flag("--rails", o.rails, "print per-rail bytes and throughput");
  app.add_option("--json", o.json_path, "write the results as JSON (rank 0)");
  auto* duration =
      app.add_option("--duration", o.duration,
                     "run each size for this many seconds instead of -n iterations; with -c 1 "
                     "every iteration is verified; --json lists every round (rank 0's start, time, "
                     "plan) of the "
                     "last size")
          ->check(CLI::PositiveNumber);
  app.add_flag("--latency", o.latency,
               "time every timed operation and print percentiles (p1 p50 p90 p99 max) on rank 0")
      ->excludes(duration);
  app.add_flag("--oneway", o.oneway,
               "sendrecv: even ranks send to rank+1, odd ranks receive (one direction per pair)");
  app.add_flag("--keep-going", o.keep_going,
               "with --duration: report a failed round and go on (exit status 2 at the end)");
  app.add_option("--events", o.events_path,
                 "write rail events and final rail states as JSON lines to PATH.rankN");
  app.add_option("--rail-samples", o.samples_path,
                 "with --duration: write every rail's counters, read between rounds about every "
                 "200 ms, as JSON lines to PATH.rankN")
      ->needs(duration);
  app.add_flag("--print-config-reference", print_reference,
               "print the R2CCL_* reference (docs/CONFIGURATION.md, Markdown) and exit");
  CLI11_PARSE(app, argc, argv);
  if (print_reference) {
    fmt::print("{}", r2ccl::config_reference_markdown());
    return 0;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "r2ccl-perf: unexpected error: {}\n", e.what());
    return 2;
  }
}

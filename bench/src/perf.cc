// r2ccl-perf: benchmarks in the style of nccl-tests.
//
//   R2CCL_RANK=0 R2CCL_NRANKS=2 R2CCL_BOOTSTRAP=198.19.0.1:29500 r2ccl-perf sendrecv -b 8 -e 64M -c
//   1
//
// Every rank sends to rank+1 and receives from rank-1 (a ring of point-to-point transfers, as
// nccl-tests' sendrecv). Rank 0 prints the table. Exit status: 0 when every check passed, 1 when
// any element was wrong, 2 on bad arguments or any operation error.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

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

struct Options {
  std::string op = "sendrecv";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  double step_factor = 2;
  int iters = 20;
  int warmup = 5;
  int check = 0;
  bool rails = false;
  std::string json_path;
  double duration = 0;      // > 0: iterate for this many seconds instead of -n
  bool keep_going = false;  // with --duration: a failed round is reported, not fatal
  std::string events_path;  // rail events as JSON lines
};

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
  std::string error;
};

// Agrees on results across ranks over the control path: max time, total wrong, first error.
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
    if (g.error.empty() && !e.empty()) g.error = fmt::format("rank {}: {}", r, e);
  }
  return g;
}

class SendRecv {
 public:
  SendRecv(Fabric& f, std::size_t max_bytes) : f_(f), send_(max_bytes), recv_(max_bytes) {}

  Status init() {
    auto s = f_.register_memory(send_.data(), send_.size());
    if (!s) return s.status();
    auto r = f_.register_memory(recv_.data(), recv_.size());
    if (!r) return r.status();
    send_region_ = *s;
    recv_region_ = *r;
    return Status::ok();
  }

  Status run_once(std::size_t bytes) {
    const int me = f_.rank();
    const int n = f_.nranks();
    const int to = (me + 1) % n;
    const int from = (me - 1 + n) % n;
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
  Result<std::uint64_t> checked(std::size_t bytes, std::uint64_t round) {
    const int from = (f_.rank() - 1 + f_.nranks()) % f_.nranks();
    fill_pattern(send_.data(), bytes, f_.rank(), round);
    std::memset(recv_.data(), 0xEE, bytes);
    R2CCL_RETURN_IF_ERROR(run_once(bytes));
    return count_wrong(recv_.data(), bytes, from, round);
  }

 private:
  Fabric& f_;
  std::vector<std::byte> send_;
  std::vector<std::byte> recv_;
  r2ccl::RegionPtr send_region_;
  r2ccl::RegionPtr recv_region_;
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
  if (!minb || !maxb || *minb > *maxb || o.step_factor <= 1 || o.iters < 1 || o.warmup < 0) {
    fmt::print(stderr,
               "r2ccl-perf: bad sizes: -b {} -e {} -f {} -n {} -w {} (need -b <= -e, -f > 1, -n >= "
               "1, -w >= 0)\n",
               o.min_bytes, o.max_bytes, o.step_factor, o.iters, o.warmup);
    return 2;
  }
  auto boot = r2ccl::BootstrapOptions::from_config(*cfg);
  if (!boot) {
    fmt::print(stderr, "r2ccl-perf: {}\n", boot.status().message());
    return 2;
  }
  auto fabric = Fabric::create(*cfg, *boot);
  if (!fabric) {
    fmt::print(stderr, "r2ccl-perf: rank {}: {}\n", boot->rank, fabric.status().to_string());
    return 2;
  }
  Fabric& f = **fabric;
  auto metrics = r2ccl::mon::JobMetrics::start(*cfg, f);  // when R2CCL_METRICS_PORT is set
  const bool root = f.rank() == 0;
  SendRecv bench(f, *maxb);
  if (Status st = bench.init(); !st) {
    fmt::print(stderr, "r2ccl-perf: rank {}: {}\n", f.rank(), st.to_string());
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
    fmt::print("#\n# {:>12} {:>12} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "size", "count", "type",
               "time", "algbw", "busbw", "#wrong");
    fmt::print("# {:>12} {:>12} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "(B)", "(elements)", "", "(us)",
               "(GB/s)", "(GB/s)", "");
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
  for (std::size_t bytes = *minb; bytes <= *maxb;) {
    std::string error;
    std::uint64_t wrong = 0;
    for (int i = 0; i < o.warmup && error.empty(); ++i)
      if (Status st = bench.run_once(bytes); !st) error = st.to_string();
    if (error.empty())
      if (Status st = f.bootstrap().barrier(f.config().timeout); !st) error = st.to_string();
    before = f.rail_snapshot();
    const auto t0 = Clock::now();
    int iters = 0;
    if (o.duration > 0) {
      // Until time is up (rank 0's clock decides, every round, on the control path); with -c 1
      // every round carries fresh data and is verified, so faults injected meanwhile are checked.
      bool stop = false;
      while (!stop && error.empty()) {
        std::string failed;
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
        }
        ++iters;
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
      for (; iters < o.iters && error.empty(); ++iters)
        if (Status st = bench.run_once(bytes); !st) error = st.to_string();
    }
    iters = std::max(iters, 1);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    after = f.rail_snapshot();
    events = f.rail_events();
    if (o.check && error.empty() && o.duration <= 0) {
      auto w = bench.checked(bytes, ++round);
      if (w)
        wrong = *w;
      else
        error = w.status().to_string();
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
    const double busbw = algbw;  // sendrecv: every byte crosses one link once
    if (!g->error.empty()) {
      if (root) fmt::print(stderr, "r2ccl-perf: {} bytes failed: {}\n", bytes, g->error);
      exit_code = 2;
      break;
    }
    if (g->wrong) exit_code = std::max(exit_code, 1);
    busbw_sum += busbw;
    ++rows;
    if (root)
      fmt::print("  {:>12} {:>12} {:>6} {:>10.1f} {:>8.3f} {:>8.3f} {:>7}\n", bytes, bytes, "uint8",
                 g->max_seconds * 1e6, algbw, busbw, o.check ? std::to_string(g->wrong) : "N/A");
    std::fflush(stdout);
    report["results"].push_back({{"bytes", bytes},
                                 {"time_us", g->max_seconds * 1e6},
                                 {"algbw_gbps", algbw},
                                 {"busbw_gbps", busbw},
                                 {"wrong", o.check ? nlohmann::json(g->wrong) : nlohmann::json()}});
    const auto next = static_cast<std::size_t>(static_cast<double>(bytes) * o.step_factor);
    bytes = next > bytes ? next : bytes + 1;
  }
  if (root && rows > 0) {
    fmt::print("# Out of bounds values : {} {}\n", exit_code == 1 ? "some" : "0",
               exit_code == 0 ? "OK" : "FAILED");
    fmt::print("# Avg bus bandwidth    : {:.4f} GB/s\n#\n", busbw_sum / rows);
  }
  report["avg_busbw_gbps"] = rows ? busbw_sum / rows : 0.0;

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
  bool print_table = false;
  app.add_option("op", o.op, "operation")->check(CLI::IsMember({"sendrecv"}));
  app.add_option("-b,--minbytes", o.min_bytes, "smallest size (e.g. 8, 4K, 1M)");
  app.add_option("-e,--maxbytes", o.max_bytes, "largest size");
  app.add_option("-f,--stepfactor", o.step_factor, "multiply the size by this between rows");
  app.add_option("-n,--iters", o.iters, "timed iterations per size");
  app.add_option("-w,--warmup_iters", o.warmup, "warm-up iterations per size");
  app.add_option("-c,--check", o.check, "1: check every byte on every rank");
  app.add_flag("--rails", o.rails, "print per-rail bytes and throughput");
  app.add_option("--json", o.json_path, "write the results as JSON (rank 0)");
  app.add_option("--duration", o.duration,
                 "run each size for this many seconds instead of -n iterations; with -c 1 every "
                 "iteration is verified")
      ->check(CLI::PositiveNumber);
  app.add_flag("--keep-going", o.keep_going,
               "with --duration: report a failed round and go on (exit status 2 at the end)");
  app.add_option("--events", o.events_path,
                 "write rail events and final rail states as JSON lines to PATH.rankN");
  app.add_flag("--print-config-table", print_table, "print the R2CCL_* table (Markdown) and exit");
  CLI11_PARSE(app, argc, argv);
  if (print_table) {
    fmt::print("{}", r2ccl::config_table_markdown());
    return 0;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "r2ccl-perf: unexpected error: {}\n", e.what());
    return 2;
  }
}

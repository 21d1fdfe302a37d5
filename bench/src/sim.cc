// r2ccl-sim: runs r2ccl's all-reduce plans on a fluid model of nodes x GPUs x NICs with NICs lost
// or slowed, beside R²CCL's cost model and the lower bound.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "r2ccl/coll/degraded.h"
#include "r2ccl/coll/plan.h"
#include "r2ccl/coll/sim.h"
#include "r2ccl/coll/types.h"

namespace {

using namespace r2ccl;
using namespace r2ccl::coll;

struct Setting {
  Cluster cluster;
  std::optional<Network> plan_net;  // --plan-from
  std::size_t bytes = std::size_t{256} << 20;
  DataType type = DataType::kBF16;
  int failed_nodes = 1;
  std::vector<int> failed;  // --failed: these nodes instead of spreading failed_nodes
  double lost = 0;          // fraction of a failed node's NIC bandwidth lost
  bool full = false;        // --full: simulate every rank, not one per node
};

// The cluster with the failed nodes spread over the job (0, nodes/f, 2 nodes/f, ...) and `lost`
// as whole NICs (or, shaped, as every NIC slowed).
Cluster cluster_of(const Setting& s) {
  Cluster c = s.cluster;
  c.failed = s.failed;
  if (s.failed.empty())
    for (int f = 0; f < s.failed_nodes; ++f)
      c.failed.push_back(f * c.nodes / std::max(1, s.failed_nodes));
  c.lost_nics = c.shaped ? 0 : static_cast<int>(std::lround(s.lost * c.nics));
  c.slow = c.shaped ? 1 - s.lost : 1;
  return c;
}

CollDesc allreduce_of(const Setting& s) {
  return CollDesc{CollOp::kAllReduce, s.bytes / type_size(s.type), s.type, RedOp::kSum, 0, false};
}

// The cost model's time (hierarchical where nodes have several ranks).
double predict(const Setting& s, Algo algo) {
  const Cluster c = cluster_of(s);
  const CollDesc d = allreduce_of(s);
  if (c.gpus == 1) return predict_seconds(algo, d, c.network());
  return predict_hierarchical_seconds(algo, d, c.nodes, c.gpus, c.network(), c.intra_bps);
}

double fault_free_ring(const Setting& s) {
  Setting h = s;
  h.lost = 0;
  return predict(h, Algo::kRing);
}

Algo auto_choice(const CollDesc& d, const Network& net) {
  return is_degraded(net) ? choose_degraded(d, net) : Algo::kRing;
}

Result<double> seconds(const Setting& s, Algo algo) {
  auto r =
      simulate(cluster_of(s), allreduce_of(s), algo, s.plan_net ? &*s.plan_net : nullptr, !s.full);
  if (!r) return r.status();
  return r->seconds;
}

// R²CCL's model (fault-free ring time = 1).
double model_balance(double x) {
  return 1 / (1 - x);
}
double model_r2cc(int n, double x) {
  return 1 + n * x / (2 * (n - 1) * (1 - x));
}

std::FILE* open_csv(const std::string& path) {
  if (path.empty()) return nullptr;
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) fmt::print(stderr, "r2ccl-sim: cannot write {}\n", path);
  return f;
}

int grid(const Setting& base, const std::string& csv_path) {
  std::FILE* csv = open_csv(csv_path);
  if (!csv_path.empty() && !csv) return 1;
  if (csv)
    fmt::print(csv,
               "n,x,balance,balance_model,r2cc,r2cc_model,weighted,lower_bound,"
               "weighted_over_bound\n");
  fmt::print(
      "| n | X | Balance sim / model | R2CC-AllReduce sim / model | weighted | T_LB | "
      "weighted / T_LB |\n|---|---|---|---|---|---|---|\n");
  double worst_model = 0, worst_bound = 0;
  bool never_slower = true;
  for (int n : {3, 8, 16, 64})
    for (auto [num, den] : {std::pair{1, 8}, {1, 4}, {1, 3}, {1, 2}}) {
      Setting s = base;
      s.cluster.nodes = n;
      s.cluster.gpus = 1;
      s.cluster.nics = 24;  // X = k/8, k/4, k/3 and k/2 are whole NICs
      s.cluster.latency_s = 0;
      s.cluster.shaped = false;
      s.failed_nodes = 1;
      s.lost = static_cast<double>(num) / den;
      const double t0 = fault_free_ring(s);
      const double lb = lower_bound_seconds(allreduce_of(s), cluster_of(s).network()) / t0;
      double t[3];
      int i = 0;
      for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted}) {
        auto o = seconds(s, a);
        if (!o) {
          fmt::print(stderr, "r2ccl-sim: {} n={} X={}/{}: {}\n", algo_name(a), n, num, den,
                     o.status().message());
          if (csv) std::fclose(csv);
          return 1;
        }
        t[i++] = *o / t0;
      }
      const double mb = model_balance(s.lost), mr = model_r2cc(n, s.lost);
      worst_model = std::max({worst_model, std::abs(t[0] / mb - 1), std::abs(t[1] / mr - 1)});
      worst_bound = std::max(worst_bound, t[2] / lb - 1);
      never_slower &= t[2] <= t[1];
      fmt::print("| {} | {}/{} | {:.4f} / {:.4f} | {:.4f} / {:.4f} | {:.4f} | {:.4f} | {:.4f} |\n",
                 n, num, den, t[0], mb, t[1], mr, t[2], lb, t[2] / lb);
      if (csv)
        fmt::print(csv, "{},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f},{:.6f}\n", n, s.lost,
                   t[0], mb, t[1], mr, t[2], lb, t[2] / lb);
    }
  fmt::print(
      "\ntimes relative to the fault-free ring; largest gap to R²CCL's model {:.2f}%, "
      "weighted at most {:.2f}% over T_LB, never slower than R2CC-AllReduce: {}\n",
      100 * worst_model, 100 * worst_bound, never_slower ? "yes" : "no");
  if (csv) std::fclose(csv);
  return 0;
}

// Time against the NICs a failed node lost (or, shaped, its speed), every algorithm.
int sweep(const Setting& base, const std::string& csv_path) {
  std::FILE* csv = open_csv(csv_path);
  if (!csv_path.empty() && !csv) return 1;
  std::FILE* out = csv ? csv : stdout;
  fmt::print(out, "nodes,gpus,x,fault_free,balance,r2cc,weighted,lower_bound,auto\n");
  const int steps = base.cluster.shaped ? 16 : base.cluster.nics;
  for (int k = 0; k < steps; ++k) {
    Setting s = base;
    s.lost = static_cast<double>(k) / steps;
    if (s.lost > 0.76) break;
    const CollDesc d = allreduce_of(s);
    const Network net = cluster_of(s).network();
    double t[3];
    int i = 0;
    for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted}) {
      auto o = seconds(s, a);
      if (!o) {
        fmt::print(stderr, "r2ccl-sim: {}: {}\n", algo_name(a), o.status().message());
        if (csv) std::fclose(csv);
        return 1;
      }
      t[i++] = *o;
    }
    fmt::print(out, "{},{},{:.4f},{:.6g},{:.6g},{:.6g},{:.6g},{:.6g},{}\n", s.cluster.nodes,
               s.cluster.gpus, s.lost, fault_free_ring(s), t[0], t[1], t[2],
               lower_bound_seconds(d, net), algo_name(auto_choice(d, net)));
  }
  if (csv) std::fclose(csv);
  return 0;
}

// The messages one rank sends in its plan of `algo` (the most of a healthy rank's and a failed
// node's first rank's).
std::size_t sends_per_rank(const Setting& s, Algo algo) {
  const Cluster c = cluster_of(s);
  const Network net = c.network();
  const CollDesc d = allreduce_of(s);
  // The first failed node's first rank, and a healthy node's (the plans differ only there).
  std::vector<int> nodes;
  for (int node = 0; node < c.nodes; ++node)
    if (std::find(c.failed.begin(), c.failed.end(), node) == c.failed.end()) {
      nodes.push_back(node);
      break;
    }
  if (!c.failed.empty()) nodes.push_back(c.failed[0]);
  std::size_t most = 0;
  for (int node : nodes) {
    const int r = node * c.gpus;
    auto plan = c.gpus > 1 ? make_hierarchical_plan(d, r, c.nodes, c.gpus, algo, &net)
                           : make_plan(d, r, c.ranks(), algo, &net);
    if (!plan) continue;
    std::size_t n = 0;
    for (const auto& ph : plan->phases)
      for (const auto& st : ph.comm)
        n += st.kind == Step::Kind::kSend && st.bytes > 0 ? 1 : 0;
    most = std::max(most, n);
  }
  return most;
}

// OptCC's lower bound of the traffic across nodes (each local index's share of the message among
// the nodes), plus what the steps inside a node take at the least.
double lower_bound(const Setting& s) {
  const Cluster c = cluster_of(s);
  Setting flat = s;
  flat.cluster.gpus = 1;
  flat.bytes = s.bytes / static_cast<std::size_t>(s.cluster.gpus);
  Cluster fc = cluster_of(flat);
  fc.nic_bps = c.nic_bps / c.gpus;
  const double inside = predict(s, Algo::kBalance) -
                        predict_seconds(Algo::kBalance, allreduce_of(flat), fc.network());
  return inside + lower_bound_seconds(allreduce_of(flat), fc.network());
}

// Every plan against the job's size: nodes doubling from 2 until `max_ranks` ranks, the cost
// model's time of each plan, the lower bound, the messages each rank sends, and the simulated
// time (with the simulator's own wall time) up to `sim_ranks` ranks.
int scale_sweep(const Setting& base, int max_ranks, int sim_ranks,
                const std::vector<Algo>& simulated, const std::string& csv_path) {
  std::FILE* csv = open_csv(csv_path);
  if (!csv_path.empty() && !csv) return 1;
  std::FILE* out = csv ? csv : stdout;
  fmt::print(out,
             "nodes,gpus,ranks,x,fault_free,lower_bound,balance,r2cc,weighted,auto,"
             "sends_balance,sends_r2cc,sends_weighted,sim_balance,sim_r2cc,sim_weighted,"
             "wall_balance,wall_r2cc,wall_weighted\n");
  for (int nodes = 2; nodes * base.cluster.gpus <= max_ranks; nodes *= 2) {
    Setting s = base;
    s.cluster.nodes = nodes;
    s.failed.clear();
    s.failed_nodes = std::min(base.failed_nodes, nodes);
    const Cluster c = cluster_of(s);
    const CollDesc d = allreduce_of(s);
    const Network net = c.network();
    const double bound = lower_bound(s);
    double model[3], sim[3] = {0, 0, 0}, wall[3] = {0, 0, 0};
    std::size_t sends[3];
    int i = 0;
    for (Algo a : {Algo::kBalance, Algo::kR2cc, Algo::kWeighted}) {
      model[i] = predict(s, a);
      sends[i] = sends_per_rank(s, a);
      if (c.ranks() <= sim_ranks &&
          std::find(simulated.begin(), simulated.end(), a) != simulated.end()) {
        const auto w0 = std::chrono::steady_clock::now();
        auto o = seconds(s, a);
        wall[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
        if (!o) {
          fmt::print(stderr, "r2ccl-sim: {} at {} nodes: {}\n", algo_name(a), nodes,
                     o.status().message());
          if (csv) std::fclose(csv);
          return 1;
        }
        sim[i] = *o;
      }
      ++i;
    }
    const auto opt = [](double v) { return v > 0 ? fmt::format("{:.6g}", v) : std::string(); };
    fmt::print(out,
               "{},{},{},{:.4f},{:.6g},{:.6g},{:.6g},{:.6g},{:.6g},{},{},{},{},{},{},{},{},{},{}\n",
               nodes, s.cluster.gpus, c.ranks(), s.lost, fault_free_ring(s), bound, model[0],
               model[1], model[2], algo_name(auto_choice(d, net)), sends[0], sends[1], sends[2],
               opt(sim[0]), opt(sim[1]), opt(sim[2]), opt(wall[0]), opt(wall[1]), opt(wall[2]));
    std::fflush(out);
  }
  if (csv) std::fclose(csv);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "r2ccl-sim: r2ccl's all-reduce plans on a fluid model of nodes x GPUs x NICs, with NICs "
      "lost or slowed"};
  Setting s;
  Cluster& c = s.cluster;
  double nic_gbps = 400, intra_gbps = 900, latency_us = 0;
  int lost_nics = -1;
  std::string algos = "balance,r2cc,weighted", csv, type = "bf16";
  bool paper_grid = false, do_sweep = false;
  app.add_option("-n,--nodes", c.nodes, "nodes")->check(CLI::Range(1, 65536));
  app.add_option("-g,--gpus", c.gpus, "GPUs (ranks) per node")->check(CLI::Range(1, 64));
  app.add_option("--nics", c.nics, "NICs per node")->check(CLI::Range(1, 64));
  app.add_option("--nic-gbps", nic_gbps, "bandwidth of one NIC, Gbit/s")
      ->check(CLI::PositiveNumber);
  app.add_option("--intra-gbps", intra_gbps, "inside a node, per GPU and direction, Gbit/s")
      ->check(CLI::PositiveNumber);
  app.add_option("--latency-us", latency_us, "fixed cost of a message, microseconds")
      ->check(CLI::NonNegativeNumber);
  app.add_option("-b,--bytes", s.bytes, "all-reduce size per rank, bytes")
      ->check(CLI::PositiveNumber);
  app.add_option("-d,--type", type, "data type")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "f64"}));
  app.add_option("-x,--lost", s.lost,
                 "fraction of a failed node's NIC bandwidth lost (whole NICs unless --shaped)")
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--lost-nics", lost_nics, "NICs each failed node lost (instead of --lost)")
      ->check(CLI::Range(0, 64));
  app.add_flag("--shaped", c.shaped,
               "failed nodes keep every NIC, each at (1 - lost) of its speed (like tc shaping)");
  app.add_option("-f,--failed-nodes", s.failed_nodes, "nodes that lost bandwidth")
      ->check(CLI::Range(0, 65536));
  app.add_option("--failed", s.failed, "the nodes that lost bandwidth (instead of --failed-nodes)")
      ->delimiter(',')
      ->check(CLI::NonNegativeNumber);
  app.add_option("-a,--algos", algos, "algorithms, comma separated: balance r2cc weighted auto");
  app.add_flag("--grid", paper_grid,
               "R²CCL's model grid: n in {3,8,16,64} x X in {1/8,1/4,1/3,1/2}, one rank per node");
  app.add_flag("--sweep", do_sweep, "time against the bandwidth lost, every algorithm (CSV)");
  int scale_ranks = 0, sim_ranks = 1024;
  app.add_option("--scale", scale_ranks,
                 "every plan against the job's size (CSV): nodes doubling from 2 up to this many "
                 "ranks, the cost model, the lower bound, the messages each rank sends, and the "
                 "simulation up to --sim-ranks")
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--sim-ranks", sim_ranks,
                 "with --scale: simulate jobs of at most this many ranks (the plans of --algos)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--csv", csv, "write the grid or sweep as CSV to this file");
  app.add_flag("--full", s.full,
               "simulate every rank (by default, where a node's ranks run one plan turned by "
               "their local index on the same rails, one rank per node is simulated and the "
               "others take its times)");
  std::string plan_from;
  app.add_option("--plan-from", plan_from,
                 "make the plans from the table a real job agreed on (r2ccl-perf --json's "
                 "\"agreed\"), to predict that job's own schedule")
      ->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);
  auto t = parse_type(type);
  if (!t) {
    fmt::print(stderr, "r2ccl-sim: {}\n", t.status().message());
    return 2;
  }
  s.type = *t;
  c.nic_bps = nic_gbps * 1e9 / 8;
  c.intra_bps = intra_gbps * 1e9 / 8;
  c.latency_s = latency_us * 1e-6;
  if (lost_nics >= 0) {
    if (lost_nics > c.nics) {
      fmt::print(stderr, "r2ccl-sim: --lost-nics {} is more than --nics {}\n", lost_nics, c.nics);
      return 2;
    }
    s.lost = static_cast<double>(lost_nics) / c.nics;
  }
  for (int f : s.failed)
    if (f >= c.nodes) {
      fmt::print(stderr, "r2ccl-sim: --failed {}: there are {} nodes\n", f, c.nodes);
      return 2;
    }
  if (!s.failed.empty()) s.failed_nodes = static_cast<int>(s.failed.size());
  if (s.failed_nodes > c.nodes) {
    fmt::print(stderr, "r2ccl-sim: --failed-nodes {} is more than --nodes {}\n", s.failed_nodes,
               c.nodes);
    return 2;
  }
  if (!plan_from.empty()) {
    try {
      std::ifstream in(plan_from);
      const auto j = nlohmann::json::parse(in).at("agreed");
      Network net;
      net.bandwidth = j.at("bandwidth_bps").get<std::vector<double>>();
      net.rails_up = j.at("rails_up").get<std::vector<std::uint64_t>>();
      net.latency_s = j.at("latency_s").get<double>();
      if (static_cast<int>(net.bandwidth.size()) != c.nodes * c.gpus ||
          net.rails_up.size() != net.bandwidth.size())
        throw std::runtime_error(
            fmt::format("it has {} ranks, the cluster {}", net.bandwidth.size(), c.nodes * c.gpus));
      s.plan_net = std::move(net);
    } catch (const std::exception& e) {
      fmt::print(stderr, "r2ccl-sim: --plan-from {}: {}\n", plan_from, e.what());
      return 2;
    }
  }
  std::vector<std::optional<Algo>> chosen;  // nullopt: auto
  for (std::size_t pos = 0; pos <= algos.size();) {
    const std::size_t comma = std::min(algos.find(',', pos), algos.size());
    const std::string name = algos.substr(pos, comma - pos);
    pos = comma + 1;
    if (name.empty()) continue;
    auto a = parse_algo(name);
    if (!a) {
      fmt::print(stderr, "r2ccl-sim: --algos: {}\n", a.status().message());
      return 2;
    }
    chosen.push_back(*a == Algo::kAuto ? std::nullopt : std::optional<Algo>(*a));
  }
  if (paper_grid) return grid(s, csv);
  if (do_sweep) return sweep(s, csv);
  if (scale_ranks > 0) {
    std::vector<Algo> simulated;
    for (const auto& a : chosen)
      if (a) simulated.push_back(*a);
    return scale_sweep(s, scale_ranks, sim_ranks, simulated, csv);
  }

  const Cluster cl = cluster_of(s);
  const CollDesc d = allreduce_of(s);
  const Network net = cl.network();
  const double t0 = fault_free_ring(s);
  fmt::print(
      "{} nodes x {} GPUs = {} ranks, {} NICs of {} Gbit/s per node; {} node(s) {}; "
      "all-reduce of {} bytes ({}), latency {} us\n",
      c.nodes, c.gpus, cl.ranks(), c.nics, nic_gbps, s.failed_nodes,
      c.shaped ? fmt::format("with every NIC at {:.1f}%", 100 * cl.slow)
               : fmt::format("lost {} NIC(s)", cl.lost_nics),
      s.bytes, type_name(s.type), latency_us);
  const double bound = lower_bound(s);
  fmt::print("fault-free ring {:.6f} s, lower bound {:.6f} s ({:.4f}x); auto picks {}\n", t0, bound,
             bound / t0, algo_name(auto_choice(d, net)));
  fmt::print(
      "| algorithm | simulated s | x fault-free | cost model s | messages | ranks simulated | "
      "wall s |\n|---|---|---|---|---|---|---|\n");
  for (const auto& a : chosen) {
    const Algo algo = a ? *a : auto_choice(d, net);
    const auto w0 = std::chrono::steady_clock::now();
    auto r = simulate(cl, d, algo, s.plan_net ? &*s.plan_net : nullptr, !s.full);
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    if (!r) {
      fmt::print(stderr, "r2ccl-sim: {}: {}\n", algo_name(algo), r.status().message());
      return 1;
    }
    fmt::print("| {} | {:.6f} | {:.4f} | {:.6f} | {} | {} | {:.2f} |\n", algo_name(algo),
               r->seconds, r->seconds / t0, predict(s, algo), r->messages, cl.ranks() / r->folded,
               wall);
  }
  return 0;
}

// r2ccl-metrics-bench: what exposing a job's rail metrics costs.
//
// Nine ranks (threads of this process) with eight loopback rails each, so rank 0 has 8 peers x 8
// rails = 64 rails. It measures (1) one scrape — collecting every r2ccl_rail_* family and
// rendering the text exposition — and (2) the data path between rank 0 and rank 1 with no
// scraping and with a scrape every 10 ms (far more often than Prometheus scrapes), in one run.
#include <fmt/format.h>
#include <prometheus/text_serializer.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <future>
#include <map>
#include <thread>

#include "r2ccl/monitor/job_metrics.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/fabric.h"

namespace {

using namespace r2ccl;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Result<std::vector<std::unique_ptr<Fabric>>> make_world(int n, int rails, std::uint16_t port) {
  std::vector<std::future<Result<std::unique_ptr<Fabric>>>> fs;
  for (int r = 0; r < n; ++r) {
    fs.push_back(std::async(std::launch::async, [=] {
      std::string nics;
      for (int i = 1; i <= rails; ++i)
        nics += fmt::format("{}127.0.{}.{}", i > 1 ? "," : "", 40 + r, i);
      std::map<std::string, std::string> vars{
          {"R2CCL_NICS", nics}, {"R2CCL_PROBE_INTERVAL", "100ms"}, {"R2CCL_PROBE_TIMEOUT", "2s"}};
      auto cfg = parse_config([&](const std::string& k) -> std::optional<std::string> {
        auto it = vars.find(k);
        if (it == vars.end()) return std::nullopt;
        return it->second;
      });
      if (!cfg) return Result<std::unique_ptr<Fabric>>(cfg.status());
      BootstrapOptions o{r, n, HostPort{"127.0.0.1", port}, {}, milliseconds(30000), ""};
      return Fabric::create(*cfg, o);
    }));
  }
  std::vector<std::unique_ptr<Fabric>> out;
  for (auto& f : fs) {
    auto fab = f.get();
    if (!fab) return fab.status();
    out.push_back(std::move(*fab));
  }
  return out;
}

// Rank 0 <-> rank 1 round trips of `bytes` for `seconds`; returns MB/s per direction.
double transfer_rate(Fabric& a, Fabric& b, std::size_t bytes, double seconds) {
  std::vector<std::byte> sa(bytes, std::byte{1}), sb(bytes, std::byte{2}), da(bytes), db(bytes);
  auto rsa = *a.register_memory(sa.data(), bytes);
  auto rda = *a.register_memory(da.data(), bytes);
  auto rsb = *b.register_memory(sb.data(), bytes);
  auto rdb = *b.register_memory(db.data(), bytes);
  std::uint64_t moved = 0;
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
    auto r1 = *b.irecv(0, rdb, 0, bytes);
    auto r0 = *a.irecv(1, rda, 0, bytes);
    auto s0 = *a.isend(1, rsa, 0, bytes);
    auto s1 = *b.isend(0, rsb, 0, bytes);
    if (!a.wait(s0) || !b.wait(s1) || !a.wait(r0) || !b.wait(r1)) return -1;
    moved += bytes;
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  for (auto& r : {rsa, rda})
    (void)a.deregister_memory(r);
  for (auto& r : {rsb, rdb})
    (void)b.deregister_memory(r);
  return static_cast<double>(moved) / secs / 1e6;
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"r2ccl-metrics-bench: cost of a metrics scrape and its effect on the data path"};
  int peers = 8;
  int rails = 8;
  int scrapes = 2000;
  double seconds = 3;
  app.add_option("--peers", peers, "peers of rank 0")->check(CLI::Range(1, 16));
  app.add_option("--rails", rails, "rails per peer")->check(CLI::Range(1, 8));
  app.add_option("--scrapes", scrapes, "scrapes to time")->check(CLI::PositiveNumber);
  app.add_option("--seconds", seconds, "seconds per data-path measurement")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  auto world = make_world(peers + 1, rails, 29950);
  if (!world) {
    fmt::print(stderr, "r2ccl-metrics-bench: {}\n", world.status().to_string());
    return 2;
  }
  auto& ranks = *world;
  mon::RailCollector collector(*ranks[0]);
  prometheus::TextSerializer serializer;

  std::vector<double> us;
  std::size_t text_bytes = 0;
  for (int i = 0; i < scrapes; ++i) {
    const auto t0 = Clock::now();
    auto families = collector.Collect();
    const std::string text = serializer.Serialize(families);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    text_bytes = text.size();
  }

  const double quiet = transfer_rate(*ranks[0], *ranks[1], 4u << 20, seconds);
  // The same transfer while another thread scrapes at a fixed interval.
  auto scraped_rate = [&](milliseconds interval, int* count) {
    std::atomic<bool> stop{false};
    std::atomic<int> done{0};
    std::thread scraper([&] {
      while (!stop) {
        auto families = collector.Collect();
        (void)serializer.Serialize(families);
        ++done;
        const auto until = Clock::now() + interval;
        while (!stop && Clock::now() < until)
          std::this_thread::sleep_for(milliseconds(5));
      }
    });
    const double rate = transfer_rate(*ranks[0], *ranks[1], 4u << 20, seconds);
    stop = true;
    scraper.join();
    *count = done.load();
    return rate;
  };
  int fast_count = 0, slow_count = 0;
  const double fast = scraped_rate(milliseconds(10), &fast_count);
  const double slow = scraped_rate(milliseconds(1000), &slow_count);
  // Tear down in reverse, rank 0 (the bootstrap root) last.
  while (ranks.size() > 1)
    ranks.pop_back();

  fmt::print("# r2ccl-metrics-bench: rank 0 has {} peers x {} rails = {} rails (loopback)\n", peers,
             rails, peers * rails);
  fmt::print("| measurement | value |\n|---|---:|\n");
  fmt::print("| one scrape (collect + text exposition, {} bytes), p50 | {:.0f} us |\n", text_bytes,
             percentile(us, 0.5));
  fmt::print("| one scrape, p99 | {:.0f} us |\n", percentile(us, 0.99));
  fmt::print("| data path rank 0 <-> 1, 4 MiB messages, no scraping | {:.0f} MB/s |\n", quiet);
  fmt::print("| same, scraped every 1 s ({} scrapes) | {:.0f} MB/s ({:.2f}x) |\n", slow_count, slow,
             quiet > 0 ? slow / quiet : 0.0);
  fmt::print("| same, scraped every 10 ms ({} scrapes) | {:.0f} MB/s ({:.2f}x) |\n", fast_count,
             fast, quiet > 0 ? fast / quiet : 0.0);
  const bool ok = percentile(us, 0.99) < 5000 && quiet > 0 && fast > 0 && slow > 0;
  fmt::print("\ntarget: a scrape of {} rails under 5 ms (p99): {}\n", peers * rails,
             ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

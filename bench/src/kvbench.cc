// r2ccl-kvbench: KV-cache transfers of real model shapes between a prefill rank (0) and a decode
// rank (1), launched like r2ccl-perf (R2CCL_RANK, R2CCL_NRANKS=2, R2CCL_BOOTSTRAP).
//
// Each request moves the KV cache of one prompt (every layer, K and V, bf16, 16-token blocks)
// into its own destination blocks; `--concurrency` requests are in flight at once. With
// verification on (the default) every block's checksum travels in the notification and is
// checked on arrival. Exit status: 0 when every request was DONE and every block verified,
// 1 otherwise, 2 on bad arguments or setup errors.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cuda_buffer.h"
#include "r2ccl/kv/engine.h"
#include "r2ccl/monitor/job_metrics.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/log.h"

namespace {

using namespace r2ccl;
using Clock = std::chrono::steady_clock;

struct Model {
  const char* name;
  std::uint32_t layers;
  std::uint32_t parts;        // 2: K and V; 1: MLA latent
  std::uint64_t token_bytes;  // per layer per part, bf16
};

// bf16, per token and layer: K (and V) = kv_heads x head_dim x 2 bytes; MLA = (512 + 64) x 2.
constexpr Model kModels[] = {
    {"llama3-8b", 32, 2, 8 * 128 * 2},   // Llama-3.1-8B: 8 KV heads x 128
    {"llama3-70b", 80, 2, 8 * 128 * 2},  // Llama-3-70B: 320 KiB per token over 80 layers
    {"deepseek-v3", 61, 1, 576 * 2},     // DeepSeek-V3: MLA latent 512 + rope 64
};
constexpr std::uint32_t kBlockTokens = 16;

struct Options {
  std::string model = "llama3-8b";
  int requests = 12;
  int min_tokens = 256;
  int max_tokens = 1024;
  int concurrency = 4;
  std::string mode = "push";
  bool no_verify = false;
  unsigned seed = 1;
  std::string json_path;
  std::vector<std::string> faults;  // SECONDS:COMMAND, run by rank 0
  int waves = 1;                    // the workload, this many times in a row
  double wave_gap = 0;              // seconds between waves
  double pool_limit_gib = 6;
  std::string memory = "host";  // or cuda: each side's pool in GPU memory
  int gpu = -1;                 // the GPU of the pool (default: the rank)
};

struct Plan {
  std::vector<std::uint32_t> first_block;  // per request
  std::vector<std::uint32_t> blocks;       // per request
  std::uint32_t total_blocks = 0;
};

Plan make_plan(const Options& o) {
  std::mt19937 rng(o.seed);
  Plan p;
  for (int i = 0; i < o.requests; ++i) {
    const int tokens =
        o.min_tokens +
        static_cast<int>(rng() % static_cast<unsigned>(o.max_tokens - o.min_tokens + 1));
    const auto blocks = static_cast<std::uint32_t>((tokens + kBlockTokens - 1) / kBlockTokens);
    p.first_block.push_back(p.total_blocks);
    p.blocks.push_back(blocks);
    p.total_blocks += blocks;
  }
  return p;
}

double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

int run(const Options& o) {
  auto cfg = parse_config(process_env());
  if (!cfg) {
    fmt::print(stderr, "r2ccl-kvbench: {}\n", cfg.status().message());
    return 2;
  }
  set_log_level(cfg->log_level);
  auto kvopts = kv::EngineOptions::from(*cfg);
  kvopts.verify = !o.no_verify;
  const Model* model = nullptr;
  for (const auto& m : kModels)
    if (o.model == m.name) model = &m;
  if (model == nullptr || o.requests < 1 || o.min_tokens < 1 || o.max_tokens < o.min_tokens ||
      o.concurrency < 1) {
    fmt::print(
        stderr,
        "r2ccl-kvbench: bad workload: --model {} --requests {} --min-tokens {} --max-tokens {} "
        "--concurrency {}\n",
        o.model, o.requests, o.min_tokens, o.max_tokens, o.concurrency);
    return 2;
  }
  auto boot = BootstrapOptions::from_config(*cfg);
  if (!boot) {
    fmt::print(stderr, "r2ccl-kvbench: {}\n", boot.status().message());
    return 2;
  }
  if (boot->nranks != 2) {
    fmt::print(stderr, "r2ccl-kvbench: needs exactly 2 ranks (prefill 0, decode 1), got {}\n",
               boot->nranks);
    return 2;
  }
  auto fabric = Fabric::create(*cfg, *boot);
  if (!fabric) {
    fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", boot->rank, fabric.status().to_string());
    return 2;
  }
  Fabric& f = **fabric;
  auto metrics = mon::JobMetrics::start(*cfg, f);
  const int me = f.rank();
  const int peer = 1 - me;
  const Plan plan = make_plan(o);
  const std::uint64_t block_bytes = model->token_bytes * kBlockTokens;
  const std::uint64_t pool_bytes =
      static_cast<std::uint64_t>(plan.total_blocks) * block_bytes * model->layers * model->parts;
  if (static_cast<double>(pool_bytes) > o.pool_limit_gib * (1ull << 30)) {
    fmt::print(
        stderr,
        "r2ccl-kvbench: the workload needs a {:.1f} GiB pool per side, over --pool-limit {} GiB\n",
        static_cast<double>(pool_bytes) / (1ull << 30), o.pool_limit_gib);
    return 2;
  }
  const auto layout =
      kv::KvLayout::layer_major(model->layers, plan.total_blocks, block_bytes, model->parts);
  // Deterministic, different per block, cheap to make: bytes [at, at + n) of the pool.
  auto pattern = [&](std::size_t at, std::span<std::byte> out) {
    for (std::size_t i = 0; i < out.size(); i += 8) {
      const std::uint64_t v = ((at + i) * 0x9E3779B97F4A7C15ull) ^ (me == 0 ? 0x5555 : 0);
      std::memcpy(out.data() + i, &v, std::min<std::size_t>(8, out.size() - i));
    }
  };
  std::vector<std::byte> host_memory;
  std::unique_ptr<bench::CudaBuffer> gpu_memory;
  std::span<std::byte> memory;
  if (o.memory == "cuda") {
    auto b = bench::CudaBuffer::make(o.gpu >= 0 ? o.gpu : me, pool_bytes);
    if (!b) {
      fmt::print(stderr, "r2ccl-kvbench: rank {}: --memory cuda: {}\n", me, b.status().message());
      return 2;
    }
    gpu_memory = std::move(*b);
    memory = gpu_memory->span();
    std::vector<std::byte> piece(std::size_t{64} << 20);
    for (std::size_t at = 0; at < pool_bytes; at += piece.size()) {
      const auto part = std::span(piece).first(std::min(piece.size(), pool_bytes - at));
      pattern(at, part);
      if (Status st = gpu_memory->upload(part, at); !st) {
        fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", me, st.message());
        return 2;
      }
    }
  } else {
    host_memory.resize(pool_bytes);
    pattern(0, host_memory);
    memory = host_memory;
  }
  // After the memory: destroyed before it.
  auto engine = kv::KvEngine::create(f, kvopts);
  if (!engine) {
    fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", me, engine.status().to_string());
    return 2;
  }
  auto pool = (*engine)->register_pool({memory}, layout);
  if (!pool) {
    fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", me, pool.status().to_string());
    return 2;
  }
  auto metas = f.bootstrap().allgather((*engine)->metadata(), cfg->timeout);
  if (!metas) {
    fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", me, metas.status().to_string());
    return 2;
  }
  if (Status st = (*engine)->accept_metadata(peer, (*metas)[static_cast<std::size_t>(peer)]); !st) {
    fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", me, st.to_string());
    return 2;
  }
  (void)f.bootstrap().barrier(cfg->timeout);

  const bool push = o.mode == "push";
  const bool initiator = push ? me == 0 : me == 1;
  std::vector<double> latency_ms;
  std::uint64_t bytes = 0;
  int done = 0, failed = 0, preserved = 0, verified = 0;
  std::vector<std::string> failures;
  nlohmann::json waves = nlohmann::json::array();
  std::vector<std::thread> faults;
  const auto t0 = Clock::now();
  if (me == 0)
    for (const auto& spec : o.faults) {
      const auto colon = spec.find(':');
      const double at = std::atof(spec.substr(0, colon).c_str());
      const std::string cmd = colon == std::string::npos ? std::string() : spec.substr(colon + 1);
      faults.emplace_back([at, cmd] {
        std::this_thread::sleep_for(std::chrono::duration<double>(at));
        fmt::print(stderr, "r2ccl-kvbench: fault at {:.1f} s: {}\n", at, cmd);
        if (std::system(cmd.c_str()) != 0)
          fmt::print(stderr, "r2ccl-kvbench: the fault command failed\n");
      });
    }
  for (int wave = 0; wave < o.waves; ++wave) {
    if (wave > 0) std::this_thread::sleep_for(std::chrono::duration<double>(o.wave_gap));
    const int base = wave * o.requests;
    int wave_done = 0, wave_failed = 0, wave_preserved = 0;
    std::uint64_t wave_invalid = 0;
    if (initiator) {
      // Keep `concurrency` requests in flight; each moves one prompt's blocks, all layers.
      std::vector<Clock::time_point> started(static_cast<std::size_t>(o.requests));
      int next = 0, finished = 0;
      std::deque<int> inflight;
      while (finished < o.requests) {
        while (next < o.requests && static_cast<int>(inflight.size()) < o.concurrency) {
          kv::BlockSpan span{0, model->layers, {}, {}};
          for (std::uint32_t b = 0; b < plan.blocks[static_cast<std::size_t>(next)]; ++b) {
            span.src_blocks.push_back(plan.first_block[static_cast<std::size_t>(next)] + b);
            span.dst_blocks.push_back(plan.first_block[static_cast<std::size_t>(next)] + b);
          }
          started[static_cast<std::size_t>(next)] = Clock::now();
          const auto id = static_cast<std::uint64_t>(base + next);
          Status st = push ? (*engine)->submit(id, peer, 0, 0, {span})
                           : (*engine)->pull(id, peer, 0, 0, {span});
          if (!st) {
            fmt::print(stderr, "r2ccl-kvbench: request {}: {}\n", id, st.to_string());
            return 2;
          }
          inflight.push_back(next++);
        }
        const int i = inflight.front();
        inflight.pop_front();
        const auto id = static_cast<std::uint64_t>(base + i);
        auto st = (*engine)->wait(id, cfg->timeout + std::chrono::seconds(5));
        ++finished;
        if (!st || st->state != kv::RequestState::kDone) {
          ++wave_failed;
          if (st) wave_invalid += st->invalid_blocks.size();
          failures.push_back(fmt::format(
              "request {}: {}", id,
              st ? fmt::format("{} ({}; {} invalid block(s))", kv::request_state_name(st->state),
                               st->reason, st->invalid_blocks.size())
                 : st.status().to_string()));
          continue;
        }
        ++wave_done;
        wave_preserved += st->preserved;
        bytes += st->bytes;
        latency_ms.push_back(std::chrono::duration<double, std::milli>(
                                 Clock::now() - started[static_cast<std::size_t>(i)])
                                 .count());
      }
    }
    if (push && me == 1) {
      // The receiver: one notification per request, verified on arrival.
      for (int i = 0; i < o.requests; ++i) {
        const auto id = static_cast<std::uint64_t>(base + i);
        auto n = (*engine)->wait_notification(0, id, cfg->timeout + std::chrono::seconds(10));
        if (!n || n->state != kv::RequestState::kDone) {
          ++wave_failed;
          if (n) wave_invalid += n->invalid_blocks.size();
          failures.push_back(fmt::format(
              "notification {}: {}", id,
              n ? fmt::format("{} ({}; {} invalid block(s))", kv::request_state_name(n->state),
                              n->reason, n->invalid_blocks.size())
                : n.status().to_string()));
          continue;
        }
        ++wave_done;
        verified += n->verified;
      }
    }
    done += wave_done;
    failed += wave_failed;
    preserved += wave_preserved;
    waves.push_back({{"wave", wave},
                     {"done", wave_done},
                     {"failed", wave_failed},
                     {"preserved", wave_preserved},
                     {"invalid_blocks", wave_invalid}});
    // The receiver has looked at every notification of this wave before the next one reuses
    // the blocks.
    (void)f.bootstrap().barrier(cfg->timeout + std::chrono::seconds(30));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (auto& t : faults)
    t.join();
  // Both sides' view, on rank 0.
  ByteWriter mine;
  mine.u32(static_cast<std::uint32_t>(done))
      .u32(static_cast<std::uint32_t>(failed))
      .u32(static_cast<std::uint32_t>(verified));
  auto all = f.bootstrap().allgather(mine.bytes(), cfg->timeout);
  int peer_done = 0, peer_failed = 0, peer_verified = 0;
  if (all) {
    ByteReader r((*all)[static_cast<std::size_t>(peer)]);
    peer_done = static_cast<int>(r.u32());
    peer_failed = static_cast<int>(r.u32());
    peer_verified = static_cast<int>(r.u32());
  }
  const int receiver_verified = push ? (me == 1 ? verified : peer_verified) : -1;
  bool ok = failed == 0 && peer_failed == 0 && all.is_ok();
  if (push && !o.no_verify) ok = ok && receiver_verified == o.requests * o.waves;
  for (const auto& s : failures)
    fmt::print(stderr, "r2ccl-kvbench: rank {}: {}\n", me, s);
  if (initiator) {
    const double gbps = static_cast<double>(bytes) / seconds / 1e9;
    fmt::print(
        "# r2ccl-kvbench {}: {} request(s) x {} wave(s) of {}-{} tokens, concurrency {}, {} "
        "rail(s), {}, pools in {} memory\n",
        o.mode, o.requests, o.waves, o.min_tokens, o.max_tokens, o.concurrency, f.nics().size(),
        model->name, o.memory);
    fmt::print(
        "| requests | DONE | FAILED | preserved | GB | seconds | GB/s | req/s | p50 ms | p90 ms | "
        "p99 ms |\n");
    fmt::print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    fmt::print(
        "| {} | {} | {} | {} | {:.3f} | {:.2f} | {:.4f} | {:.2f} | {:.0f} | {:.0f} | {:.0f} |\n",
        o.requests, done, failed, preserved, static_cast<double>(bytes) / 1e9, seconds, gbps,
        done / seconds, pct(latency_ms, 0.5), pct(latency_ms, 0.9), pct(latency_ms, 0.99));
    if (push)
      fmt::print("# receiver: {} notification(s) DONE, {} verified{}\n",
                 push && me == 0 ? peer_done : done, receiver_verified,
                 o.no_verify ? " (verification off)" : "");
    fmt::print("# result: {}\n", ok ? "every request DONE, every block verified" : "FAILED");
    if (!o.json_path.empty()) {
      nlohmann::json j{{"model", model->name},
                       {"mode", o.mode},
                       {"memory", o.memory},
                       {"requests", o.requests},
                       {"done", done},
                       {"failed", failed},
                       {"preserved", preserved},
                       {"bytes", bytes},
                       {"seconds", seconds},
                       {"goodput_gbps", gbps},
                       {"requests_per_second", done / seconds},
                       {"latency_ms",
                        {{"p50", pct(latency_ms, 0.5)},
                         {"p90", pct(latency_ms, 0.9)},
                         {"p99", pct(latency_ms, 0.99)}}},
                       {"latencies_ms", latency_ms},
                       {"receiver_verified", receiver_verified},
                       {"rails", f.nics().size()},
                       {"failures", failures},
                       {"ok", ok},
                       {"waves", waves}};
      std::ofstream(o.json_path) << j.dump(2) << "\n";
    }
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "r2ccl-kvbench: KV-cache transfers between a prefill rank (0) and a decode rank (1)"};
  Options o;
  app.add_option("--model", o.model, "llama3-8b, llama3-70b or deepseek-v3 (bf16, 16-token blocks)")
      ->check(CLI::IsMember({"llama3-8b", "llama3-70b", "deepseek-v3"}));
  app.add_option("--requests", o.requests, "number of requests");
  app.add_option("--min-tokens", o.min_tokens, "shortest prompt");
  app.add_option("--max-tokens", o.max_tokens, "longest prompt");
  app.add_option("--concurrency", o.concurrency, "requests in flight at once");
  app.add_option("--mode", o.mode, "push (prefill writes) or pull (decode reads)")
      ->check(CLI::IsMember({"push", "pull"}));
  app.add_flag("--no-verify", o.no_verify, "skip the per-block checksums");
  app.add_option("--seed", o.seed, "workload seed");
  app.add_option("--json", o.json_path, "write the results as JSON (the initiating rank)");
  app.add_option("--fault", o.faults,
                 "SECONDS:COMMAND run by rank 0 at that time (e.g. a testbed fault); repeatable");
  app.add_option("--waves", o.waves,
                 "run the workload this many times in a row (request ids continue)")
      ->check(CLI::Range(1, 100));
  app.add_option("--wave-gap", o.wave_gap, "seconds between waves")->check(CLI::NonNegativeNumber);
  app.add_option("--pool-limit", o.pool_limit_gib, "largest pool per side, GiB");
  app.add_option("--memory", o.memory,
                 "host, or cuda: each side's pool in the memory of a GPU (moved through the "
                 "host over tcp rails)")
      ->check(CLI::IsMember({"host", "cuda"}));
  app.add_option("--gpu", o.gpu,
                 "with --memory cuda: the GPU of this rank's pool (default: the "
                 "rank)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "r2ccl-kvbench: unexpected error: {}\n", e.what());
    return 2;
  }
}

// Every R2CCL_* setting, parsed and validated in one place.
//
// The table (config_table()) is the single source of truth: names, defaults and what each
// variable means. The README's configuration table is generated from it
// (`r2ccl-perf --print-config-table`) and a unit test keeps the two in agreement.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl {

using Token = std::array<std::uint8_t, 16>;

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
  std::string to_string() const;
};

struct Config {
  LogLevel log_level = LogLevel::kWarn;
  // Launch: rank and world size (R2CCL_RANK/R2CCL_NRANKS, or mpirun's environment).
  std::optional<int> rank;
  std::optional<int> nranks;
  std::optional<HostPort> bootstrap;  // rank 0's listener
  Token bootstrap_token{};            // all zero unless R2CCL_BOOTSTRAP_TOKEN is set
  bool gpu_tune = true;               // R2CCL_GPU_TUNE: measure the GPU algorithms at set-up
  bool gpu_nccl = true;               // R2CCL_GPU_NCCL: the NVLink side opens NCCL too
  std::string gpu_path = "auto";      // R2CCL_GPU_PATH: auto | nvlink | rails
  std::string node_id;                // R2CCL_NODE_ID: empty: host, boot and network namespace
  std::size_t gpu_staging_chunk = std::size_t{16} << 20;  // R2CCL_GPU_STAGING_CHUNK
  int gpu_staging_window = 4;                             // R2CCL_GPU_STAGING_WINDOW
  bool insecure_no_token = false;  // R2CCL_INSECURE_NO_TOKEN: no token outside loopback
  std::chrono::milliseconds bootstrap_timeout{30000};
  std::string socket_ifname;      // control-path interface; empty: the one reaching rank 0
  std::vector<std::string> nics;  // rails; empty: every up, addressed, non-control interface
  std::string provider = "tcp";   // tcp | verbs
  // verbs: GID index (-1: the RoCE v2 GID of the NIC's IPv4 address), transport timeout
  // exponent and retry count of the queue pairs.
  int ib_gid_index = -1;
  int ib_timeout = 14;
  int ib_retry_cnt = 3;
  std::size_t chunk_size = 512 * 1024;
  std::size_t rail_window = 2 * 1024 * 1024;         // 8M with the verbs provider
  std::chrono::milliseconds timeout{30000};          // deadline of every operation
  std::chrono::milliseconds connect_timeout{10000};  // establishing the rails
  // Rail health (DESIGN.md: UP -> SUSPECT -> DOWN -> PROBING -> UP, plus DEGRADED).
  std::chrono::milliseconds probe_interval{20};   // liveness/RTT probe on every rail
  std::chrono::milliseconds probe_timeout{200};   // silent this long: the rail is DOWN
  std::chrono::milliseconds stall_timeout{2000};  // unconfirmed data, no progress: DOWN
  std::chrono::milliseconds holddown{1000};       // stable time before re-admission
  std::chrono::milliseconds holddown_max{30000};  // cap of the doubling hold-down
  int readmit_probes = 5;                         // consecutive good probes to re-admit
  double degraded_ratio = 0.5;                    // below this share of the median bandwidth
  // Prometheus exposition of this job's rail telemetry (the monitor module): off unless a port
  // is given; rank r listens on metrics_port + r.
  std::optional<std::uint16_t> metrics_port;
  std::string metrics_addr = "127.0.0.1";
  // KV-cache transfer engine (kvxfer).
  bool kv_verify = false;                   // per-block checksums in notifications
  std::size_t kv_max_inflight = 64u << 20;  // bytes in flight per peer
  // Collectives.
  std::string algo = "auto";  // auto | ring | oneshot | twoshot | balance | r2cc | weighted
  bool check = false;         // compare every collective's arguments across ranks first
  // Degraded mode: all-reduces of at least degraded_min_bytes agree on the ranks' bandwidths
  // first and, where they differ, run the plan degraded_algo names (auto: the cost model's).
  std::string degraded_algo = "auto";  // auto | off | balance | r2cc | weighted
  std::size_t degraded_min_bytes = 1u << 20;
  std::size_t degraded_probe_bytes = 4u << 20;  // the agreement's timed probe; 0: none
  // The registration cache of the host collectives (coll/reg_cache.h): auto (where the provider's
  // registrations follow the mappings, tcp), on (also a pinning provider: the application
  // invalidates what it frees), off (register every operation's buffers for it alone).
  std::string reg_cache = "auto";
  std::size_t reg_cache_bytes = std::size_t{1} << 30;  // registered bytes it keeps at most
};

struct ConfigEntry {
  const char* name;
  const char* default_text;
  const char* meaning;
};

// Every variable, in the order docs/CONFIGURATION.md lists them.
std::span<const ConfigEntry> config_table();
// The table as Markdown.
std::string config_table_markdown();
// docs/CONFIGURATION.md, whole: how values are written, then the table.
std::string config_reference_markdown();

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
// Looks variables up in the process environment.
EnvLookup process_env();

// Parses every R2CCL_* variable (and mpirun's rank/size variables); the first bad value gives an
// error naming the variable, the value and what is allowed. Unknown R2CCL_* names produce a
// warning (see unknown_variables()).
Result<Config> parse_config(const EnvLookup& env);
// R2CCL_* names in the process environment that the table does not know (likely typos).
std::vector<std::string> unknown_variables();

// Helpers shared with the command-line tools.
Result<std::size_t> parse_size(const std::string& text);                    // 512, 4K, 1M, 2GiB
Result<std::chrono::milliseconds> parse_duration(const std::string& text);  // 250ms, 5s, 2m
Result<HostPort> parse_host_port(const std::string& text);
Result<Token> parse_token(const std::string& hex);
std::string token_to_hex(const Token& token);
std::string format_size(std::size_t bytes);  // 512K, 64M, 1000

}  // namespace r2ccl

#include "r2ccl/runtime/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>

extern char** environ;  // NOLINT

namespace r2ccl {
namespace {

constexpr ConfigEntry kTable[] = {
    {"R2CCL_LOG", "warn", "Log level: `error`, `warn`, `info`, `debug` or `trace`."},
    {"R2CCL_RANK", "(from mpirun)",
     "This process's rank, 0 ≤ rank < R2CCL_NRANKS. Under mpirun taken from "
     "`OMPI_COMM_WORLD_RANK` / `PMI_RANK` when unset."},
    {"R2CCL_NRANKS", "(from mpirun)",
     "World size, ≥ 1. Under mpirun taken from `OMPI_COMM_WORLD_SIZE` / `PMI_SIZE` when unset."},
    {"R2CCL_BOOTSTRAP", "(none)",
     "`host:port` where rank 0 listens for the rendezvous (e.g. `198.19.0.1:29500`)."},
    {"R2CCL_BOOTSTRAP_TOKEN", "(none)",
     "The job's 128-bit token as 32 hex digits (e.g. `openssl rand -hex 16`), the same on every "
     "rank. Every hello (bootstrap, rails) answers a challenge with an HMAC of it, and rail "
     "probes carry a tag derived from it; the token itself never crosses the wire. Required unless "
     "rank 0 and every rail are on loopback, or "
     "`R2CCL_INSECURE_NO_TOKEN=1`. Launches by unique id carry a random one."},
    {"R2CCL_INSECURE_NO_TOKEN", "0",
     "`1`: run a job reachable outside loopback without `R2CCL_BOOTSTRAP_TOKEN` (anyone who "
     "reaches its ports can join it)."},
    {"R2CCL_BOOTSTRAP_TIMEOUT", "30s",
     "How long the rendezvous may take (reaching rank 0, all ranks joining). Duration: `500ms`, "
     "`30s`, `2m`."},
    {"R2CCL_SOCKET_IFNAME", "(auto)",
     "Interface for bootstrap and control traffic (like `NCCL_SOCKET_IFNAME`). Default: the one "
     "that reaches the bootstrap address. Never used as a rail."},
    {"R2CCL_NICS", "(auto)",
     "Comma-separated rails: interface names (`eth1,eth2`) or local IPv4 addresses "
     "(`127.0.0.11,127.0.0.12`), like `NCCL_IB_HCA`. Default: every up interface with an IPv4 "
     "address except loopback and the control interface."},
    {"R2CCL_PROVIDER", "tcp",
     "Transport provider: `tcp` (sockets, runs anywhere) or `verbs` (RDMA over rdma-core: "
     "InfiniBand, RoCE; then `R2CCL_NICS` names verbs devices such as `mlx5_0,mlx5_1`)."},
    {"R2CCL_IB_GID_INDEX", "(by address)",
     "verbs: GID index on every NIC (like `NCCL_IB_GID_INDEX`). Default: the RoCE v2 GID that "
     "holds the NIC's IPv4 address, else index 0 (InfiniBand)."},
    {"R2CCL_IB_TIMEOUT", "14",
     "verbs: the queue pairs' transport timeout exponent (4.096 µs × 2^n per retry), 1–31."},
    {"R2CCL_IB_RETRY_CNT", "3",
     "verbs: transport retries before a queue pair fails, 0–6 (7 means \"forever\" on some NICs "
     "and is refused). With the defaults a dead path fails in about 0.3 s."},
    {"R2CCL_CHUNK_SIZE", "512K",
     "Largest chunk a message is cut into for striping over the rails, 4K–64M (smaller "
     "messages use smaller chunks, down to 4K, so that each still spans every rail)."},
    {"R2CCL_RAIL_WINDOW", "2M (tcp), 8M (verbs)",
     "Unconfirmed bytes allowed in flight on one rail, ≥ R2CCL_CHUNK_SIZE (unset: at least the "
     "chunk size), ≤ 1G. verbs gets more: its writes are confirmed by the NIC's acknowledgement, "
     "a round trip after the last byte."},
    {"R2CCL_TIMEOUT", "30s",
     "Deadline of every operation: past it, unless data to the peer is still being confirmed "
     "(slow is not dead), the operation fails with an error naming the peer and every rail tried. "
     "Collectives on GPU memory have none: like NCCL's, they wait for a late rank; they fail, on "
     "every rank, when a rank's host side fails (its process ended) or the communicator is "
     "aborted."},
    {"R2CCL_CONNECT_TIMEOUT", "10s", "How long establishing the rails to the peers may take."},
    {"R2CCL_PROBE_INTERVAL", "20ms",
     "Interval of the liveness and RTT probes sent on every rail, busy or idle, 1ms–10s."},
    {"R2CCL_PROBE_TIMEOUT", "200ms",
     "A rail from which nothing (probe reply or data) arrives for this long is declared DOWN "
     "(black-hole detection); half of it makes the rail SUSPECT. At least 2× the probe interval "
     "(unset: at least 10× it)."},
    {"R2CCL_STALL_TIMEOUT", "2s",
     "A rail with unconfirmed data and no confirmation for this long is declared DOWN."},
    {"R2CCL_HOLDDOWN", "1s",
     "How long a failed rail must answer every probe, link up, before it is used again; doubles "
     "with each flap and halves after each stable hold-down period."},
    {"R2CCL_HOLDDOWN_MAX", "30s",
     "Upper bound of the doubling hold-down, at least R2CCL_HOLDDOWN (unset: at least it)."},
    {"R2CCL_READMIT_PROBES", "5",
     "Consecutive good probes (at least) a failed rail needs before re-admission, 1–1000."},
    {"R2CCL_DEGRADED_RATIO", "0.5",
     "A rail whose measured bandwidth is below this fraction of the median of its peers' is "
     "DEGRADED (kept in use at a lower weight), 0.01–0.99. Both measures must agree: the "
     "receiver's timing of the arrivals and the sender's confirmed bytes per busy second."},
    {"R2CCL_METRICS_PORT", "(off)",
     "Serve this job's rail metrics for Prometheus at `/metrics`: a process listens on this port + "
     "the rank of its first communicator, and its later communicators join that endpoint under "
     "their own label `comm`. A port in use gives a warning and the job runs on without metrics."},
    {"R2CCL_METRICS_ADDR", "127.0.0.1", "IPv4 address the metrics endpoint binds to."},
    {"R2CCL_GPU_TUNE", "1",
     "1: the GPU side of a communicator measures every all-reduce algorithm at every size when it "
     "is set up (about a second) and keeps the fastest; 0: built-in size thresholds instead."},
    {"R2CCL_GPU_PATH", "auto",
     "How a communicator moves device memory: `auto` (NVLink where every rank is on one node, "
     "else the rails with the device data staged through host memory), `nvlink`, or `rails`."},
    {"R2CCL_NODE_ID", "",
     "The node this rank is on, for R2CCL_GPU_PATH=auto; empty: the host name, boot id and "
     "network namespace (so ranks in two network namespaces are two nodes)."},
    {"R2CCL_GPU_STAGING_CHUNK", "16M",
     "Device data across nodes moves in chunks of at most this size through pinned host memory "
     "(64K–256M; the same on every rank)."},
    {"R2CCL_GPU_STAGING_WINDOW", "4",
     "Chunks of device data in flight per communicator across nodes (1–64; the same on every "
     "rank)."},
    {"R2CCL_KV_VERIFY", "0",
     "`1`: the KV engine sends a checksum of every block with each notification and the receiver "
     "verifies the blocks on arrival."},
    {"R2CCL_KV_MAX_INFLIGHT", "64M",
     "KV bytes in flight per peer (requests share it round-robin), 1M–16G."},
    {"R2CCL_ALGO", "auto",
     "Collective algorithm: `auto` (by size: direct one-shot for small messages, ring for large; "
     "degraded mode below), `ring`, `oneshot`, `twoshot`, or an all-reduce plan of degraded mode: "
     "`balance`, `r2cc`, `weighted`."},
    {"R2CCL_DEGRADED_ALGO", "auto",
     "Degraded mode: the ranks agree on each one's bandwidth (each rail up at its NIC's line "
     "rate from sysfs, 10 Gbit/s where none is known, a degraded one at its weight, capped by the "
     "timed probe) before the first all-reduce of at least `R2CCL_DEGRADED_MIN_BYTES` and again "
     "after some rank's rails changed; where they differ, the all-reduce runs `balance` (the "
     "ring), `r2cc` (R2CC-AllReduce) or `weighted` (shards weighted by bandwidth), `auto` "
     "choosing by the cost model; `off`: no agreement, no re-planning."},
    {"R2CCL_DEGRADED_MIN_BYTES", "1M",
     "The smallest all-reduce (bytes per rank) that degraded mode plans. Each one carries every "
     "rank's count of its rail changes (8 bytes to each rank, in its first step); a count that "
     "changed makes the next one agree first."},
    {"R2CCL_DEGRADED_PROBE_BYTES", "4M",
     "At each agreement every rank sends this much to the ranks one and two ahead of it and times "
     "it, so that a rank slow on every NIC alike (shaped, congested) is seen; 0: no probe, line "
     "rates only (64K–1G or 0; the same on every rank)."},
    {"R2CCL_REG_CACHE", "auto",
     "Host buffers over 64K of collectives and send/recv that are not inside one registered "
     "with `r2cclCommRegister` keep their registrations for the next call (at most 64 buffers, "
     "LRU, whole 4K pages) instead of registering on every NIC each call. `auto`: where the "
     "provider's registrations name "
     "addresses, not pinned pages (`tcp`), so that a freed and reused buffer stays correct; "
     "`verbs` pins, and registers per call. `on`: also with `verbs` — the application promises to "
     "call `r2cclCommInvalidateCache` (or deregister) before it frees or unmaps a buffer it passed "
     "to a collective, or a later call may move stale pages. `off`: register per call."},
    {"R2CCL_REG_CACHE_BYTES", "1G",
     "The most memory the registration cache keeps registered (1M–256G); a buffer larger than this "
     "is registered for its call only."},
    {"R2CCL_CHECK", "0",
     "`1`: before every collective the ranks compare operation, count, type, reduction and root "
     "(one small exchange) and all fail with an error naming the mismatch."},
    {"R2CCL_NCCL_LIBRARY", "libnccl.so.2",
     "Device memory (a CUDA build): the NCCL library opened for the largest GPU collectives and "
     "for send/recv on device memory; where it does not load, r2ccl's own kernels take every "
     "size and device send/recv fail saying so."},
    {"R2CCL_LIBRARY", "(bundled)",
     "Python package: the `libr2ccl.so` to load. Default: the copy `pip install` bundled, else "
     "the system's loader path."},
    {"R2CCL_VLLM", "0",
     "`1`: vLLM's collectives of its tensor-parallel group go through r2ccl (the `r2ccl` vLLM "
     "plugin, loaded by vLLM in every process; `0` leaves vLLM as it is)."},
    {"R2CCL_SGLANG", "0",
     "`1`: SGLang's tensor-parallel all-reduce, all-gather and reduce-scatter go through r2ccl "
     "(host tensors, and CUDA tensors where libr2ccl has CUDA; the `r2ccl` SGLang plugin's hooks; "
     "`0` leaves SGLang as it is)."},
};

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return std::string(s);
}

Status bad(const std::string& name, const std::string& value, std::string_view allowed) {
  return {ErrorCode::kConfig, fmt::format("{}='{}' is invalid: expected {}", name, value, allowed)};
}

Result<long long> parse_int(const std::string& text) {
  long long v = 0;
  const char* b = text.data();
  const char* e = text.data() + text.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e || text.empty())
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not an integer", text));
  return v;
}

}  // namespace

std::string HostPort::to_string() const {
  return fmt::format("{}:{}", host, port);
}

std::span<const ConfigEntry> config_table() {
  return kTable;
}

std::string config_table_markdown() {
  std::string out = "| Variable | Default | Meaning |\n|---|---|---|\n";
  for (const auto& e : kTable)
    out += fmt::format("| `{}` | {} | {} |\n", e.name, e.default_text, e.meaning);
  return out;
}

std::string config_reference_markdown() {
  return "# Configuration reference\n"
         "\n"
         "<!-- Generated from runtime/src/core/config.cc by `r2ccl-perf "
         "--print-config-reference`; the unit test Config.ReferenceIsTheCodesTable fails when "
         "they differ. -->\n"
         "\n"
         "Every setting is an environment variable. A bad value stops start-up with an error "
         "naming the variable, the value and what is allowed. Sizes take "
         "`K`, `M` and `G` suffixes (powers of 1024: `512K`, `64M`); durations take `ms`, `s` "
         "(the unit of a bare number) and `m` (`200ms`, `30s`, `2m`).\n"
         "\n" +
         config_table_markdown();
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

Result<std::size_t> parse_size(const std::string& raw) {
  std::string text = trim(raw);
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])))
    ++digits;
  if (digits == 0)
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not a size", raw));
  auto number = parse_int(text.substr(0, digits));
  if (!number) return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not a size", raw));
  std::string suffix = trim(std::string_view(text).substr(digits));
  unsigned long long mult = 1;
  if (suffix.empty() || iequals(suffix, "b")) {
    mult = 1;
  } else if (iequals(suffix, "k") || iequals(suffix, "kb") || iequals(suffix, "kib")) {
    mult = 1ull << 10;
  } else if (iequals(suffix, "m") || iequals(suffix, "mb") || iequals(suffix, "mib")) {
    mult = 1ull << 20;
  } else if (iequals(suffix, "g") || iequals(suffix, "gb") || iequals(suffix, "gib")) {
    mult = 1ull << 30;
  } else {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}' has an unknown size suffix '{}'", raw, suffix));
  }
  const auto n = static_cast<unsigned long long>(*number);
  if (n > (~0ull) / mult)
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is too large", raw));
  return static_cast<std::size_t>(n * mult);
}

std::string format_size(std::size_t bytes) {
  if (bytes >= (1ull << 30) && bytes % (1ull << 30) == 0) return fmt::format("{}G", bytes >> 30);
  if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes >= (1ull << 10) && bytes % (1ull << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return fmt::format("{}", bytes);
}

Result<std::chrono::milliseconds> parse_duration(const std::string& raw) {
  std::string text = trim(raw);
  std::size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  if (digits == 0)
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not a duration", raw));
  double value = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + digits, value);
  if (ec != std::errc() || p != text.data() + digits)
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not a duration", raw));
  std::string unit = text.substr(digits);
  double ms = 0;
  if (unit == "ms") {
    ms = value;
  } else if (unit == "s" || unit.empty()) {
    ms = value * 1000.0;
  } else if (unit == "m" || unit == "min") {
    ms = value * 60000.0;
  } else if (unit == "us") {
    ms = value / 1000.0;
  } else {
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}' has an unknown unit '{}' (use ms, s or m)", raw, unit));
  }
  if (ms > 7.0 * 24 * 3600 * 1000)
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is longer than a week", raw));
  return std::chrono::milliseconds(static_cast<long long>(ms + 0.5));
}

Result<HostPort> parse_host_port(const std::string& raw) {
  std::string text = trim(raw);
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size())
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not host:port", raw));
  auto port = parse_int(text.substr(colon + 1));
  if (!port || *port < 1 || *port > 65535)
    return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' has a bad port (1..65535)", raw));
  std::string host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return HostPort{host, static_cast<std::uint16_t>(*port)};
}

Result<Token> parse_token(const std::string& raw) {
  std::string hex = trim(raw);
  if (hex.size() != 32)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}' is not 32 hex digits (got {})", raw, hex.size()));
  Token t{};
  for (std::size_t i = 0; i < 16; ++i) {
    unsigned v = 0;
    auto [p, ec] = std::from_chars(hex.data() + 2 * i, hex.data() + 2 * i + 2, v, 16);
    if (ec != std::errc() || p != hex.data() + 2 * i + 2)
      return Status(ErrorCode::kInvalidArgument, fmt::format("'{}' is not hexadecimal", raw));
    t[i] = static_cast<std::uint8_t>(v);
  }
  return t;
}

std::string token_to_hex(const Token& token) {
  std::string out;
  for (auto b : token)
    out += fmt::format("{:02x}", b);
  return out;
}

Result<Config> parse_config(const EnvLookup& env) {
  Config c;
  auto get = [&](const char* name) { return env(name); };

  if (auto v = get("R2CCL_LOG")) {
    const std::string s = trim(*v);
    bool found = false;
    for (int l = 0; l <= static_cast<int>(LogLevel::kTrace); ++l) {
      if (iequals(s, log_level_name(static_cast<LogLevel>(l)))) {
        c.log_level = static_cast<LogLevel>(l);
        found = true;
      }
    }
    if (!found) return bad("R2CCL_LOG", *v, "one of error, warn, info, debug, trace");
  }

  // World size first, so the rank can be checked against it.
  auto int_var = [&](const char* name, const std::vector<const char*>& fallbacks, long long min,
                     long long max, std::optional<int>& out) -> Status {
    std::optional<std::string> v = get(name);
    std::string from = name;
    for (const char* f : fallbacks) {
      if (v) break;
      v = get(f);
      from = f;
    }
    if (!v) return Status::ok();
    auto n = parse_int(trim(*v));
    if (!n || *n < min || *n > max)
      return bad(from, *v, fmt::format("an integer from {} to {}", min, max));
    out = static_cast<int>(*n);
    return Status::ok();
  };
  R2CCL_RETURN_IF_ERROR(
      int_var("R2CCL_NRANKS", {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1, 1 << 20, c.nranks));
  R2CCL_RETURN_IF_ERROR(int_var("R2CCL_RANK", {"OMPI_COMM_WORLD_RANK", "PMI_RANK"}, 0,
                                c.nranks ? *c.nranks - 1 : (1 << 20), c.rank));

  if (auto v = get("R2CCL_BOOTSTRAP")) {
    auto hp = parse_host_port(*v);
    if (!hp) return bad("R2CCL_BOOTSTRAP", *v, "host:port, e.g. 198.19.0.1:29500");
    c.bootstrap = *hp;
  }
  if (auto v = get("R2CCL_BOOTSTRAP_TOKEN")) {
    auto t = parse_token(*v);
    if (!t) return bad("R2CCL_BOOTSTRAP_TOKEN", *v, "32 hexadecimal digits (128 bits)");
    c.bootstrap_token = *t;
  }
  auto duration_var = [&](const char* name, std::chrono::milliseconds min,
                          std::chrono::milliseconds& out) -> Status {
    auto v = get(name);
    if (!v) return Status::ok();
    auto d = parse_duration(*v);
    if (!d || *d < min)
      return bad(name, *v,
                 fmt::format("a duration of at least {}ms such as 500ms, 30s or 2m", min.count()));
    out = *d;
    return Status::ok();
  };
  using std::chrono::milliseconds;
  R2CCL_RETURN_IF_ERROR(
      duration_var("R2CCL_BOOTSTRAP_TIMEOUT", milliseconds(10), c.bootstrap_timeout));
  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_TIMEOUT", milliseconds(10), c.timeout));
  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_CONNECT_TIMEOUT", milliseconds(10), c.connect_timeout));

  if (auto v = get("R2CCL_SOCKET_IFNAME")) c.socket_ifname = trim(*v);
  if (auto v = get("R2CCL_NICS")) {
    std::string list = *v;
    std::size_t pos = 0;
    while (pos <= list.size()) {
      auto comma = list.find(',', pos);
      if (comma == std::string::npos) comma = list.size();
      std::string item = trim(std::string_view(list).substr(pos, comma - pos));
      if (item.empty())
        return bad("R2CCL_NICS", *v,
                   "a comma-separated list of interface names or addresses with no empty entries");
      if (std::find(c.nics.begin(), c.nics.end(), item) != c.nics.end())
        return bad("R2CCL_NICS", *v, fmt::format("each NIC once ('{}' repeats)", item));
      c.nics.push_back(item);
      pos = comma + 1;
    }
  }
  if (auto v = get("R2CCL_PROVIDER")) {
    std::string p = trim(*v);
    if (p != "tcp" && p != "verbs") return bad("R2CCL_PROVIDER", *v, "tcp or verbs");
    c.provider = p;
  }
  std::optional<int> gid, ib_timeout, retry;
  R2CCL_RETURN_IF_ERROR(int_var("R2CCL_IB_GID_INDEX", {}, 0, 65535, gid));
  R2CCL_RETURN_IF_ERROR(int_var("R2CCL_IB_TIMEOUT", {}, 1, 31, ib_timeout));
  R2CCL_RETURN_IF_ERROR(int_var("R2CCL_IB_RETRY_CNT", {}, 0, 6, retry));
  c.ib_gid_index = gid.value_or(c.ib_gid_index);
  c.ib_timeout = ib_timeout.value_or(c.ib_timeout);
  c.ib_retry_cnt = retry.value_or(c.ib_retry_cnt);
  auto size_var = [&](const char* name, std::size_t min, std::size_t max,
                      std::size_t& out) -> Status {
    auto v = get(name);
    if (!v) return Status::ok();
    auto s = parse_size(*v);
    if (!s || *s < min || *s > max)
      return bad(name, *v,
                 fmt::format("a size from {} to {} bytes (suffixes K, M, G)", format_size(min),
                             format_size(max)));
    out = *s;
    return Status::ok();
  };
  R2CCL_RETURN_IF_ERROR(
      size_var("R2CCL_DEGRADED_MIN_BYTES", 0, std::size_t{1} << 40, c.degraded_min_bytes));
  R2CCL_RETURN_IF_ERROR(
      size_var("R2CCL_DEGRADED_PROBE_BYTES", 0, std::size_t{1} << 30, c.degraded_probe_bytes));
  if (c.degraded_probe_bytes > 0 && c.degraded_probe_bytes < (64u << 10))
    return bad("R2CCL_DEGRADED_PROBE_BYTES", *get("R2CCL_DEGRADED_PROBE_BYTES"),
               "0 (no probe) or a size from 64K to 1G");
  R2CCL_RETURN_IF_ERROR(size_var("R2CCL_CHUNK_SIZE", 4096, 64u << 20, c.chunk_size));
  if (c.provider == "verbs") c.rail_window = 8u << 20;
  // A variable bounded by another follows it when it is not set itself.
  c.rail_window = std::max(c.rail_window, c.chunk_size);
  R2CCL_RETURN_IF_ERROR(size_var("R2CCL_RAIL_WINDOW", c.chunk_size, 1u << 30, c.rail_window));

  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_PROBE_INTERVAL", milliseconds(1), c.probe_interval));
  if (c.probe_interval > milliseconds(10000))
    return bad("R2CCL_PROBE_INTERVAL", *get("R2CCL_PROBE_INTERVAL"), "a duration from 1ms to 10s");
  c.probe_timeout = std::max(c.probe_timeout, 10 * c.probe_interval);
  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_PROBE_TIMEOUT", 2 * c.probe_interval, c.probe_timeout));
  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_STALL_TIMEOUT", milliseconds(10), c.stall_timeout));
  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_HOLDDOWN", milliseconds(0), c.holddown));
  c.holddown_max = std::max(c.holddown_max, c.holddown);
  R2CCL_RETURN_IF_ERROR(duration_var("R2CCL_HOLDDOWN_MAX", c.holddown, c.holddown_max));
  if (auto v = get("R2CCL_READMIT_PROBES")) {
    auto n = parse_int(trim(*v));
    if (!n || *n < 1 || *n > 1000)
      return bad("R2CCL_READMIT_PROBES", *v, "an integer from 1 to 1000");
    c.readmit_probes = static_cast<int>(*n);
  }
  if (auto v = get("R2CCL_DEGRADED_RATIO")) {
    double d = 0;
    const std::string t = trim(*v);
    auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), d);
    if (ec != std::errc() || p != t.data() + t.size() || d < 0.01 || d > 0.99)
      return bad("R2CCL_DEGRADED_RATIO", *v, "a number from 0.01 to 0.99");
    c.degraded_ratio = d;
  }
  if (auto v = get("R2CCL_METRICS_PORT")) {
    auto n = parse_int(trim(*v));
    if (!n || *n < 1 || *n > 65535)
      return bad("R2CCL_METRICS_PORT", *v, "a TCP port from 1 to 65535");
    c.metrics_port = static_cast<std::uint16_t>(*n);
  }
  if (auto v = get("R2CCL_METRICS_ADDR")) {
    const std::string a = trim(*v);
    unsigned parts[4] = {};
    char extra = 0;
    if (std::sscanf(a.c_str(), "%u.%u.%u.%u%c", &parts[0], &parts[1], &parts[2], &parts[3],
                    &extra) != 4 ||
        std::any_of(std::begin(parts), std::end(parts), [](unsigned x) { return x > 255; }))
      return bad("R2CCL_METRICS_ADDR", *v, "an IPv4 address such as 127.0.0.1 or 0.0.0.0");
    c.metrics_addr = a;
  }
  if (auto v = get("R2CCL_INSECURE_NO_TOKEN")) {
    const std::string t = trim(*v);
    if (t != "0" && t != "1") return bad("R2CCL_INSECURE_NO_TOKEN", *v, "0 or 1");
    c.insecure_no_token = t == "1";
  }
  if (auto v = get("R2CCL_GPU_TUNE")) {
    const std::string t = trim(*v);
    if (t != "0" && t != "1") return bad("R2CCL_GPU_TUNE", *v, "0 or 1");
    c.gpu_tune = t == "1";
  }
  if (auto v = get("R2CCL_GPU_PATH")) {
    const std::string t = trim(*v);
    if (t != "auto" && t != "nvlink" && t != "rails")
      return bad("R2CCL_GPU_PATH", *v, "auto, nvlink or rails");
    c.gpu_path = t;
  }
  if (auto v = get("R2CCL_NODE_ID")) c.node_id = trim(*v);
  R2CCL_RETURN_IF_ERROR(
      size_var("R2CCL_GPU_STAGING_CHUNK", 64u << 10, 256u << 20, c.gpu_staging_chunk));
  if (auto v = get("R2CCL_GPU_STAGING_WINDOW")) {
    const std::string t = trim(*v);
    int w = 0;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), w);
    if (ec != std::errc() || end != t.data() + t.size() || w < 1 || w > 64)
      return bad("R2CCL_GPU_STAGING_WINDOW", *v, "a whole number from 1 to 64");
    c.gpu_staging_window = w;
  }
  if (auto v = get("R2CCL_KV_VERIFY")) {
    const std::string t = trim(*v);
    if (t != "0" && t != "1") return bad("R2CCL_KV_VERIFY", *v, "0 or 1");
    c.kv_verify = t == "1";
  }
  R2CCL_RETURN_IF_ERROR(
      size_var("R2CCL_KV_MAX_INFLIGHT", 1u << 20, 16ull << 30, c.kv_max_inflight));
  if (auto v = get("R2CCL_ALGO")) {
    std::string t = trim(*v);
    std::transform(t.begin(), t.end(), t.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    if (t != "auto" && t != "ring" && t != "oneshot" && t != "twoshot" && t != "balance" &&
        t != "r2cc" && t != "weighted")
      return bad("R2CCL_ALGO", *v, "auto, ring, oneshot, twoshot, balance, r2cc or weighted");
    c.algo = t;
  }
  if (auto v = get("R2CCL_DEGRADED_ALGO")) {
    std::string t = trim(*v);
    std::transform(t.begin(), t.end(), t.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    if (t != "auto" && t != "off" && t != "balance" && t != "r2cc" && t != "weighted")
      return bad("R2CCL_DEGRADED_ALGO", *v, "auto, off, balance, r2cc or weighted");
    c.degraded_algo = t;
  }
  if (auto v = get("R2CCL_REG_CACHE")) {
    std::string t = trim(*v);
    std::transform(t.begin(), t.end(), t.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    if (t != "auto" && t != "on" && t != "off")
      return bad("R2CCL_REG_CACHE", *v, "auto, on or off");
    c.reg_cache = t;
  }
  R2CCL_RETURN_IF_ERROR(
      size_var("R2CCL_REG_CACHE_BYTES", 1u << 20, std::size_t{256} << 30, c.reg_cache_bytes));
  if (auto v = get("R2CCL_CHECK")) {
    const std::string t = trim(*v);
    if (t != "0" && t != "1") return bad("R2CCL_CHECK", *v, "0 or 1");
    c.check = t == "1";
  }
  return c;
}

std::vector<std::string> unknown_variables() {
  std::vector<std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    if (kv.rfind("R2CCL_", 0) != 0) continue;
    std::string name(kv.substr(0, kv.find('=')));
    bool known = std::any_of(std::begin(kTable), std::end(kTable),
                             [&](const ConfigEntry& t) { return name == t.name; });
    // R2CCL_TEST_* and R2CCL_BUILD_DIR belong to the test harness and scripts.
    if (!known && name.rfind("R2CCL_TEST_", 0) != 0 && name != "R2CCL_BUILD_DIR" &&
        name != "R2CCL_CUDA")
      out.push_back(name);
  }
  return out;
}

}  // namespace r2ccl

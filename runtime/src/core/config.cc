#include "r2ccl/runtime/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>

#include "r2ccl/runtime/topology.h"

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
    {"R2CCL_GPU_NCCL", "1",
     "1: the GPU side of a communicator among the GPUs of one node also opens an NCCL "
     "communicator (about 770 MiB of GPU memory per GPU), for the largest collectives and for "
     "send/recv on device memory; 0: it does not (r2ccl's kernels take every size, device "
     "send/recv fail saying so). vLLM's CUDA communicator and SGLang's hooks set 0 unless it is "
     "set: the engine has an NCCL communicator of its own for the group."},
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

namespace {

// Reads one configuration's variables, each checked as it is read: a bad value is an error that
// names the variable, the value and what it should be.
class EnvReader {
 public:
  explicit EnvReader(const EnvLookup& env) : env_(env) {}

  std::optional<std::string> get(const char* name) const { return env_(name); }

  // An integer in [min, max] from `name`, or else from the first of `fallbacks` that is set.
  Status integer(const char* name, const std::vector<const char*>& fallbacks, long long min,
                 long long max, std::optional<int>& out, std::string_view expected = {}) const {
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
      return bad(from, *v,
                 expected.empty() ? fmt::format("an integer from {} to {}", min, max)
                                  : std::string(expected));
    out = static_cast<int>(*n);
    return Status::ok();
  }
  template <class Int>
  Status integer(const char* name, long long min, long long max, Int& out,
                 std::string_view expected = {}) const {
    std::optional<int> n;
    R2CCL_RETURN_IF_ERROR(integer(name, {}, min, max, n, expected));
    if (n) out = static_cast<Int>(*n);
    return Status::ok();
  }

  Status duration(const char* name, std::chrono::milliseconds min,
                  std::chrono::milliseconds& out) const {
    auto v = get(name);
    if (!v) return Status::ok();
    auto d = parse_duration(*v);
    if (!d || *d < min)
      return bad(name, *v,
                 fmt::format("a duration of at least {}ms such as 500ms, 30s or 2m", min.count()));
    out = *d;
    return Status::ok();
  }

  Status size(const char* name, std::size_t min, std::size_t max, std::size_t& out) const {
    auto v = get(name);
    if (!v) return Status::ok();
    auto s = parse_size(*v);
    if (!s || *s < min || *s > max)
      return bad(name, *v,
                 fmt::format("a size from {} to {} bytes (suffixes K, M, G)", format_size(min),
                             format_size(max)));
    out = *s;
    return Status::ok();
  }

  // 0 or 1.
  Status flag(const char* name, bool& out) const {
    auto v = get(name);
    if (!v) return Status::ok();
    const std::string t = trim(*v);
    if (t != "0" && t != "1") return bad(name, *v, "0 or 1");
    out = t == "1";
    return Status::ok();
  }

  // One of `allowed` ("a, b or c" when it is not); `any_case`: lower-cased first.
  Status choice(const char* name, std::initializer_list<std::string_view> allowed, bool any_case,
                std::string& out) const {
    auto v = get(name);
    if (!v) return Status::ok();
    std::string t = trim(*v);
    if (any_case)
      std::transform(t.begin(), t.end(), t.begin(),
                     [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    if (std::find(allowed.begin(), allowed.end(), t) == allowed.end()) {
      std::string expected;
      for (auto it = allowed.begin(); it != allowed.end(); ++it)
        expected += fmt::format("{}{}",
                                it == allowed.begin()            ? ""
                                : std::next(it) == allowed.end() ? " or "
                                                                 : ", ",
                                *it);
      return bad(name, *v, expected);
    }
    out = t;
    return Status::ok();
  }

 private:
  const EnvLookup& env_;
};

using std::chrono::milliseconds;

// The job: logging, the world's size and this rank, the bootstrap and its timeouts.
Status parse_job(const EnvReader& r, Config& c) {
  if (auto v = r.get("R2CCL_LOG")) {
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
  R2CCL_RETURN_IF_ERROR(
      r.integer("R2CCL_NRANKS", {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1, 1 << 20, c.nranks));
  R2CCL_RETURN_IF_ERROR(r.integer("R2CCL_RANK", {"OMPI_COMM_WORLD_RANK", "PMI_RANK"}, 0,
                                  c.nranks ? *c.nranks - 1 : (1 << 20), c.rank));
  if (auto v = r.get("R2CCL_BOOTSTRAP")) {
    auto hp = parse_host_port(*v);
    if (!hp) return bad("R2CCL_BOOTSTRAP", *v, "host:port, e.g. 198.19.0.1:29500");
    c.bootstrap = *hp;
  }
  if (auto v = r.get("R2CCL_BOOTSTRAP_TOKEN")) {
    auto t = parse_token(*v);
    if (!t) return bad("R2CCL_BOOTSTRAP_TOKEN", *v, "32 hexadecimal digits (128 bits)");
    c.bootstrap_token = *t;
  }
  R2CCL_RETURN_IF_ERROR(
      r.duration("R2CCL_BOOTSTRAP_TIMEOUT", milliseconds(10), c.bootstrap_timeout));
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_TIMEOUT", milliseconds(10), c.timeout));
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_CONNECT_TIMEOUT", milliseconds(10), c.connect_timeout));
  return r.flag("R2CCL_INSECURE_NO_TOKEN", c.insecure_no_token);
}

// The rails: which NICs, the provider and its settings, chunks and the window.
Status parse_rails(const EnvReader& r, Config& c) {
  if (auto v = r.get("R2CCL_SOCKET_IFNAME")) c.socket_ifname = trim(*v);
  if (auto v = r.get("R2CCL_NICS")) {
    const std::string& list = *v;
    for (std::size_t pos = 0; pos <= list.size();) {
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
  R2CCL_RETURN_IF_ERROR(r.choice("R2CCL_PROVIDER", {"tcp", "verbs"}, false, c.provider));
  R2CCL_RETURN_IF_ERROR(r.integer("R2CCL_IB_GID_INDEX", 0, 65535, c.ib_gid_index));
  R2CCL_RETURN_IF_ERROR(r.integer("R2CCL_IB_TIMEOUT", 1, 31, c.ib_timeout));
  R2CCL_RETURN_IF_ERROR(r.integer("R2CCL_IB_RETRY_CNT", 0, 6, c.ib_retry_cnt));
  R2CCL_RETURN_IF_ERROR(r.size("R2CCL_CHUNK_SIZE", 4096, 64u << 20, c.chunk_size));
  if (c.provider == "verbs") c.rail_window = 8u << 20;
  // A variable bounded by another follows it when it is not set itself.
  c.rail_window = std::max(c.rail_window, c.chunk_size);
  return r.size("R2CCL_RAIL_WINDOW", c.chunk_size, 1u << 30, c.rail_window);
}

// Rail health: probes, stalls, hold-down and readmission.
Status parse_health(const EnvReader& r, Config& c) {
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_PROBE_INTERVAL", milliseconds(1), c.probe_interval));
  if (c.probe_interval > milliseconds(10000))
    return bad("R2CCL_PROBE_INTERVAL", *r.get("R2CCL_PROBE_INTERVAL"),
               "a duration from 1ms to 10s");
  c.probe_timeout = std::max(c.probe_timeout, 10 * c.probe_interval);
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_PROBE_TIMEOUT", 2 * c.probe_interval, c.probe_timeout));
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_STALL_TIMEOUT", milliseconds(10), c.stall_timeout));
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_HOLDDOWN", milliseconds(0), c.holddown));
  c.holddown_max = std::max(c.holddown_max, c.holddown);
  R2CCL_RETURN_IF_ERROR(r.duration("R2CCL_HOLDDOWN_MAX", c.holddown, c.holddown_max));
  R2CCL_RETURN_IF_ERROR(r.integer("R2CCL_READMIT_PROBES", 1, 1000, c.readmit_probes));
  if (auto v = r.get("R2CCL_DEGRADED_RATIO")) {
    double d = 0;
    const std::string t = trim(*v);
    auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), d);
    if (ec != std::errc() || p != t.data() + t.size() || d < 0.01 || d > 0.99)
      return bad("R2CCL_DEGRADED_RATIO", *v, "a number from 0.01 to 0.99");
    c.degraded_ratio = d;
  }
  return Status::ok();
}

// Collectives: plans, degraded mode, registration, checks.
Status parse_collectives(const EnvReader& r, Config& c) {
  R2CCL_RETURN_IF_ERROR(
      r.size("R2CCL_DEGRADED_MIN_BYTES", 0, std::size_t{1} << 40, c.degraded_min_bytes));
  R2CCL_RETURN_IF_ERROR(
      r.size("R2CCL_DEGRADED_PROBE_BYTES", 0, std::size_t{1} << 30, c.degraded_probe_bytes));
  if (c.degraded_probe_bytes > 0 && c.degraded_probe_bytes < (64u << 10))
    return bad("R2CCL_DEGRADED_PROBE_BYTES", *r.get("R2CCL_DEGRADED_PROBE_BYTES"),
               "0 (no probe) or a size from 64K to 1G");
  R2CCL_RETURN_IF_ERROR(
      r.choice("R2CCL_ALGO", {"auto", "ring", "oneshot", "twoshot", "balance", "r2cc", "weighted"},
               true, c.algo));
  R2CCL_RETURN_IF_ERROR(r.choice("R2CCL_DEGRADED_ALGO",
                                 {"auto", "off", "balance", "r2cc", "weighted"}, true,
                                 c.degraded_algo));
  R2CCL_RETURN_IF_ERROR(r.choice("R2CCL_REG_CACHE", {"auto", "on", "off"}, true, c.reg_cache));
  R2CCL_RETURN_IF_ERROR(
      r.size("R2CCL_REG_CACHE_BYTES", 1u << 20, std::size_t{256} << 30, c.reg_cache_bytes));
  return r.flag("R2CCL_CHECK", c.check);
}

// GPUs, KV transfers and metrics.
Status parse_services(const EnvReader& r, Config& c) {
  std::optional<int> port;
  R2CCL_RETURN_IF_ERROR(
      r.integer("R2CCL_METRICS_PORT", {}, 1, 65535, port, "a TCP port from 1 to 65535"));
  if (port) c.metrics_port = static_cast<std::uint16_t>(*port);
  if (auto v = r.get("R2CCL_METRICS_ADDR")) {
    const std::string a = trim(*v);
    if (!parse_ipv4(a))
      return bad("R2CCL_METRICS_ADDR", *v, "an IPv4 address such as 127.0.0.1 or 0.0.0.0");
    c.metrics_addr = a;
  }
  R2CCL_RETURN_IF_ERROR(r.flag("R2CCL_GPU_TUNE", c.gpu_tune));
  R2CCL_RETURN_IF_ERROR(r.flag("R2CCL_GPU_NCCL", c.gpu_nccl));
  R2CCL_RETURN_IF_ERROR(r.choice("R2CCL_GPU_PATH", {"auto", "nvlink", "rails"}, false, c.gpu_path));
  if (auto v = r.get("R2CCL_NODE_ID")) c.node_id = trim(*v);
  R2CCL_RETURN_IF_ERROR(
      r.size("R2CCL_GPU_STAGING_CHUNK", 64u << 10, 256u << 20, c.gpu_staging_chunk));
  R2CCL_RETURN_IF_ERROR(r.integer("R2CCL_GPU_STAGING_WINDOW", 1, 64, c.gpu_staging_window,
                                  "a whole number from 1 to 64"));
  R2CCL_RETURN_IF_ERROR(r.flag("R2CCL_KV_VERIFY", c.kv_verify));
  return r.size("R2CCL_KV_MAX_INFLIGHT", 1u << 20, 16ull << 30, c.kv_max_inflight);
}

}  // namespace

Result<Config> parse_config(const EnvLookup& env) {
  const EnvReader r(env);
  Config c;
  R2CCL_RETURN_IF_ERROR(parse_job(r, c));
  R2CCL_RETURN_IF_ERROR(parse_rails(r, c));
  R2CCL_RETURN_IF_ERROR(parse_health(r, c));
  R2CCL_RETURN_IF_ERROR(parse_collectives(r, c));
  R2CCL_RETURN_IF_ERROR(parse_services(r, c));
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

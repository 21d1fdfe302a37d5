#include "r2ccl/monitor/options.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <sstream>

#include "r2ccl/monitor/collector.h"

namespace r2ccl::mon {
namespace {

std::optional<LogLevel> parse_log_level(const std::string& text) {
  for (auto level :
       {LogLevel::kError, LogLevel::kWarn, LogLevel::kInfo, LogLevel::kDebug, LogLevel::kTrace}) {
    if (text == log_level_name(level)) return level;
  }
  return std::nullopt;
}

CommandLine usage_error(std::string message) {
  return CommandLine{
      std::nullopt, kExitUsage,
      fmt::format("r2ccl-monitor: {}\nRun with --help for more information.\n", message)};
}

}  // namespace

CommandLine parse_command_line(int argc, const char* const* argv) {
  MonitorOptions o;
  std::string listen;
  std::vector<std::string> nics;
  std::vector<std::string> probes;
  std::string interval = "100ms";
  std::string timeout = "1s";
  std::size_t window = o.probe_window;
  unsigned echo_port = o.echo_port;
  std::string log_text;

  try {
    CLI::App app{
        "r2ccl-monitor: NIC-health exporter for Prometheus. Serves /metrics (link state, speed, "
        "carrier changes, bytes, errors from sysfs, read at every scrape; UDP echo probes to "
        "peers) and /healthz on --listen, and answers other monitors' probes on --echo-port.",
        "r2ccl-monitor"};
    app.set_version_flag("--version", std::string("r2ccl-monitor ") + monitor_version());
    app.add_option("--listen", listen, "IPV4:PORT of the HTTP server (/metrics, /healthz)")
        ->required();
    app.add_option("--nics", nics,
                   "comma-separated NICs to export (default: every non-loopback interface)")
        ->delimiter(',');
    app.add_option("--probe", probes,
                   "NIC=PEER_IPV4[:PORT]: send UDP echo probes from NIC's address to the "
                   "r2ccl-monitor at PEER (repeatable)");
    app.add_option("--probe-interval", interval, "time between two probes of one NIC=PEER")
        ->capture_default_str();
    app.add_option("--probe-timeout", timeout, "a probe with no reply after this is lost")
        ->capture_default_str();
    app.add_option("--probe-window", window,
                   "probes (most recent, finished) over which RTT and loss are computed")
        ->capture_default_str();
    app.add_option("--echo-port", echo_port,
                   "UDP port of the echo responder on every address of this host (0: none); "
                   "also the default PORT of --probe")
        ->capture_default_str();
    app.add_option("--sysfs-root", o.sysfs_root, "where sysfs is mounted (tests use a fake tree)")
        ->capture_default_str();
    app.add_option("--log", log_text,
                   "log level: error, warn, info, debug, trace (default: R2CCL_LOG, else info)");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() != 0) return usage_error(e.what());
      // --help or --version: CLI11 formats the text.
      std::ostringstream out;
      std::ostringstream err;
      const int rc = app.exit(e, out, err);
      return CommandLine{std::nullopt, rc, out.str() + err.str()};
    }
  } catch (const std::exception& e) {
    return usage_error(e.what());
  }

  auto hp = parse_host_port(listen);
  in_addr addr{};
  if (!hp || inet_pton(AF_INET, hp->host.c_str(), &addr) != 1)
    return usage_error(fmt::format(
        "bad --listen '{}': expected IPV4:PORT with PORT 1..65535, e.g. 0.0.0.0:9464", listen));
  o.listen = *hp;

  for (auto& n : nics) {
    if (n.empty()) return usage_error("bad --nics: empty NIC name");
    if (std::find(o.nics.begin(), o.nics.end(), n) == o.nics.end()) o.nics.push_back(n);
  }
  if (echo_port > 65535)
    return usage_error(fmt::format("bad --echo-port {}: expected 0..65535", echo_port));
  o.echo_port = static_cast<std::uint16_t>(echo_port);
  const std::uint16_t default_peer_port = o.echo_port == 0 ? kDefaultEchoPort : o.echo_port;
  for (const auto& p : probes) {
    auto spec = parse_probe_spec(p, default_peer_port);
    if (!spec) return usage_error(spec.status().message());
    for (const auto& other : o.probes) {
      if (other.device == spec->device && other.peer == spec->peer && other.port == spec->port)
        return usage_error(fmt::format("--probe '{}' is given twice", p));
    }
    o.probes.push_back(*spec);
  }
  auto duration = [&](const char* flag, const std::string& text,
                      std::chrono::milliseconds& out) -> std::optional<CommandLine> {
    auto d = parse_duration(text);
    if (!d || d->count() < 1 || d->count() > 60'000)
      return usage_error(
          fmt::format("bad {} '{}': expected a duration from 1ms to 60s, e.g. 100ms", flag, text));
    out = *d;
    return std::nullopt;
  };
  if (auto e = duration("--probe-interval", interval, o.probe_interval)) return *e;
  if (auto e = duration("--probe-timeout", timeout, o.probe_timeout)) return *e;
  if (window < 1 || window > 10'000)
    return usage_error(fmt::format("bad --probe-window {}: expected 1..10000", window));
  o.probe_window = window;

  if (log_text.empty()) {
    if (const char* env = std::getenv("R2CCL_LOG")) log_text = env;
  }
  if (!log_text.empty()) {
    auto level = parse_log_level(log_text);
    if (!level)
      return usage_error(
          fmt::format("bad log level '{}': expected error, warn, info, debug or trace", log_text));
    o.log_level = *level;
  }
  return CommandLine{o, 0, ""};
}

Result<MonitorPlan> plan_monitor(const MonitorOptions& options, const SysfsReader& sysfs,
                                 const AddressLookup& address_of) {
  auto unknown = [&](const std::string& device, std::string_view where) {
    return Status(
        ErrorCode::kNotFound,
        fmt::format("unknown NIC '{}' in {}: no {}/class/net/{} (this host has: {})", device, where,
                    sysfs.root().string(), device, fmt::join(sysfs.all_nics(), ", ")));
  };
  MonitorPlan plan;
  for (const auto& n : options.nics) {
    if (!sysfs.has_nic(n)) return unknown(n, "--nics");
  }
  plan.nics = options.nics;

  ProberConfig& pc = plan.prober;
  if (options.echo_port == 0) {
    pc.echo_port = std::nullopt;
  } else {
    pc.echo_port = options.echo_port;
  }
  pc.interval = options.probe_interval;
  pc.timeout = options.probe_timeout;
  pc.window = options.probe_window;
  for (const auto& spec : options.probes) {
    if (!sysfs.has_nic(spec.device)) return unknown(spec.device, "--probe");
    if (!options.nics.empty() &&
        std::find(options.nics.begin(), options.nics.end(), spec.device) == options.nics.end())
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("--probe NIC '{}' is not in --nics ({})", spec.device,
                                fmt::join(options.nics, ",")));
    auto address = address_of(spec.device);
    if (!address)
      return Status(address.status().code(),
                    fmt::format("--probe {}={}: {}", spec.device, spec.peer_label(),
                                address.status().message()));
    pc.targets.push_back(ProbeTarget{spec, *address});
  }
  return plan;
}

}  // namespace r2ccl::mon

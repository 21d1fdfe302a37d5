// r2ccl-monitor's command line (CLI11) and its checks against this host.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "r2ccl/monitor/probe.h"
#include "r2ccl/monitor/prober.h"
#include "r2ccl/monitor/sysfs.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::mon {

inline constexpr int kExitUsage = 2;  // bad argument, unknown NIC, port in use, bad address

struct MonitorOptions {
  HostPort listen;                // --listen IPV4:PORT (HTTP: /metrics, /healthz)
  std::vector<std::string> nics;  // --nics; empty: every non-loopback interface
  std::vector<ProbeSpec> probes;  // --probe NIC=PEER[:PORT], repeatable
  std::chrono::milliseconds probe_interval{100};
  std::chrono::milliseconds probe_timeout{1000};
  std::size_t probe_window = 20;
  std::uint16_t echo_port = kDefaultEchoPort;  // 0: no echo responder
  std::string sysfs_root = "/sys";
  LogLevel log_level = LogLevel::kInfo;
};

// What parsing decided: run with `options`, or exit with `exit_code` after printing `output`
// (help or version to stdout when exit_code is 0, an error naming the argument to stderr when
// it is kExitUsage).
struct CommandLine {
  std::optional<MonitorOptions> options;
  int exit_code = 0;
  std::string output;
};

CommandLine parse_command_line(int argc, const char* const* argv);

// What the daemon runs after checking the options against this host.
struct MonitorPlan {
  std::vector<std::string> nics;  // empty: every non-loopback interface at scrape time
  ProberConfig prober;
};

// Returns the IPv4 address of an interface, or an error naming it.
using AddressLookup = std::function<Result<std::string>(const std::string& device)>;

// Every --nics and --probe NIC must exist (the error names the unknown one and lists what
// exists); a probe's NIC must be among --nics when that is given, and must have an IPv4 address.
Result<MonitorPlan> plan_monitor(const MonitorOptions& options, const SysfsReader& sysfs,
                                 const AddressLookup& address_of);

}  // namespace r2ccl::mon

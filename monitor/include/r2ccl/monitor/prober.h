// The probe thread of r2ccl-monitor: a UDP echo responder (so other monitors can probe this
// host) and one prober per `--probe NIC=PEER`, all on one poll() loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "r2ccl/monitor/probe.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::mon {

struct ProbeTarget {
  ProbeSpec spec;
  std::string local_address;  // the NIC's IPv4 address: the probe's source
};

struct ProberConfig {
  // The echo responder's UDP port on every address of this host (it binds echo_address);
  // nullopt: no responder. 0 picks a free port (tests; see Prober::echo_port()).
  std::optional<std::uint16_t> echo_port = kDefaultEchoPort;
  std::string echo_address = "0.0.0.0";
  std::chrono::milliseconds interval{100};
  std::chrono::milliseconds timeout{1000};
  std::size_t window = 20;
  std::vector<ProbeTarget> targets;
};

struct ProbeStatus {
  std::string device;
  std::string peer;  // ProbeSpec::peer_label()
  ProbeStats stats;
  bool degraded = false;
};

class Prober {
 public:
  // Opens the echo socket (an error names the port when it is in use) and starts the thread.
  // Probe sockets that cannot be opened yet (NIC without its address, no route) are retried
  // every interval; each failed attempt counts as a lost probe.
  static Result<std::unique_ptr<Prober>> start(ProberConfig config);
  ~Prober();  // stops and joins the thread
  Prober(const Prober&) = delete;
  Prober& operator=(const Prober&) = delete;

  // A snapshot of every target, in the order given. Thread-safe.
  std::vector<ProbeStatus> status() const;
  // The responder's port (useful when the config asked for 0); 0 when there is none.
  std::uint16_t echo_port() const;
  // Echo requests answered so far.
  std::uint64_t echo_replies() const;

 private:
  struct Impl;
  // Only start() can name it, so only start() constructs a Prober (through make_unique).
  struct PassKey {
    explicit PassKey() = default;
  };

 public:
  Prober(PassKey key, std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace r2ccl::mon

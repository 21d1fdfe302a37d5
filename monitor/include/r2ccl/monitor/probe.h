// UDP echo probes between r2ccl-monitor instances: what a `--probe` argument means, and the sliding
// window that turns sent/answered probes into RTT and loss.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "r2ccl/runtime/probe_protocol.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::mon {

using Clock = std::chrono::steady_clock;

inline constexpr std::uint16_t kDefaultEchoPort = 29600;
// A NIC is degraded when a probe on it loses at least this share of the window...
inline constexpr double kDegradedLossRatio = 0.5;
// ...once the window holds at least this many finished probes (one lost probe is no verdict).
inline constexpr std::size_t kMinProbesForVerdict = 3;

// `--probe NIC=PEER[:PORT]`: probe PEER (an IPv4 address where another r2ccl-monitor answers on
// its echo port) from NIC's address.
struct ProbeSpec {
  std::string device;
  std::string peer;  // dotted IPv4
  std::uint16_t port = kDefaultEchoPort;
  bool port_given = false;  // PORT was written out in the argument
  // The `peer` label: the address, plus ":PORT" when the argument named a port.
  std::string peer_label() const;
};

Result<ProbeSpec> parse_probe_spec(const std::string& text,
                                   std::uint16_t default_port = kDefaultEchoPort);

// The probe datagram is the runtime's (r2ccl/runtime/probe_protocol.h): one wire format for
// both. The monitor sends requests with dst 0 and its echo responder answers only those.
using ProbePacket = r2ccl::ProbePacket;

struct ProbeStats {
  std::uint64_t sent_total = 0;  // probes sent (or attempted) since start
  std::uint64_t lost_total = 0;  // probes lost since start
  std::size_t window_count = 0;  // finished probes in the window (answered + lost)
  std::size_t window_lost = 0;
  std::size_t pending = 0;  // sent, neither answered nor timed out yet
  double loss_ratio = 0.0;  // window_lost / window_count; 0 while the window is empty
  std::optional<double> rtt_mean_seconds;  // mean RTT of the answered probes in the window
  std::optional<double> rtt_last_seconds;

  // loss_ratio ≥ kDegradedLossRatio over at least kMinProbesForVerdict (or a full, smaller,
  // window) finished probes.
  bool degraded(std::size_t window_capacity) const;
};

// The last `capacity` finished probes of one (NIC, peer) pair. A probe finishes when its reply
// arrives (answered, with an RTT), when it could not be sent at all (lost at once), or when
// `timeout` passes without a reply (lost). Late and duplicate replies are ignored.
// Not thread-safe: the owner locks.
class ProbeWindow {
 public:
  ProbeWindow(std::size_t capacity, Clock::duration timeout);

  void sent(std::uint64_t sequence, Clock::time_point at);
  // The probe could not be sent (whether or not sent() registered it first): lost at once.
  void send_failed(std::uint64_t sequence);
  // The RTT when `sequence` was pending; nullopt for late, unknown or duplicate replies.
  std::optional<Clock::duration> answered(std::uint64_t sequence, Clock::time_point at);
  // Finishes, as lost, every pending probe sent at or before `now - timeout`.
  void expire(Clock::time_point now);

  ProbeStats stats() const;
  std::size_t capacity() const { return capacity_; }

 private:
  void finish(std::optional<Clock::duration> rtt);

  std::size_t capacity_;
  Clock::duration timeout_;
  std::map<std::uint64_t, Clock::time_point> pending_;
  std::deque<std::optional<Clock::duration>> finished_;  // nullopt: lost
  std::optional<Clock::duration> last_rtt_;
  std::uint64_t sent_total_ = 0;
  std::uint64_t lost_total_ = 0;
};

}  // namespace r2ccl::mon

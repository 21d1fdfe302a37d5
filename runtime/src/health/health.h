// Rail health (DESIGN.md): UP -> SUSPECT -> DOWN -> PROBING -> UP, plus DEGRADED.
//
// A pure state machine: the channel feeds it events with their time and acts on what it
// returns, so every transition is unit-tested with a synthetic clock.
//
// - Connected (UP, DEGRADED, SUSPECT): silence — no probe reply, no frame or confirmation from
//   the peer, no acknowledgement from its kernel — for half the silence limit (silence_limit())
//   makes the rail SUSPECT (no new chunks; the channel sends a keepalive on it each probe interval
//   so that a slow rail can prove itself); for the whole limit, DOWN. So does a provider error, the
//   local link going down, the peer's fence notice, or unconfirmed data with no confirmation for
//   the stall timeout. Going DOWN means: fence, then replay (kFence).
// - DOWN: probes keep running (they do not need the data connection). A probe reply with the
//   local link up starts PROBING.
// - PROBING: re-admitted (kReadmit: reconnect) once at least `readmit_probes` consecutive probes
//   answered and the rail has been stable for the hold-down. Going bad again is a flap: the
//   hold-down doubles (capped); it halves after each stable hold-down period while in use.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/telemetry.h"

namespace r2ccl {

struct HealthConfig {
  std::chrono::milliseconds probe_timeout{200};
  std::chrono::milliseconds stall_timeout{2000};
  std::chrono::milliseconds holddown{1000};
  std::chrono::milliseconds holddown_max{30000};
  int readmit_probes = 5;
  static HealthConfig from(const Config& c);
};

enum class HealthAction { kNone, kFence, kReadmit };

class RailHealth {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;

  RailHealth(const HealthConfig& config, TimePoint now);

  RailState state() const { return state_; }
  bool connected() const { return connected_; }
  // The scheduler may give it new chunks.
  bool usable() const { return state_ == RailState::kUp || state_ == RailState::kDegraded; }

  // A data connection is in place (first connection or re-admission).
  void on_connected(TimePoint now);
  // The rail failed (provider error, peer's notice, local link down...): kFence when it was
  // connected. `reason` is kept as the last error.
  HealthAction on_failure(TimePoint now, const std::string& reason);
  // Local link state from the link watcher.
  HealthAction on_link(TimePoint now, bool up);
  // Any sign of life from the peer on this rail (a frame, a confirmation, the kernel's
  // acknowledgement), at `when` (an earlier sign than one already heard changes nothing).
  void on_heard(TimePoint when);
  // This process's progress loop did not run for `gap`: the peer's silence in that time is not
  // the rail's (its replies wait in the socket), so it does not count.
  void forgive(TimePoint now, std::chrono::nanoseconds gap);
  // How long the peer has been silent.
  std::chrono::nanoseconds silence(TimePoint now) const { return now - last_heard_; }
  // A probe reply with its round-trip time.
  void on_probe_reply(TimePoint now, std::chrono::nanoseconds rtt);
  // Periodic evaluation. `unconfirmed`: data is in flight on the rail; `last_progress`: when
  // the last confirmation came (or the oldest chunk was posted).
  HealthAction tick(TimePoint now, bool unconfirmed, TimePoint last_progress);
  // From the channel's bandwidth comparison; only affects a connected, answering rail.
  void set_degraded(bool degraded);
  // The channel's last verdict (the state may say SUSPECT meanwhile).
  bool degraded() const { return degraded_; }

  std::uint64_t flaps() const { return flaps_; }
  std::uint64_t failovers() const { return failovers_; }
  std::chrono::milliseconds holddown() const { return holddown_; }
  std::chrono::nanoseconds rtt() const { return rtt_; }
  // How long the peer may stay silent before the rail is declared DOWN (half of it: SUSPECT):
  // the probe timeout, or longer where the rail's measured round trips are long or vary (a
  // congested link whose queue delays the probes is slow, not dead): the smoothed RTT plus four
  // deviations (RFC 6298's estimator) plus half the probe timeout, at most kMaxSilenceFactor
  // probe timeouts.
  std::chrono::nanoseconds silence_limit() const;
  static constexpr int kMaxSilenceFactor = 4;
  // How long the last failure took to detect: from the last sign of life (silence, stall) or
  // from the event itself (link, provider error).
  std::chrono::nanoseconds last_detection() const { return last_detection_; }
  const std::string& last_error() const { return last_error_; }

 private:
  HealthAction go_down(TimePoint now, const std::string& reason, TimePoint detected_from);
  void refresh_connected_state();

  HealthConfig config_;
  RailState state_ = RailState::kDown;
  bool connected_ = false;
  bool link_up_ = true;
  bool link_returned_ = false;  // DOWN: the link came up again since the failure
  bool degraded_ = false;
  TimePoint last_heard_;
  TimePoint stable_since_;  // PROBING: since when the rail has looked good
  TimePoint last_decay_;    // in use: when the hold-down last halved
  int good_probes_ = 0;
  std::chrono::milliseconds holddown_;
  std::uint64_t flaps_ = 0;
  std::uint64_t failovers_ = 0;
  std::chrono::nanoseconds rtt_{0};
  std::chrono::nanoseconds srtt_{0};    // smoothed RTT (0: not measured yet)
  std::chrono::nanoseconds rttvar_{0};  // its mean deviation
  std::chrono::nanoseconds last_detection_{0};
  std::string last_error_;
};

}  // namespace r2ccl

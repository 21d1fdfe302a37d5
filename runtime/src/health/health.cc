#include "health/health.h"

#include <algorithm>

namespace r2ccl {

HealthConfig HealthConfig::from(const Config& c) {
  return {c.probe_timeout, c.stall_timeout, c.holddown, c.holddown_max, c.readmit_probes};
}

RailHealth::RailHealth(const HealthConfig& config, TimePoint now)
    : config_(config),
      last_heard_(now),
      stable_since_(now),
      last_decay_(now),
      holddown_(config.holddown) {}

void RailHealth::on_connected(TimePoint now) {
  connected_ = true;
  good_probes_ = 0;
  last_heard_ = now;
  last_decay_ = now;
  state_ = RailState::kUp;
  refresh_connected_state();
}

HealthAction RailHealth::go_down(TimePoint now, const std::string& reason,
                                 TimePoint detected_from) {
  last_error_ = reason;
  good_probes_ = 0;
  stable_since_ = now;
  if (state_ != RailState::kDown) {
    // The rail was good (in use or on its way back): that is one more flap.
    ++flaps_;
    if (flaps_ > 1) holddown_ = std::min(holddown_ * 2, config_.holddown_max);
  }
  state_ = RailState::kDown;
  link_returned_ = false;
  if (!connected_) return HealthAction::kNone;
  connected_ = false;
  ++failovers_;
  last_detection_ = std::chrono::duration_cast<std::chrono::nanoseconds>(now - detected_from);
  return HealthAction::kFence;
}

HealthAction RailHealth::on_failure(TimePoint now, const std::string& reason) {
  return go_down(now, reason, now);
}

HealthAction RailHealth::on_link(TimePoint now, bool up) {
  const bool was_up = link_up_;
  link_up_ = up;
  if (!up) {
    if (was_up && state_ == RailState::kDown && link_returned_) {
      // The link came back and went down again before any probe got through: still a flap. (A
      // link-down that arrives after another report of the same failure is not a new one.)
      link_returned_ = false;
      ++flaps_;
      holddown_ = std::min(holddown_ * 2, config_.holddown_max);
      stable_since_ = now;
      return HealthAction::kNone;
    }
    return go_down(now, "link down", now);
  }
  if (!was_up) stable_since_ = now;
  if (state_ == RailState::kDown) link_returned_ = true;
  return HealthAction::kNone;
}

void RailHealth::on_heard(TimePoint when) {
  if (when <= last_heard_) return;
  last_heard_ = when;
  if (connected_ && state_ == RailState::kSuspect) refresh_connected_state();
}

void RailHealth::on_probe_reply(TimePoint now, std::chrono::nanoseconds rtt) {
  rtt_ = rtt;
  if (rtt.count() > 0) {
    if (srtt_.count() == 0) {
      srtt_ = rtt;
      rttvar_ = rtt / 2;
    } else {
      const auto err = rtt > srtt_ ? rtt - srtt_ : srtt_ - rtt;
      rttvar_ = (3 * rttvar_ + err) / 4;
      srtt_ = (7 * srtt_ + rtt) / 8;
    }
  }
  on_heard(now);
  if (connected_ || !link_up_) return;
  if (state_ == RailState::kDown) {
    state_ = RailState::kProbing;
    good_probes_ = 0;
    if (stable_since_ < now - holddown_) stable_since_ = now;
  }
  ++good_probes_;
}

void RailHealth::forgive(TimePoint now, std::chrono::nanoseconds gap) {
  last_heard_ = std::min(now, last_heard_ + gap);
}

std::chrono::nanoseconds RailHealth::silence_limit() const {
  const std::chrono::nanoseconds configured = config_.probe_timeout;
  const auto measured = srtt_ + 4 * rttvar_ + configured / 2;
  return std::clamp(measured, configured, kMaxSilenceFactor * configured);
}

HealthAction RailHealth::tick(TimePoint now, bool unconfirmed, TimePoint last_progress) {
  const auto silence = now - last_heard_;
  const auto limit = silence_limit();
  if (connected_) {
    if (silence >= limit)
      return go_down(
          now,
          "no probe reply or data for " +
              std::to_string(
                  std::chrono::duration_cast<std::chrono::milliseconds>(silence).count()) +
              "ms (black hole?)",
          last_heard_);
    if (unconfirmed && now - last_progress >= config_.stall_timeout)
      return go_down(now,
                     "stalled: data unconfirmed for " +
                         std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            now - last_progress)
                                            .count()) +
                         "ms",
                     last_progress);
    if (silence >= limit / 2) {
      state_ = RailState::kSuspect;
    } else {
      refresh_connected_state();
    }
    // Stable in use: the hold-down decays.
    if (usable() && now - last_decay_ >= holddown_) {
      holddown_ = std::max(config_.holddown, holddown_ / 2);
      last_decay_ = now;
    }
    return HealthAction::kNone;
  }
  if (state_ == RailState::kProbing) {
    if (silence >= limit || !link_up_) {
      // Probes stopped answering again before re-admission: a flap. The same silence as for a
      // rail in use: a shorter one is as likely a busy CPU as a link, and would count flaps
      // that no link made.
      go_down(now, "probes stopped answering while probing", last_heard_);
      return HealthAction::kNone;
    }
    if (good_probes_ >= config_.readmit_probes && now - stable_since_ >= holddown_)
      return HealthAction::kReadmit;
  }
  return HealthAction::kNone;
}

void RailHealth::set_degraded(bool degraded) {
  degraded_ = degraded;
  if (connected_ && state_ != RailState::kSuspect) refresh_connected_state();
}

void RailHealth::refresh_connected_state() {
  state_ = degraded_ ? RailState::kDegraded : RailState::kUp;
}

}  // namespace r2ccl

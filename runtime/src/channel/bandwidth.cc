// Bandwidth: each rail's rate measured over its busy time, and the degraded verdicts.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "channel/channel.h"
#include "channel/protocol.h"
#include "r2ccl/runtime/log.h"

namespace r2ccl {

using std::chrono::milliseconds;

void Channel::measure_bandwidth(Clock::time_point now) {
  const bool any_busy = std::any_of(rails_.begin(), rails_.end(),
                                    [](const auto& r) { return r->busy_since.has_value(); });
  std::vector<double> bws;
  for (const auto& r : rails_)
    if (r->bandwidth > 0) bws.push_back(r->bandwidth);
  std::sort(bws.begin(), bws.end());
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    // Earliest-finish scheduling gives a rail measured as slow no work; if that lasts, raise its
    // estimate a little so it gets a chunk and is measured again (it may have recovered).
    if (any_busy && !s.busy_since && s.busy_time.count() == 0 && scheduler_.usable(i) &&
        s.bandwidth > 0 && !bws.empty() && s.bandwidth < bws[bws.size() / 2]) {
      if (++s.idle_periods >= 20) {
        s.idle_periods = 0;
        s.bandwidth = std::min(bws[bws.size() / 2], s.bandwidth * 1.5);
        scheduler_.set_bandwidth(i, s.bandwidth);
      }
    } else {
      s.idle_periods = 0;
    }
    if (s.busy_since) {
      s.busy_time += now - *s.busy_since;
      s.busy_since = now;
    }
    // From the confirmations: bytes over the time the rail had data in flight, over enough busy
    // time that one chunk more or less does not swing it.
    double confirmed = 0;
    if (s.busy_time >= milliseconds(300) && s.busy_bytes > 0) {
      confirmed =
          static_cast<double>(s.busy_bytes) / std::chrono::duration<double>(s.busy_time).count();
      s.confirm_bandwidth =
          s.confirm_bandwidth == 0 ? confirmed : 0.7 * s.confirm_bandwidth + 0.3 * confirmed;
      s.busy_time = std::chrono::nanoseconds(0);
      s.busy_bytes = 0;
    }
    double sample = 0;
    if (s.receive_time >= milliseconds(50) && s.receive_bytes > 0) {
      // The receiver timed the arrivals: the link's rate, whatever the confirmations' delay.
      sample = static_cast<double>(s.receive_bytes) /
               std::chrono::duration<double>(s.receive_time).count();
      s.receive_time = std::chrono::nanoseconds(0);
      s.receive_bytes = 0;
    } else if (s.receive_bytes == 0 && confirmed > 0) {
      sample = confirmed;
    } else {
      continue;
    }
    R2CCL_TRACE("rail {} to {}: measured {:.2f} MB/s", i, label_, sample / 1e6);
    s.bandwidth = s.bandwidth == 0 ? sample : 0.7 * s.bandwidth + 0.3 * sample;
    scheduler_.set_bandwidth(i, s.bandwidth);
    s.tel.bandwidth_bps = static_cast<std::uint64_t>(s.bandwidth);
  }
}

// A rail is degraded when it is well under its peers by both measures: the receiver's timing
// (the link's rate while the receiver keeps up) and the confirmations (bytes per busy second).
// The receiver's timing alone misleads when it falls behind: data that waited in its socket
// buffer is read at memory speed, so whichever rails it caught up on look fast and the others
// slow. The confirmations see that as a delay common to every rail.
void Channel::update_degraded() {
  const auto median_of = [&](double RailSlot::*field) {
    std::vector<double> v;
    for (const auto& s : rails_)
      if (s->rail && (*s).*field > 0) v.push_back((*s).*field);
    std::sort(v.begin(), v.end());
    return v.size() < 2 ? 0.0 : v[v.size() / 2];
  };
  const double median = median_of(&RailSlot::bandwidth);
  const double confirm_median = median_of(&RailSlot::confirm_bandwidth);
  if (median == 0) return;
  const double ratio = config_.degraded_ratio;
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    s.tel.weight_milli = static_cast<std::uint32_t>(std::lround(1000 * scheduler_.weight(i)));
    if (!s.rail || s.bandwidth == 0) continue;
    // The verdict, not the state: a degraded rail that is SUSPECT for a moment is still degraded
    // (comparing the state logged "degraded" again on every tick).
    const bool was = s.health->degraded();
    // Hysteresis: degraded below the ratio by both measures, recovered above the midpoint to 1
    // by either.
    const bool confirmed_slow = confirm_median > 0 && s.confirm_bandwidth > 0 &&
                                s.confirm_bandwidth < confirm_median * ratio;
    const bool confirmed_fine = confirm_median > 0 && s.confirm_bandwidth > 0 &&
                                s.confirm_bandwidth >= confirm_median * (1 + ratio) / 2;
    const bool now_degraded = was ? !(s.bandwidth >= median * (1 + ratio) / 2 || confirmed_fine)
                                  : s.bandwidth < median * ratio && confirmed_slow;
    if (now_degraded == was) continue;
    s.health->set_degraded(now_degraded);
    update_usable(i);
    event(i, now_degraded ? "degraded" : "recovered",
          fmt::format("{:.1f} MB/s vs median {:.1f} MB/s", s.bandwidth / 1e6, median / 1e6));
    R2CCL_INFO(
        "rail {} ({}) to {} is {} ({:.1f} MB/s, median {:.1f} MB/s; confirmed {:.1f} "
        "MB/s, median {:.1f} MB/s)",
        i, s.nic.name, peer_, now_degraded ? "degraded" : "no longer degraded", s.bandwidth / 1e6,
        median / 1e6, s.confirm_bandwidth / 1e6, confirm_median / 1e6);
  }
}

}  // namespace r2ccl

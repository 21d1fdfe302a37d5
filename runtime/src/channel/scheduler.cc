#include "channel/scheduler.h"

#include <algorithm>
#include <cmath>

namespace r2ccl {

RailScheduler::RailScheduler(std::size_t rails, std::uint64_t window_bytes)
    : rails_(rails), window_(window_bytes) {}

void RailScheduler::set_bandwidth(std::size_t rail, double bytes_per_second) {
  rails_[rail].bandwidth = std::max(bytes_per_second, 1.0);
}

void RailScheduler::clear_bandwidth(std::size_t rail) {
  rails_[rail].bandwidth = 0;
}

double RailScheduler::bandwidth(std::size_t rail) const {
  if (rails_[rail].bandwidth > 0) return rails_[rail].bandwidth;
  double top = 0;
  for (const auto& r : rails_)
    top = std::max(top, r.bandwidth);
  return top > 0 ? top : 1.0;  // nothing measured yet: all equal
}

double RailScheduler::weight(std::size_t rail) const {
  double top = 0;
  for (std::size_t i = 0; i < rails_.size(); ++i)
    if (rails_[i].usable) top = std::max(top, bandwidth(i));
  return top > 0 && rails_[rail].usable ? bandwidth(rail) / top : 0.0;
}

void RailScheduler::set_usable(std::size_t rail, bool usable) {
  rails_[rail].usable = usable;
}

std::size_t RailScheduler::usable_count() const {
  return static_cast<std::size_t>(
      std::count_if(rails_.begin(), rails_.end(), [](const auto& r) { return r.usable; }));
}

std::optional<std::size_t> RailScheduler::pick(std::uint64_t bytes, std::uint64_t mask) {
  const auto in_mask = [&](std::size_t i) { return i >= 64 || ((mask >> i) & 1) != 0; };
  bool any = false;
  for (std::size_t i = 0; i < rails_.size(); ++i)
    any |= rails_[i].usable && in_mask(i);
  std::optional<std::size_t> best;
  double best_finish = 0;
  for (std::size_t i = 0; i < rails_.size(); ++i) {
    const auto& r = rails_[i];
    if (!r.usable || (any && !in_mask(i))) continue;
    const double finish = static_cast<double>(r.inflight + bytes) / bandwidth(i);
    if (!best || finish < best_finish) {
      best = i;
      best_finish = finish;
    }
  }
  if (!best) return std::nullopt;
  auto& r = rails_[*best];
  // Waiting for the rail that finishes first beats handing the chunk to a slower one.
  if (r.inflight != 0 && r.inflight + bytes > window_) return std::nullopt;
  r.inflight += bytes;
  return best;
}

void RailScheduler::release(std::size_t rail, std::uint64_t bytes) {
  auto& r = rails_[rail];
  r.inflight = bytes > r.inflight ? 0 : r.inflight - bytes;
}

}  // namespace r2ccl

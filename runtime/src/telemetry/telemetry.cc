#include "r2ccl/runtime/telemetry.h"

#include <algorithm>
#include <deque>

namespace r2ccl {

std::string_view rail_state_name(RailState s) {
  switch (s) {
    case RailState::kUp:
      return "up";
    case RailState::kSuspect:
      return "suspect";
    case RailState::kDown:
      return "down";
    case RailState::kProbing:
      return "probing";
    case RailState::kDegraded:
      return "degraded";
  }
  return "?";
}

void LatencyHistogram::observe(double seconds) {
  std::size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i])
    ++i;
  if (i < kBounds.size()) buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<std::uint64_t>(std::max(0.0, seconds) * 1e9),
                    std::memory_order_relaxed);
}

std::array<std::uint64_t, LatencyHistogram::kBounds.size()> LatencyHistogram::cumulative() const {
  std::array<std::uint64_t, kBounds.size()> out{};
  std::uint64_t run = 0;
  for (std::size_t i = 0; i < kBounds.size(); ++i) {
    run += buckets_[i].load(std::memory_order_relaxed);
    out[i] = run;
  }
  return out;
}

namespace {
// The entry with this name and labels, added if new.
template <typename Entry>
Entry& find_or_add(std::deque<Entry>& entries, const std::string& name, const std::string& help,
                   MetricRegistry::Labels labels) {
  for (auto& e : entries)
    if (e.name == name && e.labels == labels) return e;
  auto& e = entries.emplace_back();
  e.name = name;
  e.help = help;
  e.labels = std::move(labels);
  return e;
}
}  // namespace

MetricRegistry::Counter& MetricRegistry::counter(const std::string& name, const std::string& help,
                                                 Labels labels) {
  std::lock_guard lock(mutex_);
  return find_or_add(counters_, name, help, std::move(labels));
}

MetricRegistry::Histogram& MetricRegistry::histogram(const std::string& name,
                                                     const std::string& help, Labels labels) {
  std::lock_guard lock(mutex_);
  return find_or_add(histograms_, name, help, std::move(labels));
}

void MetricRegistry::for_each(const std::function<void(const Counter&)>& counters,
                              const std::function<void(const Histogram&)>& histograms) const {
  std::lock_guard lock(mutex_);
  for (const auto& c : counters_)
    counters(c);
  for (const auto& h : histograms_)
    histograms(h);
}

void RailEventLog::add(RailEvent event) {
  std::lock_guard lock(mutex_);
  if (events_.size() >= kMaxEvents) {
    events_.pop_front();
    ++dropped_;
  }
  events_.push_back(std::move(event));
}

std::vector<RailEvent> RailEventLog::snapshot() const {
  std::lock_guard lock(mutex_);
  return {events_.begin(), events_.end()};
}

std::uint64_t RailEventLog::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

}  // namespace r2ccl

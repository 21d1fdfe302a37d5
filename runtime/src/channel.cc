#include "r2ccl/runtime/channel.h"

#include <algorithm>

namespace r2ccl {

ArrivalSet::ArrivalSet(std::uint32_t chunks) : chunks_(chunks), bits_((chunks + 63) / 64, 0) {}

bool ArrivalSet::mark(std::uint32_t index) {
  if (index >= chunks_) return false;
  auto& word = bits_[index / 64];
  const std::uint64_t bit = 1ull << (index % 64);
  if (word & bit) return false;
  word |= bit;
  ++count_;
  return true;
}

bool ArrivalSet::contains(std::uint32_t index) const {
  return index < chunks_ && (bits_[index / 64] >> (index % 64)) & 1u;
}

std::vector<std::uint32_t> ArrivalSet::missing() const {
  std::vector<std::uint32_t> out;
  for (std::uint32_t i = 0; i < chunks_; ++i)
    if (!contains(i)) out.push_back(i);
  return out;
}

std::uint64_t InflightLedger::add(const InflightChunk& chunk) {
  const auto cookie = next_cookie_++;
  chunks_.emplace(cookie, chunk);
  return cookie;
}

std::optional<InflightChunk> InflightLedger::confirm(std::uint64_t cookie) {
  auto it = chunks_.find(cookie);
  if (it == chunks_.end()) return std::nullopt;
  InflightChunk c = it->second;
  chunks_.erase(it);
  return c;
}

std::vector<InflightChunk> InflightLedger::take_rail(std::uint32_t rail) {
  std::vector<InflightChunk> out;
  for (auto it = chunks_.begin(); it != chunks_.end();) {
    if (it->second.rail == rail) {
      out.push_back(it->second);
      it = chunks_.erase(it);
    } else {
      ++it;
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.message != b.message ? a.message < b.message : a.index < b.index;
  });
  return out;
}

std::vector<InflightChunk> InflightLedger::take_message(std::uint64_t message) {
  std::vector<InflightChunk> out;
  for (auto it = chunks_.begin(); it != chunks_.end();) {
    if (it->second.message == message) {
      out.push_back(it->second);
      it = chunks_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::uint64_t InflightLedger::bytes_on_rail(std::uint32_t rail) const {
  std::uint64_t total = 0;
  for (const auto& [cookie, c] : chunks_)
    if (c.rail == rail) total += c.length;
  return total;
}

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

std::optional<std::size_t> RailScheduler::pick(std::uint64_t bytes) {
  std::optional<std::size_t> best;
  double best_finish = 0;
  for (std::size_t i = 0; i < rails_.size(); ++i) {
    const auto& r = rails_[i];
    if (!r.usable) continue;
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

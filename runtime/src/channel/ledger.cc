#include "channel/ledger.h"

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

}  // namespace r2ccl

// The multi-rail channel's bookkeeping (DESIGN.md, The data path):
//
// - Chunks are idempotent: (message, chunk index) written to a fixed place. The chunk identity
//   travels in the write's 32-bit immediate (ChunkImm), so it works the same over verbs.
// - ArrivalSet: the receiver records arrivals in a set, never a counter, so a chunk delivered
//   twice counts once.
// - InflightLedger: the sender keeps every chunk until the provider confirms delivery; on a rail
//   failure take_rail() hands back exactly the unconfirmed chunks of that rail for replay.
// - The scheduler that picks a chunk's rail is in scheduler.h.
//
// These are plain data structures, used on the progress thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

namespace r2ccl {

// imm = slot (12 bits) | chunk index (20 bits). Two-sided messages use slots 0..4094 (message
// sequence number modulo 4095); slot 4095 marks one-sided writes, which no receive waits for.
struct ChunkImm {
  static constexpr std::uint32_t kSlotBits = 12;
  static constexpr std::uint32_t kIndexBits = 20;
  static constexpr std::uint32_t kSlots = (1u << kSlotBits) - 1;  // for two-sided messages
  static constexpr std::uint32_t kOneSidedSlot = kSlots;
  static constexpr std::uint32_t kMaxChunks = 1u << kIndexBits;
  // Message ids of one-sided writes carry this bit (two-sided ones count from 0).
  static constexpr std::uint64_t kOneSidedBit = 1ull << 63;
  static std::uint32_t slot_of(std::uint64_t message) {
    return (message & kOneSidedBit) ? kOneSidedSlot : static_cast<std::uint32_t>(message % kSlots);
  }
  static std::uint32_t encode(std::uint32_t slot, std::uint32_t index) {
    return (slot << kIndexBits) | index;
  }
  static std::uint32_t slot(std::uint32_t imm) { return imm >> kIndexBits; }
  static std::uint32_t index(std::uint32_t imm) { return imm & (kMaxChunks - 1); }
};

class ArrivalSet {
 public:
  explicit ArrivalSet(std::uint32_t chunks = 0);
  // Records chunk `index`; true when it is new, false for a duplicate or an index out of range.
  bool mark(std::uint32_t index);
  bool contains(std::uint32_t index) const;
  bool complete() const { return count_ == chunks_; }
  std::uint32_t count() const { return count_; }
  std::uint32_t chunks() const { return chunks_; }
  std::vector<std::uint32_t> missing() const;

 private:
  std::uint32_t chunks_;
  std::uint32_t count_ = 0;
  std::vector<std::uint64_t> bits_;
};

struct InflightChunk {
  std::uint64_t message = 0;  // sender's message sequence number
  std::uint32_t index = 0;    // chunk index within the message
  std::uint32_t rail = 0;     // rail it was posted on
  std::uint64_t offset = 0;   // byte offset within the message
  std::uint64_t length = 0;
  std::chrono::steady_clock::time_point posted{};
};

class InflightLedger {
 public:
  // Records a posted chunk; returns its cookie (never 0).
  std::uint64_t add(const InflightChunk& chunk);
  // Delivery confirmed: removes and returns the chunk; nullopt for an unknown or repeated cookie.
  std::optional<InflightChunk> confirm(std::uint64_t cookie);
  // Removes and returns every unconfirmed chunk posted on `rail` (to replay elsewhere).
  std::vector<InflightChunk> take_rail(std::uint32_t rail);
  // Removes and returns every chunk of a message (it failed or was cancelled).
  std::vector<InflightChunk> take_message(std::uint64_t message);
  std::size_t size() const { return chunks_.size(); }
  std::uint64_t bytes_on_rail(std::uint32_t rail) const;

 private:
  std::uint64_t next_cookie_ = 1;
  std::unordered_map<std::uint64_t, InflightChunk> chunks_;
};

}  // namespace r2ccl

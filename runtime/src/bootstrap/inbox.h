// Control messages from one sender, taken once each and in the sender's order, whichever of two
// paths brings a copy first (rank 0's relay, the data rails). Each path is in order by itself;
// a copy may be missing from one of them (a send that failed there). Private to
// runtime/src/bootstrap.
#pragma once

#include <cstdint>
#include <map>
#include <utility>

#include "r2ccl/runtime/wire.h"

namespace r2ccl::bootstrap_wire {

class InOrderInbox {
 public:
  // Messages ahead of a missing one that are kept until it comes. More are dropped: their copies
  // on the path that still has the missing one follow it there, in order.
  static constexpr std::size_t kMaxHeld = 64;

  enum class Outcome {
    kDelivered,  // it was next: handed over, with the held ones that follow it
    kHeld,       // an earlier one is missing: kept
    kDuplicate,  // a copy of one taken already (or held already): dropped
    kDropped,    // ahead of a missing one and kMaxHeld are held: dropped
  };

  // Takes message #seq (seq >= 1); `deliver(Bytes)` is called for each message taken, in order.
  template <class Deliver>
  Outcome accept(std::uint64_t seq, Bytes message, Deliver&& deliver) {
    if (seq < next_ || held_.count(seq) != 0) return Outcome::kDuplicate;
    if (seq > next_) {
      if (held_.size() >= kMaxHeld) return Outcome::kDropped;
      held_.emplace(seq, std::move(message));
      return Outcome::kHeld;
    }
    deliver(std::move(message));
    ++next_;
    for (auto it = held_.begin(); it != held_.end() && it->first == next_; it = held_.erase(it)) {
      deliver(std::move(it->second));
      ++next_;
    }
    return Outcome::kDelivered;
  }

  // The sequence number of the next message to take.
  std::uint64_t next() const { return next_; }
  std::size_t held() const { return held_.size(); }

 private:
  std::uint64_t next_ = 1;
  std::map<std::uint64_t, Bytes> held_;
};

}  // namespace r2ccl::bootstrap_wire

// An operation in progress (a send, receive or one-sided write), completed exactly once.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

// Every rail (a send's rail mask: bit i is rail i).
inline constexpr std::uint64_t kAllRails = ~std::uint64_t{0};

// A send or receive in progress. Completed exactly once, on the progress thread.
class Op {
 public:
  bool done() const;
  Status status() const;  // only meaningful once done()
  // Waits for completion at most `timeout`; a timeout here is an error of its own.
  Status wait(std::chrono::milliseconds timeout);
  void complete(Status status);  // first call wins
  // Runs `fn` with the status once the operation completes (at once if it has): on the progress
  // thread, so it must not block. One callback per operation.
  void on_complete(std::function<void(const Status&)> fn);
  // Some of its data was re-sent after a rail failed (the operation survived a failover).
  bool replayed() const { return replayed_.load(std::memory_order_relaxed); }
  void mark_replayed() { replayed_.store(true, std::memory_order_relaxed); }
  // When the endpoint fails the operation unless it completes; moves later while data to the
  // peer keeps being confirmed. Waiters follow it.
  void set_deadline(std::chrono::steady_clock::time_point t) {
    deadline_ns_.store(t.time_since_epoch().count(), std::memory_order_relaxed);
  }
  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(deadline_ns_.load(std::memory_order_relaxed)));
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::atomic<bool> done_flag_{false};  // done_, readable without the lock (the waiter's spin)
  Status status_;
  std::function<void(const Status&)> callback_;
  std::atomic<bool> replayed_{false};
  std::atomic<std::chrono::steady_clock::rep> deadline_ns_{0};
};
using OpPtr = std::shared_ptr<Op>;

}  // namespace r2ccl

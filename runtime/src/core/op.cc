#include "r2ccl/runtime/op.h"

#include <fmt/format.h>

#include <thread>

namespace r2ccl {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

bool Op::done() const {
  return done_flag_.load(std::memory_order_acquire);
}

Status Op::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

Status Op::wait(milliseconds timeout) {
  // A short spin first (yielding, so the progress thread of this or another rank gets the core):
  // a small message completes within it and the waiter skips a sleep and wake-up.
  constexpr auto kSpin = std::chrono::microseconds(50);
  const auto spin_until =
      std::chrono::steady_clock::now() + std::min<Clock::duration>(kSpin, timeout);
  while (!done_flag_.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < spin_until)
    std::this_thread::yield();
  std::unique_lock lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; }))
    return {ErrorCode::kTimeout,
            fmt::format("operation did not complete within {}ms", timeout.count())};
  return status_;
}

void Op::complete(Status status) {
  std::function<void(const Status&)> fn;
  {
    std::lock_guard lock(mutex_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
    done_flag_.store(true, std::memory_order_release);
    fn = std::move(callback_);
  }
  cv_.notify_all();
  if (fn) fn(status_);
}

void Op::on_complete(std::function<void(const Status&)> fn) {
  {
    std::lock_guard lock(mutex_);
    if (!done_) {
      callback_ = std::move(fn);
      return;
    }
  }
  fn(status_);
}

}  // namespace r2ccl

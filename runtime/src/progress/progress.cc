#include "r2ccl/runtime/provider/progress.h"

#include "r2ccl/runtime/log.h"

namespace r2ccl {

namespace {
using Clock = ProgressEngine::Clock;
// After its last handler, the loop's runner keeps polling this long before blocking in epoll:
// the next event of a message exchange usually follows within microseconds. (Callers that
// polled for 5 ms kept two unpinned ranks on separate cores, but in the emulated Soft-RoCE
// guest the polling took CPU from the NIC's kernel work: both-ways throughput fell by a third,
// and a rail failed with no fault injected. Not worth it.)
constexpr auto kSpin = std::chrono::microseconds(50);
// The engine's thread stays parked this long after a caller stopped driving: a caller issuing
// operation after operation then finds the loop free each time, without waking the thread.
// Background events (timers, a peer's messages) wait at most this long while nobody drives.
constexpr auto kLinger = std::chrono::milliseconds(1);
// While callers drive, the parked thread looks again this often (a caller that stops driving
// does not wake it): rarely, since each wake-up can take a core from a driving caller, yet often
// enough that background work (probes, whose silence counts after 100 ms) resumes in time.
constexpr auto kParkedRecheck = std::chrono::milliseconds(20);
// During a run of handlers the clock is read after this many (for the caller's time limit).
constexpr unsigned kHandlersPerClockRead = 32;

// The engine whose loop this thread runs now, if any.
thread_local const ProgressEngine* t_running = nullptr;

class RunningHere {
 public:
  explicit RunningHere(const ProgressEngine* e) : saved_(t_running) { t_running = e; }
  ~RunningHere() { t_running = saved_; }
  RunningHere(const RunningHere&) = delete;
  RunningHere& operator=(const RunningHere&) = delete;

 private:
  const ProgressEngine* saved_;
};

// A handler must never throw; if one does, say so loudly instead of terminating.
template <typename F>
void guarded(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    R2CCL_ERROR("progress engine: handler threw: {}", e.what());
  } catch (...) {
    R2CCL_ERROR("progress engine: handler threw something that is not a std::exception");
  }
}
}  // namespace

ProgressEngine::ProgressEngine()
    : work_(boost::asio::make_work_guard(io_)), thread_([this] { thread_main(); }) {}

ProgressEngine::~ProgressEngine() {
  stop();
}

bool ProgressEngine::run_here_if_free(void (*fn)(void*), void* arg) {
  if (submitted_.load(std::memory_order_acquire) != 0 || in_loop() || stopping_.load())
    return false;
  std::unique_lock loop(loop_mutex_, std::try_to_lock);
  // Looked at again with the loop held: work queued before it is not overtaken.
  if (!loop.owns_lock() || submitted_.load(std::memory_order_acquire) != 0) return false;
  RunningHere here(this);
  guarded([&] { fn(arg); });
  return true;
}

bool ProgressEngine::in_loop() const {
  return t_running == this;
}

void ProgressEngine::thread_main() {
  while (!stopping_.load()) {
    park();
    if (stopping_.load()) break;
    // thread_owns_ is set before the loop is taken and cleared after it is released, so that
    // a caller that finds the loop taken never mistakes the engine's thread for another caller.
    thread_owns_.store(true);
    std::unique_lock loop(loop_mutex_, std::try_to_lock);
    if (!loop.owns_lock()) {  // a caller drives: park again
      thread_owns_.store(false);
      continue;
    }
    {
      RunningHere here(this);
      guarded([this] { run_adaptive(); });
    }
    loop.unlock();
    thread_owns_.store(false);
  }
}

void ProgressEngine::park() {
  std::unique_lock lock(park_mutex_);
  while (!stopping_.load()) {
    const auto since = Clock::now() - Clock::time_point(Clock::duration(last_drive_end_.load()));
    if (drivers_.load() == 0 && since >= kLinger) return;
    // Timed: a caller that stops driving does not have to wake this thread.
    park_cv_.wait_for(lock,
                      drivers_.load() > 0 ? Clock::duration(kParkedRecheck) : kLinger - since);
  }
}

bool ProgressEngine::step(Spin& spin, Clock::time_point until) {
  // One handler at a time: the caller's condition is looked at after each, so an operation that
  // a handler completed ends the wait without another round of the reactor.
  if (io_.poll_one() > 0) {
    spin.worked = true;
    if (++spin.handlers < kHandlersPerClockRead) return true;
  }
  const auto now = Clock::now();
  const bool worked = spin.worked;
  if (worked) {
    spin.last_work = now;
    spin.worked = false;
    spin.handlers = 0;
  }
  if (now >= until) return false;
  if (worked) return true;
  if (now - spin.last_work < kSpin) {
    std::this_thread::yield();
    return true;
  }
  if (!idle_.empty()) {
    auto work = std::move(idle_);
    idle_.clear();
    for (auto& fn : work)
      fn();
    spin.worked = true;
    return true;
  }
  // Blocks until something happens (a driver posts a no-op to end the engine thread's wait).
  if (until == Clock::time_point::max())
    io_.run_one();
  else
    io_.run_one_until(until);
  spin.worked = true;
  return true;
}

void ProgressEngine::run_adaptive() {
  Spin spin;
  while (!io_.stopped() && drivers_.load() == 0)
    step(spin, Clock::time_point::max());
}

bool ProgressEngine::drive_until(const std::function<bool()>& done, Clock::time_point until) {
  if (in_loop() || stopping_.load()) return false;
  drivers_.fetch_add(1);
  struct Leave {
    ProgressEngine* e;
    ~Leave() {
      e->last_drive_end_.store(Clock::now().time_since_epoch().count());
      e->drivers_.fetch_sub(1);
    }
  } leave{this};
  std::unique_lock loop(loop_mutex_, std::try_to_lock);
  if (!loop.owns_lock()) {
    // The engine's thread steps aside once it sees drivers_ (the no-op ends a blocking wait);
    // another caller may hold the loop for a long wait, so give up if it turns out to be one.
    post([] {});
    while (!loop.try_lock()) {
      if (!thread_owns_.load() || Clock::now() >= until) return false;
      std::this_thread::yield();
    }
  }
  RunningHere here(this);
  Spin spin;
  guarded([&] {
    while (!done() && !io_.stopped() && step(spin, until)) {
    }
  });
  return true;
}

void ProgressEngine::wait_for(const std::function<bool()>& done) {
  while (!done()) {
    if (stopping_.load()) return;  // nothing will run it any more
    if (!drive_until(done, Clock::now() + std::chrono::milliseconds(100)))
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void ProgressEngine::run_stopped(const std::function<void()>& fn) {
  std::lock_guard loop(loop_mutex_);
  RunningHere here(this);
  guarded(fn);
}

void ProgressEngine::stop() {
  stopping_.store(true);
  { std::lock_guard lock(park_mutex_); }
  park_cv_.notify_all();
  work_.reset();
  io_.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace r2ccl

// The progress engine: one event loop (Asio's reactor: epoll) that runs every provider and
// channel handler, one thread at a time. A thread that waits for an operation drives the loop
// itself (drive_until) while no other caller does, so a small message costs no hand-off between
// threads; the engine's own thread runs the loop otherwise, and steps aside (parks) while callers
// drive and for a short linger after, so that a caller's next operation finds the loop free.
// Whoever runs the loop polls for at most 50 us after work (yielding the core) and then blocks in
// the kernel: no long busy polling, which on a small machine would starve the other ranks
// (DESIGN.md, Progress).
#pragma once

#include <utility>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace r2ccl {

class ProgressEngine {
 public:
  using Clock = std::chrono::steady_clock;

  ProgressEngine();
  ~ProgressEngine();  // stops the loop and joins the thread
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  boost::asio::io_context& io() { return io_; }
  // Whether the calling thread is the one running the loop now (inside a handler, or driving).
  bool in_loop() const;

  template <typename F>
  void post(F&& f) {
    boost::asio::post(io_, std::forward<F>(f));
  }
  // Runs f on the loop: at once on the calling thread when the loop is free (no other thread
  // runs it) and no work submitted earlier still waits in its queue, else queued like post().
  // Work handed in through submit() thus runs in the order it was submitted, and an operation
  // that a caller posts before driving the loop starts at once, not after the reactor's next
  // poll (a system call on a small message's critical path).
  template <typename F>
  void submit(F&& f) {
    auto call = [](void* fn) { (*static_cast<std::remove_reference_t<F>*>(fn))(); };
    if (run_here_if_free(call, &f)) return;
    submitted_.fetch_add(1, std::memory_order_acq_rel);
    post([this, f = std::forward<F>(f)]() mutable {
      submitted_.fetch_sub(1, std::memory_order_acq_rel);
      f();
    });
  }

  // Runs fn once, on the loop, when the loop has had nothing to do for the spin period and is
  // about to block: for work worth batching with whatever the next handlers produce. Only from
  // the loop.
  void when_idle(std::function<void()> fn) { idle_.push_back(std::move(fn)); }
  // Runs f on the loop and waits for its result (runs inline when already there). Once the
  // engine has stopped, nothing runs the loop any more: f then runs on the calling thread, holding
  // the loop as a handler would (so a call racing stop() neither hangs nor runs f twice).
  template <typename F>
  auto call(F&& f) -> decltype(f()) {
    using R = decltype(f());
    if (in_loop()) return f();
    struct Call {
      explicit Call(F&& fn) : task(std::forward<F>(fn)) {}
      std::packaged_task<R()> task;
      std::atomic<bool> claimed{false};  // whoever sets it runs the task
      std::atomic<bool> ran{false};
    };
    auto c = std::make_shared<Call>(std::forward<F>(f));
    auto fut = c->task.get_future();
    if (!stopping_.load()) {
      boost::asio::post(io_, [c] {
        if (c->claimed.exchange(true)) return;
        c->task();
        c->ran.store(true, std::memory_order_release);
      });
      wait_for([&] { return c->ran.load(std::memory_order_acquire); });
    }
    if (!c->ran.load(std::memory_order_acquire)) {
      if (!c->claimed.exchange(true)) {
        run_stopped([&] { c->task(); });
      } else {
        // The loop's last handler is running it now: it finishes.
        while (!c->ran.load(std::memory_order_acquire))
          std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    return fut.get();
  }
  // Runs the loop on the calling thread until done() holds or `until` passes, unless another
  // caller drives it now or the calling thread is already in the loop: then returns false at once
  // and the caller waits some other way. done() is checked between handlers, on this thread.
  bool drive_until(const std::function<bool()>& done, Clock::time_point until);
  // Stops the loop; pending handlers are dropped. Called by the destructor.
  void stop();

 private:
  // submit()'s first try: runs fn(arg) as a handler on the calling thread if the loop is free
  // and no submitted work is queued; false (nothing run) otherwise.
  bool run_here_if_free(void (*fn)(void*), void* arg);

  // call()'s work once the engine stopped: on the calling thread, with the loop held.
  void run_stopped(const std::function<void()>& fn);
  // Drives the loop until done(), or sleeps a little while another caller drives it.
  void wait_for(const std::function<bool()>& done);
  void thread_main();
  void park();          // while callers drive, and for the linger after
  void run_adaptive();  // until a caller wants the loop or the engine stops
  // Where a loop runner is in its spin: the clock is read only when the loop finds nothing to do
  // (and now and then during a long run of handlers), since reading it costs about as much as
  // handling a small message.
  struct Spin {
    Clock::time_point last_work{};
    bool worked = true;     // handlers ran since the clock was last read
    unsigned handlers = 0;  // handlers run since then
  };
  // One step of whoever runs the loop: runs a ready handler, else spins (yielding) until kSpin
  // after the last work, else runs the idle work, else blocks until `until`. False once
  // `until` has passed.
  bool step(Spin& spin, Clock::time_point until);

  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::mutex loop_mutex_;                 // held by whichever thread runs the loop
  std::atomic<bool> thread_owns_{false};  // the engine's own thread holds loop_mutex_ (or takes it)
  std::atomic<int> drivers_{0};           // callers driving or about to
  std::atomic<int> submitted_{0};         // submit()ted work queued, not yet started
  std::atomic<Clock::rep> last_drive_end_{0};
  std::atomic<bool> stopping_{false};
  std::vector<std::function<void()>> idle_;  // when_idle's work; touched only on the loop
  std::mutex park_mutex_;
  std::condition_variable park_cv_;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace r2ccl

// The progress engine: one event loop thread (Asio's reactor: epoll) that runs every provider
// and channel handler. After work it polls for at most 50 us (yielding the core), then blocks in
// the kernel — no long busy polling, which on a small machine would starve the other ranks
// (DESIGN.md, Progress).
#pragma once

#include <utility>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <functional>
#include <future>
#include <thread>

namespace r2ccl {

class ProgressEngine {
 public:
  ProgressEngine();
  ~ProgressEngine();  // stops the loop and joins the thread
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;

  boost::asio::io_context& io() { return io_; }
  bool in_loop() const { return std::this_thread::get_id() == thread_.get_id(); }

  template <typename F>
  void post(F&& f) {
    boost::asio::post(io_, std::forward<F>(f));
  }
  // Runs f on the loop thread and waits for its result (runs inline when already there).
  template <typename F>
  auto call(F&& f) -> decltype(f()) {
    if (in_loop()) return f();
    std::packaged_task<decltype(f())()> task(std::forward<F>(f));
    auto fut = task.get_future();
    boost::asio::post(io_, [&task] { task(); });
    return fut.get();
  }
  // Stops the loop; pending handlers are dropped. Called by the destructor.
  void stop();

 private:
  void run_adaptive();
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::thread thread_;
};

}  // namespace r2ccl

#include "r2ccl/runtime/progress.h"

#include <chrono>

#include "r2ccl/runtime/log.h"

namespace r2ccl {

ProgressEngine::ProgressEngine()
    : work_(boost::asio::make_work_guard(io_)), thread_([this] {
        try {
          run_adaptive();
        } catch (const std::exception& e) {
          // A handler must never throw; if one does, say so loudly instead of terminating.
          R2CCL_ERROR("progress engine: handler threw: {}", e.what());
        }
      }) {}

// Runs handlers as they become ready; after the last one, keeps polling (yielding the core
// between polls) for a short while, because the next event of a message exchange usually
// follows within microseconds, and only then blocks in epoll. Blocking at once costs a
// sleep and wake-up per message; spinning for longer starves other ranks on a small machine.
void ProgressEngine::run_adaptive() {
  using Clock = std::chrono::steady_clock;
  constexpr auto kSpin = std::chrono::microseconds(50);
  auto last_work = Clock::now();
  while (!io_.stopped()) {
    if (io_.poll() > 0) {
      last_work = Clock::now();
      continue;
    }
    if (Clock::now() - last_work < kSpin) {
      std::this_thread::yield();
      continue;
    }
    io_.run_one();  // blocks until something happens
    last_work = Clock::now();
  }
}

ProgressEngine::~ProgressEngine() {
  stop();
}

void ProgressEngine::stop() {
  work_.reset();
  io_.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace r2ccl

#include "r2ccl/runtime/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <mutex>

namespace r2ccl {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kWarn)};
std::atomic<int> g_rank{-1};
std::mutex g_write_mutex;
std::atomic<LogSink> g_sink{nullptr};
}  // namespace

std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "error";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kTrace:
      return "trace";
  }
  return "?";
}

void set_log_level(LogLevel level) {
  g_level.store(static_cast<int>(level));
}
LogLevel log_level() {
  return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed));
}
void set_log_rank(int rank) {
  g_rank.store(rank);
}
int log_rank() {
  return g_rank.load();
}
bool claim_log_rank(int rank) {
  int unset = -1;
  return g_rank.compare_exchange_strong(unset, rank);
}

void set_log_sink(LogSink sink) {
  g_sink.store(sink);
}

void log_write(LogLevel level, std::string_view message) {
  if (const LogSink sink = g_sink.load()) {
    sink(level, message);
    return;
  }
  using namespace std::chrono;
  const double t = duration<double>(steady_clock::now().time_since_epoch()).count();
  const int rank = g_rank.load();
  std::string line = rank >= 0 ? fmt::format("r2ccl[rank {} pid {}] {:.6f} {}: {}\n", rank,
                                             getpid(), t, log_level_name(level), message)
                               : fmt::format("r2ccl[pid {}] {:.6f} {}: {}\n", getpid(), t,
                                             log_level_name(level), message);
  std::lock_guard lock(g_write_mutex);
  std::fputs(line.c_str(), stderr);
}

bool LogLimiter::admit(Clock::time_point now, std::uint64_t& dropped) {
  std::lock_guard lock(mutex_);
  if (in_window_ == 0 || now - window_start_ >= kWindow) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= kBurst) {
    ++dropped_;
    return false;
  }
  ++in_window_;
  dropped = dropped_;
  dropped_ = 0;
  return true;
}

void log_limited(LogLimiter& limiter, LogLevel level, std::string message) {
  std::uint64_t dropped = 0;
  if (!limiter.admit(LogLimiter::Clock::now(), dropped)) return;
  if (dropped > 0)
    message += fmt::format(" ({} more like this were not logged: at most {} per {}s)", dropped,
                           LogLimiter::kBurst, LogLimiter::kWindow.count());
  log_write(level, message);
}

}  // namespace r2ccl

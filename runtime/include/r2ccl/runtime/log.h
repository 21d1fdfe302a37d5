// Logging to stderr, level chosen by R2CCL_LOG (error, warn, info, debug, trace).
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string_view>

namespace r2ccl {

enum class LogLevel { kError = 0, kWarn, kInfo, kDebug, kTrace };

std::string_view log_level_name(LogLevel level);
void set_log_level(LogLevel level);
LogLevel log_level();
// Shown in every line ("r2ccl[rank 3]"); -1 before the rank is known.
void set_log_rank(int rank);
int log_rank();
// The rank of the process's first world names its lines: sets it only while none is (a split's
// communicator, or a second one, does not relabel them); whether it did.
bool claim_log_rank(int rank);
void log_write(LogLevel level, std::string_view message);
// Where lines go instead of stderr (a host's logger, e.g. NCCL's for the network plugin); the
// sink gets the level and the message alone. Null: stderr again. The sink must not log itself.
using LogSink = void (*)(LogLevel level, std::string_view message);
void set_log_sink(LogSink sink);

inline bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= static_cast<int>(log_level());
}

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (log_enabled(level)) log_write(level, fmt::format(format, std::forward<Args>(args)...));
}

// Bounds the lines one call site writes, for events a remote party can cause at will (refused
// connections, refused writes): at most kBurst lines per kWindow; the ones beyond are counted,
// and the next line that passes says how many were not written.
class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kBurst = 10;
  static constexpr std::chrono::seconds kWindow{10};
  // True: write this line; `dropped` is then how many were held back since the last one written.
  bool admit(Clock::time_point now, std::uint64_t& dropped);

 private:
  std::mutex mutex_;
  Clock::time_point window_start_{};
  int in_window_ = 0;
  std::uint64_t dropped_ = 0;
};

void log_limited(LogLimiter& limiter, LogLevel level, std::string message);

}  // namespace r2ccl

#define R2CCL_LOG_AT(level, ...)                                       \
  do {                                                                 \
    if (::r2ccl::log_enabled(level)) ::r2ccl::log(level, __VA_ARGS__); \
  } while (0)
#define R2CCL_ERROR(...) R2CCL_LOG_AT(::r2ccl::LogLevel::kError, __VA_ARGS__)
#define R2CCL_WARN(...) R2CCL_LOG_AT(::r2ccl::LogLevel::kWarn, __VA_ARGS__)
#define R2CCL_INFO(...) R2CCL_LOG_AT(::r2ccl::LogLevel::kInfo, __VA_ARGS__)
#define R2CCL_DEBUG(...) R2CCL_LOG_AT(::r2ccl::LogLevel::kDebug, __VA_ARGS__)
#define R2CCL_TRACE(...) R2CCL_LOG_AT(::r2ccl::LogLevel::kTrace, __VA_ARGS__)
// A warning that a peer can cause at will: rate-limited per call site (LogLimiter).
#define R2CCL_WARN_LIMITED(...)                                                                 \
  do {                                                                                          \
    if (::r2ccl::log_enabled(::r2ccl::LogLevel::kWarn)) {                                       \
      static ::r2ccl::LogLimiter r2ccl_limiter_;                                                \
      ::r2ccl::log_limited(r2ccl_limiter_, ::r2ccl::LogLevel::kWarn, fmt::format(__VA_ARGS__)); \
    }                                                                                           \
  } while (0)

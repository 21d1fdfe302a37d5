// NIXL's logging macros (common/nixl_log.h in NIXL's tree) over r2ccl's log, for the vendored
// NIXL headers: NIXL's own header needs a newer Abseil than Debian 12 has. A message is
// streamed into a line and written through r2ccl::log_write when the statement ends.
#pragma once

#include <sstream>
#include <string>

#include "r2ccl/runtime/log.h"

namespace r2ccl::nixl {

class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine() {
    if (log_enabled(level_)) log_write(level_, "nixl: " + out_.str());
  }
  template <typename T>
  LogLine& operator<<(const T& v) {
    if (log_enabled(level_)) out_ << v;
    return *this;
  }

 private:
  LogLevel level_;
  std::ostringstream out_;
};

}  // namespace r2ccl::nixl

#define NIXL_ERROR ::r2ccl::nixl::LogLine(::r2ccl::LogLevel::kError)
#define NIXL_WARN ::r2ccl::nixl::LogLine(::r2ccl::LogLevel::kWarn)
#define NIXL_INFO ::r2ccl::nixl::LogLine(::r2ccl::LogLevel::kInfo)
#define NIXL_DEBUG ::r2ccl::nixl::LogLine(::r2ccl::LogLevel::kDebug)
#define NIXL_TRACE ::r2ccl::nixl::LogLine(::r2ccl::LogLevel::kTrace)
#define NIXL_ERROR_FUNC NIXL_ERROR << __FUNCTION__ << ": "
// NIXL's NIXL_ASSERT is Abseil's DCHECK: nothing in a release build, as here.
#define NIXL_ASSERT(condition) static_cast<void>(0)

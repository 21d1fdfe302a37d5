#include "r2ccl/runtime/status.h"

#include <fmt/format.h>

namespace r2ccl {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kConfig:
      return "configuration error";
    case ErrorCode::kBootstrap:
      return "bootstrap error";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kNetwork:
      return "network error";
    case ErrorCode::kProtocol:
      return "protocol error";
    case ErrorCode::kRemoteRefused:
      return "refused by peer";
    case ErrorCode::kNotFound:
      return "not found";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kAborted:
      return "aborted";
    case ErrorCode::kInternal:
      return "internal error";
    case ErrorCode::kClosed:
      return "closed";
    case ErrorCode::kNoResource:
      return "no resource";
  }
  return "unknown error";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return fmt::format("{}: {}", error_code_name(code_), message_);
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  return {code_, fmt::format("{}: {}", context, message_)};
}

}  // namespace r2ccl

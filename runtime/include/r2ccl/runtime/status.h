// Errors as values: Status and Result<T>. Nothing in r2ccl throws across a module boundary.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace r2ccl {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,  // the caller passed something wrong
  kConfig,           // an R2CCL_* variable has a bad value
  kBootstrap,        // rendezvous failed (token, rank, world size, unreachable root)
  kTimeout,          // a deadline passed
  kNetwork,          // a socket or device failed
  kProtocol,         // a peer sent something malformed or forbidden
  kRemoteRefused,    // the peer refused a write (outside a registered region)
  kNotFound,
  kUnavailable,  // no usable rail / device
  kAborted,
  kInternal,
  kClosed,      // the peer closed the connection (its process ended, or it disconnected)
  kNoResource,  // a queue is full: nothing was taken, try again later
};

std::string_view error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const { return code_ == ErrorCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "timeout: rank 1 did not ..." — code name and message.
  std::string to_string() const;
  // Prepends context: "while X: <message>".
  Status with_context(std::string_view context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).is_ok() && "Result built from an OK status");
  }

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::get<T>(std::move(v_)); }
  Status status() const { return is_ok() ? Status::ok() : std::get<Status>(v_); }
  T value_or(T fallback) const& { return is_ok() ? value() : std::move(fallback); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace r2ccl

#define R2CCL_CONCAT_INNER(a, b) a##b
#define R2CCL_CONCAT(a, b) R2CCL_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if it is an error.
#define R2CCL_RETURN_IF_ERROR(expr)           \
  do {                                        \
    ::r2ccl::Status r2ccl_st_ = (expr);       \
    if (!r2ccl_st_.is_ok()) return r2ccl_st_; \
  } while (0)

#define R2CCL_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.is_ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

// R2CCL_ASSIGN_OR_RETURN(auto x, f()); returns f()'s error status if any.
#define R2CCL_ASSIGN_OR_RETURN(lhs, expr) \
  R2CCL_ASSIGN_OR_RETURN_IMPL(R2CCL_CONCAT(r2ccl_res_, __LINE__), lhs, expr)

#include "abi.h"

namespace r2ccl::capi {
namespace {
thread_local std::string t_last_error;
}  // namespace

r2cclResult_t to_result(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return r2cclSuccess;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kNotFound:
      return r2cclInvalidArgument;
    case ErrorCode::kConfig:
    case ErrorCode::kAborted:
      return r2cclInvalidUsage;
    case ErrorCode::kTimeout:
      return r2cclTimeout;
    case ErrorCode::kNetwork:
    case ErrorCode::kUnavailable:
      return r2cclSystemError;
    case ErrorCode::kBootstrap:
    case ErrorCode::kProtocol:
    case ErrorCode::kRemoteRefused:
    case ErrorCode::kClosed:
      return r2cclRemoteError;
    case ErrorCode::kNoResource:
      return r2cclTryAgain;
    case ErrorCode::kInternal:
      return r2cclInternalError;
  }
  return r2cclUnhandledError;
}

r2cclResult_t fail(ErrorSlot* slot, r2cclResult_t result, std::string message) {
  if (slot != nullptr) {
    std::lock_guard lock(slot->mutex);
    slot->text = message;
  }
  t_last_error = std::move(message);
  return result;
}

r2cclResult_t fail(ErrorSlot* slot, const Status& st) {
  return fail(slot, to_result(st.code()), st.to_string());
}

const char* last_error(ErrorSlot* slot) {
  if (slot == nullptr) return t_last_error.c_str();
  // Copied to the thread's own string, so that the pointer stays valid while another thread
  // fails on the same object.
  try {
    std::lock_guard lock(slot->mutex);
    t_last_error = slot->text;
  } catch (...) {
    return "";
  }
  return t_last_error.c_str();
}

}  // namespace r2ccl::capi

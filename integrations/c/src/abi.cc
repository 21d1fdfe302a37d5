#include "abi.h"

namespace r2ccl::capi {
namespace {
thread_local std::string t_last_error;
// What r2cclGetLastError last returned: a copy, so that a later failure does not move it.
thread_local std::string t_returned;
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
  try {
    if (slot == nullptr) {
      t_returned = t_last_error;
    } else {
      std::lock_guard lock(slot->mutex);
      t_returned = slot->text;
    }
  } catch (...) {
    return "";
  }
  return t_returned.c_str();
}

}  // namespace r2ccl::capi

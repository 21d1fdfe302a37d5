// What every entry point of the C ABI shares: results from the runtime's error codes, the text of
// the last error (per object and per thread), and the guard that keeps exceptions out of C.
#pragma once

#include <fmt/format.h>

#include <exception>
#include <mutex>
#include <new>
#include <string>

#include "r2ccl.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::capi {

// The last error of one object (a communicator, a KV engine).
struct ErrorSlot {
  std::mutex mutex;
  std::string text;
};

r2cclResult_t to_result(ErrorCode code);
// Records `message` as the last error of the calling thread and of `slot` (may be null).
r2cclResult_t fail(ErrorSlot* slot, r2cclResult_t result, std::string message);
r2cclResult_t fail(ErrorSlot* slot, const Status& st);
// The text of `slot`'s last error (null: the calling thread's), valid until the thread's next
// call of this function.
const char* last_error(ErrorSlot* slot);

// Runs `body`; an exception becomes an error result (the C caller never sees one).
template <typename F>
r2cclResult_t guarded(ErrorSlot* slot, const char* what, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    try {
      return fail(slot, r2cclSystemError, fmt::format("{}: out of memory", what));
    } catch (...) {
      return r2cclSystemError;
    }
  } catch (const std::exception& e) {
    try {
      return fail(slot, r2cclInternalError, fmt::format("{}: internal error: {}", what, e.what()));
    } catch (...) {
      return r2cclInternalError;
    }
  } catch (...) {
    return r2cclInternalError;
  }
}

}  // namespace r2ccl::capi

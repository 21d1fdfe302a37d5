// What every entry point of the C ABI shares: results from the runtime's error codes, the text of
// the last error (per object and per thread), and the guard that keeps exceptions out of C.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

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

// The objects behind the handles C callers hold. A handle is a cell of this table that is never
// freed or reused (a few bytes per object ever made), so a handle whose object is gone is refused
// for the life of the process instead of reaching whatever object took its address. A call holds
// the object (find) for its duration: destroying it on another thread frees it after that call.
// Never destroyed itself (handles outlive static destruction).
template <typename Handle, typename Object>
class HandleTable {
 public:
  Handle* add(std::shared_ptr<Object> object) {
    std::lock_guard lock(mutex_);
    Handle* h = &cells_.emplace_back(Handle{next_++});
    live_.emplace(h, std::move(object));
    return h;
  }
  std::shared_ptr<Object> find(const Handle* h) const {
    std::lock_guard lock(mutex_);
    const auto it = live_.find(h);
    return it != live_.end() ? it->second : nullptr;
  }
  std::shared_ptr<Object> remove(const Handle* h) {
    std::lock_guard lock(mutex_);
    auto node = live_.extract(h);
    return node.empty() ? nullptr : std::move(node.mapped());
  }
  static HandleTable& instance() {
    alignas(HandleTable) static std::byte storage[sizeof(HandleTable)];
    static HandleTable* const t = std::construct_at(reinterpret_cast<HandleTable*>(storage));
    return *t;
  }

 private:
  mutable std::mutex mutex_;
  std::deque<Handle> cells_;  // stable addresses
  std::uint64_t next_ = 1;
  std::unordered_map<const Handle*, std::shared_ptr<Object>> live_;
};

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

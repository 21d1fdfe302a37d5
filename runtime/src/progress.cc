#include "r2ccl/runtime/progress.h"

#include "r2ccl/runtime/log.h"

namespace r2ccl {

ProgressEngine::ProgressEngine()
    : work_(boost::asio::make_work_guard(io_)), thread_([this] {
        try {
          io_.run();
        } catch (const std::exception& e) {
          // A handler must never throw; if one does, say so loudly instead of terminating.
          R2CCL_ERROR("progress engine: handler threw: {}", e.what());
        }
      }) {}

ProgressEngine::~ProgressEngine() {
  stop();
}

void ProgressEngine::stop() {
  work_.reset();
  io_.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace r2ccl

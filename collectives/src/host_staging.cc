#include "r2ccl/coll/host_staging.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

namespace r2ccl::coll {

HostGraph::~HostGraph() {
  for (auto& r : release_)
    if (r) r();
}

HostStream::HostStream(std::size_t depth) : depth_(depth == 0 ? 1 : depth) {
  thread_ = std::thread([this] { loop(); });
}

HostStream::~HostStream() {
  {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void HostStream::enqueue(std::function<void()> op) {
  std::unique_lock lock(mutex_);
  if (capture_) {
    capture_->ops_.push_back(std::move(op));
    return;
  }
  cv_.wait(lock, [&] { return queue_.size() < depth_; });
  queue_.push_back(std::move(op));
  cv_.notify_all();
}

void HostStream::synchronize() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
}

void HostStream::begin_capture() {
  std::lock_guard lock(mutex_);
  capture_ = std::make_unique<HostGraph>();
}

std::unique_ptr<HostGraph> HostStream::end_capture() {
  std::lock_guard lock(mutex_);
  return std::move(capture_);
}

void HostStream::launch(const HostGraph& graph) {
  for (const auto& op : graph.ops_)
    enqueue(op);
}

void HostStream::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped
    auto op = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    cv_.notify_all();  // room in the queue
    lock.unlock();
    op();
    lock.lock();
    --running_;
    cv_.notify_all();
  }
}

namespace {
HostStream* host_stream(void* s) {
  return static_cast<HostStream*>(s);
}
}  // namespace

Status HostStagingDevice::put(void* stream, std::function<void()> op) {
  if (stream == nullptr)
    return {ErrorCode::kInvalidArgument, "the host stand-in device needs a HostStream"};
  host_stream(stream)->enqueue(std::move(op));
  return Status::ok();
}

Result<MappedMemory> HostStagingDevice::map(std::size_t bytes) {
  const std::size_t rounded = (bytes + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr)
    return Status(ErrorCode::kNoResource, fmt::format("out of memory: {} bytes of staging", bytes));
  std::memset(p, 0, rounded);
  MappedMemory m;
  m.host = static_cast<std::byte*>(p);
  m.device = reinterpret_cast<std::uintptr_t>(p);
  m.bytes = rounded;
  return m;
}

void HostStagingDevice::unmap(const MappedMemory& m) {
  std::free(m.host);
}

Status HostStagingDevice::copy(void* stream, void* dst, const void* src, std::size_t bytes) {
  return put(stream, [dst, src, bytes] { std::memmove(dst, src, bytes); });
}

Status HostStagingDevice::copy_2d(void* stream, void* dst, std::size_t dst_pitch, const void* src,
                                  std::size_t src_pitch, std::size_t width, std::size_t rows) {
  return put(stream, [=] {
    for (std::size_t r = 0; r < rows; ++r)
      std::memmove(static_cast<std::byte*>(dst) + r * dst_pitch,
                   static_cast<const std::byte*>(src) + r * src_pitch, width);
  });
}

Status HostStagingDevice::write_word(void* stream, std::uintptr_t word, std::uint32_t value) {
  return put(stream, [word, value] {
    reinterpret_cast<std::atomic<std::uint32_t>*>(word)->store(value, std::memory_order_release);
  });
}

Status HostStagingDevice::wait_word(void* stream, std::uintptr_t word, std::uint32_t value,
                                    std::uintptr_t abandon) {
  return put(stream, [word, value, abandon] {
    auto* w = reinterpret_cast<std::atomic<std::uint32_t>*>(word);
    auto* a = reinterpret_cast<std::atomic<std::uint32_t>*>(abandon);
    // Polls briefly at full speed, then every 20 microseconds, then (a long wait: the wire)
    // every 200, so that the stand-in leaves the CPU to the rails.
    for (int spin = 0;; ++spin) {
      if (w->load(std::memory_order_acquire) == value) return;
      if (a->load(std::memory_order_acquire) != 0) return;
      if (spin > 1000)
        std::this_thread::sleep_for(std::chrono::microseconds(spin < 3000 ? 20 : 200));
    }
  });
}

Result<bool> HostStagingDevice::capturing(void* stream) {
  if (stream == nullptr)
    return Status(ErrorCode::kInvalidArgument, "the host stand-in device needs a HostStream");
  return host_stream(stream)->capturing();
}

Status HostStagingDevice::on_graph_destroyed(void* stream, std::function<void()> release) {
  HostStream* s = host_stream(stream);
  std::lock_guard lock(s->mutex_);
  if (!s->capture_)
    return {ErrorCode::kInvalidArgument, "on_graph_destroyed: the stream is not capturing"};
  s->capture_->release_.push_back(std::move(release));
  return Status::ok();
}

Status HostStagingDevice::check_buffer(const void* p, const char* what, const char* name) {
  if (p == nullptr)
    return {ErrorCode::kInvalidArgument, fmt::format("{}: the {} buffer is null", what, name)};
  return Status::ok();
}

}  // namespace r2ccl::coll

// A device made of host threads, for StagedComm where there is no GPU: a HostStream runs the
// work enqueued on it in order on a thread of its own (copies are memcpy, a word wait polls the
// word), and can record its work into a HostGraph instead, replayed any number of times, with
// the graph's release callbacks run when it is destroyed. Its "device memory" is any host
// memory. It exercises everything of the staged path but the copy engine: the enqueue and
// progress hand-off, the words, the chunk pipeline, graph replays, and failover below them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "r2ccl/coll/staged.h"

namespace r2ccl::coll {

class HostGraph {
 public:
  HostGraph() = default;
  HostGraph(const HostGraph&) = delete;
  HostGraph& operator=(const HostGraph&) = delete;
  ~HostGraph();
  std::size_t size() const { return ops_.size(); }

 private:
  friend class HostStream;
  friend class HostStagingDevice;
  std::vector<std::function<void()>> ops_;
  std::vector<std::function<void()>> release_;
};

class HostStream {
 public:
  // At most `depth` operations waiting (enqueue blocks beyond that, as a device's queue does).
  explicit HostStream(std::size_t depth = 4096);
  ~HostStream();  // waits for the work enqueued
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;

  void enqueue(std::function<void()> op);
  void synchronize();
  // Work enqueued between these goes into the graph instead of running.
  void begin_capture();
  std::unique_ptr<HostGraph> end_capture();
  bool capturing() const { return capture_ != nullptr; }
  void launch(const HostGraph& graph);

 private:
  friend class HostStagingDevice;
  void loop();
  std::size_t depth_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::size_t running_ = 0;
  bool stop_ = false;
  std::unique_ptr<HostGraph> capture_;
  std::thread thread_;
};

class HostStagingDevice final : public StagingDevice {
 public:
  std::string name() const override { return "host stand-in"; }
  Result<MappedMemory> map(std::size_t bytes) override;
  void unmap(const MappedMemory& m) override;
  Status copy(void* stream, void* dst, const void* src, std::size_t bytes) override;
  Status copy_2d(void* stream, void* dst, std::size_t dst_pitch, const void* src,
                 std::size_t src_pitch, std::size_t width, std::size_t rows) override;
  Status write_word(void* stream, std::uintptr_t word, std::uint32_t value) override;
  Status wait_word(void* stream, std::uintptr_t word, std::uint32_t value,
                   std::uintptr_t abandon) override;
  Status begin(void*) override { return Status::ok(); }  // a HostStream per communicator
  Status end(void*) override { return Status::ok(); }
  Result<bool> capturing(void* stream) override;
  Status on_graph_destroyed(void* stream, std::function<void()> release) override;
  Status check_buffer(const void* p, const char* what, const char* name) override;

 private:
  Status put(void* stream, std::function<void()> op);
};

}  // namespace r2ccl::coll

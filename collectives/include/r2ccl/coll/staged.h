// Collectives and point to point on device memory across nodes: the device's data staged through
// host memory and moved over the host communicator's rails, enqueued on the caller's stream.
//
// A call returns at once. On the stream it leaves, per chunk of at most Options::chunk_bytes:
// a copy of the chunk from device memory into a staging slot, a word written into host memory
// ("chunk k is staged"), and later a wait for the word that says the chunk's result is ready,
// followed by the copy of the result back into device memory. A progress thread of the
// communicator sees the words, runs the host collective on the staged chunk over the rails
// (striped, with failover and the degraded-mode plans: all below the stream) and answers. The
// copy of chunk k + 1 overlaps the wire of chunk k, and the copy back of chunk k the wire of
// chunk k + 1; Options::window slots are in use at once, allocated once and reused.
//
// Nothing the stream runs depends on the call's host-side state: the words are fixed per chunk
// index and the call is named by a number written into a doorbell word, so a CUDA graph that
// captured calls replays them any number of times. A captured call's description lives until
// the graph is destroyed.
//
// One order per communicator, as NCCL's: every call waits for the communicator's previous one
// (StagingDevice::begin/end); a graph's replays are ordered with eager calls by their streams.
//
// Failure: a rail that fails is the host communicator's business (the stream never sees it).
// Where the host collective fails (no rail survived R2CCL_TIMEOUT, a peer's process ended,
// abort()), the stream is still released, the chunk's result is filled with all-ones bytes (NaN
// in every floating type, -1 in the integer ones) rather than left half-written, error() says
// why, and later calls are refused; a graph replayed after that gets all-ones results.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll {

// Host memory that a device reaches too: `host` and the device's address of the same bytes.
struct MappedMemory {
  std::byte* host = nullptr;
  std::uintptr_t device = 0;
  std::size_t bytes = 0;
};

// What the staged path needs from a device and its streams (void* is the device's stream).
// gpu::cuda_staging() is CUDA's; HostStagingDevice (host_staging.h) stands in for a device with
// host threads, for tests and machines without one.
class StagingDevice {
 public:
  virtual ~StagingDevice() = default;
  virtual std::string name() const = 0;
  // Zeroed host memory the device reads and writes; pinned, so copies from and to it are
  // asynchronous. Freed with unmap.
  virtual Result<MappedMemory> map(std::size_t bytes) = 0;
  virtual void unmap(const MappedMemory& m) = 0;
  // Enqueued on `stream`, run in order. Copies go either way between device memory and mapped
  // memory; copy_2d copies `rows` rows of `width` bytes, rows `src_pitch` and `dst_pitch` apart.
  virtual Status copy(void* stream, void* dst, const void* src, std::size_t bytes) = 0;
  virtual Status copy_2d(void* stream, void* dst, std::size_t dst_pitch, const void* src,
                         std::size_t src_pitch, std::size_t width, std::size_t rows) = 0;
  // `word` is a device address in mapped memory. write: the stream's earlier work is visible
  // before the word. wait: the stream goes on once the word equals `value`, or once `*abandon`
  // (a device address in mapped memory too) is non-zero.
  virtual Status write_word(void* stream, std::uintptr_t word, std::uint32_t value) = 0;
  virtual Status wait_word(void* stream, std::uintptr_t word, std::uint32_t value,
                           std::uintptr_t abandon) = 0;
  // The communicator's order: begin makes `stream` wait for the previous call (eager or of the
  // same capture), end marks this call as the last. Called under the communicator's lock.
  virtual Status begin(void* stream) = 0;
  virtual Status end(void* stream) = 0;
  // Whether `stream` is being captured into a graph. on_graph_destroyed: `release` runs (on any
  // thread, making no device call) when the graph being captured on `stream` is destroyed.
  virtual Result<bool> capturing(void* stream) = 0;
  virtual Status on_graph_destroyed(void* stream, std::function<void()> release) = 0;
  // Whether `p` is memory this device's copies can read and write (device memory for CUDA).
  virtual Status check_buffer(const void* p, const char* what, const char* name) = 0;
};

class StagedComm {
 public:
  struct Options {
    std::size_t chunk_bytes = std::size_t{16} << 20;  // the most staged per chunk and direction
    int window = 4;                                   // chunks in flight (staging slots)
  };
  // Collective over `host` (every rank calls it): a communicator of the same ranks for the
  // progress thread (split from `host`, so that host calls on `host` from the caller's thread
  // never meet the thread's), the staging slots, registered on every rail once, and the words.
  static Result<std::unique_ptr<StagedComm>> create(Communicator& host,
                                                    std::shared_ptr<StagingDevice> device,
                                                    Options options);
  static Result<std::unique_ptr<StagedComm>> create(Communicator& host,
                                                    std::shared_ptr<StagingDevice> device) {
    return create(host, std::move(device), Options{});
  }
  StagedComm(const StagedComm&) = delete;
  StagedComm& operator=(const StagedComm&) = delete;
  ~StagedComm();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Options& options() const { return options_; }
  StagingDevice& device() { return *device_; }
  // The progress thread's communicator (its fabric's rails carry the data; read its rail
  // counters and events, make no call on it).
  Communicator& communicator() { return *comm_; }

  // As Communicator's, on device buffers and enqueued on `stream`.
  Status all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                    void* stream);
  Status all_gather(const void* send, void* recv, std::size_t count, DataType type, void* stream);
  Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                        RedOp op, void* stream);
  Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                   void* stream);
  Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op, int root,
                void* stream);
  // Matched in order per pair; between group_start and group_end posted together (one call).
  Status send(const void* buf, std::size_t count, DataType type, int peer, void* stream);
  Status recv(void* buf, std::size_t count, DataType type, int peer, void* stream);
  Status group_start();
  Status group_end();

  // Why the communicator cannot be used any more, or OK. Any thread.
  Status error() const;
  // Fails the communicator: waits on the stream are abandoned, later calls refused.
  void abort(const std::string& why);
  // Collective: waits (at most R2CCL_TIMEOUT) for the calls handed to the thread, stops it and
  // frees the staging; after a failure the staging is left allocated if a stream may still copy.
  Status close();

  // Calls the progress thread ran, and of them the ones it could not (for tests and metrics).
  std::uint64_t calls_run() const { return calls_run_.load(); }

 private:
  struct Work;  // one chunk's host side
  struct Call;  // what the progress thread runs for one doorbell
  struct Copy;
  struct Chunk;
  StagedComm() = default;
  Status enqueue(const char* what, void* stream, std::vector<Chunk> chunks);
  Status submit(const char* what, void* stream, std::vector<Chunk>& chunks, std::size_t first,
                std::size_t count);
  Status usable(const char* what) const;
  void progress();
  Status run_work(const Work& w, std::size_t k);
  void fail(const Status& why);
  void post_p2p(bool is_send, const void* buf, std::size_t count, DataType type, int peer,
                void* stream, const char* what, Status& result);
  std::byte* slot_in(std::size_t k) const;
  std::byte* slot_out(std::size_t k) const;

  int rank_ = 0, size_ = 1;
  Options options_;
  std::shared_ptr<StagingDevice> device_;
  std::unique_ptr<Communicator> comm_;  // the progress thread's
  MappedMemory staging_;                // window slots of 2 x chunk_bytes (in, out)
  MappedMemory words_;                  // doorbell, abandon, ready[], done[]
  std::atomic<std::uint32_t>* word(std::size_t i) const;
  std::uintptr_t word_device(std::size_t i) const;

  // Calls by doorbell number: eager ones until the thread takes them, captured ones until their
  // graph is destroyed. Shared with the graphs' release callbacks.
  struct Registry {
    std::mutex mutex;
    std::unordered_map<std::uint32_t, std::shared_ptr<const Call>> calls;
    std::uint32_t next = 1;
  };
  std::shared_ptr<Registry> registry_ = std::make_shared<Registry>();
  std::mutex call_mutex_;  // one call enqueued at a time (the order)
  int group_depth_ = 0;
  struct P2p;
  std::vector<P2p> group_;
  void* group_stream_ = nullptr;

  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<bool> busy_{false};  // the thread is running a call
  mutable std::mutex failure_mutex_;
  Status failure_ = Status::ok();
  std::atomic<std::uint64_t> calls_run_{0};
  bool closed_ = false;
};

}  // namespace r2ccl::coll

// NodeComm: the collectives of one node's GPUs that can read each other's memory (NVLink, or PCIe
// peer access), one process per GPU, on r2ccl's kernels or, where it is faster, NCCL's. Each rank
// allocates a staging area and a block of flags in device memory once; the ranks exchange CUDA
// IPC handles over a host communicator and map each other's. From then on an all-reduce is one
// kernel per chunk on the caller's stream: it copies the rank's input into its staging area,
// meets the peers at a flag barrier (per thread block, flags that count calls, so a CUDA graph
// replays it without a host step), reduces from every rank's staging area in rank order (the same
// bits on every rank), and writes the result. Nothing is allocated and nothing waits on the host
// per call.
//
//   low-latency: every rank writes its input into every peer's memory as (data, flag) pairs and
//             reduces what arrives in its own; no barrier, no staging copy (the smallest
//             messages);
//   low-latency two-shot: the same lines, slice q of every rank's input to rank q, which reduces
//             it and sends the result to every rank; no barrier, 2(p-1)/p of the data sent
//             twice over instead of p-1 times it (mid sizes on more than two GPUs);
//   one-shot: every rank reads all of every peer's chunk (small messages: one barrier);
//   two-shot: rank r reduces the r-th part, then every rank gathers the others' parts (two
//             barriers, 2(p-1)/p of the data read per rank instead of p-1 times it);
//   push:     two-shot by writing instead of reading: each rank writes part q of its input into
//             rank q's staging area, which reduces it and writes the result into every rank's;
//             no staging copy and no remote read to wait for;
//   nccl:     NCCL's all-reduce on a communicator of the same GPUs, for the sizes where it is
//             faster (Options::nccl_min_bytes, from r2ccl-gpu-perf --bench on the machine).
//
// All-gather, reduce-scatter, broadcast and reduce are staged kernels of the same kind (one
// barrier each), NCCL's from nccl_min_bytes; send and recv are NCCL's. NCCL is opened at run
// time (libnccl.so.2, or R2CCL_NCCL_LIBRARY); without it the kernels serve every size and
// send/recv say that they need it.
//
// The staging area has two halves used in turn, so a rank never overwrites data a peer may still
// be reading. NVLink multicast is never used.
//
// One order per communicator, as NCCL's: every collective waits for the communicator's previous
// one, whatever the streams (an event chain; under CUDA graph capture the chain is kept within
// the capture, and a graph's replays are ordered with eager calls by their streams only).
//
// Failure: a kernel waits for late peers as long as it takes, as NCCL's do. It gives up only when
// the communicator is aborted (abort(), from any thread; the host's watchdog does it when the
// host communicator reports an error, such as a rank whose process ended), or when another rank
// declared it dead. Either way every rank's later calls are refused, and error() says why: a call
// in flight then may have left wrong data in its output, and error() is how to know.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll::gpu {

namespace detail {
struct NvlinkArgs;
struct NvlinkHostWords;
}  // namespace detail

inline constexpr int kMaxNvlinkRanks = 8;
inline constexpr int kMaxNvlinkBlocks = 128;

enum class NvlinkAlgo : std::uint8_t {
  kAuto,
  kLowLatency,
  kOneShot,
  kTwoShot,
  kPush,
  kNccl,
  kLowLatencyTwoShot
};
// Every algorithm kAuto chooses from, in the order tune() measures them.
inline constexpr NvlinkAlgo kNvlinkAlgos[] = {
    NvlinkAlgo::kLowLatency, NvlinkAlgo::kLowLatencyTwoShot,
    NvlinkAlgo::kOneShot,    NvlinkAlgo::kTwoShot,
    NvlinkAlgo::kPush,       NvlinkAlgo::kNccl};
std::string_view nvlink_algo_name(NvlinkAlgo a);
// The algorithms of the low-latency protocol (flags in the data), bounded by
// Options::low_latency_max.
constexpr bool low_latency(NvlinkAlgo a) {
  return a == NvlinkAlgo::kLowLatency || a == NvlinkAlgo::kLowLatencyTwoShot;
}

// OK where NCCL can be used (NvlinkAlgo::kNccl, Options::nccl_min_bytes, send/recv): this build
// knows NCCL's interface and the library loads; otherwise why not.
Status nccl_available();

class NodeComm {
 public:
  // kAuto's choice by size. With `tune` (the default), create() measures every algorithm at
  // every power of two from 8 KiB to 64 MiB on these GPUs (CUDA graphs of bf16 sums, the ranks'
  // slowest time counts) and keeps the fastest per size: table(). Without it, or where the
  // measurement failed: the low-latency kernel up to low_latency_max, then one-shot up to
  // one_shot_max, then two-shot, and NCCL from nccl_min_bytes (crossovers measured on 2 x H100
  // with r2ccl-gpu-perf --bench, which prints every algorithm's time per size).
  struct Options {
    std::size_t staging_bytes = std::size_t{32} << 20;  // per half; larger calls go in chunks
    int blocks = 128;                                   // thread blocks of the staged kernel
    // The low-latency kernel takes calls up to this size (at least 64 bytes), the low-latency
    // two-shot kernel up to nranks/2 times it (low_latency_limit); their area is twice this per
    // rank and half, on every rank.
    std::size_t low_latency_max = std::size_t{512} << 10;
    int low_latency_blocks = 128;
    // 0: 32 MiB for two ranks (one-shot reads every peer's whole input: for more ranks two-shot
    // takes over sooner), 1 MiB for more (not measured: no machine of more GPUs was lent).
    std::size_t one_shot_max = 0;
    // NCCL from this size (0: never), where NCCL is available on every rank.
    std::size_t nccl_min_bytes = std::size_t{64} << 20;
    // Open an NCCL communicator at all (for nccl_min_bytes and send/recv). It costs about
    // 770 MiB of GPU memory per GPU (2 x H200, NCCL 2.28; bench/gpu/footprint.py); without it
    // the kernels take every size and send/recv say why they cannot run. Where one rank says
    // false, no rank opens it.
    bool nccl = true;
    // Measure the table at create() (a CUDA graph per algorithm and size, replayed a few times)
    // rather than use the thresholds above. Where nccl_min_bytes is 0, NCCL is not a candidate.
    bool tune = true;
    // Let ranks share a GPU, for checking the kernels on a machine of fewer GPUs than ranks: the
    // ranks' kernels take turns on it (slow), and NCCL, which refuses such a communicator, is not
    // used. Every rank must say the same.
    bool share_gpu = false;
  };
  // Collective over `host` (every rank calls it, each with its own GPU `device`): allocates,
  // exchanges and opens the IPC handles. Errors name the rank and what failed (two ranks on one
  // GPU, GPUs that cannot map each other's memory, more than 8 ranks).
  static Result<std::unique_ptr<NodeComm>> create(Communicator& host, int device, Options options);
  static Result<std::unique_ptr<NodeComm>> create(Communicator& host, int device) {
    return create(host, device, Options{});
  }
  NodeComm(const NodeComm&) = delete;
  NodeComm& operator=(const NodeComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }

  // recv[i] = op over every rank's send[i], on `stream` (the calling thread's device must be
  // `device()`). send may equal recv. Device memory only (the error names what `send` or `recv`
  // is otherwise). Capturable in a CUDA graph; every rank must make the same calls in the same
  // order, as with any collective.
  Status all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                    cudaStream_t stream, NvlinkAlgo algo = NvlinkAlgo::kAuto);

  // recv holds size() blocks of `count` elements: block r is rank r's send. In place when
  // send == recv + rank() * count.
  Status all_gather(const void* send, void* recv, std::size_t count, DataType type,
                    cudaStream_t stream);
  // send holds size() blocks of `recv_count` elements; recv gets the reduction of block rank().
  // In place when recv == send + rank() * recv_count.
  Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                        RedOp op, cudaStream_t stream);
  // The root's send into every rank's recv (send is read on the root only).
  Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                   cudaStream_t stream);
  // The reduction of every rank's send into the root's recv (recv is not touched elsewhere).
  Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op, int root,
                cudaStream_t stream);
  // Point to point over NCCL (kUnavailable without it), matched in order per pair. Between
  // group_start and group_end they are posted together, as ncclGroupStart/End do.
  Status send(const void* buf, std::size_t count, DataType type, int peer, cudaStream_t stream);
  Status recv(void* buf, std::size_t count, DataType type, int peer, cudaStream_t stream);
  Status group_start();
  Status group_end();
  bool has_nccl() const { return nccl_ != nullptr; }
  // What kAuto does by size: entry (bytes, algo) serves calls up to `bytes` that the previous
  // entry does not; the last also serves every larger call. Empty: the Options' thresholds.
  using Table = std::vector<std::pair<std::size_t, NvlinkAlgo>>;
  const Table& table() const { return table_; }
  // The algorithm kAuto picks for a call of `bytes`.
  NvlinkAlgo choose(std::size_t bytes) const;
  // The largest call a low-latency algorithm runs in one kernel (larger calls go in pieces of
  // this size; kAuto and the table use it only up to here); 0 for the other algorithms.
  std::size_t low_latency_limit(NvlinkAlgo algo) const;

  // Why the communicator cannot be used any more (aborted here, or killed by another rank or by
  // the host side's failure), or OK. Reads host memory only: no synchronisation, any thread.
  Status error() const;
  // Waits for this communicator's last eager call, then error(). Replays of a captured CUDA
  // graph are not tracked here: synchronize their streams first.
  Status synchronize() const;

  // For tests of the low-latency flags' wrap at 2^32 calls: waits for the last call, counts
  // `calls` more low-latency calls as if each had run and written no line, and gives the count
  // reached (with 0: the count so far). Every rank must skip the same number between the same
  // calls. Refused where the calls skipped include a refresh (every 2^31 calls, which real calls
  // make), or the counts of the thread blocks differ.
  Result<std::uint32_t> skip_low_latency_calls(std::uint32_t calls);

  // Fails the communicator at once, from any thread: spinning kernels give up, every rank's
  // later calls are refused (this rank writes the dead word into every rank's memory). The
  // memory stays allocated: peers may still write into it. Teardown follows in close() or the
  // destructor.
  void abort(const std::string& why);

  // Collective, like create: waits for this communicator's calls, closes the peers' mappings,
  // meets the peers at a host barrier, then frees this rank's memory (that the peers no longer
  // map). After a failure, or where the barrier fails, the memory is left allocated rather than
  // freed under a peer that may still map it. The caller's current device is left as it was.
  Status close();
  // Where close() was not called: waits for the calls (at most 10 s), closes the mappings and
  // leaves this rank's memory allocated (freeing it without the barrier could free it under a
  // peer still writing into it).
  ~NodeComm();

 private:
  NodeComm() = default;
  void unmap_peers();  // and NCCL's communicator
  void free_mine();
  void free_host_side();  // events and stream (the host words go with the object)
  void stop_watchdog();
  // abort(), and the watchdog's failure (which marks only this rank's memory).
  void fail(const std::string& why, bool tell_peers);
  // Waits for the last call, at most `limit` (then false).
  bool wait_idle(std::chrono::milliseconds limit) const;
  // Teardown of a communicator that failed: nothing freed that a peer may map.
  void teardown_failed();
  // Every collective goes through here: refused once failed, ordered after the communicator's
  // previous call (the event chain), then `enqueue`.
  template <class F>
  Status ordered(const char* what, cudaStream_t stream, F&& enqueue);
  Status usable(const char* what) const;
  Status device_buffer(const void* p, const char* what, const char* name) const;
  // send/recv's checks: a peer other than this rank, NCCL, device memory.
  Status point_to_point(const char* what, const void* buf, std::size_t count, int peer,
                        const char* name) const;
  // Why there is no NCCL communicator (for errors).
  std::string why_no_nccl() const;
  // Whether NCCL takes a call of `bytes` (its largest buffer) chosen automatically.
  bool nccl_takes(std::size_t bytes) const {
    return nccl_ != nullptr && options_.nccl_min_bytes > 0 && bytes >= options_.nccl_min_bytes;
  }
  void base_args(detail::NvlinkArgs& a) const;  // every kernel's common arguments
  Status tune();                                // fills table_ (a collective)
  Communicator* host_ = nullptr;
  int rank_ = 0, size_ = 1, device_ = 0;
  Options options_;
  std::byte* mine_ = nullptr;                        // flags, then the two staging halves
  std::array<std::byte*, kMaxNvlinkRanks> peers_{};  // every rank's block, mapped (ours too)
  std::uint32_t* counters_ = nullptr;
  void* nccl_ = nullptr;  // ncclComm_t, where NCCL is available on every rank
  Table table_;
  std::atomic<bool> closed_{false};
  bool exported_ = false;  // a peer may have mapped mine_ (freed only after close()'s barrier)
  // Failure (abort(), the watchdog, a kernel that gave up): host words mapped into the device.
  detail::NvlinkHostWords* words_ = nullptr;         // host address
  detail::NvlinkHostWords* words_device_ = nullptr;  // the device's address of the same
  bool words_idle_ = false;                          // no kernel can read them any more
  std::atomic<bool> aborted_{false};
  mutable std::mutex failure_mutex_;
  Status failure_ = Status::ok();  // why abort() was called
  cudaStream_t side_ = nullptr;    // abort's writes of the dead words (never waits on calls)
  // The order of calls: the event the last eager call recorded; under capture, the last
  // captured call's event and its capture's id.
  std::mutex order_mutex_;
  cudaEvent_t last_ = nullptr;
  cudaEvent_t last_captured_ = nullptr;
  unsigned long long capture_id_ = 0;
  bool captured_any_ = false;
  // The watchdog: aborts when the host communicator reports an error.
  std::thread watchdog_;
  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_cv_;
  bool watchdog_stop_ = false;
};

}  // namespace r2ccl::coll::gpu

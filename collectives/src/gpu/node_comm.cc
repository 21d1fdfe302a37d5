#include "r2ccl/coll/gpu/node_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <thread>

#include "nvlink_kernels.h"
#include "r2ccl/coll/gpu/device.h"
#include "r2ccl/runtime/log.h"

#ifdef R2CCL_HAVE_NCCL
#include "nccl_api.h"
#endif

namespace r2ccl::coll::gpu {

static_assert(kMaxNvlinkRanks == detail::kNvlinkRanks && kMaxNvlinkBlocks == detail::kNvlinkBlocks);

Status nccl_available() {
#ifdef R2CCL_HAVE_NCCL
  return detail::nccl().status();
#else
  return {ErrorCode::kUnavailable, "this build of r2ccl has no NCCL (nccl.h was not found)"};
#endif
}

std::string_view nvlink_algo_name(NvlinkAlgo a) {
  switch (a) {
    case NvlinkAlgo::kAuto:
      return "auto";
    case NvlinkAlgo::kLowLatency:
      return "low-latency";
    case NvlinkAlgo::kOneShot:
      return "one-shot";
    case NvlinkAlgo::kTwoShot:
      return "two-shot";
    case NvlinkAlgo::kPush:
      return "push";
    case NvlinkAlgo::kNccl:
      return "nccl";
    case NvlinkAlgo::kLowLatencyTwoShot:
      return "low-latency-two-shot";
  }
  return "?";
}

namespace {

// What each rank tells the others when the communicator is made.
struct Card {
  cudaIpcMemHandle_t handle{};
  char uuid[16] = {};
  std::uint64_t staging_bytes = 0;
  std::uint64_t low_latency_max = 0;
  std::uint64_t nccl_min_bytes = 0;
  std::int32_t blocks = 0;
  std::int32_t low_latency_blocks = 0;
  std::int32_t ok = 0;    // 0: this rank could not allocate (the others then fail too)
  std::int32_t nccl = 0;  // NCCL loads here
  std::int32_t share_gpu = 0;
};

}  // namespace

Result<std::unique_ptr<NodeComm>> NodeComm::create(Communicator& host, int device,
                                                   Options options) {
  const int p = host.size();
  if (p > kMaxNvlinkRanks)
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("nvlink: {} ranks (at most {} GPUs of one node)", p, kMaxNvlinkRanks));
  for (int b : {options.blocks, options.low_latency_blocks})
    if (b < 1 || b > kMaxNvlinkBlocks)
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("nvlink: {} thread blocks (1 to {})", b, kMaxNvlinkBlocks));
  options.staging_bytes = std::max<std::size_t>(options.staging_bytes / 16 * 16, 4096);
  // At least 8 bytes per rank of the most ranks: a two-shot call of fewer than 8 * p bytes runs
  // the one-shot kernel, which must fit it.
  options.low_latency_max =
      std::max<std::size_t>(options.low_latency_max / 16 * 16, 8 * kMaxNvlinkRanks);
  if (options.one_shot_max == 0)
    options.one_shot_max = p <= 2 ? std::size_t{32} << 20 : std::size_t{1} << 20;
  const CurrentDevice keep;  // the caller's device, as it was, on every way out
  std::unique_ptr<NodeComm> c(new NodeComm());
  c->host_ = &host;
  c->rank_ = host.rank();
  c->size_ = p;
  c->device_ = device;
  c->options_ = options;
  Card card;
  card.staging_bytes = options.staging_bytes;
  card.blocks = options.blocks;
  card.low_latency_max = options.low_latency_max;
  card.low_latency_blocks = options.low_latency_blocks;
  card.nccl_min_bytes = options.nccl_min_bytes;
  card.share_gpu = options.share_gpu ? 1 : 0;
  // Allocate first, exchange whatever happened: a rank that failed must not leave the others
  // waiting in the all-gather.
  Status local = cuda_status(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device));
  cudaDeviceProp prop{};
  if (local) local = cuda_status(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  const std::size_t bytes = detail::kFlagsBytes + 2 * options.staging_bytes +
                            static_cast<std::size_t>(p) * 2 * (2 * options.low_latency_max);
  if (local) {
    void* mem = nullptr;
    local = cuda_status(cudaMalloc(&mem, bytes), fmt::format("cudaMalloc of {} bytes", bytes));
    c->mine_ = static_cast<std::byte*>(mem);
  }
  // Flags and the low-latency area start at zero: no call's flag is 0.
  if (local) local = cuda_status(cudaMemset(c->mine_, 0, bytes), "cudaMemset");
  if (local) {
    void* counters = nullptr;
    local = cuda_status(cudaMalloc(&counters, detail::kCounterWords * sizeof(std::uint32_t)),
                        "cudaMalloc of the counters");
    c->counters_ = static_cast<std::uint32_t*>(counters);
  }
  if (local)
    local = cuda_status(cudaMemset(c->counters_, 0, detail::kCounterWords * sizeof(std::uint32_t)),
                        "cudaMemset");
  if (local) {
    void* words = nullptr;
    local = cuda_status(cudaHostAlloc(&words, sizeof(detail::NvlinkHostWords), cudaHostAllocMapped),
                        "cudaHostAlloc of the abort and error words");
    c->words_ = static_cast<detail::NvlinkHostWords*>(words);
  }
  if (local) {
    *c->words_ = detail::NvlinkHostWords{};
    c->words_->dead = 1u + static_cast<std::uint32_t>(c->rank_);
    void* mapped = nullptr;
    local = cuda_status(cudaHostGetDevicePointer(&mapped, c->words_, 0),
                        "cudaHostGetDevicePointer of the abort and error words");
    c->words_device_ = static_cast<detail::NvlinkHostWords*>(mapped);
  }
  if (local)
    local =
        cuda_status(cudaEventCreateWithFlags(&c->last_, cudaEventDisableTiming), "cudaEventCreate");
  if (local)
    local = cuda_status(cudaEventCreateWithFlags(&c->last_captured_, cudaEventDisableTiming),
                        "cudaEventCreate");
  if (local)
    local = cuda_status(cudaStreamCreateWithFlags(&c->side_, cudaStreamNonBlocking),
                        "cudaStreamCreate");
  if (local)
    local = cuda_status(cudaIpcGetMemHandle(&card.handle, c->mine_), "cudaIpcGetMemHandle");
  if (local) local = cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (local) {
    std::memcpy(card.uuid, prop.uuid.bytes, sizeof card.uuid);
    card.ok = 1;
  }
  card.nccl = p > 1 && options.nccl && nccl_available().is_ok() ? 1 : 0;
  std::vector<Card> cards(static_cast<std::size_t>(p));
  c->exported_ = card.ok != 0 && p > 1;  // from here a peer may map this rank's memory
  R2CCL_RETURN_IF_ERROR(host.all_gather(&card, cards.data(), sizeof(Card), DataType::kU8)
                            .with_context("nvlink: exchanging the IPC handles"));
  if (!local) return local.with_context(fmt::format("nvlink: rank {}", c->rank_));
  for (int r = 0; r < p; ++r) {
    const Card& k = cards[static_cast<std::size_t>(r)];
    if (!k.ok)
      return Status(ErrorCode::kUnavailable,
                    fmt::format("nvlink: rank {} could not set up its GPU memory", r));
    if (k.staging_bytes != card.staging_bytes || k.blocks != card.blocks ||
        k.low_latency_max != card.low_latency_max ||
        k.low_latency_blocks != card.low_latency_blocks ||
        k.nccl_min_bytes != card.nccl_min_bytes || k.share_gpu != card.share_gpu)
      return Status(
          ErrorCode::kInvalidArgument,
          fmt::format("nvlink: rank {} has other options than rank {}: staging {} and "
                      "{} bytes, blocks {} and {}, low-latency up to {} and {} bytes in "
                      "{} and {} blocks, NCCL from {} and {} bytes, GPUs shared {} and {}",
                      r, c->rank_, k.staging_bytes, card.staging_bytes, k.blocks, card.blocks,
                      k.low_latency_max, card.low_latency_max, k.low_latency_blocks,
                      card.low_latency_blocks, k.nccl_min_bytes, card.nccl_min_bytes,
                      k.share_gpu != 0, card.share_gpu != 0));
    if (r != c->rank_ && !options.share_gpu &&
        std::memcmp(k.uuid, card.uuid, sizeof card.uuid) == 0)
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("nvlink: ranks {} and {} are on the same GPU", r, c->rank_));
  }
  Status opened = Status::ok();
  for (int r = 0; r < p; ++r) {
    if (r == c->rank_) {
      c->peers_[static_cast<std::size_t>(r)] = c->mine_;
      continue;
    }
    void* peer = nullptr;
    opened = cuda_status(cudaIpcOpenMemHandle(&peer, cards[static_cast<std::size_t>(r)].handle,
                                              cudaIpcMemLazyEnablePeerAccess),
                         fmt::format("nvlink: mapping rank {}'s GPU memory (cudaIpcOpenMemHandle; "
                                     "the GPUs must reach each other's memory)",
                                     r));
    if (!opened) break;
    c->peers_[static_cast<std::size_t>(r)] = static_cast<std::byte*>(peer);
  }
  // Everyone mapped everyone (or someone failed): agree before the first kernel.
  std::int32_t mine_ok = opened ? 1 : 0, all_ok = 0;
  R2CCL_RETURN_IF_ERROR(host.all_reduce(&mine_ok, &all_ok, 1, DataType::kI32, RedOp::kMin)
                            .with_context("nvlink: agreeing that every rank mapped the others"));
  if (!opened) return opened;
  if (!all_ok)
    return Status(ErrorCode::kUnavailable, "nvlink: another rank could not map the GPU memory");
#ifdef R2CCL_HAVE_NCCL
  // NCCL where every rank has it. One rank has nothing to exchange: no NCCL (whose one-rank
  // average also left the tail of unaligned buffers unwritten in 2.28.3).
  bool everyone_nccl = !options.share_gpu;
  for (const Card& k : cards)
    everyone_nccl = everyone_nccl && k.nccl != 0;
  if (everyone_nccl) {
    const detail::Nccl* n = *detail::nccl();
    ncclUniqueId id{};
    Status made = c->rank_ == 0 ? n->check(n->GetUniqueId(&id), "ncclGetUniqueId") : Status::ok();
    R2CCL_RETURN_IF_ERROR(made.with_context("nvlink: NCCL"));
    R2CCL_RETURN_IF_ERROR(host.broadcast(&id, &id, sizeof id, DataType::kU8, 0)
                              .with_context("nvlink: handing out NCCL's unique id"));
    ncclComm_t comm = nullptr;
    R2CCL_RETURN_IF_ERROR(
        n->check(n->CommInitRank(&comm, p, id, c->rank_), "nvlink: ncclCommInitRank"));
    c->nccl_ = comm;
  }
#endif
  if (options.tune && p > 1) R2CCL_RETURN_IF_ERROR(c->tune());
  if (p > 1) {
    NodeComm* self = c.get();
    c->watchdog_ = std::thread([self] {
      (void)cudaSetDevice(self->device_);
      std::unique_lock lock(self->watchdog_mutex_);
      while (!self->watchdog_stop_) {
        self->watchdog_cv_.wait_for(lock, std::chrono::milliseconds(20));
        if (self->watchdog_stop_) break;
        if (Status failed = self->host_->async_error(); !failed) {
          lock.unlock();
          // The peers' hosts see the same failure, or their kernels see this rank's: this rank
          // marks only itself (a peer whose process ended may no longer back its memory).
          self->fail(fmt::format("nvlink: the host communicator failed ({})", failed.message()),
                     /*tell_peers=*/false);
          return;
        }
      }
    });
  }
  return c;
}

void NodeComm::unmap_peers() {
  std::lock_guard lock(failure_mutex_);  // abort() writes through the mappings
#ifdef R2CCL_HAVE_NCCL
  if (nccl_) (void)(*detail::nccl())->CommDestroy(static_cast<ncclComm_t>(nccl_));
#endif
  nccl_ = nullptr;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && peers_[static_cast<std::size_t>(r)])
      (void)cudaIpcCloseMemHandle(peers_[static_cast<std::size_t>(r)]);
  peers_.fill(nullptr);
}

void NodeComm::free_mine() {
  if (mine_) (void)cudaFree(mine_);
  if (counters_) (void)cudaFree(counters_);
  mine_ = nullptr;
  counters_ = nullptr;
}

void NodeComm::free_host_side() {
  if (last_) (void)cudaEventDestroy(last_);
  if (last_captured_) (void)cudaEventDestroy(last_captured_);
  if (side_) (void)cudaStreamDestroy(side_);
  last_ = last_captured_ = nullptr;
  side_ = nullptr;
  words_idle_ = true;  // no kernel reads them any more; error() may, until the destructor
}

void NodeComm::stop_watchdog() {
  {
    std::lock_guard lock(watchdog_mutex_);
    watchdog_stop_ = true;
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

bool NodeComm::wait_idle(std::chrono::milliseconds limit) const {
  if (last_ == nullptr) return true;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const cudaError_t e = cudaEventQuery(last_);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void NodeComm::abort(const std::string& why) {
  fail(why, /*tell_peers=*/true);
}

void NodeComm::fail(const std::string& why, bool tell_peers) {
  {
    std::lock_guard lock(failure_mutex_);
    if (failure_.is_ok()) failure_ = Status(ErrorCode::kAborted, why);
  }
  if (aborted_.exchange(true) || words_ == nullptr) return;
  std::atomic_ref<std::uint32_t>(words_->abort).store(1, std::memory_order_release);
  // The dead word, into this rank's memory (calls still queued here give up at their first wait)
  // and, for an abort, every peer's (theirs give up, and their hosts refuse later calls).
  const CurrentDevice keep;
  (void)cudaSetDevice(device_);
  std::lock_guard lock(failure_mutex_);
  bool wrote = false;
  for (int r = 0; r < size_; ++r) {
    std::byte* block = peers_[static_cast<std::size_t>(r)];
    if (block == nullptr || (r != rank_ && !tell_peers)) continue;
    wrote = cudaMemcpyAsync(block + detail::kDeadOffset, &words_->dead, sizeof words_->dead,
                            cudaMemcpyHostToDevice, side_) == cudaSuccess ||
            wrote;
  }
  if (wrote) (void)cudaStreamSynchronize(side_);
  (void)cudaGetLastError();
}

void NodeComm::teardown_failed() {
  // Kernels give up within microseconds of the abort word; where they did not, nothing they use
  // is touched. This rank's memory stays allocated: a peer may still write into it.
  if (!wait_idle(std::chrono::seconds(10))) {
    R2CCL_ERROR(
        "nvlink: rank {}: calls still running 10 s after the communicator failed; its "
        "GPU memory and mappings are left as they are",
        rank_);
    return;
  }
  unmap_peers();
  free_host_side();
  if (!exported_) free_mine();
}

NodeComm::~NodeComm() {
  stop_watchdog();
  const CurrentDevice keep;
  if (!closed_) {
    (void)cudaSetDevice(device_);
    if (!error().is_ok() || !wait_idle(std::chrono::seconds(10))) {
      fail("nvlink: the communicator was destroyed with calls still running", false);
      teardown_failed();
    } else {
      unmap_peers();
      free_host_side();
      // Without close()'s barrier a peer may still map this rank's memory: it stays allocated.
      if (!exported_) free_mine();
    }
  }
  // The host words last: another thread's error() may read them until the object goes.
  if (words_ != nullptr && words_idle_) (void)cudaFreeHost(words_);
}

Status NodeComm::close() {
  if (closed_) return Status::ok();
  const CurrentDevice keep;
  R2CCL_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "nvlink close: cudaSetDevice"));
  stop_watchdog();
  {
    std::lock_guard lock(order_mutex_);
    closed_ = true;  // no call from here on
  }
  if (error().is_ok() && !wait_idle(host_->config().timeout))
    fail(
        fmt::format(
            "nvlink: rank {}'s calls did not end within {} ms of close", rank_,
            std::chrono::duration_cast<std::chrono::milliseconds>(host_->config().timeout).count()),
        /*tell_peers=*/true);
  if (Status failed = error(); !failed) {
    teardown_failed();
    return Status::ok();  // what failed was reported by error(); the teardown itself is done
  }
  unmap_peers();
  Status b = size_ > 1 ? host_->barrier() : Status::ok();  // every peer unmapped this memory
  free_host_side();
  if (b) {
    free_mine();
  } else {
    R2CCL_WARN(
        "nvlink: rank {}: the barrier before freeing failed ({}); its GPU memory stays "
        "allocated",
        rank_, b.message());
    if (!exported_) free_mine();
  }
  return b.with_context("nvlink close: the barrier before freeing");
}

Status NodeComm::error() const {
  {
    std::lock_guard lock(failure_mutex_);
    if (!failure_.is_ok()) return failure_;
  }
  if (words_ == nullptr) return Status::ok();
  const std::uint32_t e =
      std::atomic_ref<std::uint32_t>(words_->error).load(std::memory_order_acquire);
  if (e == 0) return Status::ok();
  if ((e & 0xffff0000u) == detail::kErrorPeer)
    return {ErrorCode::kAborted,
            fmt::format("nvlink: rank {} aborted the communicator or failed; rank {}'s calls "
                        "gave up and this communicator cannot be used again",
                        e & 0xffffu, rank_)};
  return {
      ErrorCode::kAborted,
      fmt::format("nvlink: rank {}'s communicator was aborted; it cannot be used again", rank_)};
}

Status NodeComm::synchronize() const {
  if (last_ != nullptr)
    R2CCL_RETURN_IF_ERROR(
        cuda_status(cudaEventSynchronize(last_), "nvlink check: waiting for the last call"));
  return error();
}

Result<std::uint32_t> NodeComm::skip_low_latency_calls(std::uint32_t calls) {
  std::lock_guard lock(order_mutex_);
  R2CCL_RETURN_IF_ERROR(synchronize());
  if (counters_ == nullptr) return 0u;
  const CurrentDevice keep;
  R2CCL_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  const auto blocks = static_cast<std::size_t>(options_.low_latency_blocks);
  std::vector<std::uint32_t> count(blocks);
  std::uint32_t* words = counters_ + detail::kLowLatencyCounters;
  R2CCL_RETURN_IF_ERROR(cuda_status(
      cudaMemcpy(count.data(), words, blocks * sizeof(std::uint32_t), cudaMemcpyDeviceToHost),
      "skip_low_latency_calls: reading the counts"));
  const std::uint32_t now = count[0];
  if (std::any_of(count.begin(), count.end(), [&](std::uint32_t c) { return c != now; }))
    return Status(ErrorCode::kInternal,
                  "skip_low_latency_calls: the thread blocks' low-latency call counts differ");
  // The next refresh after `now`: the next call numbered 0 or 1 modulo kRefreshPeriod.
  const std::uint32_t m = now % detail::kRefreshPeriod;
  const std::uint32_t to_refresh = m == 0 ? 1 : detail::kRefreshPeriod - m;
  if (calls >= to_refresh)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("skip_low_latency_calls: call {} of the {} skipped after call {} "
                              "refreshes the low-latency lines",
                              now + to_refresh, calls, now));
  std::fill(count.begin(), count.end(), now + calls);
  R2CCL_RETURN_IF_ERROR(cuda_status(
      cudaMemcpy(words, count.data(), blocks * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
      "skip_low_latency_calls: writing the counts"));
  // Landed before any later call, on whatever stream (a copy from pageable memory may return
  // first, and does not order work on non-blocking streams).
  R2CCL_RETURN_IF_ERROR(
      cuda_status(cudaDeviceSynchronize(), "skip_low_latency_calls: cudaDeviceSynchronize"));
  return now + calls;
}

template <class F>
Status NodeComm::ordered(const char* what, cudaStream_t stream, F&& enqueue) {
  std::lock_guard lock(order_mutex_);
  R2CCL_RETURN_IF_ERROR(usable(what));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  R2CCL_RETURN_IF_ERROR(cuda_status(cudaStreamGetCaptureInfo(stream, &capture, &id),
                                    fmt::format("{}: cudaStreamGetCaptureInfo", what)));
  if (capture == cudaStreamCaptureStatusInvalidated)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the stream's CUDA graph capture was invalidated", what)};
  const bool capturing = capture == cudaStreamCaptureStatusActive;
  cudaEvent_t& chain = capturing ? last_captured_ : last_;
  // Eager: after the last eager call (an event never recorded is complete). Captured: after the
  // last call of the same capture; a capture cannot wait for work outside it.
  if (!capturing || (captured_any_ && capture_id_ == id))
    R2CCL_RETURN_IF_ERROR(cuda_status(cudaStreamWaitEvent(stream, chain, 0),
                                      fmt::format("{}: cudaStreamWaitEvent", what)));
  const Status st = enqueue();
  const Status recorded =
      cuda_status(cudaEventRecord(chain, stream), fmt::format("{}: cudaEventRecord", what));
  if (capturing) {
    capture_id_ = id;
    captured_any_ = true;
  }
  return st.is_ok() ? recorded : st;
}

#ifdef R2CCL_HAVE_NCCL
#define R2CCL_NCCL_CALL(what, fn, ...)                                                   \
  do {                                                                                   \
    const detail::Nccl* n_ = *detail::nccl();                                            \
    return n_->check(n_->fn(__VA_ARGS__, static_cast<ncclComm_t>(nccl_), stream), what); \
  } while (false)
#else
#define R2CCL_NCCL_CALL(what, fn, ...) \
  return Status(ErrorCode::kInternal, fmt::format("{}: no NCCL in this build", what))
#endif

Status NodeComm::usable(const char* what) const {
  if (closed_)
    return {ErrorCode::kInvalidArgument, fmt::format("{}: the communicator is closed", what)};
  if (Status e = error(); !e) return e.with_context(what);
  return Status::ok();
}

Status NodeComm::device_buffer(const void* p, const char* what, const char* name) const {
  const PointerInfo info = pointer_info(p);
  if (info.kind != MemoryKind::kDevice && info.kind != MemoryKind::kManaged)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the {} buffer is {} memory, not device memory", what, name,
                        memory_kind_name(info.kind))};
  return Status::ok();
}

void NodeComm::base_args(detail::NvlinkArgs& a) const {
  for (int r = 0; r < size_; ++r)
    a.block[r] = peers_[static_cast<std::size_t>(r)];
  a.counters = counters_;
  a.host = words_device_;
  a.rank = rank_;
  a.nranks = size_;
  a.staging_bytes = options_.staging_bytes;
  a.ll_offset = detail::kFlagsBytes + 2 * options_.staging_bytes;
  a.ll_bytes = 2 * options_.low_latency_max;
}

std::size_t NodeComm::low_latency_limit(NvlinkAlgo algo) const {
  if (!low_latency(algo)) return 0;
  return detail::low_latency_bytes(2 * options_.low_latency_max, size_,
                                   algo == NvlinkAlgo::kLowLatencyTwoShot);
}

NvlinkAlgo NodeComm::choose(std::size_t bytes) const {
  if (!table_.empty()) {
    for (const auto& [upto, algo] : table_)
      if (bytes <= upto) return algo;
    return table_.back().second;
  }
  if (nccl_takes(bytes)) return NvlinkAlgo::kNccl;
  if (bytes <= options_.low_latency_max) return NvlinkAlgo::kLowLatency;
  return bytes <= options_.one_shot_max ? NvlinkAlgo::kOneShot : NvlinkAlgo::kTwoShot;
}

namespace {

// Seconds per call of `call` on `s`: `calls` of it captured in a CUDA graph, replayed after one
// warm-up replay; infinity where anything failed.
template <class Call>
double graph_seconds(cudaStream_t s, int calls, int replays, Call&& call) {
  constexpr double kFailed = std::numeric_limits<double>::infinity();
  cudaGraph_t g = nullptr;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return kFailed;
  bool ok = true;
  for (int i = 0; i < calls && ok; ++i)
    ok = call().is_ok();
  ok = cudaStreamEndCapture(s, &g) == cudaSuccess && ok;
  cudaGraphExec_t exec = nullptr;
  ok = ok && cudaGraphInstantiate(&exec, g, 0) == cudaSuccess;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  ok = ok && cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess;
  ok = ok && cudaGraphLaunch(exec, s) == cudaSuccess && cudaEventRecord(e0, s) == cudaSuccess;
  for (int i = 0; i < replays && ok; ++i)
    ok = cudaGraphLaunch(exec, s) == cudaSuccess;
  float ms = 0;
  ok = ok && cudaEventRecord(e1, s) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
       cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
  if (e0) (void)cudaEventDestroy(e0);
  if (e1) (void)cudaEventDestroy(e1);
  if (exec) (void)cudaGraphExecDestroy(exec);
  if (g) (void)cudaGraphDestroy(g);
  return ok ? static_cast<double>(ms) * 1e-3 / (static_cast<double>(calls) * replays) : kFailed;
}

}  // namespace

Status NodeComm::tune() {
  constexpr std::size_t kSmallest = std::size_t{8} << 10, kLargest = std::size_t{64} << 20;
  const auto& algos = kNvlinkAlgos;
  constexpr std::size_t kAlgos = std::size(kNvlinkAlgos);
  std::vector<std::size_t> sizes;
  for (std::size_t b = kSmallest; b <= kLargest; b *= 2)
    sizes.push_back(b);
  // Every rank measures the same cases in the same order (they are collectives); a case that
  // does not apply, or failed, is infinite.
  std::vector<double> seconds(sizes.size() * kAlgos, std::numeric_limits<double>::infinity());
  void* buf = nullptr;
  cudaStream_t s = nullptr;
  bool ready = cudaMalloc(&buf, 2 * kLargest) == cudaSuccess &&
               cudaMemset(buf, 0, 2 * kLargest) == cudaSuccess &&
               cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
  // Every rank must take part in every case, so a rank that could not get ready says so first.
  std::int32_t mine = ready ? 1 : 0, all = 0;
  R2CCL_RETURN_IF_ERROR(host_->all_reduce(&mine, &all, 1, DataType::kI32, RedOp::kMin));
  if (all == 1) {
    auto* in = static_cast<std::byte*>(buf);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t count = sizes[i] / 2;
      // Large calls take long: fewer replays.
      const int replays = sizes[i] >= (std::size_t{8} << 20) ? 2 : 5;
      for (std::size_t k = 0; k < kAlgos; ++k) {
        const NvlinkAlgo algo = algos[k];
        if (low_latency(algo) && sizes[i] > low_latency_limit(algo)) continue;
        if (algo == NvlinkAlgo::kLowLatencyTwoShot && size_ <= 2) continue;  // one-shot's traffic
        if (algo == NvlinkAlgo::kNccl && (nccl_ == nullptr || options_.nccl_min_bytes == 0))
          continue;
        seconds[i * kAlgos + k] = graph_seconds(s, 10, replays, [&] {
          return all_reduce(in, in + kLargest, count, DataType::kBF16, RedOp::kSum, s, algo);
        });
      }
    }
  }
  // A kernel that gave up on a peer spoils every time; the ranks still agree before failing.
  const Status measured = all == 1 ? synchronize() : Status::ok();
  if (!measured) std::fill(seconds.begin(), seconds.end(), std::numeric_limits<double>::infinity());
  if (s) (void)cudaStreamDestroy(s);
  if (buf) (void)cudaFree(buf);
  // The slowest rank's time is the call's time.
  std::vector<double> agreed(seconds.size());
  R2CCL_RETURN_IF_ERROR(
      host_->all_reduce(seconds.data(), agreed.data(), agreed.size(), DataType::kF64, RedOp::kMax)
          .with_context("nvlink: agreeing on the measured times"));
  if (!measured) return measured.with_context("nvlink: measuring the algorithms");
  Table table;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::size_t best = kAlgos;
    for (std::size_t k = 0; k < kAlgos; ++k)
      if (std::isfinite(agreed[i * kAlgos + k]) &&
          (best == kAlgos || agreed[i * kAlgos + k] < agreed[i * kAlgos + best]))
        best = k;
    if (best == kAlgos) return Status::ok();  // nothing measured: the thresholds stay
    if (!table.empty() && table.back().second == algos[best])
      table.back().first = sizes[i];
    else
      table.emplace_back(sizes[i], algos[best]);
  }
  table_ = std::move(table);
  return Status::ok();
}

Status NodeComm::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                            RedOp op, cudaStream_t stream, NvlinkAlgo algo) {
  const char* what = "nvlink all-reduce";
  R2CCL_RETURN_IF_ERROR(usable(what));
  if (Status st = check_type_and_op(type, op); !st) return st.with_context(what);
  if (count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_buffer(recv, what, "receive"));
  const std::size_t elem = type_size(type);
  if (algo == NvlinkAlgo::kAuto) algo = choose(count * elem);
  return ordered(what, stream, [&]() -> Status {
    if (algo == NvlinkAlgo::kNccl) {
      if (nccl_)
        R2CCL_NCCL_CALL("nvlink all-reduce: ncclAllReduce", AllReduce, send, recv, count,
                        detail::nccl_type(type), detail::nccl_op(op));
      return {ErrorCode::kInvalidArgument, fmt::format("nvlink all-reduce: {}", why_no_nccl())};
    }
    const bool ll = low_latency(algo);
    // push: a half holds a slot per rank of the longest slice, then the whole call.
    const std::size_t per_call =
        ll ? low_latency_limit(algo) / elem
        : algo == NvlinkAlgo::kPush
            ? (options_.staging_bytes / 16 - static_cast<std::size_t>(size_)) / 2 * (16 / elem)
            : options_.staging_bytes / elem;
    detail::NvlinkArgs a;
    base_args(a);
    a.divide_by = op == RedOp::kAvg ? size_ : 0;
    a.push = algo == NvlinkAlgo::kPush;
    for (std::size_t done = 0; done < count; done += per_call) {
      const std::size_t n = std::min(per_call, count - done);
      a.send = static_cast<const std::byte*>(send) + done * elem;
      a.recv = static_cast<std::byte*>(recv) + done * elem;
      a.count = n;
      // The low-latency two-shot kernel needs a line of every rank's slice (nvlink_kernels.h).
      a.two_shot =
          algo == NvlinkAlgo::kTwoShot || (algo == NvlinkAlgo::kLowLatencyTwoShot &&
                                           n * elem >= 8 * static_cast<std::size_t>(size_));
      // Always each kernel's full grid: every thread block counts every call (nvlink_kernels.h).
      R2CCL_RETURN_IF_ERROR(cuda_status(
          ll ? detail::launch_low_latency(a, type, op, options_.low_latency_blocks, stream)
             : detail::launch_nvlink(a, type, op, options_.blocks, stream),
          fmt::format("nvlink all-reduce of {} {} ({})", n, type_name(type), redop_name(op))));
    }
    return Status::ok();
  });
}

Status NodeComm::reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                        int root, cudaStream_t stream) {
  const char* what = "nvlink reduce";
  R2CCL_RETURN_IF_ERROR(usable(what));
  if (Status st = check_type_and_op(type, op); !st) return st.with_context(what);
  if (root < 0 || root >= size_)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: root {} is not a rank (0..{})", what, root, size_ - 1)};
  if (count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_buffer(send, what, "send"));
  if (rank_ == root) R2CCL_RETURN_IF_ERROR(device_buffer(recv, what, "receive"));
  const std::size_t elem = type_size(type);
  return ordered(what, stream, [&]() -> Status {
    if (nccl_takes(count * elem))
      R2CCL_NCCL_CALL("nvlink reduce: ncclReduce", Reduce, send, recv, count,
                      detail::nccl_type(type), detail::nccl_op(op), root);
    detail::NvlinkArgs a;
    base_args(a);
    a.divide_by = op == RedOp::kAvg ? size_ : 0;
    a.root = root;
    const std::size_t per_call = options_.staging_bytes / elem;
    for (std::size_t done = 0; done < count; done += per_call) {
      a.send = static_cast<const std::byte*>(send) + done * elem;
      a.recv = rank_ == root ? static_cast<std::byte*>(recv) + done * elem : nullptr;
      a.count = std::min(per_call, count - done);
      R2CCL_RETURN_IF_ERROR(
          cuda_status(detail::launch_nvlink(a, type, op, options_.blocks, stream),
                      fmt::format("{} of {} {}", what, a.count, type_name(type))));
    }
    return Status::ok();
  });
}

Status NodeComm::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                                RedOp op, cudaStream_t stream) {
  const char* what = "nvlink reduce-scatter";
  R2CCL_RETURN_IF_ERROR(usable(what));
  if (Status st = check_type_and_op(type, op); !st) return st.with_context(what);
  if (recv_count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_buffer(recv, what, "receive"));
  const std::size_t elem = type_size(type);
  return ordered(what, stream, [&]() -> Status {
    if (nccl_takes(recv_count * elem * static_cast<std::size_t>(size_)))
      R2CCL_NCCL_CALL("nvlink reduce-scatter: ncclReduceScatter", ReduceScatter, send, recv,
                      recv_count, detail::nccl_type(type), detail::nccl_op(op));
    detail::NvlinkArgs a;
    base_args(a);
    a.divide_by = op == RedOp::kAvg ? size_ : 0;
    a.stride = recv_count;
    // Each rank's block of a call, in whole 16-byte units, must fit its share of a staging half.
    const std::size_t per_call =
        options_.staging_bytes / static_cast<std::size_t>(size_) / 16 * (16 / elem);
    for (std::size_t done = 0; done < recv_count; done += per_call) {
      a.send = static_cast<const std::byte*>(send) + done * elem;
      a.recv = static_cast<std::byte*>(recv) + done * elem;
      a.count = std::min(per_call, recv_count - done);
      R2CCL_RETURN_IF_ERROR(
          cuda_status(detail::launch_reduce_scatter(a, type, op, options_.blocks, stream),
                      fmt::format("{} of {} {}", what, a.count, type_name(type))));
    }
    return Status::ok();
  });
}

Status NodeComm::all_gather(const void* send, void* recv, std::size_t count, DataType type,
                            cudaStream_t stream) {
  const char* what = "nvlink all-gather";
  R2CCL_RETURN_IF_ERROR(usable(what));
  if (count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_buffer(recv, what, "receive"));
  const std::size_t bytes = count * type_size(type);
  return ordered(what, stream, [&]() -> Status {
    if (nccl_takes(bytes * static_cast<std::size_t>(size_)))
      R2CCL_NCCL_CALL("nvlink all-gather: ncclAllGather", AllGather, send, recv, count,
                      detail::nccl_type(type));
    detail::NvlinkArgs a;
    base_args(a);
    a.stride = bytes;
    for (std::size_t done = 0; done < bytes; done += options_.staging_bytes) {
      a.send = static_cast<const std::byte*>(send) + done;
      a.recv = static_cast<std::byte*>(recv) + done;
      a.count = std::min(options_.staging_bytes, bytes - done);
      R2CCL_RETURN_IF_ERROR(cuda_status(detail::launch_gather(a, options_.blocks, stream),
                                        fmt::format("{} of {} bytes", what, a.count)));
    }
    return Status::ok();
  });
}

Status NodeComm::broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                           cudaStream_t stream) {
  const char* what = "nvlink broadcast";
  R2CCL_RETURN_IF_ERROR(usable(what));
  if (root < 0 || root >= size_)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: root {} is not a rank (0..{})", what, root, size_ - 1)};
  if (count == 0) return Status::ok();
  if (rank_ == root) R2CCL_RETURN_IF_ERROR(device_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_buffer(recv, what, "receive"));
  const std::size_t bytes = count * type_size(type);
  return ordered(what, stream, [&]() -> Status {
    if (nccl_takes(bytes))
      R2CCL_NCCL_CALL("nvlink broadcast: ncclBroadcast", Broadcast, send, recv, count,
                      detail::nccl_type(type), root);
    detail::NvlinkArgs a;
    base_args(a);
    a.root = root;
    for (std::size_t done = 0; done < bytes; done += options_.staging_bytes) {
      a.send = rank_ == root ? static_cast<const std::byte*>(send) + done : nullptr;
      a.recv = static_cast<std::byte*>(recv) + done;
      a.count = std::min(options_.staging_bytes, bytes - done);
      R2CCL_RETURN_IF_ERROR(cuda_status(detail::launch_gather(a, options_.blocks, stream),
                                        fmt::format("{} of {} bytes", what, a.count)));
    }
    return Status::ok();
  });
}

std::string NodeComm::why_no_nccl() const {
  if (size_ == 1) return "NCCL is not used for one rank";
  if (options_.share_gpu) return "NCCL is not used where ranks share a GPU";
  if (!options_.nccl) return "NCCL is off on this rank (R2CCL_GPU_NCCL=0)";
  if (Status st = nccl_available(); !st) return st.message();
  return "another rank has no NCCL (R2CCL_GPU_NCCL=0 there, or NCCL does not load)";
}

Status NodeComm::point_to_point(const char* what, const void* buf, std::size_t count, int peer,
                                const char* name) const {
  R2CCL_RETURN_IF_ERROR(usable(what));
  if (peer < 0 || peer >= size_ || peer == rank_)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: peer {} is not another rank (0..{}, not {})", what, peer, size_ - 1,
                        rank_)};
  if (nccl_ == nullptr)
    return {ErrorCode::kUnavailable,
            fmt::format("{}: device memory goes point to point over NCCL, and {}", what,
                        why_no_nccl())};
  if (count > 0) R2CCL_RETURN_IF_ERROR(device_buffer(buf, what, name));
  return Status::ok();
}

Status NodeComm::send(const void* buf, std::size_t count, DataType type, int peer,
                      cudaStream_t stream) {
  R2CCL_RETURN_IF_ERROR(point_to_point("nvlink send", buf, count, peer, "send"));
  R2CCL_NCCL_CALL("nvlink send: ncclSend", Send, buf, count, detail::nccl_type(type), peer);
}

Status NodeComm::recv(void* buf, std::size_t count, DataType type, int peer, cudaStream_t stream) {
  R2CCL_RETURN_IF_ERROR(point_to_point("nvlink recv", buf, count, peer, "receive"));
  R2CCL_NCCL_CALL("nvlink recv: ncclRecv", Recv, buf, count, detail::nccl_type(type), peer);
}

Status NodeComm::group_start() {
#ifdef R2CCL_HAVE_NCCL
  if (nccl_) return (*detail::nccl())->check((*detail::nccl())->GroupStart(), "ncclGroupStart");
#endif
  return Status::ok();
}

Status NodeComm::group_end() {
#ifdef R2CCL_HAVE_NCCL
  if (nccl_) return (*detail::nccl())->check((*detail::nccl())->GroupEnd(), "ncclGroupEnd");
#endif
  return Status::ok();
}

}  // namespace r2ccl::coll::gpu

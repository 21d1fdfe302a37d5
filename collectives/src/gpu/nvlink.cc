#include "r2ccl/coll/gpu/nvlink.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "nvlink_kernels.h"
#include "r2ccl/coll/gpu/device.h"

#ifdef R2CCL_HAVE_NCCL
#include <nccl.h>
#endif

namespace r2ccl::coll::gpu {

static_assert(kMaxNvlinkRanks == detail::kNvlinkRanks && kMaxNvlinkBlocks == detail::kNvlinkBlocks);

bool nccl_built() {
#ifdef R2CCL_HAVE_NCCL
  return true;
#else
  return false;
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
    case NvlinkAlgo::kNccl:
      return "nccl";
  }
  return "?";
}

namespace {

#ifdef R2CCL_HAVE_NCCL
Status nccl_status(ncclResult_t r, std::string_view what) {
  if (r == ncclSuccess) return Status::ok();
  return {ErrorCode::kInternal, fmt::format("{}: {}", what, ncclGetErrorString(r))};
}

ncclDataType_t nccl_type(DataType t) {
  switch (t) {
    case DataType::kF32:
      return ncclFloat32;
    case DataType::kF16:
      return ncclFloat16;
    case DataType::kBF16:
      return ncclBfloat16;
    case DataType::kF64:
      return ncclFloat64;
    case DataType::kI32:
      return ncclInt32;
    case DataType::kI64:
      return ncclInt64;
    case DataType::kU8:
      return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kProd:
      return ncclProd;
    case RedOp::kMin:
      return ncclMin;
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}
#endif

// What each rank tells the others when the communicator is made.
struct Card {
  cudaIpcMemHandle_t handle{};
  char uuid[16] = {};
  std::uint64_t staging_bytes = 0;
  std::uint64_t low_latency_max = 0;
  std::uint64_t nccl_min_bytes = 0;
  std::int32_t blocks = 0;
  std::int32_t low_latency_blocks = 0;
  std::int32_t ok = 0;  // 0: this rank could not allocate (the others then fail too)
};

}  // namespace

Result<std::unique_ptr<NvlinkComm>> NvlinkComm::create(Communicator& host, int device,
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
  options.low_latency_max = std::max<std::size_t>(options.low_latency_max / 16 * 16, 16);
  if (options.one_shot_max == 0)
    options.one_shot_max = p <= 2 ? std::size_t{32} << 20 : std::size_t{1} << 20;
  if (options.nccl_min_bytes > 0 && !nccl_built())
    return Status(ErrorCode::kUnavailable,
                  "nvlink: nccl_min_bytes is set, but this build of r2ccl has no NCCL");
  std::unique_ptr<NvlinkComm> c(new NvlinkComm());
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
  if (local)
    local = cuda_status(cudaIpcGetMemHandle(&card.handle, c->mine_), "cudaIpcGetMemHandle");
  if (local) local = cuda_status(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (local) {
    std::memcpy(card.uuid, prop.uuid.bytes, sizeof card.uuid);
    card.ok = 1;
  }
  std::vector<Card> cards(static_cast<std::size_t>(p));
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
        k.low_latency_blocks != card.low_latency_blocks || k.nccl_min_bytes != card.nccl_min_bytes)
      return Status(
          ErrorCode::kInvalidArgument,
          fmt::format("nvlink: rank {} has other options than rank {}: staging {} and "
                      "{} bytes, blocks {} and {}, low-latency up to {} and {} bytes in "
                      "{} and {} blocks, NCCL from {} and {} bytes",
                      r, c->rank_, k.staging_bytes, card.staging_bytes, k.blocks, card.blocks,
                      k.low_latency_max, card.low_latency_max, k.low_latency_blocks,
                      card.low_latency_blocks, k.nccl_min_bytes, card.nccl_min_bytes));
    if (r != c->rank_ && std::memcmp(k.uuid, card.uuid, sizeof card.uuid) == 0)
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
  // One rank has nothing to exchange: no NCCL (whose one-rank average also left the tail of
  // unaligned buffers unwritten in 2.28.3).
  if (options.nccl_min_bytes > 0 && p > 1) {
    ncclUniqueId id{};
    Status made =
        c->rank_ == 0 ? nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId") : Status::ok();
    R2CCL_RETURN_IF_ERROR(made.with_context("nvlink: NCCL for large calls"));
    R2CCL_RETURN_IF_ERROR(host.broadcast(&id, &id, sizeof id, DataType::kU8, 0)
                              .with_context("nvlink: handing out NCCL's unique id"));
    ncclComm_t comm = nullptr;
    R2CCL_RETURN_IF_ERROR(
        nccl_status(ncclCommInitRank(&comm, p, id, c->rank_), "nvlink: ncclCommInitRank"));
    c->nccl_ = comm;
  }
#endif
  return c;
}

void NvlinkComm::unmap_peers() {
#ifdef R2CCL_HAVE_NCCL
  if (nccl_) (void)ncclCommDestroy(static_cast<ncclComm_t>(nccl_));
#endif
  nccl_ = nullptr;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && peers_[static_cast<std::size_t>(r)])
      (void)cudaIpcCloseMemHandle(peers_[static_cast<std::size_t>(r)]);
  peers_.fill(nullptr);
}

void NvlinkComm::free_mine() {
  if (mine_) (void)cudaFree(mine_);
  if (counters_) (void)cudaFree(counters_);
  mine_ = nullptr;
  counters_ = nullptr;
}

NvlinkComm::~NvlinkComm() {
  unmap_peers();
  free_mine();
}

Status NvlinkComm::close() {
  if (closed_) return Status::ok();
  Status st = cuda_status(cudaDeviceSynchronize(), "nvlink close: cudaDeviceSynchronize");
  unmap_peers();
  Status b = host_->barrier();  // every peer has unmapped this rank's memory
  free_mine();
  closed_ = true;
  if (!st) return st;
  return b.with_context("nvlink close: the barrier before freeing");
}

Status NvlinkComm::check() const {
  std::uint32_t error = 0;
  R2CCL_RETURN_IF_ERROR(cuda_status(
      cudaMemcpy(&error, counters_ + detail::kErrorWord, sizeof error, cudaMemcpyDeviceToHost),
      "nvlink check: reading the error word"));
  if (error == 0) return Status::ok();
  return {
      ErrorCode::kTimeout,
      fmt::format(
          "nvlink: rank {} did not reach an all-reduce barrier within {} ms; this "
          "communicator cannot be used again",
          error - 1,
          std::chrono::duration_cast<std::chrono::milliseconds>(host_->config().timeout).count())};
}

Status NvlinkComm::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                              RedOp op, cudaStream_t stream, NvlinkAlgo algo) {
  if (closed_)
    return {ErrorCode::kInvalidArgument, "nvlink all-reduce: the communicator is closed"};
  if (Status st = check_type_and_op(type, op); !st) return st.with_context("nvlink all-reduce");
  if (count == 0) return Status::ok();
  for (const auto& [ptr, name] :
       {std::pair{send, "send"}, std::pair<const void*, const char*>{recv, "receive"}}) {
    const PointerInfo info = pointer_info(ptr);
    if (info.kind != MemoryKind::kDevice && info.kind != MemoryKind::kManaged)
      return {ErrorCode::kInvalidArgument,
              fmt::format("nvlink all-reduce: the {} buffer is {} memory, not device memory", name,
                          memory_kind_name(info.kind))};
  }
  const std::size_t elem = type_size(type);
  if (algo == NvlinkAlgo::kNccl ||
      (algo == NvlinkAlgo::kAuto && nccl_ && count * elem >= options_.nccl_min_bytes)) {
#ifdef R2CCL_HAVE_NCCL
    if (nccl_)
      return nccl_status(ncclAllReduce(send, recv, count, nccl_type(type), nccl_op(op),
                                       static_cast<ncclComm_t>(nccl_), stream),
                         "nvlink all-reduce: ncclAllReduce");
#endif
    if (algo == NvlinkAlgo::kNccl)
      return {ErrorCode::kInvalidArgument,
              size_ == 1 ? std::string("nvlink all-reduce: NCCL is not used for one rank")
                         : std::string("nvlink all-reduce: NCCL was not set up "
                                       "(NvlinkComm::Options::nccl_min_bytes)")};
  }
  const bool low_latency = algo == NvlinkAlgo::kLowLatency ||
                           (algo == NvlinkAlgo::kAuto && count * elem <= options_.low_latency_max);
  const std::size_t per_call =
      (low_latency ? options_.low_latency_max : options_.staging_bytes) / elem;
  detail::NvlinkArgs a;
  for (int r = 0; r < size_; ++r)
    a.block[r] = peers_[static_cast<std::size_t>(r)];
  a.counters = counters_;
  a.rank = rank_;
  a.nranks = size_;
  a.divide_by = op == RedOp::kAvg ? size_ : 0;
  a.staging_bytes = options_.staging_bytes;
  a.ll_offset = detail::kFlagsBytes + 2 * options_.staging_bytes;
  a.ll_bytes = 2 * options_.low_latency_max;
  a.timeout_ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(host_->config().timeout).count());
  for (std::size_t done = 0; done < count; done += per_call) {
    const std::size_t n = std::min(per_call, count - done);
    a.send = static_cast<const std::byte*>(send) + done * elem;
    a.recv = static_cast<std::byte*>(recv) + done * elem;
    a.count = n;
    a.two_shot = algo == NvlinkAlgo::kTwoShot ||
                 (algo == NvlinkAlgo::kAuto && count * elem > options_.one_shot_max);
    // Always each kernel's full grid: every thread block counts every call (nvlink_kernels.h).
    R2CCL_RETURN_IF_ERROR(cuda_status(
        low_latency ? detail::launch_low_latency(a, type, op, options_.low_latency_blocks, stream)
                    : detail::launch_nvlink(a, type, op, options_.blocks, stream),
        fmt::format("nvlink all-reduce of {} {} ({})", n, type_name(type), redop_name(op))));
  }
  return Status::ok();
}

}  // namespace r2ccl::coll::gpu

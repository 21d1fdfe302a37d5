// The NVLink all-reduce kernel's launcher (nvlink.cu), behind NodeComm (node_comm.cc). Private to
// r2ccl_coll_gpu; C++17, as the kernels are compiled (collectives/CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "r2ccl/coll/types.h"

namespace r2ccl::coll::gpu::detail {

inline constexpr int kNvlinkRanks = 8;     // gpu::kMaxNvlinkRanks
inline constexpr int kNvlinkBlocks = 128;  // gpu::kMaxNvlinkBlocks

// Each rank's block of device memory: the flags, the two staging halves, then the low-latency
// area: for each sending rank, two halves of ll_bytes, in 16-byte lines of two (4 data bytes,
// 4 flag bytes) pairs.
//   start[b][r], mid[b][r]: the call count that rank r's thread block b has reached
//   dead: 0 while the communicator is sound; 1 + the rank that failed or aborted it otherwise
//         (written by that rank's host into every rank's block; never cleared)
struct NvlinkFlags {
  std::uint32_t start[kNvlinkBlocks][kNvlinkRanks];
  std::uint32_t mid[kNvlinkBlocks][kNvlinkRanks];
  std::uint32_t dead;
};
inline constexpr std::size_t kFlagsBytes = 8192 + 128;
static_assert(sizeof(NvlinkFlags) <= kFlagsBytes && kFlagsBytes % 16 == 0);
inline constexpr std::size_t kDeadOffset = offsetof(NvlinkFlags, dead);
// The rank's own counters (not shared): calls so far per thread block of the staged kernel, then
// of the low-latency kernel. Each kernel always runs on its full grid, so every block of it counts
// every call and they agree on the call's number, which serves as the barriers' and the
// low-latency lines' flag; its parity picks the half of the area a call uses. A kernel that
// fails does not count the call: the communicator is dead from then on (the dead word and the
// host's refusal of later calls see to it that nothing runs on the disagreeing counts).
inline constexpr std::size_t kLowLatencyCounters = kNvlinkBlocks;
inline constexpr std::size_t kCounterWords = 2 * kNvlinkBlocks;
// The low-latency flags are call numbers modulo 2^32, so a line left alone for 2^32 calls (one
// beyond every call's size since, or never written and still 0) would match again. The call
// numbered k * 2^31 (half 0) and the one after it (half 1) therefore rewrite every line of their
// half in every peer that the call itself does not read: from then until the next such call, a
// line's flag is one of the numbers of the calls since, never the current one before it lands.
inline constexpr std::uint32_t kRefreshPeriod = 1u << 31;
__host__ __device__ constexpr bool low_latency_refresh(std::uint32_t flag) {
  return flag % kRefreshPeriod <= 1;
}

// Host memory mapped into the device (cudaHostAllocMapped): what the host and the kernels tell
// each other without a copy or a synchronisation.
//   abort: set by the host (NodeComm::abort); every spin loop polls it and gives up
//   error:  0, or what made a kernel give up (kErrorAborted, or kErrorPeer | the dead word's rank)
//   dead:   the value the host writes into the blocks' dead words (1 + this rank)
struct NvlinkHostWords {
  std::uint32_t abort;
  std::uint32_t error;
  std::uint32_t dead;
  std::uint32_t pad;
};
inline constexpr std::uint32_t kErrorAborted = 1u << 16;
inline constexpr std::uint32_t kErrorPeer = 2u << 16;  // | the rank that killed the communicator

struct NvlinkArgs {
  std::byte* block[kNvlinkRanks] = {};  // every rank's block, mapped here
  std::uint32_t* counters = nullptr;    // kCounterWords words
  NvlinkHostWords* host = nullptr;      // the host's words, as the device sees them
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;          // elements in this call (at most staging_bytes of them)
  std::size_t staging_bytes = 0;  // per half, a multiple of 16
  std::size_t ll_offset = 0;      // where the low-latency area starts in a rank's block
  std::size_t ll_bytes = 0;       // per sending rank and half: twice the data it carries
  int rank = 0;
  int nranks = 1;
  int divide_by = 0;       // avg: divide by the number of ranks
  bool two_shot = false;   // the staged two-shot kernel, or the low-latency two-shot one
  bool push = false;       // two-shot by pushing (nvlink.cu: nvlink_push_two_shot)
  int root = -1;           // reduce: the one rank that writes the result; broadcast: the source
  std::size_t stride = 0;  // elements between the ranks' blocks: of send (reduce-scatter), of
                           // recv (all-gather)
};

cudaError_t launch_nvlink(const NvlinkArgs& args, DataType t, RedOp op, int blocks,
                          cudaStream_t stream);
// The low-latency kernels, no barrier: every rank writes its input into every peer's low-latency
// area as (data, flag) pairs and reduces what arrives in its own (one-shot); or, with two_shot,
// writes slice q of it to rank q, which reduces its slice and writes the result to every rank the
// same way (count * element size must be at least 8 * nranks). count * element size must be at
// most low_latency_bytes: the largest call of the kernel (two_shot or not) for an area of ll_bytes
// per sender and half.
constexpr std::size_t low_latency_bytes(std::size_t ll_bytes, int nranks, bool two_shot) {
  return two_shot ? static_cast<std::size_t>(nranks) * (ll_bytes / 32) * 8 : ll_bytes / 2;
}
cudaError_t launch_low_latency(const NvlinkArgs& args, DataType t, RedOp op, int blocks,
                               cudaStream_t stream);

// The other staged kernels; they count calls with the all-reduce's counters and use its staging
// halves, so every staged kernel must run on the same grid (`blocks`).
//   reduce-scatter: `count` elements of each rank's block (stride apart in send), reduced block
//                   `rank` into recv; count units per block must fit staging_bytes / nranks.
cudaError_t launch_reduce_scatter(const NvlinkArgs& args, DataType t, RedOp op, int blocks,
                                  cudaStream_t stream);
//   all-gather (root < 0): `count` bytes of every rank, into recv + rank * stride;
//   broadcast (root >= 0): `count` bytes of the root's send, into every rank's recv.
cudaError_t launch_gather(const NvlinkArgs& args, int blocks, cudaStream_t stream);

}  // namespace r2ccl::coll::gpu::detail

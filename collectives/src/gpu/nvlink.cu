// The NVLink all-reduce kernel (node_comm.h says what it does). Every phase walks the same units
// (16-byte groups of elements) with the same (block, thread) mapping, so a thread block's barrier
// with its peers' same-numbered blocks is enough: block b only ever reads what the peers' block b
// wrote.
#include <cstdint>

#include "elementwise.cuh"
#include "nvlink_kernels.h"

namespace r2ccl::coll::gpu::detail {
namespace {

__device__ __forceinline__ void store_release(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ std::uint32_t load_acquire(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// This call's number (1 for the first), from the block's own counter at `base`.
__device__ __forceinline__ std::uint32_t call_number(const NvlinkArgs& a, std::size_t base) {
  return a.counters[base + blockIdx.x] + 1;
}

// The call is over for this block (on failure it is not counted: the communicator is broken).
__device__ __forceinline__ void finish_call(const NvlinkArgs& a, std::size_t base,
                                            std::uint32_t flag) {
  if (threadIdx.x == 0) a.counters[base + blockIdx.x] = flag;
}

// A thread block with no unit to walk in this call (small calls leave most of the grid idle) only
// counts the call: it skips the barriers, which no peer's same-numbered block waits on either
// (they have no work too). Staging stays safe to reuse: block 0 always has work, and its
// barrier in call k means every peer's kernel of call k-1 has ended.
__device__ __forceinline__ bool idle(std::size_t longest_walk) {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x >= longest_walk;
}

__device__ __forceinline__ std::uint32_t load_volatile(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ const std::uint32_t* dead_word(const NvlinkArgs& a) {
  return reinterpret_cast<const std::uint32_t*>(a.block[a.rank] + kDeadOffset);
}

// The reason this kernel gives up, for the host (the first one stays).
__device__ __forceinline__ void record_error(const NvlinkArgs& a, std::uint32_t why) {
  if (load_volatile(&a.host->error) == 0) store_release(&a.host->error, why);
}

// Why to stop waiting, or 0: the host aborted the communicator (a word in mapped host memory,
// read every 1024 spins), or some rank's host declared it dead (this rank's dead word, every 64).
__device__ __forceinline__ std::uint32_t give_up(const NvlinkArgs& a, std::uint32_t spins) {
  if ((spins & 63) != 0) return 0;
  if (const std::uint32_t d = load_volatile(dead_word(a)); d != 0) return kErrorPeer | (d - 1);
  if ((spins & 1023) == 0 && load_volatile(&a.host->abort) != 0) return kErrorAborted;
  return 0;
}

// After a wait that ended: whether the communicator died meanwhile (its counts can no longer be
// trusted, so neither can what this call read).
__device__ __forceinline__ std::uint32_t died(const NvlinkArgs& a) {
  const std::uint32_t d = load_volatile(dead_word(a));
  return d != 0 ? kErrorPeer | (d - 1) : 0;
}

// Block b of this rank tells block b of every rank that it reached call `flag` at `which`
// barrier, and waits until each of them has (counts only grow: a peer may be a call ahead). It
// waits as long as it takes, unless the communicator is aborted or declared dead: false then,
// with the reason recorded for the host.
__device__ bool barrier(const NvlinkArgs& a, bool mid, std::uint32_t flag) {
  __shared__ std::uint32_t failed;
  __syncthreads();
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < static_cast<unsigned>(a.nranks)) {
    const int peer = static_cast<int>(threadIdx.x);
    auto* theirs = reinterpret_cast<NvlinkFlags*>(a.block[peer]);
    auto* ours = reinterpret_cast<NvlinkFlags*>(a.block[a.rank]);
    std::uint32_t* tell =
        mid ? &theirs->mid[blockIdx.x][a.rank] : &theirs->start[blockIdx.x][a.rank];
    const std::uint32_t* wait = mid ? &ours->mid[blockIdx.x][peer] : &ours->start[blockIdx.x][peer];
    store_release(tell, flag);
    std::uint32_t spins = 0;
    while (static_cast<std::int32_t>(load_acquire(wait) - flag) < 0) {
      if (const std::uint32_t why = give_up(a, ++spins); why != 0) {
        atomicCAS(&failed, 0u, why);
        break;
      }
    }
    if (threadIdx.x == 0)
      if (const std::uint32_t why = died(a); why != 0) atomicCAS(&failed, 0u, why);
  }
  __syncthreads();
  if (failed != 0) {
    if (threadIdx.x == 0) record_error(a, failed);
    return false;
  }
  return true;
}

// One unit: up to kPack<T> elements starting at element u * kPack<T>.
template <class T>
struct Unit {
  T e[kPack<T>];
};

template <class T>
__device__ __forceinline__ int unit_size(std::size_t u, std::size_t count) {
  const std::size_t first = u * kPack<T>;
  return count - first >= static_cast<std::size_t>(kPack<T>) ? kPack<T>
                                                             : static_cast<int>(count - first);
}

// Loads a unit from memory that may be unaligned or end inside it.
template <class T>
__device__ __forceinline__ Unit<T> load(const T* base, std::size_t u, int n, bool aligned) {
  Unit<T> x;
  if (n == kPack<T> && aligned) {
    const uint4 v = reinterpret_cast<const uint4*>(base)[u];
    memcpy(x.e, &v, sizeof v);
  } else {
    for (int j = 0; j < n; ++j)
      x.e[j] = base[u * kPack<T> + j];
  }
  return x;
}

template <class T>
__device__ __forceinline__ void store(T* base, std::size_t u, int n, bool aligned,
                                      const Unit<T>& x) {
  if (n == kPack<T> && aligned) {
    uint4 v;
    memcpy(&v, x.e, sizeof v);
    reinterpret_cast<uint4*>(base)[u] = v;
  } else {
    for (int j = 0; j < n; ++j)
      base[u * kPack<T> + j] = x.e[j];
  }
}

// A staging unit (always aligned, whole units of room), read past L1: the peers wrote it.
template <class T>
__device__ __forceinline__ Unit<T> load_staged(const T* base, std::size_t u) {
  Unit<T> x;
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(base) + u);
  memcpy(x.e, &v, sizeof v);
  return x;
}

template <class T>
__device__ __forceinline__ void store_staged(T* base, std::size_t u, const Unit<T>& x) {
  uint4 v;
  memcpy(&v, x.e, sizeof v);
  __stcg(reinterpret_cast<uint4*>(base) + u, v);
}

// The unit reduced over every rank's staging area, in rank order (the same bits on every rank).
template <class T, RedOp Op>
__device__ __forceinline__ Unit<T> reduce_unit(T* const* stage, int nranks, std::size_t u,
                                               int divide_by) {
  using A = typename Acc<T>::type;
  A acc[kPack<T>];
  Unit<T> x = load_staged(stage[0], u);
#pragma unroll
  for (int j = 0; j < kPack<T>; ++j)
    acc[j] = widen(x.e[j]);
  for (int r = 1; r < nranks; ++r) {
    x = load_staged(stage[r], u);
#pragma unroll
    for (int j = 0; j < kPack<T>; ++j)
      acc[j] = apply<Op>(acc[j], widen(x.e[j]));
  }
#pragma unroll
  for (int j = 0; j < kPack<T>; ++j) {
    if constexpr (std::is_floating_point_v<A>) {
      if (divide_by > 0) acc[j] = acc[j] / static_cast<A>(divide_by);
    }
    x.e[j] = narrow<T>(acc[j]);
  }
  return x;
}

template <class T, RedOp Op>
__global__ void __launch_bounds__(512) nvlink_all_reduce(NvlinkArgs a) {
  const std::uint32_t flag = call_number(a, 0);
  T* stage[kNvlinkRanks];
  const std::size_t half = (flag & 1u) * a.staging_bytes;
  for (int r = 0; r < a.nranks; ++r)
    stage[r] = reinterpret_cast<T*>(a.block[r] + kFlagsBytes + half);
  const auto* send = static_cast<const T*>(a.send);
  auto* recv = static_cast<T*>(a.recv);
  const bool send_aligned = reinterpret_cast<std::uintptr_t>(send) % 16 == 0;
  const bool recv_aligned = reinterpret_cast<std::uintptr_t>(recv) % 16 == 0;
  const std::size_t units = (a.count + kPack<T> - 1) / kPack<T>;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const int slices = a.two_shot ? a.nranks : 1;
  auto begin = [&](int s) { return units * static_cast<std::size_t>(s) / slices; };
  if (idle((units + slices - 1) / slices)) {
    finish_call(a, 0, flag);
    return;
  }

  // This rank's input into its staging area, slice by slice, as the later phases walk it.
  for (int s = 0; s < slices; ++s)
    for (std::size_t u = begin(s) + first; u < begin(s + 1); u += stride)
      store_staged(stage[a.rank], u, load(send, u, unit_size<T>(u, a.count), send_aligned));
  if (!barrier(a, false, flag)) return;

  if (!a.two_shot) {
    if (a.root < 0 || a.root == a.rank)
      for (std::size_t u = first; u < units; u += stride)
        store(recv, u, unit_size<T>(u, a.count), recv_aligned,
              reduce_unit<T, Op>(stage, a.nranks, u, a.divide_by));
  } else {
    // Reduce-scatter: this rank's slice, reduced into its staging area (the peers gather it
    // from there) and into the output.
    for (std::size_t u = begin(a.rank) + first; u < begin(a.rank + 1); u += stride) {
      const Unit<T> x = reduce_unit<T, Op>(stage, a.nranks, u, a.divide_by);
      store_staged(stage[a.rank], u, x);
      store(recv, u, unit_size<T>(u, a.count), recv_aligned, x);
    }
    if (!barrier(a, true, flag)) return;
    // All-gather: every other rank's slice.
    for (int q = 0; q < a.nranks; ++q) {
      if (q == a.rank) continue;
      for (std::size_t u = begin(q) + first; u < begin(q + 1); u += stride)
        store(recv, u, unit_size<T>(u, a.count), recv_aligned, load_staged(stage[q], u));
    }
  }
  finish_call(a, 0, flag);
}

// Two-shot by pushing: no copy into the rank's own staging area and no remote read, whose latency
// the reading thread waits out. Each rank writes slice q of its input into rank q's area (a slot
// per sender), meets the peers at a barrier, reduces its own slice from its input and the slots
// (in rank order), writes the result to its output and into every peer's gather area, meets them
// again, and copies the other slices out of its gather area. A half of the staging area holds
// nranks slots of a slice, then the gather area of every unit.
template <class T, RedOp Op>
__global__ void __launch_bounds__(512) nvlink_push_two_shot(NvlinkArgs a) {
  const std::uint32_t flag = call_number(a, 0);
  const int p = a.nranks;
  const std::size_t units = (a.count + kPack<T> - 1) / kPack<T>;
  const std::size_t slot = (units + p - 1) / p;  // the longest slice
  if (idle(slot)) {
    finish_call(a, 0, flag);
    return;
  }
  auto begin = [&](int q) { return units * static_cast<std::size_t>(q) / p; };
  const std::size_t half = (flag & 1u) * a.staging_bytes;
  auto area = [&](int owner) { return reinterpret_cast<T*>(a.block[owner] + kFlagsBytes + half); };
  auto rs = [&](int owner, int sender) {
    return area(owner) + static_cast<std::size_t>(sender) * slot * kPack<T>;
  };
  auto ag = [&](int owner) { return area(owner) + static_cast<std::size_t>(p) * slot * kPack<T>; };
  const auto* send = static_cast<const T*>(a.send);
  auto* recv = static_cast<T*>(a.recv);
  const bool send_aligned = reinterpret_cast<std::uintptr_t>(send) % 16 == 0;
  const bool recv_aligned = reinterpret_cast<std::uintptr_t>(recv) % 16 == 0;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;

  for (int d = 1; d < p; ++d) {
    const int q = (a.rank + d) % p;  // every rank starts on a different peer
    for (std::size_t u = begin(q) + first; u < begin(q + 1); u += stride)
      store_staged(rs(q, a.rank), u - begin(q),
                   load(send, u, unit_size<T>(u, a.count), send_aligned));
  }
  if (!barrier(a, false, flag)) return;

  using A = typename Acc<T>::type;
  const std::size_t mine = begin(a.rank);
  for (std::size_t u = mine + first; u < begin(a.rank + 1); u += stride) {
    const int n = unit_size<T>(u, a.count);
    A acc[kPack<T>];
    for (int r = 0; r < p; ++r) {
      const Unit<T> x =
          r == a.rank ? load(send, u, n, send_aligned) : load_staged(rs(a.rank, r), u - mine);
#pragma unroll
      for (int j = 0; j < kPack<T>; ++j)
        acc[j] = r == 0 ? widen(x.e[j]) : apply<Op>(acc[j], widen(x.e[j]));
    }
    Unit<T> x;
#pragma unroll
    for (int j = 0; j < kPack<T>; ++j) {
      if constexpr (std::is_floating_point_v<A>) {
        if (a.divide_by > 0) acc[j] = acc[j] / static_cast<A>(a.divide_by);
      }
      x.e[j] = narrow<T>(acc[j]);
    }
    store(recv, u, n, recv_aligned, x);
    for (int d = 1; d < p; ++d)
      store_staged(ag((a.rank + d) % p), u, x);
  }
  if (!barrier(a, true, flag)) return;

  for (int d = 1; d < p; ++d) {
    const int q = (a.rank + d) % p;
    for (std::size_t u = begin(q) + first; u < begin(q + 1); u += stride)
      store(recv, u, unit_size<T>(u, a.count), recv_aligned, load_staged(ag(a.rank), u));
  }
  finish_call(a, 0, flag);
}

// Reduce-scatter: every rank stages all its blocks (block q at q * units units), then reduces
// block `rank` over every rank's staging area.
template <class T, RedOp Op>
__global__ void __launch_bounds__(512) nvlink_reduce_scatter(NvlinkArgs a) {
  const std::uint32_t flag = call_number(a, 0);
  const std::size_t units = (a.count + kPack<T> - 1) / kPack<T>;
  if (idle(units)) {
    finish_call(a, 0, flag);
    return;
  }
  const std::size_t half = (flag & 1u) * a.staging_bytes;
  T* stage[kNvlinkRanks];
  for (int r = 0; r < a.nranks; ++r)
    stage[r] = reinterpret_cast<T*>(a.block[r] + kFlagsBytes + half);
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (int q = 0; q < a.nranks; ++q) {
    const T* src = static_cast<const T*>(a.send) + static_cast<std::size_t>(q) * a.stride;
    const bool aligned = reinterpret_cast<std::uintptr_t>(src) % 16 == 0;
    T* dst = stage[a.rank] + static_cast<std::size_t>(q) * units * kPack<T>;
    for (std::size_t u = first; u < units; u += stride)
      store_staged(dst, u, load(src, u, unit_size<T>(u, a.count), aligned));
  }
  if (!barrier(a, false, flag)) return;
  T* mine[kNvlinkRanks];
  for (int r = 0; r < a.nranks; ++r)
    mine[r] = stage[r] + static_cast<std::size_t>(a.rank) * units * kPack<T>;
  auto* recv = static_cast<T*>(a.recv);
  const bool recv_aligned = reinterpret_cast<std::uintptr_t>(recv) % 16 == 0;
  for (std::size_t u = first; u < units; u += stride)
    store(recv, u, unit_size<T>(u, a.count), recv_aligned,
          reduce_unit<T, Op>(mine, a.nranks, u, a.divide_by));
  finish_call(a, 0, flag);
}

// All-gather and broadcast, as bytes: the ranks that contribute stage their input, then every
// rank copies what it needs out of their staging areas.
__global__ void __launch_bounds__(512) nvlink_gather(NvlinkArgs a) {
  using T = std::uint8_t;
  const std::uint32_t flag = call_number(a, 0);
  const std::size_t units = (a.count + kPack<T> - 1) / kPack<T>;
  if (idle(units)) {
    finish_call(a, 0, flag);
    return;
  }
  const std::size_t half = (flag & 1u) * a.staging_bytes;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  auto stage = [&](int r) { return reinterpret_cast<T*>(a.block[r] + kFlagsBytes + half); };
  if (a.root < 0 || a.root == a.rank) {
    const auto* send = static_cast<const T*>(a.send);
    const bool aligned = reinterpret_cast<std::uintptr_t>(send) % 16 == 0;
    for (std::size_t u = first; u < units; u += stride)
      store_staged(stage(a.rank), u, load(send, u, unit_size<T>(u, a.count), aligned));
  }
  if (!barrier(a, false, flag)) return;
  const int q0 = a.root < 0 ? 0 : a.root, q1 = a.root < 0 ? a.nranks : a.root + 1;
  for (int q = q0; q < q1; ++q) {
    T* out = static_cast<T*>(a.recv) + (a.root < 0 ? static_cast<std::size_t>(q) * a.stride : 0);
    const bool aligned = reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
    for (std::size_t u = first; u < units; u += stride)
      store(out, u, unit_size<T>(u, a.count), aligned, load_staged(stage(q), u));
  }
  finish_call(a, 0, flag);
}

// ---- the low-latency kernel: (data, flag) pairs, no barrier

__device__ __forceinline__ void ll_store(uint4* p, std::uint32_t d0, std::uint32_t d1,
                                         std::uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag),
               "r"(d1), "r"(flag)
               : "memory");
}

// True once both halves of the line carry `flag` (each 8-byte half is written at once).
__device__ __forceinline__ bool ll_load(const uint4* p, std::uint32_t flag, std::uint32_t& d0,
                                        std::uint32_t& d1) {
  std::uint32_t a, b, c, d;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
               : "l"(p)
               : "memory");
  d0 = a;
  d1 = c;
  return b == flag && d == flag;
}

// Up to 8 bytes at `off` of a buffer that may be unaligned or end there.
__device__ __forceinline__ void load8(const std::byte* base, std::size_t off, std::size_t n,
                                      bool aligned, std::uint32_t (&d)[2]) {
  if (n == 8 && aligned) {
    const uint2 v = *reinterpret_cast<const uint2*>(base + off);
    d[0] = v.x;
    d[1] = v.y;
  } else {
    d[0] = d[1] = 0;
    memcpy(d, base + off, n);
  }
}

// Waits until the line carries `flag` and gives its data; false where the kernel gives up (the
// reason in `failed`, shared by the block).
__device__ __forceinline__ bool ll_wait(const NvlinkArgs& a, const uint4* line, std::uint32_t flag,
                                        std::uint32_t (&d)[2], std::uint32_t& failed) {
  std::uint32_t spins = 0;
  while (!ll_load(line, flag, d[0], d[1])) {
    if (const std::uint32_t why = give_up(a, ++spins); why != 0) {
      atomicCAS(&failed, 0u, why);
      return false;
    }
  }
  return true;
}

// The low-latency kernels' view of a call: 8-byte lines of input and output, and the areas.
struct LowLatencyCall {
  const NvlinkArgs& a;
  std::uint32_t flag;
  std::size_t bytes, lines, first, stride;
  const std::byte* in;
  std::byte* out;
  bool in8, out8;

  __device__ LowLatencyCall(const NvlinkArgs& args, std::size_t elem)
      : a(args),
        flag(call_number(args, kLowLatencyCounters)),
        bytes(args.count * elem),
        lines((bytes + 7) / 8),
        first(static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x),
        stride(static_cast<std::size_t>(gridDim.x) * blockDim.x),
        in(static_cast<const std::byte*>(args.send)),
        out(static_cast<std::byte*>(args.recv)),
        in8(reinterpret_cast<std::uintptr_t>(args.send) % 8 == 0),
        out8(reinterpret_cast<std::uintptr_t>(args.recv) % 8 == 0) {}

  // What `sender` writes into `owner`'s memory, in this call's half.
  __device__ uint4* area(int owner, int sender) const {
    return reinterpret_cast<uint4*>(a.block[owner] + a.ll_offset +
                                    static_cast<std::size_t>(sender) * 2 * a.ll_bytes +
                                    (flag & 1u) * a.ll_bytes);
  }
  __device__ std::size_t size(std::size_t l) const { return bytes - l * 8 < 8 ? bytes - l * 8 : 8; }
  // At a refresh call (low_latency_refresh): every line of this half in every peer's area from
  // this rank that `read(line, peer)` says the peer does not read in this call gets this call's
  // flag (and no data), so that no line keeps a flag for 2^32 calls.
  template <class Read>
  __device__ void refresh(Read read) const {
    if (!low_latency_refresh(flag)) return;
    const std::size_t capacity = a.ll_bytes / 16;
    for (std::size_t l = first; l < capacity; l += stride)
      for (int q = 0; q < a.nranks; ++q)
        if (q != a.rank && !read(l, q)) ll_store(area(q, a.rank) + l, 0, 0, flag);
  }
  __device__ void input(std::size_t l, std::uint32_t (&d)[2]) const {
    load8(in, l * 8, size(l), in8, d);
  }
  __device__ void output(std::size_t l, const std::uint32_t (&d)[2]) const {
    if (size(l) == 8 && out8)
      *reinterpret_cast<uint2*>(out + l * 8) = make_uint2(d[0], d[1]);
    else
      memcpy(out + l * 8, d, size(l));
  }
  // Line l reduced over every rank in rank order (this rank's from its input, the others' as
  // they arrive in its area); false where the kernel gives up.
  // `at`: where the line is in the areas.
  template <class T, RedOp Op>
  __device__ bool reduce(std::size_t l, std::size_t at, std::uint32_t (&result)[2],
                         std::uint32_t& failed) const {
    using A = typename Acc<T>::type;
    constexpr int kPer = 8 / static_cast<int>(sizeof(T));
    A acc[kPer];
    for (int r = 0; r < a.nranks; ++r) {
      std::uint32_t d[2];
      if (r == a.rank)
        input(l, d);
      else if (!ll_wait(a, area(a.rank, r) + at, flag, d, failed))
        return false;
      T e[kPer];
      memcpy(e, d, sizeof e);
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        acc[j] = r == 0 ? widen(e[j]) : apply<Op>(acc[j], widen(e[j]));
    }
    T e[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if constexpr (std::is_floating_point_v<A>) {
        if (a.divide_by > 0) acc[j] = acc[j] / static_cast<A>(a.divide_by);
      }
      e[j] = narrow<T>(acc[j]);
    }
    memcpy(result, e, sizeof e);
    return true;
  }
  // The call's end for the block: counted, or the reason recorded for the host.
  __device__ void finish(std::uint32_t& failed) const {
    if (threadIdx.x == 0)
      if (const std::uint32_t why = died(a); why != 0) atomicCAS(&failed, 0u, why);
    __syncthreads();
    if (failed != 0) {
      if (threadIdx.x == 0) record_error(a, failed);
      return;
    }
    finish_call(a, kLowLatencyCounters, flag);
  }
};

// One-shot: every rank's input to every peer, each rank reduces all of it.
template <class T, RedOp Op>
__global__ void __launch_bounds__(512) low_latency(NvlinkArgs a) {
  __shared__ std::uint32_t failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const LowLatencyCall c(a, sizeof(T));
  c.refresh([&](std::size_t l, int) { return l < c.lines; });
  for (std::size_t l = c.first; l < c.lines; l += c.stride) {
    std::uint32_t d[2];
    c.input(l, d);
    for (int q = 0; q < a.nranks; ++q)
      if (q != a.rank) ll_store(c.area(q, a.rank) + l, d[0], d[1], c.flag);
  }
  for (std::size_t l = c.first; l < c.lines && failed == 0; l += c.stride) {
    std::uint32_t d[2];
    if (!c.template reduce<T, Op>(l, l, d, failed)) break;
    c.output(l, d);
  }
  c.finish(failed);
}

// Two-shot: slice q of every rank's input to rank q, which reduces it and sends the result to
// every rank, in (data, flag) lines both ways (no barrier). In the area a sender has at a
// receiver, the receiver's slice of the sender's input takes the first `slot` lines and the
// sender's slice of the result the next `slot` (slot: the longest slice), so calls up to nranks/2
// times the one-shot kernel's size fit the same area. Every rank hears from every peer in every
// call (each slice has a line: lines >= nranks), which keeps the halves safe to reuse as in the
// one-shot kernel.
template <class T, RedOp Op>
__global__ void __launch_bounds__(512) low_latency_two_shot(NvlinkArgs a) {
  __shared__ std::uint32_t failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const LowLatencyCall c(a, sizeof(T));
  const int p = a.nranks;
  auto begin = [&](int q) { return c.lines * static_cast<std::size_t>(q) / p; };
  const std::size_t slot = (c.lines + p - 1) / p;
  // Rank q reads its slice of the input and this rank's slice of the result from this rank.
  c.refresh([&](std::size_t at, int q) {
    return at < begin(q + 1) - begin(q) ||
           (at >= slot && at - slot < begin(a.rank + 1) - begin(a.rank));
  });
  for (int k = 1; k < p; ++k) {
    const int q = (a.rank + k) % p;  // every rank starts on a different peer
    for (std::size_t l = begin(q) + c.first; l < begin(q + 1); l += c.stride) {
      std::uint32_t d[2];
      c.input(l, d);
      ll_store(c.area(q, a.rank) + (l - begin(q)), d[0], d[1], c.flag);
    }
  }
  for (std::size_t l = begin(a.rank) + c.first; l < begin(a.rank + 1) && failed == 0;
       l += c.stride) {
    std::uint32_t d[2];
    if (!c.template reduce<T, Op>(l, l - begin(a.rank), d, failed)) break;
    for (int k = 1; k < p; ++k)
      ll_store(c.area((a.rank + k) % p, a.rank) + slot + (l - begin(a.rank)), d[0], d[1], c.flag);
    c.output(l, d);
  }
  for (int k = 1; k < p && failed == 0; ++k) {
    const int q = (a.rank + k) % p;
    for (std::size_t l = begin(q) + c.first; l < begin(q + 1) && failed == 0; l += c.stride) {
      std::uint32_t d[2];
      if (!ll_wait(a, c.area(a.rank, q) + slot + (l - begin(q)), c.flag, d, failed)) break;
      c.output(l, d);
    }
  }
  c.finish(failed);
}

}  // namespace

cudaError_t launch_nvlink(const NvlinkArgs& args, DataType t, RedOp op, int blocks,
                          cudaStream_t stream) {
  return dispatch(t, op, [&](auto type, auto red) {
    using T = typename decltype(type)::type;
    constexpr RedOp kOp = decltype(red)::value;
    if (args.push)
      nvlink_push_two_shot<T, kOp><<<static_cast<unsigned>(blocks), 512, 0, stream>>>(args);
    else
      nvlink_all_reduce<T, kOp><<<static_cast<unsigned>(blocks), 512, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

cudaError_t launch_reduce_scatter(const NvlinkArgs& args, DataType t, RedOp op, int blocks,
                                  cudaStream_t stream) {
  return dispatch(t, op, [&](auto type, auto red) {
    nvlink_reduce_scatter<typename decltype(type)::type, decltype(red)::value>
        <<<static_cast<unsigned>(blocks), 512, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

cudaError_t launch_gather(const NvlinkArgs& args, int blocks, cudaStream_t stream) {
  nvlink_gather<<<static_cast<unsigned>(blocks), 512, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_low_latency(const NvlinkArgs& args, DataType t, RedOp op, int blocks,
                               cudaStream_t stream) {
  return dispatch(t, op, [&](auto type, auto red) {
    using T = typename decltype(type)::type;
    constexpr RedOp kOp = decltype(red)::value;
    if (args.two_shot)
      low_latency_two_shot<T, kOp><<<static_cast<unsigned>(blocks), 512, 0, stream>>>(args);
    else
      low_latency<T, kOp><<<static_cast<unsigned>(blocks), 512, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace r2ccl::coll::gpu::detail

// r2ccl-gpu-perf: the NVLink all-reduce on the GPUs of one node, one process per GPU (ranks from
// R2CCL_RANK / R2CCL_NRANKS / R2CCL_BOOTSTRAP, as r2ccl-perf; bench/gpu/allreduce.sh starts them).
//   --check  every type x reduction x algorithm, sizes from 0 and odd counts up to several
//            staging chunks, in place and out of place, eager and replayed from a CUDA graph;
//            every element compared with the exact result
//   --bench  bf16 sum replayed from a CUDA graph, beside NCCL in the same run: latency per call
//            and bus bandwidth, and their ratio
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/coll/gpu/device.h"
#include "r2ccl/coll/gpu/node_comm.h"
#include "r2ccl/coll/reduce.h"
#include "r2ccl/coll/verify.h"
#include "r2ccl/runtime/config.h"

namespace {

using r2ccl::ErrorCode;
using r2ccl::Status;
using r2ccl::coll::Communicator;
using r2ccl::coll::DataType;
using r2ccl::coll::RedOp;
namespace gpu = r2ccl::coll::gpu;

struct Options {
  bool check = false;
  bool bench = false;
  std::string min_bytes = "8K", max_bytes = "512M";
  double factor = 2;
  int iters = 200;
  int graph_calls = 10;
  int device = -1;
  bool nccl = true;
  // NodeComm::Options (--bench); "default": the library's defaults
  std::string low_latency = "default", one_shot = "default", nccl_min = "default";
  int blocks = 128, low_latency_blocks = 128;
  bool tune = true;
  bool share_gpu = false;
  std::size_t low_latency_max = 0;  // parsed from low_latency
};

Status cuda(cudaError_t e, const char* what) {
  return gpu::cuda_status(e, what);
}

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::ok();
  return {ErrorCode::kInternal, fmt::format("{}: {}", what, ncclGetErrorString(r))};
}

// Exact in every type: small whole numbers (quarters for the float types), distinct per rank.
double value(std::size_t i, int rank, DataType t) {
  const auto k = static_cast<int>((i * 7919 + static_cast<std::size_t>(rank) * 104729) % 15);
  if (t == DataType::kU8) return static_cast<double>(k);
  if (!r2ccl::coll::is_float(t)) return static_cast<double>(k - 7);
  return static_cast<double>(k - 7) * 0.25;
}

// The exact reduction over p ranks of value_of(rank), as type t holds it.
template <class ValueOf>
double reduced(DataType t, RedOp op, int p, ValueOf value_of) {
  double acc = value_of(0);
  for (int r = 1; r < p; ++r) {
    const double v = value_of(r);
    acc = op == RedOp::kMin    ? std::min(acc, v)
          : op == RedOp::kMax  ? std::max(acc, v)
          : op == RedOp::kProd ? acc * v
                               : acc + v;
  }
  if (op == RedOp::kAvg) acc /= p;
  if (t == DataType::kU8)
    acc = static_cast<double>(static_cast<std::uint8_t>(static_cast<std::int64_t>(acc)));
  return acc;
}

struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(std::size_t bytes) { (void)cudaMalloc(&p, std::max<std::size_t>(bytes, 16)); }
  ~DeviceMem() {
    if (p) (void)cudaFree(p);
  }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
};

// Runs `call` on `stream` either directly or captured once in a CUDA graph and replayed.
Status run_on(cudaStream_t s, bool graph, const std::function<Status()>& call) {
  if (!graph) return call();
  cudaGraph_t g = nullptr;
  R2CCL_RETURN_IF_ERROR(
      cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture"));
  Status st = call();
  Status end = cuda(cudaStreamEndCapture(s, &g), "cudaStreamEndCapture");
  R2CCL_RETURN_IF_ERROR(st);
  R2CCL_RETURN_IF_ERROR(end);
  cudaGraphExec_t exec = nullptr;
  st = cuda(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
  if (st) st = cuda(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
  if (exec) (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(g);
  return st;
}

// `in` into `src`, then `call` on `s`, then the kernels' error word, then `dst` into `out`.
Status round_trip(gpu::NodeComm& nv, cudaStream_t s, void* src, const std::vector<std::byte>& in,
                  const void* dst, std::vector<std::byte>& out,
                  const std::function<Status()>& call) {
  R2CCL_RETURN_IF_ERROR(
      cuda(cudaMemcpy(src, in.data(), in.size(), cudaMemcpyHostToDevice), "copy in"));
  // A copy from pageable memory may return before its data lands, and the all-reduce runs on a
  // stream that does not wait for the legacy one.
  R2CCL_RETURN_IF_ERROR(cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));
  R2CCL_RETURN_IF_ERROR(call());
  R2CCL_RETURN_IF_ERROR(cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
  R2CCL_RETURN_IF_ERROR(nv.synchronize());
  return cuda(cudaMemcpy(out.data(), dst, out.size(), cudaMemcpyDeviceToHost), "copy out");
}

// Where a case's elements differ from what they should be: (bad count, first bad index).
std::pair<std::size_t, std::size_t> compare(const std::vector<std::byte>& got,
                                            const std::vector<std::byte>& want, DataType t,
                                            bool fuzzy) {
  const std::size_t e = r2ccl::coll::type_size(t), count = got.size() / e;
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double g = r2ccl::coll::get_element(got.data(), i, t);
    const double w = r2ccl::coll::get_element(want.data(), i, t);
    if (fuzzy ? std::fabs(g - w) > 0.02
              : std::memcmp(got.data() + i * e, want.data() + i * e, e) != 0) {
      if (bad++ == 0) first_bad = i;
    }
  }
  return {bad, first_bad};
}

// 1 when `got` differs from `want`, after saying where on stderr; else 0.
int verify(int me, const std::string& what, const std::vector<std::byte>& got,
           const std::vector<std::byte>& want, DataType t, bool fuzzy) {
  const auto [bad, first_bad] = compare(got, want, t, fuzzy);
  if (bad == 0) return 0;
  fmt::print(stderr, "rank {}: {}: {} of {} elements wrong, first at {} (got {}, want {})\n", me,
             what, bad, got.size() / r2ccl::coll::type_size(t), first_bad,
             r2ccl::coll::get_element(got.data(), first_bad, t),
             r2ccl::coll::get_element(want.data(), first_bad, t));
  return 1;
}

// 1 GiB and a few elements, float and bfloat16 sums, every algorithm: the largest size, checked
// element by element (the values are small whole numbers, so every sum is exact).
int check_large(Communicator& host, gpu::NodeComm& nv, cudaStream_t s, int& cases) {
  const int p = host.size(), me = host.rank();
  int wrong = 0;
  for (DataType t : {DataType::kF32, DataType::kBF16}) {
    const std::size_t e = r2ccl::coll::type_size(t);
    const std::size_t count = (std::size_t{1} << 30) / e + 3;
    auto element = [&](std::size_t i, int rank) {
      return static_cast<float>(static_cast<int>((i + static_cast<std::size_t>(rank) * 7) % 9) - 4);
    };
    std::vector<std::byte> in(count * e), want(count * e), got(count * e);
    for (std::size_t i = 0; i < count; ++i) {
      float sum = 0;
      for (int r = 0; r < p; ++r)
        sum += element(i, r);
      const float mine = element(i, me);
      if (t == DataType::kF32) {
        std::memcpy(in.data() + i * 4, &mine, 4);
        std::memcpy(want.data() + i * 4, &sum, 4);
      } else {
        const std::uint16_t a = r2ccl::coll::float_to_bf16(mine),
                            b = r2ccl::coll::float_to_bf16(sum);
        std::memcpy(in.data() + i * 2, &a, 2);
        std::memcpy(want.data() + i * 2, &b, 2);
      }
    }
    DeviceMem src(count * e), dst(count * e);
    if (!src.p || !dst.p) {
      fmt::print(stderr, "rank {}: cannot allocate 2 x {} bytes\n", me, count * e);
      return -1;
    }
    for (gpu::NvlinkAlgo algo : gpu::kNvlinkAlgos) {
      if (algo == gpu::NvlinkAlgo::kNccl && (!nv.has_nccl() || p == 1)) continue;
      Status st = round_trip(nv, s, src.p, in, dst.p, got, [&] {
        return nv.all_reduce(src.p, dst.p, count, t, RedOp::kSum, s, algo);
      });
      ++cases;
      if (!st) {
        fmt::print(stderr, "rank {}: {} sum {} count {}: {}\n", me, r2ccl::coll::type_name(t),
                   gpu::nvlink_algo_name(algo), count, st.to_string());
        return -1;
      }
      if (got != want) {
        ++wrong;
        std::size_t i = 0;
        while (i < count && std::memcmp(got.data() + i * e, want.data() + i * e, e) == 0)
          ++i;
        fmt::print(stderr, "rank {}: {} sum {} count {}: wrong from element {}\n", me,
                   r2ccl::coll::type_name(t), gpu::nvlink_algo_name(algo), count, i);
      }
    }
  }
  return wrong;
}

enum class Op { kAllGather, kReduceScatter, kBroadcast, kReduce, kSendRecv };
const char* op_name(Op op) {
  switch (op) {
    case Op::kAllGather:
      return "all-gather";
    case Op::kReduceScatter:
      return "reduce-scatter";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kReduce:
      return "reduce";
    case Op::kSendRecv:
      return "send/recv";
  }
  return "?";
}

// All-gather, reduce-scatter, broadcast, reduce (root: the last rank) and send/recv round a ring,
// every type (and reduction), sizes from 0 to several staging chunks, in place and out of place,
// eager and from a CUDA graph; every element compared. Returns the cases wrong (-1: an error).
int check_ops(Communicator& host, gpu::NodeComm& nv, cudaStream_t s, const char* engine,
              int& cases) {
  const int p = host.size(), me = host.rank(), root = p - 1;
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  const std::size_t counts[] = {0, 1, 7, 1000, 65536 + 5, (std::size_t{3} << 17) + 7};
  int wrong = 0;
  for (Op kind : {Op::kAllGather, Op::kReduceScatter, Op::kBroadcast, Op::kReduce, Op::kSendRecv}) {
    if (kind == Op::kSendRecv && (p == 1 || !nv.has_nccl())) continue;
    const bool reducing = kind == Op::kReduceScatter || kind == Op::kReduce;
    for (DataType t : r2ccl::coll::kAllTypes) {
      const std::size_t e = r2ccl::coll::type_size(t);
      for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax, RedOp::kAvg}) {
        if (!reducing && op != RedOp::kSum) continue;
        if (op == RedOp::kAvg && !r2ccl::coll::is_float(t)) continue;
        if (op == RedOp::kProd && p > 4) continue;
        for (std::size_t n : counts) {
          for (int variant = 0; variant < 4; ++variant) {
            const bool in_place = variant & 1, graph = variant & 2;
            if (in_place && kind == Op::kSendRecv) continue;
            const std::size_t np = n * static_cast<std::size_t>(p);
            const std::size_t in_n = kind == Op::kReduceScatter ? np : n;
            const std::size_t out_n = kind == Op::kAllGather ? np : n;
            std::vector<std::byte> in(in_n * e), want(out_n * e), got(out_n * e);
            for (std::size_t i = 0; i < in_n; ++i)
              r2ccl::coll::set_element(in.data(), i, t, value(i, me, t));
            for (std::size_t i = 0; i < out_n; ++i) {
              double w = 0;
              switch (kind) {
                case Op::kAllGather:
                  w = value(i % (n ? n : 1), static_cast<int>(i / (n ? n : 1)), t);
                  break;
                case Op::kReduceScatter:
                  w = reduced(t, op, p, [&](int r) { return value(me * n + i, r, t); });
                  break;
                case Op::kBroadcast:
                  w = value(i, root, t);
                  break;
                case Op::kReduce:
                  w = me == root ? reduced(t, op, p, [&](int r) { return value(i, r, t); })
                      : in_place ? value(i, me, t)
                                 : 0;
                  break;
                case Op::kSendRecv:
                  w = value(i, prev, t);
                  break;
              }
              r2ccl::coll::set_element(want.data(), i, t, w);
            }
            const std::size_t shift = n % 2 == 1 ? e : 0;
            const std::size_t bytes = std::max(in_n, out_n) * e + 64;
            DeviceMem a(bytes), b(bytes);
            (void)cudaMemset(a.p, 0, bytes);
            (void)cudaMemset(b.p, 0, bytes);
            std::byte* src = static_cast<std::byte*>(a.p) + shift;
            std::byte* dst = static_cast<std::byte*>(b.p) + shift;
            if (in_place) {
              if (kind == Op::kAllGather)
                src = dst + static_cast<std::size_t>(me) * n * e;
              else if (kind == Op::kReduceScatter)
                dst = src + static_cast<std::size_t>(me) * n * e;
              else
                dst = src;
            }
            Status st = round_trip(nv, s, src, in, dst, got, [&] {
              return run_on(s, graph, [&]() -> Status {
                switch (kind) {
                  case Op::kAllGather:
                    return nv.all_gather(src, dst, n, t, s);
                  case Op::kReduceScatter:
                    return nv.reduce_scatter(src, dst, n, t, op, s);
                  case Op::kBroadcast:
                    return nv.broadcast(src, dst, n, t, root, s);
                  case Op::kReduce:
                    return nv.reduce(src, dst, n, t, op, root, s);
                  case Op::kSendRecv:
                    break;
                }
                R2CCL_RETURN_IF_ERROR(nv.group_start());
                Status a1 = nv.send(src, n, t, next, s);
                Status a2 = nv.recv(dst, n, t, prev, s);
                Status end = nv.group_end();
                R2CCL_RETURN_IF_ERROR(a1);
                R2CCL_RETURN_IF_ERROR(a2);
                return end;
              });
            });
            ++cases;
            const std::string what =
                fmt::format("{} ({}) {} {} count {} {}{}", op_name(kind), engine,
                            r2ccl::coll::type_name(t), r2ccl::coll::redop_name(op), n,
                            in_place ? "in place" : "out of place", graph ? ", graph" : "");
            if (!st) {
              fmt::print(stderr, "rank {}: {}: {}\n", me, what, st.to_string());
              return -1;
            }
            wrong += verify(me, what, got, want, t, op == RedOp::kAvg && e == 2);
          }
        }
      }
    }
  }
  return wrong;
}

// The low-latency flags across their wrap at 2^32 calls, the calls in between skipped
// (NodeComm::skip_low_latency_calls): the lines that large calls wrote just after one refresh,
// left alone by small calls through the next two refreshes and the wrap, must not pass for the
// lines of the large calls 2^32 calls later, whose last rank starts 50 ms late (so the others
// read their areas before it writes them). Both low-latency kernels; int32 sums.
int check_wrap(Communicator& host, gpu::NodeComm& nv, cudaStream_t s, int& cases) {
  const int p = host.size(), me = host.rank();
  if (p < 2) return 0;
  constexpr std::uint64_t kPeriod = std::uint64_t{1} << 31;  // the refresh period
  constexpr gpu::NvlinkAlgo kAlgos[] = {gpu::NvlinkAlgo::kLowLatency,
                                        gpu::NvlinkAlgo::kLowLatencyTwoShot};
  const std::size_t small = 64;
  std::size_t most = 0;
  for (gpu::NvlinkAlgo algo : kAlgos)
    most = std::max(most, nv.low_latency_limit(algo));
  DeviceMem src(most), dst(most);
  int wrong = 0;
  for (gpu::NvlinkAlgo algo : kAlgos) {
    const std::size_t big = nv.low_latency_limit(algo) / 4;  // int32: the kernel's largest call
    int seed = 0;
    auto call = [&](std::size_t count, bool late, std::uint64_t number) -> int {
      ++seed;
      auto element = [&](std::size_t i, int rank) {
        return static_cast<std::int32_t>(
            (i * 31 + static_cast<std::size_t>(rank) * 7 + static_cast<std::size_t>(seed) * 1009) %
            1000);
      };
      std::vector<std::byte> in(count * 4), want(count * 4), got(count * 4);
      for (std::size_t i = 0; i < count; ++i) {
        std::int32_t sum = 0;
        for (int r = 0; r < p; ++r)
          sum += element(i, r);
        r2ccl::coll::set_element(in.data(), i, DataType::kI32, element(i, me));
        r2ccl::coll::set_element(want.data(), i, DataType::kI32, sum);
      }
      Status st = round_trip(nv, s, src.p, in, dst.p, got, [&] {
        if (late && me == p - 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return nv.all_reduce(src.p, dst.p, count, DataType::kI32, RedOp::kSum, s, algo);
      });
      ++cases;
      const std::string what = fmt::format(
          "wrap: {} int32 sum count {} as call {} mod 2^32{}", gpu::nvlink_algo_name(algo), count,
          number % (std::uint64_t{1} << 32), late ? ", the last rank late" : "");
      if (!st) {
        fmt::print(stderr, "rank {}: {}: {}\n", me, what, st.to_string());
        return -1;
      }
      return verify(me, what, got, want, DataType::kI32, false);
    };
    auto count_now = [&]() -> std::optional<std::uint64_t> {
      auto now = nv.skip_low_latency_calls(0);
      if (!now) {
        fmt::print(stderr, "rank {}: {}\n", me, now.status().to_string());
        return std::nullopt;
      }
      return *now;
    };
    // Calls [first, first + n) (numbered without the wrap): `count` elements each.
    auto calls = [&](std::uint64_t first, int n, std::size_t count, bool late) -> int {
      int bad = 0;
      for (int k = 0; k < n; ++k) {
        const int r = call(count, late, first + static_cast<std::uint64_t>(k));
        if (r < 0) return -1;
        bad += r;
      }
      return bad;
    };
    // Skips to just before call `next` (numbered without the wrap; the count is modulo 2^32).
    auto skip_to = [&](std::uint64_t next) -> bool {
      auto now = count_now();
      if (!now) return false;
      const auto n = static_cast<std::uint32_t>((next - 1 - *now) % (std::uint64_t{1} << 32));
      auto r = nv.skip_low_latency_calls(n);
      if (!r) fmt::print(stderr, "rank {}: {}\n", me, r.status().to_string());
      return static_cast<bool>(r);
    };
    auto now = count_now();
    if (!now) return -1;
    // Real calls while a refresh is among the next four (skipping cannot pass one): at most 5.
    for (int k = 0; k < 6 && (*now % kPeriod == 0 || kPeriod - *now % kPeriod < 4); ++k) {
      if (const int r = calls(*now + 1, 1, small, false); r != 0) return r;
      now = *now + 1;
    }
    const std::uint64_t f = (*now / kPeriod + 1) * kPeriod;  // the next refresh of half 0
    const struct {
      std::uint64_t first;
      int small_calls, large_calls;
      bool late;
    } rounds[] = {
        {f - 2, 4, 2, false}, {f + kPeriod - 2, 6, 0, false}, {f + 2 * kPeriod - 2, 4, 2, true}};
    for (const auto& round : rounds) {
      if (!skip_to(round.first)) return -1;
      const int a = calls(round.first, round.small_calls, small, false);
      if (a < 0) return -1;
      const int b = calls(round.first + static_cast<std::uint64_t>(round.small_calls),
                          round.large_calls, big, round.late);
      if (b < 0) return -1;
      wrong += a + b;
    }
  }
  return wrong;
}

int check(Communicator& host, gpu::NodeComm& nv, gpu::NodeComm* nccl, cudaStream_t s) {
  const int p = host.size(), me = host.rank();
  const std::size_t chunked = (std::size_t{3} << 18) + 7;  // several 256 KiB staging chunks
  const std::size_t counts[] = {0, 1, 7, 1000, 8192 + 3, 65536 + 5, chunked};
  int cases = 0, wrong = 0;
  for (DataType t : r2ccl::coll::kAllTypes) {
    const std::size_t e = r2ccl::coll::type_size(t);
    for (RedOp op : {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax, RedOp::kAvg}) {
      if (op == RedOp::kAvg && !r2ccl::coll::is_float(t)) continue;
      for (gpu::NvlinkAlgo algo : gpu::kNvlinkAlgos) {
        if (algo == gpu::NvlinkAlgo::kNccl && (!nv.has_nccl() || p == 1)) continue;
        for (std::size_t count : counts) {
          for (int variant = 0; variant < 4; ++variant) {
            const bool in_place = variant & 1, graph = variant & 2;
            // Products of more than a few ranks' values leave the exact range of 16-bit types.
            if (op == RedOp::kProd && p > 4) continue;
            std::vector<std::byte> in(count * e), want(count * e), got(count * e);
            for (std::size_t i = 0; i < count; ++i) {
              r2ccl::coll::set_element(in.data(), i, t, value(i, me, t));
              const double acc = reduced(t, op, p, [&](int r) { return value(i, r, t); });
              r2ccl::coll::set_element(want.data(), i, t, acc);
            }
            // One element off the allocation's alignment where the count allows, to walk the
            // unaligned paths too.
            const std::size_t shift = count % 2 == 1 ? e : 0;
            DeviceMem a(count * e + 64), b(count * e + 64);
            auto* src = static_cast<std::byte*>(a.p) + shift;
            auto* dst = in_place ? src : static_cast<std::byte*>(b.p) + shift;
            Status st = round_trip(nv, s, src, in, dst, got, [&] {
              return run_on(s, graph,
                            [&] { return nv.all_reduce(src, dst, count, t, op, s, algo); });
            });
            ++cases;
            std::string what =
                fmt::format("{} {} {} count {} {}{}", r2ccl::coll::type_name(t),
                            r2ccl::coll::redop_name(op), gpu::nvlink_algo_name(algo), count,
                            in_place ? "in place" : "out of place", graph ? ", graph" : "");
            if (!st) {
              fmt::print(stderr, "rank {}: {}: {}\n", me, what, st.to_string());
              return 1;
            }
            // A mean rounds in 16 bits.
            wrong += verify(me, what, got, want, t, op == RedOp::kAvg && e == 2);
          }
        }
      }
    }
  }
  if (const int wrap = check_wrap(host, nv, s, cases); wrap != 0) {
    if (wrap < 0) return 1;
    wrong += wrap;
  }
  if (const int large = check_large(host, nv, s, cases); large != 0) {
    if (large < 0) return 1;
    wrong += large;
  }
  if (const int others = check_ops(host, nv, s, "kernels", cases); others != 0) {
    if (others < 0) return 1;
    wrong += others;
  }
  // The same through NCCL, where there is NCCL: a communicator that hands it every size.
  if (nccl) {
    if (const int others = check_ops(host, *nccl, s, "nccl", cases); others != 0) {
      if (others < 0) return 1;
      wrong += others;
    }
  }
  // Every rank's verdict, so that rank 0's line speaks for all.
  std::int32_t mine = wrong, total = 0;
  if (Status st = host.all_reduce(&mine, &total, 1, DataType::kI32, RedOp::kSum); !st) {
    fmt::print(stderr, "rank {}: {}\n", me, st.to_string());
    return 1;
  }
  if (me == 0)
    fmt::print(
        "check: {} ranks, {} cases per rank (all-reduce: types x reductions x low-latency "
        "one- and two-shot/one-shot/two-shot/push/nccl x sizes x in place/out of place x "
        "eager/graph, both low-latency kernels across the flags' wrap, and 1 GiB "
        "sums; "
        "all-gather, reduce-scatter, broadcast, reduce, send/recv: the same on the kernels and "
        "on NCCL): {}\n",
        p, cases, total == 0 ? "every element right" : fmt::format("{} cases WRONG", total));
  return total == 0 ? 0 : 1;
}

// Seconds per call of `call`, captured `calls` times in one graph and replayed `iters` times.
r2ccl::Result<double> time_graph(cudaStream_t s, int calls, int iters,
                                 const std::function<Status()>& call) {
  cudaGraph_t g = nullptr;
  R2CCL_RETURN_IF_ERROR(
      cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture"));
  Status st = Status::ok();
  for (int i = 0; i < calls && st; ++i)
    st = call();
  Status end = cuda(cudaStreamEndCapture(s, &g), "cudaStreamEndCapture");
  R2CCL_RETURN_IF_ERROR(st);
  R2CCL_RETURN_IF_ERROR(end);
  cudaGraphExec_t exec = nullptr;
  R2CCL_RETURN_IF_ERROR(cuda(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate"));
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  (void)cudaEventCreate(&e0);
  (void)cudaEventCreate(&e1);
  for (int i = 0; i < 5 && st; ++i)  // warm-up
    st = cuda(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
  if (st) st = cuda(cudaEventRecord(e0, s), "cudaEventRecord");
  for (int i = 0; i < iters && st; ++i)
    st = cuda(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
  if (st) st = cuda(cudaEventRecord(e1, s), "cudaEventRecord");
  if (st) st = cuda(cudaEventSynchronize(e1), "cudaEventSynchronize");
  float ms = 0;
  if (st) st = cuda(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(g);
  R2CCL_RETURN_IF_ERROR(st);
  return static_cast<double>(ms) * 1e-3 / (static_cast<double>(iters) * calls);
}

int bench(Communicator& host, gpu::NodeComm& nv, cudaStream_t s, const Options& o,
          std::size_t min_bytes, std::size_t max_bytes) {
  const int p = host.size(), me = host.rank();
  ncclComm_t nc = nullptr;
  if (o.nccl) {
    ncclUniqueId id{};
    if (me == 0) (void)ncclGetUniqueId(&id);
    if (Status st = host.broadcast(&id, &id, sizeof id, DataType::kU8, 0); !st) {
      fmt::print(stderr, "rank {}: {}\n", me, st.to_string());
      return 1;
    }
    if (Status st = nccl_status(ncclCommInitRank(&nc, p, id, me), "ncclCommInitRank"); !st) {
      fmt::print(stderr, "rank {}: {}\n", me, st.to_string());
      return 1;
    }
  }
  DeviceMem buf(max_bytes), out(max_bytes);
  (void)cudaMemset(buf.p, 0, max_bytes);
  const gpu::NvlinkAlgo algos[] = {
      gpu::NvlinkAlgo::kLowLatency, gpu::NvlinkAlgo::kLowLatencyTwoShot,
      gpu::NvlinkAlgo::kOneShot,    gpu::NvlinkAlgo::kTwoShot,
      gpu::NvlinkAlgo::kPush,       gpu::NvlinkAlgo::kAuto};
  constexpr int kTimed = static_cast<int>(std::size(algos));
  if (me == 0) {
    int dev = 0;
    (void)cudaGetDevice(&dev);
    cudaDeviceProp prop{};
    (void)cudaGetDeviceProperties(&prop, dev);
    int nv_version = 0;
    if (o.nccl) (void)ncclGetVersion(&nv_version);
    fmt::print(
        "# all-reduce bf16 sum, {} ranks on {}, CUDA graph of {} calls replayed up to {} "
        "times (fewer for large sizes); NCCL {}; low-latency up to {} bytes\n",
        p, prop.name, o.graph_calls, o.iters, nv_version, o.low_latency_max);
    std::string table;
    for (const auto& [upto, algo] : nv.table())
      table += fmt::format(" {} up to {},", gpu::nvlink_algo_name(algo), upto);
    fmt::print("# auto: {}\n", table.empty() ? std::string(" the thresholds (--no-tune)")
                                             : table.substr(0, table.size() - 1) + ", and beyond");
    fmt::print("{:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>11} {:>11}\n", "bytes",
               "ll us", "ll2 us", "1shot us", "2shot us", "push us", "auto us", "nccl us", "ratio",
               "auto GB/s", "nccl GB/s");
  }
  int rc = 0;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes && rc == 0;
       bytes = static_cast<std::size_t>(std::ceil(static_cast<double>(bytes) * o.factor))) {
    const std::size_t count = bytes / 2;
    const int iters = static_cast<int>(std::clamp<double>(
        o.iters * (static_cast<double>(std::size_t{1} << 20) / static_cast<double>(bytes)), 5,
        o.iters));
    double t[kTimed];
    std::fill(std::begin(t), std::end(t), NAN);
    Status st = Status::ok();
    for (int k = 0; k < kTimed && st; ++k) {
      if (gpu::low_latency(algos[k]) && bytes > nv.low_latency_limit(algos[k])) continue;
      auto r = time_graph(s, o.graph_calls, iters, [&] {
        return nv.all_reduce(buf.p, out.p, count, DataType::kBF16, RedOp::kSum, s, algos[k]);
      });
      st = r ? nv.synchronize() : r.status();
      if (st) t[k] = *r;
    }
    double theirs = NAN;
    if (st && o.nccl) {
      auto r = time_graph(s, o.graph_calls, iters, [&] {
        return nccl_status(ncclAllReduce(buf.p, out.p, count, ncclBfloat16, ncclSum, nc, s),
                           "ncclAllReduce");
      });
      if (r)
        theirs = *r;
      else
        st = r.status();
    }
    if (!st) {
      fmt::print(stderr, "rank {}: {} bytes: {}\n", me, bytes, st.to_string());
      rc = 1;
      break;
    }
    const double bus = 2.0 * (p - 1) / p * static_cast<double>(bytes);
    if (me == 0)
      fmt::print(
          "{:>10} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>7.2f} "
          "{:>11.1f} {:>11.1f}\n",
          bytes, t[0] * 1e6, t[1] * 1e6, t[2] * 1e6, t[3] * 1e6, t[4] * 1e6, t[5] * 1e6,
          theirs * 1e6, t[5] / theirs, bus / t[5] / 1e9, bus / theirs / 1e9);
  }
  if (nc) (void)ncclCommDestroy(nc);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "r2ccl-gpu-perf: the NVLink all-reduce on the GPUs of one node, checked and timed "
      "beside NCCL"};
  app.add_flag("--check", o.check, "every type x reduction x algorithm x size, checked");
  app.add_flag("--bench", o.bench, "bf16 sum latency and bus bandwidth beside NCCL");
  app.add_option("-b,--min-bytes", o.min_bytes, "smallest size (--bench)");
  app.add_option("-e,--max-bytes", o.max_bytes, "largest size (--bench)");
  app.add_option("-f,--factor", o.factor, "size step (--bench)");
  app.add_option("--iters", o.iters, "graph replays per size (--bench)");
  app.add_option("--graph-calls", o.graph_calls, "calls captured in the graph (--bench)");
  app.add_option("--device", o.device, "GPU (default: the rank modulo the GPU count)");
  app.add_option("--low-latency-max", o.low_latency,
                 "low-latency kernel up to this size (--bench)");
  app.add_option("--nccl-min", o.nccl_min, "auto: NCCL from this size, 0 never (--bench)");
  app.add_option("--one-shot-max", o.one_shot,
                 "auto: one-shot up to this size, 0 by rank count (--bench)");
  app.add_option("--blocks", o.blocks, "thread blocks of the staged kernels");
  app.add_option("--low-latency-blocks", o.low_latency_blocks,
                 "thread blocks of the low-latency kernels (with --share-gpu, the ranks' grids "
                 "must fit the GPU together: their kernels wait for each other)");
  app.add_flag("!--no-nccl", o.nccl, "leave NCCL out (--bench)");
  app.add_flag("!--no-tune", o.tune,
               "auto: the thresholds (--low-latency-max, --one-shot-max, --nccl-min) instead of "
               "the table measured when the communicator is made (--bench)");
  app.add_flag("--share-gpu", o.share_gpu,
               "let ranks share a GPU (kernels checked on fewer GPUs than ranks; slow, no NCCL)");
  CLI11_PARSE(app, argc, argv);
  if (!o.check && !o.bench) {
    fmt::print(stderr, "r2ccl-gpu-perf: say --check, --bench or both\n");
    return 2;
  }
  auto minb = r2ccl::parse_size(o.min_bytes), maxb = r2ccl::parse_size(o.max_bytes);
  const gpu::NodeComm::Options defaults;
  auto size_or = [](const std::string& text, std::size_t fallback) {
    return text == "default" ? r2ccl::Result<std::size_t>(fallback) : r2ccl::parse_size(text);
  };
  auto llmax = size_or(o.low_latency, defaults.low_latency_max);
  auto oneshot = size_or(o.one_shot, defaults.one_shot_max);
  auto ncclmin = size_or(o.nccl_min, defaults.nccl_min_bytes);
  if (llmax) o.low_latency_max = *llmax;
  if (!minb || !maxb || !llmax || !oneshot || !ncclmin || *minb < 2 || *maxb < *minb ||
      o.factor <= 1 || o.iters < 1 || o.graph_calls < 1) {
    fmt::print(stderr,
               "r2ccl-gpu-perf: bad sizes or counts (-b {} -e {} -f {} --iters {} "
               "--graph-calls {})\n",
               o.min_bytes, o.max_bytes, o.factor, o.iters, o.graph_calls);
    return 2;
  }
  if (Status st = gpu::available(); !st) {
    fmt::print(stderr, "r2ccl-gpu-perf: {}\n", st.message());
    return 77;
  }
  auto host = Communicator::from_env();
  if (!host) {
    fmt::print(stderr, "r2ccl-gpu-perf: {}\n", host.status().to_string());
    return 2;
  }
  int ndev = 0;
  (void)cudaGetDeviceCount(&ndev);
  const int device = o.device >= 0 ? o.device : (*host)->rank() % std::max(ndev, 1);
  (void)cudaSetDevice(device);
  cudaStream_t s = nullptr;
  (void)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int rc = 0;
  if (o.check) {
    gpu::NodeComm::Options small;
    small.staging_bytes = std::size_t{256} << 10;  // so that the largest case takes several chunks
    small.low_latency_max = std::size_t{64} << 10;
    small.nccl_min_bytes = std::size_t{1} << 40;  // forced only
    small.tune = false;
    small.share_gpu = o.share_gpu;
    small.blocks = o.blocks;
    small.low_latency_blocks = o.low_latency_blocks;
    auto nv = gpu::NodeComm::create(**host, device, small);
    if (!nv) {
      fmt::print(stderr, "r2ccl-gpu-perf: rank {}: {}\n", (*host)->rank(), nv.status().to_string());
      return 1;
    }
    gpu::NodeComm::Options all_nccl = small;
    all_nccl.nccl_min_bytes = 1;
    auto nc = gpu::NodeComm::create(**host, device, all_nccl);
    if (!nc) {
      fmt::print(stderr, "r2ccl-gpu-perf: rank {}: {}\n", (*host)->rank(), nc.status().to_string());
      return 1;
    }
    rc = check(**host, **nv, (*nc)->has_nccl() ? nc->get() : nullptr, s);
    if (Status st = (*nc)->close(); !st) rc = 1;
    if (Status st = (*nv)->close(); !st) rc = 1;
  }
  if (o.bench && rc == 0) {
    gpu::NodeComm::Options opts;
    opts.low_latency_max = *llmax;
    opts.one_shot_max = *oneshot;
    opts.blocks = o.blocks;
    opts.low_latency_blocks = o.low_latency_blocks;
    opts.nccl_min_bytes = *ncclmin;
    opts.tune = o.tune;
    opts.share_gpu = o.share_gpu;
    auto nv = gpu::NodeComm::create(**host, device, opts);
    if (!nv) {
      fmt::print(stderr, "r2ccl-gpu-perf: rank {}: {}\n", (*host)->rank(), nv.status().to_string());
      return 1;
    }
    rc = bench(**host, **nv, s, o, *minb, *maxb);
    if (Status st = (*nv)->close(); !st) rc = 1;
  }
  (void)cudaStreamDestroy(s);
  return rc;
}

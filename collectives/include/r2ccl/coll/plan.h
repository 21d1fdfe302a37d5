// Collectives as plans (DESIGN.md): an algorithm turns (operation, world size, this rank, message
// size) into a list of phases. A phase's communication steps are posted together and all complete
// before its compute steps (reduce, copy) run. Plans name buffers and peers only — never rails,
// sockets or registrations — so the executor runs them on the fabric and a simulator can run the
// same plans on a cost model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/op.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll {

enum class CollOp : std::uint8_t {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kReduce,
  kBarrier,
};
std::string_view coll_op_name(CollOp op);

// kBalance, kR2cc and kWeighted are the all-reduce plans for ranks of unequal bandwidth
// (degraded.h); kBalance is the ring, named apart so that a degraded-mode choice shows.
enum class Algo : std::uint8_t { kAuto, kRing, kOneShot, kTwoShot, kBalance, kR2cc, kWeighted };
std::string_view algo_name(Algo a);
// auto ring oneshot twoshot balance r2cc weighted
Result<Algo> parse_algo(std::string_view text);
bool is_degraded_algo(Algo a);

// Where a step reads or writes: the caller's send or receive buffer, or the plan's scratch space.
enum class Buf : std::uint8_t { kSend, kRecv, kScratch };
struct Ref {
  Buf buf = Buf::kSend;
  std::size_t offset = 0;  // bytes
};

struct Step {
  enum class Kind : std::uint8_t {
    kSend,    // bytes from `a` to `peer`
    kRecv,    // bytes from `peer` into `dst`
    kReduce,  // dst = a op b, element-wise over bytes / element size
    kCopy,    // dst = a
    kAvg,     // dst /= world size (the end of an avg)
  };
  Kind kind = Kind::kCopy;
  int peer = -1;
  Ref a, b, dst;
  std::size_t bytes = 0;
  // The rails (bit i: rail i) a send may use; its chunks go elsewhere only when none of them is
  // left. R2CC-AllReduce keeps its rings on separate rails.
  std::uint64_t rails = kAllRails;
  static constexpr std::uint64_t kAllRails = r2ccl::kAllRails;
};

// Phases of one lane run one after the other; lanes run side by side (a rank may, say, all-reduce
// one part of the data among all ranks while it all-reduces another among a subset). Messages
// between a pair of ranks are still matched in plan order: the executor posts a phase only once
// every earlier step (in plan order) to or from the same peer in the same direction was posted.
struct Phase {
  std::uint32_t lane = 0;
  // Waits for every phase before it in plan order, of every lane (where lanes meet again).
  bool join = false;
  std::vector<Step> comm;     // posted together (receives first), then all awaited
  std::vector<Step> compute;  // after every communication step of the phase completed
};

struct Plan {
  Algo algo = Algo::kRing;
  std::uint32_t lanes = 1;
  std::size_t scratch_bytes = 0;
  std::vector<Phase> phases;
};

// What an operation asks for. `count` is the element count of the operation as NCCL counts it
// (per rank for all-gather's send and reduce-scatter's receive buffer).
struct CollDesc {
  CollOp op = CollOp::kAllReduce;
  std::size_t count = 0;
  DataType type = DataType::kF32;
  RedOp redop = RedOp::kSum;
  int root = 0;
  bool in_place = false;  // the send data lies where this rank's part of the result goes
  bool operator==(const CollDesc&) const = default;
};

// The algorithm `auto` picks for this operation and size. `eager_bytes`: with two ranks, the
// largest message that goes between them without a handshake (the transport's eager limit), or 0
// when not known. Every rank must pass the same value (two ranks share their one channel's).
Algo choose_algo(const CollDesc& d, int nranks, Algo requested, std::size_t eager_bytes = 0);
struct Network;  // degraded.h

// The plan of rank `rank` of `nranks`. Every rank's plan pairs with every other's: the n-th send
// from a to b in plan order meets the n-th receive at b from a. The degraded-mode algorithms
// (all-reduce only) need `net`, the ranks' agreed bandwidths; every rank must pass the same.
Result<Plan> make_plan(const CollDesc& d, int rank, int nranks, Algo algo,
                       const Network* net = nullptr);

// Bytes each rank must provide in its send and receive buffers.
std::size_t send_bytes(const CollDesc& d, int nranks);
std::size_t recv_bytes(const CollDesc& d, int nranks);

// Messages up to this many bytes per rank use the direct one-shot algorithm under `auto`
// (measured on loopback and on the testbed: below it one round of messages beats the ring's
// 2(p-1) rounds; at 64 KiB the ring is 30% faster on loopback and 5% slower on the shaped
// testbed).
inline constexpr std::size_t kDirectThreshold = 32 * 1024;
// With two ranks, all-reduces up to this many bytes may take one-shot above kDirectThreshold too
// (see choose_algo). At 1 MiB one-shot took 0.7-0.95x the ring's time on the shaped testbed and
// about the same on loopback; at 2 MiB the two were alike on both.
inline constexpr std::size_t kTwoRankDirectMax = 1024 * 1024;

}  // namespace r2ccl::coll

// The pieces plans are made of, shared by the plan builders (plan.cc, degraded.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "r2ccl/coll/plan.h"

namespace r2ccl::coll::plan_steps {

using Kind = Step::Kind;

inline int mod(int a, int p) {
  return ((a % p) + p) % p;
}

// Splits `count` elements into p segments of near-equal size (the first count % p get one more).
struct Segments {
  std::size_t count, elem;
  int p;
  std::size_t first(int i) const {
    const std::size_t base = count / static_cast<std::size_t>(p);
    const std::size_t rem = count % static_cast<std::size_t>(p);
    const auto u = static_cast<std::size_t>(i);
    return u * base + std::min(u, rem);
  }
  std::size_t off(int i) const { return first(i) * elem; }
  std::size_t len(int i) const { return (first(i + 1) - first(i)) * elem; }
  std::size_t max_len() const { return len(0); }
};

inline Ref at(Buf b, std::size_t off) {
  return Ref{b, off};
}
inline Step send(int peer, Ref a, std::size_t n, std::uint64_t rails) {
  return Step{Kind::kSend, peer, a, {}, {}, n, rails};
}
inline Step send(int peer, Ref a, std::size_t n) {
  return Step{Kind::kSend, peer, a, {}, {}, n, Step::kAllRails};
}
inline Step recv(int peer, Ref dst, std::size_t n) {
  return Step{Kind::kRecv, peer, {}, {}, dst, n, Step::kAllRails};
}
inline Step reduce(Ref dst, Ref a, Ref b, std::size_t n) {
  return Step{Kind::kReduce, -1, a, b, dst, n, Step::kAllRails};
}
inline Step copy(Ref dst, Ref a, std::size_t n) {
  return Step{Kind::kCopy, -1, a, {}, dst, n, Step::kAllRails};
}
inline Step avg(Ref dst, std::size_t n) {
  return Step{Kind::kAvg, -1, {}, {}, dst, n, Step::kAllRails};
}

// Reduces the p inputs of one block in rank order (so every rank computes bit-identical floats)
// into `dst`: input(i) says where rank i's contribution lies.
template <class Input>
void chain(std::vector<Step>& out, int p, Ref dst, std::size_t n, Input input, bool average) {
  if (p == 1) {
    if (dst.buf != input(0).buf || dst.offset != input(0).offset)
      out.push_back(copy(dst, input(0), n));
  } else {
    out.push_back(reduce(dst, input(0), input(1), n));
    for (int i = 2; i < p; ++i)
      out.push_back(reduce(dst, dst, input(i), n));
  }
  if (average) out.push_back(avg(dst, n));
}

// A ring all-reduce of elements [first, first + count) among `members` (ranks in ring order; this
// rank is members[me]), its phases in `lane`, its scratch at `scratch_at` (it needs
// ring_scratch(...) bytes there). `average`: divide by the world size at the end (an avg whose
// every input is in this ring).
struct RingPart {
  const std::vector<int>& members;
  int me;
  std::size_t first, count;
  std::uint32_t lane;
  std::size_t scratch_at;
  bool average;
  std::uint64_t rails;  // the rails its messages may use
};
void ring_allreduce(Plan& plan, std::size_t elem, const RingPart& part);
inline std::size_t ring_scratch(std::size_t count, std::size_t elem, int members) {
  return Segments{count, elem, members}.max_len();
}

// The R2CC-AllReduce and weighted plans (degraded.cc); `net` null: every rank equally fast.
Plan degraded_allreduce(const CollDesc& d, int r, int p, std::size_t elem, Algo algo,
                        const Network* net);

}  // namespace r2ccl::coll::plan_steps

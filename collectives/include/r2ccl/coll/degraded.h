// Degraded mode: all-reduce when the ranks' bandwidths differ (a rank lost NICs, or one is slow).
//
// A plain ring runs at the slowest rank's speed for everyone. Three plans (make_plan with
// Algo::kBalance, kR2cc, kWeighted and the agreed Network) and their cost model:
//
// - Balance: the ring, each rank's traffic spread over its surviving rails by their measured
//   bandwidth (what the channel's striping does). T = 2(p-1)/p * N / b_min.
// - R2CC-AllReduce (R²CCL): the slowest rank d keeps a fraction beta of the others' bandwidth.
//   The first (1-X) of the data (X = 1-beta) is ring-all-reduced among all ranks while the
//   healthy ranks ring-all-reduce the tail X among themselves on the bandwidth the first ring
//   leaves them; then d sends its tail, in K pipelined chunks, to the healthy ranks (a piece to
//   each), which add it and send the sums back to d and to each other.
//   T = max(T_main, T_tail) + (1 + 1/K) X N / (beta B).
// - Weighted (r2ccl's own): a direct reduce-scatter and all-gather in which each rank owns a
//   shard sized so that its traffic, (1 + (p-2) s_i) N each way, is in proportion to its
//   bandwidth (a rank too slow for that owns none), pipelined in C chunks: the reduce-scatter of
//   chunk k runs beside the all-gather of chunk k-1, so no rank's link idles. It reaches the
//   lower bound T_LB = max(N / b_min, 2(p-1) N / sum b) (OptCC's, for any number of slow ranks)
//   up to the pipeline's fill, 1/C.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "r2ccl/coll/plan.h"

namespace r2ccl::coll {

// What the ranks agreed on: how fast each sends and receives, and a message's fixed cost.
struct Network {
  std::vector<double> bandwidth;  // bytes per second, per rank (all its rails together)
  double latency_s = 0;           // per message (a round of messages sent side by side)
  // Per rank, its usable rails (bit i: rail i); empty when not known. R2CC-AllReduce puts the
  // healthy ranks' tail on the rails the degraded rank lost.
  std::vector<std::uint64_t> rails_up;
};

// A rank is degraded below this fraction of the fastest rank's bandwidth.
inline constexpr double kDegradedBelow = 0.95;
bool is_degraded(const Network& net);

// The ranks' bandwidths as the agreement settles them, the same on every rank: rates per usable
// rail within 30% of the (lower) median rank's, or above it, count as the median's (measured rates
// wander with the traffic pattern; only a rank well under the others is degraded), a rank's
// bandwidth is its rate times its usable rails (so a lost NIC shows exactly), and within 10% of the
// fastest counts as the fastest, below that in steps of 1/32.
std::vector<double> settle_bandwidths(const std::vector<double>& measured,
                                      const std::vector<std::uint64_t>& rails);

// The fraction of the data each rank owns in the weighted plan (sums to 1).
std::vector<double> weighted_shares(const std::vector<double>& bandwidth);

// The all-reduce's lower bound on `net` (N = the message's bytes).
double lower_bound_seconds(const CollDesc& d, const Network& net);
// What the plan of `algo` takes on `net` by the cost model (all-reduce; kRing = kBalance).
double predict_seconds(Algo algo, const CollDesc& d, const Network& net);
// The degraded-mode algorithm the cost model says is fastest for `d` on `net`.
Algo choose_degraded(const CollDesc& d, const Network& net);

// An all-reduce over nodes of `gpus` ranks each (rank = node * gpus + local): a direct
// reduce-scatter inside the node (each local rank then owns 1/gpus of the data), the all-reduce of
// `algo` across nodes among the ranks of the same local index (its rails' traffic), and a direct
// all-gather inside the node. `net`: per rank, as make_plan's.
Result<Plan> make_hierarchical_plan(const CollDesc& d, int rank, int nodes, int gpus, Algo algo,
                                    const Network* net);
// Its cost by the model: the two steps inside the node at `intra_bps`, the one across nodes by
// predict_seconds on the slowest local index's ranks.
double predict_hierarchical_seconds(Algo algo, const CollDesc& d, int nodes, int gpus,
                                    const Network& net, double intra_bps);
// Whether every rank's hierarchical plan is its node's local rank 0's turned by its local index
// (the same phases and sizes, each peer (node m, local q) becoming (m, q + local mod gpus)): so
// where every local index has equal shards (gpus divides d.count) and sees the same table.
bool hierarchical_plans_rotate(const CollDesc& d, int nodes, int gpus, const Network* net);

// From this many ranks the weighted plan takes the form of a grid: the ranks at full speed
// (within kDegradedBelow of the fastest) in about sqrt(n) rows of sqrt(n), each chunk
// reduce-scattered along the rows, all-reduced down the columns and all-gathered along the rows,
// a stage per phase; a slower rank owns nothing, sends its data to the owners of its pieces and
// receives the result. Each rank sends about 2(rows + columns) messages a chunk instead of 2n.
inline constexpr int kWeightedGridFrom = 65;
// That form's plan for any number of ranks (make_plan takes it from kWeightedGridFrom).
Result<Plan> make_weighted_grid_plan(const CollDesc& d, int rank, int nranks, const Network& net);

// From this many ranks R2CC-AllReduce's healthy ranks share the exchange's sums along rows of
// about sqrt(n) and then across the rows (2 sqrt(n) messages a chunk each instead of n), at the
// cost of one more step of the exchange's pipeline.
inline constexpr int kR2ccGridFrom = 65;

// The pipeline depth of each plan for `d` on `net` (chunks; 1 = not pipelined), chosen to
// balance the fill (1/C of the transfer time) against C messages' latency.
int weighted_chunks(const CollDesc& d, const Network& net);
int r2cc_chunks(const CollDesc& d, const Network& net);

}  // namespace r2ccl::coll

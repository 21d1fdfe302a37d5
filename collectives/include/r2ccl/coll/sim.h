// The simulator's engine: runs every rank's plan (the same Plan objects the executor runs) on a
// fluid model of the network, and says when each rank finishes.
//
// The model: every rank has rails (NICs or its share of them), each a port out and a port in
// (and, where ranks share a node, another pair for traffic inside the node). A message starts
// once both sides posted it (the sender's phase and the receiver's phase began), plus the
// latency, and moves over every rail up at both ends that its step allows (the channel's
// striping; any rail up at both ends if none of those is). Each (sender, receiver, rail) shares
// its two ports max-min fairly with the others, the messages on it share it equally (the channel
// serves them round-robin), and the rates are recomputed whenever a message starts or ends.
// The executor's rules hold: phases of a lane run in order, lanes side by side, and a phase waits
// until every earlier message (in plan order) to or from the same peer was posted. A plan that
// would hang the executor (a message nobody receives, sizes that differ) is an error here too.
#pragma once

#include <cstdint>
#include <vector>

#include "r2ccl/coll/degraded.h"
#include "r2ccl/coll/plan.h"

namespace r2ccl::coll {

struct SimNetwork {
  std::vector<std::vector<double>> rail_bps;  // [rank][rail] bytes per second each way; 0: down
  std::vector<int> node;                      // per rank; empty: every rank on a node of its own
  double intra_bps = 0;                       // per rank and direction inside a node
  double latency_s = 0;                       // before a message's first byte moves
  double reduce_bps = 0;                      // reductions and copies; 0: free
};

struct SimResult {
  double seconds = 0;          // when the last rank finished
  std::vector<double> finish;  // per rank
  std::uint64_t messages = 0;
  double bytes = 0;  // over the NICs and inside nodes
  int folded = 1;    // ranks each simulated rank stood for (simulate(Cluster) with fold)
};

Result<SimResult> simulate(const std::vector<Plan>& plans, const SimNetwork& net);

// A cluster to simulate: nodes x GPUs (a rank each); a node's NICs are shared by its GPUs, rail i
// of every rank being NIC i of its node (the channel spreads a rank's traffic over them). Some
// nodes lost their last `lost_nics` NICs, or (shaped) run every NIC at `slow` of its speed.
struct Cluster {
  int nodes = 8, gpus = 1, nics = 8;
  double nic_bps = 50e9;  // bytes per second per NIC and direction
  double intra_bps = 0;   // inside a node, per GPU and direction (0: over the NICs)
  double latency_s = 0;
  std::vector<int> failed;  // nodes
  int lost_nics = 0;
  bool shaped = false;
  double slow = 1;
  int ranks() const { return nodes * gpus; }
  SimNetwork sim_network() const;
  // What the ranks would agree on in degraded mode (bandwidths, rails up, latency).
  Network network() const;
};

// Every rank's plan of `algo` for `d` on `c` (with c.network(); hierarchical where nodes have
// several ranks), run on c.sim_network().
// `plan_net`: the table the plans are made from, where it differs from c.network() (what a real
// job's ranks agreed on, to predict that job's own schedule).
// `fold`: where every rank of a node runs its local rank 0's plan turned by its local index
// (hierarchical_plans_rotate) on the same rails, only local rank 0 is simulated and the node's
// other ranks take its times (the max-min rates keep that symmetry, so they are the times the
// whole job's simulation gives, to rounding); SimResult::folded says whether it was.
Result<SimResult> simulate(const Cluster& c, const CollDesc& d, Algo algo,
                           const Network* plan_net = nullptr, bool fold = true);

}  // namespace r2ccl::coll

// Collectives over nodes of several ranks each, in two levels: a communicator inside the node
// (NVLink for GPUs) and one across nodes per local index (the rails), each call of the whole made
// of calls of the two, on one stream, with no copy of its own:
//   all-reduce      reduce-scatter inside, all-reduce of its part across, all-gather inside
//   all-gather      each rank's block to the same local index of every other node (point to
//                   point across, one pair of nodes per round), then an all-gather inside per
//                   node's blocks, in place
//   reduce-scatter  a reduce-scatter inside per node's blocks into scratch, then a
//                   reduce-scatter of those across
//   broadcast       across among the root's local index, then inside every node from it
//   reduce          inside every node to the root's local index, then across to the root
// So every byte crosses the network once per node pair rather than once per rank pair of a flat
// ring, and the GPUs' own links carry the rest. The ranks must be numbered node by node
// (rank = node * per_node + local), as torchrun, mpirun and vLLM number them; the caller checks
// that (TwoLevel::blocked) and goes flat otherwise. An average is not split in levels (each
// level would divide by its own size): the caller goes flat for it.
//
// Nothing here knows CUDA: DeviceComm (device_comm.h) runs it over NodeComm and StagedComm,
// and the tests over host communicators.
#pragma once

#include <cstddef>
#include <vector>

#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll {

// One level's communicator: the calls of NCCL's collectives on `stream` (the caller's device
// stream, or null where the level ignores it).
class Level {
 public:
  virtual ~Level() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Status all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                            RedOp op, void* stream) = 0;
  // recv holds size() blocks of count; in place when send == recv + rank() * count.
  virtual Status all_gather(const void* send, void* recv, std::size_t count, DataType type,
                            void* stream) = 0;
  virtual Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                                RedOp op, void* stream) = 0;
  // In place (send == recv) on the root.
  virtual Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                           void* stream) = 0;
  // In place (send == recv) on the root; recv is not touched elsewhere.
  virtual Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                        int root, void* stream) = 0;
  virtual Status send(const void* buf, std::size_t count, DataType type, int peer,
                      void* stream) = 0;
  virtual Status recv(void* buf, std::size_t count, DataType type, int peer, void* stream) = 0;
  virtual Status group_start() = 0;
  virtual Status group_end() = 0;
};

// Memory of the kind the levels move, ordered on the stream: what a reduce-scatter or a reduce
// holds between its levels. release() comes after the calls that use the memory are enqueued.
class Scratch {
 public:
  virtual ~Scratch() = default;
  virtual Result<void*> acquire(std::size_t bytes, void* stream) = 0;
  virtual Status release(void* p, void* stream) = 0;
};

class TwoLevel {
 public:
  // `inside`: this node's ranks, rank = local index; `across`: the ranks of this local index,
  // rank = node. Both outlive this.
  TwoLevel(Level& inside, Level& across, Scratch& scratch)
      : inside_(inside), across_(across), scratch_(scratch) {}

  int nodes() const { return across_.size(); }
  int per_node() const { return inside_.size(); }
  int rank() const { return across_.rank() * inside_.size() + inside_.rank(); }

  // Whether ranks numbered `ranks` (rank r on node node_of[r], local index local_of[r]) are
  // numbered node by node with per_node ranks each.
  static bool blocked(const std::vector<int>& node_of, const std::vector<int>& local_of,
                      int per_node);

  // As NCCL's calls of the same names, over every rank of both levels. all_reduce needs count to
  // be a multiple of per_node() (the caller goes flat otherwise).
  Status all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                    void* stream);
  Status all_gather(const void* send, void* recv, std::size_t count, DataType type, void* stream);
  Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                        RedOp op, void* stream);
  Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                   void* stream);
  Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op, int root,
                void* stream);

 private:
  Status check_root(int root, const char* what) const;
  Level& inside_;
  Level& across_;
  Scratch& scratch_;
};

}  // namespace r2ccl::coll

// The GPU side of a communicator (coll/comm.h): device memory among the GPUs of one node (NVLink
// through CUDA IPC, NCCL where it is faster and for point to point; coll/gpu/node_comm.h), or,
// where the ranks span nodes (R2CCL_GPU_PATH), over the rails with the data staged through pinned
// host memory on the caller's stream (coll/staged.h), in two levels (coll/two_level.h) where the
// nodes hold several GPUs each. No CUDA type appears here, so that its users compile the same with
// and without CUDA: src/gpu/device_comm.cc serves it where the build has CUDA, and
// src/device_comm_none.cc says that it has none.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll {

// 1 where this library can move device memory: built with CUDA, and a device can be used.
bool cuda_supported();

// Where a call's buffers are: -1 for host memory, else the device of the first buffer in device
// memory. A stream with host buffers, or buffers of both kinds, is an error naming them. Null
// buffers are not looked at (a reduce's receive buffer off the root).
Result<int> buffers_device(std::initializer_list<const void*> buffers, void* stream,
                           const char* what);

class DeviceComm {
 public:
  DeviceComm();
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  // Sets up the GPU side on `device` (the NVLink buffers, the IPC handles, NCCL; or the staged
  // path's communicator, staging and progress thread where the ranks span nodes): a collective
  // over `host`. Done by the first call on device memory where not called before; never while
  // `stream` is being captured into a CUDA graph.
  Status bind(Communicator& host, int device, void* stream, const char* what);
  bool bound() const;

  Status all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                    void* stream);
  Status all_gather(const void* send, void* recv, std::size_t count, DataType type, void* stream);
  Status reduce_scatter(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                        void* stream);
  Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                   void* stream);
  Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op, int root,
                void* stream);
  Status send(const void* buf, std::size_t count, DataType type, int peer, void* stream);
  Status recv(void* buf, std::size_t count, DataType type, int peer, void* stream);
  Status group_start();
  Status group_end();
  // Waits for `stream` (a barrier's device side); refused while the stream is being captured.
  Status synchronize(void* stream);
  // Why the GPU side cannot be used any more (an abort here or on another rank, the host side's
  // failure), or OK; OK where it was never set up. No synchronisation.
  Status error() const;
  // Fails the GPU side at once (every rank's calls give up and later ones are refused).
  void abort(const std::string& why);
  // Closes the GPU side: a collective, like bind (node_comm.h, NodeComm::close). Calls after it are
  // refused; the destructor frees what is left.
  Status close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace r2ccl::coll

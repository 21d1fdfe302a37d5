// One communicator for host and device memory, as NCCL's: each call runs on the host
// communicator where its buffers are host memory (and `stream` is null), or on the GPU side where
// they are device memory, queued on `stream` (NVLink inside a node, the rails across nodes:
// device_comm.h). The GPU side is set up by the first call on device memory (a collective: every
// rank makes it), or by bind_device(). The C ABI (r2ccl.h) is a thin wrapper of this class.
//
// Threading: as Communicator, one call at a time.
#pragma once

#include <initializer_list>
#include <memory>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/coll/device_comm.h"

namespace r2ccl::coll {

class Comm {
 public:
  explicit Comm(std::unique_ptr<Communicator> host);
  // The GPU side goes first (it uses the host communicator), freeing what is left without a
  // collective: call close_device() first for the collective teardown.
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  Communicator& host() { return *host_; }
  const Communicator& host() const { return *host_; }
  DeviceComm& device() { return device_; }
  int rank() const { return host_->rank(); }
  int size() const { return host_->size(); }

  // Where a call on `buffers` runs: -1 on the host, else the device of its buffers, with the
  // GPU side set up (the first such call does it on every rank). Errors name `what`.
  Result<int> place(std::initializer_list<const void*> buffers, void* stream, const char* what);
  // Sets up the GPU side on `device` now (a collective), instead of at the first device call.
  Status bind_device(int device);

  Status all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                    void* stream = nullptr);
  Status all_gather(const void* send, void* recv, std::size_t count, DataType type,
                    void* stream = nullptr);
  Status reduce_scatter(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                        void* stream = nullptr);
  Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                   void* stream = nullptr);
  Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op, int root,
                void* stream = nullptr);
  // Outside a group they run at once; inside one (group_start/group_end) they are queued and
  // run at group_end, the device ones as one group of the GPU side.
  Status send(const void* buf, std::size_t count, DataType type, int peer, void* stream = nullptr);
  Status recv(void* buf, std::size_t count, DataType type, int peer, void* stream = nullptr);
  Status group_start();
  Status group_end();
  // Every rank here; with a stream, once the work queued on it is done.
  Status barrier(void* stream = nullptr);

  // Why the communicator cannot be used any more (the host side's, else the GPU side's), or OK.
  Status error() const;
  // Fails both sides at once (every rank's calls give up, later ones are refused).
  void abort(const std::string& why);
  // Closes the GPU side (a collective); the host communicator stays usable.
  Status close_device();

 private:
  // Runs `host` or `device` by where the buffers are.
  template <typename Host, typename Device>
  Status run(std::initializer_list<const void*> buffers, void* stream, const char* what,
             Host&& host, Device&& device);
  // A point-to-point call: as run(), opening the host or GPU side's group inside one.
  template <typename Host, typename Device>
  Status run_p2p(const void* buffer, void* stream, const char* what, Host&& host, Device&& device);

  std::unique_ptr<Communicator> host_;
  DeviceComm device_;
  int group_depth_ = 0;
  bool group_host_ = false;    // the host communicator's group is open
  bool group_device_ = false;  // the GPU side's group is open
};

}  // namespace r2ccl::coll

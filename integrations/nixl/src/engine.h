// r2ccl as a NIXL backend: a nixlBackendEngine over one r2ccl endpoint per NIXL agent.
//
// NIXL's descriptors are byte ranges inside registered regions, so the engine sits on the
// endpoint's registered memory and one-sided writes (striped over every rail, replayed on a
// surviving rail after a fence) rather than on the KV engine's block pools.
//
// - Connection info: the endpoint's blob (every rail's address, incarnation, token), published
//   once; rail addresses stay valid across link flaps. The channel to a peer opens on first use.
// - WRITE: one endpoint write per descriptor; once every write is confirmed in the peer's memory,
//   the notification (when asked for) follows as a message, delivered exactly once.
// - READ: a read request (in messages of at most 60 KiB) asks the peer's engine to write its
//   regions into this side's; the peer tells "done" once every byte is confirmed here, and
//   delivers the notification to its own agent at that moment.
// - Errors: a rail failure stays below checkXfer (in progress, then success on the surviving
//   rails); NIXL_ERR_REMOTE_DISCONNECT only when the peer's process left; no usable rail to the
//   peer past R2CCL_TIMEOUT gives NIXL_ERR_BACKEND naming the peer and every rail, and the peer
//   stays usable once a rail returns.
// - releaseReqH refuses (an error; NIXL keeps the request) while data may still move into or out
//   of the request's buffers, and never blocks.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend_engine.h"  // NIXL's (third_party/nixl-<version>)
#include "r2ccl/runtime/endpoint.h"
#ifdef R2CCL_WITH_METRICS
#include "r2ccl/monitor/job_metrics.h"
#endif

namespace r2ccl::nixl {

// The NIXL release whose headers this build used (third_party/nixl-<version>).
inline constexpr const char* kNixlVersion = R2CCL_NIXL_VERSION;

struct Xfer;
struct ReadJob;

class Engine final : public nixlBackendEngine {
 public:
  explicit Engine(const nixlBackendInitParams* params);
  ~Engine() override;
  // Why the engine could not start (NIXL only learns that it failed).
  const std::string& init_error() const { return init_error_; }

  bool supportsRemote() const override { return true; }
  bool supportsLocal() const override { return true; }
  bool supportsNotif() const override { return true; }
  nixl_mem_list_t getSupportedMems() const override;

  nixl_status_t registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                            nixlBackendMD*& out) override;
  nixl_status_t deregisterMem(nixlBackendMD* meta) override;
  nixl_status_t connect(const std::string& remote_agent) override;
  nixl_status_t disconnect(const std::string& remote_agent) override;
  nixl_status_t unloadMD(nixlBackendMD* input) override;
  nixl_status_t prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                         nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t postXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                         nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t checkXfer(nixlBackendReqH* handle) const override;
  nixl_status_t releaseReqH(nixlBackendReqH* handle) const override;
  nixl_status_t getPublicData(const nixlBackendMD* meta, std::string& str) const override;
  nixl_status_t getConnInfo(std::string& str) const override;
  nixl_status_t loadRemoteConnInfo(const std::string& remote_agent,
                                   const std::string& remote_conn_info) override;
  nixl_status_t loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem,
                             const std::string& remote_agent, nixlBackendMD*& output) override;
  nixl_status_t loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) override;
  nixl_status_t getNotifs(notif_list_t& notif_list) override;
  nixl_status_t genNotif(const std::string& remote_agent, const std::string& msg) const override;

 private:
  struct Agent {
    Bytes blob;        // its connection info (endpoint blob)
    int peer = -1;     // the endpoint's id for it, once connected
    std::string left;  // its process left: why (posts fail with REMOTE_DISCONNECT)
  };
  struct Counters;

  // The endpoint's id of `agent`, connecting on first use (bounded by R2CCL_CONNECT_TIMEOUT).
  Result<int> peer_of(const std::string& agent) const;
  nixl_status_t post_local(Xfer& x, const nixl_opt_b_args_t* opt_args) const;
  nixl_status_t post_write(const std::shared_ptr<Xfer>& x, int peer) const;
  nixl_status_t post_read(const std::shared_ptr<Xfer>& x, int peer) const;
  // A write of `x` ended (progress thread, or the poster's on an immediate error).
  void write_done(const std::shared_ptr<Xfer>& x, std::uint64_t generation, const Status& st,
                  bool replayed) const;
  // Where the rails to `peer` stand: an error once none was usable for `limit`.
  Status health(Xfer& x, std::chrono::milliseconds limit) const;
  void push_notif(std::string agent, std::string msg) const;
  void on_message(int peer, Bytes payload);
  void on_read_request(int peer, ByteReader& r);
  void on_read_done(int peer, ByteReader& r);
  void on_notif(int peer, ByteReader& r);
  void on_peer_event(const Endpoint::PeerEvent& e);
  void read_job_step(int peer, std::uint64_t token, const Status& st, bool replayed,
                     bool chunk_seen);
  void finish(Xfer& x, nixl_status_t state, std::string error) const;

  Config config_;
  std::string init_error_;
  std::unique_ptr<Endpoint> endpoint_;
  int listener_ = -1;
  std::unique_ptr<Counters> counters_;
#ifdef R2CCL_WITH_METRICS
  std::unique_ptr<mon::JobMetrics> metrics_;  // when R2CCL_METRICS_PORT is set
#endif

  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, Agent> agents_;  // by NIXL agent name
  std::unordered_map<std::uint64_t, RegionPtr> regions_;   // this side's, by region id
  mutable std::unordered_map<std::uint64_t, std::weak_ptr<Xfer>> reads_;  // by token
  mutable std::uint64_t next_token_ = 1;
  std::map<std::pair<int, std::uint64_t>, std::unique_ptr<ReadJob>> jobs_;  // (peer, token)
  mutable std::vector<std::pair<std::string, std::string>> notifs_;
  mutable std::size_t notif_bytes_ = 0;
};

}  // namespace r2ccl::nixl

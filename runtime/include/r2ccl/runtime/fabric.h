// The fabric: a world of ranks over an endpoint (endpoint.h). It creates this rank's endpoint,
// exchanges the ranks' endpoint blobs through the bootstrap, and connects one rail per NIC pair
// to every other rank (rail i of rank a to rail i of rank b; the lower rank connects). Peer ids
// on the endpoint are the ranks. The bootstrap's control path also carries a copy of every
// failover message (it outlives the rails) and tells when a rank leaves.
//
// Messages are point-to-point and matched in order per (sender, receiver) pair, like NCCL's
// send/recv: the n-th isend from a to b pairs with the n-th irecv at b from a (counted within an
// epoch: set_epoch), and both must give the same length. The receiver announces its registered
// buffer (one control message); the sender then stripes the message over all usable rails in
// chunks with one-sided writes.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "r2ccl/runtime/bootstrap.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/op.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/telemetry.h"

namespace r2ccl {

class SelfChannel;
class OutOfBandSender;

// A job without a token (all-zero: R2CCL_BOOTSTRAP_TOKEN unset, rank 0 on loopback) keys its
// rails' handshakes with a key everyone knows, so it may run only where every rail is loopback
// too; insecure (R2CCL_INSECURE_NO_TOKEN=1) lets it run anyway. The error names the rails.
Status check_rails_need_no_token(const Token& token, const std::vector<EndpointInfo::Rail>& rails,
                                 bool insecure);

class Fabric {
 public:
  static Result<std::unique_ptr<Fabric>> create(const Config& config, const BootstrapOptions& boot);
  // Waits (a bounded time) until the messages already sent are confirmed, then closes.
  ~Fabric();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  int rank() const;
  int nranks() const;
  Bootstrap& bootstrap() { return *bootstrap_; }
  // This rank's endpoint (peer id = rank).
  Endpoint& endpoint() { return *endpoint_; }
  const Endpoint& endpoint() const { return *endpoint_; }
  const Config& config() const { return config_; }
  // This rank's rails (local NICs), in rail order.
  const std::vector<RailNic>& nics() const;
  std::size_t rails_to(int peer) const;
  // The largest message to `peer` that is sent eagerly (no clear-to-send first); 0 for itself.
  std::size_t eager_limit(int peer) const;

  // Registers memory on every rail. kRemoteWrite (receive buffers, one-sided write targets)
  // lets peers write into it; kLocal (send-only buffers) does not.
  Result<RegionPtr> register_memory(void* base, std::size_t length,
                                    MemoryAccess access = MemoryAccess::kRemoteWrite);
  // Deregisters at once, whatever is in flight: the tcp provider closes a rail whose data is
  // still landing in the region. Deregister only what no operation still uses.
  Status deregister_memory(const RegionPtr& region);
  // Regions registered now (this rank's, every user's).
  std::size_t registered_regions() const { return endpoint_->registered_regions(); }

  // Starts an epoch of every pair's messages (Endpoint::set_epoch): the collectives start one
  // per operation.
  void set_epoch(std::uint64_t epoch) { endpoint_->set_epoch(epoch); }
  // Sends [offset, offset+length) of a registered region to `peer`. `rails` (bit i: rail i):
  // the rails its chunks go on while any of them is usable (then any rail, so that nothing is
  // lost); the collectives keep two rings apart this way.
  Result<OpPtr> isend(int peer, const RegionPtr& region, std::size_t offset, std::size_t length,
                      std::uint64_t rails = kAllRails);
  // Receives the matching message from `peer` into [offset, offset+length) of a region.
  Result<OpPtr> irecv(int peer, const RegionPtr& region, std::size_t offset, std::size_t length);
  // One-sided: writes [offset, offset+length) of a local region into `remote` (a region the peer
  // registered and described to us) at `remote_offset`, striped over the rails, replayed on
  // failover. Completes once the peer confirmed every byte is in its memory.
  Result<OpPtr> iwrite(int peer, const RegionPtr& region, std::size_t offset,
                       const RemoteRegion& remote, std::size_t remote_offset, std::size_t length);
  // A small message (at most 64 KiB) to the peer's message handler: reliable, delivered once, in
  // order with everything else this rank sends on the control messages to that peer, and after
  // every iwrite to that peer that completed before it was sent.
  // With `control_path`, it goes through rank 0's relay, and a copy on the rails (the receiver
  // takes one, in the order sent): it arrives even when no rail to the peer is left, or while
  // the management network is silent (but not in order with the rail traffic). Sent from the
  // progress loop (a completion or a message handler), it is written by the out-of-band
  // sender's thread, so that the loop never waits on the relay: kUnavailable when that path is
  // gone or 256 messages wait for it.
  //
  // Messages are demultiplexed by service, each with its own handler, so that the KV engine and
  // the application (or the collectives) share the channels without taking each other's
  // messages. The service travels in the message's first byte.
  enum class Service : std::uint8_t { kApplication = 0, kKvTransfer = 1 };
  static constexpr std::size_t kServices = 2;  // the endpoint's other service is the world's
  Status send_message(int peer, Service service, Bytes payload, bool control_path = false);
  Status send_message(int peer, Bytes payload, bool control_path = false) {
    return send_message(peer, Service::kApplication, std::move(payload), control_path);
  }
  using MessageHandler = std::function<void(int peer, Bytes payload)>;
  // Runs on the progress thread; must not block. Null: the service's messages are dropped.
  void set_message_handler(Service service, MessageHandler handler);
  void set_message_handler(MessageHandler handler) {
    set_message_handler(Service::kApplication, std::move(handler));
  }

  // Waits for an operation: until it completes, or a grace period past its deadline (which moves
  // only while the peer keeps confirming data).
  Status wait(const OpPtr& op);
  // Waits until at least one of `ops` completed (the caller looks which); a timeout once all are
  // past their deadlines.
  Status wait_any(std::span<const OpPtr> ops);

  std::vector<RailSnapshot> rail_snapshot() const;
  ProviderCounters provider_counters() const;
  // The provider's ProviderCapability flags (the same provider serves every rail).
  std::uint32_t provider_capabilities() const;
  // Rail state changes with wall-clock times (failed, replay_started, readmitted, ...).
  std::vector<RailEvent> rail_events() const;
  // Every rail's live telemetry (plain atomics), for collectors that read it at scrape time.
  std::vector<RailTelemetryView> rail_telemetry() const;
  // How long rail failures took to detect.
  const LatencyHistogram& failover_detection() const { return endpoint_->failover_detection(); }
  // Where modules above the runtime publish their counters for the monitor.
  MetricRegistry& metrics() { return endpoint_->metrics(); }
  const MetricRegistry& metrics() const { return endpoint_->metrics(); }
  // The first asynchronous error: a peer left, or no rail to a peer survived an operation's
  // deadline. OK while none happened.
  Status async_error() const;
  // Fails every operation in flight and every later one with `why` (and records it as the
  // asynchronous error); the fabric stays safe to destroy. Not from the progress thread.
  void abort(const std::string& why);

 private:
  Fabric();
  Status connect_all(const std::vector<Bytes>& infos);
  Status check_peer(int peer, const char* what) const;
  void record_async_error(const Status& st);

  Config config_;
  std::unique_ptr<Endpoint> endpoint_;
  std::unique_ptr<Bootstrap> bootstrap_;
  std::unique_ptr<OutOfBandSender> out_of_band_;  // failover messages on the control path
  mutable std::mutex async_mutex_;
  Status async_error_;
  std::unique_ptr<SelfChannel> self_;  // messages to ourselves (memcpy)
};

}  // namespace r2ccl

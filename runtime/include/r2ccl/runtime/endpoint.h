// An endpoint: this process's rails on its NICs, and a multi-rail channel to every peer that it
// connected to or that connected to it. Peers come and go at any time; nothing here needs a world,
// a rank or a rendezvous.
//
// An endpoint describes itself in a small versioned blob (every rail's address, its probe port,
// its incarnation, and the token a peer must show). Anyone holding the blob connects to it; the
// endpoint learns who connected from the rails' hellos. A process that starts again is a new
// incarnation: the old one's peer id stays dead, and every operation towards it fails at once
// naming it. A compact form of the blob fits in 128 bytes (for an NCCL network plugin's handle).
//
// Operations are those of the fabric (fabric.h), addressed by peer id: point-to-point messages
// matched in order per pair, one-sided writes into a peer's registered memory, and small
// messages demultiplexed by service.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/op.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/telemetry.h"

namespace r2ccl {

// What an endpoint publishes about itself: decoded from its blob or its compact handle.
struct EndpointInfo {
  static constexpr std::uint32_t kMagic = 0x50453252;  // "R2EP"
  static constexpr std::uint16_t kVersion = 1;
  static constexpr std::size_t kMaxBlob = 2048;
  static constexpr std::size_t kHandleSize = 128;
  static constexpr std::size_t kMaxRails = 64;

  struct Rail {
    std::string nic;      // the NIC's name ("eth1", "mlx5_0"); its address in a handle
    std::string address;  // IPv4
    Bytes endpoint;       // the provider's endpoint of that NIC
    std::uint16_t probe_port = 0;
  };
  std::string name;  // chosen by its process: "decode-3", "host:pid"
  std::uint64_t incarnation = 0;
  std::string provider;        // "tcp", "verbs"
  std::optional<Token> token;  // what a peer shows in its hellos; absent in a hello's copy
  std::vector<Rail> rails;

  // A blob or a handle (told apart by their first bytes); an error says what was wrong.
  static Result<EndpointInfo> decode(std::span<const std::byte> bytes);
  Bytes encode(bool with_token) const;
  // The compact form (at most kHandleSize bytes): no names, at most 12 IPv4 rails.
  Result<Bytes> encode_handle() const;
  // How errors and logs name it: "peer 'decode-3' (incarnation 5f2c09a1e3b74d10)".
  std::string label() const;
};

// Hex text of a blob, for files, environment variables and command lines.
std::string blob_to_hex(std::span<const std::byte> blob);
Result<Bytes> blob_from_hex(std::string_view hex);

struct EndpointOptions {
  std::string name;            // empty: "<hostname>:<pid>"
  std::optional<Token> token;  // empty: a random one (published in the blob)
  // An address the rails must not use (the interface that carries a world's control path).
  std::string control_address;
  // How messages name this side ("rank 0"); empty: its name, quoted.
  std::string self_label;
  // Peers that connect by themselves are taken (false: only those added with add_peer).
  bool accept_new_peers = true;
  std::size_t max_peers = 1024;  // live peers; further connections are refused
};

class ProgressEngine;
class Channel;
class Prober;
class LinkWatcher;

class Endpoint {
 public:
  static Result<std::unique_ptr<Endpoint>> create(const Config& config, EndpointOptions options);
  // Says goodbye to its peers, waits (a bounded time) for the messages already sent to be
  // confirmed, then closes.
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  const EndpointInfo& info() const { return info_; }
  std::uint64_t incarnation() const { return info_.incarnation; }
  const std::string& name() const { return info_.name; }
  Bytes blob() const { return info_.encode(true); }
  Result<Bytes> handle() const { return info_.encode_handle(); }
  const Config& config() const { return config_; }
  const std::vector<RailNic>& nics() const;
  ProgressEngine& engine() { return *engine_; }

  // Connects a multi-rail channel to the endpoint a blob (or handle) describes and returns its
  // peer id once at least one rail is open; the other rails join as they open. Connecting to a
  // peer that is already connected returns its id.
  Result<int> connect(std::span<const std::byte> blob);
  // Says goodbye (after everything already sent), waits a bounded time for it to be confirmed,
  // and closes the channel; operations with the peer fail from now on.
  Status disconnect(int peer);

  struct PeerOptions {
    int id = -1;                // -1: the next free id
    bool connector = true;      // this side opens the rails (else it waits for the peer's)
    bool gone_on_close = true;  // see Channel::PeerIdentity
    std::string label;          // empty: EndpointInfo::label()
  };
  // Adds a peer without connecting yet (a world adds every rank, then connects).
  Result<int> add_peer(std::span<const std::byte> blob, const PeerOptions& options);
  // Opens the rails of every connector channel among `peers`.
  void connect_rails(const std::vector<int>& peers);
  // Waits until every one of `peers` has at least one rail (and the rails still opening had a
  // short grace), or fails naming those without; then rails that open later are reported
  // as joining.
  Status wait_rails(const std::vector<int>& peers, std::chrono::milliseconds timeout);

  struct PeerEvent {
    enum class Kind { kJoined, kLeft } kind;
    int peer;
    std::string label;
    std::string why;  // kLeft
  };
  // Peers that connected to this endpoint, and peers that left. Runs on the progress thread;
  // must not block.
  void set_peer_handler(std::function<void(const PeerEvent&)> handler);
  // The same events for a component that must not take the one handler above (the KV engine):
  // every listener hears them, after the handler. Runs on the progress thread; must not block.
  // Once remove_peer_listener returns, the listener is not called again.
  int add_peer_listener(std::function<void(const PeerEvent&)> listener);
  void remove_peer_listener(int id);
  struct PeerSummary {
    int id;
    std::string label;
    std::uint64_t incarnation;
    bool alive;
    std::size_t rails;
  };
  std::vector<PeerSummary> peers() const;
  // The peer's label, or an error when the id was never given or is long gone.
  Result<std::string> peer_label(int peer) const;

  std::size_t rails_to(int peer) const;
  std::size_t eager_limit(int peer) const;

  // kRemoteWrite (the default) for what is received into or written by peers; kLocal for
  // what is only sent from.
  // `device`: see MemoryRegistry::register_region (null: CUDA memory where the driver says so).
  Result<RegionPtr> register_memory(void* base, std::size_t length,
                                    MemoryAccess access = MemoryAccess::kRemoteWrite,
                                    const DeviceMemory* device = nullptr);
  Status deregister_memory(const RegionPtr& region);
  // Regions registered now (MemoryRegistry::size).
  std::size_t registered_regions() const;
  // Sends and receives posted from now on belong to `epoch` of their pair's messages, or to a
  // later one: each pair's first message of a new epoch starts its numbering afresh on both
  // sides, so what was posted in an earlier epoch never pairs with it. Epochs only grow; both
  // sides of a pair must start them at the same points of their programs. A communicator starts
  // one with every collective, so that a collective that failed on some ranks and not on others
  // leaves no message that could pair with the next one's.
  void set_epoch(std::uint64_t epoch) { epoch_.store(epoch, std::memory_order_relaxed); }
  // `rails`: see Fabric::isend.
  Result<OpPtr> isend(int peer, const RegionPtr& region, std::size_t offset, std::size_t length,
                      std::uint64_t rails = kAllRails);
  Result<OpPtr> irecv(int peer, const RegionPtr& region, std::size_t offset, std::size_t length);
  Result<OpPtr> iwrite(int peer, const RegionPtr& region, std::size_t offset,
                       const RemoteRegion& remote, std::size_t remote_offset, std::size_t length);
  // Small messages (at most 64 KiB) by service: see Fabric::send_message.
  Status send_message(int peer, std::uint8_t service, Bytes payload);
  using MessageHandler = std::function<void(int peer, Bytes payload)>;
  // Services 0 and 1 are Fabric::Service's; kWorldControl carries a world's bootstrap control
  // path over the rails (Bootstrap::set_direct_path), whose messages may be a few bytes over
  // 64 KiB.
  static constexpr std::size_t kServices = 3;
  static constexpr std::uint8_t kWorldControl = 2;
  void set_message_handler(std::uint8_t service, MessageHandler handler);
  // Waits until at least one of `ops` completed (OK; the caller looks which), or fails with a
  // timeout once every one of them is past its deadline and grace.
  Status wait_any(std::span<const OpPtr> ops);
  Status wait(const OpPtr& op);

  // The out-of-band path of a world (its rank 0 relay): failover messages also go there, and
  // what arrives from it is handed in with on_out_of_band. Set before any peer is added.
  using OutOfBand = std::function<bool(int peer, Bytes message)>;
  void set_out_of_band(OutOfBand path) { out_of_band_ = std::move(path); }
  void on_out_of_band(int peer, Bytes message);
  // A message (its service byte first) that came by another path, to its service's handler.
  // Loop thread.
  void deliver_message(int peer, std::span<const std::byte> message);
  // The peer is gone (a world's control path says so): its operations fail now.
  void peer_left(int peer, const std::string& why);
  // Where errors that end a job go (a world's asynchronous error); default: logged.
  void set_fatal_handler(std::function<void(const Status&)> handler);

  std::vector<RailSnapshot> rail_snapshot() const;
  ProviderCounters provider_counters() const;
  // The provider's ProviderCapability flags.
  std::uint32_t provider_capabilities() const;
  std::vector<RailEvent> rail_events() const;
  std::vector<RailTelemetryView> rail_telemetry() const;
  const LatencyHistogram& failover_detection() const { return failover_detection_; }
  MetricRegistry& metrics() { return metrics_; }
  const MetricRegistry& metrics() const { return metrics_; }
  // Fails every operation in flight and every later one with `why`. Not from the progress thread.
  void abort(const std::string& why);
  // Waits (at most `limit`) until what was sent is confirmed or cannot be.
  void drain(std::chrono::milliseconds limit);

 private:
  Endpoint();
  struct Peer;
  Result<int> add_peer_locked(EndpointInfo info, const PeerOptions& options);
  // The peer of that incarnation whose channel is alive, if any (on the engine's thread).
  std::optional<int> live_peer(std::uint64_t incarnation) const;
  bool on_accept(const std::shared_ptr<Rail>& rail);
  Channel* channel(int peer) const;  // loop thread, or under peers_mutex_
  Status check_args(int peer, const RegionPtr& region, std::size_t offset, std::size_t length,
                    const char* what) const;
  void arm_watchdog();
  // A new operation with its deadline, handed to `post(op, deadline)` on the loop.
  template <typename Post>
  OpPtr start_op(Post post);
  // After it left: probes stop, the handler hears of it, the oldest departed are forgotten.
  void retire(int peer, const std::string& why);
  void tell_peer_event(const PeerEvent& event);  // the handler, then the listeners (loop thread)

  Config config_;
  EndpointOptions options_;
  EndpointInfo info_;
  std::unique_ptr<ProgressEngine> engine_;
  std::unique_ptr<Provider> provider_;
  std::unique_ptr<MemoryRegistry> registry_;
  std::unique_ptr<Prober> prober_;
  std::unique_ptr<LinkWatcher> link_watcher_;
  RailEventLog events_;
  LatencyHistogram failover_detection_;
  MetricRegistry metrics_;
  OutOfBand out_of_band_;
  std::function<void(const Status&)> on_fatal_;
  std::atomic<std::uint64_t> epoch_{0};  // of the sends and receives posted next (set_epoch)
  std::function<void(const PeerEvent&)> peer_handler_;  // loop thread
  std::vector<std::pair<int, std::function<void(const PeerEvent&)>>> peer_listeners_;  // loop
  int next_listener_ = 0;                                                              // loop
  std::array<MessageHandler, kServices> message_handlers_;  // loop thread
  mutable std::mutex peers_mutex_;  // peers_ changes on the loop thread, under it
  // By id: the peers that have not left, and the last departed ones (forgotten once more than
  // 256 have left since). Ids are never reused: a new one is one past every id used so far.
  std::map<int, std::unique_ptr<Peer>> peers_;
  int id_end_ = 0;
  std::vector<int> departed_;  // ids of peers that left, oldest first
  struct Watchdog;
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace r2ccl

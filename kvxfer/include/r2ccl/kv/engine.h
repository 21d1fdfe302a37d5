// The KV-cache transfer engine for prefill/decode disaggregation.
//
// Each side registers its KV pools (buffers + layout) and hands its metadata blob to the other;
// a side that connected with a peer's blob can push blocks into the peer's pools (prefill ->
// decode) or ask the peer to push to it (pull). A request moves a list of (layer range, source
// blocks, destination blocks); it can be built layer by layer as prefill produces them and then
// sealed. Its bytes are one-sided writes striped over every rail of the fabric; a NIC failure
// mid-request is absorbed by the fabric's fence-and-replay, so the request still ends DONE (and
// counts as preserved). The receiver gets one notification per request, after all of its bytes
// have landed — or, if no rail to the peer survives the deadline, FAILED with the list of
// destination blocks whose contents are not valid. A partial request is never reported DONE.
//
// Threading: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/kv/layout.h"
#include "r2ccl/runtime/fabric.h"

namespace r2ccl::kv {

enum class RequestState { kPending, kInFlight, kDone, kFailed, kCancelled };
std::string_view request_state_name(RequestState s);

// Blocks of layers [first_layer, last_layer) — every part of each.
struct BlockSpan {
  std::uint32_t first_layer = 0;
  std::uint32_t last_layer = 0;
  std::vector<std::uint32_t> src_blocks;
  std::vector<std::uint32_t> dst_blocks;  // same length as src_blocks
};

struct RequestStatus {
  RequestState state = RequestState::kPending;
  std::string reason;                         // FAILED/CANCELLED: why
  bool preserved = false;                     // DONE although a rail failed under it
  std::vector<std::uint32_t> invalid_blocks;  // FAILED/CANCELLED: destination blocks not valid
  std::uint64_t bytes = 0;
  std::chrono::nanoseconds duration{0};  // submit to end
};

// The most bytes a request's payload may carry to the receiving side.
inline constexpr std::size_t kMaxPayloadBytes = 4096;

// What the receiving side learns about a request, once.
struct Notification {
  std::uint64_t request = 0;
  int peer = -1;  // the side that pushed
  RequestState state = RequestState::kDone;
  std::string reason;
  Bytes payload;  // the user's small payload (e.g. the first token)
  std::vector<std::uint32_t> invalid_blocks;
  bool verified = false;  // R2CCL_KV_VERIFY: every block's checksum matched
};

struct EngineCounters {
  std::uint64_t done = 0, failed = 0, cancelled = 0, preserved = 0, bytes = 0;
  // Notifications from peers dropped because too many, or too many bytes of them, were waiting
  // (EngineOptions::max_queued_bytes).
  std::uint64_t dropped_notifications = 0;
};

struct EngineOptions {
  bool verify = false;                     // R2CCL_KV_VERIFY
  std::uint64_t max_inflight = 64u << 20;  // R2CCL_KV_MAX_INFLIGHT: bytes in flight per peer
  // Notifications waiting to be verified, handed to the callback or polled: at most this many
  // bytes (payloads, reasons, block lists, checksums) together, besides at most 65,536 of them;
  // past either, a notification is dropped, saying so.
  std::uint64_t max_queued_bytes = 64u << 20;
  static EngineOptions from(const Config& config) {
    return {config.kv_verify, config.kv_max_inflight};
  }
};

class KvEngine {
 public:
  // On an endpoint: peers are the endpoint's peer ids, connected by load_remote() (or by the
  // endpoint itself before accept_metadata()). A failure notice then travels on the rails only.
  static Result<std::unique_ptr<KvEngine>> create(Endpoint& endpoint, const EngineOptions& options,
                                                  Fabric* world = nullptr);
  // In a world: peers are ranks, and failure notices also take the world's control path.
  static Result<std::unique_ptr<KvEngine>> create(Fabric& fabric, const EngineOptions& options);
  ~KvEngine();
  KvEngine(const KvEngine&) = delete;
  KvEngine& operator=(const KvEngine&) = delete;

  // Registers a pool's buffers on every rail; returns its id (0, 1, ...). Host memory, or device
  // memory: `memory`'s, or CUDA's where the driver says so (r2ccl/runtime/device_memory.h). A
  // device pool's blocks must be complete on the device when a request that reads them is
  // submitted (the stream that wrote them synchronised); a notification comes after every byte
  // was copied into the receiver's device memory.
  Result<std::uint32_t> register_pool(const std::vector<std::span<std::byte>>& buffers,
                                      const KvLayout& layout, const DeviceMemory* memory = nullptr);
  // Deregisters a pool (refused while a request uses it): peers can no longer write into it,
  // and its id is not reused. Metadata taken afterwards shows it as gone. The destructor
  // deregisters every pool.
  Status unregister_pool(std::uint32_t pool);
  // Versioned, checksummed description of this side's pools and their remote keys.
  Bytes metadata() const;
  // Accepts the metadata of `peer`, already connected (a world's rank, or an endpoint peer);
  // refuses a truncated, corrupted or incompatible blob, saying why. load_remote() connects as
  // well.
  Status accept_metadata(int peer, std::span<const std::byte> metadata);
  // The agent model (NIXL's loadRemoteMD): connects the endpoint that the metadata names (it
  // carries its endpoint blob), accepts its pools, and returns its peer id.
  Result<int> load_remote(std::span<const std::byte> metadata);
  // Forgets the peer's pools and closes the endpoint's channel to it; its requests in flight
  // fail.
  Status disconnect(int peer);

  // Push, built step by step (layer streaming) ...
  Status begin(std::uint64_t id, int peer, std::uint32_t local_pool, std::uint32_t remote_pool);
  Status add(std::uint64_t id, const BlockSpan& span);
  Status seal(std::uint64_t id, Bytes payload = {});
  // ... or at once.
  Status submit(std::uint64_t id, int peer, std::uint32_t local_pool, std::uint32_t remote_pool,
                const std::vector<BlockSpan>& spans, Bytes payload = {});
  // Pull: `peer` pushes its blocks (src_blocks, its pool `remote_pool`) into ours (dst_blocks).
  // It must end within the endpoint's timeout (R2CCL_TIMEOUT), else it fails naming the peer;
  // it fails at once when the peer leaves or is disconnected. A pull that ends here (so, or
  // cancelled) is notified here as the peer's push would be, with every destination block
  // invalid, and what the peer says of it later is ignored.
  Status pull(std::uint64_t id, int peer, std::uint32_t local_pool, std::uint32_t remote_pool,
              const std::vector<BlockSpan>& spans);

  Result<RequestStatus> status(std::uint64_t id) const;
  // Until the request (push or pull) ends, at most `timeout`.
  Result<RequestStatus> wait(std::uint64_t id, std::chrono::milliseconds timeout);
  // Stops a request. A push: nothing more is sent; it ends CANCELLED once what was in flight
  // lands. A pull: it ends CANCELLED at once and the peer is asked to stop, but writes of the
  // peer already in flight may still land in its destination blocks.
  Status cancel(std::uint64_t id);

  // Notifications for requests pushed to this side (verified here when R2CCL_KV_VERIFY is on).
  std::vector<Notification> poll_notifications();
  // Delivers every later notification to `fn` instead (already verified), on the engine's
  // notification thread and outside its lock: `fn` may call this engine; while it runs, later
  // notifications wait. Notifications already queued are delivered at once, on the caller's
  // thread.
  void set_notification_callback(std::function<void(const Notification&)> fn);
  Result<Notification> wait_notification(int peer, std::uint64_t id,
                                         std::chrono::milliseconds timeout);

  EngineCounters counters() const;

 private:
  struct Impl;
  explicit KvEngine(std::shared_ptr<Impl> impl);
  // Shared with the completion callbacks of its writes (they hold it weakly), so that one that
  // fires after the engine is gone finds nothing instead of freed memory.
  std::shared_ptr<Impl> impl_;
};

}  // namespace r2ccl::kv

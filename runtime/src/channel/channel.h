// The multi-rail channel to one peer (private to the runtime; an Endpoint owns one per peer).
// Everything here runs on the progress thread.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "channel/ledger.h"
#include "channel/scheduler.h"
#include "health/health.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/op.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/telemetry.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

// What a channel needs from its fabric.
struct ChannelContext {
  const Config* config = nullptr;
  std::uint64_t incarnation = 0;  // this endpoint's
  // This endpoint's description, carried in the hello of every rail it connects.
  std::shared_ptr<const Bytes> description;
  std::string self_label = "this endpoint";  // how messages name this side ("rank 0")
  Token token{};
  Provider* provider = nullptr;
  // The out-of-band control path (rank 0's relay): queues a failover message for a sender thread
  // and returns at once; false when it cannot (full, or no such path). Null: none.
  std::function<bool(int peer, Bytes message)> out_of_band;
  RailEventLog* events = nullptr;
  LatencyHistogram* detection = nullptr;        // failover detection latencies
  std::function<void(const Status&)> on_fatal;  // records the fabric's asynchronous error
  // Fabric::send_message's messages: the service byte, then the payload (valid for the call).
  std::function<void(int peer, std::span<const std::byte> message)> on_user_message;
  // The peer left (on_peer_left ran): called once, from inside the channel, so it must only
  // post work for later.
  std::function<void(int peer, const std::string& why)> on_gone;
  // A connection of the peer's rail `rail` is in place (attach()); `address` is the peer's end
  // of it (Rail::remote_address()). Null: nobody is told.
  std::function<void(int peer, std::uint32_t rail, const std::string& address)> on_rail_attached;
  // The epoch this endpoint's program is in (Endpoint::set_epoch); null: always 0.
  const std::atomic<std::uint64_t>* epoch = nullptr;
};

class Channel {
 public:
  using Clock = std::chrono::steady_clock;

  struct RemoteRail {
    std::string nic;
    Bytes endpoint;  // provider endpoint of the peer's NIC
  };
  // Who the peer is and how the channel to it behaves.
  struct PeerIdentity {
    int id = -1;                    // the endpoint's number for it (a rank in a world)
    std::string label;              // how messages name it: "rank 3", "peer 'decode-1' (...)"
    std::uint64_t incarnation = 0;  // the peer endpoint's
    bool connector = false;         // this side opens the rails (first and re-admissions)
    // The peer is gone once every rail was closed by it and its NICs stopped answering probes
    // (its process ended). Without it, only on_peer_left() says so (a world's control path).
    bool gone_on_close = false;
  };

  Channel(ChannelContext ctx, PeerIdentity peer, std::vector<RailNic> local,
          std::vector<RemoteRail> remote);

  std::size_t nrails() const { return rails_.size(); }
  // The largest message sent eagerly (inside a control message, no clear-to-send first).
  std::size_t eager_limit() const;
  int peer() const { return peer_; }
  const std::string& label() const { return label_; }
  std::uint64_t peer_incarnation() const { return identity_.incarnation; }
  bool connector() const { return identity_.connector; }
  bool gone_on_close() const { return identity_.gone_on_close; }
  bool dead() const { return dead_; }
  // The peer connected to us while we were connecting to it: its rails win (it has the lower
  // incarnation), ours are abandoned and this side accepts from now on.
  void become_acceptor();
  const RailNic& nic(std::size_t rail) const { return rails_[rail]->nic; }

  // A rail connection is in place (initial connection, or re-admission at a higher epoch).
  bool attach(std::uint32_t index, std::shared_ptr<Rail> rail);
  void connect_failed(std::uint32_t index, const Status& why);
  // The first connection of every rail (the connector connects, the other side accepts). A
  // rail that cannot connect now (its NIC is down) is probed, and connected once it answers.
  void connect_all_rails();
  std::size_t attached() const;
  std::size_t connecting() const;  // connection attempts under way
  // Start-up is over: a rail connected for the first time from now on is reported ("joined").
  void mark_started() { started_ = true; }
  // Rails without a connection; with `never_connected`, only those that have not had one yet (a
  // rail this side opened and the peer then closed, because its own connections won a
  // simultaneous connect, is not missing: the peer's arrives on that rail).
  std::string missing_rails(bool never_connected = false) const;

  // Starts epoch `epoch` of the two-sided messages (protocol.h) if it is later than the current
  // one: both message counters jump to its first number, and what the peer sent early for the
  // epochs before it (kept for receives or sends never posted) is dropped.
  void enter_epoch(std::uint64_t epoch);
  void post_send(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                 Clock::time_point deadline, std::uint64_t rails = kAllRails);
  void post_recv(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                 Clock::time_point deadline);
  // One-sided: writes into the peer's registered memory; no receive is matched.
  void post_write(OpPtr op, RegionPtr region, std::size_t offset, const RemoteRegion& remote,
                  std::size_t remote_offset, std::size_t length, Clock::time_point deadline);
  // Reliable, delivered once, in order with the control messages of this channel.
  void send_user_message(std::uint8_t service, std::span<const std::byte> payload);
  // Bytes of control messages sent and not yet confirmed by the peer (any thread): a user
  // message is refused ("try again") past kMaxControlUnconfirmed.
  std::size_t control_unconfirmed_bytes() const {
    return control_unconfirmed_bytes_.load(std::memory_order_relaxed);
  }
  // Eager data kept for receives not posted yet (at most kEagerCredit), and this side's eager
  // bytes the peer has not consumed yet (loop thread).
  std::size_t unexpected_bytes() const { return unexpected_bytes_; }
  std::uint64_t eager_unconsumed() const { return eager_unconsumed_; }
  // Tells the peer that this side disconnects, after everything sent before.
  void send_goodbye();

  // Periodic: deadlines, rail health (silence, stalls, re-admission), bandwidth and degradation.
  void tick(Clock::time_point now);
  // The progress loop did not run for `gap` (this process stalled): silence and missing
  // progress in that time are not counted against the rails or the peer.
  void forgive_stall(Clock::time_point now, Clock::duration gap);
  // The local NIC `ifname` changed operational state.
  void on_link(const std::string& ifname, bool running);
  void on_probe_reply(std::uint32_t rail, std::chrono::nanoseconds rtt);
  // A message from the peer on the control path (fence notices).
  void on_control_path(Bytes message);
  // The peer left the control path: every operation with it fails now.
  void on_peer_left(const std::string& why);
  // The sends and receives on region `region_id` end with `why` (kAborted): it is being
  // deregistered, so no rail may read or write it for them again. The peer is told of each
  // two-sided one, so that its side ends too, with the same reason.
  void abandon_region(std::uint64_t region_id, const std::string& why);

  void snapshot(std::vector<RailSnapshot>& out) const;
  void telemetry_views(std::vector<RailTelemetryView>& out) const;
  void shutdown();
  // Nothing sent to the peer waits any more: every control message (eager data included) is
  // confirmed, or no rail is left that could deliver it.
  bool settled() const;

 private:
  struct Sink final : RailEvents {
    Channel* channel = nullptr;
    std::uint32_t index = 0;
    void on_write_confirmed(std::uint64_t cookie, std::uint64_t receive_ns) override;
    void on_write_refused(std::uint64_t cookie, const Status& why) override;
    void on_write_arrived(std::uint32_t imm, std::size_t length) override;
    void on_control(std::span<const std::byte> message) override;
    void on_rail_failed(const Status& why) override;
  };
  struct Cts {
    std::uint64_t seq = 0;
    std::uint64_t length = 0;
    std::uint32_t chunk = 0;
    std::uint64_t offset = 0;
    RemoteRegion region;
  };
  struct ControlEntry {
    std::uint64_t seq = 0;
    std::shared_ptr<const Bytes> message;  // the whole framed control message (shared with rails)
    std::uint32_t rail = 0;
    std::size_t payload = 0;  // user data inside (eager messages): counted as rail traffic
  };
  struct RailSlot {
    std::shared_ptr<Rail> rail;  // null while fenced / not connected
    Sink sink;
    RailNic nic;
    RemoteRail remote;
    std::optional<RailHealth> health;
    std::uint32_t epoch = 0;
    bool connecting = false;
    bool closed_by_peer = false;  // its last connection ended because the peer closed it
    bool ever_attached = false;   // it has carried a connection (from either side)
    // Its last connection stays on this host (Provider::host_local): the NIC's link state does
    // not touch it.
    bool host_local = false;
    // Its provider refused a post (kNoResource, back-pressure): no work until it confirms
    // something, or the next tick.
    bool backpressured = false;
    Clock::time_point next_connect{};  // re-admission attempts back off after a failure
    std::string connect_error;
    // Fence, then replay: what the rail left unconfirmed waits until the peer has fenced its
    // end of the same connection too.
    std::vector<InflightChunk> awaiting_replay;
    std::vector<ControlEntry> awaiting_control;
    std::optional<std::uint32_t> peer_fenced_epoch;
    bool replay_confirm_pending = false;
    Clock::time_point last_progress{};
    Clock::time_point last_keepalive{};  // SUSPECT: when the last keepalive went on it
    // Bandwidth is measured over the time the rail had data in flight ("busy"), per period.
    std::optional<Clock::time_point> busy_since;
    std::chrono::nanoseconds busy_time{0};
    std::uint64_t busy_bytes = 0;
    // Or, better, from the receiver's own timing when the provider reports it.
    std::chrono::nanoseconds receive_time{0};
    std::uint64_t receive_bytes = 0;
    double bandwidth = 0;          // measured bytes/s (EWMA); 0 until measured
    double confirm_bandwidth = 0;  // from confirmations only (EWMA); 0 until measured
    int idle_periods = 0;          // measurement periods without work while other rails had some
    RailTelemetry tel;
  };
  struct Send {
    OpPtr op;
    RegionPtr region;
    std::size_t offset = 0;
    std::size_t length = 0;
    Clock::time_point deadline;
    bool started = false;
    Cts cts;
    std::uint32_t nchunks = 0;
    std::uint32_t next_chunk = 0;
    std::uint32_t confirmed = 0;
    std::uint64_t rails = kAllRails;  // the rails it prefers (all where none of them is usable)
  };
  struct Recv {
    OpPtr op;
    RegionPtr region;
    std::uint64_t seq = 0;
    std::size_t offset = 0;
    std::size_t length = 0;
    Clock::time_point deadline;
    Clock::time_point last_arrival{};  // of one of its chunks
    ArrivalSet arrivals;
  };

  // Rails
  void fail_rail(std::uint32_t index, const std::string& reason, HealthAction action,
                 bool notify_peer);
  void fence(std::uint32_t index, const std::string& reason, bool notify_peer);
  void maybe_replay(std::uint32_t index);
  void send_replay_query(std::uint32_t index, std::vector<InflightChunk> chunks);
  void answer_replay_query(std::uint32_t index, std::uint32_t epoch, ByteReader& r);
  void on_replay_answer(std::uint32_t index, ByteReader& r);
  void readmit(std::uint32_t index);
  void open_rail(std::uint32_t index, std::uint32_t epoch);
  void update_usable(std::uint32_t index);
  void measure_bandwidth(Clock::time_point now);
  void update_degraded();
  void event(std::uint32_t index, const std::string& kind, const std::string& detail);
  std::string rail_summary() const;
  bool any_usable() const;

  // Control messages on the rails (clear-to-send, abort): reliable and idempotent.
  // Sends a message built with control_writer (its sequence number is filled in here).
  void send_control(Bytes message, std::size_t payload = 0);
  void flush_control();
  // Dedupes and orders the control messages of the peer, then handles each (handle_control).
  void deliver_control(std::uint32_t rail, std::span<const std::byte> message);
  void handle_control(std::uint32_t rail, std::span<const std::byte> message);
  void send_fence_notice(std::uint8_t type, std::uint32_t rail, std::uint32_t epoch,
                         const std::string& why);
  // Failover messages (fence notices, replay queries and answers) go on a connected rail of this
  // peer, kept until confirmed and sent again on another if that rail fails; only when no rail
  // is connected do they take the out-of-band control path.
  Status send_failover(const Bytes& message);
  // `duplicate`: also on the out-of-band path when a rail took it (the first copy to arrive
  // counts; the rails' queues may hold it back behind data).
  Status post_failover(std::shared_ptr<const Bytes> framed, bool duplicate);
  // Signs of life the peer gives without being asked (the kernel's acknowledgements), and a
  // trickle for a SUSPECT rail: a keepalive on that rail, at most one per probe interval, so
  // that a slow rail proves itself instead of being declared dead.
  void listen_for_life(std::uint32_t rail, Clock::time_point now);

  // Data
  bool fail_if_dead(const OpPtr& op);  // completes it with the reason when the peer is gone
  static Send make_send(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                        Clock::time_point deadline);
  std::uint32_t chunk_for(std::size_t length) const;  // chunk size of a message
  void start_send(std::uint64_t seq, const Cts& cts);
  // Eager data for receive `seq` (posted or not yet).
  void on_eager(std::uint64_t seq, std::span<const std::byte> data);
  // Eager bytes consumed here (matched or discarded): credit for the peer, returned in batches.
  void consumed_eager(std::size_t bytes);
  void return_credit();
  // The clear-to-send of a posted receive, and its arrival set.
  void send_cts(Recv& r);
  // Messages of eager size (1..8 KiB; 1..64 KiB over a single rail) travel inside a control
  // message, and their receives get no clear-to-send; the others go through a rendezvous.
  bool needs_cts(std::size_t length) const;
  // Fails a receive whose sender announced another size, and tells the sender.
  void refuse_send(const OpPtr& op, std::uint64_t seq, std::uint64_t sent, std::uint64_t posted);
  // Completes a posted receive with eager data (or its size mismatch).
  void finish_eager(const OpPtr& op, const RegionPtr& region, std::size_t offset,
                    std::size_t length, std::uint64_t seq, std::span<const std::byte> data);
  void pump();
  void drop_send(std::map<std::uint64_t, Send>::iterator it);
  void fail_all(const Status& why);
  void on_confirmed(std::uint32_t rail, std::uint64_t cookie, std::uint64_t receive_ns);
  void chunk_done(std::uint64_t message);  // a chunk of send `message` is delivered
  void on_refused(std::uint32_t rail, std::uint64_t cookie, const Status& why);
  void on_arrived(std::uint32_t rail, std::uint32_t imm, std::size_t length);
  void on_rail_failed(std::uint32_t rail, const Status& why);
  void check_gone(Clock::time_point now);  // gone_on_close
  // The peer broke the protocol: the job's error, and the peer is treated as gone.
  void protocol_violation(const std::string& what);
  // The peer ended its `half` ("send" or "receive") of message `seq` before this side posted
  // its own (`next`: this side's next one): kept in `early` (early_aborts_ or
  // early_abort_sends_), within the early window, for when it is posted.
  void keep_early_abort(std::map<std::uint64_t, Status>& early, std::uint64_t seq,
                        std::uint64_t next, std::string_view half, Status why);
  // Ends `op`, just numbered `seq`, with the reason kept for it there, if any.
  static bool end_if_aborted_early(std::map<std::uint64_t, Status>& early, std::uint64_t seq,
                                   const OpPtr& op);
  // Messages announced (request-to-send) ahead of the receives posted here, at most.
  static constexpr std::uint64_t kEarlyWindow = 65536;
  // The peer's message `seq`, which this side has not posted (its next is `next`): kept early
  // (its receive or send may still be posted here), stale (its epoch is over here, so it never
  // will be), or a protocol violation (`window` or more into its epoch, or `window` kept already
  // in `kept`: more than a peer following the protocol gets). Any epoch ahead is legal: what is
  // kept is bounded by its size, not by how far ahead the peer's program is.
  struct Early {
    bool stale = false;
    std::optional<std::string> violation;
  };
  Early judge_early(std::uint64_t seq, std::uint64_t next, std::uint64_t window,
                    std::size_t kept) const;

  ChannelContext ctx_;
  const Config& config_;
  PeerIdentity identity_;
  int peer_;
  std::string label_;
  // Every rail closed by the peer (not by a fault of the network): since when, for gone_on_close.
  std::optional<Clock::time_point> all_closed_since_;
  Clock::time_point last_probe_reply_{};
  bool dead_ = false;  // the peer left
  std::string dead_reason_;
  bool closing_ = false;
  bool started_ = false;
  std::vector<std::unique_ptr<RailSlot>> rails_;
  RailScheduler scheduler_;
  InflightLedger ledger_;

  struct FailoverEntry {
    std::uint32_t rail = 0;
    std::shared_ptr<const Bytes> message;  // framed (kFailover)
  };
  std::map<std::uint64_t, FailoverEntry> failover_inflight_;  // by cookie
  std::uint64_t next_failover_cookie_ = 1;
  std::uint64_t next_control_seq_ = 1;
  std::uint64_t next_control_cookie_ = 1;
  std::deque<ControlEntry> control_backlog_;
  std::map<std::uint64_t, ControlEntry> control_inflight_;  // by cookie
  // Received control messages are handled in sequence order: the next one expected, and those
  // that arrived ahead of it (bounded: a peer further ahead breaks the protocol).
  struct PendingControl {
    std::uint32_t rail = 0;
    Bytes message;
  };
  static constexpr std::uint64_t kControlReorderWindow = 65536;
  static constexpr std::size_t kControlReorderBytes = std::size_t{256} << 20;
  std::uint64_t control_next_ = 1;
  std::map<std::uint64_t, PendingControl> control_reorder_;
  std::size_t control_reorder_bytes_ = 0;

  std::uint64_t epoch_ = 0;  // of two-sided messages (enter_epoch)
  std::uint64_t next_send_seq_ = 0;
  std::uint64_t next_write_seq_ = 0;  // one-sided writes (with ChunkImm::kOneSidedBit)
  std::map<std::uint64_t, Send> sends_;
  std::map<std::uint64_t, Cts> early_cts_;
  std::map<std::uint64_t, std::uint64_t> early_rts_;  // announced lengths, receive not posted
  // Why the peer ended its side of a message that this side has not posted yet (its region was
  // deregistered): the receive, or the send, fails with that reason when it is posted.
  std::map<std::uint64_t, Status> early_aborts_;       // receives
  std::map<std::uint64_t, Status> early_abort_sends_;  // sends
  std::uint32_t eager_rail_ = 0;     // round-robin of eager messages over the rails
  std::deque<std::uint64_t> ready_;  // messages with chunks not yet posted, oldest first
  std::size_t serve_ = 0;            // the one of the oldest few that gets the next chunk
  std::deque<InflightChunk> replay_;
  // Chunks of fenced rails waiting for the peer to say which it still lacks, by query id.
  struct ReplayQuery {
    std::uint32_t rail = 0;
    std::vector<InflightChunk> chunks;
  };
  std::map<std::uint64_t, ReplayQuery> replay_queries_;
  std::uint64_t next_query_id_ = 1;

  std::uint64_t next_recv_seq_ = 0;
  std::map<std::uint64_t, Bytes> unexpected_;  // eager data whose receive is not posted yet
  std::size_t unexpected_bytes_ = 0;           // at most kEagerCredit
  // Eager credit (protocol.h): sent and not yet returned, here; consumed and not yet returned,
  // from the peer.
  std::uint64_t eager_unconsumed_ = 0;
  std::uint64_t eager_returnable_ = 0;
  std::atomic<std::size_t> control_unconfirmed_bytes_{0};
  std::map<std::uint32_t, Recv> recv_slots_;
  Clock::time_point last_tick_{};
  Clock::time_point last_confirm_{};  // of any chunk to this peer, or a re-admission
};

}  // namespace r2ccl

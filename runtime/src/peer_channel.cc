#include "peer_channel.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "r2ccl/runtime/log.h"

namespace r2ccl {
namespace {

using std::chrono::milliseconds;

// Control messages on the rails: u64 sequence number, u8 type, body.
// kCts: the receiver's clear-to-send (its region and length). kAbort: the sender refuses a
// receive (size mismatch). kEager: a small message with its data. kRts: a send that is not eager
// announces its length, for a receiver that expects an eager message (and so sent no
// clear-to-send). kAbortSend: the receiver refuses such a send (size mismatch).
enum class ControlType : std::uint8_t {
  kCts = 1,
  kAbort = 2,
  kUser = 3,
  kEager = 4,
  kRts = 5,
  kAbortSend = 6,
  // A failover message (fence, fence acknowledgement, replay query or answer; FenceType below),
  // with sequence number 0: not ordered with the others, handled when it arrives (each is
  // idempotent), so that it never waits behind a gap that only its own replay can fill.
  kFailover = 7,
  // The peer disconnects: nothing follows it (sent after everything else on the channel).
  kGoodbye = 8,
};
// A control message's writer: room for its sequence number first (send_control fills it in, so
// the message is built once), then its type; `body` bytes are reserved for what follows.
ByteWriter control_writer(ControlType type, std::size_t body = 48) {
  ByteWriter w(9 + body);
  w.u64(0).u8(static_cast<std::uint8_t>(type));
  return w;
}

// Messages up to this size travel eagerly inside a control message (no clear-to-send round trip
// before the data).
// Above it, messages are striped over the rails in chunks: on shaped links a 16 KiB message
// sent whole on one rail already takes longer than the clear-to-send round trip it saves.
constexpr std::size_t kEagerMax = 8 * 1024;
// With a single rail there is nothing to stripe over, and the round trip is all that a
// rendezvous would add: up to this size (Open MPI's TCP eager limit) messages go eagerly.
constexpr std::size_t kEagerMaxOneRail = 64 * 1024;
// Chunks go round-robin to at most this many of the oldest messages in flight.
constexpr std::size_t kServeWindow = 4;

std::string size_mismatch(std::uint64_t seq, const std::string& sender, const std::string& receiver,
                          std::uint64_t sent, std::uint64_t posted) {
  return fmt::format(
      "size mismatch in message #{} between {} and {}: the sender sends {} bytes, the "
      "receiver posted {} bytes",
      seq, sender, receiver, sent, posted);
}
// Failover messages, on a surviving rail of the same peer (kFailover), or on the out-of-band
// control path when no rail is connected; each u8 type, u32 rail, u32 epoch, then:
// kFence / kFenceAck: the reason (a string). The sender of either has fenced its end of the rail.
// kReplayQuery: u64 query id, u32 count, count x (u64 message, u32 chunk index): the chunks of
//   two-sided messages that a fenced rail left unconfirmed, asked about before they are replayed.
// kReplayAnswer: u64 query id, u32 count, count x u8 (1: the chunk is still wanted).
enum class FenceType : std::uint8_t {
  kFence = 1,
  kFenceAck = 2,
  kReplayQuery = 3,
  kReplayAnswer = 4,
};
// A query names at most this many chunks (more go in further queries).
constexpr std::size_t kQueryChunks = 4096;

constexpr std::uint64_t kControlCookieBit = 1ull << 63;
constexpr std::uint64_t kFailoverCookieBit = 1ull << 62;  // with kControlCookieBit
// Failover messages up to this size also go on the out-of-band path when a rail took them.
constexpr std::size_t kOutOfBandCopyMax = 4096;

std::uint32_t chunk_count(std::uint64_t length, std::uint64_t chunk) {
  return static_cast<std::uint32_t>((length + chunk - 1) / chunk);
}

std::int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ms_text(std::chrono::nanoseconds d) {
  return fmt::format("{:.1f}ms", static_cast<double>(d.count()) / 1e6);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Events from a rail

void Channel::Sink::on_write_confirmed(std::uint64_t cookie, std::uint64_t receive_ns) {
  channel->on_confirmed(index, cookie, receive_ns);
}
void Channel::Sink::on_write_refused(std::uint64_t cookie, const Status& why) {
  channel->on_refused(index, cookie, why);
}
void Channel::Sink::on_write_arrived(std::uint32_t imm, std::size_t length) {
  channel->on_arrived(index, imm, length);
}
void Channel::Sink::on_control(std::span<const std::byte> message) {
  channel->deliver_control(index, message);
}
void Channel::Sink::on_rail_failed(const Status& why) {
  channel->on_rail_failed(index, why);
}

Channel::Channel(ChannelContext ctx, PeerIdentity peer, std::vector<RailNic> local,
                 std::vector<RemoteRail> remote)
    : ctx_(std::move(ctx)),
      config_(*ctx_.config),
      identity_(std::move(peer)),
      peer_(identity_.id),
      label_(identity_.label),
      scheduler_(local.size(), config_.rail_window) {
  const auto now = Clock::now();
  for (std::size_t i = 0; i < local.size(); ++i) {
    auto slot = std::make_unique<RailSlot>();
    slot->nic = local[i];
    slot->remote = remote[i];
    slot->sink.channel = this;
    slot->sink.index = static_cast<std::uint32_t>(i);
    slot->health.emplace(HealthConfig::from(config_), now);
    slot->tel.state = RailState::kDown;
    slot->tel.holddown_ms = static_cast<std::uint64_t>(config_.holddown.count());
    rails_.push_back(std::move(slot));
    scheduler_.set_usable(i, false);
  }
  last_tick_ = now;
}

// ---------------------------------------------------------------------------------------------
// Rails: connection, failure, fence, replay, re-admission

bool Channel::attach(std::uint32_t index, std::shared_ptr<Rail> rail) {
  if (index >= rails_.size() || dead_) return false;
  auto& s = *rails_[index];
  const std::uint32_t epoch = rail->hello().epoch;
  const bool readmission = epoch > 0;
  if (s.rail) {
    if (epoch <= s.epoch) return false;  // a duplicate or stale connection
    // The peer re-established the rail, so it has fenced the old connection: so do we.
    fence(index, "replaced by a new connection from the peer", false);
  }
  if (epoch > s.epoch) {
    // A connection of a newer epoch proves that the peer's end of every older one is closed (the
    // lower rank re-connects only with its end fenced; the higher rank fences its end before it
    // takes the new one). What the old epoch left unconfirmed is dealt with now, under the old
    // epoch: once the new one is in place, the peer's confirmation of the old fence would be
    // ignored as stale, and the chunks would wait for it forever.
    s.peer_fenced_epoch = s.epoch;
    maybe_replay(index);
  }
  s.epoch = epoch;
  s.tel.epoch = epoch;
  s.closed_by_peer = false;
  all_closed_since_.reset();
  s.backpressured = false;
  s.rail = std::move(rail);
  s.rail->start(&s.sink);
  const auto now = Clock::now();
  s.health->on_connected(now);
  s.last_progress = now;
  // Until measured again, a re-admitted rail is assumed as fast as the median of the others.
  std::vector<double> bws;
  for (const auto& o : rails_)
    if (o.get() != &s && o->bandwidth > 0) bws.push_back(o->bandwidth);
  s.bandwidth = 0;
  s.busy_since.reset();
  s.busy_time = std::chrono::nanoseconds(0);
  s.busy_bytes = 0;
  if (!bws.empty()) {
    std::nth_element(bws.begin(), bws.begin() + static_cast<std::ptrdiff_t>(bws.size() / 2),
                     bws.end());
    scheduler_.set_bandwidth(index, bws[bws.size() / 2]);
  } else {
    scheduler_.clear_bandwidth(index);
  }
  update_usable(index);
  if (!readmission && started_) {
    // A rail that could not be opened at start-up (its NIC was down) joins now.
    event(index, "joined", "first connection, after start-up");
    R2CCL_INFO("rail {} ({} -> {}) to {} joined after start-up", index, s.nic.name, s.remote.nic,
               label_);
  }
  if (readmission) {
    last_confirm_ = now;  // a rail back in use is a sign of life: operations waiting get more time
    event(index, "readmitted",
          fmt::format("epoch {}, hold-down was {}ms, {} flap(s)", epoch,
                      s.health->holddown().count(), s.health->flaps()));
    R2CCL_INFO("rail {} ({} -> {}) to {} re-admitted (epoch {})", index, s.nic.name, s.remote.nic,
               label_, epoch);
  }
  maybe_replay(index);
  flush_control();
  pump();
  return true;
}

void Channel::connect_failed(std::uint32_t index, const Status& why) {
  if (index >= rails_.size()) return;
  auto& s = *rails_[index];
  s.connecting = false;
  s.next_connect = Clock::now() + milliseconds(500);
  s.tel.errors.fetch_add(1, std::memory_order_relaxed);
  if (s.health->state() == RailState::kProbing)
    R2CCL_INFO("rail {} to {}: re-admission failed: {}", index, label_, why.message());
  s.connect_error = why.message();  // the fabric names it when the first connection fails
}

std::size_t Channel::attached() const {
  return static_cast<std::size_t>(std::count_if(rails_.begin(), rails_.end(),
                                                [](const auto& s) { return s->rail != nullptr; }));
}

std::string Channel::missing_rails() const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < rails_.size(); ++i)
    if (!rails_[i]->rail)
      out.push_back(
          fmt::format("rail {} ({} -> {}){}", i, rails_[i]->nic.name, rails_[i]->remote.nic,
                      rails_[i]->connect_error.empty() ? "" : ": " + rails_[i]->connect_error));
  return fmt::format("{}", fmt::join(out, "; "));
}

void Channel::update_usable(std::uint32_t index) {
  auto& s = *rails_[index];
  const bool usable = s.rail && s.health->usable() && !dead_ && !s.backpressured;
  scheduler_.set_usable(index, usable);
  s.tel.state = s.health->state();
}

void Channel::event(std::uint32_t index, const std::string& kind, const std::string& detail) {
  if (ctx_.events)
    ctx_.events->add(RailEvent{wall_ns(), peer_, index, rails_[index]->nic.name, kind, detail});
}

void Channel::on_rail_failed(std::uint32_t index, const Status& why) {
  auto& s = *rails_[index];
  // A peer that closes its rails while nothing is in flight is most likely shutting down.
  const bool idle = sends_.empty() && recv_slots_.empty() && scheduler_.inflight(index) == 0;
  log(closing_ || idle ? LogLevel::kInfo : LogLevel::kWarn, "rail {} ({} -> {}) to {} failed: {}",
      index, s.nic.name, s.remote.nic, label_, why.message());
  s.rail.reset();  // the provider closed it already
  s.closed_by_peer = why.code() == ErrorCode::kClosed;
  if (s.closed_by_peer && attached() == 0 && !all_closed_since_) all_closed_since_ = Clock::now();
  fail_rail(index, why.message(), s.health->on_failure(Clock::now(), why.message()), true);
}

void Channel::check_gone(Clock::time_point now) {
  if (!identity_.gone_on_close || dead_ || !all_closed_since_) return;
  if (attached() > 0) {
    all_closed_since_.reset();
    return;
  }
  // The peer's kernel closed every connection; a process that is still there answers probes.
  const auto grace = std::max<Clock::duration>(5 * config_.probe_interval, milliseconds(100));
  if (now - *all_closed_since_ < grace || now - last_probe_reply_ < grace) return;
  on_peer_left(fmt::format(
      "its process ended (it closed every rail, and its NICs have not answered probes for {}ms)",
      std::chrono::duration_cast<milliseconds>(now -
                                               std::max(*all_closed_since_, last_probe_reply_))
          .count()));
}

void Channel::fail_rail(std::uint32_t index, const std::string& reason, HealthAction action,
                        bool notify_peer) {
  auto& s = *rails_[index];
  s.tel.flaps = s.health->flaps();
  s.tel.holddown_ms = static_cast<std::uint64_t>(s.health->holddown().count());
  if (action == HealthAction::kFence) {
    fence(index, reason, notify_peer);
  } else {
    update_usable(index);
  }
}

// Fence, then replay: the connection is closed abortively and its epoch is over; what it left
// unconfirmed is replayed once the peer confirms its end is closed too, so that no write of the
// old connection can land after a replayed one.
void Channel::fence(std::uint32_t index, const std::string& reason, bool notify_peer) {
  auto& s = *rails_[index];
  if (s.rail) {
    s.rail->fence();
    s.rail.reset();
  }
  s.tel.failovers.fetch_add(1, std::memory_order_relaxed);
  s.tel.errors.fetch_add(1, std::memory_order_relaxed);
  s.tel.detection_ns = static_cast<std::uint64_t>(s.health->last_detection().count());
  if (ctx_.detection)
    ctx_.detection->observe(std::chrono::duration<double>(s.health->last_detection()).count());
  scheduler_.set_usable(index, false);
  s.busy_since.reset();
  s.busy_time = std::chrono::nanoseconds(0);
  s.busy_bytes = 0;
  for (const auto& c : ledger_.take_rail(index)) {
    scheduler_.release(index, c.length);
    s.awaiting_replay.push_back(c);
  }
  for (auto it = control_inflight_.begin(); it != control_inflight_.end();) {
    if (it->second.rail == index) {
      s.awaiting_control.push_back(std::move(it->second));
      it = control_inflight_.erase(it);
    } else {
      ++it;
    }
  }
  // Failover messages the rail left unconfirmed go again at once on another path (each is
  // idempotent: no need to wait for the fence).
  std::vector<std::shared_ptr<const Bytes>> resend;
  for (auto it = failover_inflight_.begin(); it != failover_inflight_.end();) {
    if (it->second.rail == index) {
      resend.push_back(std::move(it->second.message));
      it = failover_inflight_.erase(it);
    } else {
      ++it;
    }
  }
  update_usable(index);
  for (auto& m : resend)
    if (Status st = post_failover(std::move(m), false); !st)
      R2CCL_INFO("cannot resend a failover message to {}: {}", label_, st.message());
  event(index, "failed",
        fmt::format("{} (detected in {}; {} chunk(s), {} control message(s) to replay)", reason,
                    ms_text(s.health->last_detection()), s.awaiting_replay.size(),
                    s.awaiting_control.size()));
  if (!closing_)
    log(s.awaiting_replay.empty() ? LogLevel::kInfo : LogLevel::kWarn,
        "rail {} ({} -> {}) to {} is down: {}; fenced epoch {}, {} chunk(s) ({} bytes) to "
        "replay on {} rail(s)",
        index, s.nic.name, s.remote.nic, label_, reason, s.epoch, s.awaiting_replay.size(),
        std::accumulate(s.awaiting_replay.begin(), s.awaiting_replay.end(), std::uint64_t{0},
                        [](std::uint64_t n, const InflightChunk& c) { return n + c.length; }),
        scheduler_.usable_count());
  if (notify_peer)
    send_fence_notice(static_cast<std::uint8_t>(FenceType::kFence), index, s.epoch, reason);
  maybe_replay(index);
}

void Channel::send_fence_notice(std::uint8_t type, std::uint32_t rail, std::uint32_t epoch,
                                const std::string& why) {
  if (dead_ || closing_) return;
  ByteWriter w;
  w.u8(type).u32(rail).u32(epoch).str(why);
  // Without any path the peer learns of the failure from its own detection.
  if (Status st = send_failover(w.bytes()); !st)
    R2CCL_INFO("cannot tell {} about rail {}: {}", label_, rail, st.message());
}

Status Channel::send_failover(const Bytes& message) {
  ByteWriter w(9 + message.size());
  w.u64(0)
      .u8(static_cast<std::uint8_t>(ControlType::kFailover))
      .raw(message.data(), message.size());
  return post_failover(std::make_shared<const Bytes>(w.take()), true);
}

Status Channel::post_failover(std::shared_ptr<const Bytes> framed, bool duplicate) {
  if (dead_ || closing_) return {ErrorCode::kAborted, fmt::format("{} is gone", label_)};
  // A usable rail of the same peer first (the one with the least data in flight), else any
  // connected one: no third process involved. The message overtakes the data queued there.
  std::vector<std::uint32_t> order;
  for (std::uint32_t i = 0; i < rails_.size(); ++i)
    if (rails_[i]->rail) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    const bool ua = scheduler_.usable(a);
    const bool ub = scheduler_.usable(b);
    if (ua != ub) return ua;
    return scheduler_.inflight(a) < scheduler_.inflight(b);
  });
  for (const std::uint32_t i : order) {
    const std::uint64_t cookie = kControlCookieBit | kFailoverCookieBit | next_failover_cookie_++;
    if (rails_[i]->rail->post_urgent_control(framed, cookie)) {
      failover_inflight_.emplace(cookie, FailoverEntry{i, framed});
      // A second copy on the control path, when there is one, is often there first: the rail's
      // own queues (the socket's, the link's) may hold the message back behind data. Nothing
      // depends on it.
      if (duplicate && ctx_.out_of_band && framed->size() <= kOutOfBandCopyMax)
        (void)ctx_.out_of_band(peer_, Bytes(framed->begin() + 9, framed->end()));
      return Status::ok();
    }
  }
  // No rail left: the out-of-band control path only.
  if (!ctx_.out_of_band || !ctx_.out_of_band(peer_, Bytes(framed->begin() + 9, framed->end())))
    return {ErrorCode::kUnavailable, "no rail is connected and the control path cannot take it"};
  return Status::ok();
}

void Channel::on_control_path(Bytes message) {
  ByteReader r(message);
  const auto type = static_cast<FenceType>(r.u8());
  const auto index = r.u32();
  const auto epoch = r.u32();
  if (!r.ok() || index >= rails_.size()) {
    R2CCL_WARN("malformed control-path message from {}", label_);
    return;
  }
  if (type == FenceType::kReplayQuery) return answer_replay_query(index, epoch, r);
  if (type == FenceType::kReplayAnswer) return on_replay_answer(index, r);
  std::string why = r.str(4096);
  if (!r.finish("fence notice").is_ok()) {
    R2CCL_WARN("malformed control-path message from {}", label_);
    return;
  }
  auto& s = *rails_[index];
  if (type == FenceType::kFence) {
    if (epoch == s.epoch && s.rail) {
      const std::string reason = fmt::format("{} reported: {}", label_, why);
      fail_rail(index, reason, s.health->on_failure(Clock::now(), reason), false);
    }
    if (epoch == s.epoch) {
      s.peer_fenced_epoch = epoch;
      maybe_replay(index);
    }
    send_fence_notice(static_cast<std::uint8_t>(FenceType::kFenceAck), index, epoch, "");
    return;
  }
  if (type == FenceType::kFenceAck && epoch == s.epoch) {
    s.peer_fenced_epoch = epoch;
    maybe_replay(index);
  }
}

// Reconcile, then replay. A chunk that a fenced rail left unconfirmed may have landed, its
// confirmation lost with the rail; the receiver may then have completed that receive and
// released (or reused) its memory. So the chunks of two-sided messages are not replayed blindly:
// the peer, whose end of the rail is fenced too (no write of it can land any more), says which of
// them it still lacks, and only those are replayed; the others count as confirmed. One-sided
// writes are replayed at once: their target memory stays registered until their sender reports
// them done.
void Channel::maybe_replay(std::uint32_t index) {
  auto& s = *rails_[index];
  if (s.rail || s.peer_fenced_epoch != s.epoch) return;
  if (s.awaiting_replay.empty() && s.awaiting_control.empty()) return;
  std::vector<InflightChunk> ask;
  std::size_t direct = 0;
  for (auto& c : s.awaiting_replay) {
    if (c.message & ChunkImm::kOneSidedBit) {
      replay_.push_back(c);
      ++direct;
    } else {
      ask.push_back(c);
    }
  }
  event(index, "replay_started",
        fmt::format("{} chunk(s), {} control message(s); {} chunk(s) asked about first",
                    s.awaiting_replay.size(), s.awaiting_control.size(), ask.size()));
  s.replay_confirm_pending = direct > 0;
  s.awaiting_replay.clear();
  // Ahead of everything queued since, oldest first (the receiver handles them in that order).
  std::sort(s.awaiting_control.begin(), s.awaiting_control.end(),
            [](const ControlEntry& a, const ControlEntry& b) { return a.seq < b.seq; });
  control_backlog_.insert(control_backlog_.begin(),
                          std::make_move_iterator(s.awaiting_control.begin()),
                          std::make_move_iterator(s.awaiting_control.end()));
  s.awaiting_control.clear();
  for (std::size_t from = 0; from < ask.size(); from += kQueryChunks)
    send_replay_query(
        index, std::vector<InflightChunk>(ask.begin() + static_cast<std::ptrdiff_t>(from),
                                          ask.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                            ask.size(), from + kQueryChunks))));
  flush_control();
  pump();
}

void Channel::send_replay_query(std::uint32_t index, std::vector<InflightChunk> chunks) {
  const std::uint64_t id = next_query_id_++;
  ByteWriter w(21 + chunks.size() * 12);
  w.u8(static_cast<std::uint8_t>(FenceType::kReplayQuery))
      .u32(index)
      .u32(rails_[index]->epoch)
      .u64(id)
      .u32(static_cast<std::uint32_t>(chunks.size()));
  for (const auto& c : chunks)
    w.u64(c.message).u32(c.index);
  if (const Status st = send_failover(w.bytes()); !st) {
    // Without asking, a chunk that landed (its confirmation lost) could be written again into a
    // receive that completed meanwhile: the sends concerned fail instead.
    const Status why(ErrorCode::kNetwork,
                     fmt::format("rail {} ({}) to {} failed and {} cannot be asked which "
                                 "of its unconfirmed chunks arrived ({}): the send fails rather "
                                 "than replay them blindly",
                                 index, rails_[index]->nic.name, label_, label_, st.message()));
    R2CCL_WARN("{}", why.message());
    for (const auto& c : chunks)
      if (auto it = sends_.find(c.message); it != sends_.end()) {
        auto op = it->second.op;
        drop_send(it);
        op->complete(why);
      }
    return;
  }
  replay_queries_.emplace(id, ReplayQuery{index, std::move(chunks)});
}

void Channel::answer_replay_query(std::uint32_t index, std::uint32_t epoch, ByteReader& r) {
  const std::uint64_t id = r.u64();
  const std::uint32_t n = r.u32();
  if (!r.ok() || n > kQueryChunks) {
    R2CCL_WARN("malformed replay query from {}", label_);
    return;
  }
  ByteWriter w(21 + n);
  w.u8(static_cast<std::uint8_t>(FenceType::kReplayAnswer)).u32(index).u32(epoch).u64(id).u32(n);
  std::uint32_t wanted = 0;
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint64_t message = r.u64();
    const std::uint32_t chunk = r.u32();
    // Wanted only by the receive it was written for, while that receive lacks it. A receive that
    // completed or failed wants nothing more (its memory may be released or in use again).
    const auto it = recv_slots_.find(ChunkImm::slot_of(message));
    const bool want = it != recv_slots_.end() && it->second.seq == message &&
                      chunk < it->second.arrivals.chunks() && !it->second.arrivals.contains(chunk);
    wanted += want ? 1 : 0;
    w.u8(want ? 1 : 0);
  }
  if (!r.finish("replay query").is_ok()) {
    R2CCL_WARN("malformed replay query from {}", label_);
    return;
  }
  R2CCL_DEBUG("{} asked about {} chunk(s) of rail {}: {} still wanted", label_, n, index, wanted);
  if (Status st = send_failover(w.bytes()); !st)
    R2CCL_INFO("cannot answer {}'s replay query: {}", label_, st.message());
}

void Channel::on_replay_answer(std::uint32_t index, ByteReader& r) {
  const std::uint64_t id = r.u64();
  const std::uint32_t n = r.u32();
  auto q = replay_queries_.find(id);
  if (r.ok() && q == replay_queries_.end() && id < next_query_id_) return;  // answered already
  if (!r.ok() || q == replay_queries_.end() || q->second.rail != index ||
      q->second.chunks.size() != n) {
    R2CCL_WARN("unexpected replay answer from {} (query {})", label_, id);
    return;
  }
  auto chunks = std::move(q->second.chunks);
  replay_queries_.erase(q);
  std::vector<bool> want(n);
  for (std::uint32_t i = 0; i < n; ++i)
    want[i] = r.u8() != 0;
  if (!r.finish("replay answer").is_ok()) {
    R2CCL_WARN("malformed replay answer from {}", label_);
    return;
  }
  std::size_t replayed = 0;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (want[i]) {
      replay_.push_back(chunks[i]);
      ++replayed;
    } else {
      chunk_done(chunks[i].message);  // nothing, for a message that has failed since
    }
  }
  if (replayed > 0) rails_[index]->replay_confirm_pending = true;
  event(index, "replay_reconciled",
        fmt::format("{} chunk(s) had arrived (their confirmation was lost), {} to replay",
                    n - replayed, replayed));
  pump();
}

void Channel::readmit(std::uint32_t index) {
  auto& s = *rails_[index];
  // The connector re-connects; the other side accepts (as for the first connection).
  if (!identity_.connector || s.connecting || s.rail || dead_ || Clock::now() < s.next_connect)
    return;
  open_rail(index, s.epoch + 1);
}

void Channel::become_acceptor() {
  identity_.connector = false;
  for (auto& s : rails_)
    s->connecting = false;  // their connections are refused; a late one is closed on arrival
}

void Channel::connect_all_rails() {
  if (!identity_.connector) return;
  for (std::uint32_t i = 0; i < rails_.size(); ++i)
    if (!rails_[i]->rail && !rails_[i]->connecting) open_rail(i, rails_[i]->epoch);
}

std::size_t Channel::connecting() const {
  return static_cast<std::size_t>(
      std::count_if(rails_.begin(), rails_.end(), [](const auto& s) { return s->connecting; }));
}

void Channel::open_rail(std::uint32_t index, std::uint32_t epoch) {
  auto& s = *rails_[index];
  s.connecting = true;
  RailHello hello;
  hello.token = ctx_.token;
  hello.src_incarnation = ctx_.incarnation;
  hello.dst_incarnation = identity_.incarnation;
  hello.rail = index;
  hello.epoch = epoch;
  hello.description = ctx_.description;
  ctx_.provider->connect(index, s.remote.endpoint, hello, config_.connect_timeout,
                         [this, index](Result<std::shared_ptr<Rail>> r) {
                           if (!identity_.connector) {  // the peer's connection won meanwhile
                             if (r.is_ok()) (*r)->fence();
                             return;
                           }
                           if (r.is_ok()) {
                             rails_[index]->connecting = false;
                             if (!attach(index, std::move(*r))) (*r)->fence();
                           } else {
                             connect_failed(index, r.status());
                           }
                         });
}

void Channel::on_link(const std::string& ifname, bool running) {
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    if (s.nic.netdev != ifname) continue;
    event(i, running ? "link_up" : "link_down", ifname);
    fail_rail(i, "link down", s.health->on_link(Clock::now(), running), true);
  }
}

void Channel::on_probe_reply(std::uint32_t rail, std::chrono::nanoseconds rtt) {
  if (rail >= rails_.size()) return;
  last_probe_reply_ = Clock::now();
  auto& s = *rails_[rail];
  s.health->on_probe_reply(Clock::now(), rtt);
  s.tel.rtt_ns = static_cast<std::uint64_t>(rtt.count());
  update_usable(rail);
}

void Channel::measure_bandwidth(Clock::time_point now) {
  const bool any_busy = std::any_of(rails_.begin(), rails_.end(),
                                    [](const auto& r) { return r->busy_since.has_value(); });
  std::vector<double> bws;
  for (const auto& r : rails_)
    if (r->bandwidth > 0) bws.push_back(r->bandwidth);
  std::sort(bws.begin(), bws.end());
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    // Earliest-finish scheduling gives a rail measured as slow no work; if that lasts, raise its
    // estimate a little so it gets a chunk and is measured again (it may have recovered).
    if (any_busy && !s.busy_since && s.busy_time.count() == 0 && scheduler_.usable(i) &&
        s.bandwidth > 0 && !bws.empty() && s.bandwidth < bws[bws.size() / 2]) {
      if (++s.idle_periods >= 20) {
        s.idle_periods = 0;
        s.bandwidth = std::min(bws[bws.size() / 2], s.bandwidth * 1.5);
        scheduler_.set_bandwidth(i, s.bandwidth);
      }
    } else {
      s.idle_periods = 0;
    }
    if (s.busy_since) {
      s.busy_time += now - *s.busy_since;
      s.busy_since = now;
    }
    // From the confirmations: bytes over the time the rail had data in flight, over enough busy
    // time that one chunk more or less does not swing it.
    double confirmed = 0;
    if (s.busy_time >= milliseconds(300) && s.busy_bytes > 0) {
      confirmed =
          static_cast<double>(s.busy_bytes) / std::chrono::duration<double>(s.busy_time).count();
      s.confirm_bandwidth =
          s.confirm_bandwidth == 0 ? confirmed : 0.7 * s.confirm_bandwidth + 0.3 * confirmed;
      s.busy_time = std::chrono::nanoseconds(0);
      s.busy_bytes = 0;
    }
    double sample = 0;
    if (s.receive_time >= milliseconds(50) && s.receive_bytes > 0) {
      // The receiver timed the arrivals: the link's rate, whatever the confirmations' delay.
      sample = static_cast<double>(s.receive_bytes) /
               std::chrono::duration<double>(s.receive_time).count();
      s.receive_time = std::chrono::nanoseconds(0);
      s.receive_bytes = 0;
    } else if (s.receive_bytes == 0 && confirmed > 0) {
      sample = confirmed;
    } else {
      continue;
    }
    R2CCL_TRACE("rail {} to {}: measured {:.2f} MB/s", i, label_, sample / 1e6);
    s.bandwidth = s.bandwidth == 0 ? sample : 0.7 * s.bandwidth + 0.3 * sample;
    scheduler_.set_bandwidth(i, s.bandwidth);
    s.tel.bandwidth_bps = static_cast<std::uint64_t>(s.bandwidth);
  }
}

// A rail is degraded when it is well under its peers by both measures: the receiver's timing
// (the link's rate while the receiver keeps up) and the confirmations (bytes per busy second).
// The receiver's timing alone misleads when it falls behind: data that waited in its socket
// buffer is read at memory speed, so whichever rails it caught up on look fast and the others
// slow. The confirmations see that as a delay common to every rail.
void Channel::update_degraded() {
  const auto median_of = [&](double RailSlot::*field) {
    std::vector<double> v;
    for (const auto& s : rails_)
      if (s->rail && (*s).*field > 0) v.push_back((*s).*field);
    std::sort(v.begin(), v.end());
    return v.size() < 2 ? 0.0 : v[v.size() / 2];
  };
  const double median = median_of(&RailSlot::bandwidth);
  const double confirm_median = median_of(&RailSlot::confirm_bandwidth);
  if (median == 0) return;
  const double ratio = config_.degraded_ratio;
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    s.tel.weight_milli = static_cast<std::uint32_t>(std::lround(1000 * scheduler_.weight(i)));
    if (!s.rail || s.bandwidth == 0) continue;
    // The verdict, not the state: a degraded rail that is SUSPECT for a moment is still degraded
    // (comparing the state logged "degraded" again on every tick).
    const bool was = s.health->degraded();
    // Hysteresis: degraded below the ratio by both measures, recovered above the midpoint to 1
    // by either.
    const bool confirmed_slow = confirm_median > 0 && s.confirm_bandwidth > 0 &&
                                s.confirm_bandwidth < confirm_median * ratio;
    const bool confirmed_fine = confirm_median > 0 && s.confirm_bandwidth > 0 &&
                                s.confirm_bandwidth >= confirm_median * (1 + ratio) / 2;
    const bool now_degraded = was ? !(s.bandwidth >= median * (1 + ratio) / 2 || confirmed_fine)
                                  : s.bandwidth < median * ratio && confirmed_slow;
    if (now_degraded == was) continue;
    s.health->set_degraded(now_degraded);
    update_usable(i);
    event(i, now_degraded ? "degraded" : "recovered",
          fmt::format("{:.1f} MB/s vs median {:.1f} MB/s", s.bandwidth / 1e6, median / 1e6));
    R2CCL_INFO(
        "rail {} ({}) to {} is {} ({:.1f} MB/s, median {:.1f} MB/s; confirmed {:.1f} "
        "MB/s, median {:.1f} MB/s)",
        i, s.nic.name, peer_, now_degraded ? "degraded" : "no longer degraded", s.bandwidth / 1e6,
        median / 1e6, s.confirm_bandwidth / 1e6, confirm_median / 1e6);
  }
}

void Channel::tick(Clock::time_point now) {
  check_gone(now);
  if (dead_) return;
  // A rail that refused a post for back-pressure is tried again at least every tick.
  for (std::uint32_t i = 0; i < rails_.size(); ++i)
    if (rails_[i]->backpressured) {
      rails_[i]->backpressured = false;
      update_usable(i);
    }
  // Rail health.
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    const bool unconfirmed = scheduler_.inflight(i) > 0;
    const auto action = s.health->tick(now, unconfirmed, s.last_progress);
    if (action == HealthAction::kReadmit) {
      readmit(i);
    } else {
      fail_rail(i, s.health->last_error(), action, true);
    }
    s.tel.holddown_ms = static_cast<std::uint64_t>(s.health->holddown().count());
    s.tel.flaps = s.health->flaps();
  }
  if (now - last_tick_ >= milliseconds(100)) {
    last_tick_ = now;
    measure_bandwidth(now);
    update_degraded();
  }
  // Control messages queued while no rail was usable (every rail SUSPECT for a moment, say, on a
  // busy machine) go out once one is again: a rail that comes back from SUSPECT does not call
  // for them itself.
  flush_control();
  pump();

  // Deadlines.
  const bool none_left = !any_usable();
  const std::string prefix =
      none_left ? fmt::format("no rail to {} survived; ", label_) : std::string();
  for (auto it = sends_.begin(); it != sends_.end();) {
    auto& s = it->second;
    if (now < s.deadline) {
      ++it;
      continue;
    }
    // Slow is not dead: a started send on a channel that is still confirming data gets more time.
    if (s.started && !none_left && now - last_confirm_ < config_.timeout) {
      s.deadline = now + config_.timeout;
      s.op->set_deadline(s.deadline);
      ++it;
      continue;
    }
    const auto seq = it->first;
    const std::string progress =
        s.started ? fmt::format("{} of {} chunks confirmed", s.confirmed, s.nchunks)
                  : fmt::format("{} never posted the matching receive", label_);
    Status why(ErrorCode::kTimeout,
               fmt::format("{}{} #{} of {} bytes to {} timed out after {}ms ({}); rails tried: {}",
                           prefix, (seq & ChunkImm::kOneSidedBit) ? "write" : "send",
                           seq & ~ChunkImm::kOneSidedBit, s.length, label_, config_.timeout.count(),
                           progress, rail_summary()));
    auto op = s.op;
    drop_send(it++);
    op->complete(why);
    if (none_left && ctx_.on_fatal) ctx_.on_fatal(why);
  }
  for (auto it = recv_slots_.begin(); it != recv_slots_.end();) {
    auto& r = it->second;
    if (now < r.deadline) {
      ++it;
      continue;
    }
    if (!none_left && now - r.last_arrival < config_.timeout) {  // its data is still coming in
      r.deadline = now + config_.timeout;
      r.op->set_deadline(r.deadline);
      ++it;
      continue;
    }
    const std::string progress =
        r.arrivals.chunks() > 0
            ? fmt::format("{} of {} chunks arrived", r.arrivals.count(), r.arrivals.chunks())
            : std::string("its eager message did not arrive");
    Status why(ErrorCode::kTimeout,
               fmt::format("{}receive #{} of {} bytes from {} timed out after {}ms ({}); "
                           "rails tried: {}",
                           prefix, r.seq, r.length, label_, config_.timeout.count(), progress,
                           rail_summary()));
    r.op->complete(why);
    it = recv_slots_.erase(it);
    if (none_left && ctx_.on_fatal) ctx_.on_fatal(why);
  }
}

bool Channel::any_usable() const {
  return scheduler_.usable_count() > 0;
}

std::string Channel::rail_summary() const {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < rails_.size(); ++i) {
    const auto& s = *rails_[i];
    std::string p = fmt::format("{} ({} -> {}) {}", i, s.nic.name, s.remote.nic,
                                rail_state_name(s.health->state()));
    if (scheduler_.inflight(i) > 0)
      p += fmt::format(", {} bytes unconfirmed", scheduler_.inflight(i));
    if (!s.health->last_error().empty() && !s.health->usable()) p += ": " + s.health->last_error();
    parts.push_back(p);
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

void Channel::on_peer_left(const std::string& why) {
  if (dead_) return;
  dead_ = true;
  dead_reason_ = why;
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& s = *rails_[i];
    if (s.rail) {
      s.rail->fence();
      s.rail.reset();
    }
    update_usable(i);
  }
  fail_all({ErrorCode::kAborted, fmt::format("{} is gone: {}", label_, why)});
  if (ctx_.on_gone) ctx_.on_gone(peer_, why);
}

void Channel::fail_all(const Status& why) {
  failover_inflight_.clear();
  control_reorder_.clear();
  control_reorder_bytes_ = 0;
  auto sends = std::move(sends_);
  auto recvs = std::move(recv_slots_);
  sends_.clear();
  recv_slots_.clear();
  ready_.clear();
  serve_ = 0;
  replay_.clear();
  replay_queries_.clear();
  for (auto& [seq, s] : sends) {
    for (const auto& c : ledger_.take_message(seq))
      scheduler_.release(c.rail, c.length);
    s.op->complete(why);
  }
  for (auto& [slot, r] : recvs)
    r.op->complete(why);
}

void Channel::snapshot(std::vector<RailSnapshot>& out) const {
  for (std::size_t i = 0; i < rails_.size(); ++i) {
    const auto& s = *rails_[i];
    RailSnapshot r;
    r.peer = peer_;
    r.rail = static_cast<std::uint32_t>(i);
    r.nic = s.nic.name;
    r.remote_nic = s.remote.nic;
    r.state = s.health->state();
    r.tx_bytes = s.tel.tx_bytes.load();
    r.rx_bytes = s.tel.rx_bytes.load();
    r.tx_chunks = s.tel.tx_chunks.load();
    r.rx_chunks = s.tel.rx_chunks.load();
    r.replayed_chunks = s.tel.replayed_chunks.load();
    r.replayed_bytes = s.tel.replayed_bytes.load();
    r.errors = s.tel.errors.load();
    r.failovers = s.tel.failovers.load();
    r.bandwidth_bps = s.tel.bandwidth_bps.load();
    r.flaps = s.health->flaps();
    r.rtt_ns = s.tel.rtt_ns.load();
    r.detection_ns = s.tel.detection_ns.load();
    r.weight = scheduler_.weight(i);
    r.holddown_ms = static_cast<std::uint64_t>(s.health->holddown().count());
    r.epoch = s.epoch;
    r.last_error = s.health->last_error();
    out.push_back(std::move(r));
  }
}

void Channel::telemetry_views(std::vector<RailTelemetryView>& out) const {
  for (std::uint32_t i = 0; i < rails_.size(); ++i)
    out.push_back({peer_, i, rails_[i]->nic.name, rails_[i]->remote.nic, &rails_[i]->tel});
}

bool Channel::settled() const {
  return closing_ || !any_usable() ||
         (control_backlog_.empty() && control_inflight_.empty() && failover_inflight_.empty());
}

void Channel::shutdown() {
  closing_ = true;
  for (auto& s : rails_)
    if (s->rail) {
      s->rail->fence();
      s->rail.reset();
    }
  fail_all({ErrorCode::kAborted, "the fabric was destroyed"});
}

// ---------------------------------------------------------------------------------------------
// Control messages on the rails

void Channel::send_control(Bytes message, std::size_t payload) {
  ControlEntry e;
  e.seq = next_control_seq_++;
  e.payload = payload;
  store_le(message.data(), e.seq);  // where control_writer left room for it
  e.message = std::make_shared<const Bytes>(std::move(message));
  control_backlog_.push_back(std::move(e));
  flush_control();
}

void Channel::flush_control() {
  while (!control_backlog_.empty()) {
    // Control messages take the first usable rail; eager messages (with data, matched by their
    // own sequence number, so their order does not matter) go round-robin over the usable
    // rails, so that small messages use every link.
    const bool spread = control_backlog_.front().payload > 0;
    const std::uint32_t n = static_cast<std::uint32_t>(rails_.size());
    const std::uint32_t first = spread && n > 0 ? eager_rail_++ % n : 0;
    std::optional<std::uint32_t> rail;
    for (std::uint32_t k = 0; k < n && !rail; ++k) {
      const std::uint32_t i = (first + k) % n;
      if (rails_[i]->rail && scheduler_.usable(i)) rail = i;
    }
    if (!rail) return;  // sent when a rail is usable again
    ControlEntry e = std::move(control_backlog_.front());
    control_backlog_.pop_front();
    e.rail = *rail;
    const std::uint64_t cookie = kControlCookieBit | next_control_cookie_++;
    if (!rails_[*rail]->rail->post_control(e.message, cookie)) {
      control_backlog_.push_front(std::move(e));
      return;
    }
    control_inflight_.emplace(cookie, std::move(e));
  }
}

void Channel::deliver_control(std::uint32_t rail, std::span<const std::byte> message) {
  rails_[rail]->health->on_heard(Clock::now());
  ByteReader r(message);
  const auto seq = r.u64();
  if (!r.ok()) return;
  if (seq == 0) {
    if (static_cast<ControlType>(r.u8()) != ControlType::kFailover || !r.ok()) {
      R2CCL_WARN(
          "{} sent an unsequenced control message that is not a failover message on "
          "rail {}",
          label_, rail);
      return;
    }
    on_control_path(Bytes(message.begin() + 9, message.end()));
    return;
  }
  // Handled once (a message replayed after a failover may arrive twice), and in the order sent:
  // one that arrives ahead of a gap (newer messages went on another rail while the older ones
  // waited for the fence and their replay) waits until the gap is filled.
  if (seq < control_next_) return;
  if (seq != control_next_) {
    if (control_reorder_.count(seq) != 0) return;
    if (seq - control_next_ > kControlReorderWindow ||
        control_reorder_bytes_ + message.size() > kControlReorderBytes) {
      const Status why(
          ErrorCode::kProtocol,
          fmt::format("{} sent control message #{} while #{} is missing: more "
                      "than {} messages or {} bytes ahead of the gap",
                      label_, seq, control_next_, kControlReorderWindow, kControlReorderBytes));
      R2CCL_WARN("{}", why.message());
      if (ctx_.on_fatal) ctx_.on_fatal(why);
      on_peer_left(why.message());
      return;
    }
    control_reorder_bytes_ += message.size();
    control_reorder_.emplace(seq, PendingControl{rail, Bytes(message.begin(), message.end())});
    return;
  }
  ++control_next_;
  handle_control(rail, message);
  while (!dead_ && !control_reorder_.empty() && control_reorder_.begin()->first == control_next_) {
    auto node = control_reorder_.extract(control_reorder_.begin());
    control_reorder_bytes_ -= node.mapped().message.size();
    ++control_next_;
    handle_control(node.mapped().rail, node.mapped().message);
  }
}

void Channel::handle_control(std::uint32_t rail, std::span<const std::byte> message) {
  ByteReader r(message);
  r.u64();  // the sequence number, checked by deliver_control
  const auto type = static_cast<ControlType>(r.u8());
  if (type == ControlType::kCts) {
    Cts c;
    c.seq = r.u64();
    c.length = r.u64();
    c.chunk = r.u32();
    c.offset = r.u64();
    c.region = RemoteRegion::decode(r);
    if (!r.finish("clear-to-send").is_ok()) {
      R2CCL_WARN("{} sent a malformed clear-to-send on rail {}", label_, rail);
      return;
    }
    if (sends_.count(c.seq) != 0)
      start_send(c.seq, c);
    else if (c.seq >= next_send_seq_)
      early_cts_[c.seq] = c;
    // else: the send already ended (it failed)
    return;
  }
  if (type == ControlType::kEager) {
    const auto seq2 = r.u64();
    const auto length = r.u64();
    if (!r.ok() || message.size() - 25 != length) {
      R2CCL_WARN("{} sent a malformed eager message on rail {}", label_, rail);
      return;
    }
    rails_[rail]->tel.rx_bytes.fetch_add(length, std::memory_order_relaxed);
    rails_[rail]->tel.rx_chunks.fetch_add(1, std::memory_order_relaxed);
    on_eager(seq2, message.subspan(25));
    return;
  }
  if (type == ControlType::kRts) {
    const auto seq2 = r.u64();
    const auto length = r.u64();
    if (!r.finish("request-to-send").is_ok()) {
      R2CCL_WARN("{} sent a malformed request-to-send on rail {}", label_, rail);
      return;
    }
    auto it = recv_slots_.find(ChunkImm::slot_of(seq2));
    if (it != recv_slots_.end() && it->second.seq == seq2) {
      if (!needs_cts(it->second.length)) {
        auto op = it->second.op;
        const auto posted = it->second.length;
        recv_slots_.erase(it);
        refuse_send(op, seq2, length, posted);
      }
      // else: the clear-to-send already went; the sender checks the length against it
    } else if (seq2 >= next_recv_seq_) {
      early_rts_[seq2] = length;
    }
    return;
  }
  if (type == ControlType::kAbortSend) {
    const auto seq2 = r.u64();
    std::string why = r.str(4096);
    if (auto it = sends_.find(seq2); it != sends_.end()) {
      auto op = it->second.op;
      drop_send(it);
      op->complete({ErrorCode::kInvalidArgument, why});
    }
    return;
  }
  if (type == ControlType::kAbort) {
    const auto seq2 = r.u64();
    std::string why = r.str(4096);
    auto it = recv_slots_.find(ChunkImm::slot_of(seq2));
    if (it != recv_slots_.end() && it->second.seq == seq2) {
      auto op = it->second.op;
      recv_slots_.erase(it);
      op->complete({ErrorCode::kInvalidArgument, why});
    }
    return;
  }
  if (type == ControlType::kUser) {
    // After the sequence number and type: the service byte, then the payload.
    if (ctx_.on_user_message) ctx_.on_user_message(peer_, message.subspan(9));
    return;
  }
  if (type == ControlType::kGoodbye) {
    on_peer_left("it disconnected");
    return;
  }
  R2CCL_WARN("{} sent an unknown control message type {} on rail {}", label_,
             static_cast<int>(type), rail);
}

// ---------------------------------------------------------------------------------------------
// Data

Channel::Send Channel::make_send(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                                 Clock::time_point deadline) {
  Send s;
  s.op = std::move(op);
  s.region = std::move(region);
  s.offset = offset;
  s.length = length;
  s.deadline = deadline;
  return s;
}

bool Channel::fail_if_dead(const OpPtr& op) {
  if (!dead_) return false;
  op->complete({ErrorCode::kAborted, fmt::format("{} is gone: {}", label_, dead_reason_)});
  return true;
}

void Channel::post_send(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                        Clock::time_point deadline) {
  if (fail_if_dead(op)) return;
  const auto seq = next_send_seq_++;
  Send s = make_send(std::move(op), std::move(region), offset, length, deadline);
  if (!needs_cts(length)) {
    // Eager: the data travels inside a reliable control message (kept, and replayed on another
    // rail, until the peer confirms it), so the send is complete once it is queued — buffered,
    // as MPI's eager sends are. A receiver that posted another size reports the mismatch.
    ByteWriter w = control_writer(ControlType::kEager, 16 + length);
    w.u64(seq).u64(length);
    w.raw(s.region->base + offset, length);
    send_control(w.take(), length);
    early_cts_.erase(seq);  // the receiver's clear-to-send is not needed
    s.op->complete(Status::ok());
    return;
  }
  sends_.emplace(seq, std::move(s));
  {
    ByteWriter w = control_writer(ControlType::kRts);
    w.u64(seq).u64(length);
    send_control(w.take());
  }
  if (auto it = early_cts_.find(seq); it != early_cts_.end()) {
    Cts c = it->second;
    early_cts_.erase(it);
    start_send(seq, c);
  }
}

void Channel::post_write(OpPtr op, RegionPtr region, std::size_t offset, const RemoteRegion& remote,
                         std::size_t remote_offset, std::size_t length,
                         Clock::time_point deadline) {
  if (fail_if_dead(op)) return;
  if (remote.keys.size() < rails_.size()) {
    op->complete({ErrorCode::kInvalidArgument,
                  fmt::format("the remote region has keys for {} rails, the channel to {} has {}",
                              remote.keys.size(), label_, rails_.size())});
    return;
  }
  if (length == 0) {
    op->complete(Status::ok());
    return;
  }
  const auto seq = ChunkImm::kOneSidedBit | next_write_seq_++;
  Send s = make_send(std::move(op), std::move(region), offset, length, deadline);
  s.started = true;
  s.cts.seq = seq;
  s.cts.length = length;
  s.cts.chunk = chunk_for(length);
  s.cts.offset = remote_offset;
  s.cts.region = remote;
  s.nchunks = chunk_count(length, s.cts.chunk);
  if (s.nchunks > ChunkImm::kMaxChunks) {
    s.op->complete(
        {ErrorCode::kInvalidArgument,
         fmt::format("a write of {} bytes needs more than {} chunks: raise R2CCL_CHUNK_SIZE",
                     length, ChunkImm::kMaxChunks)});
    return;
  }
  sends_.emplace(seq, std::move(s));
  ready_.push_back(seq);
  pump();
}

void Channel::send_goodbye() {
  if (!dead_) send_control(control_writer(ControlType::kGoodbye).take());
}

void Channel::send_user_message(std::uint8_t service, std::span<const std::byte> payload) {
  ByteWriter w = control_writer(ControlType::kUser, 1 + payload.size());
  w.u8(service).raw(payload.data(), payload.size());
  send_control(w.take());
}

void Channel::post_recv(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                        Clock::time_point deadline) {
  if (fail_if_dead(op)) return;
  const auto seq = next_recv_seq_++;
  const auto slot = ChunkImm::slot_of(seq);
  if (recv_slots_.count(slot) != 0) {
    op->complete({ErrorCode::kUnavailable, fmt::format("more than {} receives from {} outstanding",
                                                       ChunkImm::kSlots, label_)});
    return;
  }
  if (auto it = unexpected_.find(seq); it != unexpected_.end()) {
    // An eager message came first: no clear-to-send (its sender has finished).
    Bytes data = std::move(it->second);
    unexpected_.erase(it);
    finish_eager(op, region, offset, length, seq, data);
    return;
  }
  if (auto it = early_rts_.find(seq); it != early_rts_.end()) {
    const auto sent = it->second;
    early_rts_.erase(it);
    if (!needs_cts(length)) return refuse_send(op, seq, sent, length);
  }
  const std::uint32_t chunk = chunk_for(length);
  if (needs_cts(length)) {
    // A receive of eager size waits for the data without a clear-to-send; a sender of another
    // size announces itself (request-to-send) and is refused.
    ByteWriter w = control_writer(ControlType::kCts);
    w.u64(seq).u64(length).u32(chunk).u64(offset);
    RemoteRegion{region->id, region->length, region->keys}.encode(w);
    send_control(w.take());
    if (length == 0) {
      op->complete(Status::ok());
      return;
    }
  }
  Recv r;
  r.op = std::move(op);
  r.region = std::move(region);
  r.seq = seq;
  r.offset = offset;
  r.length = length;
  r.deadline = deadline;
  if (needs_cts(length)) r.arrivals = ArrivalSet(chunk_count(length, chunk));  // eager: one piece
  recv_slots_.emplace(slot, std::move(r));
}

std::size_t Channel::eager_limit() const {
  // Both ends have the same number of rails (rail i pairs with rail i), so they agree.
  return rails_.size() == 1 ? kEagerMaxOneRail : kEagerMax;
}

bool Channel::needs_cts(std::size_t length) const {
  return length == 0 || length > eager_limit();
}

void Channel::refuse_send(const OpPtr& op, std::uint64_t seq, std::uint64_t sent,
                          std::uint64_t posted) {
  const std::string why = size_mismatch(seq, label_, ctx_.self_label, sent, posted);
  ByteWriter w = control_writer(ControlType::kAbortSend);
  w.u64(seq).str(why);
  send_control(w.take());
  op->complete({ErrorCode::kInvalidArgument, why});
}

void Channel::on_eager(std::uint64_t seq, std::span<const std::byte> data) {
  auto it = recv_slots_.find(ChunkImm::slot_of(seq));
  if (it == recv_slots_.end() || it->second.seq != seq) {
    // Kept until its receive is posted (the only copy besides the one into place).
    if (seq >= next_recv_seq_) unexpected_.emplace(seq, Bytes(data.begin(), data.end()));
    return;  // else: the receive already ended (failed at its deadline)
  }
  Recv r = std::move(it->second);
  recv_slots_.erase(it);
  finish_eager(r.op, r.region, r.offset, r.length, seq, data);
}

void Channel::finish_eager(const OpPtr& op, const RegionPtr& region, std::size_t offset,
                           std::size_t length, std::uint64_t seq, std::span<const std::byte> data) {
  if (data.size() != length) {
    op->complete({ErrorCode::kInvalidArgument,
                  size_mismatch(seq, label_, ctx_.self_label, data.size(), length)});
    return;
  }
  std::memcpy(region->base + offset, data.data(), length);
  op->complete(Status::ok());
}

std::uint32_t Channel::chunk_for(std::size_t length) const {
  // At most R2CCL_CHUNK_SIZE, in whole 4 KiB units, and small enough that a message gives every
  // rail several chunks: the rails then finish a message within about one chunk of each other.
  // (Four 100 Mbit/s rails: with two chunks per rail a 1 MiB all-reduce took 35-40 ms, with
  // eight 22-24 ms; the links' rate allows 21.) But a chunk is not made shorter than kChunkTime
  // on the fastest measured rail, where its fixed costs (header, confirmation, scheduling) would
  // show: on loopback eight chunks per rail took 30-50% longer than two. Until a rail is
  // measured, two chunks per rail.
  constexpr std::size_t kMinChunk = 4 * 1024;
  constexpr double kChunkTime = 100e-6;  // seconds
  const std::size_t rails = std::max<std::size_t>(rails_.size(), 1);
  double fastest = 0;
  for (const auto& s : rails_)
    fastest = std::max(fastest, s->bandwidth);
  const std::size_t pieces = (fastest > 0 ? 8 : 2) * rails;
  const auto floor = std::max(kMinChunk, static_cast<std::size_t>(fastest * kChunkTime));
  std::size_t c = std::max(floor, (length + pieces - 1) / pieces);
  c = (c + 4095) / 4096 * 4096;
  return static_cast<std::uint32_t>(std::min(config_.chunk_size, c));
}

void Channel::start_send(std::uint64_t seq, const Cts& cts) {
  auto it = sends_.find(seq);
  auto& s = it->second;
  auto finish = [&](Status st) {
    auto op = s.op;
    sends_.erase(it);
    op->complete(std::move(st));
  };
  if (cts.length != s.length) {
    const std::string why = size_mismatch(seq, ctx_.self_label, label_, s.length, cts.length);
    ByteWriter w = control_writer(ControlType::kAbort);
    w.u64(seq).str(why);
    send_control(w.take());
    return finish({ErrorCode::kInvalidArgument, why});
  }
  if (cts.region.keys.size() < rails_.size() || cts.chunk == 0)
    return finish({ErrorCode::kProtocol, fmt::format("{} sent a malformed clear-to-send", label_)});
  s.started = true;
  s.cts = cts;
  s.nchunks = chunk_count(s.length, cts.chunk);
  if (s.nchunks > ChunkImm::kMaxChunks)
    return finish(
        {ErrorCode::kInvalidArgument,
         fmt::format(
             "a message of {} bytes needs {} chunks of {}; at most {} fit: raise R2CCL_CHUNK_SIZE",
             s.length, s.nchunks, cts.chunk, ChunkImm::kMaxChunks)});
  if (s.nchunks == 0) return finish(Status::ok());
  ready_.push_back(seq);
  pump();
}

// Posts chunks while some rail has room: replays first, then new chunks round-robin over the
// oldest messages in flight (kServeWindow).
void Channel::pump() {
  while (true) {
    InflightChunk c;
    bool replay = false;
    if (!replay_.empty()) {
      c = replay_.front();
      replay = true;
    } else {
      // Round-robin over the oldest few messages only: a large message does not starve the
      // small ones behind it, and messages still finish about in the order they were posted
      // (round-robin over a long queue would finish every one of them only at its end).
      while (true) {
        if (ready_.empty()) return;
        if (serve_ >= std::min(kServeWindow, ready_.size())) serve_ = 0;
        if (sends_.count(ready_[serve_]) != 0) break;
        ready_.erase(ready_.begin() + static_cast<std::ptrdiff_t>(serve_));  // it ended
      }
      auto& s = sends_.at(ready_[serve_]);
      c.message = ready_[serve_];
      c.index = s.next_chunk;
      c.offset = static_cast<std::uint64_t>(c.index) * s.cts.chunk;
      c.length = std::min<std::uint64_t>(s.cts.chunk, s.length - c.offset);
    }
    auto sit = sends_.find(c.message);
    if (sit == sends_.end()) {  // a replayed chunk of a message that has since failed
      replay_.pop_front();
      continue;
    }
    auto rail = scheduler_.pick(c.length);
    if (!rail) return;
    auto& s = sit->second;
    auto& slot = *rails_[*rail];
    const auto now = Clock::now();
    if (scheduler_.inflight(*rail) == c.length) {  // the rail was idle
      slot.last_progress = now;
      slot.busy_since = now;
    }
    c.rail = static_cast<std::uint32_t>(*rail);
    c.posted = now;
    WriteRequest w;
    w.src = s.region->base + s.offset + c.offset;
    w.length = c.length;
    w.remote_key = s.cts.region.keys[*rail];
    w.remote_offset = s.cts.offset + c.offset;
    w.imm = ChunkImm::encode(ChunkImm::slot_of(c.message), c.index);
    w.cookie = ledger_.add(c);
    if (Status st = slot.rail->post_write(w); !st) {
      ledger_.confirm(w.cookie);
      scheduler_.release(*rail, c.length);
      // Its queue is full (back-pressure): it gets no more until it confirms something. Any
      // other error: the rail reports its failure separately.
      if (st.code() == ErrorCode::kNoResource) slot.backpressured = true;
      scheduler_.set_usable(*rail, false);
      continue;
    }
    if (replay) {
      s.op->mark_replayed();
      replay_.pop_front();
      slot.tel.replayed_chunks.fetch_add(1, std::memory_order_relaxed);
      slot.tel.replayed_bytes.fetch_add(c.length, std::memory_order_relaxed);
    } else {
      if (++s.next_chunk < s.nchunks)
        ++serve_;  // the next message of the window gets the next chunk
      else
        ready_.erase(ready_.begin() + static_cast<std::ptrdiff_t>(serve_));
    }
  }
}

void Channel::drop_send(std::map<std::uint64_t, Send>::iterator it) {
  for (const auto& c : ledger_.take_message(it->first))
    scheduler_.release(c.rail, c.length);
  std::erase_if(replay_, [&](const InflightChunk& c) { return c.message == it->first; });
  for (auto& slot : rails_)
    std::erase_if(slot->awaiting_replay,
                  [&](const InflightChunk& c) { return c.message == it->first; });
  sends_.erase(it);
}

void Channel::on_confirmed(std::uint32_t rail, std::uint64_t cookie, std::uint64_t receive_ns) {
  const auto now = Clock::now();
  auto& s = *rails_[rail];
  s.health->on_heard(now);
  if (s.backpressured) {  // the rail's queue moved: it takes work again
    s.backpressured = false;
    update_usable(rail);
    if (!control_backlog_.empty()) flush_control();
  }
  if ((cookie & kControlCookieBit) && (cookie & kFailoverCookieBit)) {
    failover_inflight_.erase(cookie);
    return;
  }
  if (cookie & kControlCookieBit) {
    if (auto it = control_inflight_.find(cookie); it != control_inflight_.end()) {
      if (it->second.payload > 0) {
        s.tel.tx_bytes.fetch_add(it->second.payload, std::memory_order_relaxed);
        s.tel.tx_chunks.fetch_add(1, std::memory_order_relaxed);
      }
      control_inflight_.erase(it);
    }
    return;
  }
  // Any confirmation shows the rail moving data, even one for a chunk whose operation ended.
  s.last_progress = now;
  auto c = ledger_.confirm(cookie);
  if (!c) return;  // repeated or stale confirmation
  last_confirm_ = now;
  scheduler_.release(rail, c->length);
  s.busy_bytes += c->length;
  if (receive_ns > 0) {
    s.receive_time += std::chrono::nanoseconds(static_cast<std::int64_t>(receive_ns));
    s.receive_bytes += c->length;
  }
  if (scheduler_.inflight(rail) == 0 && s.busy_since) {
    // The last confirmation of a busy period comes a round trip after the link carried the last
    // byte; that round trip is not transmission time (it matters for a rail given one chunk at
    // a time).
    const auto period = now - *s.busy_since;
    const auto rtt = std::chrono::nanoseconds(static_cast<std::int64_t>(s.tel.rtt_ns.load()));
    s.busy_time += period - std::min<Clock::duration>(rtt, period / 2);
    s.busy_since.reset();
  }
  s.tel.tx_bytes.fetch_add(c->length, std::memory_order_relaxed);
  s.tel.tx_chunks.fetch_add(1, std::memory_order_relaxed);
  // The first replayed chunk confirmed on a surviving rail: traffic flows again.
  for (std::uint32_t i = 0; i < rails_.size(); ++i) {
    auto& f = *rails_[i];
    if (f.replay_confirm_pending && i != rail) {
      f.replay_confirm_pending = false;
      event(i, "first_replay_confirmed", fmt::format("on rail {} ({})", rail, s.nic.name));
    }
  }
  chunk_done(c->message);
  pump();
}

void Channel::chunk_done(std::uint64_t message) {
  if (auto it = sends_.find(message); it != sends_.end()) {
    if (++it->second.confirmed == it->second.nchunks) {
      auto op = it->second.op;
      sends_.erase(it);
      op->complete(Status::ok());
    }
  }
}

void Channel::on_refused(std::uint32_t rail, std::uint64_t cookie, const Status& why) {
  auto& s = *rails_[rail];
  s.health->on_heard(Clock::now());
  s.tel.errors.fetch_add(1, std::memory_order_relaxed);
  auto c = ledger_.confirm(cookie);
  if (!c) return;
  scheduler_.release(rail, c->length);
  if (auto it = sends_.find(c->message); it != sends_.end()) {
    auto op = it->second.op;
    drop_send(it);
    op->complete(why.with_context(fmt::format("message #{} to {}", c->message, label_)));
  }
  pump();
}

void Channel::on_arrived(std::uint32_t rail, std::uint32_t imm, std::size_t length) {
  auto& s = *rails_[rail];
  s.health->on_heard(Clock::now());
  s.tel.rx_bytes.fetch_add(length, std::memory_order_relaxed);
  s.tel.rx_chunks.fetch_add(1, std::memory_order_relaxed);
  if (ChunkImm::slot(imm) == ChunkImm::kOneSidedSlot) return;  // one-sided: the sender tracks it
  auto it = recv_slots_.find(ChunkImm::slot(imm));
  if (it == recv_slots_.end()) return;  // a late duplicate of a completed or failed receive
  auto& r = it->second;
  r.last_arrival = Clock::now();
  if (r.arrivals.mark(ChunkImm::index(imm)) && r.arrivals.complete()) {
    auto op = r.op;
    recv_slots_.erase(it);
    op->complete(Status::ok());
  }
}

}  // namespace r2ccl

// Fence, then reconcile, then replay: the failover protocol with the peer (failover messages
// on a surviving rail, or out of band), and what a fenced rail left unconfirmed.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "channel/channel.h"
#include "channel/protocol.h"
#include "r2ccl/runtime/log.h"

namespace r2ccl {

using std::chrono::milliseconds;

namespace {
// A fence-type message about one rail (fence, its acknowledgement, keepalive).
Bytes rail_notice(std::uint8_t type, std::uint32_t rail, std::uint32_t epoch,
                  const std::string& why) {
  ByteWriter w;
  w.u8(type).u32(rail).u32(epoch).str(why);
  return w.take();
}

// A failover message as the rails carry it: sequence number 0, then its type.
std::shared_ptr<const Bytes> framed_failover(const Bytes& message) {
  ByteWriter w(9 + message.size());
  w.u64(0)
      .u8(static_cast<std::uint8_t>(ControlType::kFailover))
      .raw(message.data(), message.size());
  return std::make_shared<const Bytes>(w.take());
}
}  // namespace

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
  // Without any path the peer learns of the failure from its own detection.
  if (Status st = send_failover(rail_notice(type, rail, epoch, why)); !st)
    R2CCL_INFO("cannot tell {} about rail {}: {}", label_, rail, st.message());
}

Status Channel::send_failover(const Bytes& message) {
  return post_failover(framed_failover(message), true);
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

void Channel::listen_for_life(std::uint32_t index, Clock::time_point now) {
  auto& s = *rails_[index];
  if (!s.rail || !s.health->connected()) return;
  // A quarter of the silence limit without a frame or a probe reply: ask the kernel.
  if (s.health->silence(now) >= s.health->silence_limit() / 4)
    if (const auto age = s.rail->since_acknowledged())
      s.health->on_heard(now - std::chrono::duration_cast<Clock::duration>(*age));
  if (s.health->state() != RailState::kSuspect || now - s.last_keepalive < config_.probe_interval)
    return;
  s.last_keepalive = now;
  // Not kept for a resend elsewhere: it means something only on this rail. Its confirmation
  // (a failover cookie with no entry) is a sign of life like any other.
  const std::uint64_t cookie = kControlCookieBit | kFailoverCookieBit | next_failover_cookie_++;
  const auto message = framed_failover(
      rail_notice(static_cast<std::uint8_t>(FenceType::kKeepalive), index, s.epoch, ""));
  if (Status st = s.rail->post_urgent_control(message, cookie);
      !st && st.code() != ErrorCode::kNoResource)
    R2CCL_DEBUG("keepalive on rail {} to {}: {}", index, label_, st.message());
}

void Channel::on_control_path(Bytes message) {
  ByteReader r(message);
  const auto type = static_cast<FenceType>(r.u8());
  const auto index = r.u32();
  const auto epoch = r.u32();
  if (!r.ok() || index >= rails_.size()) {
    R2CCL_WARN_LIMITED("malformed control-path message from {}", label_);
    return;
  }
  if (type == FenceType::kReplayQuery) return answer_replay_query(index, epoch, r);
  if (type == FenceType::kReplayAnswer) return on_replay_answer(index, r);
  if (type == FenceType::kKeepalive) return;  // deliver_control counted it as a sign of life
  std::string why = r.str(4096);
  if (!r.finish("fence notice").is_ok()) {
    R2CCL_WARN_LIMITED("malformed control-path message from {}", label_);
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
    R2CCL_WARN_LIMITED("malformed replay query from {}", label_);
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
    R2CCL_WARN_LIMITED("malformed replay query from {}", label_);
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
    R2CCL_WARN_LIMITED("unexpected replay answer from {} (query {})", label_, id);
    return;
  }
  auto chunks = std::move(q->second.chunks);
  replay_queries_.erase(q);
  std::vector<bool> want(n);
  for (std::uint32_t i = 0; i < n; ++i)
    want[i] = r.u8() != 0;
  if (!r.finish("replay answer").is_ok()) {
    R2CCL_WARN_LIMITED("malformed replay answer from {}", label_);
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

}  // namespace r2ccl

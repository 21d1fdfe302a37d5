// The chunk pump: chunks posted on the rails by the scheduler, and their completions.
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

// Posts chunks while some rail has room: replays first, then new chunks round-robin over the
// oldest messages in flight (kServeWindow).
void Channel::pump() {
  std::size_t blocked = 0;  // messages in a row whose rails had no room
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
    auto rail = scheduler_.pick(c.length, sit->second.rails);
    if (!rail) {
      // A message kept to some rails waits for them; the others in the window may still go.
      if (replay || sit->second.rails == kAllRails ||
          ++blocked >= std::min(kServeWindow, ready_.size()))
        return;
      ++serve_;
      continue;
    }
    blocked = 0;
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
    w.src_device = s.region->device;
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
      control_unconfirmed_bytes_.fetch_sub(it->second.message->size(), std::memory_order_relaxed);
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

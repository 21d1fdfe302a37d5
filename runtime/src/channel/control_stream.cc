// The control stream: sequenced, confirmed, replayed control messages, handled in order
// through a bounded reorder buffer.
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

namespace {
// kAbort / kAbortSend after the sequence number: the reason, then kAbortedFlag where the peer
// ended the message itself (kAborted) rather than refused it (a size mismatch: kInvalidArgument).
Status abort_reason(ByteReader& r) {
  std::string why = r.str(4096);
  const bool aborted = r.remaining() > 0 && r.u8() == channel_protocol::kAbortedFlag;
  return {aborted ? ErrorCode::kAborted : ErrorCode::kInvalidArgument, std::move(why)};
}
}  // namespace

using std::chrono::milliseconds;

void Channel::keep_early_abort(std::map<std::uint64_t, Status>& early, std::uint64_t seq,
                               std::uint64_t next, std::string_view half, Status why) {
  if (seq < next || (seq & ChunkImm::kOneSidedBit) != 0) return;  // ended already, or one-sided
  const Early e = judge_early(seq, next, kEarlyWindow, early.size());
  if (e.violation)
    return protocol_violation(fmt::format("{} ended its {} of message {}, {}", label_, half,
                                          message_number(seq), *e.violation));
  if (!e.stale) early[seq] = std::move(why);
}

bool Channel::end_if_aborted_early(std::map<std::uint64_t, Status>& early, std::uint64_t seq,
                                   const OpPtr& op) {
  auto it = early.find(seq);
  if (it == early.end()) return false;
  Status why = std::move(it->second);
  early.erase(it);
  op->complete(why);
  return true;
}

void Channel::send_control(Bytes message, std::size_t payload) {
  ControlEntry e;
  e.seq = next_control_seq_++;
  e.payload = payload;
  store_le(message.data(), e.seq);  // where control_writer left room for it
  control_unconfirmed_bytes_.fetch_add(message.size(), std::memory_order_relaxed);
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
      R2CCL_WARN_LIMITED(
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
      protocol_violation(
          fmt::format("{} sent control message #{} while #{} is missing: more "
                      "than {} messages or {} bytes ahead of the gap",
                      label_, seq, control_next_, kControlReorderWindow, kControlReorderBytes));
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
      R2CCL_WARN_LIMITED("{} sent a malformed clear-to-send on rail {}", label_, rail);
      return;
    }
    if (sends_.count(c.seq) != 0) {
      start_send(c.seq, c);
    } else if (c.seq >= next_send_seq_) {
      // A receiver has at most ChunkImm::kSlots receives posted: a clear-to-send further ahead of
      // this side's sends is not one a peer following the protocol sends.
      const Early e = judge_early(c.seq, next_send_seq_, ChunkImm::kSlots, early_cts_.size());
      if (e.violation)
        return protocol_violation(fmt::format("{} sent a clear-to-send for message {}, {}", label_,
                                              message_number(c.seq), *e.violation));
      if (!e.stale) early_cts_[c.seq] = c;
    }
    // else: the send already ended (it failed)
    return;
  }
  if (type == ControlType::kEager) {
    const auto seq2 = r.u64();
    const auto length = r.u64();
    if (!r.ok() || message.size() - 25 != length) {
      R2CCL_WARN_LIMITED("{} sent a malformed eager message on rail {}", label_, rail);
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
      R2CCL_WARN_LIMITED("{} sent a malformed request-to-send on rail {}", label_, rail);
      return;
    }
    auto it = recv_slots_.find(ChunkImm::slot_of(seq2));
    if (it != recv_slots_.end() && it->second.seq == seq2) {
      if (!needs_cts(it->second.length)) {
        // A receive of eager size: the sender is out of eager credit and asks for a
        // clear-to-send instead; another size is refused.
        if (length == it->second.length && it->second.arrivals.chunks() == 0) {
          send_cts(it->second);
        } else {
          auto op = it->second.op;
          const auto posted = it->second.length;
          recv_slots_.erase(it);
          refuse_send(op, seq2, length, posted);
        }
      }
      // else: the clear-to-send already went; the sender checks the length against it
    } else if (seq2 >= next_recv_seq_) {
      const Early e = judge_early(seq2, next_recv_seq_, kEarlyWindow, early_rts_.size());
      if (e.violation)
        return protocol_violation(
            fmt::format("{} announced message {}, {}", label_, message_number(seq2), *e.violation));
      if (!e.stale) early_rts_[seq2] = length;
    }
    return;
  }
  if (type == ControlType::kAbortSend) {
    const auto seq2 = r.u64();
    Status why = abort_reason(r);
    if (auto it = sends_.find(seq2); it != sends_.end()) {
      auto op = it->second.op;
      drop_send(it);
      op->complete(why);
    } else {
      keep_early_abort(early_abort_sends_, seq2, next_send_seq_, "receive", std::move(why));
    }
    return;
  }
  if (type == ControlType::kAbort) {
    const auto seq2 = r.u64();
    Status why = abort_reason(r);
    auto it = recv_slots_.find(ChunkImm::slot_of(seq2));
    if (it != recv_slots_.end() && it->second.seq == seq2) {
      auto op = it->second.op;
      recv_slots_.erase(it);
      op->complete(why);
    } else {
      keep_early_abort(early_aborts_, seq2, next_recv_seq_, "send", std::move(why));
    }
    return;
  }
  if (type == ControlType::kUser) {
    // After the sequence number and type: the service byte, then the payload.
    if (ctx_.on_user_message) ctx_.on_user_message(peer_, message.subspan(9));
    return;
  }
  if (type == ControlType::kCredit) {
    const auto bytes = r.u64();
    if (!r.finish("eager credit").is_ok()) {
      R2CCL_WARN_LIMITED("{} sent a malformed eager credit on rail {}", label_, rail);
      return;
    }
    if (bytes > eager_unconsumed_)
      return protocol_violation(
          fmt::format("{} returned {} bytes of eager credit, but only {} were outstanding", label_,
                      bytes, eager_unconsumed_));
    eager_unconsumed_ -= bytes;
    return;
  }
  if (type == ControlType::kGoodbye) {
    on_peer_left("it disconnected");
    return;
  }
  R2CCL_WARN_LIMITED("{} sent an unknown control message type {} on rail {}", label_,
                     static_cast<int>(type), rail);
}

void Channel::send_goodbye() {
  if (!dead_) send_control(control_writer(ControlType::kGoodbye).take());
}

void Channel::send_user_message(std::uint8_t service, std::span<const std::byte> payload) {
  ByteWriter w = control_writer(ControlType::kUser, 1 + payload.size());
  w.u8(service).raw(payload.data(), payload.size());
  send_control(w.take());
}

void Channel::protocol_violation(const std::string& what) {
  const Status why(ErrorCode::kProtocol, what);
  R2CCL_WARN("{}", what);
  if (ctx_.on_fatal) ctx_.on_fatal(why);
  on_peer_left(what);
}

}  // namespace r2ccl

// The message protocol: eager messages, request-to-send / clear-to-send, and aborts on a
// size mismatch.
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

void Channel::enter_epoch(std::uint64_t epoch) {
  epoch = std::min(epoch, kMaxEpoch);
  if (epoch <= epoch_) return;
  epoch_ = epoch;
  const std::uint64_t first = epoch << kEpochShift;
  next_send_seq_ = std::max(next_send_seq_, first);
  next_recv_seq_ = std::max(next_recv_seq_, first);
  early_cts_.erase(early_cts_.begin(), early_cts_.lower_bound(next_send_seq_));
  early_rts_.erase(early_rts_.begin(), early_rts_.lower_bound(next_recv_seq_));
  early_aborts_.erase(early_aborts_.begin(), early_aborts_.lower_bound(next_recv_seq_));
  early_abort_sends_.erase(early_abort_sends_.begin(),
                           early_abort_sends_.lower_bound(next_send_seq_));
  const auto stale = unexpected_.lower_bound(next_recv_seq_);
  for (auto it = unexpected_.begin(); it != stale; ++it) {
    unexpected_bytes_ -= it->second.size();
    consumed_eager(it->second.size());
  }
  unexpected_.erase(unexpected_.begin(), stale);
}

Channel::Early Channel::judge_early(std::uint64_t seq, std::uint64_t next, std::uint64_t window,
                                    std::size_t kept) const {
  // This side's program is in `now`; a channel enters an epoch only with its first message in it.
  const std::uint64_t now =
      std::max(epoch_, ctx_.epoch ? ctx_.epoch->load(std::memory_order_relaxed) : 0);
  const std::uint64_t epoch = epoch_of(seq);
  Early e;
  if (epoch < now) {
    e.stale = true;
    return e;
  }
  // However many epochs ahead: a legal program may run any number of collectives ahead of a
  // busy peer (its eager sends complete once queued). What is kept is bounded by its size
  // instead: `window` entries, each at most `window` into its epoch.
  const std::uint64_t ahead = epoch == epoch_of(next) ? seq - next : index_of(seq);
  if (ahead >= window)
    e.violation =
        fmt::format("{} ahead of the next one here in its epoch (at most {})", ahead, window - 1);
  else if (kept >= window)
    e.violation =
        fmt::format("with {} of its messages kept early here already (at most {})", kept, window);
  return e;
}

void Channel::post_send(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                        Clock::time_point deadline, std::uint64_t rails) {
  if (fail_if_dead(op)) return;
  const bool eager = !needs_cts(length) && eager_unconsumed_ + length <= kEagerCredit;
  // Device memory goes eagerly through a host copy, made before the message takes a number.
  Bytes staged;
  if (eager && region->device != nullptr) {
    staged.resize(length);
    if (Status st = region->device->to_host(staged.data(), region->base + offset, length); !st) {
      op->complete(st.with_context("send"));
      return;
    }
  }
  const auto seq = next_send_seq_++;
  if (end_if_aborted_early(early_abort_sends_, seq, op)) {
    early_cts_.erase(seq);
    return;
  }
  Send s = make_send(std::move(op), std::move(region), offset, length, deadline);
  s.rails = rails;
  if (eager) {
    // Eager: the data travels inside a reliable control message (kept, and replayed on another
    // rail, until the peer confirms it), so the send is complete once it is queued — buffered,
    // as MPI's eager sends are. A receiver that posted another size reports the mismatch.
    // Out of eager credit, the same message takes the request-to-send path below.
    eager_unconsumed_ += length;
    ByteWriter w = control_writer(ControlType::kEager, 16 + length);
    w.u64(seq).u64(length);
    w.raw(staged.empty() ? s.region->base + offset : staged.data(), length);
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
  if (end_if_aborted_early(early_aborts_, seq, op)) {
    early_rts_.erase(seq);
    return;
  }
  if (auto it = unexpected_.find(seq); it != unexpected_.end()) {
    // An eager message came first: no clear-to-send (its sender has finished).
    Bytes data = std::move(it->second);
    unexpected_bytes_ -= data.size();
    unexpected_.erase(it);
    finish_eager(op, region, offset, length, seq, data);
    return;
  }
  // A receive of eager size waits for the data without a clear-to-send, unless its sender, out
  // of eager credit, announced it (request-to-send of the same size); a sender of another size
  // announces itself and is refused.
  bool rendezvous = needs_cts(length);
  if (auto it = early_rts_.find(seq); it != early_rts_.end()) {
    const auto sent = it->second;
    early_rts_.erase(it);
    if (!needs_cts(length) && sent != length) return refuse_send(op, seq, sent, length);
    rendezvous = true;
  }
  if (length == 0) {  // nothing to move: the clear-to-send tells the sender so
    Recv r;
    r.seq = seq;
    r.offset = offset;
    r.region = std::move(region);
    send_cts(r);
    op->complete(Status::ok());
    return;
  }
  Recv r;
  r.op = std::move(op);
  r.region = std::move(region);
  r.seq = seq;
  r.offset = offset;
  r.length = length;
  r.deadline = deadline;
  if (rendezvous) send_cts(r);
  recv_slots_.emplace(slot, std::move(r));
}

void Channel::send_cts(Recv& r) {
  const std::uint32_t chunk = chunk_for(r.length);
  ByteWriter w = control_writer(ControlType::kCts);
  w.u64(r.seq).u64(r.length).u32(chunk).u64(r.offset);
  RemoteRegion{r.region->id, r.region->length, r.region->keys}.encode(w);
  send_control(w.take());
  if (r.length > 0) r.arrivals = ArrivalSet(chunk_count(r.length, chunk));
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
    // The receive already ended (failed at its deadline), or its epoch is over here.
    if (seq < next_recv_seq_ || unexpected_.count(seq) != 0 ||
        judge_early(seq, next_recv_seq_, ~std::uint64_t{0}, 0).stale) {
      consumed_eager(data.size());
      return;
    }
    // Kept until its receive is posted (the only copy besides the one into place), within the
    // sender's eager credit.
    if (unexpected_bytes_ + data.size() > kEagerCredit)
      return protocol_violation(fmt::format(
          "{} sent eager message {} ({} bytes) beyond its eager credit: {} bytes already wait "
          "for receives here (at most {})",
          label_, message_number(seq), data.size(), unexpected_bytes_, kEagerCredit));
    unexpected_bytes_ += data.size();
    unexpected_.emplace(seq, Bytes(data.begin(), data.end()));
    return;
  }
  Recv r = std::move(it->second);
  recv_slots_.erase(it);
  finish_eager(r.op, r.region, r.offset, r.length, seq, data);
}

void Channel::consumed_eager(std::size_t bytes) {
  eager_returnable_ += bytes;
  if (eager_returnable_ >= kCreditReturn) return_credit();
}

void Channel::return_credit() {
  if (eager_returnable_ == 0 || dead_) return;
  ByteWriter w = control_writer(ControlType::kCredit, 8);
  w.u64(eager_returnable_);
  eager_returnable_ = 0;
  send_control(w.take());
}

void Channel::finish_eager(const OpPtr& op, const RegionPtr& region, std::size_t offset,
                           std::size_t length, std::uint64_t seq, std::span<const std::byte> data) {
  consumed_eager(data.size());
  if (data.size() != length) {
    op->complete({ErrorCode::kInvalidArgument,
                  size_mismatch(seq, label_, ctx_.self_label, data.size(), length)});
    return;
  }
  op->complete(copy_from_host(region->device, region->base + offset, data.data(), length));
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

}  // namespace r2ccl

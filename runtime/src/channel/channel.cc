// The multi-rail channel to one peer: construction, the rails' events, the periodic tick
// (health, deadlines), the peer leaving, and what it reports.
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

void Channel::event(std::uint32_t index, const std::string& kind, const std::string& detail) {
  if (ctx_.events)
    ctx_.events->add(RailEvent{wall_ns(), peer_, index, rails_[index]->nic.name, kind, detail});
}

void Channel::check_gone(Clock::time_point now) {
  if (!identity_.gone_on_close || dead_ || !all_closed_since_) return;
  if (attached() > 0) {
    all_closed_since_.reset();
    return;
  }
  // The peer's kernel closed every connection; a process that is still there answers probes.
  // A live peer also closes rails it fenced, and on a loaded machine its probe replies can lag
  // by several probe timeouts: the grace spans five of them (a second by default), so that a
  // busy peer is not taken for one that ended.
  const auto grace = std::max<Clock::duration>(
      {5 * config_.probe_interval, 5 * config_.probe_timeout, milliseconds(100)});
  if (now - *all_closed_since_ < grace || now - last_probe_reply_ < grace) return;
  on_peer_left(fmt::format(
      "its process ended (it closed every rail, and its NICs have not answered probes for {}ms)",
      std::chrono::duration_cast<milliseconds>(now -
                                               std::max(*all_closed_since_, last_probe_reply_))
          .count()));
}

void Channel::forgive_stall(Clock::time_point now, Clock::duration gap) {
  auto later = [&](Clock::time_point t) {
    return t == Clock::time_point{} ? t : std::min(now, t + gap);
  };
  for (auto& s : rails_) {
    s->health->forgive(now, gap);
    s->last_progress = later(s->last_progress);
  }
  last_probe_reply_ = later(last_probe_reply_);
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
    listen_for_life(i, now);
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
  return_credit();  // eager credit consumed since the last batch went back
  // Control messages queued while no rail was usable (every rail SUSPECT for a moment, say, on a
  // busy machine) go out once one is again: a rail that comes back from SUSPECT does not call
  // for them itself.
  flush_control();
  pump();

  // Deadlines.
  const bool none_left = !any_usable();
  const std::string prefix =
      none_left ? fmt::format("no rail to {} survived; ", label_) : std::string();
  std::vector<std::pair<OpPtr, Status>> ended;
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
               fmt::format("{}{} {} of {} bytes to {} timed out after {}ms ({}); rails tried: {}",
                           prefix, (seq & ChunkImm::kOneSidedBit) ? "write" : "send",
                           (seq & ChunkImm::kOneSidedBit)
                               ? fmt::format("#{}", seq & ~ChunkImm::kOneSidedBit)
                               : message_number(seq),
                           s.length, label_, config_.timeout.count(), progress, rail_summary()));
    ended.emplace_back(s.op, why);
    drop_send(it++);
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
               fmt::format("{}receive {} of {} bytes from {} timed out after {}ms ({}); "
                           "rails tried: {}",
                           prefix, message_number(r.seq), r.length, label_, config_.timeout.count(),
                           progress, rail_summary()));
    ended.emplace_back(r.op, why);
    it = recv_slots_.erase(it);
  }
  // Completed after the walk: a completion's callback may post or end operations here.
  for (auto& [op, why] : ended) {
    op->complete(why);
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

void Channel::abandon_region(std::uint64_t region_id, const std::string& why) {
  std::vector<OpPtr> ended;
  for (auto it = sends_.begin(); it != sends_.end();) {
    if (!it->second.region || it->second.region->id != region_id) {
      ++it;
      continue;
    }
    const std::uint64_t seq = it->first;
    ended.push_back(it->second.op);
    drop_send(it++);
    if ((seq & ChunkImm::kOneSidedBit) == 0 && !dead_) {
      ByteWriter w = control_writer(ControlType::kAbort);
      w.u64(seq).str(why).u8(kAbortedFlag);
      send_control(w.take());
    }
  }
  for (auto it = recv_slots_.begin(); it != recv_slots_.end();) {
    if (!it->second.region || it->second.region->id != region_id) {
      ++it;
      continue;
    }
    const std::uint64_t seq = it->second.seq;
    ended.push_back(it->second.op);
    it = recv_slots_.erase(it);
    if (!dead_) {
      ByteWriter w = control_writer(ControlType::kAbortSend);
      w.u64(seq).str(why).u8(kAbortedFlag);
      send_control(w.take());
    }
  }
  // Completed after the walk: a completion's callback may post or end operations here.
  const Status status(ErrorCode::kAborted, why);
  for (auto& op : ended)
    op->complete(status);
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

}  // namespace r2ccl

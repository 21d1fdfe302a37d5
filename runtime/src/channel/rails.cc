// Rail lifecycle: connection, attachment, failure, re-admission, link and probe events.
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

bool Channel::attach(std::uint32_t index, std::shared_ptr<Rail> rail) {
  if (index >= rails_.size() || dead_) return false;
  auto& s = *rails_[index];
  const std::uint32_t epoch = rail->hello().epoch;
  const bool readmission = epoch > 0;
  // Both sides connected at once and the peer's connections won (become_acceptor): the one this
  // side opened on this rail was refused by the peer as soon as its handshake ended, before it
  // carried anything, so it gives way, and what it was given goes again on the peer's.
  const bool lost_race = s.rail && epoch == s.epoch && !identity_.connector &&
                         s.rail->hello().src_incarnation == ctx_.incarnation;
  if (s.rail) {
    if (epoch <= s.epoch && !lost_race) return false;  // a duplicate or stale connection
    // The peer re-established the rail, so it has fenced the old connection: so do we.
    fence(index,
          lost_race ? "the peer's connection won (both sides connected at once)"
                    : "replaced by a new connection from the peer",
          false);
  }
  if (lost_race) {
    s.peer_fenced_epoch = s.epoch;
    maybe_replay(index);
  } else if (epoch > s.epoch) {
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
  s.ever_attached = true;
  s.host_local = ctx_.provider->host_local(s.rail->remote_address());
  s.rail->start(&s.sink);
  if (ctx_.on_rail_attached) ctx_.on_rail_attached(peer_, index, s.rail->remote_address());
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

std::string Channel::missing_rails(bool never_connected) const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < rails_.size(); ++i)
    if (!rails_[i]->rail && !(never_connected && rails_[i]->ever_attached))
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
    if (s.host_local) {  // the kernel loops its traffic back: it never reached this NIC
      R2CCL_DEBUG("{} {} ignored on rail {} to {}: the peer is on this host", ifname,
                  running ? "up" : "down", i, label_);
      continue;
    }
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

}  // namespace r2ccl

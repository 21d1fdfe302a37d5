#include "health/prober.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "core/crypto.h"
#include "progress/asio.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/probe_protocol.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {
namespace {

namespace asio = boost::asio;
using asio::ip::udp;
using Clock = std::chrono::steady_clock;

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}

class UdpProber final : public Prober, public std::enable_shared_from_this<UdpProber> {
 public:
  UdpProber(ProgressEngine& engine, const Token& token, std::uint64_t me,
            std::chrono::milliseconds interval, ReplyHandler handler)
      : engine_(engine),
        me_(me),
        interval_(interval),
        timer_(engine.io()),
        handler_(std::move(handler)) {
    tag_ = Prober::tag_of(token);
  }

  // Per rail: a socket bound to the NIC (SO_BINDTODEVICE), so that probes cross that NIC and
  // no other. Where there is a NIC to bind to, a twin on the same address and port without the
  // binding carries the probes to and from peers on this host: the kernel loops those back
  // without the NIC, and refuses to send them from a socket bound to a NIC whose link is down.
  Status open(const std::vector<RailNic>& nics) {
    for (const auto& nic : nics) {
      auto s = std::make_unique<Device>(engine_.io());
      boost::system::error_code ec;
      const auto address = asio::ip::make_address_v4(nic.address, ec);
      const bool twin = !nic.netdev.empty();
      if (!ec) s->nic.socket.open(udp::v4(), ec);
      if (!ec && twin) {
        s->nic.socket.set_option(udp::socket::reuse_address(true), ec);
        (void)::setsockopt(s->nic.socket.native_handle(), SOL_SOCKET, SO_BINDTODEVICE,
                           nic.netdev.c_str(), static_cast<socklen_t>(nic.netdev.size()));
      }
      if (!ec) s->nic.socket.bind(udp::endpoint(address, 0), ec);
      if (ec)
        return {ErrorCode::kNetwork, fmt::format("cannot open the probe socket on {} ({}): {}",
                                                 nic.name, nic.address, ec.message())};
      s->port = s->nic.socket.local_endpoint().port();
      if (twin) {
        s->host.socket.open(udp::v4(), ec);
        if (!ec) s->host.socket.set_option(udp::socket::reuse_address(true), ec);
        if (!ec) s->host.socket.bind(udp::endpoint(address, s->port), ec);
        if (ec) {
          R2CCL_WARN(
              "prober: no probe socket for peers on this host on {} ({}:{}): {}; their "
              "probes stop while {} is down",
              nic.name, nic.address, s->port, ec.message(), nic.netdev);
          boost::system::error_code ignored;
          s->host.socket.close(ignored);
        }
      }
      devices_.push_back(std::move(s));
    }
    return Status::ok();
  }

  void run() {
    engine_.call([this] {
      for (std::size_t i = 0; i < devices_.size(); ++i) {
        receive(i, false);
        if (devices_[i]->host.socket.is_open()) receive(i, true);
      }
      arm_timer();
    });
  }

  std::uint16_t port(std::size_t device) const override { return devices_[device]->port; }

  void accept_tag(std::uint64_t tag) override {
    if (tag == tag_ || std::find(tags_.begin(), tags_.end(), tag) != tags_.end()) return;
    if (tags_.size() >= kMaxTags) tags_.erase(tags_.begin());
    tags_.push_back(tag);
  }

  void add_target(int peer, std::uint64_t incarnation, std::uint32_t rail,
                  const std::string& address, std::uint16_t port, std::uint64_t tag,
                  bool on_host) override {
    if (tag == 0) tag = tag_;
    boost::system::error_code ec;
    auto a = asio::ip::make_address_v4(address, ec);
    if (ec || rail >= devices_.size()) {
      R2CCL_WARN("prober: bad probe target for peer {} rail {}: '{}'", peer, rail, address);
      return;
    }
    const Target t{static_cast<std::uint32_t>(peer), incarnation, rail,
                   udp::endpoint(a, port),           tag,         on_host};
    auto same = std::find_if(targets_.begin(), targets_.end(),
                             [&](const Target& o) { return o.peer == t.peer && o.rail == t.rail; });
    if (same == targets_.end()) {
      targets_.push_back(t);
    } else {
      same->incarnation = t.incarnation;
      same->to = t.to;  // replies to the probes sent to the old address no longer count
      same->tag = t.tag;
      same->on_host = t.on_host;
    }
  }

  void remove_targets(int peer) override {
    std::erase_if(targets_,
                  [&](const Target& t) { return t.peer == static_cast<std::uint32_t>(peer); });
  }

  void stop() override {
    engine_.call([this] {
      stopped_ = true;
      timer_.cancel();
      boost::system::error_code ec;
      for (auto& d : devices_) {
        d->nic.socket.close(ec);
        d->host.socket.close(ec);
      }
    });
  }

 private:
  struct Socket {
    explicit Socket(asio::io_context& io) : socket(io) {}
    udp::socket socket;
    std::array<std::uint8_t, 128> buffer{};
    udp::endpoint from;
  };
  // A rail's probe sockets: `nic` bound to its NIC, `host` (open only where there is a NIC to
  // bind to) for peers on this host, both on the same address and port.
  struct Device {
    explicit Device(asio::io_context& io) : nic(io), host(io) {}
    Socket nic, host;
    std::uint16_t port = 0;
  };
  // A probe sent and not answered yet: sequence `seq` (0: none), sent at `time_ns`.
  struct InFlight {
    std::uint64_t seq = 0;
    std::uint64_t time_ns = 0;
  };
  // Probes remembered per target: a reply later than this many probe intervals is ignored.
  static constexpr std::size_t kInFlight = 64;
  struct Target {
    std::uint32_t peer;
    std::uint64_t incarnation;
    std::uint32_t rail;
    udp::endpoint to;
    std::uint64_t tag = 0;  // what its probes carry: the channel's token's
    bool on_host = false;   // the rail stays on this host: probed through the unbound twin
    std::uint64_t seq = 0;
    std::array<InFlight, kInFlight> in_flight{};  // sequence s in slot s % kInFlight
  };

  void arm_timer() {
    timer_.expires_after(interval_);
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped_) return;
      self->send_probes();
      self->arm_timer();
    });
  }

  void send_probes() {
    for (auto& t : targets_) {
      ProbePacket p;
      p.type = ProbePacket::Type::kRequest;
      p.tag = t.tag;
      p.src = me_;
      p.dst = t.incarnation;
      p.peer = t.peer;
      p.rail = t.rail;
      p.sequence = ++t.seq;
      p.send_time_ns = now_ns();
      t.in_flight[p.sequence % kInFlight] = InFlight{p.sequence, p.send_time_ns};
      send(t.rail, t.on_host, p, t.to);
    }
  }

  void send(std::size_t device, bool on_host, const ProbePacket& packet, const udp::endpoint& to) {
    auto buf = std::make_shared<std::array<std::uint8_t, ProbePacket::kSize>>(packet.encode());
    auto& d = *devices_[device];
    auto& socket = on_host && d.host.socket.is_open() ? d.host.socket : d.nic.socket;
    socket.async_send_to(asio::buffer(*buf), to, [buf](boost::system::error_code, std::size_t) {
      // A probe that cannot be sent (link down, black hole)
      // is simply not answered.
    });
  }

  void receive(std::size_t device, bool host) {
    auto& s = host ? devices_[device]->host : devices_[device]->nic;
    s.socket.async_receive_from(
        asio::buffer(s.buffer), s.from,
        [self = shared_from_this(), device, host](boost::system::error_code ec, std::size_t n) {
          if (self->stopped_) return;
          if (!ec) self->on_packet(device, host, n);
          if (ec == asio::error::operation_aborted) return;
          self->receive(device, host);
        });
  }

  void on_packet(std::size_t device, bool host, std::size_t n) {
    auto& s = host ? devices_[device]->host : devices_[device]->nic;
    const auto p = ProbePacket::decode(s.buffer.data(), n);
    if (!p) return;
    if (p->type == ProbePacket::Type::kRequest && p->dst == me_ &&
        (p->tag == tag_ || std::find(tags_.begin(), tags_.end(), p->tag) != tags_.end())) {
      // Around the NIC where this side probes the requester's rail so too.
      const bool on_host = std::any_of(targets_.begin(), targets_.end(), [&](const Target& t) {
        return t.on_host && t.incarnation == p->src && t.rail == device;
      });
      send(device, on_host, p->reply(), s.from);
      return;
    }
    if (p->type == ProbePacket::Type::kReply && p->src == me_) on_reply(device, *p, s.from);
  }

  // A reply counts only if it answers a probe this prober sent and that is not answered yet, and
  // comes from where that probe went, on the rail's own socket (review m6): the tag is the same
  // for every probe of the job, so a copied or made-up reply must not keep a dead rail alive.
  // The round trip is measured from the send time kept here, not the one the packet carries.
  void on_reply(std::size_t device, const ProbePacket& p, const udp::endpoint& from) {
    auto t = std::find_if(targets_.begin(), targets_.end(),
                          [&](const Target& o) { return o.peer == p.peer && o.rail == p.rail; });
    if (t == targets_.end() || t->rail != device || from != t->to || p.dst != t->incarnation ||
        p.tag != t->tag || p.sequence == 0)
      return;
    auto& sent = t->in_flight[p.sequence % kInFlight];
    if (sent.seq != p.sequence) return;  // never sent, too old, or answered already
    sent.seq = 0;
    const auto rtt = std::chrono::nanoseconds(static_cast<std::int64_t>(now_ns() - sent.time_ns));
    handler_(static_cast<int>(p.peer), p.rail, rtt);
  }

  ProgressEngine& engine_;
  std::uint64_t me_;
  std::chrono::milliseconds interval_;
  asio::steady_timer timer_;
  ReplyHandler handler_;
  std::uint64_t tag_ = 0;
  std::vector<std::uint64_t> tags_;  // tags of peers' tokens also answered (accept_tag)
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<Target> targets_;
  bool stopped_ = false;
};

}  // namespace

std::uint64_t Prober::tag_of(const Token& token) {
  // Derived from the token (an HMAC), never a part of it: probes go out in the clear.
  static constexpr std::string_view kLabel = "r2ccl probe tag";
  std::uint64_t tag = 0;
  if (auto mac = crypto::hmac(
          token, {std::span<const std::uint8_t>(
                     reinterpret_cast<const std::uint8_t*>(kLabel.data()), kLabel.size())}))
    std::memcpy(&tag, mac->data(), sizeof tag);
  return tag;
}

Result<std::unique_ptr<Prober>> Prober::open(ProgressEngine& engine,
                                             const std::vector<RailNic>& nics, const Token& token,
                                             std::uint64_t my_incarnation,
                                             std::chrono::milliseconds interval,
                                             ReplyHandler on_reply) {
  auto p =
      std::make_shared<UdpProber>(engine, token, my_incarnation, interval, std::move(on_reply));
  R2CCL_RETURN_IF_ERROR(p->open(nics));
  p->run();
  struct Handle final : Prober {
    std::shared_ptr<UdpProber> impl;
    std::uint16_t port(std::size_t d) const override { return impl->port(d); }
    void add_target(int peer, std::uint64_t incarnation, std::uint32_t rail, const std::string& a,
                    std::uint16_t port, std::uint64_t tag, bool on_host) override {
      impl->add_target(peer, incarnation, rail, a, port, tag, on_host);
    }
    void accept_tag(std::uint64_t tag) override { impl->accept_tag(tag); }
    void remove_targets(int peer) override { impl->remove_targets(peer); }
    void stop() override { impl->stop(); }
    ~Handle() override { impl->stop(); }
  };
  auto h = std::make_unique<Handle>();
  h->impl = std::move(p);
  return std::unique_ptr<Prober>(std::move(h));
}

}  // namespace r2ccl

#include "r2ccl/runtime/endpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <cstring>
#include <limits>
#include <thread>

#include "channel/channel.h"
#include "channel/protocol.h"
#include "common/handshake.h"
#include "core/crypto.h"
#include "health/prober.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/topology.h"
#include "topology/link_watcher.h"

namespace r2ccl {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// Peers that left are remembered (their ids fail with their name) up to this many.
constexpr std::size_t kMaxDeparted = 256;
// The compact handle: u32 magic | u8 version | u8 provider | u8 rails | u64 incarnation |
// token | rails x (IPv4, u16 port, u16 probe port).
constexpr std::uint32_t kHandleMagic = 0x48453252;  // "R2EH"
constexpr std::size_t kHandleHeader = 4 + 1 + 1 + 1 + 8 + 16;
constexpr std::size_t kHandleRail = 4 + 2 + 2;

std::string default_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "host");
  return fmt::format("{}:{}", host, ::getpid());
}

std::uint8_t provider_code(std::string_view p) {
  return p == "verbs" ? 1 : 0;
}

Result<std::pair<std::array<std::uint8_t, 4>, std::uint16_t>> ipv4_port(const Bytes& endpoint) {
  ByteReader r(endpoint);
  const std::string host = r.str(64);
  const auto port = r.u16();
  const auto a = parse_ipv4(host);
  if (!r.finish("endpoint").is_ok() || !a)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("rail endpoint '{}' is not an IPv4 address", host));
  return std::pair{*a, port};
}

Result<EndpointInfo> decode_handle(std::span<const std::byte> bytes) {
  ByteReader r(bytes);
  r.u32();  // magic, checked by the caller
  EndpointInfo info;
  const auto version = r.u8();
  if (version != EndpointInfo::kVersion)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint handle of version {} (this build reads {})", version,
                              EndpointInfo::kVersion));
  const auto provider = r.u8();
  if (r.ok() && provider > 1)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint handle names provider {} (0: tcp, 1: verbs)", provider));
  info.provider = provider == 1 ? "verbs" : "tcp";
  const auto n = r.u8();
  constexpr std::size_t kMostRails = (EndpointInfo::kHandleSize - kHandleHeader) / kHandleRail;
  if (r.ok() && (n == 0 || n > kMostRails))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint handle names {} rails (1 to {})", n, kMostRails));
  info.incarnation = r.u64();
  Token token{};
  r.raw(token.data(), token.size());
  info.token = token;
  for (std::uint8_t i = 0; i < n && r.ok(); ++i) {
    std::array<std::uint8_t, 4> a{};
    r.raw(a.data(), a.size());
    EndpointInfo::Rail rail;
    rail.address = fmt::format("{}.{}.{}.{}", a[0], a[1], a[2], a[3]);
    rail.nic = rail.address;
    rail.endpoint = encode_endpoint(rail.address, r.u16());
    rail.probe_port = r.u16();
    info.rails.push_back(std::move(rail));
  }
  R2CCL_RETURN_IF_ERROR(r.finish("endpoint handle"));
  info.name = fmt::format("{:016x}", info.incarnation);
  return info;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// EndpointInfo

Result<EndpointInfo> EndpointInfo::decode(std::span<const std::byte> bytes) {
  if (bytes.size() > kMaxBlob)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint blob of {} bytes exceeds {}", bytes.size(), kMaxBlob));
  ByteReader r(bytes);
  const auto magic = r.u32();
  if (r.ok() && magic == kHandleMagic) return decode_handle(bytes);
  if (!r.ok() || magic != kMagic)
    return Status(ErrorCode::kInvalidArgument,
                  "not an r2ccl endpoint blob or handle (wrong magic number)");
  EndpointInfo info;
  const auto version = r.u16();
  if (r.ok() && version != kVersion)
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("endpoint blob of version {} (this build reads {})", version, kVersion));
  info.name = r.str(256);
  info.incarnation = r.u64();
  info.provider = r.str(16);
  if (r.u8() != 0) {
    Token t{};
    r.raw(t.data(), t.size());
    info.token = t;
  }
  const auto n = r.u32();
  if (r.ok() && n > kMaxRails)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint blob names {} rails (at most {})", n, kMaxRails));
  for (std::uint32_t i = 0; i < n && r.ok(); ++i) {
    Rail rail;
    rail.nic = r.str(256);
    rail.address = r.str(64);
    rail.endpoint = r.blob(1024);
    rail.probe_port = r.u16();
    info.rails.push_back(std::move(rail));
  }
  R2CCL_RETURN_IF_ERROR(r.finish("endpoint blob"));
  if (info.rails.empty()) return Status(ErrorCode::kInvalidArgument, "endpoint blob names no rail");
  return info;
}

Bytes EndpointInfo::encode(bool with_token) const {
  ByteWriter w;
  w.u32(kMagic).u16(kVersion).str(name).u64(incarnation).str(provider);
  if (with_token && token) {
    w.u8(1).raw(token->data(), token->size());
  } else {
    w.u8(0);
  }
  w.u32(static_cast<std::uint32_t>(rails.size()));
  for (const auto& rail : rails)
    w.str(rail.nic).str(rail.address).blob(rail.endpoint).u16(rail.probe_port);
  return w.take();
}

Result<Bytes> EndpointInfo::encode_handle() const {
  const std::size_t most = (kHandleSize - kHandleHeader) / kHandleRail;
  if (rails.size() > most)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{} rails do not fit a {}-byte handle (at most {})", rails.size(),
                              kHandleSize, most));
  if (!token) return Status(ErrorCode::kInvalidArgument, "a handle needs the endpoint's token");
  ByteWriter w(kHandleSize);
  w.u32(kHandleMagic)
      .u8(static_cast<std::uint8_t>(kVersion))
      .u8(provider_code(provider))
      .u8(static_cast<std::uint8_t>(rails.size()))
      .u64(incarnation)
      .raw(token->data(), token->size());
  for (const auto& rail : rails) {
    R2CCL_ASSIGN_OR_RETURN(auto ap, ipv4_port(rail.endpoint));
    w.raw(ap.first.data(), ap.first.size()).u16(ap.second).u16(rail.probe_port);
  }
  return w.take();
}

std::string EndpointInfo::label() const {
  return fmt::format("peer '{}' (incarnation {:016x})", name, incarnation);
}

std::string blob_to_hex(std::span<const std::byte> blob) {
  std::string out;
  out.reserve(blob.size() * 2);
  for (auto b : blob)
    out += fmt::format("{:02x}", std::to_integer<unsigned>(b));
  return out;
}

Result<Bytes> blob_from_hex(std::string_view hex) {
  while (!hex.empty() && std::isspace(static_cast<unsigned char>(hex.back())))
    hex.remove_suffix(1);
  if (hex.size() % 2 != 0 || hex.size() > 2 * EndpointInfo::kMaxBlob)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint blob text of {} characters: not an even number of hex "
                              "digits up to {}",
                              hex.size(), 2 * EndpointInfo::kMaxBlob));
  Bytes out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    unsigned v = 0;
    for (int k = 0; k < 2; ++k) {
      const char c = hex[2 * i + static_cast<std::size_t>(k)];
      const int d = c >= '0' && c <= '9'   ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0)
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("endpoint blob text has '{}' at {}: not a hex digit", c,
                                  2 * i + static_cast<std::size_t>(k)));
      v = v * 16 + static_cast<unsigned>(d);
    }
    out[i] = std::byte(v);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Endpoint

struct Endpoint::Peer {
  EndpointInfo info;
  std::unique_ptr<Channel> channel;
};

struct Endpoint::Watchdog {
  explicit Watchdog(boost::asio::io_context& io) : timer(io) {}
  Clock::time_point last{};  // the previous round (loop thread)
  boost::asio::steady_timer timer;
  bool stopped = false;
};

Endpoint::Endpoint() = default;

Result<std::unique_ptr<Endpoint>> Endpoint::create(const Config& config, EndpointOptions options) {
  std::unique_ptr<Endpoint> e(new Endpoint());
  e->config_ = config;
  e->options_ = std::move(options);
  auto& info = e->info_;
  info.name = e->options_.name.empty() ? default_name() : e->options_.name;
  if (info.name.size() > 255)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("endpoint name of {} characters (at most 255)", info.name.size()));
  while (info.incarnation == 0) {
    std::array<std::uint8_t, sizeof info.incarnation> raw{};
    R2CCL_RETURN_IF_ERROR(crypto::random_bytes(raw));
    std::memcpy(&info.incarnation, raw.data(), raw.size());
  }
  if (e->options_.token) {
    info.token = *e->options_.token;
  } else {
    Token t{};
    R2CCL_RETURN_IF_ERROR(crypto::random_bytes(t));
    info.token = t;
  }
  info.provider = config.provider;

  R2CCL_ASSIGN_OR_RETURN(auto topo, discover_topology());
  e->engine_ = std::make_unique<ProgressEngine>();
  if (config.provider == "verbs") {
#ifdef R2CCL_HAVE_VERBS
    R2CCL_ASSIGN_OR_RETURN(e->provider_,
                           make_verbs_provider(*e->engine_, topo, config, *info.token));
#else
    return Status(ErrorCode::kConfig,
                  "R2CCL_PROVIDER=verbs: this build has no verbs provider (rdma-core's "
                  "libibverbs was not found when it was configured)");
#endif
  } else {
    R2CCL_ASSIGN_OR_RETURN(auto tcp_nics,
                           select_rails(topo, config.nics, e->options_.control_address));
    R2CCL_ASSIGN_OR_RETURN(e->provider_, make_tcp_provider(*e->engine_, tcp_nics, *info.token));
  }
  const auto& nics = e->provider_->devices();
  if (nics.size() > EndpointInfo::kMaxRails)
    return Status(ErrorCode::kConfig, fmt::format("{} NICs selected; an endpoint has at most {}",
                                                  nics.size(), EndpointInfo::kMaxRails));
  e->registry_ = std::make_unique<MemoryRegistry>(*e->provider_);
  Endpoint* self = e.get();
  R2CCL_ASSIGN_OR_RETURN(
      e->prober_,
      Prober::open(*e->engine_, nics, *info.token, info.incarnation, config.probe_interval,
                   [self](int peer, std::uint32_t rail, std::chrono::nanoseconds rtt) {
                     if (Channel* c = self->channel(peer)) c->on_probe_reply(rail, rtt);
                   }));
  for (std::size_t i = 0; i < nics.size(); ++i)
    info.rails.push_back(
        {nics[i].name, nics[i].address, e->provider_->endpoint(i), e->prober_->port(i)});
  if (info.encode(true).size() > EndpointInfo::kMaxBlob)
    return Status(ErrorCode::kConfig,
                  fmt::format("the endpoint's description exceeds {} bytes (names too long?)",
                              EndpointInfo::kMaxBlob));
  e->provider_->set_accept_handler(
      [self](std::shared_ptr<Rail> rail) { return self->on_accept(rail); });
  // Local link state: a NIC going down is known without waiting for traffic.
  auto watcher = LinkWatcher::start(*e->engine_, [self](const std::string& ifname, bool running) {
    for (auto& [slot_id, p] : self->peers_)
      if (p) p->channel->on_link(ifname, running);
  });
  if (watcher)
    e->link_watcher_ = std::move(*watcher);
  else
    R2CCL_WARN("no link watcher ({}); link failures are found by probes only",
               watcher.status().message());
  e->arm_watchdog();
  return e;
}

Endpoint::~Endpoint() {
  if (engine_ && !engine_->in_loop()) {
    // Peers that connected by blob are told this endpoint is going (a world's ranks learn it
    // from the control path).
    engine_->call([this] {
      for (auto& [slot_id, p] : peers_)
        if (p && !p->channel->dead() && p->channel->gone_on_close()) p->channel->send_goodbye();
    });
    drain(std::min<milliseconds>(config_.timeout, milliseconds(2000)));
  }
  if (link_watcher_) link_watcher_->stop();
  if (prober_) prober_->stop();
  if (engine_) {
    engine_->call([this] {
      if (watchdog_) {
        watchdog_->stopped = true;
        watchdog_->timer.cancel();
      }
      for (auto& [slot_id, p] : peers_)
        if (p) p->channel->shutdown();
    });
  }
  link_watcher_.reset();
  prober_.reset();
  registry_.reset();
  provider_.reset();
  watchdog_.reset();  // its timer belongs to the engine's io_context
  engine_.reset();
  peers_.clear();
}

void Endpoint::drain(milliseconds limit) {
  // An eager send is complete once queued, so a process may destroy its endpoint while its last
  // messages are still on the way: they reach the peer first (or give up with the rails, or
  // after the limit), and the peer does not see this endpoint leave before its data.
  const auto until = Clock::now() + limit;
  auto settled = [this] {
    for (const auto& [slot_id, p] : peers_)
      if (p && !p->channel->settled()) return false;
    return true;
  };
  while (Clock::now() < until) {
    if (engine_->drive_until(settled, until)) return;  // drove until settled or out of time
    if (engine_->call(settled)) return;                // another thread drives: look now and then
    std::this_thread::sleep_for(milliseconds(1));
  }
}

const std::vector<RailNic>& Endpoint::nics() const {
  return provider_->devices();
}

Channel* Endpoint::channel(int peer) const {
  const auto it = peers_.find(peer);
  return it != peers_.end() && it->second ? it->second->channel.get() : nullptr;
}

Result<int> Endpoint::add_peer_locked(EndpointInfo info, const PeerOptions& options) {
  int id = options.id;
  if (id < 0) {
    // One past every id used so far: an id is never handed out twice.
    if (id_end_ == std::numeric_limits<int>::max())
      return Status(ErrorCode::kUnavailable,
                    fmt::format("this endpoint has handed out {} peer ids: no more", id_end_));
    id = id_end_;
  } else if (peers_.contains(id)) {
    return Status(ErrorCode::kInvalidArgument, fmt::format("peer id {} is in use", id));
  } else if (id == std::numeric_limits<int>::max()) {
    return Status(ErrorCode::kInvalidArgument, fmt::format("peer id {} is out of range", id));
  }
  std::size_t live = 0;
  for (const auto& [slot_id, p] : peers_)
    live += p && !p->channel->dead();
  if (live >= options_.max_peers)
    return Status(ErrorCode::kUnavailable,
                  fmt::format("this endpoint has {} peers, its limit", options_.max_peers));
  const auto& nics = provider_->devices();
  const std::size_t n = std::min(nics.size(), info.rails.size());
  if (n == 0) return Status(ErrorCode::kUnavailable, fmt::format("{} has no rails", info.label()));
  std::vector<RailNic> local(nics.begin(), nics.begin() + static_cast<std::ptrdiff_t>(n));
  std::vector<Channel::RemoteRail> remote;
  for (std::size_t i = 0; i < n; ++i)
    remote.push_back({info.rails[i].nic, info.rails[i].endpoint});

  ChannelContext ctx;
  ctx.config = &config_;
  ctx.incarnation = info_.incarnation;
  ctx.description = std::make_shared<const Bytes>(info_.encode(false));
  ctx.self_label =
      options_.self_label.empty() ? fmt::format("'{}'", info_.name) : options_.self_label;
  // A connector shows the token of the endpoint it connects to.
  ctx.token = info.token.value_or(*info_.token);
  // Probes on this channel carry its token's tag: the peer's when this side dialled it (the
  // peer answers its own), this endpoint's when the peer dialled it. Standalone endpoints have
  // tokens of their own; in a world every rank has the job's.
  const std::uint64_t probe_tag = Prober::tag_of(ctx.token);
  prober_->accept_tag(probe_tag);
  ctx.provider = provider_.get();
  if (out_of_band_) ctx.out_of_band = out_of_band_;
  ctx.events = &events_;
  ctx.detection = &failover_detection_;
  ctx.epoch = &epoch_;
  ctx.on_user_message = [this](int peer, std::span<const std::byte> message) {
    deliver_message(peer, message);
  };
  ctx.on_fatal = [this](const Status& st) {
    if (on_fatal_)
      on_fatal_(st);
    else
      R2CCL_WARN("{}", st.message());
  };
  ctx.on_gone = [this](int peer, const std::string& why) {
    engine_->post([this, peer, why] { retire(peer, why); });
  };
  // Probes go only where the rails' connections go (review N-m20), never to the address the
  // peer's description names for them (it could name any host): to the peer's end of each rail's
  // connection once there is one; before that, where a connector dials the rail (so that a rail
  // that could not connect joins once it answers); an acceptor waits for the connection.
  std::vector<std::uint16_t> probe_ports;
  for (const auto& rail : info.rails)
    probe_ports.push_back(rail.probe_port);
  ctx.on_rail_attached = [this, incarnation = info.incarnation, probe_ports, probe_tag](
                             int peer, std::uint32_t rail, const std::string& address) {
    // No address: the connection closed before it was attached (the peer gave up its side of
    // two crossing connects); it fails on its first read, and its successor sets the target.
    if (address.empty()) return;
    if (rail < probe_ports.size())
      prober_->add_target(peer, incarnation, rail, address, probe_ports[rail], probe_tag,
                          provider_->host_local(address));
  };
  Channel::PeerIdentity identity;
  identity.id = id;
  identity.label = options.label.empty() ? info.label() : options.label;
  identity.incarnation = info.incarnation;
  identity.connector = options.connector;
  identity.gone_on_close = options.gone_on_close;
  auto peer = std::make_unique<Peer>();
  peer->channel = std::make_unique<Channel>(std::move(ctx), identity, local, remote);
  for (std::uint32_t i = 0; i < n && options.connector; ++i)
    if (auto dialled = decode_endpoint(info.rails[i].endpoint, info.provider)) {
      const std::string address = dialled->address().to_string();
      prober_->add_target(id, info.incarnation, i, address, info.rails[i].probe_port, probe_tag,
                          provider_->host_local(address));
    }
  peer->info = std::move(info);
  std::lock_guard lock(peers_mutex_);
  peers_[id] = std::move(peer);
  id_end_ = std::max(id_end_, id + 1);
  return id;
}

Result<int> Endpoint::add_peer(std::span<const std::byte> blob, const PeerOptions& options) {
  R2CCL_ASSIGN_OR_RETURN(auto info, EndpointInfo::decode(blob));
  if (info.incarnation == info_.incarnation)
    return Status(ErrorCode::kInvalidArgument, "that blob describes this endpoint itself");
  if (info.provider != info_.provider)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{} uses the {} provider, this endpoint {}", info.label(),
                              info.provider, info_.provider));
  return engine_->call([&]() -> Result<int> {
    if (const auto known = live_peer(info.incarnation)) return *known;
    return add_peer_locked(std::move(info), options);
  });
}

std::optional<int> Endpoint::live_peer(std::uint64_t incarnation) const {
  for (const auto& [slot_id, p] : peers_)
    if (p && !p->channel->dead() && p->info.incarnation == incarnation) return p->channel->peer();
  return std::nullopt;
}

void Endpoint::connect_rails(const std::vector<int>& peers) {
  engine_->call([&] {
    for (int p : peers)
      if (Channel* c = channel(p)) c->connect_all_rails();
  });
}

Status Endpoint::wait_rails(const std::vector<int>& peers, milliseconds timeout) {
  // Every rail that can be opened now is, and at least one to every peer. A rail whose NIC is
  // down (here or at the peer) is not waited for: it is probed, and joins when it answers.
  // Connections still under way once every peer has a rail get a short grace (a healthy one
  // takes milliseconds; one to a dead NIC waits for the connect timeout), then go on by themselves.
  constexpr auto kGrace = milliseconds(2000);
  const auto deadline = Clock::now() + timeout + milliseconds(500);
  std::optional<Clock::time_point> every_peer_since;
  while (true) {
    // Peers without any rail yet, and whether rails are still being connected.
    const auto [none, pending, gone] = engine_->call([&] {
      std::vector<std::string> out;
      std::string left;
      bool connecting = false;
      for (int p : peers) {
        const Channel* c = channel(p);
        if (!c) continue;
        if (c->dead()) left = fmt::format("{} left", c->label());
        if (c->attached() == c->nrails()) continue;
        if (c->attached() == 0)
          out.push_back(fmt::format("to {}: {}", c->label(), c->missing_rails()));
        connecting |= c->connecting() > 0;
      }
      return std::tuple{fmt::format("{}", fmt::join(out, "; ")), connecting, left};
    });
    if (!gone.empty()) return {ErrorCode::kAborted, gone};
    const auto now = Clock::now();
    const bool out_of_time = now >= deadline;
    if (none.empty() && !every_peer_since) every_peer_since = now;
    if (none.empty() && (!pending || out_of_time || now - *every_peer_since >= kGrace)) break;
    if (out_of_time)
      return {ErrorCode::kNetwork,
              fmt::format("{} could not open any rail within {}ms {}",
                          options_.self_label.empty() ? info_.name : options_.self_label,
                          timeout.count(), none)};
    std::this_thread::sleep_for(milliseconds(5));
  }
  // The side that connects knows which rails could not be opened: it says so once.
  const std::string left_out = engine_->call([&] {
    std::vector<std::string> out;
    for (int p : peers) {
      Channel* c = channel(p);
      if (!c) continue;
      c->mark_started();
      if (!c->connector() || c->attached() == c->nrails()) continue;
      if (std::string missing = c->missing_rails(true); !missing.empty())
        out.push_back(fmt::format("to {}: {}", c->label(), missing));
    }
    return fmt::format("{}", fmt::join(out, "; "));
  });
  if (!left_out.empty())
    R2CCL_WARN("starting without these rails; each joins once its link answers probes: {}",
               left_out);
  return Status::ok();
}

Result<int> Endpoint::connect(std::span<const std::byte> blob) {
  // A peer this endpoint is connected to already is returned as it is: its rails are its
  // channel's (one that is down rejoins once its link answers probes). Waiting for them here,
  // and dropping the channel when none answered in time, would end a channel the peer still
  // holds, and a second one of the same incarnation would then not be one the peer knows.
  R2CCL_ASSIGN_OR_RETURN(auto info, EndpointInfo::decode(blob));
  const auto known = engine_->call([&] { return live_peer(info.incarnation); });
  if (known) return *known;
  R2CCL_ASSIGN_OR_RETURN(const int id, add_peer(blob, PeerOptions{}));
  connect_rails({id});
  if (Status st = wait_rails({id}, config_.connect_timeout); !st) {
    peer_left(id, st.message());
    return st;
  }
  return id;
}

Status Endpoint::disconnect(int peer) {
  const bool known = engine_->call([&] {
    Channel* c = channel(peer);
    if (!c || c->dead()) return false;
    c->send_goodbye();
    return true;
  });
  if (!known)
    return {ErrorCode::kInvalidArgument, fmt::format("disconnect: peer {} is not connected", peer)};
  const auto until = Clock::now() + std::min<milliseconds>(config_.timeout, milliseconds(2000));
  auto settled = [&] {
    Channel* c = channel(peer);
    return !c || c->settled();
  };
  while (Clock::now() < until && !engine_->call(settled))
    std::this_thread::sleep_for(milliseconds(1));
  peer_left(peer, "this endpoint disconnected from it");
  return Status::ok();
}

bool Endpoint::on_accept(const std::shared_ptr<Rail>& rail) {
  const RailHello& h = rail->hello();
  if (h.dst_incarnation != info_.incarnation) {
    R2CCL_WARN_LIMITED(
        "refused a rail meant for incarnation {:016x} of this endpoint (this is {:016x})",
        h.dst_incarnation, info_.incarnation);
    return false;
  }
  for (auto& [slot_id, p] : peers_) {
    if (!p || p->info.incarnation != h.src_incarnation) continue;
    Channel& c = *p->channel;
    if (c.dead()) {
      R2CCL_WARN_LIMITED("refused a rail from {}, which has left", c.label());
      return false;
    }
    if (c.connector()) {
      // Both sides connect at once: the rails of the lower incarnation win.
      if (info_.incarnation < h.src_incarnation) return false;
      c.become_acceptor();
    }
    return c.attach(h.rail, rail);
  }
  if (!options_.accept_new_peers) {
    R2CCL_WARN_LIMITED("refused a rail from an unknown endpoint (incarnation {:016x})",
                       h.src_incarnation);
    return false;
  }
  auto info = EndpointInfo::decode(h.description ? *h.description : Bytes{});
  if (!info || info->incarnation != h.src_incarnation || info->provider != info_.provider) {
    R2CCL_WARN_LIMITED("refused a rail whose hello describes its endpoint wrongly: {}",
                       info ? "incarnation or provider mismatch" : info.status().message());
    return false;
  }
  // The same name at another incarnation. A name proves nothing (the connecting process chooses
  // it), so it evicts only a peer that is gone already as far as this side can tell: no rail
  // connected to it and none connecting (its process ended and the kernel closed its
  // connections, or every rail to it failed). That is a process that started again. A peer
  // still connected is not evicted: the newcomer is another peer, and the collision is logged.
  std::vector<std::string> namesakes;
  for (auto& [slot_id, p] : peers_) {
    if (!p || p->channel->dead() || p->info.name != info->name) continue;
    Channel& old = *p->channel;
    if (old.attached() == 0 && old.connecting() == 0)
      old.on_peer_left(fmt::format("it started again as incarnation {:016x}", info->incarnation));
    else
      namesakes.push_back(fmt::format("{} (peer id {})", old.label(), old.peer()));
  }
  PeerOptions options;
  options.connector = false;
  auto id = add_peer_locked(std::move(*info), options);
  if (!id) {
    R2CCL_WARN_LIMITED("refused a rail from a new peer: {}", id.status().message());
    return false;
  }
  Channel& c = *channel(*id);
  c.mark_started();
  R2CCL_INFO("{} connected (peer id {})", c.label(), *id);
  if (!namesakes.empty())
    R2CCL_WARN_LIMITED(
        "{} (peer id {}) has the name of {}, still connected: kept as distinct peers (endpoint "
        "names should be unique; a process that starts again replaces its old incarnation only "
        "once that one's rails are gone)",
        c.label(), *id, fmt::join(namesakes, ", "));
  tell_peer_event(PeerEvent{PeerEvent::Kind::kJoined, *id, c.label(), {}});
  return c.attach(h.rail, rail);
}

void Endpoint::retire(int peer, const std::string& why) {
  Channel* c = channel(peer);
  if (!c) return;
  prober_->remove_targets(peer);
  tell_peer_event(PeerEvent{PeerEvent::Kind::kLeft, peer, c->label(), why});
  departed_.push_back(peer);
  // Forget the oldest departed peers (a channel with a connection attempt still under way is
  // kept until it ends: the attempt's handler refers to it).
  while (departed_.size() > kMaxDeparted) {
    Channel* old = channel(departed_.front());
    if (old && old->connecting() > 0) break;
    std::lock_guard lock(peers_mutex_);
    peers_.erase(departed_.front());
    departed_.erase(departed_.begin());
  }
}

void Endpoint::set_peer_handler(std::function<void(const PeerEvent&)> handler) {
  engine_->call([&] { peer_handler_ = std::move(handler); });
}

int Endpoint::add_peer_listener(std::function<void(const PeerEvent&)> listener) {
  return engine_->call([&] {
    const int id = next_listener_++;
    peer_listeners_.emplace_back(id, std::move(listener));
    return id;
  });
}

void Endpoint::remove_peer_listener(int id) {
  engine_->call(
      [&] { std::erase_if(peer_listeners_, [&](const auto& l) { return l.first == id; }); });
}

void Endpoint::tell_peer_event(const PeerEvent& event) {
  if (peer_handler_) peer_handler_(event);
  // A listener may remove itself, or another, while it runs: a copy, each looked up before.
  const auto listeners = peer_listeners_;
  for (const auto& [id, fn] : listeners)
    if (std::any_of(peer_listeners_.begin(), peer_listeners_.end(),
                    [id = id](const auto& l) { return l.first == id; }))
      fn(event);
}

void Endpoint::set_fatal_handler(std::function<void(const Status&)> handler) {
  engine_->call([&] { on_fatal_ = std::move(handler); });
}

std::vector<Endpoint::PeerSummary> Endpoint::peers() const {
  return engine_->call([this] {
    std::vector<PeerSummary> out;
    for (const auto& [slot_id, p] : peers_)
      if (p)
        out.push_back({p->channel->peer(), p->channel->label(), p->info.incarnation,
                       !p->channel->dead(), p->channel->attached()});
    return out;
  });
}

Result<std::string> Endpoint::peer_label(int peer) const {
  std::lock_guard lock(peers_mutex_);
  if (const Channel* c = channel(peer)) return c->label();
  if (peer >= 0 && peer < id_end_)
    return Status(ErrorCode::kNotFound, fmt::format("peer {} left long ago", peer));
  return Status(ErrorCode::kNotFound, fmt::format("no peer has id {}", peer));
}

void Endpoint::on_out_of_band(int peer, Bytes message) {
  engine_->post([this, peer, message = std::move(message)]() mutable {
    if (Channel* c = channel(peer)) c->on_control_path(std::move(message));
  });
}

void Endpoint::peer_left(int peer, const std::string& why) {
  engine_->call([&] {
    if (Channel* c = channel(peer)) c->on_peer_left(why);
  });
}

// Every probe interval: deadlines, rail health, re-admission, bandwidth, peers that left.
void Endpoint::arm_watchdog() {
  watchdog_ = std::make_unique<Watchdog>(engine_->io());
  engine_->post([this] {
    struct Loop {
      Endpoint* e;
      void operator()(boost::system::error_code ec) const {
        auto& w = *e->watchdog_;
        if (ec || w.stopped) return;
        const auto now = Clock::now();
        // The loop runs this every probe interval; a much longer gap is this process stalling
        // (no CPU, a long handler), not the peers' silence.
        const auto interval = e->config_.probe_interval;
        const auto limit = std::max<Clock::duration>(5 * interval, e->config_.probe_timeout / 2);
        if (w.last != Clock::time_point{} && now - w.last > limit) {
          const auto gap = now - w.last - interval;
          R2CCL_DEBUG("progress loop stalled for {} ms: rail silence in that time not counted",
                      std::chrono::duration_cast<milliseconds>(gap).count());
          for (auto& [slot_id, p] : e->peers_)
            if (p) p->channel->forgive_stall(now, gap);
        }
        w.last = now;
        for (auto& [slot_id, p] : e->peers_)
          if (p) p->channel->tick(now);
        w.timer.expires_after(e->config_.probe_interval);
        w.timer.async_wait(*this);
      }
    };
    watchdog_->timer.expires_after(config_.probe_interval);
    watchdog_->timer.async_wait(Loop{this});
  });
}

void Endpoint::abort(const std::string& why) {
  engine_->call([&] {
    for (auto& [slot_id, p] : peers_)
      if (p) p->channel->on_peer_left(why);
  });
}

std::vector<RailEvent> Endpoint::rail_events() const {
  return events_.snapshot();
}

std::vector<RailTelemetryView> Endpoint::rail_telemetry() const {
  std::lock_guard lock(peers_mutex_);
  std::vector<RailTelemetryView> out;
  for (const auto& [slot_id, p] : peers_)
    if (p) p->channel->telemetry_views(out);
  return out;
}

std::vector<RailSnapshot> Endpoint::rail_snapshot() const {
  return engine_->call([this] {
    std::vector<RailSnapshot> out;
    for (const auto& [slot_id, p] : peers_)
      if (p) p->channel->snapshot(out);
    return out;
  });
}

ProviderCounters Endpoint::provider_counters() const {
  return provider_->counters();
}

std::uint32_t Endpoint::provider_capabilities() const {
  return provider_->capabilities();
}

std::size_t Endpoint::rails_to(int peer) const {
  std::lock_guard lock(peers_mutex_);
  const Channel* c = channel(peer);
  return c ? c->nrails() : 0;
}

std::size_t Endpoint::eager_limit(int peer) const {
  std::lock_guard lock(peers_mutex_);
  const Channel* c = channel(peer);
  return c ? c->eager_limit() : 0;
}

Result<RegionPtr> Endpoint::register_memory(void* base, std::size_t length, MemoryAccess access,
                                            const DeviceMemory* device) {
  return registry_->register_region(base, length, access, device);
}

Status Endpoint::deregister_memory(const RegionPtr& region) {
  if (!region) return {ErrorCode::kInvalidArgument, "deregister_memory: null region"};
  // Operations still using it end first, so that no rail is given its bytes again; then the
  // providers make sure none still reads or writes them.
  const std::string why =
      fmt::format("region #{} ({} bytes at {}) was deregistered while the operation used it",
                  region->id, region->length, static_cast<const void*>(region->base));
  engine_->call([&] {
    for (auto& [slot_id, p] : peers_)
      if (p) p->channel->abandon_region(region->id, why);
  });
  return registry_->deregister_region(region->id);
}

std::size_t Endpoint::registered_regions() const {
  return registry_->size();
}

Status Endpoint::check_args(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length, const char* what) const {
  {
    std::lock_guard lock(peers_mutex_);
    if (!channel(peer))
      return {ErrorCode::kInvalidArgument,
              peer >= 0 && peer < id_end_ ? fmt::format("{}: peer {} left long ago", what, peer)
                                          : fmt::format("{}: no peer has id {}", what, peer)};
  }
  return check_region(region, offset, length, what);
}

namespace {
// An operation whose peer was forgotten (retire) after check_args found it, before the loop ran
// the operation: it fails as one posted later would have been refused.
void left_long_ago(const OpPtr& op, const char* what, int peer) {
  op->complete({ErrorCode::kAborted, fmt::format("{}: peer {} left long ago", what, peer)});
}
}  // namespace

template <typename Post>
OpPtr Endpoint::start_op(Post post) {
  auto op = std::make_shared<Op>();
  const auto deadline = Clock::now() + config_.timeout;
  op->set_deadline(deadline);
  engine_->submit([op, deadline, post = std::move(post)] { post(op, deadline); });
  return op;
}

Result<OpPtr> Endpoint::isend(int peer, const RegionPtr& region, std::size_t offset,
                              std::size_t length, std::uint64_t rails) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "send"));
  return start_op(
      [this, region, offset, length, peer, rails, epoch = epoch_.load(std::memory_order_relaxed)](
          OpPtr op, Clock::time_point deadline) {
        Channel* c = channel(peer);
        if (!c) return left_long_ago(op, "send", peer);
        c->enter_epoch(epoch);
        c->post_send(std::move(op), region, offset, length, deadline, rails);
      });
}

Result<OpPtr> Endpoint::irecv(int peer, const RegionPtr& region, std::size_t offset,
                              std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "receive"));
  R2CCL_RETURN_IF_ERROR(check_remote_writable(region, "receive"));
  return start_op(
      [this, region, offset, length, peer, epoch = epoch_.load(std::memory_order_relaxed)](
          OpPtr op, Clock::time_point deadline) {
        Channel* c = channel(peer);
        if (!c) return left_long_ago(op, "receive", peer);
        c->enter_epoch(epoch);
        c->post_recv(std::move(op), region, offset, length, deadline);
      });
}

Result<OpPtr> Endpoint::iwrite(int peer, const RegionPtr& region, std::size_t offset,
                               const RemoteRegion& remote, std::size_t remote_offset,
                               std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "write"));
  if (remote_offset > remote.length || length > remote.length - remote_offset)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("write: {} bytes at offset {} exceed {}'s region of {} bytes", length,
                              remote_offset, peer_label(peer).value_or("the peer"), remote.length));
  return start_op([this, region, offset, remote, remote_offset, length, peer](
                      OpPtr op, Clock::time_point deadline) {
    Channel* c = channel(peer);
    if (!c) return left_long_ago(op, "write", peer);
    c->post_write(std::move(op), region, offset, remote, remote_offset, length, deadline);
  });
}

Status Endpoint::send_message(int peer, std::uint8_t service, Bytes payload) {
  {
    std::lock_guard lock(peers_mutex_);
    Channel* c = channel(peer);
    if (!c) return {ErrorCode::kInvalidArgument, fmt::format("message: no peer has id {}", peer)};
    // Bounded: a sender that outruns the rails (or a peer that stopped confirming) is told to
    // try again instead of queueing without end.
    if (const auto queued = c->control_unconfirmed_bytes(); queued > kMaxControlUnconfirmed)
      return {ErrorCode::kNoResource,
              fmt::format("message to {}: {} bytes of control messages are not confirmed yet "
                          "(at most {}); try again",
                          c->label(), queued, kMaxControlUnconfirmed)};
  }
  const std::size_t limit = 64 * 1024 + (service == kWorldControl ? 64 : 0);
  if (payload.size() > limit)
    return {ErrorCode::kInvalidArgument,
            fmt::format("message of {} bytes exceeds 64 KiB", payload.size())};
  if (service >= kServices)
    return {ErrorCode::kInvalidArgument,
            fmt::format("message: unknown service {}", static_cast<int>(service))};
  engine_->submit([this, peer, service, payload = std::move(payload)] {
    if (Channel* c = channel(peer))
      c->send_user_message(service, payload);
    else
      R2CCL_WARN_LIMITED("message to peer {} dropped: it left long ago", peer);
  });
  return Status::ok();
}

void Endpoint::set_message_handler(std::uint8_t service, MessageHandler handler) {
  if (service >= kServices) return;
  engine_->call([&] { message_handlers_[service] = std::move(handler); });
}

void Endpoint::deliver_message(int peer, std::span<const std::byte> message) {
  const std::size_t service =
      message.empty() ? kServices : std::to_integer<std::size_t>(message[0]);
  if (service >= kServices) {
    R2CCL_WARN_LIMITED("peer {} sent a message for an unknown service ({} bytes): dropped", peer,
                       message.size());
    return;
  }
  if (message_handlers_[service])
    message_handlers_[service](peer, Bytes(message.begin() + 1, message.end()));
}

Status Endpoint::wait_any(std::span<const OpPtr> ops) {
  const auto any_done = [&] {
    return std::any_of(ops.begin(), ops.end(), [](const OpPtr& op) { return op && op->done(); });
  };
  if (ops.empty() || any_done()) return Status::ok();
  constexpr milliseconds kGrace{1000};
  while (true) {
    auto limit = Clock::time_point::min();
    for (const auto& op : ops)
      if (op) limit = std::max(limit, op->deadline() + kGrace);
    const auto now = Clock::now();
    if (now >= limit)
      return any_done() ? Status::ok()
                        : Status(ErrorCode::kTimeout, "no operation completed by its deadline");
    if (!engine_->drive_until(any_done, limit)) {
      // Another caller drives the loop: sleep on one operation a little, then look at all.
      for (const auto& op : ops)
        if (op && !op->done()) {
          (void)op->wait(milliseconds(1));
          break;
        }
    }
    if (any_done()) return Status::ok();
  }
}

Status Endpoint::wait(const OpPtr& op) {
  if (!op) return {ErrorCode::kInvalidArgument, "wait: null operation"};
  if (op->done()) return op->status();
  // The watchdog fails an operation at its deadline; the grace only guards against a stuck
  // progress thread.
  constexpr milliseconds kGrace{1000};
  while (true) {
    const auto limit = op->deadline() + kGrace;
    const auto now = Clock::now();
    if (now >= limit)
      return op->done() ? op->status()
                        : Status(ErrorCode::kTimeout, "operation did not complete by its deadline");
    // Drive the loop from this thread (no hand-off to the engine's thread per message), or, while
    // another caller drives it, sleep on the operation and try again now and then.
    if (!engine_->drive_until([&] { return op->done(); }, limit))
      (void)op->wait(
          std::min(std::chrono::duration_cast<milliseconds>(limit - now) + milliseconds(1),
                   milliseconds(2)));
    if (op->done()) return op->status();
    // not done: the deadline may have moved, look again
  }
}

}  // namespace r2ccl

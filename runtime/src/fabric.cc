#include "r2ccl/runtime/fabric.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/steady_timer.hpp>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <thread>

#include "peer_channel.h"
#include "r2ccl/runtime/link_watcher.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/prober.h"
#include "r2ccl/runtime/progress.h"
#include "r2ccl/runtime/topology.h"

namespace r2ccl {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string_view rail_state_name(RailState s) {
  switch (s) {
    case RailState::kUp:
      return "up";
    case RailState::kSuspect:
      return "suspect";
    case RailState::kDown:
      return "down";
    case RailState::kProbing:
      return "probing";
    case RailState::kDegraded:
      return "degraded";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Op

bool Op::done() const {
  return done_flag_.load(std::memory_order_acquire);
}

Status Op::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

Status Op::wait(milliseconds timeout) {
  // A short spin first (yielding, so the progress thread of this or another rank gets the core):
  // a small message completes within it and the waiter skips a sleep and wake-up.
  constexpr auto kSpin = std::chrono::microseconds(50);
  const auto spin_until =
      std::chrono::steady_clock::now() + std::min<Clock::duration>(kSpin, timeout);
  while (!done_flag_.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < spin_until)
    std::this_thread::yield();
  std::unique_lock lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; }))
    return {ErrorCode::kTimeout,
            fmt::format("operation did not complete within {}ms", timeout.count())};
  return status_;
}

void Op::complete(Status status) {
  std::function<void(const Status&)> fn;
  {
    std::lock_guard lock(mutex_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
    done_flag_.store(true, std::memory_order_release);
    fn = std::move(callback_);
  }
  cv_.notify_all();
  if (fn) fn(status_);
}

void Op::on_complete(std::function<void(const Status&)> fn) {
  {
    std::lock_guard lock(mutex_);
    if (!done_) {
      callback_ = std::move(fn);
      return;
    }
  }
  fn(status_);
}

namespace {
std::string describe_bytes(std::uint64_t n) {
  return fmt::format("{} bytes", n);
}
// First byte of a control-path message that carries a user message (fence notices use 1 and 2).
constexpr std::uint8_t kUserOnControlPath = 0x55;
}  // namespace

void LatencyHistogram::observe(double seconds) {
  std::size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i])
    ++i;
  if (i < kBounds.size()) buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<std::uint64_t>(std::max(0.0, seconds) * 1e9),
                    std::memory_order_relaxed);
}

std::array<std::uint64_t, LatencyHistogram::kBounds.size()> LatencyHistogram::cumulative() const {
  std::array<std::uint64_t, kBounds.size()> out{};
  std::uint64_t run = 0;
  for (std::size_t i = 0; i < kBounds.size(); ++i) {
    run += buckets_[i].load(std::memory_order_relaxed);
    out[i] = run;
  }
  return out;
}

namespace {
// The entry with this name and labels, added if new.
template <typename Entry>
Entry& find_or_add(std::deque<Entry>& entries, const std::string& name, const std::string& help,
                   MetricRegistry::Labels labels) {
  for (auto& e : entries)
    if (e.name == name && e.labels == labels) return e;
  auto& e = entries.emplace_back();
  e.name = name;
  e.help = help;
  e.labels = std::move(labels);
  return e;
}
}  // namespace

MetricRegistry::Counter& MetricRegistry::counter(const std::string& name, const std::string& help,
                                                 Labels labels) {
  std::lock_guard lock(mutex_);
  return find_or_add(counters_, name, help, std::move(labels));
}

MetricRegistry::Histogram& MetricRegistry::histogram(const std::string& name,
                                                     const std::string& help, Labels labels) {
  std::lock_guard lock(mutex_);
  return find_or_add(histograms_, name, help, std::move(labels));
}

void MetricRegistry::for_each(const std::function<void(const Counter&)>& counters,
                              const std::function<void(const Histogram&)>& histograms) const {
  std::lock_guard lock(mutex_);
  for (const auto& c : counters_)
    counters(c);
  for (const auto& h : histograms_)
    histograms(h);
}

void RailEventLog::add(RailEvent event) {
  std::lock_guard lock(mutex_);
  if (events_.size() < kMaxEvents) events_.push_back(std::move(event));
}

std::vector<RailEvent> RailEventLog::snapshot() const {
  std::lock_guard lock(mutex_);
  return events_;
}

// ---------------------------------------------------------------------------------------------
// Messages a rank sends to itself: matched in order and copied.
class SelfChannel {
 public:
  void post(bool is_send, OpPtr op, std::byte* ptr, std::size_t length) {
    (is_send ? sends_ : recvs_).push_back({std::move(op), ptr, length});
    while (!sends_.empty() && !recvs_.empty()) {
      auto s = sends_.front();
      auto r = recvs_.front();
      sends_.pop_front();
      recvs_.pop_front();
      if (s.length != r.length) {
        Status why(ErrorCode::kInvalidArgument,
                   fmt::format("size mismatch in a message to self: sent {}, posted {}",
                               describe_bytes(s.length), describe_bytes(r.length)));
        s.op->complete(why);
        r.op->complete(why);
        continue;
      }
      if (s.length > 0) std::memmove(r.ptr, s.ptr, s.length);
      s.op->complete(Status::ok());
      r.op->complete(Status::ok());
    }
  }
  void shutdown() {
    const Status gone(ErrorCode::kAborted, "the fabric was destroyed");
    for (auto& e : sends_)
      e.op->complete(gone);
    for (auto& e : recvs_)
      e.op->complete(gone);
    sends_.clear();
    recvs_.clear();
  }

 private:
  struct Entry {
    OpPtr op;
    std::byte* ptr;
    std::size_t length;
  };
  std::deque<Entry> sends_;
  std::deque<Entry> recvs_;
};

// ---------------------------------------------------------------------------------------------
// Fabric

struct Fabric::Watchdog {
  explicit Watchdog(boost::asio::io_context& io) : timer(io) {}
  boost::asio::steady_timer timer;
  bool stopped = false;
};

namespace {

// The local address the kernel would use to reach `host` (no packet is sent).
Result<std::string> route_source_address(const std::string& host, std::uint16_t port) {
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &dst.sin_addr) != 1)
    return Status(ErrorCode::kConfig,
                  fmt::format("R2CCL_BOOTSTRAP host '{}' is not an IPv4 address", host));
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(ErrorCode::kNetwork, "cannot open a UDP socket");
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0) {
    sockaddr_in src{};
    socklen_t len = sizeof src;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&src), &len) == 0) {
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &src.sin_addr, buf, sizeof buf);
      out = buf;
    }
  }
  ::close(fd);
  if (out.empty())
    return Status(ErrorCode::kBootstrap, fmt::format("no route to rank 0 at {}:{}", host, port));
  return out;
}

// What every rank publishes about each of its rails.
struct PublishedRail {
  std::string nic;
  std::string address;
  Bytes endpoint;  // provider endpoint
  std::uint16_t probe_port = 0;
};

}  // namespace

Fabric::Fabric() = default;

// Failover messages on the out-of-band control path, written by their own thread so that the
// progress thread never waits on that connection (a blocking write to rank 0's relay). Bounded:
// when the queue is full the message is not taken (the rails carry it too, when there are any).
class OutOfBandSender {
 public:
  static constexpr std::size_t kMaxQueued = 256;

  explicit OutOfBandSender(Bootstrap& bootstrap)
      : bootstrap_(bootstrap), thread_([this] { run(); }) {}
  ~OutOfBandSender() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  OutOfBandSender(const OutOfBandSender&) = delete;
  OutOfBandSender& operator=(const OutOfBandSender&) = delete;

  bool post(int peer, Bytes message) {
    {
      std::lock_guard lock(mutex_);
      if (stop_ || broken_ || queue_.size() >= kMaxQueued) return false;
      queue_.emplace_back(peer, std::move(message));
    }
    cv_.notify_one();
    return true;
  }

 private:
  void run() {
    while (true) {
      std::pair<int, Bytes> next;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      Status st;
      try {
        st = bootstrap_.send_to(next.first, next.second);
      } catch (const std::exception& e) {
        st = Status(ErrorCode::kInternal, e.what());
      }
      if (!st) {
        R2CCL_INFO(
            "the out-of-band control path is gone ({}); failover messages use the rails "
            "only",
            st.message());
        std::lock_guard lock(mutex_);
        broken_ = true;
        queue_.clear();
      }
    }
  }

  Bootstrap& bootstrap_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<int, Bytes>> queue_;
  bool stop_ = false;
  bool broken_ = false;
  std::thread thread_;  // last: starts once everything above is in place
};

Fabric::~Fabric() {
  if (engine_ && !engine_->in_loop()) drain();
  if (bootstrap_) bootstrap_->set_handlers(nullptr, nullptr);
  if (link_watcher_) link_watcher_->stop();
  if (prober_) prober_->stop();
  if (engine_) {
    engine_->call([this] {
      if (watchdog_) {
        watchdog_->stopped = true;
        watchdog_->timer.cancel();
      }
      for (auto& c : channels_)
        if (c) c->shutdown();
      if (self_) self_->shutdown();
    });
  }
  link_watcher_.reset();
  out_of_band_.reset();  // after the channels' shutdown: nothing posts to it any more
  prober_.reset();
  registry_.reset();
  provider_.reset();
  watchdog_.reset();  // its timer belongs to the engine's io_context
  engine_.reset();
  channels_.clear();
  bootstrap_.reset();
}

void Fabric::drain() {
  // An eager send is complete once queued, so a rank may destroy its fabric while its last
  // messages are still on the way: they reach the peer first (or give up with the rails, or
  // after kDrainLimit), and the peer does not see this rank leave before its data.
  constexpr milliseconds kDrainLimit{2000};
  const auto until = Clock::now() + std::min<Clock::duration>(config_.timeout, kDrainLimit);
  auto settled = [this] {
    for (const auto& c : channels_)
      if (c && !c->settled()) return false;
    return true;
  };
  while (Clock::now() < until) {
    if (engine_->drive_until(settled, until)) return;  // drove until settled or out of time
    if (engine_->call(settled)) return;                // another thread drives: look now and then
    std::this_thread::sleep_for(milliseconds(1));
  }
}

Result<std::unique_ptr<Fabric>> Fabric::create(const Config& config, const BootstrapOptions& boot) {
  std::unique_ptr<Fabric> f(new Fabric());
  f->config_ = config;
  f->rail_token_ = boot.token;
  set_log_level(config.log_level);
  set_log_rank(boot.rank);
  for (const auto& name : unknown_variables())
    R2CCL_WARN("unknown variable {} is ignored (a typo?)", name);

  R2CCL_ASSIGN_OR_RETURN(auto topo, discover_topology());
  std::string control;
  if (!config.socket_ifname.empty()) {
    auto a = interface_ipv4(config.socket_ifname);
    if (!a) return a.status().with_context("R2CCL_SOCKET_IFNAME");
    control = *a;
  } else {
    auto a = route_source_address(boot.root.host, boot.root.port);
    if (a) control = *a;  // a host name: rails are then chosen without excluding it
  }
  f->engine_ = std::make_unique<ProgressEngine>();
  if (config.provider == "verbs") {
#ifdef R2CCL_HAVE_VERBS
    R2CCL_ASSIGN_OR_RETURN(f->provider_,
                           make_verbs_provider(*f->engine_, topo, config, boot.token));
#else
    return Status(ErrorCode::kConfig,
                  "R2CCL_PROVIDER=verbs: this build has no verbs provider (rdma-core's "
                  "libibverbs was not found when it was configured)");
#endif
  } else {
    R2CCL_ASSIGN_OR_RETURN(auto tcp_nics, select_rails(topo, config.nics, control));
    R2CCL_ASSIGN_OR_RETURN(f->provider_, make_tcp_provider(*f->engine_, tcp_nics, boot.token));
  }
  const std::vector<RailNic> nics = f->provider_->devices();
  f->registry_ = std::make_unique<MemoryRegistry>(*f->provider_);
  Fabric* self = f.get();
  R2CCL_ASSIGN_OR_RETURN(
      f->prober_,
      Prober::open(*f->engine_, nics, boot.token, boot.rank, config.probe_interval,
                   [self](int peer, std::uint32_t rail, std::chrono::nanoseconds rtt) {
                     if (peer >= 0 && static_cast<std::size_t>(peer) < self->channels_.size() &&
                         self->channels_[static_cast<std::size_t>(peer)])
                       self->channels_[static_cast<std::size_t>(peer)]->on_probe_reply(rail, rtt);
                   }));

  ByteWriter info;
  info.u32(static_cast<std::uint32_t>(nics.size()));
  for (std::size_t i = 0; i < nics.size(); ++i)
    info.str(nics[i].name)
        .str(nics[i].address)
        .blob(f->provider_->endpoint(i))
        .u16(f->prober_->port(i));
  R2CCL_ASSIGN_OR_RETURN(f->bootstrap_, Bootstrap::join(boot, info.bytes()));
  R2CCL_RETURN_IF_ERROR(f->connect_all(f->bootstrap_->rank_info()));

  // Control path: fence notices from peers, and peers leaving.
  f->bootstrap_->set_handlers(
      [self](int src, Bytes msg) {
        self->engine_->post([self, src, msg = std::move(msg)]() mutable {
          if (!msg.empty() && std::to_integer<std::uint8_t>(msg[0]) == kUserOnControlPath) {
            self->deliver_message(src, std::span<const std::byte>(msg).subspan(1));
            return;
          }
          if (src >= 0 && static_cast<std::size_t>(src) < self->channels_.size() &&
              self->channels_[static_cast<std::size_t>(src)])
            self->channels_[static_cast<std::size_t>(src)]->on_control_path(std::move(msg));
        });
      },
      [self](int rank, const std::string& why) {
        self->engine_->post([self, rank, why] {
          self->record_async_error({ErrorCode::kAborted, why});
          if (rank >= 0 && static_cast<std::size_t>(rank) < self->channels_.size() &&
              self->channels_[static_cast<std::size_t>(rank)])
            self->channels_[static_cast<std::size_t>(rank)]->on_peer_left(why);
        });
      });
  // Local link state: a NIC going down is known without waiting for traffic.
  auto watcher = LinkWatcher::start(*f->engine_, [self](const std::string& ifname, bool running) {
    for (auto& c : self->channels_)
      if (c) c->on_link(ifname, running);
  });
  if (watcher)
    f->link_watcher_ = std::move(*watcher);
  else
    R2CCL_WARN("no link watcher ({}); link failures are found by probes only",
               watcher.status().message());
  f->arm_watchdog();
  R2CCL_INFO("fabric up: rank {} of {}, {} rail(s): {}", f->rank(), f->nranks(), nics.size(),
             fmt::join(
                 [&] {
                   std::vector<std::string> n;
                   for (const auto& r : nics)
                     n.push_back(r.name + "=" + r.address);
                   return n;
                 }(),
                 ", "));
  return f;
}

Status Fabric::connect_all(const std::vector<Bytes>& infos) {
  const int me = rank();
  const auto& nics = provider_->devices();
  std::vector<std::vector<PublishedRail>> peers(infos.size());
  for (std::size_t p = 0; p < infos.size(); ++p) {
    ByteReader r(infos[p]);
    const auto n = r.u32();
    for (std::uint32_t i = 0; i < n && r.ok() && i < 256; ++i) {
      PublishedRail pr;
      pr.nic = r.str(256);
      pr.address = r.str(64);
      pr.endpoint = r.blob(1024);
      pr.probe_port = r.u16();
      peers[p].push_back(std::move(pr));
    }
    R2CCL_RETURN_IF_ERROR(
        r.finish("rail endpoints").with_context(fmt::format("rank {}'s bootstrap info", p)));
  }
  ChannelContext ctx;
  ctx.config = &config_;
  ctx.me = me;
  ctx.token = rail_token_;
  ctx.provider = provider_.get();
  out_of_band_ = std::make_unique<OutOfBandSender>(*bootstrap_);
  ctx.out_of_band = [oob = out_of_band_.get()](int peer, Bytes message) {
    return oob->post(peer, std::move(message));
  };
  ctx.events = &events_;
  ctx.detection = &failover_detection_;
  ctx.on_user_message = [this](int peer, std::span<const std::byte> message) {
    deliver_message(peer, message);
  };
  ctx.on_fatal = [this](const Status& st) { record_async_error(st); };
  channels_.resize(infos.size());
  for (std::size_t p = 0; p < infos.size(); ++p) {
    if (static_cast<int>(p) == me) continue;
    const std::size_t n = std::min(nics.size(), peers[p].size());
    if (n == 0) return {ErrorCode::kUnavailable, fmt::format("rank {} has no rails", p)};
    std::vector<RailNic> local(nics.begin(), nics.begin() + static_cast<std::ptrdiff_t>(n));
    std::vector<Channel::RemoteRail> remote;
    for (std::size_t i = 0; i < n; ++i)
      remote.push_back({peers[p][i].nic, peers[p][i].endpoint});
    channels_[p] = std::make_unique<Channel>(ctx, static_cast<int>(p), local, remote);
  }
  self_ = std::make_unique<SelfChannel>();
  engine_->call([&] {
    for (std::size_t p = 0; p < channels_.size(); ++p)
      if (channels_[p])
        for (std::uint32_t i = 0; i < channels_[p]->nrails(); ++i)
          prober_->add_target(static_cast<int>(p), i, peers[p][i].address, peers[p][i].probe_port);
  });
  provider_->set_accept_handler([this, me](std::shared_ptr<Rail> rail) {
    const auto& h = rail->hello();
    if (h.dst_rank != static_cast<std::uint32_t>(me) || h.src_rank >= channels_.size() ||
        !channels_[h.src_rank] || static_cast<int>(h.src_rank) > me) {
      R2CCL_WARN("refused a rail claiming to be rank {} -> rank {} rail {}", h.src_rank, h.dst_rank,
                 h.rail);
      return false;
    }
    return channels_[h.src_rank]->attach(h.rail, std::move(rail));
  });
  // Everybody accepts before anybody connects.
  R2CCL_RETURN_IF_ERROR(
      bootstrap_->barrier(config_.connect_timeout).with_context("before connecting rails"));

  // The lower rank connects to the higher one; rail i joins NIC i on both sides.
  engine_->call([&] {
    for (auto& c : channels_)
      if (c) c->connect_all_rails();
  });
  // Every rail that can be opened now is, and at least one to every peer. A rail whose NIC is
  // down (here or at the peer) is not waited for: it is probed, and joins when it answers.
  // Connections still under way once every peer has a rail get a short grace (a healthy one
  // takes milliseconds; one to a dead NIC waits for the connect timeout), then go on by themselves.
  constexpr auto kGrace = milliseconds(2000);
  const auto deadline = Clock::now() + config_.connect_timeout + milliseconds(500);
  std::optional<Clock::time_point> every_peer_since;
  while (true) {
    // Peers without any rail yet, and whether rails are still being connected.
    const auto [none, pending] = engine_->call([&] {
      std::vector<std::string> out;
      bool connecting = false;
      for (const auto& c : channels_) {
        if (!c || c->attached() == c->nrails()) continue;
        if (c->attached() == 0)
          out.push_back(fmt::format("to rank {}: {}", c->peer(), c->missing_rails()));
        connecting |= c->connecting() > 0;
      }
      return std::pair{fmt::format("{}", fmt::join(out, "; ")), connecting};
    });
    const auto now = Clock::now();
    const bool out_of_time = now >= deadline;
    if (none.empty() && !every_peer_since) every_peer_since = now;
    if (none.empty() && (!pending || out_of_time || now - *every_peer_since >= kGrace)) break;
    if (out_of_time)
      return {ErrorCode::kNetwork, fmt::format("rank {} could not open any rail within {}ms {}", me,
                                               config_.connect_timeout.count(), none)};
    std::this_thread::sleep_for(milliseconds(5));
  }
  R2CCL_RETURN_IF_ERROR(
      bootstrap_->barrier(config_.connect_timeout).with_context("after connecting rails"));
  // The side that connects knows which rails could not be opened: it says so once.
  const std::string left_out = engine_->call([&] {
    std::vector<std::string> out;
    for (auto& c : channels_)
      if (c) c->mark_started();
    for (const auto& c : channels_)
      if (c && c->peer() > me && c->attached() < c->nrails())
        out.push_back(fmt::format("to rank {}: {}", c->peer(), c->missing_rails()));
    return fmt::format("{}", fmt::join(out, "; "));
  });
  if (!left_out.empty())
    R2CCL_WARN("starting without these rails; each joins once its link answers probes: {}",
               left_out);
  return Status::ok();
}

// Every probe interval: deadlines, rail health, re-admission, bandwidth.
void Fabric::arm_watchdog() {
  watchdog_ = std::make_unique<Watchdog>(engine_->io());
  engine_->post([this] {
    struct Loop {
      Fabric* f;
      void operator()(boost::system::error_code ec) const {
        auto& w = *f->watchdog_;
        if (ec || w.stopped) return;
        const auto now = Clock::now();
        for (auto& c : f->channels_)
          if (c) c->tick(now);
        w.timer.expires_after(f->config_.probe_interval);
        w.timer.async_wait(*this);
      }
    };
    watchdog_->timer.expires_after(config_.probe_interval);
    watchdog_->timer.async_wait(Loop{this});
  });
}

void Fabric::abort(const std::string& why) {
  record_async_error({ErrorCode::kAborted, why});
  engine_->call([&] {
    for (auto& c : channels_)
      if (c) c->on_peer_left(why);
  });
}

void Fabric::record_async_error(const Status& st) {
  std::lock_guard lock(async_mutex_);
  if (async_error_.is_ok()) async_error_ = st;
}

Status Fabric::async_error() const {
  std::lock_guard lock(async_mutex_);
  return async_error_;
}

std::vector<RailEvent> Fabric::rail_events() const {
  return events_.snapshot();
}

std::vector<RailTelemetryView> Fabric::rail_telemetry() const {
  std::vector<RailTelemetryView> out;
  for (const auto& c : channels_)
    if (c) c->telemetry_views(out);
  return out;
}

int Fabric::rank() const {
  return bootstrap_->rank();
}
int Fabric::nranks() const {
  return bootstrap_->nranks();
}
const std::vector<RailNic>& Fabric::nics() const {
  return provider_->devices();
}

std::size_t Fabric::rails_to(int peer) const {
  if (peer < 0 || peer >= nranks() || !channels_[static_cast<std::size_t>(peer)]) return 0;
  return channels_[static_cast<std::size_t>(peer)]->nrails();
}

std::size_t Fabric::eager_limit(int peer) const {
  if (peer < 0 || peer >= nranks() || !channels_[static_cast<std::size_t>(peer)]) return 0;
  return channels_[static_cast<std::size_t>(peer)]->eager_limit();
}

Result<RegionPtr> Fabric::register_memory(void* base, std::size_t length) {
  return registry_->register_region(base, length);
}

Status Fabric::deregister_memory(const RegionPtr& region) {
  if (!region) return {ErrorCode::kInvalidArgument, "deregister_memory: null region"};
  return registry_->deregister_region(region->id);
}

Status Fabric::check_args(int peer, const RegionPtr& region, std::size_t offset, std::size_t length,
                          const char* what) const {
  if (peer < 0 || peer >= nranks())
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: peer {} is out of range (0..{})", what, peer, nranks() - 1)};
  if (!region)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the buffer is not registered (null region)", what)};
  if (offset > region->length || length > region->length - offset)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: {} bytes at offset {} exceed the registered region of {} bytes", what,
                        length, offset, region->length)};
  return Status::ok();
}

Result<OpPtr> Fabric::isend(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "send"));
  auto op = std::make_shared<Op>();
  const auto deadline = Clock::now() + config_.timeout;
  op->set_deadline(deadline);
  engine_->submit([this, op, region, offset, length, peer, deadline] {
    if (peer == rank())
      self_->post(true, op, region->base + offset, length);
    else
      channels_[static_cast<std::size_t>(peer)]->post_send(op, region, offset, length, deadline);
  });
  return op;
}

Result<OpPtr> Fabric::irecv(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "receive"));
  auto op = std::make_shared<Op>();
  const auto deadline = Clock::now() + config_.timeout;
  op->set_deadline(deadline);
  engine_->submit([this, op, region, offset, length, peer, deadline] {
    if (peer == rank())
      self_->post(false, op, region->base + offset, length);
    else
      channels_[static_cast<std::size_t>(peer)]->post_recv(op, region, offset, length, deadline);
  });
  return op;
}

Result<OpPtr> Fabric::iwrite(int peer, const RegionPtr& region, std::size_t offset,
                             const RemoteRegion& remote, std::size_t remote_offset,
                             std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "write"));
  if (peer == rank())
    return Status(ErrorCode::kInvalidArgument, "write: a one-sided write to this rank itself");
  if (remote_offset > remote.length || length > remote.length - remote_offset)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("write: {} bytes at offset {} exceed rank {}'s region of {} bytes",
                              length, remote_offset, peer, remote.length));
  auto op = std::make_shared<Op>();
  const auto deadline = Clock::now() + config_.timeout;
  op->set_deadline(deadline);
  engine_->submit([this, op, region, offset, remote, remote_offset, length, peer, deadline] {
    channels_[static_cast<std::size_t>(peer)]->post_write(op, region, offset, remote, remote_offset,
                                                          length, deadline);
  });
  return op;
}

Status Fabric::send_message(int peer, Service service, Bytes payload, bool control_path) {
  if (peer < 0 || peer >= nranks() || peer == rank())
    return {ErrorCode::kInvalidArgument,
            fmt::format("message: peer {} is out of range or this rank", peer)};
  if (payload.size() > 64 * 1024)
    return {ErrorCode::kInvalidArgument,
            fmt::format("message of {} bytes exceeds 64 KiB", payload.size())};
  if (static_cast<std::size_t>(service) >= kServices)
    return {ErrorCode::kInvalidArgument,
            fmt::format("message: unknown service {}", static_cast<int>(service))};
  if (control_path) {
    ByteWriter w(2 + payload.size());
    w.u8(kUserOnControlPath)
        .u8(static_cast<std::uint8_t>(service))
        .raw(payload.data(), payload.size());
    return bootstrap_->send_to(peer, w.bytes());
  }
  engine_->submit([this, peer, service, payload = std::move(payload)] {
    channels_[static_cast<std::size_t>(peer)]->send_user_message(static_cast<std::uint8_t>(service),
                                                                 payload);
  });
  return Status::ok();
}

void Fabric::set_message_handler(Service service, MessageHandler handler) {
  const auto i = static_cast<std::size_t>(service);
  if (i >= kServices) return;
  engine_->call([&] { message_handlers_[i] = std::move(handler); });
}

void Fabric::deliver_message(int peer, std::span<const std::byte> message) {
  const std::size_t service =
      message.empty() ? kServices : std::to_integer<std::size_t>(message[0]);
  if (service >= kServices) {
    R2CCL_WARN("rank {} sent a message for an unknown service ({} bytes): dropped", peer,
               message.size());
    return;
  }
  if (message_handlers_[service])
    message_handlers_[service](peer, Bytes(message.begin() + 1, message.end()));
}

Status Fabric::wait(const OpPtr& op) {
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

std::vector<RailSnapshot> Fabric::rail_snapshot() const {
  return engine_->call([this] {
    std::vector<RailSnapshot> out;
    for (const auto& c : channels_)
      if (c) c->snapshot(out);
    return out;
  });
}

ProviderCounters Fabric::provider_counters() const {
  return provider_->counters();
}

}  // namespace r2ccl

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

#include "channel/channel.h"
#include "health/prober.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/topology.h"
#include "topology/link_watcher.h"

namespace r2ccl {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {
std::string describe_bytes(std::uint64_t n) {
  return fmt::format("{} bytes", n);
}
// First byte of a control-path message that carries a user message (fence notices use 1 and 2).
constexpr std::uint8_t kUserOnControlPath = 0x55;
}  // namespace

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
  if (bootstrap_) bootstrap_->set_handlers(nullptr, nullptr);
  if (endpoint_ && !endpoint_->engine().in_loop()) {
    endpoint_->drain(std::min<milliseconds>(config_.timeout, milliseconds(2000)));
    endpoint_->engine().call([this] {
      if (self_) self_->shutdown();
    });
  }
  // The bootstrap's direct path uses the endpoint: gone first (its handler on the endpoint calls
  // the bootstrap, which outlives the endpoint).
  if (bootstrap_) bootstrap_->set_direct_path(nullptr);
  endpoint_.reset();
  out_of_band_.reset();  // after the channels' shutdown: nothing posts to it any more
  bootstrap_.reset();
}

Status check_rails_need_no_token(const Token& token, const std::vector<EndpointInfo::Rail>& rails,
                                 bool insecure) {
  if (token != Token{} || insecure) return Status::ok();
  std::vector<std::string> outside;
  for (const auto& r : rails) {
    in_addr a{};
    const bool loopback =
        inet_pton(AF_INET, r.address.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
    if (!loopback) outside.push_back(fmt::format("{} {}", r.nic, r.address));
  }
  if (outside.empty()) return Status::ok();
  return Status(
      ErrorCode::kConfig,
      fmt::format("R2CCL_BOOTSTRAP_TOKEN is not set, and this rank's rails listen outside "
                  "loopback ({}): give every rank the same token (32 hex digits, e.g. "
                  "from `openssl rand -hex 16`), or set R2CCL_INSECURE_NO_TOKEN=1 to let "
                  "anyone who reaches those NICs connect",
                  fmt::join(outside, ", ")));
}

Result<std::unique_ptr<Fabric>> Fabric::create(const Config& config, const BootstrapOptions& boot) {
  std::unique_ptr<Fabric> f(new Fabric());
  f->config_ = config;
  set_log_level(config.log_level);
  claim_log_rank(boot.rank);
  for (const auto& name : unknown_variables())
    R2CCL_WARN("unknown variable {} is ignored (a typo?)", name);

  EndpointOptions options;
  options.name = fmt::format("rank {}", boot.rank);
  options.self_label = options.name;
  options.token = boot.token;
  options.accept_new_peers = false;  // the ranks of the world, nobody else
  if (!config.socket_ifname.empty()) {
    auto a = interface_ipv4(config.socket_ifname);
    if (!a) return a.status().with_context("R2CCL_SOCKET_IFNAME");
    options.control_address = *a;
  } else {
    auto a = route_source_address(boot.root.host, boot.root.port);
    if (a) options.control_address = *a;  // a host name: rails are then chosen without excluding it
  }
  R2CCL_ASSIGN_OR_RETURN(f->endpoint_, Endpoint::create(config, std::move(options)));
  R2CCL_RETURN_IF_ERROR(
      check_rails_need_no_token(boot.token, f->endpoint_->info().rails, config.insecure_no_token));
  Fabric* self = f.get();
  f->endpoint_->set_fatal_handler([self](const Status& st) { self->record_async_error(st); });
  // The ranks share the job's token already: the blob they exchange leaves it out.
  R2CCL_ASSIGN_OR_RETURN(f->bootstrap_,
                         Bootstrap::join(boot, f->endpoint_->info().encode(/*with_token=*/false)));
  // The bootstrap's direct path: what ranks send it on the rails goes to the bootstrap (set
  // before any rail is up, so that nothing sent on it is dropped for want of a handler).
  f->endpoint_->set_message_handler(Endpoint::kWorldControl, [self](int peer, Bytes message) {
    self->bootstrap_->on_direct_message(peer, message);
  });
  f->out_of_band_ = std::make_unique<OutOfBandSender>(*f->bootstrap_);
  f->endpoint_->set_out_of_band([oob = f->out_of_band_.get()](int peer, Bytes message) {
    return oob->post(peer, std::move(message));
  });
  f->self_ = std::make_unique<SelfChannel>();
  R2CCL_RETURN_IF_ERROR(f->connect_all(f->bootstrap_->rank_info()));
  // Every rank has rails to every other: control messages and all-gathers also take them, so
  // that a silent management network does not stop the job.
  f->bootstrap_->set_direct_path([self](int rank, Bytes message) {
    return self->endpoint_->send_message(rank, Endpoint::kWorldControl, std::move(message));
  });

  // Control path: fence notices from peers, and peers leaving.
  f->bootstrap_->set_handlers(
      [self](int src, Bytes msg) {
        if (!msg.empty() && std::to_integer<std::uint8_t>(msg[0]) == kUserOnControlPath) {
          if (msg.size() < 2 || std::to_integer<std::size_t>(msg[1]) >= kServices) {
            R2CCL_WARN_LIMITED("rank {} sent a control-path message for no user service: dropped",
                               src);
            return;
          }
          self->endpoint_->engine().post([self, src, msg = std::move(msg)] {
            self->endpoint_->deliver_message(src, std::span<const std::byte>(msg).subspan(1));
          });
          return;
        }
        self->endpoint_->on_out_of_band(src, std::move(msg));
      },
      [self](int rank, const std::string& why) {
        self->record_async_error({ErrorCode::kAborted, why});
        self->endpoint_->engine().post([self, rank, why] {
          if (rank != self->rank()) self->endpoint_->peer_left(rank, why);
        });
      });
  const auto& nics = f->endpoint_->nics();
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
  std::vector<int> peers;
  for (std::size_t p = 0; p < infos.size(); ++p) {
    if (static_cast<int>(p) == me) continue;
    Endpoint::PeerOptions o;
    o.id = static_cast<int>(p);
    o.connector = me < static_cast<int>(p);  // the lower rank connects
    o.gone_on_close = false;                 // the control path says when a rank leaves
    o.label = fmt::format("rank {}", p);
    R2CCL_RETURN_IF_ERROR(endpoint_->add_peer(infos[p], o)
                              .status()
                              .with_context(fmt::format("rank {}'s endpoint", p)));
    peers.push_back(static_cast<int>(p));
  }
  // Everybody knows everybody before anybody connects.
  R2CCL_RETURN_IF_ERROR(
      bootstrap_->barrier(config_.connect_timeout).with_context("before connecting rails"));
  endpoint_->connect_rails(peers);
  R2CCL_RETURN_IF_ERROR(endpoint_->wait_rails(peers, config_.connect_timeout));
  return bootstrap_->barrier(config_.connect_timeout).with_context("after connecting rails");
}

void Fabric::abort(const std::string& why) {
  record_async_error({ErrorCode::kAborted, why});
  endpoint_->abort(why);
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
  return endpoint_->rail_events();
}

std::vector<RailTelemetryView> Fabric::rail_telemetry() const {
  return endpoint_->rail_telemetry();
}

int Fabric::rank() const {
  return bootstrap_->rank();
}
int Fabric::nranks() const {
  return bootstrap_->nranks();
}
const std::vector<RailNic>& Fabric::nics() const {
  return endpoint_->nics();
}

std::size_t Fabric::rails_to(int peer) const {
  return peer == rank() ? 0 : endpoint_->rails_to(peer);
}

std::size_t Fabric::eager_limit(int peer) const {
  return peer == rank() ? 0 : endpoint_->eager_limit(peer);
}

Result<RegionPtr> Fabric::register_memory(void* base, std::size_t length, MemoryAccess access) {
  return endpoint_->register_memory(base, length, access);
}

Status Fabric::deregister_memory(const RegionPtr& region) {
  return endpoint_->deregister_memory(region);
}

Status Fabric::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= nranks())
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: peer {} is out of range (0..{})", what, peer, nranks() - 1)};
  return Status::ok();
}

namespace {
// A rank's messages to itself are copied on the host.
Status check_host_memory(const RegionPtr& region, const char* what) {
  if (region->device == nullptr) return Status::ok();
  return {ErrorCode::kInvalidArgument,
          fmt::format("{}: a message of this rank to itself in {} (copy it on the device "
                      "instead)",
                      what, region->device->describe())};
}
}  // namespace

Result<OpPtr> Fabric::isend(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length, std::uint64_t rails) {
  R2CCL_RETURN_IF_ERROR(check_peer(peer, "send"));
  if (peer != rank()) return endpoint_->isend(peer, region, offset, length, rails);
  R2CCL_RETURN_IF_ERROR(check_region(region, offset, length, "send"));
  R2CCL_RETURN_IF_ERROR(check_host_memory(region, "send"));
  auto op = std::make_shared<Op>();
  op->set_deadline(Clock::now() + config_.timeout);
  endpoint_->engine().submit(
      [this, op, region, offset, length] { self_->post(true, op, region->base + offset, length); });
  return op;
}

Result<OpPtr> Fabric::irecv(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_peer(peer, "receive"));
  if (peer != rank()) return endpoint_->irecv(peer, region, offset, length);
  R2CCL_RETURN_IF_ERROR(check_region(region, offset, length, "receive"));
  R2CCL_RETURN_IF_ERROR(check_host_memory(region, "receive"));
  auto op = std::make_shared<Op>();
  op->set_deadline(Clock::now() + config_.timeout);
  endpoint_->engine().submit([this, op, region, offset, length] {
    self_->post(false, op, region->base + offset, length);
  });
  return op;
}

Result<OpPtr> Fabric::iwrite(int peer, const RegionPtr& region, std::size_t offset,
                             const RemoteRegion& remote, std::size_t remote_offset,
                             std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_peer(peer, "write"));
  if (peer == rank())
    return Status(ErrorCode::kInvalidArgument, "write: a one-sided write to this rank itself");
  return endpoint_->iwrite(peer, region, offset, remote, remote_offset, length);
}

Status Fabric::send_message(int peer, Service service, Bytes payload, bool control_path) {
  if (peer < 0 || peer >= nranks() || peer == rank())
    return {ErrorCode::kInvalidArgument,
            fmt::format("message: peer {} is out of range or this rank", peer)};
  if (static_cast<std::size_t>(service) >= kServices)
    return {ErrorCode::kInvalidArgument,
            fmt::format("message: unknown service {}", static_cast<int>(service))};
  if (!control_path)
    return endpoint_->send_message(peer, static_cast<std::uint8_t>(service), std::move(payload));
  if (payload.size() > 64 * 1024)
    return {ErrorCode::kInvalidArgument,
            fmt::format("message of {} bytes exceeds 64 KiB", payload.size())};
  ByteWriter w(2 + payload.size());
  w.u8(kUserOnControlPath)
      .u8(static_cast<std::uint8_t>(service))
      .raw(payload.data(), payload.size());
  // The progress loop never waits on the control path's connection (a write to rank 0's relay
  // can take seconds): from there the out-of-band sender's thread writes it.
  if (endpoint_->engine().in_loop()) {
    if (!out_of_band_->post(peer, w.take()))
      return {ErrorCode::kUnavailable,
              "message: the out-of-band control path is gone, or its queue is full"};
    return Status::ok();
  }
  return bootstrap_->send_to(peer, w.bytes());
}

void Fabric::set_message_handler(Service service, MessageHandler handler) {
  endpoint_->set_message_handler(static_cast<std::uint8_t>(service), std::move(handler));
}

Status Fabric::wait(const OpPtr& op) {
  return endpoint_->wait(op);
}

Status Fabric::wait_any(std::span<const OpPtr> ops) {
  return endpoint_->wait_any(ops);
}

std::vector<RailSnapshot> Fabric::rail_snapshot() const {
  return endpoint_->rail_snapshot();
}

ProviderCounters Fabric::provider_counters() const {
  return endpoint_->provider_counters();
}

std::uint32_t Fabric::provider_capabilities() const {
  return endpoint_->provider_capabilities();
}

}  // namespace r2ccl

#include "r2ccl/monitor/prober.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "r2ccl/runtime/log.h"

namespace r2ccl::mon {
namespace {

// Owns one file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

std::string errno_text(int err) {
  return std::strerror(err);
}

// sockaddr_in for an IPv4 literal; false if it is not one.
bool make_addr(const std::string& ip, std::uint16_t port, sockaddr_in& out) {
  out = {};
  out.sin_family = AF_INET;
  out.sin_port = htons(port);
  return inet_pton(AF_INET, ip.c_str(), &out.sin_addr) == 1;
}

// The socket API takes the generic sockaddr; sockaddr_in is layout-compatible by contract.
sockaddr* as_sockaddr(sockaddr_in& a) {
  return reinterpret_cast<sockaddr*>(&a);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
}

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}

constexpr int kMaxDatagramsPerWake = 64;  // bounds the work of one loop turn per socket

}  // namespace

struct Prober::Impl {
  struct Target {
    ProbeTarget target;
    UniqueFd fd;
    std::uint32_t id = 0;
    std::uint64_t next_sequence = 1;
    Clock::time_point next_send;
    ProbeWindow window;      // guarded by Impl::mutex
    std::string last_error;  // the last error logged; empty while healthy (thread only)
  };

  ProberConfig config;
  UniqueFd echo_fd;
  UniqueFd wake_fd;
  std::uint16_t echo_port = 0;
  mutable std::mutex mutex;
  std::vector<Target> targets;
  std::atomic<std::uint64_t> echo_replies{0};
  std::atomic<bool> stopping{false};
  std::thread thread;

  Status open_echo();
  Status open_target(Target& t);
  void note_error(Target& t, const std::string& error);
  void send_probe(Target& t, Clock::time_point now);
  void receive_replies(Target& t);
  void answer_echoes();
  void run();
};

Status Prober::Impl::open_echo() {
  if (!config.echo_port) return Status::ok();
  const std::string where = fmt::format("{}:{}", config.echo_address, *config.echo_port);
  sockaddr_in addr{};
  if (!make_addr(config.echo_address, *config.echo_port, addr))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("echo address '{}' is not an IPv4 address", config.echo_address));
  UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid())
    return Status(ErrorCode::kNetwork, fmt::format("UDP socket: {}", errno_text(errno)));
  int one = 1;
  if (::setsockopt(fd.get(), IPPROTO_IP, IP_PKTINFO, &one, sizeof one) != 0)
    return Status(ErrorCode::kNetwork, fmt::format("IP_PKTINFO: {}", errno_text(errno)));
  if (::bind(fd.get(), as_sockaddr(addr), sizeof addr) != 0) {
    const int err = errno;
    if (err == EADDRINUSE)
      return Status(ErrorCode::kUnavailable,
                    fmt::format("UDP echo port {} ({}) is already in use; another "
                                "r2ccl-monitor may be running (choose one with --echo-port)",
                                *config.echo_port, where));
    return Status(ErrorCode::kNetwork, fmt::format("cannot bind the UDP echo responder to {}: {}",
                                                   where, errno_text(err)));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof bound;
  if (::getsockname(fd.get(), as_sockaddr(bound), &len) == 0) echo_port = ntohs(bound.sin_port);
  echo_fd = std::move(fd);
  return Status::ok();
}

Status Prober::Impl::open_target(Target& t) {
  const ProbeSpec& spec = t.target.spec;
  sockaddr_in local{};
  sockaddr_in peer{};
  if (!make_addr(t.target.local_address, 0, local))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}' is not an IPv4 address", t.target.local_address));
  if (!make_addr(spec.peer, spec.port, peer))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("'{}' is not an IPv4 address", spec.peer));
  UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid())
    return Status(ErrorCode::kNetwork, fmt::format("UDP socket: {}", errno_text(errno)));
  // Best effort: pins the probe to the NIC even where routing would pick another one. Needs
  // CAP_NET_RAW; without it the source address alone selects the NIC (it does on rail subnets).
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_BINDTODEVICE, spec.device.c_str(),
                   static_cast<socklen_t>(spec.device.size())) != 0) {
    R2CCL_DEBUG("probe {}->{}: SO_BINDTODEVICE: {} (continuing with the source address only)",
                spec.device, spec.peer_label(), errno_text(errno));
  }
  if (::bind(fd.get(), as_sockaddr(local), sizeof local) != 0)
    return Status(ErrorCode::kNetwork, fmt::format("bind to {} ({}): {}", t.target.local_address,
                                                   spec.device, errno_text(errno)));
  if (::connect(fd.get(), as_sockaddr(peer), sizeof peer) != 0)
    return Status(ErrorCode::kNetwork,
                  fmt::format("connect to {}: {}", spec.peer_label(), errno_text(errno)));
  t.fd = std::move(fd);
  return Status::ok();
}

void Prober::Impl::note_error(Target& t, const std::string& error) {
  if (error == t.last_error) return;
  if (error.empty()) {
    R2CCL_INFO("probe {} -> {}: sending again", t.target.spec.device, t.target.spec.peer_label());
  } else {
    R2CCL_WARN("probe {} -> {}: {} (counted as lost; retrying every interval)",
               t.target.spec.device, t.target.spec.peer_label(), error);
  }
  t.last_error = error;
}

void Prober::Impl::send_probe(Target& t, Clock::time_point now) {
  const std::uint64_t sequence = t.next_sequence++;
  if (!t.fd.valid()) {
    if (Status st = open_target(t); !st.is_ok()) {
      note_error(t, st.message());
      std::lock_guard lock(mutex);
      t.window.send_failed(sequence);
      return;
    }
  }
  ProbePacket packet;
  packet.type = ProbePacket::Type::kRequest;
  packet.peer = t.id;  // dst 0: any monitor answers
  packet.sequence = sequence;
  packet.send_time_ns = now_ns();
  const auto bytes = packet.encode();
  {
    // Registered before the send so that even an instant reply finds it.
    std::lock_guard lock(mutex);
    t.window.sent(sequence, now);
  }
  const ssize_t n = ::send(t.fd.get(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(bytes.size())) {
    note_error(t, "");
    return;
  }
  const int err = n < 0 ? errno : EMSGSIZE;
  note_error(t, fmt::format("send: {}", errno_text(err)));
  {
    std::lock_guard lock(mutex);
    t.window.send_failed(sequence);
  }
  // The NIC vanished or lost its address: open a fresh socket next time.
  if (err == ENODEV || err == ENXIO || err == EADDRNOTAVAIL || err == EBADF) t.fd.reset();
}

void Prober::Impl::receive_replies(Target& t) {
  std::array<std::uint8_t, 64> buf{};
  for (int i = 0; i < kMaxDatagramsPerWake; ++i) {
    const ssize_t n = ::recv(t.fd.get(), buf.data(), buf.size(), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // EAGAIN, or a queued ICMP error (ECONNREFUSED): the probe times out
    }
    auto packet = ProbePacket::decode(buf.data(), static_cast<std::size_t>(n));
    if (!packet || packet->type != ProbePacket::Type::kReply || packet->peer != t.id) continue;
    const auto at = Clock::now();
    std::lock_guard lock(mutex);
    t.window.answered(packet->sequence, at);
  }
}

void Prober::Impl::answer_echoes() {
  std::array<std::uint8_t, 64> buf{};
  for (int i = 0; i < kMaxDatagramsPerWake; ++i) {
    sockaddr_in from{};
    iovec iov{buf.data(), buf.size()};
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(in_pktinfo))> control{};
    msghdr msg{};
    msg.msg_name = &from;
    msg.msg_namelen = sizeof from;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    const ssize_t n = ::recvmsg(echo_fd.get(), &msg, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    auto packet = ProbePacket::decode(buf.data(), static_cast<std::size_t>(n));
    // Requests for a runtime endpoint (dst set) are its prober's to answer, not ours.
    if (!packet || packet->type != ProbePacket::Type::kRequest || packet->dst != 0) continue;
    auto reply = packet->reply().encode();

    // Answer from the address the request was sent to, so the reply leaves by the same NIC.
    std::optional<in_addr> local;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_PKTINFO) {
        in_pktinfo info{};
        std::memcpy(&info, CMSG_DATA(c), sizeof info);
        local = info.ipi_spec_dst;
      }
    }
    iovec out_iov{reply.data(), reply.size()};
    alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(in_pktinfo))> out_control{};
    msghdr out{};
    out.msg_name = &from;
    out.msg_namelen = sizeof from;
    out.msg_iov = &out_iov;
    out.msg_iovlen = 1;
    if (local) {
      out.msg_control = out_control.data();
      out.msg_controllen = out_control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&out);
      c->cmsg_level = IPPROTO_IP;
      c->cmsg_type = IP_PKTINFO;
      c->cmsg_len = CMSG_LEN(sizeof(in_pktinfo));
      in_pktinfo info{};
      info.ipi_spec_dst = *local;
      std::memcpy(CMSG_DATA(c), &info, sizeof info);
    }
    if (::sendmsg(echo_fd.get(), &out, MSG_DONTWAIT | MSG_NOSIGNAL) ==
        static_cast<ssize_t>(reply.size()))
      echo_replies.fetch_add(1, std::memory_order_relaxed);
  }
}

void Prober::Impl::run() {
  const auto interval = std::chrono::duration_cast<Clock::duration>(config.interval);
  const auto start = Clock::now();
  for (std::size_t i = 0; i < targets.size(); ++i) {
    // Spread the first probes over one interval so they do not go out in a burst.
    targets[i].next_send =
        start + interval * static_cast<long>(i) / static_cast<long>(targets.size());
  }
  std::vector<pollfd> fds;
  while (!stopping.load()) {
    auto now = Clock::now();
    auto wake_at = now + std::chrono::milliseconds(500);
    for (auto& t : targets) {
      if (now >= t.next_send) {
        send_probe(t, now);
        t.next_send += interval;
        if (t.next_send <= now) t.next_send = now + interval;  // fell behind: skip, no burst
      }
      {
        std::lock_guard lock(mutex);
        t.window.expire(now);
      }
      wake_at = std::min(wake_at, t.next_send);
    }

    fds.clear();
    fds.push_back({wake_fd.get(), POLLIN, 0});
    if (echo_fd.valid()) fds.push_back({echo_fd.get(), POLLIN, 0});
    for (auto& t : targets)
      fds.push_back({t.fd.valid() ? t.fd.get() : -1, POLLIN, 0});  // poll skips negative fds
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - now);
    const int timeout_ms = static_cast<int>(std::clamp<long long>(wait.count() + 1, 0, 500));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready <= 0) continue;  // timeout, or EINTR
    if (fds[0].revents != 0) break;
    std::size_t k = 1;
    if (echo_fd.valid()) {
      if (fds[k].revents != 0) answer_echoes();
      ++k;
    }
    for (auto& t : targets) {
      if (fds[k].revents != 0 && t.fd.valid()) receive_replies(t);
      ++k;
    }
  }
}

Prober::Prober(PassKey /*key*/, std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Prober>> Prober::start(ProberConfig config) {
  if (config.interval.count() <= 0)
    return Status(ErrorCode::kInvalidArgument, "probe interval must be positive");
  if (config.timeout.count() <= 0)
    return Status(ErrorCode::kInvalidArgument, "probe timeout must be positive");
  auto impl = std::make_unique<Impl>();
  impl->config = std::move(config);
  R2CCL_RETURN_IF_ERROR(impl->open_echo());
  impl->wake_fd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!impl->wake_fd.valid())
    return Status(ErrorCode::kInternal, fmt::format("eventfd: {}", errno_text(errno)));
  std::random_device seed;
  std::mt19937 rng(seed());
  const auto timeout = std::chrono::duration_cast<Clock::duration>(impl->config.timeout);
  for (const auto& target : impl->config.targets) {
    impl->targets.push_back(Impl::Target{.target = target,
                                         .fd = UniqueFd(),
                                         .id = static_cast<std::uint32_t>(rng()),
                                         .next_sequence = 1,
                                         .next_send = Clock::time_point(),
                                         .window = ProbeWindow(impl->config.window, timeout),
                                         .last_error = std::string()});
  }
  // Open the probe sockets now so a bad configuration is reported at start; failures here are
  // retried by the thread (the NIC may come up later).
  for (auto& t : impl->targets) {
    if (Status st = impl->open_target(t); !st.is_ok()) impl->note_error(t, st.message());
  }
  Impl* raw = impl.get();
  try {
    impl->thread = std::thread([raw] { raw->run(); });
  } catch (const std::system_error& e) {
    return Status(ErrorCode::kInternal, fmt::format("cannot start the probe thread: {}", e.what()));
  }
  return std::make_unique<Prober>(PassKey(), std::move(impl));
}

Prober::~Prober() {
  if (!impl_) return;
  impl_->stopping.store(true);
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(impl_->wake_fd.get(), &one, sizeof one);
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::vector<ProbeStatus> Prober::status() const {
  std::vector<ProbeStatus> out;
  std::lock_guard lock(impl_->mutex);
  out.reserve(impl_->targets.size());
  for (const auto& t : impl_->targets) {
    ProbeStatus s;
    s.device = t.target.spec.device;
    s.peer = t.target.spec.peer_label();
    s.stats = t.window.stats();
    s.degraded = s.stats.degraded(t.window.capacity());
    out.push_back(std::move(s));
  }
  return out;
}

std::uint16_t Prober::echo_port() const {
  return impl_->echo_port;
}

std::uint64_t Prober::echo_replies() const {
  return impl_->echo_replies.load(std::memory_order_relaxed);
}

}  // namespace r2ccl::mon

#include "topology/link_watcher.h"

#include <fmt/format.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>

#include "progress/asio.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"

namespace r2ccl {
namespace {

class NetlinkWatcher final : public LinkWatcher,
                             public std::enable_shared_from_this<NetlinkWatcher> {
 public:
  NetlinkWatcher(ProgressEngine& engine, Handler handler)
      : engine_(engine), stream_(engine.io()), handler_(std::move(handler)), buffer_(16384) {}

  Status open() {
    const int fd = ::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_ROUTE);
    if (fd < 0)
      return {ErrorCode::kNetwork, fmt::format("netlink socket: {}", std::strerror(errno))};
    sockaddr_nl sa{};
    sa.nl_family = AF_NETLINK;
    sa.nl_groups = RTMGRP_LINK;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      const int e = errno;
      ::close(fd);
      return {ErrorCode::kNetwork, fmt::format("netlink bind: {}", std::strerror(e))};
    }
    boost::system::error_code ec;
    stream_.assign(fd, ec);
    if (ec) return {ErrorCode::kNetwork, fmt::format("netlink: {}", ec.message())};
    return Status::ok();
  }

  void arm() {
    stream_.async_read_some(
        boost::asio::buffer(buffer_),
        [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
          if (self->stopped_) return;
          if (ec == boost::asio::error::no_buffer_space) {
            // The kernel dropped link events (a storm filled the socket's buffer): what is still
            // queued is older than what was dropped, so it is discarded, and the state of every
            // interface is read from the interfaces themselves.
            R2CCL_WARN(
                "link watcher: the kernel dropped link events (ENOBUFS); re-reading the "
                "state of every interface");
            self->drain();
            self->resync();
            self->resyncs_.fetch_add(1, std::memory_order_relaxed);
            return self->arm();
          }
          if (ec) {
            if (ec != boost::asio::error::operation_aborted)
              R2CCL_WARN("link watcher stopped ({}); link failures are found by probes only",
                         ec.message());
            return;
          }
          self->parse(n);
          self->arm();
        });
  }

  // Every interface's state now, reported where it differs from what was last known (an
  // interface never heard of is reported only when it is down: up is what is assumed).
  void resync() {
    struct if_nameindex* all = ::if_nameindex();
    if (all == nullptr) return;
    for (auto* i = all; i->if_index != 0 && i->if_name != nullptr; ++i) {
      const std::string name = i->if_name;
      auto running = interface_running(name);
      if (!running) continue;
      auto it = last_.find(name);
      if (it == last_.end() ? *running : it->second == *running) continue;
      last_[name] = *running;
      R2CCL_INFO("link watcher: {} is {} (after the resync)", name, *running ? "up" : "down");
      handler_(name, *running);
    }
    ::if_freenameindex(all);
  }

  // Discards what the socket holds (bounded: what its buffer can hold, read in one pass).
  void drain() {
    for (int i = 0; i < 4096; ++i) {
      const ssize_t n =
          ::recv(stream_.native_handle(), buffer_.data(), buffer_.size(), MSG_DONTWAIT);
      if (n > 0) continue;
      if (n < 0 && errno == ENOBUFS) continue;  // reported again: more was dropped meanwhile
      break;
    }
  }

  std::uint64_t resyncs() const override { return resyncs_.load(std::memory_order_relaxed); }

  void stop() override {
    engine_.call([this] {
      stopped_ = true;
      boost::system::error_code ec;
      stream_.close(ec);
    });
  }

 private:
  void parse(std::size_t n) {
    parse_link_messages(buffer_.data(), n, [this](const std::string& name, bool running) {
      auto it = last_.find(name);
      if (it != last_.end() && it->second == running) return;
      last_[name] = running;
      R2CCL_DEBUG("link watcher: {} is {}", name, running ? "up" : "down");
      handler_(name, running);
    });
  }

  ProgressEngine& engine_;
  boost::asio::posix::stream_descriptor stream_;
  Handler handler_;
  std::vector<char> buffer_;
  std::map<std::string, bool> last_;
  bool stopped_ = false;
  std::atomic<std::uint64_t> resyncs_{0};
};

}  // namespace

// The rtnetlink macros are C: they cast the old way.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wcast-align"
#pragma GCC diagnostic ignored "-Wsign-compare"
void parse_link_messages(const char* buffer, std::size_t n,
                         const std::function<void(const std::string& ifname, bool running)>& each) {
  // NLMSG_OK takes a signed length on some C libraries: keep it in range.
  int len = static_cast<int>(std::min<std::size_t>(n, 1u << 30));
  for (auto* h = reinterpret_cast<const nlmsghdr*>(buffer); NLMSG_OK(h, len);
       h = NLMSG_NEXT(h, len)) {
    if (h->nlmsg_type != RTM_NEWLINK && h->nlmsg_type != RTM_DELLINK) continue;
    if (h->nlmsg_len < NLMSG_LENGTH(sizeof(ifinfomsg))) continue;  // too short for its header
    const auto* ifi = static_cast<const ifinfomsg*>(NLMSG_DATA(h));
    std::string name;
    int attr_len = static_cast<int>(IFLA_PAYLOAD(h));
    for (auto* a = IFLA_RTA(ifi); RTA_OK(a, attr_len); a = RTA_NEXT(a, attr_len))
      if (a->rta_type == IFLA_IFNAME) {
        // Bounded by the attribute's payload, not by a terminator the kernel may not have sent.
        const auto* data = static_cast<const char*>(RTA_DATA(a));
        name.assign(data, ::strnlen(data, RTA_PAYLOAD(a)));
      }
    if (name.empty()) continue;
    each(name, h->nlmsg_type == RTM_NEWLINK && (ifi->ifi_flags & IFF_UP) &&
                   (ifi->ifi_flags & IFF_RUNNING));
  }
}
#pragma GCC diagnostic pop

Result<std::unique_ptr<LinkWatcher>> LinkWatcher::start(ProgressEngine& engine, Handler handler) {
  auto w = std::make_shared<NetlinkWatcher>(engine, std::move(handler));
  R2CCL_RETURN_IF_ERROR(w->open());
  engine.call([&] { w->arm(); });
  // The caller owns a handle; the reader keeps the object alive until stop().
  struct Handle final : LinkWatcher {
    std::shared_ptr<NetlinkWatcher> impl;
    void stop() override { impl->stop(); }
    std::uint64_t resyncs() const override { return impl->resyncs(); }
    ~Handle() override { impl->stop(); }
  };
  auto h = std::make_unique<Handle>();
  h->impl = std::move(w);
  return std::unique_ptr<LinkWatcher>(std::move(h));
}

Result<bool> interface_running(const std::string& ifname) {
  if (ifname.size() >= IFNAMSIZ)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("interface name '{}' is too long", ifname));
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(ErrorCode::kNetwork, "cannot open a socket");
  ifreq req{};
  std::memcpy(req.ifr_name, ifname.c_str(), ifname.size());
  const int rc = ::ioctl(fd, SIOCGIFFLAGS, &req);
  ::close(fd);
  if (rc != 0) return Status(ErrorCode::kNotFound, fmt::format("no interface named '{}'", ifname));
  return (req.ifr_flags & IFF_UP) && (req.ifr_flags & IFF_RUNNING);
}

}  // namespace r2ccl

#include "net_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>

namespace r2ccl::mon::test {
namespace {

sockaddr_in loopback(std::uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

sockaddr* raw(sockaddr_in& a) {
  return reinterpret_cast<sockaddr*>(&a);
}

}  // namespace

std::uint16_t free_port(bool udp) {
  const int fd = ::socket(AF_INET, udp ? SOCK_DGRAM : SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a = loopback(0);
  std::uint16_t port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, raw(a), sizeof a) == 0 && ::getsockname(fd, raw(a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

std::string http_get(std::uint16_t port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a = loopback(port);
  std::string out;
  if (::connect(fd, raw(a), sizeof a) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      std::array<char, 4096> buf{};
      for (int i = 0; i < 4096; ++i) {  // bounded: at most 16 MiB
        const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
        if (n <= 0) break;
        out.append(buf.data(), static_cast<std::size_t>(n));
      }
    }
  }
  ::close(fd);
  return out;
}

PortHolder::PortHolder(std::uint16_t port, bool udp) {
  fd_ = ::socket(AF_INET, udp ? SOCK_DGRAM : SOCK_STREAM, 0);
  if (fd_ < 0) return;
  sockaddr_in a = loopback(port);
  if (::bind(fd_, raw(a), sizeof a) != 0 || (!udp && ::listen(fd_, 1) != 0)) {
    ::close(fd_);
    fd_ = -1;
  }
}

PortHolder::~PortHolder() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace r2ccl::mon::test

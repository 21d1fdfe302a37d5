// Loopback helpers for the monitor's socket tests (127.0.0.1 only).
#pragma once

#include <cstdint>
#include <string>

namespace r2ccl::mon::test {

// A TCP (or UDP) port on 127.0.0.1 that was free a moment ago.
std::uint16_t free_port(bool udp = false);

// A plain HTTP/1.0 GET to 127.0.0.1:port; returns "STATUS_LINE\n...BODY" or "" on failure.
// Bounded by a 5 s socket timeout.
std::string http_get(std::uint16_t port, const std::string& path);

// Holds a bound (and, for TCP, listening) socket on 127.0.0.1:port until destroyed.
class PortHolder {
 public:
  PortHolder(std::uint16_t port, bool udp);
  ~PortHolder();
  PortHolder(const PortHolder&) = delete;
  PortHolder& operator=(const PortHolder&) = delete;
  bool ok() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace r2ccl::mon::test

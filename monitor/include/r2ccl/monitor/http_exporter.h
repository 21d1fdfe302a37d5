// The HTTP side of r2ccl-monitor: prometheus-cpp's Exposer (civetweb) serving /metrics, plus
// /healthz answered "ok" from civetweb's begin_request callback on the same server.
#pragma once

#include <prometheus/collectable.h>

#include <cstdint>
#include <memory>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::mon {

class HttpExporter {
 public:
  // Listens on `listen` (an IPv4 literal and a port). A port in use or an address that is not
  // this host's gives an error naming it; nothing is thrown.
  static Result<std::unique_ptr<HttpExporter>> start(
      const HostPort& listen, const std::weak_ptr<prometheus::Collectable>& collectable);
  ~HttpExporter();
  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

  std::uint16_t port() const { return port_; }

 private:
  struct Impl;
  struct PassKey {
    explicit PassKey() = default;
  };

 public:
  HttpExporter(PassKey key, std::unique_ptr<Impl> impl, std::uint16_t port);

 private:
  std::unique_ptr<Impl> impl_;
  std::uint16_t port_ = 0;
};

}  // namespace r2ccl::mon

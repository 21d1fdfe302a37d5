#include "r2ccl/monitor/http_exporter.h"

#include <CivetServer.h>
#include <arpa/inet.h>
#include <civetweb.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <prometheus/exposer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>
#include <set>
#include <string_view>

namespace r2ccl::mon {
namespace {

constexpr std::string_view kHealthzPath = "/healthz";

// The ports whose server serves /metrics already. civetweb listens (and answers /healthz) from
// the Exposer's construction, before /metrics is registered: until then /healthz says 503, so
// that "healthy" means "scrapable".
std::mutex ready_mutex;
std::set<int> ready_ports;

bool ready(int port) {
  std::lock_guard lock(ready_mutex);
  return ready_ports.contains(port);
}

// civetweb calls this before its URI handlers; a non-zero return means "handled".
int begin_request(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  if (info == nullptr || info->local_uri == nullptr || kHealthzPath != info->local_uri) return 0;
  const bool up = ready(info->server_port);
  static constexpr char kOk[] = "ok\n";
  static constexpr char kStarting[] = "starting\n";
  const std::string_view body = up ? std::string_view(kOk, sizeof kOk - 1)
                                   : std::string_view(kStarting, sizeof kStarting - 1);
  mg_printf(conn,
            "HTTP/1.1 %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            up ? "200 OK" : "503 Service Unavailable", body.size());
  if (std::string_view(info->request_method == nullptr ? "" : info->request_method) != "HEAD")
    mg_write(conn, body.data(), body.size());
  return up ? 200 : 503;
}

// Binds and releases the address first, so that a port in use or a foreign address gives a
// message naming it (civetweb only says that it could not start).
Status check_bindable(const HostPort& listen) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(listen.port);
  if (inet_pton(AF_INET, listen.host.c_str(), &addr.sin_addr) != 1)
    return Status(
        ErrorCode::kInvalidArgument,
        fmt::format("--listen {}: '{}' is not an IPv4 address", listen.to_string(), listen.host));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(ErrorCode::kNetwork, fmt::format("socket: {}", std::strerror(errno)));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as civetweb does
  int err = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 1) != 0)
    err = errno;
  ::close(fd);
  if (err == 0) return Status::ok();
  if (err == EADDRINUSE)
    return Status(ErrorCode::kUnavailable,
                  fmt::format("--listen {}: port {} is already in use on {}", listen.to_string(),
                              listen.port, listen.host));
  if (err == EADDRNOTAVAIL)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("--listen {}: {} is not an address of this host", listen.to_string(),
                              listen.host));
  return Status(ErrorCode::kNetwork,
                fmt::format("--listen {}: {}", listen.to_string(), std::strerror(err)));
}

}  // namespace

struct HttpExporter::Impl {
  CivetCallbacks callbacks;
  std::unique_ptr<prometheus::Exposer> exposer;
};

HttpExporter::HttpExporter(PassKey /*key*/, std::unique_ptr<Impl> impl, std::uint16_t port)
    : impl_(std::move(impl)), port_(port) {}

HttpExporter::~HttpExporter() {
  {
    std::lock_guard lock(ready_mutex);
    ready_ports.erase(port_);
  }
  impl_.reset();  // the Exposer stops civetweb and joins its threads
}

Result<std::unique_ptr<HttpExporter>> HttpExporter::start(
    const HostPort& listen, const std::weak_ptr<prometheus::Collectable>& collectable) {
  R2CCL_RETURN_IF_ERROR(check_bindable(listen));
  auto impl = std::make_unique<Impl>();
  impl->callbacks.begin_request = &begin_request;
  std::uint16_t port = 0;
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", listen.to_string(), "num_threads", "2"},
        &impl->callbacks);
    impl->exposer->RegisterCollectable(collectable, "/metrics");
    const auto ports = impl->exposer->GetListeningPorts();
    port = ports.empty() ? listen.port : static_cast<std::uint16_t>(ports.front());
    std::lock_guard lock(ready_mutex);
    ready_ports.insert(port);
  } catch (const std::exception& e) {
    return Status(
        ErrorCode::kUnavailable,
        fmt::format("--listen {}: cannot start the HTTP server: {}", listen.to_string(), e.what()));
  }
  return std::make_unique<HttpExporter>(PassKey(), std::move(impl), port);
}

}  // namespace r2ccl::mon

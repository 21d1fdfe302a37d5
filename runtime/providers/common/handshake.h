// What the socket-handshaking providers (tcp, verbs) share: the rail hello's encoding, the
// endpoint a provider publishes (an IPv4 address and a TCP port), and the provider counters.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <optional>
#include <string>

#include "progress/asio.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

// token (16) | u16 version | u64 src incarnation | u64 dst incarnation | u32 rail | u32 epoch |
// blob description, little-endian.
constexpr std::uint16_t kHelloVersion = 2;
constexpr std::size_t kHelloMinSize = 16 + 2 + 8 + 8 + 4 + 4 + 4;
constexpr std::size_t kHelloMaxSize = kHelloMinSize + RailHello::kMaxDescription;

inline void write_hello(ByteWriter& w, const RailHello& h) {
  w.raw(h.token.data(), h.token.size())
      .u16(kHelloVersion)
      .u64(h.src_incarnation)
      .u64(h.dst_incarnation)
      .u32(h.rail)
      .u32(h.epoch);
  if (h.description)
    w.blob(*h.description);
  else
    w.blob(Bytes{});
}

// A hello, or an error naming what was wrong with it (r's error state says so too).
inline Result<RailHello> read_hello(ByteReader& r) {
  RailHello h;
  r.raw(h.token.data(), h.token.size());
  const auto version = r.u16();
  if (r.ok() && version != kHelloVersion)
    return Status(
        ErrorCode::kProtocol,
        fmt::format("rail hello of version {} (this build speaks {})", version, kHelloVersion));
  h.src_incarnation = r.u64();
  h.dst_incarnation = r.u64();
  h.rail = r.u32();
  h.epoch = r.u32();
  h.description = std::make_shared<const Bytes>(r.blob(RailHello::kMaxDescription));
  if (!r.ok()) return Status(ErrorCode::kProtocol, "malformed rail hello");
  return h;
}

inline Bytes encode_endpoint(const std::string& address, std::uint16_t port) {
  return ByteWriter().str(address).u16(port).take();
}

// The endpoint a peer published, or an error naming it.
inline Result<boost::asio::ip::tcp::endpoint> decode_endpoint(const Bytes& remote,
                                                              std::string_view provider) {
  ByteReader r(remote);
  std::string host = r.str(64);
  const auto port = r.u16();
  boost::system::error_code ec;
  auto addr = boost::asio::ip::make_address_v4(host, ec);
  if (!r.finish("endpoint").is_ok() || ec)
    return Status(ErrorCode::kProtocol,
                  fmt::format("peer published a malformed {} endpoint '{}'", provider, host));
  return boost::asio::ip::tcp::endpoint(addr, port);
}

struct AtomicProviderCounters {
  std::atomic<std::uint64_t> refused_writes{0};
  std::atomic<std::uint64_t> dropped_connections{0};
  ProviderCounters snapshot() const { return {refused_writes.load(), dropped_connections.load()}; }
};

}  // namespace r2ccl

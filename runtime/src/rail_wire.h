// What the socket-handshaking providers (tcp, verbs) share: the rail hello's encoding, the
// endpoint a provider publishes (an IPv4 address and a TCP port), and the provider counters.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <optional>
#include <string>

#include "r2ccl/runtime/asio.h"
#include "r2ccl/runtime/provider.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

// token (16) | src_rank | dst_rank | rail | epoch, little-endian.
constexpr std::size_t kHelloSize = 16 + 4 * 4;

inline void write_hello(ByteWriter& w, const RailHello& h) {
  w.raw(h.token.data(), h.token.size()).u32(h.src_rank).u32(h.dst_rank).u32(h.rail).u32(h.epoch);
}

inline RailHello read_hello(ByteReader& r) {
  RailHello h;
  r.raw(h.token.data(), h.token.size());
  h.src_rank = r.u32();
  h.dst_rank = r.u32();
  h.rail = r.u32();
  h.epoch = r.u32();
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

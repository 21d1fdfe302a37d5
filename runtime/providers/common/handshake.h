// What the socket-handshaking providers (tcp, verbs) share: the authenticated rail handshake, the
// endpoint a provider publishes (an IPv4 address and a TCP port), and the provider counters.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <optional>
#include <string>

#include "common/pending_hellos.h"
#include "core/crypto.h"
#include "progress/asio.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

// The rail handshake of the socket-handshaking providers, a challenge-response so that the job's
// token never crosses the wire:
//   acceptor -> connector: the challenge, a fresh random nonce (kChallengeSize bytes)
//   connector -> acceptor: the hello: u16 version | u64 src incarnation | u64 dst incarnation |
//     u32 rail | u32 epoch | blob description | client nonce (16) | MAC (32), little-endian;
//     MAC = HMAC-SHA256(token, "r2ccl rail hello" | challenge | every hello byte before the MAC)
//   acceptor -> connector: the acknowledgement, kAckSize bytes:
//     HMAC-SHA256(token, "r2ccl rail ack" | client nonce | challenge)
// A hello replayed from another connection fails its fresh challenge; the acknowledgement
// proves to the connector that the acceptor holds the token too.
constexpr std::uint16_t kHelloVersion = 3;
constexpr std::size_t kChallengeSize = sizeof(crypto::Nonce);
constexpr std::size_t kAckSize = sizeof(crypto::Mac);
constexpr std::size_t kHelloMinSize = 2 + 8 + 8 + 4 + 4 + 4 + kChallengeSize + kAckSize;
constexpr std::size_t kHelloMaxSize = kHelloMinSize + RailHello::kMaxDescription;

// The connector's hello for the acceptor's challenge; `client` receives its nonce.
Result<Bytes> encode_hello(const RailHello& hello, const crypto::Nonce& challenge,
                           crypto::Nonce* client);
struct AcceptedHello {
  RailHello hello;  // with the acceptor's token
  crypto::Nonce client{};
  std::size_t size = 0;  // bytes of `data` it took (more may follow: the verbs handshake's)
};
// The acceptor's checks, before anything else is done with the connection: the hello parses
// and its MAC proves the token. The error names what was wrong.
Result<AcceptedHello> accept_hello(std::span<const std::byte> data, const Token& token,
                                   const crypto::Nonce& challenge);
Result<Bytes> encode_ack(const Token& token, const crypto::Nonce& client,
                         const crypto::Nonce& challenge);
Status check_ack(std::span<const std::byte> ack, const Token& token, const crypto::Nonce& client,
                 const crypto::Nonce& challenge);

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

// The rail acceptors' handshakes (tcp, verbs: a state with `done`, `from`, `nic`, `timer` and
// `socket`). An accepted connection's handshake ends: closed, counted and logged as dropped.
template <class Handshake>
void drop_accepted(PendingHellos<Handshake>& pending, AtomicProviderCounters& counters,
                   Handshake& hs, const std::string& why) {
  hs.done = true;
  pending.settle(&hs);
  counters.dropped_connections.fetch_add(1);
  R2CCL_WARN_LIMITED("dropped a rail connection from {} on {}: {}", hs.from, hs.nic, why);
  boost::system::error_code e;
  hs.timer.cancel();
  hs.socket.close(e);
}

// Counts a connection accepted from `source` among those waiting for their hello: false where
// its source holds its share already (it is dropped at once); past the total the oldest one is
// dropped (kMaxPendingHellosPerSource, kMaxPendingHellos).
template <class Handshake>
bool admit_accepted(PendingHellos<Handshake>& pending, AtomicProviderCounters& counters,
                    const std::shared_ptr<Handshake>& hs, const std::string& source) {
  auto admitted = pending.admit(hs, source);
  if (!admitted) {
    drop_accepted(pending, counters, *hs, admitted.status().message());
    return false;
  }
  if (*admitted) drop_accepted(pending, counters, **admitted, pending.shed_reason());
  return true;
}

}  // namespace r2ccl

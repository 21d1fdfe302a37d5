#include "common/handshake.h"

#include <cstring>

namespace r2ccl {
namespace {

std::span<const std::uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}
std::span<const std::uint8_t> bytes_of(std::span<const std::byte> b) {
  return {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()};
}

constexpr std::string_view kHelloLabel = "r2ccl rail hello";
constexpr std::string_view kAckLabel = "r2ccl rail ack";

}  // namespace

Result<Bytes> encode_hello(const RailHello& h, const crypto::Nonce& challenge,
                           crypto::Nonce* client) {
  R2CCL_ASSIGN_OR_RETURN(*client, crypto::make_nonce());
  ByteWriter w;
  w.u16(kHelloVersion)
      .u64(h.src_incarnation)
      .u64(h.dst_incarnation)
      .u32(h.rail)
      .u32(h.epoch)
      .blob(h.description ? std::span<const std::byte>(*h.description)
                          : std::span<const std::byte>())
      .raw(client->data(), client->size());
  R2CCL_ASSIGN_OR_RETURN(auto mac,
                         crypto::hmac(h.token, {bytes_of(kHelloLabel), challenge,
                                                bytes_of(std::span<const std::byte>(w.bytes()))}));
  w.raw(mac.data(), mac.size());
  return w.take();
}

Result<AcceptedHello> accept_hello(std::span<const std::byte> data, const Token& token,
                                   const crypto::Nonce& challenge) {
  ByteReader r(data);
  AcceptedHello a;
  const auto version = r.u16();
  if (r.ok() && version != kHelloVersion)
    return Status(
        ErrorCode::kProtocol,
        fmt::format("rail hello of version {} (this build speaks {})", version, kHelloVersion));
  a.hello.src_incarnation = r.u64();
  a.hello.dst_incarnation = r.u64();
  a.hello.rail = r.u32();
  a.hello.epoch = r.u32();
  a.hello.description = std::make_shared<const Bytes>(r.blob(RailHello::kMaxDescription));
  r.raw(a.client.data(), a.client.size());
  const std::size_t signed_size = data.size() - r.remaining();
  crypto::Mac mac{};
  r.raw(mac.data(), mac.size());
  if (!r.ok()) return Status(ErrorCode::kProtocol, "malformed rail hello");
  R2CCL_ASSIGN_OR_RETURN(auto want, crypto::hmac(token, {bytes_of(kHelloLabel), challenge,
                                                         bytes_of(data.first(signed_size))}));
  if (!crypto::equal(mac, want))
    return Status(ErrorCode::kProtocol,
                  "wrong token (the hello does not answer the challenge with this job's token)");
  a.hello.token = token;
  a.size = data.size() - r.remaining();
  return a;
}

Result<Bytes> encode_ack(const Token& token, const crypto::Nonce& client,
                         const crypto::Nonce& challenge) {
  R2CCL_ASSIGN_OR_RETURN(auto mac, crypto::hmac(token, {bytes_of(kAckLabel), client, challenge}));
  return Bytes(reinterpret_cast<const std::byte*>(mac.data()),
               reinterpret_cast<const std::byte*>(mac.data()) + mac.size());
}

Status check_ack(std::span<const std::byte> ack, const Token& token, const crypto::Nonce& client,
                 const crypto::Nonce& challenge) {
  if (ack.size() != kAckSize)
    return {ErrorCode::kProtocol, fmt::format("handshake reply of {} bytes", ack.size())};
  R2CCL_ASSIGN_OR_RETURN(auto want, crypto::hmac(token, {bytes_of(kAckLabel), client, challenge}));
  crypto::Mac got{};
  std::memcpy(got.data(), ack.data(), got.size());
  if (!crypto::equal(got, want))
    return {ErrorCode::kProtocol,
            "the peer does not know this job's token (its handshake reply does not match)"};
  return Status::ok();
}

}  // namespace r2ccl

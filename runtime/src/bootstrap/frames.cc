#include "bootstrap/frames.h"

#include <fmt/format.h>

#include <cstring>

namespace r2ccl::bootstrap_wire {

namespace {
// n blobs, n from the wire and required to equal the world size (so a count never sizes
// anything by itself).
Result<std::vector<Bytes>> rank_blobs(ByteReader& r, int nranks, const char* what) {
  const auto n = r.u32();
  if (!r.ok()) return Status(ErrorCode::kProtocol, fmt::format("malformed {}", what));
  if (nranks < 0 || n != static_cast<std::uint32_t>(nranks))
    return Status(ErrorCode::kProtocol,
                  fmt::format("{}: {} entries for a world of {} ranks", what, n, nranks));
  std::vector<Bytes> out;
  for (std::uint32_t i = 0; i < n && r.ok(); ++i)
    out.push_back(r.blob());
  R2CCL_RETURN_IF_ERROR(r.finish(what));
  return out;
}
}  // namespace

HeaderBytes encode_header(FrameType type, std::size_t len) {
  ByteWriter w;
  w.u32(kMagic)
      .u16(static_cast<std::uint16_t>(type))
      .u16(kVersion)
      .u32(static_cast<std::uint32_t>(len));
  HeaderBytes h{};
  std::memcpy(h.data(), w.bytes().data(), kHeaderSize);
  return h;
}

Result<Header> decode_header(const HeaderBytes& h) {
  ByteReader r(h);
  const auto magic = r.u32();
  const auto type = r.u16();
  const auto version = r.u16();
  const auto len = r.u32();
  if (magic != kMagic)
    return Status(ErrorCode::kProtocol, "not an r2ccl bootstrap connection (bad magic)");
  if (version != kVersion)
    return Status(
        ErrorCode::kProtocol,
        fmt::format("bootstrap protocol version {} (this build speaks {})", version, kVersion));
  if (len > kMaxFrame)
    return Status(ErrorCode::kProtocol,
                  fmt::format("bootstrap frame of {} bytes is too large", len));
  return Header{static_cast<FrameType>(type), len};
}

Bytes frame(FrameType type, const Bytes& payload) {
  auto h = encode_header(type, payload.size());
  Bytes out(kHeaderSize + payload.size());
  std::memcpy(out.data(), h.data(), kHeaderSize);
  if (!payload.empty()) std::memcpy(out.data() + kHeaderSize, payload.data(), payload.size());
  return out;
}

Result<Hello> parse_hello(std::span<const std::byte> payload) {
  ByteReader r(payload);
  Hello h;
  h.version = r.u32();
  h.rank = static_cast<int>(r.u32());
  h.nranks = static_cast<int>(r.u32());
  h.info = r.blob();
  r.raw(h.client.data(), h.client.size());
  h.signed_size = payload.size() - r.remaining();
  r.raw(h.mac.data(), h.mac.size());
  if (!r.finish("bootstrap hello").is_ok() || h.version != kVersion)
    return Status(ErrorCode::kProtocol, "malformed bootstrap hello");
  return h;
}

Result<Coll> parse_coll(std::span<const std::byte> payload) {
  ByteReader r(payload);
  Coll c;
  c.seq = r.u64();
  c.blob = r.blob();
  R2CCL_RETURN_IF_ERROR(r.finish("bootstrap all-gather"));
  return c;
}

Result<Relayed> parse_relayed(std::span<const std::byte> payload) {
  ByteReader r(payload);
  Relayed m;
  m.rank = r.u32();
  m.message = r.blob();
  R2CCL_RETURN_IF_ERROR(r.finish("relayed control message"));
  return m;
}

Result<Sequenced> parse_sequenced(std::span<const std::byte> payload) {
  ByteReader r(payload);
  Sequenced m;
  m.seq = r.u64();
  if (!r.ok() || m.seq == 0)
    return Status(ErrorCode::kProtocol,
                  "malformed control message: no sequence number (or sequence number 0)");
  m.message.assign(payload.begin() + 8, payload.end());
  return m;
}

Bytes encode_sequenced(std::uint64_t seq, std::span<const std::byte> message) {
  return ByteWriter(8 + message.size()).u64(seq).raw(message.data(), message.size()).take();
}

Result<Direct> parse_direct(std::span<const std::byte> payload) {
  ByteReader r(payload);
  Direct d;
  const auto kind = r.u8();
  d.seq = r.u64();
  if (!r.ok())
    return Status(ErrorCode::kProtocol,
                  fmt::format("direct control message of {} bytes is too short", payload.size()));
  if (kind != static_cast<std::uint8_t>(DirectKind::kContribution) &&
      kind != static_cast<std::uint8_t>(DirectKind::kMessage))
    return Status(ErrorCode::kProtocol,
                  fmt::format("direct control message of unknown kind {}", kind));
  if (d.seq == 0)
    return Status(ErrorCode::kProtocol, "direct control message with sequence number 0");
  d.kind = static_cast<DirectKind>(kind);
  d.body.assign(payload.begin() + 9, payload.end());
  return d;
}

Bytes encode_direct(DirectKind kind, std::uint64_t seq, std::span<const std::byte> body) {
  return ByteWriter(9 + body.size())
      .u8(static_cast<std::uint8_t>(kind))
      .u64(seq)
      .raw(body.data(), body.size())
      .take();
}

Result<Welcome> parse_welcome(std::span<const std::byte> payload, int nranks) {
  ByteReader r(payload);
  Welcome w;
  r.raw(w.proof.data(), w.proof.size());
  R2CCL_ASSIGN_OR_RETURN(w.info, rank_blobs(r, nranks, "bootstrap welcome"));
  return w;
}

Result<std::vector<Bytes>> parse_coll_result(std::span<const std::byte> payload, int nranks) {
  ByteReader r(payload);
  (void)r.u64();
  return rank_blobs(r, nranks, "control-path all-gather result");
}

std::optional<std::uint64_t> coll_result_seq(std::span<const std::byte> payload) {
  ByteReader r(payload);
  const auto seq = r.u64();
  if (!r.ok()) return std::nullopt;
  return seq;
}

Result<PeerLeft> parse_peer_left(std::span<const std::byte> payload) {
  ByteReader r(payload);
  PeerLeft p;
  p.rank = static_cast<int>(r.u32());
  p.why = r.str(4096);
  R2CCL_RETURN_IF_ERROR(r.finish("peer-left notice"));
  return p;
}

Result<std::string> parse_error(std::span<const std::byte> payload) {
  ByteReader r(payload);
  std::string why = r.str(4096);
  R2CCL_RETURN_IF_ERROR(r.finish("bootstrap error frame"));
  return why;
}

Status decode_id(std::span<const std::byte> id, HostPort* at, Token* token) {
  ByteReader r(id);
  if (r.u32() != kIdMagic)
    return {ErrorCode::kInvalidArgument, "not an r2ccl unique id (bad magic)"};
  at->host = r.str(64);
  at->port = r.u16();
  r.raw(token->data(), token->size());
  if (!r.ok() || at->host.empty())
    return {ErrorCode::kInvalidArgument, "malformed r2ccl unique id"};
  return Status::ok();
}

}  // namespace r2ccl::bootstrap_wire

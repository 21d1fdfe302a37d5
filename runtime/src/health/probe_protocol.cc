#include "r2ccl/runtime/probe_protocol.h"

#include <span>

#include "r2ccl/runtime/wire.h"

namespace r2ccl {

std::array<std::uint8_t, ProbePacket::kSize> ProbePacket::encode() const {
  ByteWriter w(kSize);
  w.u32(kMagic)
      .u8(kVersion)
      .u8(static_cast<std::uint8_t>(type))
      .u16(0)
      .u64(tag)
      .u64(src)
      .u64(dst)
      .u32(peer)
      .u32(rail)
      .u64(sequence)
      .u64(send_time_ns);
  std::array<std::uint8_t, kSize> out{};
  const auto& b = w.bytes();
  for (std::size_t i = 0; i < kSize && i < b.size(); ++i)
    out[i] = std::to_integer<std::uint8_t>(b[i]);
  return out;
}

std::optional<ProbePacket> ProbePacket::decode(const std::uint8_t* data, std::size_t size) {
  if (data == nullptr || size != kSize) return std::nullopt;
  ByteReader r(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (r.u32() != kMagic || r.u8() != kVersion) return std::nullopt;
  ProbePacket p;
  const auto type = r.u8();
  if (type != static_cast<std::uint8_t>(Type::kRequest) &&
      type != static_cast<std::uint8_t>(Type::kReply))
    return std::nullopt;
  p.type = static_cast<Type>(type);
  r.u16();
  p.tag = r.u64();
  p.src = r.u64();
  p.dst = r.u64();
  p.peer = r.u32();
  p.rail = r.u32();
  p.sequence = r.u64();
  p.send_time_ns = r.u64();
  if (!r.ok()) return std::nullopt;
  return p;
}

}  // namespace r2ccl

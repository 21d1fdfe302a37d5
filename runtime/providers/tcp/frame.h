// The tcp provider's frame header: 40 bytes, little-endian,
//   u16 magic "R2" | u8 op | u8 flags | u32 imm | u64 key | u64 offset | u32 length |
//   u32 CRC-32C of the other 36 bytes | u64 cookie
// followed by `length` payload bytes. The checksum covers what says where a write lands (key,
// offset, length, imm) and what it confirms (cookie): a header corrupted on the way fails the
// rail (and its data is replayed on another) instead of landing somewhere else.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "r2ccl/runtime/status.h"

namespace r2ccl::tcp_frame {

constexpr std::uint16_t kMagic = 0x3252;  // "R2"
constexpr std::size_t kHeaderSize = 40;
constexpr std::size_t kChecksumAt = 28;  // the u32 checksum's offset in the header

enum class Op : std::uint8_t {
  kHello = 1,
  kHelloAck = 2,
  kWrite = 3,
  kWriteAck = 4,
  kWriteNack = 5,
  kControl = 6,
  kChallenge = 7,  // the acceptor's first frame: the handshake's nonce (common/handshake.h)
};

struct Header {
  Op op{};
  std::uint8_t flags = 0;
  std::uint32_t imm = 0;
  std::uint64_t key = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;  // 32 bits on the wire; the provider's bounds are far below
  std::uint64_t cookie = 0;
};
using HeaderBytes = std::array<std::byte, kHeaderSize>;

// CRC-32C of the header's bytes other than its checksum field.
std::uint32_t checksum(const HeaderBytes& b);
// With its checksum filled in.
HeaderBytes encode(const Header& h);
// kProtocol for a bad magic or checksum, saying which.
Result<Header> decode(const HeaderBytes& b);

}  // namespace r2ccl::tcp_frame

#include "tcp/frame.h"

#include <fmt/format.h>

#include <boost/crc.hpp>

#include "r2ccl/runtime/wire.h"

namespace r2ccl::tcp_frame {

std::uint32_t checksum(const HeaderBytes& b) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;  // CRC-32C
  crc.process_bytes(b.data(), kChecksumAt);
  crc.process_bytes(b.data() + kChecksumAt + 4, kHeaderSize - kChecksumAt - 4);
  return crc.checksum();
}

HeaderBytes encode(const Header& h) {
  HeaderBytes out{};
  std::byte* p = out.data();
  store_le(p, kMagic);
  store_le(p + 2, static_cast<std::uint8_t>(h.op));
  store_le(p + 3, h.flags);
  store_le(p + 4, h.imm);
  store_le(p + 8, h.key);
  store_le(p + 16, h.offset);
  store_le(p + 24, static_cast<std::uint32_t>(h.length));
  store_le(p + 32, h.cookie);
  store_le(p + kChecksumAt, checksum(out));
  return out;
}

Result<Header> decode(const HeaderBytes& b) {
  const std::byte* p = b.data();
  const auto magic = static_cast<std::uint16_t>(load_le(p, 2));
  if (magic != kMagic)
    return Status(ErrorCode::kProtocol, fmt::format("malformed frame: bad magic 0x{:04x}", magic));
  const auto sent = static_cast<std::uint32_t>(load_le(p + kChecksumAt, 4));
  if (const std::uint32_t computed = checksum(b); sent != computed)
    return Status(ErrorCode::kProtocol,
                  fmt::format("malformed frame: header checksum 0x{:08x}, computed 0x{:08x} (the "
                              "header was corrupted on the way)",
                              sent, computed));
  Header h;
  h.op = static_cast<Op>(load_le(p + 2, 1));
  h.flags = static_cast<std::uint8_t>(load_le(p + 3, 1));
  h.imm = static_cast<std::uint32_t>(load_le(p + 4, 4));
  h.key = load_le(p + 8, 8);
  h.offset = load_le(p + 16, 8);
  h.length = load_le(p + 24, 4);
  h.cookie = load_le(p + 32, 8);
  return h;
}

}  // namespace r2ccl::tcp_frame

// The probe datagram: one wire format for the runtime's rail probes and r2ccl-monitor's NIC
// probes. Little-endian, 56 bytes:
//   0 magic "R2PB" (u32)   4 version (u8)   5 type (u8: 1 request, 2 reply)   6 reserved (2)
//   8 tag (u64)   16 src (u64)   24 dst (u64)   32 peer (u32)   36 rail (u32)
//   40 sequence (u64)   48 send time, ns (u64, the sender's clock)
// A responder answers a well-formed request with the same fields and type = reply, so it never
// sends more than it receives and never answers a reply. Who answers what:
// - the runtime answers requests whose tag is its job's and whose dst is its own incarnation;
// - r2ccl-monitor answers every request whose dst is 0 (any responder).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace r2ccl {

struct ProbePacket {
  static constexpr std::size_t kSize = 56;
  static constexpr std::uint32_t kMagic = 0x42503252;  // "R2PB"
  static constexpr std::uint8_t kVersion = 2;
  enum class Type : std::uint8_t { kRequest = 1, kReply = 2 };

  Type type = Type::kRequest;
  std::uint64_t tag = 0;   // the job's (runtime); 0 for the monitor
  std::uint64_t src = 0;   // the sender: an endpoint's incarnation; 0 for the monitor
  std::uint64_t dst = 0;   // the endpoint meant to answer; 0: any responder
  std::uint32_t peer = 0;  // the sender's number for the target, echoed back
  std::uint32_t rail = 0;
  std::uint64_t sequence = 0;
  std::uint64_t send_time_ns = 0;

  std::array<std::uint8_t, kSize> encode() const;
  // nullopt unless `data` is exactly one well-formed packet.
  static std::optional<ProbePacket> decode(const std::uint8_t* data, std::size_t size);
  // The answer to this request.
  ProbePacket reply() const {
    ProbePacket p = *this;
    p.type = Type::kReply;
    return p;
  }
};

}  // namespace r2ccl

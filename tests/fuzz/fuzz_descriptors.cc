// What peers publish about themselves: an endpoint's blob or handle (binary and hex), a remote
// region's keys, a KV layout, and the probe datagram every NIC answers (the runtime's and the
// monitor's). The first byte picks the parser.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "r2ccl/kv/layout.h"
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/probe_protocol.h"

using namespace r2ccl;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  switch (data[0] % 5) {
    case 0: {
      auto info = EndpointInfo::decode(in);
      if (info) {
        // What decodes encodes again, and decodes to the same description.
        auto again = EndpointInfo::decode(info->encode(true));
        if (!again || again->incarnation != info->incarnation || again->name != info->name)
          __builtin_trap();
      }
      break;
    }
    case 1:
      (void)blob_from_hex(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
      break;
    case 2: {
      ByteReader r(in);
      const RemoteRegion region = RemoteRegion::decode(r);
      if (r.ok() && region.keys.size() > 64) __builtin_trap();
      break;
    }
    case 3: {
      ByteReader r(in);
      auto layout = kv::KvLayout::decode(r);
      (void)layout;
      break;
    }
    case 4: {
      auto p = ProbePacket::decode(data + 1, size - 1);
      if (p &&
          (size - 1 != ProbePacket::kSize ||
           ProbePacket::decode(p->encode().data(), ProbePacket::kSize)->sequence != p->sequence))
        __builtin_trap();
      break;
    }
  }
  return 0;
}

// The bootstrap's parsers, each fed the input: the frame header, and every frame payload the root
// reads from a connection (hello, all-gather, send) or a rank reads from the root (welcome,
// all-gather result, relayed message, peer-left notice, error), the direct path's messages (from
// a rank over the rails), and the unique id.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "bootstrap/frames.h"

using namespace r2ccl;
using namespace r2ccl::bootstrap_wire;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t which = data[0];
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  switch (which % 10) {
    case 0: {
      HeaderBytes h{};
      std::memcpy(h.data(), in.data(), std::min(in.size(), h.size()));
      auto d = decode_header(h);
      if (d && d->length > kMaxFrame) __builtin_trap();
      break;
    }
    case 1: {
      auto h = parse_hello(in);
      if (h && (h->signed_size > in.size() || h->version != kVersion)) __builtin_trap();
      break;
    }
    case 2:
      (void)parse_coll(in);
      break;
    case 3:
      (void)parse_relayed(in);
      break;
    case 4: {
      auto w = parse_welcome(in, static_cast<int>(which / 10));
      if (w && w->info.size() != static_cast<std::size_t>(which / 10)) __builtin_trap();
      break;
    }
    case 5: {
      auto r = parse_coll_result(in, static_cast<int>(which / 10));
      if (r && r->size() != static_cast<std::size_t>(which / 10)) __builtin_trap();
      (void)coll_result_seq(in);
      break;
    }
    case 6: {
      // A relayed message's sequence number and body; the direct path's messages.
      if (auto m = parse_relayed(in)) {
        auto q = parse_sequenced(m->message);
        if (q && (q->seq == 0 || q->message.size() + 8 != m->message.size())) __builtin_trap();
      }
      auto d = parse_direct(in);
      if (d && (d->seq == 0 || d->body.size() + 9 != in.size())) __builtin_trap();
      break;
    }
    case 7: {
      auto p = parse_peer_left(in);
      if (p && p->why.size() > 4096) __builtin_trap();
      break;
    }
    case 8:
      (void)parse_error(in);
      break;
    case 9: {
      HostPort at;
      Token token{};
      (void)decode_id(in, &at, &token);
      break;
    }
  }
  return 0;
}

// The rail handshake of the tcp and verbs providers as the acceptor reads it (the connector's
// hello, checked against a challenge and the job's token), the connector's check of the
// acknowledgement, and a published endpoint. The input is also signed with the right token, so
// the fuzzer gets past the MAC and into what follows it.
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/handshake.h"

using namespace r2ccl;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Token token{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const crypto::Nonce challenge{9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto a = accept_hello(in, token, challenge);
  if (a && (a->size > size || !a->hello.description ||
            a->hello.description->size() > RailHello::kMaxDescription))
    __builtin_trap();
  // The same bytes with a valid MAC appended: what an authenticated peer could send.
  if (size >= kChallengeSize) {
    ByteWriter w;
    w.raw(data, size);
    auto mac =
        crypto::hmac(token, {std::span<const std::uint8_t>(
                                 reinterpret_cast<const std::uint8_t*>("r2ccl rail hello"), 16),
                             challenge, std::span<const std::uint8_t>(data, size)});
    if (mac) {
      w.raw(mac->data(), mac->size());
      auto signed_hello = accept_hello(w.bytes(), token, challenge);
      if (signed_hello && signed_hello->size > w.bytes().size()) __builtin_trap();
    }
  }
  (void)check_ack(in, token, challenge, challenge);
  (void)decode_endpoint(Bytes(in.begin(), in.end()), "tcp");
  return 0;
}

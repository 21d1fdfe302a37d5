// The runtime's cryptography, from OpenSSL's libcrypto: random bytes, HMAC-SHA256 and a
// constant-time comparison. Nothing here is written by hand.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::crypto {

using Nonce = std::array<std::uint8_t, 16>;
using Mac = std::array<std::uint8_t, 32>;

// Random bytes from the kernel (getrandom); an error only when it cannot deliver them.
Status random_bytes(std::span<std::uint8_t> out);
Result<Nonce> make_nonce();
// HMAC-SHA256 keyed by the token over the concatenation of `parts`.
Result<Mac> hmac(const Token& key, std::initializer_list<std::span<const std::uint8_t>> parts);
// Whether two MACs are equal, in time that does not depend on where they differ.
bool equal(const Mac& a, const Mac& b);

}  // namespace r2ccl::crypto

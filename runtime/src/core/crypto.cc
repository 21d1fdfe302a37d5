#include "core/crypto.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace r2ccl::crypto {

Status random_bytes(std::span<std::uint8_t> out) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t got = ::getrandom(out.data() + done, out.size() - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return {ErrorCode::kInternal, fmt::format("getrandom: {}", std::strerror(errno))};
    }
    done += static_cast<std::size_t>(got);
  }
  return Status::ok();
}

Result<Nonce> make_nonce() {
  Nonce n{};
  R2CCL_RETURN_IF_ERROR(random_bytes(n));
  return n;
}

Result<Mac> hmac(const Token& key, std::initializer_list<std::span<const std::uint8_t>> parts) {
  std::vector<std::uint8_t> data;
  for (const auto& p : parts)
    data.insert(data.end(), p.begin(), p.end());
  Mac out{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), data.data(), data.size(),
           out.data(), &len) == nullptr ||
      len != out.size())
    return Status(ErrorCode::kInternal, "HMAC-SHA256 failed (OpenSSL)");
  return out;
}

bool equal(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace r2ccl::crypto

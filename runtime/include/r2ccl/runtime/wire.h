// Little-endian serialisation of control-path messages (bootstrap, endpoint info, channel
// control). A reader never reads past its buffer: a short or malformed message is an error.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

using Bytes = std::vector<std::byte>;

class ByteWriter {
 public:
  ByteWriter& u8(std::uint8_t v) { return raw(&v, 1); }
  ByteWriter& u16(std::uint16_t v) { return le(v); }
  ByteWriter& u32(std::uint32_t v) { return le(v); }
  ByteWriter& u64(std::uint64_t v) { return le(v); }
  ByteWriter& str(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return raw(s.data(), s.size());
  }
  ByteWriter& blob(std::span<const std::byte> b) {
    u32(static_cast<std::uint32_t>(b.size()));
    return raw(b.data(), b.size());
  }
  ByteWriter& raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  Bytes take() { return std::move(buf_); }
  const Bytes& bytes() const { return buf_; }

 private:
  template <typename T>
  ByteWriter& le(T v) {
    std::byte b[sizeof(T)];
    for (std::size_t i = 0; i < sizeof(T); ++i)
      b[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
    return raw(b, sizeof(T));
  }
  Bytes buf_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> b) : b_(b) {}
  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == b_.size(); }
  std::size_t remaining() const { return b_.size() - pos_; }
  std::uint8_t u8() { return static_cast<std::uint8_t>(le(1)); }
  std::uint16_t u16() { return static_cast<std::uint16_t>(le(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(le(4)); }
  std::uint64_t u64() { return le(8); }
  std::string str(std::size_t max = 1 << 20) {
    auto n = u32();
    if (!ok_ || n > max || n > remaining()) return fail_str();
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  Bytes blob(std::size_t max = 16 << 20) {
    auto n = u32();
    if (!ok_ || n > max || n > remaining()) {
      ok_ = false;
      return {};
    }
    Bytes out(b_.begin() + static_cast<std::ptrdiff_t>(pos_),
              b_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return out;
  }
  void raw(void* out, std::size_t n) {
    if (!ok_ || n > remaining()) {
      ok_ = false;
      std::memset(out, 0, n);
      return;
    }
    std::memcpy(out, b_.data() + pos_, n);
    pos_ += n;
  }
  // An error naming what was being read, when anything went wrong.
  Status finish(const char* what) const {
    if (ok_ && at_end()) return Status::ok();
    return {ErrorCode::kProtocol, std::string("malformed ") + what};
  }

 private:
  std::uint64_t le(std::size_t n) {
    if (!ok_ || n > remaining()) {
      ok_ = false;
      return 0;
    }
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(b_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }
  std::string fail_str() {
    ok_ = false;
    return {};
  }
  std::span<const std::byte> b_;
  std::size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace r2ccl

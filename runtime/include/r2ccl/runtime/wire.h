// Little-endian serialisation of control-path messages (bootstrap, endpoint info, channel
// control). A reader never reads past its buffer: a short or malformed message is an error.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

using Bytes = std::vector<std::byte>;

// Stores `v` little-endian in the sizeof(T) bytes at `p`.
template <typename T>
void store_le(std::byte* p, T v) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, sizeof(T));
  } else {
    for (std::size_t i = 0; i < sizeof(T); ++i)
      p[i] = static_cast<std::byte>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xff);
  }
}
// Loads a little-endian value of `n` ≤ 8 bytes from `p`.
inline std::uint64_t load_le(const std::byte* p, std::size_t n) {
  std::uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, n);
  } else {
    for (std::size_t i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(p[i])) << (8 * i);
  }
  return v;
}

class ByteWriter {
 public:
  // `reserve`: the bytes the message is expected to take (it grows past them if need be).
  explicit ByteWriter(std::size_t reserve = 64) { buf_.reserve(reserve); }
  ByteWriter& u8(std::uint8_t v) { return le(v); }
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
    if (n == 0) return *this;
    const std::size_t at = grow(n);
    std::memcpy(buf_.data() + at, p, n);
    return *this;
  }
  Bytes take() { return std::move(buf_); }
  const Bytes& bytes() const { return buf_; }

 private:
  // Makes room for n more bytes at the end; returns where they start.
  std::size_t grow(std::size_t n) {
    const std::size_t at = buf_.size();
    if (buf_.capacity() - at < n) buf_.reserve(std::max(2 * buf_.capacity(), at + n));
    buf_.resize(at + n);
    return at;
  }
  template <typename T>
  ByteWriter& le(T v) {
    const std::size_t at = grow(sizeof(T));  // first: growing may move the buffer
    store_le(buf_.data() + at, v);
    return *this;
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
    const std::uint64_t v = load_le(b_.data() + pos_, n);
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

// The control-path codec: every field written comes back, also once a message outgrows the room
// reserved for it, and a short message is an error, not a read past its end.
#include <gtest/gtest.h>

#include <string>

#include "r2ccl/runtime/wire.h"

namespace r2ccl {
namespace {

TEST(Wire, FieldsRoundTripPastTheReservedRoom) {
  // A reservation of 1 byte makes nearly every field reallocate the buffer.
  ByteWriter w(1);
  const std::string text(300, 'x');
  Bytes blob(1000);
  for (std::size_t i = 0; i < blob.size(); ++i)
    blob[i] = static_cast<std::byte>(i * 7);
  for (std::uint64_t i = 0; i < 100; ++i)
    w.u8(static_cast<std::uint8_t>(i)).u16(0xbeef).u32(0xdeadbeef).u64(i * 0x0101010101010101ull);
  w.str(text).blob(blob).raw("end", 3);
  const Bytes msg = w.take();
  ASSERT_EQ(msg.size(), 100 * 15 + 4 + 300 + 4 + 1000 + 3);

  ByteReader r(msg);
  for (std::uint64_t i = 0; i < 100; ++i) {
    EXPECT_EQ(r.u8(), static_cast<std::uint8_t>(i));
    EXPECT_EQ(r.u16(), 0xbeef);
    EXPECT_EQ(r.u32(), 0xdeadbeefu);
    EXPECT_EQ(r.u64(), i * 0x0101010101010101ull);
  }
  EXPECT_EQ(r.str(), text);
  EXPECT_EQ(r.blob(), blob);
  char end[3];
  r.raw(end, 3);
  EXPECT_EQ(std::string(end, 3), "end");
  EXPECT_TRUE(r.finish("test message").is_ok());
}

TEST(Wire, LittleEndianOnTheWire) {
  const Bytes msg = ByteWriter().u32(0x04030201).take();
  ASSERT_EQ(msg.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_EQ(std::to_integer<int>(msg[i]), static_cast<int>(i + 1));
}

TEST(Wire, AShortMessageIsNamedAndNothingIsReadPastIt) {
  const Bytes msg = ByteWriter().u32(7).take();
  ByteReader r(msg);
  EXPECT_EQ(r.u32(), 7u);
  EXPECT_EQ(r.u64(), 0u);  // past the end: zero, and the reader is marked bad
  EXPECT_FALSE(r.ok());
  const Status st = r.finish("clear-to-send");
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(), "malformed clear-to-send");
}

TEST(Wire, AStringLongerThanItsMessageIsRefused) {
  ByteWriter w;
  w.u32(1000).raw("abc", 3);  // claims 1000 bytes, has 3
  const Bytes msg = w.take();
  ByteReader r(msg);
  EXPECT_EQ(r.str(), "");
  EXPECT_FALSE(r.ok());
}

}  // namespace
}  // namespace r2ccl

// The link watcher's reader of rtnetlink messages (what the kernel sends on a link change).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "topology/link_watcher.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A copy of exactly `size` bytes (aligned, as the kernel's buffer is), so that a read past its
  // end is caught.
  if (size == 0) return 0;
  std::vector<char> exact(size);
  std::memcpy(exact.data(), data, size);
  r2ccl::parse_link_messages(exact.data(), size, [&](const std::string& name, bool) {
    if (name.empty() || name.size() > size) __builtin_trap();
  });
  return 0;
}

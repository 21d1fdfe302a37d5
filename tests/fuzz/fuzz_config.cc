// The configuration, from the environment: the input is lines of NAME=VALUE. Whatever the values,
// parse_config either refuses with a message naming the variable, or returns a configuration
// whose cross-variable rules hold.
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "r2ccl/runtime/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::map<std::string, std::string> vars;
  std::string text(reinterpret_cast<const char*>(data), size);
  std::size_t pos = 0;
  while (pos < text.size() && vars.size() < 64) {
    const auto end = std::min(text.find('\n', pos), text.size());
    const std::string line = text.substr(pos, end - pos);
    const auto eq = line.find('=');
    if (eq != std::string::npos) vars["R2CCL_" + line.substr(0, eq)] = line.substr(eq + 1);
    pos = end + 1;
  }
  auto c = r2ccl::parse_config([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  if (!c) {
    if (c.status().message().find("R2CCL_") == std::string::npos) __builtin_trap();
  } else if (c->probe_timeout < c->probe_interval || c->holddown > c->holddown_max) {
    __builtin_trap();
  }
  return 0;
}

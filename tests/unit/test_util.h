// Helpers shared by the unit tests.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "r2ccl/runtime/config.h"

namespace r2ccl::test {

// A TCP port that was free a moment ago on 127.0.0.1.
std::uint16_t free_port();

// An environment for parse_config made of the given variables only.
EnvLookup env_of(std::map<std::string, std::string> vars);

}  // namespace r2ccl::test

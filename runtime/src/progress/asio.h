// Boost.Asio, included in one place. Boost 1.74's awaitable.hpp uses std::exchange without
// including <utility>; g++ 12 in C++20 mode needs it included first.
#pragma once

#include <utility>

#include <boost/asio.hpp>

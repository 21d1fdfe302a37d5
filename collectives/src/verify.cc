#include "r2ccl/coll/verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "r2ccl/coll/reduce.h"

namespace r2ccl::coll {

double get_element(const void* buf, std::size_t i, DataType t) {
  const auto* p = static_cast<const std::byte*>(buf) + i * type_size(t);
  switch (t) {
    case DataType::kF32: {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DataType::kF64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DataType::kF16:
    case DataType::kBF16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return t == DataType::kF16 ? half_to_float(h) : bf16_to_float(h);
    }
    case DataType::kI32: {
      std::int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DataType::kI64: {
      std::int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
    case DataType::kU8:
      return static_cast<double>(static_cast<std::uint8_t>(*p));
  }
  return 0;
}

void set_element(void* buf, std::size_t i, DataType t, double v) {
  auto* p = static_cast<std::byte*>(buf) + i * type_size(t);
  switch (t) {
    case DataType::kF32: {
      const auto x = static_cast<float>(v);
      std::memcpy(p, &x, 4);
      break;
    }
    case DataType::kF64:
      std::memcpy(p, &v, 8);
      break;
    case DataType::kF16:
    case DataType::kBF16: {
      const auto h = t == DataType::kF16 ? float_to_half(static_cast<float>(v))
                                         : float_to_bf16(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kI32: {
      const auto x = static_cast<std::int32_t>(v);
      std::memcpy(p, &x, 4);
      break;
    }
    case DataType::kI64: {
      const auto x = static_cast<std::int64_t>(v);
      std::memcpy(p, &x, 8);
      break;
    }
    case DataType::kU8:
      *p = static_cast<std::byte>(static_cast<std::uint8_t>(static_cast<std::int64_t>(v)));
      break;
  }
}

double test_value(int rank, std::size_t i, std::uint64_t round, RedOp op) {
  const std::size_t k = static_cast<std::size_t>(rank) * 7 + i * 3 + round;
  if (op == RedOp::kProd) {
    const std::size_t m = k % 7;
    return m == 0 ? 2 : m == 3 ? -1 : 1;
  }
  return static_cast<double>(static_cast<int>(k % 9) - 4);
}

bool matches_reduction(const void* got, std::span<const double> in, DataType t, RedOp op) {
  const std::size_t e = type_size(t);
  std::byte want[8] = {};
  if (is_float(t)) {
    double acc = in[0];
    for (std::size_t k = 1; k < in.size(); ++k) {
      switch (op) {
        case RedOp::kSum:
        case RedOp::kAvg:
          acc += in[k];
          break;
        case RedOp::kProd:
          acc *= in[k];
          break;
        case RedOp::kMin:
          acc = std::min(acc, in[k]);
          break;
        case RedOp::kMax:
          acc = std::max(acc, in[k]);
          break;
      }
    }
    if (op == RedOp::kAvg) {
      // The sum is exact; the division rounds once in float (double for f64), then to t.
      acc /= static_cast<double>(in.size());
      set_element(want, 0, t, acc);
      const double g = get_element(got, 0, t), w = get_element(want, 0, t);
      const double tol = t == DataType::kBF16 ? 1e-2 : t == DataType::kF16 ? 1e-3 : 1e-6;
      return std::fabs(g - w) <= tol * std::max(1.0, std::fabs(w));
    }
    set_element(want, 0, t, acc);
    return std::memcmp(got, want, e) == 0;
  }
  // Integers: two's complement wrap-around, computed in 64-bit unsigned arithmetic.
  auto acc = static_cast<std::uint64_t>(static_cast<std::int64_t>(in[0]));
  auto lo = static_cast<std::int64_t>(in[0]), hi = lo;
  for (std::size_t k = 1; k < in.size(); ++k) {
    const auto x = static_cast<std::int64_t>(in[k]);
    if (op == RedOp::kSum) acc += static_cast<std::uint64_t>(x);
    if (op == RedOp::kProd) acc *= static_cast<std::uint64_t>(x);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  const std::uint64_t v = op == RedOp::kMin   ? static_cast<std::uint64_t>(lo)
                          : op == RedOp::kMax ? static_cast<std::uint64_t>(hi)
                                              : acc;
  std::memcpy(want, &v, e);  // little-endian: the low bytes are the wrapped value
  return std::memcmp(got, want, e) == 0;
}

}  // namespace r2ccl::coll

#include "r2ccl/coll/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "combine.h"

// x86-64: the kernels are compiled twice, for the baseline and for AVX2 + F16C + FMA, and the
// second is used when the CPU has those (checked once). The template kernels are inlined into
// both entry points so each gets its own code.
#if defined(__x86_64__) && defined(__GNUC__)
#define R2CCL_X86_DISPATCH 1
#include <cpuid.h>
#endif
#define R2CCL_INLINE [[gnu::always_inline]] inline

namespace r2ccl::coll {
namespace {

struct Sum {
  template <class T>
  R2CCL_INLINE T operator()(T a, T b) const {
    return combine<RedOp::kSum>(a, b);
  }
};
struct Prod {
  template <class T>
  R2CCL_INLINE T operator()(T a, T b) const {
    return combine<RedOp::kProd>(a, b);
  }
};
struct Min {
  template <class T>
  R2CCL_INLINE T operator()(T a, T b) const {
    return combine<RedOp::kMin>(a, b);
  }
};
struct Max {
  template <class T>
  R2CCL_INLINE T operator()(T a, T b) const {
    return combine<RedOp::kMax>(a, b);
  }
};

template <class T, class Op>
R2CCL_INLINE void plain(void* dst, const void* a, const void* b, std::size_t n, Op op) {
  auto* d = static_cast<T*>(dst);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i)
    d[i] = op(x[i], y[i]);
}

R2CCL_INLINE float bf16_in(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
R2CCL_INLINE std::uint16_t bf16_out(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>(u >> 16);
}
#ifdef __FLT16_MANT_DIG__  // the compiler has _Float16 (GCC 12; clang from 15 on x86)
R2CCL_INLINE float f16_in(std::uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, sizeof v);
  return static_cast<float>(v);
}
R2CCL_INLINE std::uint16_t f16_out(float f) {
  const auto v = static_cast<_Float16>(f);
  std::uint16_t h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}
#else  // IEEE binary16 by hand, rounding to nearest even as the hardware does
R2CCL_INLINE float f16_in(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;  // zero
  } else {     // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
R2CCL_INLINE std::uint16_t f16_out(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow: inf
  if (abs < 0x38800000u) {  // a subnormal half (or zero)
    if (abs < 0x33000000u) return sign;
    const std::uint32_t exp = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;  // 14 + (112 - exp) + 1 - 1
    std::uint32_t half = man >> shift;
    const std::uint32_t rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = ((abs >> 13) - (112u << 10));
  const std::uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<std::uint16_t>(sign | half);
}
#endif

// 16-bit floats: widen a block to float, reduce, round back.
template <bool kBf16, class Op>
R2CCL_INLINE void half(void* dst, const void* a, const void* b, std::size_t n, Op op) {
  constexpr std::size_t kBlock = 256;
  auto* d = static_cast<std::uint16_t*>(dst);
  const auto* x = static_cast<const std::uint16_t*>(a);
  const auto* y = static_cast<const std::uint16_t*>(b);
  float fx[kBlock], fy[kBlock];
  for (std::size_t i = 0; i < n; i += kBlock) {
    const std::size_t m = std::min(kBlock, n - i);
    for (std::size_t j = 0; j < m; ++j) {
      fx[j] = kBf16 ? bf16_in(x[i + j]) : f16_in(x[i + j]);
      fy[j] = kBf16 ? bf16_in(y[i + j]) : f16_in(y[i + j]);
    }
    for (std::size_t j = 0; j < m; ++j)
      fx[j] = op(fx[j], fy[j]);
    for (std::size_t j = 0; j < m; ++j)
      d[i + j] = kBf16 ? bf16_out(fx[j]) : f16_out(fx[j]);
  }
}

template <class Op>
R2CCL_INLINE void by_type(void* d, const void* a, const void* b, std::size_t n, DataType t, Op op) {
  switch (t) {
    case DataType::kF32:
      return plain<float>(d, a, b, n, op);
    case DataType::kF64:
      return plain<double>(d, a, b, n, op);
    case DataType::kI32:
      return plain<std::int32_t>(d, a, b, n, op);
    case DataType::kI64:
      return plain<std::int64_t>(d, a, b, n, op);
    case DataType::kU8:
      return plain<std::uint8_t>(d, a, b, n, op);
    case DataType::kF16:
      return half<false>(d, a, b, n, op);
    case DataType::kBF16:
      return half<true>(d, a, b, n, op);
  }
}

// The kernels' bodies, inlined into one entry point per instruction set.
R2CCL_INLINE void reduce_body(void* dst, const void* a, const void* b, std::size_t count,
                              DataType t, RedOp op) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg:
      return by_type(dst, a, b, count, t, Sum{});
    case RedOp::kProd:
      return by_type(dst, a, b, count, t, Prod{});
    case RedOp::kMin:
      return by_type(dst, a, b, count, t, Min{});
    case RedOp::kMax:
      return by_type(dst, a, b, count, t, Max{});
  }
}

R2CCL_INLINE void avg_body(void* buf, std::size_t count, DataType t, int n) {
  struct Div {
    float fn;
    double dn;
    R2CCL_INLINE float operator()(float a, float) const { return a / fn; }
    R2CCL_INLINE double operator()(double a, double) const { return a / dn; }
  } div{static_cast<float>(n), static_cast<double>(n)};
  switch (t) {
    case DataType::kF32:
      return plain<float>(buf, buf, buf, count, div);
    case DataType::kF64:
      return plain<double>(buf, buf, buf, count, div);
    case DataType::kF16:
      return half<false>(buf, buf, buf, count, div);
    case DataType::kBF16:
      return half<true>(buf, buf, buf, count, div);
    default:
      return;  // avg is refused for integer types before any data moves
  }
}

void reduce_baseline(void* dst, const void* a, const void* b, std::size_t count, DataType t,
                     RedOp op) {
  reduce_body(dst, a, b, count, t, op);
}
void avg_baseline(void* buf, std::size_t count, DataType t, int n) {
  avg_body(buf, count, t, n);
}

#ifdef R2CCL_X86_DISPATCH
__attribute__((target("avx2,f16c,fma"))) void reduce_avx2(void* dst, const void* a, const void* b,
                                                          std::size_t count, DataType t, RedOp op) {
  reduce_body(dst, a, b, count, t, op);
}
__attribute__((target("avx2,f16c,fma"))) void avg_avx2(void* buf, std::size_t count, DataType t,
                                                       int n) {
  avg_body(buf, count, t, n);
}
bool has_avx2() {
  // F16C from cpuid (leaf 1, ECX bit 29): not every compiler's __builtin_cpu_supports knows it.
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

}  // namespace

void reduce(void* dst, const void* a, const void* b, std::size_t count, DataType t, RedOp op) {
#ifdef R2CCL_X86_DISPATCH
  if (has_avx2()) return reduce_avx2(dst, a, b, count, t, op);
#endif
  reduce_baseline(dst, a, b, count, t, op);
}

void finish_avg(void* buf, std::size_t count, DataType t, int n) {
#ifdef R2CCL_X86_DISPATCH
  if (has_avx2()) return avg_avx2(buf, count, t, n);
#endif
  avg_baseline(buf, count, t, n);
}

float half_to_float(std::uint16_t h) {
  return f16_in(h);
}
std::uint16_t float_to_half(float f) {
  return f16_out(f);
}
float bf16_to_float(std::uint16_t h) {
  return bf16_in(h);
}
std::uint16_t float_to_bf16(float f) {
  return bf16_out(f);
}

}  // namespace r2ccl::coll

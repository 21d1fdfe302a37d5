// Reduction kernels on host memory. Integers are exact (sums and products wrap around, as two's
// complement); half and bfloat16 are widened to float, reduced, and rounded back to nearest-even,
// in blocks the compiler vectorises (an AVX2/F16C clone is picked at load time where the CPU has
// it).
#pragma once

#include <cstddef>

#include "r2ccl/coll/types.h"

namespace r2ccl::coll {

// dst[i] = a[i] op b[i] for `count` elements; dst may be a or b. avg reduces as a sum (the
// caller divides once at the end with finish_avg).
void reduce(void* dst, const void* a, const void* b, std::size_t count, DataType t, RedOp op);
// buf[i] /= n (float types; the last step of an avg).
void finish_avg(void* buf, std::size_t count, DataType t, int n);

// Conversions, exposed for tests and for the CUDA kernels' host reference.
float half_to_float(std::uint16_t h);
std::uint16_t float_to_half(float f);
float bf16_to_float(std::uint16_t h);
std::uint16_t float_to_bf16(float f);

}  // namespace r2ccl::coll

// Checking collective results element by element (r2ccl-perf -c 1 and the tests): inputs that
// are small integers, exact in every type, and the reference result of a reduction over them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "r2ccl/coll/types.h"

namespace r2ccl::coll {

// Element i of a buffer of type t, read as a double (u8 as 0..255) / written from one.
double get_element(const void* buf, std::size_t i, DataType t);
void set_element(void* buf, std::size_t i, DataType t, double v);

// Rank r's input element i in round `round`: a small integer (-4..4; for prod one of -1, 1, 2)
// so that sums and products over up to 64 ranks are exact in every type.
double test_value(int rank, std::size_t i, std::uint64_t round, RedOp op);

// Whether `got` (one element of type t) is the reduction of `inputs` (each already stored in and
// read back from type t, in rank order): bit-exact, with the type's wrap-around for integer sums
// and products; avg within the rounding of t.
bool matches_reduction(const void* got, std::span<const double> inputs, DataType t, RedOp op);

}  // namespace r2ccl::coll

// Element types and reductions of the collectives, with nccl-tests' names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "r2ccl/runtime/status.h"

namespace r2ccl::coll {

enum class DataType : std::uint8_t { kF32, kF16, kBF16, kF64, kI32, kI64, kU8 };
enum class RedOp : std::uint8_t { kSum, kProd, kMin, kMax, kAvg };

inline constexpr DataType kAllTypes[] = {DataType::kF32, DataType::kF16, DataType::kBF16,
                                         DataType::kF64, DataType::kI32, DataType::kI64,
                                         DataType::kU8};
inline constexpr RedOp kAllRedOps[] = {RedOp::kSum, RedOp::kProd, RedOp::kMin, RedOp::kMax,
                                       RedOp::kAvg};

// Bytes per element; 0 for a value outside the enumeration.
std::size_t type_size(DataType t);
bool is_float(DataType t);
// nccl-tests' names: float half bfloat16 double int32 int64 uint8.
std::string_view type_name(DataType t);
// sum prod min max avg.
std::string_view redop_name(RedOp op);

// Accepts nccl-tests' names and short aliases (f32, fp16, f16, bf16, f64, i32, int, i64, u8,
// char, ...), case-insensitive; the error lists what is accepted.
Result<DataType> parse_type(std::string_view text);
Result<RedOp> parse_redop(std::string_view text);

// Whether the pair is supported, and if not, why: an enumeration value out of range, or avg on
// an integer type (an integer mean would silently truncate).
Status check_type_and_op(DataType t, RedOp op);
Status check_type(DataType t);

}  // namespace r2ccl::coll

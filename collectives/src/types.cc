#include "r2ccl/coll/types.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <utility>

namespace r2ccl::coll {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

constexpr std::array<std::pair<std::string_view, DataType>, 22> kTypeNames{{
    {"float", DataType::kF32}, {"float32", DataType::kF32}, {"f32", DataType::kF32},
    {"fp32", DataType::kF32},  {"half", DataType::kF16},    {"float16", DataType::kF16},
    {"f16", DataType::kF16},   {"fp16", DataType::kF16},    {"bfloat16", DataType::kBF16},
    {"bf16", DataType::kBF16}, {"double", DataType::kF64},  {"float64", DataType::kF64},
    {"f64", DataType::kF64},   {"fp64", DataType::kF64},    {"int32", DataType::kI32},
    {"i32", DataType::kI32},   {"int", DataType::kI32},     {"int64", DataType::kI64},
    {"i64", DataType::kI64},   {"uint8", DataType::kU8},    {"u8", DataType::kU8},
    {"char", DataType::kU8},
}};

}  // namespace

std::size_t type_size(DataType t) {
  switch (t) {
    case DataType::kF32:
      return 4;
    case DataType::kF16:
      return 2;
    case DataType::kBF16:
      return 2;
    case DataType::kF64:
      return 8;
    case DataType::kI32:
      return 4;
    case DataType::kI64:
      return 8;
    case DataType::kU8:
      return 1;
  }
  return 0;
}

bool is_float(DataType t) {
  return t == DataType::kF32 || t == DataType::kF16 || t == DataType::kBF16 || t == DataType::kF64;
}

std::string_view type_name(DataType t) {
  switch (t) {
    case DataType::kF32:
      return "float";
    case DataType::kF16:
      return "half";
    case DataType::kBF16:
      return "bfloat16";
    case DataType::kF64:
      return "double";
    case DataType::kI32:
      return "int32";
    case DataType::kI64:
      return "int64";
    case DataType::kU8:
      return "uint8";
  }
  return "?";
}

std::string_view redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "sum";
    case RedOp::kProd:
      return "prod";
    case RedOp::kMin:
      return "min";
    case RedOp::kMax:
      return "max";
    case RedOp::kAvg:
      return "avg";
  }
  return "?";
}

Result<DataType> parse_type(std::string_view text) {
  const std::string t = lower(text);
  for (const auto& [name, type] : kTypeNames)
    if (name == t) return type;
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("unknown data type '{}': expected float, half, bfloat16, double, "
                            "int32, int64 or uint8 (or f32, f16, bf16, f64, i32, i64, u8)",
                            text));
}

Result<RedOp> parse_redop(std::string_view text) {
  const std::string t = lower(text);
  for (RedOp op : kAllRedOps)
    if (redop_name(op) == t) return op;
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("unknown reduction '{}': expected sum, prod, min, max or avg", text));
}

Status check_type(DataType t) {
  if (type_size(t) == 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("unsupported data type (value {})", static_cast<int>(t))};
  return Status::ok();
}

Status check_type_and_op(DataType t, RedOp op) {
  R2CCL_RETURN_IF_ERROR(check_type(t));
  if (redop_name(op) == "?")
    return {ErrorCode::kInvalidArgument,
            fmt::format("unsupported reduction (value {})", static_cast<int>(op))};
  if (op == RedOp::kAvg && !is_float(t))
    return {ErrorCode::kInvalidArgument,
            fmt::format("reduction avg is not supported for {}: it needs a floating-point type "
                        "(an integer mean would truncate)",
                        type_name(t))};
  return Status::ok();
}

}  // namespace r2ccl::coll

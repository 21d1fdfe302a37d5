#include "nccl_api.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <string>

namespace r2ccl::coll::gpu::detail {

namespace {

Result<Nccl> load() {
  const char* named = std::getenv("R2CCL_NCCL_LIBRARY");
  const std::string file = named != nullptr && *named != '\0' ? named : "libnccl.so.2";
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr)
    return Status(ErrorCode::kUnavailable,
                  fmt::format("NCCL could not be loaded ({}): {}", file, dlerror()));
  Nccl n{};
  Status missing = Status::ok();
  const auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (fn == nullptr && missing)
      missing = Status(ErrorCode::kUnavailable, fmt::format("{} has no {}", file, name));
  };
  get(n.GetVersion, "ncclGetVersion");
  get(n.GetUniqueId, "ncclGetUniqueId");
  get(n.CommInitRank, "ncclCommInitRank");
  get(n.CommDestroy, "ncclCommDestroy");
  get(n.GetErrorString, "ncclGetErrorString");
  get(n.AllReduce, "ncclAllReduce");
  get(n.AllGather, "ncclAllGather");
  get(n.ReduceScatter, "ncclReduceScatter");
  get(n.Broadcast, "ncclBroadcast");
  get(n.Reduce, "ncclReduce");
  get(n.Send, "ncclSend");
  get(n.Recv, "ncclRecv");
  get(n.GroupStart, "ncclGroupStart");
  get(n.GroupEnd, "ncclGroupEnd");
  if (!missing) return missing;  // the library stays loaded: others in the process may use it
  return n;
}

}  // namespace

Status Nccl::check(ncclResult_t r, std::string_view what) const {
  if (r == ncclSuccess) return Status::ok();
  return {ErrorCode::kInternal, fmt::format("{}: {}", what, GetErrorString(r))};
}

Result<const Nccl*> nccl() {
  static const Result<Nccl> loaded = load();
  if (!loaded) return loaded.status();
  return &*loaded;
}

ncclDataType_t nccl_type(DataType t) {
  switch (t) {
    case DataType::kF32:
      return ncclFloat32;
    case DataType::kF16:
      return ncclFloat16;
    case DataType::kBF16:
      return ncclBfloat16;
    case DataType::kF64:
      return ncclFloat64;
    case DataType::kI32:
      return ncclInt32;
    case DataType::kI64:
      return ncclInt64;
    case DataType::kU8:
      return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kProd:
      return ncclProd;
    case RedOp::kMin:
      return ncclMin;
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kAvg:
      return ncclAvg;
  }
  return ncclSum;
}

}  // namespace r2ccl::coll::gpu::detail

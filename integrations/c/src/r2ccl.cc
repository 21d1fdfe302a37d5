// The C ABI (include/r2ccl.h) over the C++ communicator. Every entry point is noexcept: errors
// become r2cclResult_t values with their text kept for r2cclGetLastError, and any exception is
// caught here, never let through to a C caller.
#include "r2ccl.h"

#include "abi.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "r2ccl/coll/comm.h"
#include "r2ccl/coll/communicator.h"
#if R2CCL_WITH_METRICS
#include "r2ccl/monitor/job_metrics.h"
#endif
#include "r2ccl/runtime/bootstrap.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/topology.h"

using r2ccl::ErrorCode;
using r2ccl::Status;
namespace coll = r2ccl::coll;

// The handle: a cell of the handle table, never reused (abi.h, HandleTable).
struct r2cclComm {
  std::uint64_t serial;
};

namespace {
struct CommState {
  // The host communicator and its GPU side.
  std::unique_ptr<coll::Comm> comm;
#if R2CCL_WITH_METRICS
  // R2CCL_METRICS_PORT: this rank's rail metrics for Prometheus (declared after `comm`, so that it
  // goes first: it reads the communicator's fabric).
  std::unique_ptr<r2ccl::mon::JobMetrics> metrics;
#endif
  std::atomic<bool> closed{false};  // finalized, destroyed or aborted: no more operations
  r2ccl::capi::ErrorSlot errors;
};

using r2ccl::capi::to_result;
using Held = std::shared_ptr<CommState>;

// Every live communicator, by the handle C callers hold (abi.h): a handle already freed is
// refused rather than used, even where a later communicator took its memory. Communicators a
// program did not destroy are left to the process's exit, as NCCL leaves them.
using Registry = r2ccl::capi::HandleTable<r2cclComm, CommState>;
Registry& registry() {
  return Registry::instance();
}

// r2cclGroupStart/End: per thread, over the one communicator used inside the group.
thread_local int t_group_depth = 0;
thread_local Held t_group_comm;

r2cclResult_t fail(const CommState* c, r2cclResult_t result, std::string message) {
  return r2ccl::capi::fail(c != nullptr ? &const_cast<CommState*>(c)->errors : nullptr, result,
                           std::move(message));
}
r2cclResult_t fail(const CommState* c, const Status& st) {
  return r2ccl::capi::fail(c != nullptr ? &const_cast<CommState*>(c)->errors : nullptr, st);
}

// An entry point on a communicator: the guard, the handle looked up and held while `body` runs.
template <typename F>
r2cclResult_t with_comm(const r2cclComm* handle, const char* what, F&& body) noexcept {
  return r2ccl::capi::guarded(nullptr, what, [&]() -> r2cclResult_t {
    if (handle == nullptr)
      return fail(nullptr, r2cclInvalidArgument, fmt::format("{}: comm is NULL", what));
    const Held c = registry().find(handle);
    if (!c)
      return fail(nullptr, r2cclInvalidArgument,
                  fmt::format("{}: comm is not a live communicator (destroyed, aborted, or never "
                              "made by r2ccl)",
                              what));
    return body(c);
  });
}

Status usable(const CommState& c, const char* what) {
  if (c.closed.load())
    return {ErrorCode::kAborted,
            fmt::format("{}: the communicator was finalized or aborted", what)};
  // A GPU side that failed (aborted here or on another rank) fails the whole communicator.
  if (Status e = c.comm->device().error(); !e) return e.with_context(what);
  return Status::ok();
}

// A C caller may pass any int as an enumeration; C++ may not load a value outside the
// enumerators' range as that type, so the bytes are read as an int first.
template <typename Enum>
int raw_value(const Enum& e) {
  static_assert(sizeof(Enum) == sizeof(int));
  int v = 0;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

constexpr std::array<const char*, r2cclNumTypes> kTypeNames = {
    "int8",    "uint8",   "int32",   "uint32",   "int64",      "uint64",
    "float16", "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};

r2ccl::Result<coll::DataType> data_type(const r2cclDataType_t& t) {
  const int v = raw_value(t);
  switch (v) {
    case r2cclUint8:
      return coll::DataType::kU8;
    case r2cclInt32:
      return coll::DataType::kI32;
    case r2cclInt64:
      return coll::DataType::kI64;
    case r2cclFloat16:
      return coll::DataType::kF16;
    case r2cclFloat32:
      return coll::DataType::kF32;
    case r2cclFloat64:
      return coll::DataType::kF64;
    case r2cclBfloat16:
      return coll::DataType::kBF16;
    default:
      break;
  }
  if (v < 0 || v >= r2cclNumTypes)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("datatype {} is not a datatype (0..{})", v, r2cclNumTypes - 1));
  return Status(ErrorCode::kInvalidArgument,
                fmt::format("datatype {} ({}) is not supported (uint8, int32, int64, float16, "
                            "float32, float64 and bfloat16 are)",
                            v, kTypeNames[static_cast<std::size_t>(v)]));
}

r2ccl::Result<coll::RedOp> red_op(const r2cclRedOp_t& op) {
  switch (const int v = raw_value(op)) {
    case r2cclSum:
      return coll::RedOp::kSum;
    case r2cclProd:
      return coll::RedOp::kProd;
    case r2cclMax:
      return coll::RedOp::kMax;
    case r2cclMin:
      return coll::RedOp::kMin;
    case r2cclAvg:
      return coll::RedOp::kAvg;
    default:
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("op {} is not a reduction (0..{})", v, r2cclNumOps - 1));
  }
}

// Inside r2cclGroupStart/End a collective is not queued with the point-to-point calls.
Status not_in_group(const char* what) {
  if (t_group_depth > 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: collectives cannot be grouped (only r2cclSend/r2cclRecv are)", what)};
  return Status::ok();
}

// The address rank 0's rendezvous listener binds to: R2CCL_SOCKET_IFNAME's, else the first up
// interface with an IPv4 address that is not loopback, a rail or a container or VM bridge, else
// loopback.
r2ccl::Result<std::string> listener_address(const r2ccl::Config& config) {
  if (!config.socket_ifname.empty()) return r2ccl::interface_ipv4(config.socket_ifname);
  const auto excluded = [&](const std::string& name) {
    for (const char* prefix : {"docker", "br-", "virbr", "veth"})
      if (name.starts_with(prefix)) return true;
    return std::find(config.nics.begin(), config.nics.end(), name) != config.nics.end();
  };
  if (auto topo = r2ccl::discover_topology(); topo.is_ok())
    for (const auto& i : topo->interfaces)
      if (i.up && !i.loopback && !i.ipv4.empty() && !excluded(i.name)) return i.ipv4;
  return std::string("127.0.0.1");
}

// A made communicator, registered: the handle C callers get.
r2cclComm_t adopt(std::unique_ptr<coll::Communicator> made) {
  auto c = std::make_shared<CommState>();
  c->comm = std::make_unique<coll::Comm>(std::move(made));
#if R2CCL_WITH_METRICS
  c->metrics = r2ccl::mon::JobMetrics::start(c->comm->host().config(), c->comm->host().fabric());
#else
  if (c->comm->host().config().metrics_port)
    R2CCL_WARN(
        "R2CCL_METRICS_PORT is set, but this libr2ccl was built without metrics "
        "(-DR2CCL_METRICS=OFF)");
#endif
  return registry().add(std::move(c));
}

template <typename Make>
r2cclResult_t make_comm(r2cclComm_t* out, const char* what, Make&& make) {
  if (out == nullptr)
    return fail(nullptr, r2cclInvalidArgument, fmt::format("{}: comm is NULL", what));
  *out = nullptr;
  auto made = make();
  if (!made) return fail(nullptr, made.status().with_context(what));
  *out = adopt(std::move(*made));
  return r2cclSuccess;
}

// A collective: the checks every one shares (`args`: its datatype and reduction, read once),
// then `call` on the communicator, which runs it where its buffers are (coll/comm.h).
template <typename Call>
r2cclResult_t collective(r2cclComm_t handle, const char* what, const Status& args, Call&& call) {
  return with_comm(handle, what, [&](const Held& c) {
    if (Status st = usable(*c, what); !st) return fail(c.get(), st);
    if (Status st = not_in_group(what); !st) return fail(c.get(), st);
    if (!args) return fail(c.get(), args.with_context(what));
    const Status st = call(*c->comm);
    return st.is_ok() ? r2cclSuccess : fail(c.get(), st.with_context(what));
  });
}

// Point to point: run at once outside a group; inside one, queued on the communicator (its
// group is opened the first time the thread's group uses it) and run at r2cclGroupEnd.
template <typename Call>
r2cclResult_t point_to_point(r2cclComm_t handle, const char* what, const Status& args,
                             Call&& call) {
  return with_comm(handle, what, [&](const Held& c) {
    if (Status st = usable(*c, what); !st) return fail(c.get(), st);
    if (!args) return fail(c.get(), args.with_context(what));
    if (t_group_depth > 0 && t_group_comm != c) {
      if (t_group_comm)
        return fail(c.get(), r2cclInvalidUsage,
                    fmt::format("{}: a group spans one communicator, and this group already "
                                "uses another",
                                what));
      if (Status st = c->comm->group_start(); !st) return fail(c.get(), st.with_context(what));
      t_group_comm = c;
    }
    const Status st = call(*c->comm);
    return st.is_ok() ? r2cclSuccess : fail(c.get(), st.with_context(what));
  });
}

}  // namespace

extern "C" {

r2cclResult_t r2cclGetVersion(int* version) {
  if (version == nullptr)
    return fail(nullptr, r2cclInvalidArgument, "r2cclGetVersion: version is NULL");
  *version = R2CCL_VERSION_CODE;
  return r2cclSuccess;
}

const char* r2cclGetErrorString(r2cclResult_t result) {
  switch (raw_value(result)) {
    case r2cclSuccess:
      return "no error";
    case r2cclUnhandledError:
      return "unhandled error";
    case r2cclSystemError:
      return "system error (a socket, device or system call failed)";
    case r2cclInternalError:
      return "internal error (a bug in r2ccl)";
    case r2cclInvalidArgument:
      return "invalid argument";
    case r2cclInvalidUsage:
      return "invalid usage (a finalized or aborted communicator, a bad setting)";
    case r2cclRemoteError:
      return "remote error (a peer failed, left or misbehaved)";
    case r2cclInProgress:
      return "operation in progress";
    case r2cclTimeout:
      return "timed out";
    case r2cclTryAgain:
      return "resource temporarily unavailable: try again";
    default:
      return "unknown result code";
  }
}

const char* r2cclGetLastError(r2cclComm_t comm) {
  const Held c = comm != nullptr ? registry().find(comm) : nullptr;
  return r2ccl::capi::last_error(c ? &c->errors : nullptr);
}

r2cclResult_t r2cclGetUniqueId(r2cclUniqueId* uniqueId) {
  return r2ccl::capi::guarded(nullptr, "r2cclGetUniqueId", [&] {
    if (uniqueId == nullptr)
      return fail(nullptr, r2cclInvalidArgument, "r2cclGetUniqueId: uniqueId is NULL");
    auto config = r2ccl::parse_config(r2ccl::process_env());
    if (!config) return fail(nullptr, config.status().with_context("r2cclGetUniqueId"));
    auto host = listener_address(*config);
    if (!host) return fail(nullptr, host.status().with_context("r2cclGetUniqueId"));
    auto id = r2ccl::UniqueId::create(*host);
    if (!id) return fail(nullptr, id.status().with_context("r2cclGetUniqueId"));
    static_assert(sizeof uniqueId->internal == r2ccl::UniqueId::kSize);
    std::memcpy(uniqueId->internal, id->bytes.data(), r2ccl::UniqueId::kSize);
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommInitRank(r2cclComm_t* comm, int nranks, r2cclUniqueId commId, int rank) {
  return r2ccl::capi::guarded(nullptr, "r2cclCommInitRank", [&] {
    return make_comm(comm, "r2cclCommInitRank", [&] {
      r2ccl::UniqueId id;
      std::memcpy(id.bytes.data(), commId.internal, r2ccl::UniqueId::kSize);
      return coll::Communicator::from_unique_id(id, rank, nranks);
    });
  });
}

r2cclResult_t r2cclCommInitFromEnv(r2cclComm_t* comm) {
  return r2ccl::capi::guarded(nullptr, "r2cclCommInitFromEnv", [&] {
    return make_comm(comm, "r2cclCommInitFromEnv", [] { return coll::Communicator::from_env(); });
  });
}

r2cclResult_t r2cclCommSplit(r2cclComm_t comm, int color, int key, r2cclComm_t* newcomm,
                             void* config) {
  return with_comm(comm, "r2cclCommSplit", [&](const Held& c) {
    if (Status st = usable(*c, "r2cclCommSplit"); !st) return fail(c.get(), st);
    if (newcomm == nullptr)
      return fail(c.get(), r2cclInvalidArgument, "r2cclCommSplit: newcomm is NULL");
    if (config != nullptr)
      return fail(c.get(), r2cclInvalidArgument, "r2cclCommSplit: config must be NULL");
    *newcomm = nullptr;
    auto made = c->comm->host().split(color, key);
    if (!made) return fail(c.get(), made.status().with_context("r2cclCommSplit"));
    if (!*made) return r2cclSuccess;  // color < 0: in none
    *newcomm = adopt(std::move(*made));
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommFinalize(r2cclComm_t comm) {
  return with_comm(comm, "r2cclCommFinalize", [&](const Held& c) {
    if (Status st = usable(*c, "r2cclCommFinalize"); !st) return fail(c.get(), st);
    // Host operations are blocking: nothing of them is left in flight. The GPU side's calls are
    // waited for and its memory freed once every rank has unmapped it (a collective).
    c->closed.store(true);
    if (Status st = c->comm->close_device(); !st)
      return fail(c.get(), st.with_context("r2cclCommFinalize"));
    return r2cclSuccess;
  });
}

namespace {
// r2cclCommDestroy and r2cclCommAbort: the handle leaves the registry at once; the communicator
// goes with the last call still inside it (this one's reference first).
r2cclResult_t release(r2cclComm_t comm, const char* what, bool abort) {
  return r2ccl::capi::guarded(nullptr, what, [&] {
    if (comm == nullptr) return r2cclSuccess;
    const Held c = registry().remove(comm);
    if (!c)
      return fail(nullptr, r2cclInvalidArgument,
                  fmt::format("{}: comm is not a live communicator (destroyed, aborted, or never "
                              "made by r2ccl)",
                              what));
    c->closed.store(true);
    if (t_group_comm == c) t_group_comm.reset();
    if (abort) {
      // The GPU side first: its kernels give up and every rank's later calls are refused.
      c->comm->abort(fmt::format("r2cclCommAbort on rank {}", c->comm->rank()));
      return r2cclSuccess;
    }
    // Destroy closes the GPU side collectively (as Finalize does, where it was not called).
    if (Status st = c->comm->close_device(); !st) return fail(nullptr, st.with_context(what));
    return r2cclSuccess;
  });
}
}  // namespace

r2cclResult_t r2cclCommDestroy(r2cclComm_t comm) {
  return release(comm, "r2cclCommDestroy", false);
}

r2cclResult_t r2cclCommAbort(r2cclComm_t comm) {
  return release(comm, "r2cclCommAbort", true);
}

r2cclResult_t r2cclCommGetAsyncError(r2cclComm_t comm, r2cclResult_t* asyncError) {
  return with_comm(comm, "r2cclCommGetAsyncError", [&](const Held& c) {
    if (asyncError == nullptr)
      return fail(c.get(), r2cclInvalidArgument, "r2cclCommGetAsyncError: asyncError is NULL");
    const Status st = c->comm->error();
    *asyncError = to_result(st.code());
    if (!st) (void)fail(c.get(), st);
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommCount(const r2cclComm_t comm, int* count) {
  return with_comm(comm, "r2cclCommCount", [&](const Held& c) {
    if (count == nullptr)
      return fail(c.get(), r2cclInvalidArgument, "r2cclCommCount: count is NULL");
    *count = c->comm->size();
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommUserRank(const r2cclComm_t comm, int* rank) {
  return with_comm(comm, "r2cclCommUserRank", [&](const Held& c) {
    if (rank == nullptr)
      return fail(c.get(), r2cclInvalidArgument, "r2cclCommUserRank: rank is NULL");
    *rank = c->comm->rank();
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommRegister(const r2cclComm_t comm, void* buff, size_t size, void** handle) {
  return with_comm(comm, "r2cclCommRegister", [&](const Held& c) {
    if (Status st = usable(*c, "r2cclCommRegister"); !st) return fail(c.get(), st);
    if (handle == nullptr)
      return fail(c.get(), r2cclInvalidArgument, "r2cclCommRegister: handle is NULL");
    auto where = coll::buffers_device({buff}, nullptr, "r2cclCommRegister");
    if (!where) return fail(c.get(), where.status());
    if (*where >= 0)
      return fail(c.get(), r2cclInvalidArgument,
                  "r2cclCommRegister: buff is device memory, which is not registered: calls on "
                  "device memory copy through the communicator's own NVLink buffers");
    auto h = c->comm->host().register_buffer(buff, size);
    if (!h) return fail(c.get(), h.status().with_context("r2cclCommRegister"));
    *handle = reinterpret_cast<void*>(static_cast<std::uintptr_t>(*h));
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommDeregister(const r2cclComm_t comm, void* handle) {
  return with_comm(comm, "r2cclCommDeregister", [&](const Held& c) {
    if (Status st = usable(*c, "r2cclCommDeregister"); !st) return fail(c.get(), st);
    const Status st = c->comm->host().deregister_buffer(
        static_cast<coll::Communicator::BufferHandle>(reinterpret_cast<std::uintptr_t>(handle)));
    return st.is_ok() ? r2cclSuccess : fail(c.get(), st.with_context("r2cclCommDeregister"));
  });
}

r2cclResult_t r2cclCommInvalidateCache(const r2cclComm_t comm, const void* buff, size_t size) {
  return with_comm(comm, "r2cclCommInvalidateCache", [&](const Held& c) {
    (void)c->comm->host().invalidate_cache(buff, size);
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclGetCudaSupport(int* supported) {
  if (supported == nullptr)
    return fail(nullptr, r2cclInvalidArgument, "r2cclGetCudaSupport: supported is NULL");
  return r2ccl::capi::guarded(nullptr, "r2cclGetCudaSupport", [&] {
    *supported = coll::cuda_supported() ? 1 : 0;
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommBindDevice(r2cclComm_t comm, int device) {
  return with_comm(comm, "r2cclCommBindDevice", [&](const Held& c) {
    if (Status st = usable(*c, "r2cclCommBindDevice"); !st) return fail(c.get(), st);
    const Status st = c->comm->bind_device(device);
    return st.is_ok() ? r2cclSuccess : fail(c.get(), st);
  });
}

r2cclResult_t r2cclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                             r2cclDataType_t datatype, r2cclRedOp_t op, r2cclComm_t comm,
                             r2cclStream_t stream) {
  const auto t = data_type(datatype);
  const auto o = red_op(op);
  return collective(
      comm, "r2cclAllReduce", t.is_ok() ? o.status() : t.status(),
      [&](coll::Comm& c) { return c.all_reduce(sendbuff, recvbuff, count, *t, *o, stream); });
}

r2cclResult_t r2cclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                             r2cclDataType_t datatype, int root, r2cclComm_t comm,
                             r2cclStream_t stream) {
  const auto t = data_type(datatype);
  return collective(comm, "r2cclBroadcast", t.status(), [&](coll::Comm& c) {
    return c.broadcast(sendbuff, recvbuff, count, *t, root, stream);
  });
}

r2cclResult_t r2cclReduce(const void* sendbuff, void* recvbuff, size_t count,
                          r2cclDataType_t datatype, r2cclRedOp_t op, int root, r2cclComm_t comm,
                          r2cclStream_t stream) {
  const auto t = data_type(datatype);
  const auto o = red_op(op);
  return collective(comm, "r2cclReduce", t.is_ok() ? o.status() : t.status(), [&](coll::Comm& c) {
    return c.reduce(sendbuff, recvbuff, count, *t, *o, root, stream);
  });
}

r2cclResult_t r2cclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             r2cclDataType_t datatype, r2cclComm_t comm, r2cclStream_t stream) {
  const auto t = data_type(datatype);
  return collective(comm, "r2cclAllGather", t.status(), [&](coll::Comm& c) {
    return c.all_gather(sendbuff, recvbuff, sendcount, *t, stream);
  });
}

r2cclResult_t r2cclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 r2cclDataType_t datatype, r2cclRedOp_t op, r2cclComm_t comm,
                                 r2cclStream_t stream) {
  const auto t = data_type(datatype);
  const auto o = red_op(op);
  return collective(comm, "r2cclReduceScatter", t.is_ok() ? o.status() : t.status(),
                    [&](coll::Comm& c) {
                      return c.reduce_scatter(sendbuff, recvbuff, recvcount, *t, *o, stream);
                    });
}

r2cclResult_t r2cclBarrier(r2cclComm_t comm, r2cclStream_t stream) {
  // With a stream: once the work queued on it is done.
  return with_comm(comm, "r2cclBarrier", [&](const Held& c) {
    if (Status st = usable(*c, "r2cclBarrier"); !st) return fail(c.get(), st);
    if (Status st = not_in_group("r2cclBarrier"); !st) return fail(c.get(), st);
    const Status st = c->comm->barrier(stream);
    return st.is_ok() ? r2cclSuccess : fail(c.get(), st.with_context("r2cclBarrier"));
  });
}

r2cclResult_t r2cclSend(const void* sendbuff, size_t count, r2cclDataType_t datatype, int peer,
                        r2cclComm_t comm, r2cclStream_t stream) {
  const auto t = data_type(datatype);
  return point_to_point(comm, "r2cclSend", t.status(),
                        [&](coll::Comm& c) { return c.send(sendbuff, count, *t, peer, stream); });
}

r2cclResult_t r2cclRecv(void* recvbuff, size_t count, r2cclDataType_t datatype, int peer,
                        r2cclComm_t comm, r2cclStream_t stream) {
  const auto t = data_type(datatype);
  return point_to_point(comm, "r2cclRecv", t.status(),
                        [&](coll::Comm& c) { return c.recv(recvbuff, count, *t, peer, stream); });
}

r2cclResult_t r2cclGroupStart(void) {
  ++t_group_depth;
  return r2cclSuccess;
}

r2cclResult_t r2cclGroupEnd(void) {
  return r2ccl::capi::guarded(nullptr, "r2cclGroupEnd", [&] {
    if (t_group_depth == 0)
      return fail(nullptr, r2cclInvalidUsage, "r2cclGroupEnd without r2cclGroupStart");
    if (--t_group_depth > 0) return r2cclSuccess;
    const Held c = std::exchange(t_group_comm, nullptr);
    if (!c) return r2cclSuccess;
    const Status st = c->comm->group_end();
    return st.is_ok() ? r2cclSuccess : fail(c.get(), st.with_context("r2cclGroupEnd"));
  });
}

}  // extern "C"

// The C ABI (include/r2ccl.h) over the C++ communicator. Every entry point is noexcept: errors
// become r2cclResult_t values with their text kept for r2cclGetLastError, and any exception is
// caught here, never let through to a C caller.
#include "r2ccl.h"

#include "abi.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/coll/communicator.h"
#include "r2ccl/runtime/bootstrap.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/topology.h"

using r2ccl::ErrorCode;
using r2ccl::Status;
namespace coll = r2ccl::coll;

// The C enumerations are the C++ ones, value for value.
static_assert(static_cast<int>(coll::DataType::kF32) == r2cclFloat32 &&
              static_cast<int>(coll::DataType::kF16) == r2cclFloat16 &&
              static_cast<int>(coll::DataType::kBF16) == r2cclBfloat16 &&
              static_cast<int>(coll::DataType::kF64) == r2cclFloat64 &&
              static_cast<int>(coll::DataType::kI32) == r2cclInt32 &&
              static_cast<int>(coll::DataType::kI64) == r2cclInt64 &&
              static_cast<int>(coll::DataType::kU8) == r2cclUint8 &&
              std::size(coll::kAllTypes) == r2cclNumTypes);
static_assert(static_cast<int>(coll::RedOp::kSum) == r2cclSum &&
              static_cast<int>(coll::RedOp::kProd) == r2cclProd &&
              static_cast<int>(coll::RedOp::kMin) == r2cclMin &&
              static_cast<int>(coll::RedOp::kMax) == r2cclMax &&
              static_cast<int>(coll::RedOp::kAvg) == r2cclAvg &&
              std::size(coll::kAllRedOps) == r2cclNumOps);

struct r2cclComm {
  std::unique_ptr<coll::Communicator> comm;
  std::atomic<int> active{0};  // calls inside the communicator right now
  std::atomic<bool> finalized{false};
  r2ccl::capi::ErrorSlot errors;
};

namespace {

// r2cclGroupStart/End: per thread, over every communicator used inside the group.
thread_local int t_group_depth = 0;
thread_local std::vector<r2cclComm*> t_group_comms;

using r2ccl::capi::to_result;

r2cclResult_t fail(r2cclComm* c, r2cclResult_t result, std::string message) {
  return r2ccl::capi::fail(c != nullptr ? &c->errors : nullptr, result, std::move(message));
}
r2cclResult_t fail(r2cclComm* c, const Status& st) {
  return r2ccl::capi::fail(c != nullptr ? &c->errors : nullptr, st);
}
r2cclResult_t done(r2cclComm* c, const Status& st) {
  return st.is_ok() ? r2cclSuccess : fail(c, st);
}
template <typename F>
r2cclResult_t guarded(r2cclComm* c, const char* what, F&& body) noexcept {
  return r2ccl::capi::guarded(c != nullptr ? &c->errors : nullptr, what, std::forward<F>(body));
}

// Counts a call inside the communicator, so that r2cclCommAbort frees it only once none is.
class Active {
 public:
  explicit Active(r2cclComm* c) : c_(c) { c_->active.fetch_add(1, std::memory_order_acq_rel); }
  ~Active() { c_->active.fetch_sub(1, std::memory_order_acq_rel); }
  Active(const Active&) = delete;
  Active& operator=(const Active&) = delete;

 private:
  r2cclComm* c_;
};

Status usable(const r2cclComm* c, const char* what) {
  if (c == nullptr) return {ErrorCode::kInvalidArgument, fmt::format("{}: comm is NULL", what)};
  if (c->finalized.load())
    return {ErrorCode::kAborted, fmt::format("{}: the communicator was finalized", what)};
  return Status::ok();
}

Status host_stream(r2cclStream_t stream, const char* what) {
  if (stream != nullptr)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: stream must be NULL: this build moves host memory only", what)};
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

r2ccl::Result<coll::DataType> data_type(const r2cclDataType_t& t, const char* what) {
  const int v = raw_value(t);
  if (v < 0 || v >= r2cclNumTypes)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{}: unknown datatype {} (0..{})", what, v, r2cclNumTypes - 1));
  return static_cast<coll::DataType>(v);
}

r2ccl::Result<coll::RedOp> red_op(const r2cclRedOp_t& op, const char* what) {
  const int v = raw_value(op);
  if (v < 0 || v >= r2cclNumOps)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{}: unknown reduction {} (0..{})", what, v, r2cclNumOps - 1));
  return static_cast<coll::RedOp>(v);
}

// Inside r2cclGroupStart/End a collective is not queued with the point-to-point calls.
Status not_in_group(const char* what) {
  if (t_group_depth > 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: collectives cannot be grouped (only r2cclSend/r2cclRecv are)", what)};
  return Status::ok();
}

// The address rank 0's rendezvous listener binds to: R2CCL_SOCKET_IFNAME's, else the first up
// interface with an IPv4 address that is not loopback, else loopback.
r2ccl::Result<std::string> listener_address(const r2ccl::Config& config) {
  if (!config.socket_ifname.empty()) return r2ccl::interface_ipv4(config.socket_ifname);
  if (auto topo = r2ccl::discover_topology(); topo.is_ok())
    for (const auto& i : topo->interfaces)
      if (i.up && !i.loopback && !i.ipv4.empty()) return i.ipv4;
  return std::string("127.0.0.1");
}

template <typename Make>
r2cclResult_t make_comm(r2cclComm_t* out, const char* what, Make&& make) {
  if (out == nullptr)
    return fail(nullptr, r2cclInvalidArgument, fmt::format("{}: comm is NULL", what));
  *out = nullptr;
  auto made = make();
  if (!made) return fail(nullptr, made.status().with_context(what));
  auto c = std::make_unique<r2cclComm>();
  c->comm = std::move(*made);
  *out = c.release();
  return r2cclSuccess;
}

// A collective: the checks every one shares, then `run` on the communicator.
template <typename Run>
r2cclResult_t collective(r2cclComm_t comm, r2cclStream_t stream, const char* what, Run&& run) {
  return guarded(comm, what, [&] {
    if (Status st = usable(comm, what); !st) return fail(comm, st);
    if (Status st = host_stream(stream, what); !st) return fail(comm, st);
    if (Status st = not_in_group(what); !st) return fail(comm, st);
    Active active(comm);
    Status st = run(*comm->comm);
    return st.is_ok() ? r2cclSuccess : fail(comm, st.with_context(what));
  });
}

// Point to point: run at once outside a group; inside one, queued on the communicator (its own
// group is opened the first time the thread's group uses it) and run at r2cclGroupEnd.
template <typename Run>
r2cclResult_t point_to_point(r2cclComm_t comm, r2cclStream_t stream, const char* what, Run&& run) {
  return guarded(comm, what, [&] {
    if (Status st = usable(comm, what); !st) return fail(comm, st);
    if (Status st = host_stream(stream, what); !st) return fail(comm, st);
    Active active(comm);
    if (t_group_depth > 0 &&
        std::find(t_group_comms.begin(), t_group_comms.end(), comm) == t_group_comms.end()) {
      if (Status st = comm->comm->group_start(); !st) return fail(comm, st.with_context(what));
      t_group_comms.push_back(comm);
    }
    Status st = run(*comm->comm);
    return st.is_ok() ? r2cclSuccess : fail(comm, st.with_context(what));
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
  switch (result) {
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
    case r2cclNumResults:
      break;
  }
  return "unknown result code";
}

const char* r2cclGetLastError(r2cclComm_t comm) {
  return r2ccl::capi::last_error(comm != nullptr ? &comm->errors : nullptr);
}

r2cclResult_t r2cclGetUniqueId(r2cclUniqueId* uniqueId) {
  return guarded(nullptr, "r2cclGetUniqueId", [&] {
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
  return guarded(nullptr, "r2cclCommInitRank", [&] {
    return make_comm(comm, "r2cclCommInitRank", [&] {
      r2ccl::UniqueId id;
      std::memcpy(id.bytes.data(), commId.internal, r2ccl::UniqueId::kSize);
      return coll::Communicator::from_unique_id(id, rank, nranks);
    });
  });
}

r2cclResult_t r2cclCommInitFromEnv(r2cclComm_t* comm) {
  return guarded(nullptr, "r2cclCommInitFromEnv", [&] {
    return make_comm(comm, "r2cclCommInitFromEnv", [] { return coll::Communicator::from_env(); });
  });
}

r2cclResult_t r2cclCommSplit(r2cclComm_t comm, int color, int key, r2cclComm_t* newcomm,
                             void* config) {
  return guarded(comm, "r2cclCommSplit", [&] {
    if (Status st = usable(comm, "r2cclCommSplit"); !st) return fail(comm, st);
    if (newcomm == nullptr)
      return fail(comm, r2cclInvalidArgument, "r2cclCommSplit: newcomm is NULL");
    if (config != nullptr)
      return fail(comm, r2cclInvalidArgument, "r2cclCommSplit: config must be NULL");
    *newcomm = nullptr;
    Active active(comm);
    auto made = comm->comm->split(color, key);
    if (!made) return fail(comm, made.status().with_context("r2cclCommSplit"));
    if (!*made) return r2cclSuccess;  // color < 0: in none
    auto c = std::make_unique<r2cclComm>();
    c->comm = std::move(*made);
    *newcomm = c.release();
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommFinalize(r2cclComm_t comm) {
  return guarded(comm, "r2cclCommFinalize", [&] {
    if (Status st = usable(comm, "r2cclCommFinalize"); !st) return fail(comm, st);
    // Operations are blocking: nothing is left in flight once this thread is here.
    comm->finalized.store(true);
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommDestroy(r2cclComm_t comm) {
  return guarded(nullptr, "r2cclCommDestroy", [&] {
    std::unique_ptr<r2cclComm> owned(comm);  // NULL: nothing to do
    std::erase(t_group_comms, comm);
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommAbort(r2cclComm_t comm) {
  return guarded(nullptr, "r2cclCommAbort", [&] {
    if (comm == nullptr) return r2cclSuccess;
    comm->finalized.store(true);
    comm->comm->abort();
    // The calls it ended return promptly; the object is freed once none is left inside it. One
    // that does not come back within a minute keeps it alive (leaked) rather than freed under it.
    const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    while (comm->active.load() > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (comm->active.load() > 0)
      return fail(nullptr, r2cclInternalError,
                  "r2cclCommAbort: a call on this communicator did not return within a minute "
                  "of the abort; the communicator was not freed");
    std::erase(t_group_comms, comm);
    std::unique_ptr<r2cclComm> owned(comm);  // the handle C callers hold is the owner
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommGetAsyncError(r2cclComm_t comm, r2cclResult_t* asyncError) {
  return guarded(comm, "r2cclCommGetAsyncError", [&] {
    if (comm == nullptr)
      return fail(nullptr, r2cclInvalidArgument, "r2cclCommGetAsyncError: comm is NULL");
    if (asyncError == nullptr)
      return fail(comm, r2cclInvalidArgument, "r2cclCommGetAsyncError: asyncError is NULL");
    const Status st = comm->comm->async_error();
    *asyncError = to_result(st.code());
    if (!st) (void)fail(comm, st);
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommCount(const r2cclComm_t comm, int* count) {
  return guarded(comm, "r2cclCommCount", [&] {
    if (comm == nullptr) return fail(nullptr, r2cclInvalidArgument, "r2cclCommCount: comm is NULL");
    if (count == nullptr) return fail(comm, r2cclInvalidArgument, "r2cclCommCount: count is NULL");
    *count = comm->comm->size();
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommUserRank(const r2cclComm_t comm, int* rank) {
  return guarded(comm, "r2cclCommUserRank", [&] {
    if (comm == nullptr)
      return fail(nullptr, r2cclInvalidArgument, "r2cclCommUserRank: comm is NULL");
    if (rank == nullptr) return fail(comm, r2cclInvalidArgument, "r2cclCommUserRank: rank is NULL");
    *rank = comm->comm->rank();
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommRegister(const r2cclComm_t comm, void* buff, size_t size, void** handle) {
  return guarded(comm, "r2cclCommRegister", [&] {
    if (Status st = usable(comm, "r2cclCommRegister"); !st) return fail(comm, st);
    if (handle == nullptr)
      return fail(comm, r2cclInvalidArgument, "r2cclCommRegister: handle is NULL");
    Active active(comm);
    auto h = comm->comm->register_buffer(buff, size);
    if (!h) return fail(comm, h.status().with_context("r2cclCommRegister"));
    *handle = reinterpret_cast<void*>(static_cast<std::uintptr_t>(*h));
    return r2cclSuccess;
  });
}

r2cclResult_t r2cclCommDeregister(const r2cclComm_t comm, void* handle) {
  return guarded(comm, "r2cclCommDeregister", [&] {
    if (Status st = usable(comm, "r2cclCommDeregister"); !st) return fail(comm, st);
    Active active(comm);
    return done(comm, comm->comm->deregister_buffer(static_cast<coll::Communicator::BufferHandle>(
                          reinterpret_cast<std::uintptr_t>(handle))));
  });
}

r2cclResult_t r2cclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                             r2cclDataType_t datatype, r2cclRedOp_t op, r2cclComm_t comm,
                             r2cclStream_t stream) {
  return collective(comm, stream, "r2cclAllReduce", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    R2CCL_ASSIGN_OR_RETURN(auto o, red_op(op, "op"));
    return c.all_reduce(sendbuff, recvbuff, count, t, o);
  });
}

r2cclResult_t r2cclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                             r2cclDataType_t datatype, int root, r2cclComm_t comm,
                             r2cclStream_t stream) {
  return collective(comm, stream, "r2cclBroadcast", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    return c.broadcast(sendbuff, recvbuff, count, t, root);
  });
}

r2cclResult_t r2cclReduce(const void* sendbuff, void* recvbuff, size_t count,
                          r2cclDataType_t datatype, r2cclRedOp_t op, int root, r2cclComm_t comm,
                          r2cclStream_t stream) {
  return collective(comm, stream, "r2cclReduce", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    R2CCL_ASSIGN_OR_RETURN(auto o, red_op(op, "op"));
    return c.reduce(sendbuff, recvbuff, count, t, o, root);
  });
}

r2cclResult_t r2cclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             r2cclDataType_t datatype, r2cclComm_t comm, r2cclStream_t stream) {
  return collective(comm, stream, "r2cclAllGather", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    return c.all_gather(sendbuff, recvbuff, sendcount, t);
  });
}

r2cclResult_t r2cclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 r2cclDataType_t datatype, r2cclRedOp_t op, r2cclComm_t comm,
                                 r2cclStream_t stream) {
  return collective(comm, stream, "r2cclReduceScatter", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    R2CCL_ASSIGN_OR_RETURN(auto o, red_op(op, "op"));
    return c.reduce_scatter(sendbuff, recvbuff, recvcount, t, o);
  });
}

r2cclResult_t r2cclBarrier(r2cclComm_t comm, r2cclStream_t stream) {
  return collective(comm, stream, "r2cclBarrier",
                    [&](coll::Communicator& c) -> Status { return c.barrier(); });
}

r2cclResult_t r2cclSend(const void* sendbuff, size_t count, r2cclDataType_t datatype, int peer,
                        r2cclComm_t comm, r2cclStream_t stream) {
  return point_to_point(comm, stream, "r2cclSend", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    return c.send(sendbuff, count, t, peer);
  });
}

r2cclResult_t r2cclRecv(void* recvbuff, size_t count, r2cclDataType_t datatype, int peer,
                        r2cclComm_t comm, r2cclStream_t stream) {
  return point_to_point(comm, stream, "r2cclRecv", [&](coll::Communicator& c) -> Status {
    R2CCL_ASSIGN_OR_RETURN(auto t, data_type(datatype, "datatype"));
    return c.recv(recvbuff, count, t, peer);
  });
}

r2cclResult_t r2cclGroupStart(void) {
  ++t_group_depth;
  return r2cclSuccess;
}

r2cclResult_t r2cclGroupEnd(void) {
  return guarded(nullptr, "r2cclGroupEnd", [&] {
    if (t_group_depth == 0)
      return fail(nullptr, r2cclInvalidUsage, "r2cclGroupEnd without r2cclGroupStart");
    if (--t_group_depth > 0) return r2cclSuccess;
    // Every communicator the group used runs its queue; the first failure is reported, the
    // others still run.
    std::vector<r2cclComm*> comms;
    comms.swap(t_group_comms);
    r2cclResult_t result = r2cclSuccess;
    for (r2cclComm* c : comms) {
      Active active(c);
      if (Status st = c->comm->group_end(); !st && result == r2cclSuccess)
        result = fail(c, st.with_context("r2cclGroupEnd"));
    }
    return result;
  });
}

}  // extern "C"

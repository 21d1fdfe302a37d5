// NCCL, opened at run time (dlopen) rather than linked: libr2ccl then loads on machines without
// it, and inside a PyTorch process it shares the NCCL PyTorch already loaded (same soname).
// R2CCL_NCCL_LIBRARY names another file. Private to r2ccl_coll_gpu.
#pragma once

#include <nccl.h>

#include <string_view>

#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll::gpu::detail {

struct Nccl {
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  const char* (*GetErrorString)(ncclResult_t);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();

  Status check(ncclResult_t r, std::string_view what) const;
};

// NCCL's functions, loaded once per process; the error says why not (no such library, a
// function missing from it).
Result<const Nccl*> nccl();

ncclDataType_t nccl_type(DataType t);
ncclRedOp_t nccl_op(RedOp op);

}  // namespace r2ccl::coll::gpu::detail

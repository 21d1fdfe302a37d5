// CUDA's StagingDevice, for StagedComm (device memory across nodes): pinned host memory mapped
// into the device, copies with cudaMemcpyAsync, and the words written and awaited by one-thread
// kernels on the caller's stream (capturable in a CUDA graph). The order of a communicator's
// calls is an event chain, as NodeComm's. A captured call's description goes when its graph is
// destroyed (a CUDA user object).
#pragma once

#include <memory>

#include "r2ccl/coll/staged.h"
#include "r2ccl/runtime/status.h"

namespace r2ccl::coll::gpu {

// For the GPU `device` (the caller's streams must be of that device).
Result<std::shared_ptr<StagingDevice>> cuda_staging(int device);

}  // namespace r2ccl::coll::gpu

// The staged path's one-thread kernels (staging.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace r2ccl::coll::gpu::detail {

// *word = value, after the stream's earlier work (visible to the host before the word).
cudaError_t launch_write_word(cudaStream_t stream, std::uint32_t* word, std::uint32_t value);
// Returns once *word == value or *abandon != 0.
cudaError_t launch_wait_word(cudaStream_t stream, const std::uint32_t* word, std::uint32_t value,
                             const std::uint32_t* abandon);

}  // namespace r2ccl::coll::gpu::detail

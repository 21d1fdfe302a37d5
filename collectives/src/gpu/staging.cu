#include "staging_kernels.h"

namespace r2ccl::coll::gpu::detail {

namespace {

__global__ void write_word_kernel(std::uint32_t* word, std::uint32_t value) {
  __threadfence_system();
  *reinterpret_cast<volatile std::uint32_t*>(word) = value;
  __threadfence_system();
}

__global__ void wait_word_kernel(const std::uint32_t* word, std::uint32_t value,
                                 const std::uint32_t* abandon) {
  const auto* w = reinterpret_cast<const volatile std::uint32_t*>(word);
  const auto* a = reinterpret_cast<const volatile std::uint32_t*>(abandon);
  while (*w != value && *a == 0)
    __nanosleep(256);
  __threadfence_system();
}

}  // namespace

cudaError_t launch_write_word(cudaStream_t stream, std::uint32_t* word, std::uint32_t value) {
  write_word_kernel<<<1, 1, 0, stream>>>(word, value);
  return cudaGetLastError();
}

cudaError_t launch_wait_word(cudaStream_t stream, const std::uint32_t* word, std::uint32_t value,
                             const std::uint32_t* abandon) {
  wait_word_kernel<<<1, 1, 0, stream>>>(word, value, abandon);
  return cudaGetLastError();
}

}  // namespace r2ccl::coll::gpu::detail

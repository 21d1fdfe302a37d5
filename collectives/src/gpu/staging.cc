#include "r2ccl/coll/gpu/staging.h"

#include <fmt/format.h>

#include <cstring>
#include <mutex>

#include "r2ccl/coll/gpu/device.h"
#include "staging_kernels.h"

namespace r2ccl::coll::gpu {

namespace {

cudaStream_t cuda(void* s) {
  return static_cast<cudaStream_t>(s);
}

void release_callback(void* p) {
  const std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
  if (*f) (*f)();
}

class CudaStaging final : public StagingDevice {
 public:
  explicit CudaStaging(int device) : device_(device) {}
  ~CudaStaging() override {
    if (last_ != nullptr) cudaEventDestroy(last_);
    if (last_captured_ != nullptr) cudaEventDestroy(last_captured_);
  }

  Status init() {
    const CurrentDevice keep;
    R2CCL_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    R2CCL_RETURN_IF_ERROR(
        cuda_status(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), "cudaEventCreate"));
    return cuda_status(cudaEventCreateWithFlags(&last_captured_, cudaEventDisableTiming),
                       "cudaEventCreate");
  }

  std::string name() const override { return fmt::format("CUDA device {}", device_); }

  Result<MappedMemory> map(std::size_t bytes) override {
    const CurrentDevice keep;
    R2CCL_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    R2CCL_RETURN_IF_ERROR(
        cuda_status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                    fmt::format("cudaHostAlloc of {} bytes of staging", bytes)));
    std::memset(p, 0, bytes);
    void* d = nullptr;
    if (Status st = cuda_status(cudaHostGetDevicePointer(&d, p, 0), "cudaHostGetDevicePointer");
        !st) {
      cudaFreeHost(p);
      return st;
    }
    MappedMemory m;
    m.host = static_cast<std::byte*>(p);
    m.device = reinterpret_cast<std::uintptr_t>(d);
    m.bytes = bytes;
    return m;
  }
  void unmap(const MappedMemory& m) override { cudaFreeHost(m.host); }

  Status copy(void* stream, void* dst, const void* src, std::size_t bytes) override {
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda(stream)),
                       "cudaMemcpyAsync");
  }
  Status copy_2d(void* stream, void* dst, std::size_t dst_pitch, const void* src,
                 std::size_t src_pitch, std::size_t width, std::size_t rows) override {
    return cuda_status(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                         cudaMemcpyDefault, cuda(stream)),
                       "cudaMemcpy2DAsync");
  }
  Status write_word(void* stream, std::uintptr_t word, std::uint32_t value) override {
    return cuda_status(
        detail::launch_write_word(cuda(stream), reinterpret_cast<std::uint32_t*>(word), value),
        "the staged path's word kernel");
  }
  Status wait_word(void* stream, std::uintptr_t word, std::uint32_t value,
                   std::uintptr_t abandon) override {
    return cuda_status(
        detail::launch_wait_word(cuda(stream), reinterpret_cast<const std::uint32_t*>(word), value,
                                 reinterpret_cast<const std::uint32_t*>(abandon)),
        "the staged path's wait kernel");
  }

  // As NodeComm's order: eager calls after the last eager one; captured calls after the last
  // of the same capture (a capture cannot wait for work outside it).
  Status begin(void* stream) override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    R2CCL_RETURN_IF_ERROR(cuda_status(cudaStreamGetCaptureInfo(cuda(stream), &capture, &id),
                                      "cudaStreamGetCaptureInfo"));
    if (capture == cudaStreamCaptureStatusInvalidated)
      return {ErrorCode::kInvalidArgument, "the stream's CUDA graph capture was invalidated"};
    capturing_ = capture == cudaStreamCaptureStatusActive;
    capture_now_ = id;
    if (!capturing_ || (captured_any_ && capture_id_ == id))
      R2CCL_RETURN_IF_ERROR(
          cuda_status(cudaStreamWaitEvent(cuda(stream), capturing_ ? last_captured_ : last_, 0),
                      "cudaStreamWaitEvent"));
    return Status::ok();
  }
  Status end(void* stream) override {
    R2CCL_RETURN_IF_ERROR(cuda_status(
        cudaEventRecord(capturing_ ? last_captured_ : last_, cuda(stream)), "cudaEventRecord"));
    if (capturing_) {
      capture_id_ = capture_now_;
      captured_any_ = true;
    }
    return Status::ok();
  }

  Result<bool> capturing(void* stream) override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    R2CCL_RETURN_IF_ERROR(
        cuda_status(cudaStreamIsCapturing(cuda(stream), &capture), "cudaStreamIsCapturing"));
    return capture == cudaStreamCaptureStatusActive;
  }

  Status on_graph_destroyed(void* stream, std::function<void()> release) override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cudaGraph_t graph = nullptr;
    R2CCL_RETURN_IF_ERROR(cuda_status(cudaStreamGetCaptureInfo(cuda(stream), &capture, &id, &graph),
                                      "cudaStreamGetCaptureInfo"));
    if (capture != cudaStreamCaptureStatusActive || graph == nullptr)
      return {ErrorCode::kInvalidArgument, "the stream is not capturing"};
    auto f = std::make_unique<std::function<void()>>(std::move(release));
    cudaUserObject_t object = nullptr;
    R2CCL_RETURN_IF_ERROR(cuda_status(
        cudaUserObjectCreate(&object, f.get(), release_callback, 1, cudaUserObjectNoDestructorSync),
        "cudaUserObjectCreate"));
    f.release();  // the user object owns it now (release_callback deletes it)
    return cuda_status(cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove),
                       "cudaGraphRetainUserObject");
  }

  Status check_buffer(const void* p, const char* what, const char* name) override {
    const PointerInfo info = pointer_info(p);
    if (info.kind != MemoryKind::kDevice && info.kind != MemoryKind::kManaged)
      return {ErrorCode::kInvalidArgument,
              fmt::format("{}: the {} buffer is {} memory, not device memory", what, name,
                          memory_kind_name(info.kind))};
    if (info.device != device_ && info.kind == MemoryKind::kDevice)
      return {ErrorCode::kInvalidArgument,
              fmt::format("{}: the {} buffer is on device {}, the communicator's is device {}",
                          what, name, info.device, device_)};
    return Status::ok();
  }

 private:
  int device_;
  cudaEvent_t last_ = nullptr;
  cudaEvent_t last_captured_ = nullptr;
  bool capturing_ = false;
  unsigned long long capture_now_ = 0, capture_id_ = 0;
  bool captured_any_ = false;
};

}  // namespace

Result<std::shared_ptr<StagingDevice>> cuda_staging(int device) {
  R2CCL_RETURN_IF_ERROR(available());
  auto d = std::make_shared<CudaStaging>(device);
  R2CCL_RETURN_IF_ERROR(d->init());
  return std::shared_ptr<StagingDevice>(std::move(d));
}

}  // namespace r2ccl::coll::gpu

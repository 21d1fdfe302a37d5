#include "device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "r2ccl/coll/gpu/device.h"
#include "r2ccl/coll/gpu/nvlink.h"

namespace r2ccl::capi {

namespace gpu = coll::gpu;

bool cuda_supported() {
  return gpu::available().is_ok();
}

Result<int> buffers_device(std::initializer_list<const void*> buffers, void* stream,
                           const char* what) {
  // Without a usable device every buffer is host memory: no CUDA query on the host path.
  static const bool kCuda = cuda_supported();
  int device = -1;
  const void* host = nullptr;
  for (const void* b : buffers) {
    if (b == nullptr) continue;
    const gpu::PointerInfo info = kCuda ? gpu::pointer_info(b) : gpu::PointerInfo{};
    if (info.kind == gpu::MemoryKind::kDevice || info.kind == gpu::MemoryKind::kManaged) {
      if (device < 0) device = info.device;
    } else if (host == nullptr) {
      host = b;
    }
  }
  if (device >= 0 && host != nullptr)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{}: buffer {} is host memory and another is device memory (of "
                              "device {}); pass buffers of one kind",
                              what, host, device));
  if (device < 0 && stream != nullptr && host != nullptr)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{}: the buffers are host memory, so the stream must be NULL (a "
                              "stream is for device memory)",
                              what));
  if (device < 0 && stream != nullptr) {
    // No buffer to look at (a barrier): the stream's device.
    int current = 0;
    R2CCL_RETURN_IF_ERROR(gpu::cuda_status(cudaGetDevice(&current), what));
    device = current;
  }
  return device;
}

struct DeviceComm::Impl {
  std::unique_ptr<gpu::NvlinkComm> nv;
  Status usable(const char* what) const {
    if (!nv) return {ErrorCode::kInternal, fmt::format("{}: the GPU side was not set up", what)};
    return Status::ok();
  }
};

DeviceComm::DeviceComm() : impl_(std::make_unique<Impl>()) {}
DeviceComm::~DeviceComm() = default;

bool DeviceComm::bound() const {
  return impl_->nv != nullptr;
}

Status DeviceComm::bind(coll::Communicator& host, int device, void* stream, const char* what) {
  if (impl_->nv) {
    if (impl_->nv->device() != device && device >= 0)
      return {ErrorCode::kInvalidArgument,
              fmt::format("{}: this communicator's GPU is device {}, the buffers are on device {}",
                          what, impl_->nv->device(), device)};
    return Status::ok();
  }
  // Every rank goes on to NvlinkComm::create, a collective, even where it has no device: it
  // fails there after telling the others, who then fail too instead of waiting.
  const Status here = gpu::available();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (stream != nullptr)
    R2CCL_RETURN_IF_ERROR(
        gpu::cuda_status(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capturing),
                         fmt::format("{}: cudaStreamIsCapturing", what)));
  if (capturing != cudaStreamCaptureStatusNone)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the communicator's GPU side is set up by its first call on device "
                        "memory, and this one is being captured into a CUDA graph: make one "
                        "call on device memory before capturing (or r2cclCommBindDevice)",
                        what)};
  if (device < 0) {  // the calling thread's device
    device = 0;
    if (here) R2CCL_RETURN_IF_ERROR(gpu::cuda_status(cudaGetDevice(&device), what));
  }
  gpu::NvlinkComm::Options options;
  options.tune = host.config().gpu_tune;
  auto made = gpu::NvlinkComm::create(host, device, options);
  if (!made) return made.status().with_context(what);
  impl_->nv = std::move(*made);
  return Status::ok();
}

namespace {
cudaStream_t cuda_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
}  // namespace

Status DeviceComm::all_reduce(const void* send, void* recv, std::size_t count, coll::DataType type,
                              coll::RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-reduce"));
  return impl_->nv->all_reduce(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::all_gather(const void* send, void* recv, std::size_t count, coll::DataType type,
                              void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-gather"));
  return impl_->nv->all_gather(send, recv, count, type, cuda_stream(stream));
}
Status DeviceComm::reduce_scatter(const void* send, void* recv, std::size_t count,
                                  coll::DataType type, coll::RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce-scatter"));
  return impl_->nv->reduce_scatter(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::broadcast(const void* send, void* recv, std::size_t count, coll::DataType type,
                             int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("broadcast"));
  return impl_->nv->broadcast(send, recv, count, type, root, cuda_stream(stream));
}
Status DeviceComm::reduce(const void* send, void* recv, std::size_t count, coll::DataType type,
                          coll::RedOp op, int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce"));
  return impl_->nv->reduce(send, recv, count, type, op, root, cuda_stream(stream));
}
Status DeviceComm::send(const void* buf, std::size_t count, coll::DataType type, int peer,
                        void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("send"));
  return impl_->nv->send(buf, count, type, peer, cuda_stream(stream));
}
Status DeviceComm::recv(void* buf, std::size_t count, coll::DataType type, int peer, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("recv"));
  return impl_->nv->recv(buf, count, type, peer, cuda_stream(stream));
}
Status DeviceComm::group_start() {
  R2CCL_RETURN_IF_ERROR(impl_->usable("group start"));
  return impl_->nv->group_start();
}
Status DeviceComm::group_end() {
  R2CCL_RETURN_IF_ERROR(impl_->usable("group end"));
  return impl_->nv->group_end();
}
Status DeviceComm::synchronize(void* stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  R2CCL_RETURN_IF_ERROR(gpu::cuda_status(cudaStreamIsCapturing(cuda_stream(stream), &capturing),
                                         "cudaStreamIsCapturing"));
  if (capturing != cudaStreamCaptureStatusNone)
    return {ErrorCode::kInvalidArgument,
            "the stream is being captured into a CUDA graph, and a barrier waits for it on the "
            "host: call it outside the capture"};
  return gpu::cuda_status(cudaStreamSynchronize(cuda_stream(stream)), "cudaStreamSynchronize");
}
Status DeviceComm::error() const {
  return impl_->nv ? impl_->nv->error() : Status::ok();
}
void DeviceComm::abort(const std::string& why) {
  if (impl_->nv) impl_->nv->abort(why);
}
Status DeviceComm::close() {
  return impl_->nv ? impl_->nv->close() : Status::ok();
}

}  // namespace r2ccl::capi

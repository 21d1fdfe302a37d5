#include "device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <unistd.h>

#include <fstream>

#include "r2ccl/coll/gpu/device.h"
#include "r2ccl/coll/gpu/nvlink.h"
#include "r2ccl/coll/gpu/staging.h"
#include "r2ccl/coll/staged.h"

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

// Where this rank runs, for R2CCL_GPU_PATH=auto: R2CCL_NODE_ID, else the host name, the boot
// id and the network namespace (ranks in two namespaces reach each other over the rails only).
std::string node_key(const Config& config) {
  if (!config.node_id.empty()) return config.node_id;
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = 0;
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  return fmt::format("{}/{}/{}", host, boot,
                     n > 0 ? std::string(ns, static_cast<std::size_t>(n)) : "");
}

// Whether every rank of `host` is on this rank's node (a collective).
Result<bool> one_node(coll::Communicator& host) {
  const std::string key = node_key(host.config());
  const Bytes mine(reinterpret_cast<const std::byte*>(key.data()),
                   reinterpret_cast<const std::byte*>(key.data()) + key.size());
  R2CCL_ASSIGN_OR_RETURN(auto all,
                         host.fabric().bootstrap().allgather(mine, host.config().timeout));
  for (const auto& k : all)
    if (k != mine) return false;
  return true;
}

struct DeviceComm::Impl {
  std::unique_ptr<gpu::NvlinkComm> nv;
  std::unique_ptr<coll::StagedComm> staged;  // ranks on several nodes: over the rails
  int device = -1;
  Status usable(const char* what) const {
    if (!nv && !staged)
      return {ErrorCode::kInternal, fmt::format("{}: the GPU side was not set up", what)};
    return Status::ok();
  }
};

DeviceComm::DeviceComm() : impl_(std::make_unique<Impl>()) {}
DeviceComm::~DeviceComm() = default;

bool DeviceComm::bound() const {
  return impl_->nv != nullptr || impl_->staged != nullptr;
}

Status DeviceComm::bind(coll::Communicator& host, int device, void* stream, const char* what) {
  if (bound()) {
    if (impl_->device != device && device >= 0)
      return {ErrorCode::kInvalidArgument,
              fmt::format("{}: this communicator's GPU is device {}, the buffers are on device {}",
                          what, impl_->device, device)};
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
  const std::string& path = host.config().gpu_path;
  bool nvlink = path == "nvlink";
  if (path == "auto") {
    auto same = one_node(host);
    if (!same) return same.status().with_context(what);
    nvlink = *same;
  }
  impl_->device = device;
  if (!nvlink) {
    // Every rank goes on to StagedComm::create (a collective) with or without a device.
    auto staging =
        here ? gpu::cuda_staging(device) : Result<std::shared_ptr<coll::StagingDevice>>(here);
    coll::StagedComm::Options options;
    options.chunk_bytes = host.config().gpu_staging_chunk;
    options.window = host.config().gpu_staging_window;
    auto made = coll::StagedComm::create(host, staging ? *staging : nullptr, options);
    if (!staging) return staging.status().with_context(what);
    if (!made) return made.status().with_context(what);
    impl_->staged = std::move(*made);
    return Status::ok();
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
  if (impl_->staged) return impl_->staged->all_reduce(send, recv, count, type, op, stream);
  return impl_->nv->all_reduce(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::all_gather(const void* send, void* recv, std::size_t count, coll::DataType type,
                              void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-gather"));
  if (impl_->staged) return impl_->staged->all_gather(send, recv, count, type, stream);
  return impl_->nv->all_gather(send, recv, count, type, cuda_stream(stream));
}
Status DeviceComm::reduce_scatter(const void* send, void* recv, std::size_t count,
                                  coll::DataType type, coll::RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce-scatter"));
  if (impl_->staged) return impl_->staged->reduce_scatter(send, recv, count, type, op, stream);
  return impl_->nv->reduce_scatter(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::broadcast(const void* send, void* recv, std::size_t count, coll::DataType type,
                             int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("broadcast"));
  if (impl_->staged) return impl_->staged->broadcast(send, recv, count, type, root, stream);
  return impl_->nv->broadcast(send, recv, count, type, root, cuda_stream(stream));
}
Status DeviceComm::reduce(const void* send, void* recv, std::size_t count, coll::DataType type,
                          coll::RedOp op, int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce"));
  if (impl_->staged) return impl_->staged->reduce(send, recv, count, type, op, root, stream);
  return impl_->nv->reduce(send, recv, count, type, op, root, cuda_stream(stream));
}
Status DeviceComm::send(const void* buf, std::size_t count, coll::DataType type, int peer,
                        void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("send"));
  if (impl_->staged) return impl_->staged->send(buf, count, type, peer, stream);
  return impl_->nv->send(buf, count, type, peer, cuda_stream(stream));
}
Status DeviceComm::recv(void* buf, std::size_t count, coll::DataType type, int peer, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("recv"));
  if (impl_->staged) return impl_->staged->recv(buf, count, type, peer, stream);
  return impl_->nv->recv(buf, count, type, peer, cuda_stream(stream));
}
Status DeviceComm::group_start() {
  R2CCL_RETURN_IF_ERROR(impl_->usable("group start"));
  if (impl_->staged) return impl_->staged->group_start();
  return impl_->nv->group_start();
}
Status DeviceComm::group_end() {
  R2CCL_RETURN_IF_ERROR(impl_->usable("group end"));
  if (impl_->staged) return impl_->staged->group_end();
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
  if (impl_->staged) return impl_->staged->error();
  return impl_->nv ? impl_->nv->error() : Status::ok();
}
void DeviceComm::abort(const std::string& why) {
  if (impl_->nv) impl_->nv->abort(why);
  if (impl_->staged) impl_->staged->abort(why);
}
Status DeviceComm::close() {
  if (impl_->staged) return impl_->staged->close();
  return impl_->nv ? impl_->nv->close() : Status::ok();
}

}  // namespace r2ccl::capi

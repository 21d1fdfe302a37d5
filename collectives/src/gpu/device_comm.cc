#include "r2ccl/coll/device_comm.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <vector>

#include "r2ccl/coll/gpu/device.h"
#include "r2ccl/coll/gpu/nvlink.h"
#include "r2ccl/coll/gpu/staging.h"
#include "r2ccl/coll/staged.h"

namespace r2ccl::coll {

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

// Where the ranks of `host` are (a collective): this rank's node and index in it, in the order
// the nodes' first ranks come; `per_node` is 0 where the nodes hold different numbers of ranks.
struct Layout {
  int nodes = 1, node = 0, local = 0, per_node = 0;
};
Result<Layout> node_layout(Communicator& host) {
  const std::string key = node_key(host.config());
  const Bytes mine(reinterpret_cast<const std::byte*>(key.data()),
                   reinterpret_cast<const std::byte*>(key.data()) + key.size());
  R2CCL_ASSIGN_OR_RETURN(auto all,
                         host.fabric().bootstrap().allgather(mine, host.config().timeout));
  std::vector<Bytes> keys;
  std::vector<int> count;
  Layout l;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto it = std::find(keys.begin(), keys.end(), all[r]);
    const auto n = static_cast<std::size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(all[r]);
      count.push_back(0);
    }
    if (static_cast<int>(r) == host.rank()) {
      l.node = static_cast<int>(n);
      l.local = count[n];
    }
    ++count[n];
  }
  l.nodes = static_cast<int>(keys.size());
  l.per_node = count.front();
  for (int c : count)
    if (c != l.per_node) l.per_node = 0;
  return l;
}

struct DeviceComm::Impl {
  // Nodes of several GPUs each: an all-reduce reduce-scatters over NVLink inside the node
  // (`nv` on `local`), all-reduces its part over the rails with the same index on the other
  // nodes (`cross` on `across`), and all-gathers over NVLink. The other calls go over `staged`.
  // (Declared first: `nv` uses `local` and goes before it.)
  std::unique_ptr<Communicator> local, across;
  std::unique_ptr<gpu::NvlinkComm> nv;       // one node: NVLink
  std::unique_ptr<coll::StagedComm> staged;  // ranks on several nodes: over the rails
  std::unique_ptr<coll::StagedComm> cross;
  int per_node = 0, local_rank = 0;
  int device = -1;
  Status usable(const char* what) const {
    if (!nv && !staged)
      return {ErrorCode::kInternal, fmt::format("{}: the GPU side was not set up", what)};
    return Status::ok();
  }
  // Whether an all-reduce of `count` elements of `bytes` each takes the hierarchical plan.
  // (Average divides once, over every rank: not in parts.)
  bool hierarchical(std::size_t count, std::size_t bytes, RedOp op) const {
    return cross != nullptr && op != RedOp::kAvg &&
           count % static_cast<std::size_t>(per_node) == 0 &&
           count * bytes >= (std::size_t{256} << 10);
  }
};

DeviceComm::DeviceComm() : impl_(std::make_unique<Impl>()) {}
DeviceComm::~DeviceComm() = default;

bool DeviceComm::bound() const {
  return impl_->nv != nullptr || impl_->staged != nullptr;
}

Status DeviceComm::bind(Communicator& host, int device, void* stream, const char* what) {
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
  Layout layout;
  if (path != "nvlink") {
    auto l = node_layout(host);
    if (!l) return l.status().with_context(what);
    layout = *l;
    nvlink = path == "auto" && layout.nodes == 1;
  }
  impl_->device = device;
  gpu::NvlinkComm::Options nv_options;
  nv_options.tune = host.config().gpu_tune;
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
    // Nodes of 2 to 8 GPUs each, alike: the hierarchical all-reduce's communicators.
    if (layout.nodes > 1 && layout.per_node > 1 && layout.per_node <= gpu::kMaxNvlinkRanks) {
      auto local = host.split(layout.node, layout.local);
      if (!local) return local.status().with_context(what);
      auto across = host.split(layout.local, layout.node);
      if (!across) return across.status().with_context(what);
      impl_->local = std::move(*local);
      impl_->across = std::move(*across);
      auto nv = gpu::NvlinkComm::create(*impl_->local, device, nv_options);
      if (!nv) return nv.status().with_context(fmt::format("{}: NVLink inside the node", what));
      impl_->nv = std::move(*nv);
      auto cross = coll::StagedComm::create(*impl_->across, *staging, options);
      if (!cross) return cross.status().with_context(what);
      impl_->cross = std::move(*cross);
      impl_->per_node = layout.per_node;
      impl_->local_rank = layout.local;
    }
    return Status::ok();
  }
  auto made = gpu::NvlinkComm::create(host, device, nv_options);
  if (!made) return made.status().with_context(what);
  impl_->nv = std::move(*made);
  return Status::ok();
}

namespace {
cudaStream_t cuda_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
}  // namespace

Status DeviceComm::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                              RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-reduce"));
  if (impl_->hierarchical(count, coll::type_size(type), op)) {
    // In place at every step: rank i of the node keeps part i of `recv`.
    const std::size_t part = count / static_cast<std::size_t>(impl_->per_node);
    auto* mine = static_cast<std::byte*>(recv) +
                 static_cast<std::size_t>(impl_->local_rank) * part * coll::type_size(type);
    R2CCL_RETURN_IF_ERROR(
        impl_->nv->reduce_scatter(send, mine, part, type, op, cuda_stream(stream)));
    R2CCL_RETURN_IF_ERROR(impl_->cross->all_reduce(mine, mine, part, type, op, stream));
    return impl_->nv->all_gather(mine, recv, part, type, cuda_stream(stream));
  }
  if (impl_->staged) return impl_->staged->all_reduce(send, recv, count, type, op, stream);
  return impl_->nv->all_reduce(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::all_gather(const void* send, void* recv, std::size_t count, DataType type,
                              void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-gather"));
  if (impl_->staged) return impl_->staged->all_gather(send, recv, count, type, stream);
  return impl_->nv->all_gather(send, recv, count, type, cuda_stream(stream));
}
Status DeviceComm::reduce_scatter(const void* send, void* recv, std::size_t count, DataType type,
                                  RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce-scatter"));
  if (impl_->staged) return impl_->staged->reduce_scatter(send, recv, count, type, op, stream);
  return impl_->nv->reduce_scatter(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::broadcast(const void* send, void* recv, std::size_t count, DataType type,
                             int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("broadcast"));
  if (impl_->staged) return impl_->staged->broadcast(send, recv, count, type, root, stream);
  return impl_->nv->broadcast(send, recv, count, type, root, cuda_stream(stream));
}
Status DeviceComm::reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                          int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce"));
  if (impl_->staged) return impl_->staged->reduce(send, recv, count, type, op, root, stream);
  return impl_->nv->reduce(send, recv, count, type, op, root, cuda_stream(stream));
}
Status DeviceComm::send(const void* buf, std::size_t count, DataType type, int peer, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("send"));
  if (impl_->staged) return impl_->staged->send(buf, count, type, peer, stream);
  return impl_->nv->send(buf, count, type, peer, cuda_stream(stream));
}
Status DeviceComm::recv(void* buf, std::size_t count, DataType type, int peer, void* stream) {
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
  if (impl_->cross)
    if (Status e = impl_->cross->error(); !e) return e;
  if (impl_->nv)
    if (Status e = impl_->nv->error(); !e) return e;
  return impl_->staged ? impl_->staged->error() : Status::ok();
}
void DeviceComm::abort(const std::string& why) {
  if (impl_->nv) impl_->nv->abort(why);
  if (impl_->staged) impl_->staged->abort(why);
  if (impl_->cross) impl_->cross->abort(why);
}
Status DeviceComm::close() {
  Status st = Status::ok();
  if (impl_->cross) st = impl_->cross->close();
  if (impl_->nv) {
    const Status nv = impl_->nv->close();
    if (st) st = nv;
  }
  if (impl_->staged) {
    const Status staged = impl_->staged->close();
    if (st) st = staged;
  }
  return st;
}

}  // namespace r2ccl::coll

#include "r2ccl/coll/device_comm.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <type_traits>
#include <vector>

#include "r2ccl/coll/gpu/device.h"
#include "r2ccl/coll/gpu/node_comm.h"
#include "r2ccl/coll/gpu/staging.h"
#include "r2ccl/coll/staged.h"
#include "r2ccl/coll/two_level.h"

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
  bool blocked = false;  // rank = node * per_node + local for every rank
};
Result<Layout> node_layout(Communicator& host) {
  const std::string key = node_key(host.config());
  const Bytes mine(reinterpret_cast<const std::byte*>(key.data()),
                   reinterpret_cast<const std::byte*>(key.data()) + key.size());
  R2CCL_ASSIGN_OR_RETURN(auto all,
                         host.fabric().bootstrap().allgather(mine, host.config().timeout));
  std::vector<Bytes> keys;
  std::vector<int> count, node_of, local_of;
  Layout l;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto it = std::find(keys.begin(), keys.end(), all[r]);
    const auto n = static_cast<std::size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(all[r]);
      count.push_back(0);
    }
    node_of.push_back(static_cast<int>(n));
    local_of.push_back(count[n]);
    ++count[n];
  }
  const auto me = static_cast<std::size_t>(host.rank());
  l.node = node_of.at(me);
  l.local = local_of.at(me);
  l.nodes = static_cast<int>(keys.size());
  l.per_node = count.front();
  for (int c : count)
    if (c != l.per_node) l.per_node = 0;
  l.blocked = TwoLevel::blocked(node_of, local_of, l.per_node);
  return l;
}

namespace {

cudaStream_t cuda_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

// NVLink inside the node (gpu::NodeComm) or the rails staged through the host (StagedComm) as
// a level of TwoLevel.
template <class C>
class LevelOf final : public Level {
 public:
  explicit LevelOf(C& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  Status all_reduce(const void* s, void* r, std::size_t n, DataType t, RedOp op,
                    void* st) override {
    return c_.all_reduce(s, r, n, t, op, stream_of(st));
  }
  Status all_gather(const void* s, void* r, std::size_t n, DataType t, void* st) override {
    return c_.all_gather(s, r, n, t, stream_of(st));
  }
  Status reduce_scatter(const void* s, void* r, std::size_t n, DataType t, RedOp op,
                        void* st) override {
    return c_.reduce_scatter(s, r, n, t, op, stream_of(st));
  }
  Status broadcast(const void* s, void* r, std::size_t n, DataType t, int root, void* st) override {
    return c_.broadcast(s, r, n, t, root, stream_of(st));
  }
  Status reduce(const void* s, void* r, std::size_t n, DataType t, RedOp op, int root,
                void* st) override {
    return c_.reduce(s, r, n, t, op, root, stream_of(st));
  }
  Status send(const void* b, std::size_t n, DataType t, int peer, void* st) override {
    return c_.send(b, n, t, peer, stream_of(st));
  }
  Status recv(void* b, std::size_t n, DataType t, int peer, void* st) override {
    return c_.recv(b, n, t, peer, stream_of(st));
  }
  Status group_start() override { return c_.group_start(); }
  Status group_end() override { return c_.group_end(); }

 private:
  // NodeComm takes CUDA's stream type, StagedComm the opaque one.
  static auto stream_of(void* st) {
    if constexpr (std::is_same_v<C, gpu::NodeComm>)
      return cuda_stream(st);
    else
      return st;
  }
  C& c_;
};
using NvlinkLevel = LevelOf<gpu::NodeComm>;
using StagedLevel = LevelOf<StagedComm>;

// Device memory of the communicator's GPU for what a call holds between its levels, kept and
// grown (never shrunk) rather than taken per call: a buffer that a CUDA graph captured must live
// as long as the graph, so one outgrown stays until the communicator goes; and memory of a
// graph's own allocation (cudaMallocAsync in capture) is not device memory to the calls that
// check their buffers. Eager calls on different streams are ordered through it (each waits for
// the previous one's release), as the levels order their own calls.
class DeviceScratch final : public Scratch {
 public:
  explicit DeviceScratch(int device) : device_(device) {}
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() override {
    for (void* p : buffers_)
      (void)cudaFree(p);
    if (done_ != nullptr) (void)cudaEventDestroy(done_);
  }
  Result<void*> acquire(std::size_t bytes, void* stream) override {
    R2CCL_ASSIGN_OR_RETURN(const bool capturing, is_capturing(stream));
    if (bytes > size_) {
      // cudaMalloc does not take part in a capture; relaxed so that a capture in global mode
      // (PyTorch's default) allows it.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      (void)cudaThreadExchangeStreamCaptureMode(&mode);
      int current = 0;
      void* p = nullptr;
      cudaError_t e = cudaGetDevice(&current);
      if (e == cudaSuccess) e = cudaSetDevice(device_);
      if (e == cudaSuccess) e = cudaMalloc(&p, bytes);
      (void)cudaSetDevice(current);
      (void)cudaThreadExchangeStreamCaptureMode(&mode);
      R2CCL_RETURN_IF_ERROR(gpu::cuda_status(
          e, fmt::format("cudaMalloc of {} bytes between the levels of a collective", bytes)));
      buffers_.push_back(p);
      size_ = bytes;
    }
    if (!capturing && done_ != nullptr)  // made when a release is first recorded
      R2CCL_RETURN_IF_ERROR(gpu::cuda_status(cudaStreamWaitEvent(cuda_stream(stream), done_, 0),
                                             "cudaStreamWaitEvent"));
    return buffers_.back();
  }
  Status release(void*, void* stream) override {
    R2CCL_ASSIGN_OR_RETURN(const bool capturing, is_capturing(stream));
    if (capturing) return Status::ok();
    if (done_ == nullptr)
      R2CCL_RETURN_IF_ERROR(gpu::cuda_status(
          cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate"));
    R2CCL_RETURN_IF_ERROR(
        gpu::cuda_status(cudaEventRecord(done_, cuda_stream(stream)), "cudaEventRecord"));
    return Status::ok();
  }

 private:
  static Result<bool> is_capturing(void* stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    R2CCL_RETURN_IF_ERROR(gpu::cuda_status(cudaStreamIsCapturing(cuda_stream(stream), &status),
                                           "cudaStreamIsCapturing"));
    return status != cudaStreamCaptureStatusNone;
  }
  int device_;
  std::vector<void*> buffers_;  // the last is in use; the others may be in captured graphs
  std::size_t size_ = 0;
  cudaEvent_t done_ = nullptr;  // the last eager release, once there was one
};

}  // namespace

struct DeviceComm::Impl {
  // Nodes of several GPUs each (alike, 2 to 8): large calls run in two levels (two_level.h),
  // NVLink inside the node (`nv` on `local`) and the rails with the same local index on the
  // other nodes (`cross` on `across`). The other calls go over `staged`, flat.
  // (Declared first: `nv` uses `local` and goes before it.)
  std::unique_ptr<Communicator> local, across;
  std::unique_ptr<gpu::NodeComm> nv;         // one node: NVLink
  std::unique_ptr<coll::StagedComm> staged;  // ranks on several nodes: over the rails
  std::unique_ptr<coll::StagedComm> cross;
  std::unique_ptr<NvlinkLevel> inside_level;
  std::unique_ptr<StagedLevel> across_level;
  std::unique_ptr<DeviceScratch> scratch;
  std::unique_ptr<TwoLevel> two;
  bool blocked = false;  // ranks numbered node by node: every call may take two levels
  int device = -1;
  Status usable(const char* what) const {
    if (!nv && !staged)
      return {ErrorCode::kInternal, fmt::format("{}: the GPU side was not set up", what)};
    return Status::ok();
  }
  // Whether a call that moves `bytes` (of the largest buffer) runs in two levels. An average
  // divides once, over every rank: not in levels. All-reduce's result is the same on every rank,
  // so it needs no numbering; the others place blocks by rank.
  bool two_level(std::size_t bytes, RedOp op = RedOp::kSum, bool any_numbering = false) const {
    return two != nullptr && op != RedOp::kAvg && (blocked || any_numbering) &&
           bytes >= (std::size_t{256} << 10);
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
  // Every rank goes on to NodeComm::create, a collective, even where it has no device: it
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
  gpu::NodeComm::Options nv_options;
  nv_options.tune = host.config().gpu_tune;
  nv_options.nccl = host.config().gpu_nccl;
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
      auto nv = gpu::NodeComm::create(*impl_->local, device, nv_options);
      if (!nv) return nv.status().with_context(fmt::format("{}: NVLink inside the node", what));
      impl_->nv = std::move(*nv);
      auto cross = coll::StagedComm::create(*impl_->across, *staging, options);
      if (!cross) return cross.status().with_context(what);
      impl_->cross = std::move(*cross);
      impl_->inside_level = std::make_unique<NvlinkLevel>(*impl_->nv);
      impl_->across_level = std::make_unique<StagedLevel>(*impl_->cross);
      impl_->scratch = std::make_unique<DeviceScratch>(device);
      impl_->two =
          std::make_unique<TwoLevel>(*impl_->inside_level, *impl_->across_level, *impl_->scratch);
      impl_->blocked = layout.blocked;
    }
    return Status::ok();
  }
  auto made = gpu::NodeComm::create(host, device, nv_options);
  if (!made) return made.status().with_context(what);
  impl_->nv = std::move(*made);
  return Status::ok();
}

Status DeviceComm::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                              RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-reduce"));
  if (impl_->two_level(count * type_size(type), op, true) &&
      count % static_cast<std::size_t>(impl_->two->per_node()) == 0)
    return impl_->two->all_reduce(send, recv, count, type, op, stream);
  if (impl_->staged) return impl_->staged->all_reduce(send, recv, count, type, op, stream);
  return impl_->nv->all_reduce(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::all_gather(const void* send, void* recv, std::size_t count, DataType type,
                              void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("all-gather"));
  if (impl_->staged) {
    if (impl_->two_level(count * type_size(type) * static_cast<std::size_t>(impl_->staged->size())))
      return impl_->two->all_gather(send, recv, count, type, stream);
    return impl_->staged->all_gather(send, recv, count, type, stream);
  }
  return impl_->nv->all_gather(send, recv, count, type, cuda_stream(stream));
}
Status DeviceComm::reduce_scatter(const void* send, void* recv, std::size_t count, DataType type,
                                  RedOp op, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce-scatter"));
  if (impl_->staged) {
    if (impl_->two_level(count * type_size(type) * static_cast<std::size_t>(impl_->staged->size()),
                         op))
      return impl_->two->reduce_scatter(send, recv, count, type, op, stream);
    return impl_->staged->reduce_scatter(send, recv, count, type, op, stream);
  }
  return impl_->nv->reduce_scatter(send, recv, count, type, op, cuda_stream(stream));
}
Status DeviceComm::broadcast(const void* send, void* recv, std::size_t count, DataType type,
                             int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("broadcast"));
  if (impl_->staged) {
    if (impl_->two_level(count * type_size(type)))
      return impl_->two->broadcast(send, recv, count, type, root, stream);
    return impl_->staged->broadcast(send, recv, count, type, root, stream);
  }
  return impl_->nv->broadcast(send, recv, count, type, root, cuda_stream(stream));
}
Status DeviceComm::reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                          int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(impl_->usable("reduce"));
  if (impl_->staged) {
    if (impl_->two_level(count * type_size(type), op))
      return impl_->two->reduce(send, recv, count, type, op, root, stream);
    return impl_->staged->reduce(send, recv, count, type, op, root, stream);
  }
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

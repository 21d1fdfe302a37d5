// The GPU side of a library built without CUDA: host memory only, and every device call says so.
#include <fmt/format.h>

#include "r2ccl/coll/device_comm.h"

namespace r2ccl::coll {

namespace {
Status no_cuda(const char* what) {
  return {ErrorCode::kUnavailable,
          fmt::format("{}: this libr2ccl was built without CUDA (R2CCL_CUDA=OFF, or no nvcc at "
                      "build time): host memory only",
                      what)};
}
}  // namespace

bool cuda_supported() {
  return false;
}

Result<int> buffers_device(std::initializer_list<const void*>, void* stream, const char* what) {
  if (stream != nullptr)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("{}: stream must be NULL: this build moves host memory only", what));
  return -1;
}

struct DeviceComm::Impl {};

DeviceComm::DeviceComm() = default;
DeviceComm::~DeviceComm() = default;
bool DeviceComm::bound() const {
  return false;
}
Status DeviceComm::bind(Communicator&, int, void*, const char* what) {
  return no_cuda(what);
}
Status DeviceComm::all_reduce(const void*, void*, std::size_t, DataType, RedOp, void*) {
  return no_cuda("all-reduce");
}
Status DeviceComm::all_gather(const void*, void*, std::size_t, DataType, void*) {
  return no_cuda("all-gather");
}
Status DeviceComm::reduce_scatter(const void*, void*, std::size_t, DataType, RedOp, void*) {
  return no_cuda("reduce-scatter");
}
Status DeviceComm::broadcast(const void*, void*, std::size_t, DataType, int, void*) {
  return no_cuda("broadcast");
}
Status DeviceComm::reduce(const void*, void*, std::size_t, DataType, RedOp, int, void*) {
  return no_cuda("reduce");
}
Status DeviceComm::send(const void*, std::size_t, DataType, int, void*) {
  return no_cuda("send");
}
Status DeviceComm::recv(void*, std::size_t, DataType, int, void*) {
  return no_cuda("recv");
}
Status DeviceComm::group_start() {
  return no_cuda("group start");
}
Status DeviceComm::group_end() {
  return no_cuda("group end");
}
Status DeviceComm::synchronize(void*) {
  return no_cuda("synchronize");
}
Status DeviceComm::error() const {
  return Status::ok();
}
void DeviceComm::abort(const std::string&) {}
Status DeviceComm::close() {
  return Status::ok();
}

}  // namespace r2ccl::coll

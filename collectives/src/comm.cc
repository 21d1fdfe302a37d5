#include "r2ccl/coll/comm.h"

#include <fmt/format.h>

namespace r2ccl::coll {

Comm::Comm(std::unique_ptr<Communicator> host) : host_(std::move(host)) {}

Comm::~Comm() = default;

Result<int> Comm::place(std::initializer_list<const void*> buffers, void* stream,
                        const char* what) {
  R2CCL_ASSIGN_OR_RETURN(const int device, buffers_device(buffers, stream, what));
  if (device >= 0) R2CCL_RETURN_IF_ERROR(device_.bind(*host_, device, stream, what));
  return device;
}

Status Comm::bind_device(int device) {
  return device_.bind(*host_, device, nullptr, "bind_device");
}

template <typename Host, typename Device>
Status Comm::run(std::initializer_list<const void*> buffers, void* stream, const char* what,
                 Host&& host, Device&& device) {
  if (group_depth_ > 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: a group holds sends and receives only", what)};
  R2CCL_ASSIGN_OR_RETURN(const int where, place(buffers, stream, what));
  return where >= 0 ? device(device_) : host(*host_);
}

template <typename Host, typename Device>
Status Comm::run_p2p(const void* buffer, void* stream, const char* what, Host&& host,
                     Device&& device) {
  // Placed first: setting up the GPU side is a collective of the host communicator, which must
  // not run inside its group.
  R2CCL_ASSIGN_OR_RETURN(const int where, place({buffer}, stream, what));
  if (group_depth_ > 0 && !group_host_) {
    R2CCL_RETURN_IF_ERROR(host_->group_start());
    group_host_ = true;
  }
  if (where >= 0 && group_depth_ > 0 && !group_device_) {
    R2CCL_RETURN_IF_ERROR(device_.group_start());
    group_device_ = true;
  }
  return where >= 0 ? device(device_) : host(*host_);
}

Status Comm::all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                        void* stream) {
  return run(
      {send, recv}, stream, "all-reduce",
      [&](Communicator& c) { return c.all_reduce(send, recv, count, type, op); },
      [&](DeviceComm& d) { return d.all_reduce(send, recv, count, type, op, stream); });
}

Status Comm::all_gather(const void* send, void* recv, std::size_t count, DataType type,
                        void* stream) {
  return run(
      {send, recv}, stream, "all-gather",
      [&](Communicator& c) { return c.all_gather(send, recv, count, type); },
      [&](DeviceComm& d) { return d.all_gather(send, recv, count, type, stream); });
}

Status Comm::reduce_scatter(const void* send, void* recv, std::size_t count, DataType type,
                            RedOp op, void* stream) {
  return run(
      {send, recv}, stream, "reduce-scatter",
      [&](Communicator& c) { return c.reduce_scatter(send, recv, count, type, op); },
      [&](DeviceComm& d) { return d.reduce_scatter(send, recv, count, type, op, stream); });
}

Status Comm::broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                       void* stream) {
  return run(
      {send, recv}, stream, "broadcast",
      [&](Communicator& c) { return c.broadcast(send, recv, count, type, root); },
      [&](DeviceComm& d) { return d.broadcast(send, recv, count, type, root, stream); });
}

Status Comm::reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                    int root, void* stream) {
  return run(
      {send, recv}, stream, "reduce",
      [&](Communicator& c) { return c.reduce(send, recv, count, type, op, root); },
      [&](DeviceComm& d) { return d.reduce(send, recv, count, type, op, root, stream); });
}

Status Comm::send(const void* buf, std::size_t count, DataType type, int peer, void* stream) {
  return run_p2p(
      buf, stream, "send", [&](Communicator& c) { return c.send(buf, count, type, peer); },
      [&](DeviceComm& d) { return d.send(buf, count, type, peer, stream); });
}

Status Comm::recv(void* buf, std::size_t count, DataType type, int peer, void* stream) {
  return run_p2p(
      buf, stream, "recv", [&](Communicator& c) { return c.recv(buf, count, type, peer); },
      [&](DeviceComm& d) { return d.recv(buf, count, type, peer, stream); });
}

Status Comm::group_start() {
  // The sides' groups open at the first send or receive (run_p2p).
  ++group_depth_;
  return Status::ok();
}

Status Comm::group_end() {
  if (group_depth_ == 0) return {ErrorCode::kInvalidArgument, "group_end without group_start"};
  if (--group_depth_ > 0) return Status::ok();
  Status st = Status::ok();
  if (std::exchange(group_host_, false)) st = host_->group_end();
  if (std::exchange(group_device_, false)) {
    Status d = device_.group_end();
    if (st) st = d;
  }
  return st;
}

Status Comm::barrier(void* stream) {
  if (stream != nullptr) R2CCL_RETURN_IF_ERROR(device_.synchronize(stream));
  return host_->barrier();
}

Status Comm::error() const {
  if (Status e = host_->async_error(); !e) return e;
  return device_.error();
}

void Comm::abort(const std::string& why) {
  device_.abort(why);
  host_->abort();
}

Status Comm::close_device() {
  return device_.close();
}

}  // namespace r2ccl::coll

#include "r2ccl/coll/two_level.h"

#include <fmt/format.h>

namespace r2ccl::coll {

namespace {

const std::byte* at(const void* base, std::size_t elements, std::size_t elem) {
  return static_cast<const std::byte*>(base) + elements * elem;
}
std::byte* at(void* base, std::size_t elements, std::size_t elem) {
  return static_cast<std::byte*>(base) + elements * elem;
}

// Scratch memory held for one call: released after the calls that use it are enqueued, and on
// every early return.
class Held {
 public:
  Held(Scratch& scratch, void* stream) : scratch_(scratch), stream_(stream) {}
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    if (p_ != nullptr) (void)scratch_.release(p_, stream_);
  }
  Result<void*> acquire(std::size_t bytes) {
    R2CCL_ASSIGN_OR_RETURN(p_, scratch_.acquire(bytes, stream_));
    return p_;
  }
  Status release() {
    void* p = p_;
    p_ = nullptr;
    return p == nullptr ? Status::ok() : scratch_.release(p, stream_);
  }

 private:
  Scratch& scratch_;
  void* stream_;
  void* p_ = nullptr;
};

}  // namespace

bool TwoLevel::blocked(const std::vector<int>& node_of, const std::vector<int>& local_of,
                       int per_node) {
  if (per_node <= 0 || node_of.size() != local_of.size()) return false;
  for (std::size_t r = 0; r < node_of.size(); ++r)
    if (static_cast<std::size_t>(node_of[r]) * static_cast<std::size_t>(per_node) +
            static_cast<std::size_t>(local_of[r]) !=
        r)
      return false;
  return true;
}

Status TwoLevel::check_root(int root, const char* what) const {
  if (root < 0 || root >= nodes() * per_node())
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: root {} is not a rank (0..{})", what, root, nodes() * per_node() - 1)};
  return Status::ok();
}

Status TwoLevel::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                            RedOp op, void* stream) {
  const auto p = static_cast<std::size_t>(per_node());
  if (count % p != 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("two-level all-reduce: {} elements do not split into {} parts", count, p)};
  // In place from the first step: local rank i keeps part i of recv.
  const std::size_t part = count / p;
  void* mine = at(recv, static_cast<std::size_t>(inside_.rank()) * part, type_size(type));
  R2CCL_RETURN_IF_ERROR(inside_.reduce_scatter(send, mine, part, type, op, stream));
  R2CCL_RETURN_IF_ERROR(across_.all_reduce(mine, mine, part, type, op, stream));
  return inside_.all_gather(mine, recv, part, type, stream);
}

Status TwoLevel::all_gather(const void* send, void* recv, std::size_t count, DataType type,
                            void* stream) {
  const std::size_t elem = type_size(type);
  const auto p = static_cast<std::size_t>(per_node());
  const int node = across_.rank();
  const auto local = static_cast<std::size_t>(inside_.rank());
  // Block (m, local) of every other node m arrives here, where the result holds it: in rounds,
  // round k to the node k after this one and from the node k before (one send and one receive
  // per group, whatever the number of nodes).
  for (int k = 1; k < nodes(); ++k) {
    const int to = (node + k) % nodes(), from = (node + nodes() - k) % nodes();
    R2CCL_RETURN_IF_ERROR(across_.group_start());
    Status posted = across_.send(send, count, type, to, stream);
    if (posted)
      posted = across_.recv(at(recv, (static_cast<std::size_t>(from) * p + local) * count, elem),
                            count, type, from, stream);
    const Status ended = across_.group_end();
    R2CCL_RETURN_IF_ERROR(posted);
    R2CCL_RETURN_IF_ERROR(ended);
  }
  // Then, per node, the node's blocks among this node's ranks: each holds its own.
  for (int m = 0; m < nodes(); ++m) {
    const auto first = static_cast<std::size_t>(m) * p;
    const void* own = m == node ? send : at(recv, (first + local) * count, elem);
    R2CCL_RETURN_IF_ERROR(
        inside_.all_gather(own, at(recv, first * count, elem), count, type, stream));
  }
  return Status::ok();
}

Status TwoLevel::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType type,
                                RedOp op, void* stream) {
  const std::size_t elem = type_size(type);
  const auto p = static_cast<std::size_t>(per_node());
  const auto n = static_cast<std::size_t>(nodes());
  // This node's sum of block (m, local) for every node m, side by side; then across, node m
  // gets the sum of block m over the nodes.
  Held held(scratch_, stream);
  R2CCL_ASSIGN_OR_RETURN(void* partial, held.acquire(n * recv_count * elem));
  for (std::size_t m = 0; m < n; ++m)
    R2CCL_RETURN_IF_ERROR(inside_.reduce_scatter(at(send, m * p * recv_count, elem),
                                                 at(partial, m * recv_count, elem), recv_count,
                                                 type, op, stream));
  R2CCL_RETURN_IF_ERROR(across_.reduce_scatter(partial, recv, recv_count, type, op, stream));
  return held.release();
}

Status TwoLevel::broadcast(const void* send, void* recv, std::size_t count, DataType type, int root,
                           void* stream) {
  R2CCL_RETURN_IF_ERROR(check_root(root, "two-level broadcast"));
  const int root_node = root / per_node(), root_local = root % per_node();
  if (inside_.rank() == root_local)
    R2CCL_RETURN_IF_ERROR(across_.broadcast(send, recv, count, type, root_node, stream));
  return inside_.broadcast(recv, recv, count, type, root_local, stream);
}

Status TwoLevel::reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                        int root, void* stream) {
  R2CCL_RETURN_IF_ERROR(check_root(root, "two-level reduce"));
  const int root_node = root / per_node(), root_local = root % per_node();
  Held held(scratch_, stream);
  // The node's sum at the root's local index: into recv on the root, scratch elsewhere.
  void* node_sum = recv;
  if (inside_.rank() == root_local && rank() != root) {
    R2CCL_ASSIGN_OR_RETURN(node_sum, held.acquire(count * type_size(type)));
  }
  R2CCL_RETURN_IF_ERROR(inside_.reduce(send, node_sum, count, type, op, root_local, stream));
  if (inside_.rank() == root_local)
    R2CCL_RETURN_IF_ERROR(across_.reduce(node_sum, node_sum, count, type, op, root_node, stream));
  return held.release();
}

}  // namespace r2ccl::coll

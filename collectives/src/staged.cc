#include "r2ccl/coll/staged.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl::coll {

namespace {

// The words, in mapped memory: the doorbell and the abandon word on lines of their own, then
// one "staged" and one "done" word per chunk index of a call.
constexpr std::size_t kDoorbell = 0;
constexpr std::size_t kAbandon = 16;
constexpr std::size_t kMaxChunks = 4096;  // per doorbell; a longer call takes several
constexpr std::size_t kReady = 32;
constexpr std::size_t kDone = kReady + kMaxChunks;
constexpr std::size_t kWords = kDone + kMaxChunks;
// Point to point moves in pieces of chunk_bytes / kPieces, piece j of every operation of a
// group in chunk j (so both ends of a pair cut and order alike): at most kPieces sends and
// kPieces receives per group.
constexpr std::size_t kPieces = 8;
// Calls whose description is kept (captured ones live as long as their graphs).
constexpr std::size_t kMaxCalls = std::size_t{1} << 20;

// Waits with a bounded cost to the CPU: a short spin, then sleeps.
class Backoff {
 public:
  void pause() {
    if (++spins_ < 2000) return;
    std::this_thread::sleep_for(std::chrono::microseconds(spins_ < 20000 ? 20 : 100));
  }

 private:
  int spins_ = 0;
};

}  // namespace

// One chunk's copy between device memory and the chunk's staging slot: `rows` rows of `width`
// bytes, `dev_pitch` apart in device memory and `width` apart in the slot.
struct StagedComm::Copy {
  bool to_slot = true;  // device -> slot (before), else slot -> device (after)
  bool out = false;     // the slot's out region, else its in region
  std::size_t offset = 0;
  std::byte* dev = nullptr;
  std::size_t dev_pitch = 0;
  std::size_t width = 0;
  std::size_t rows = 1;
};

struct StagedComm::P2p {
  bool is_send;
  std::byte* buf;
  std::size_t bytes;
  int peer;
};

// What the progress thread runs for one chunk, on its slot.
struct StagedComm::Work {
  CollOp op = CollOp::kAllReduce;
  bool p2p = false;
  DataType type = DataType::kU8;
  RedOp red = RedOp::kSum;
  int root = 0;
  std::size_t count = 0;  // elements (all-gather: per rank; reduce-scatter: per rank received)
  struct Piece {
    bool is_send;
    int peer;
    std::size_t offset;  // in the in region (send) or the out region (recv)
    std::size_t bytes;
  };
  std::vector<Piece> pieces;
};

struct StagedComm::Chunk {
  std::vector<Copy> before, after;
  Work work;
};

struct StagedComm::Call {
  std::vector<Work> chunks;
  bool eager = true;
};

std::atomic<std::uint32_t>* StagedComm::word(std::size_t i) const {
  return reinterpret_cast<std::atomic<std::uint32_t>*>(words_.host) + i;
}
std::uintptr_t StagedComm::word_device(std::size_t i) const {
  return words_.device + i * sizeof(std::uint32_t);
}
std::byte* StagedComm::slot_in(std::size_t k) const {
  return staging_.host + (k % static_cast<std::size_t>(options_.window)) * 2 * options_.chunk_bytes;
}
std::byte* StagedComm::slot_out(std::size_t k) const {
  return slot_in(k) + options_.chunk_bytes;
}

Result<std::unique_ptr<StagedComm>> StagedComm::create(Communicator& host,
                                                       std::shared_ptr<StagingDevice> device,
                                                       Options options) {
  if (!device) return Status(ErrorCode::kInvalidArgument, "staged: no device");
  if (options.window < 1 || options.window > 64)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("staged: a window of {} chunks (1 to 64)", options.window));
  if (options.chunk_bytes < 4096 || options.chunk_bytes > (std::size_t{1} << 30))
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("staged: chunks of {} bytes (4 KiB to 1 GiB)", options.chunk_bytes));
  options.chunk_bytes = options.chunk_bytes / 4096 * 4096;
  std::unique_ptr<StagedComm> c(new StagedComm());
  c->rank_ = host.rank();
  c->size_ = host.size();
  c->options_ = options;
  c->device_ = std::move(device);
  // Every rank cuts its calls alike only with the same options: compare them first.
  {
    ByteWriter w;
    w.u64(options.chunk_bytes).u32(static_cast<std::uint32_t>(options.window));
    R2CCL_ASSIGN_OR_RETURN(auto all,
                           host.fabric().bootstrap().allgather(w.bytes(), host.config().timeout));
    for (std::size_t r = 0; r < all.size(); ++r)
      if (all[r] != w.bytes())
        return Status(ErrorCode::kInvalidArgument,
                      fmt::format("staged: rank {} has other chunk options than rank {} "
                                  "(R2CCL_GPU_STAGING_CHUNK and _WINDOW must be the same on every "
                                  "rank)",
                                  r, c->rank_));
  }
  R2CCL_ASSIGN_OR_RETURN(c->comm_, host.split(0, host.rank()));
  if (!c->comm_) return Status(ErrorCode::kInternal, "staged: the split made no communicator");
  const std::size_t staging = static_cast<std::size_t>(options.window) * 2 * options.chunk_bytes;
  R2CCL_ASSIGN_OR_RETURN(c->staging_, c->device_->map(staging));
  auto words = c->device_->map(kWords * sizeof(std::uint32_t));
  if (!words) {
    c->device_->unmap(c->staging_);
    c->staging_ = {};
    return words.status().with_context("staged: the words");
  }
  c->words_ = *words;
  // Registered once: the thread's collectives on the slots then never register.
  if (auto reg = c->comm_->register_buffer(c->staging_.host, c->staging_.bytes); !reg)
    return reg.status().with_context("staged: registering the staging slots");
  c->thread_ = std::thread([p = c.get()] { p->progress(); });
  return c;
}

StagedComm::~StagedComm() {
  if (thread_.joinable()) {
    stop_ = true;
    if (comm_) comm_->abort();
    thread_.join();
  }
  if (words_.host != nullptr) {
    // A stream that still waits on a word goes on; whatever it copies out is all-ones.
    if (staging_.host != nullptr) std::memset(staging_.host, 0xFF, staging_.bytes);
    word(kAbandon)->store(1, std::memory_order_release);
  }
  // The memory stays where a stream may still run this communicator's calls (a graph replayed
  // after the communicator ended): a device reading freed memory is worse than a leak.
  if (!closed_) return;
  comm_.reset();
  if (staging_.host != nullptr) device_->unmap(staging_);
  if (words_.host != nullptr) device_->unmap(words_);
}

Status StagedComm::error() const {
  if (!failed_) return Status::ok();
  std::lock_guard lock(failure_mutex_);
  return failure_;
}

void StagedComm::fail(const Status& why) {
  {
    std::lock_guard lock(failure_mutex_);
    if (failed_) return;
    failure_ = why;
    failed_ = true;
  }
  R2CCL_ERROR("staged: rank {}: {}; later calls are refused and results are all-ones", rank_,
              why.to_string());
}

void StagedComm::abort(const std::string& why) {
  fail(Status(ErrorCode::kAborted, why));
  if (comm_) comm_->abort();
}

Status StagedComm::usable(const char* what) const {
  if (closed_)
    return {ErrorCode::kInvalidArgument, fmt::format("{}: the communicator is closed", what)};
  if (Status e = error(); !e) return e.with_context(what);
  return Status::ok();
}

Status StagedComm::close() {
  if (closed_) return Status::ok();
  Status st = error();
  // The calls handed to the thread finish first: the last one's doorbell is taken and its
  // chunks answered when the registry holds no eager call.
  const auto deadline = std::chrono::steady_clock::now() + comm_->config().timeout;
  for (Backoff b; st && std::chrono::steady_clock::now() < deadline; b.pause()) {
    std::lock_guard lock(registry_->mutex);
    bool eager = false;
    for (const auto& [id, call] : registry_->calls)
      eager = eager || call->eager;
    if (!eager && word(kDoorbell)->load() == 0 && !busy_.load()) break;
  }
  if (st) st = comm_->barrier().with_context("staged: close");
  stop_ = true;
  if (!st) comm_->abort();
  thread_.join();
  closed_ = st.is_ok();
  return st;
}

// --- the progress thread -------------------------------------------------------------------

void StagedComm::progress() {
  while (!stop_) {
    const std::uint32_t id = word(kDoorbell)->load(std::memory_order_acquire);
    if (id == 0) {
      for (Backoff b; !stop_ && word(kDoorbell)->load(std::memory_order_acquire) == 0;)
        b.pause();
      continue;
    }
    busy_ = true;
    word(kDoorbell)->store(0, std::memory_order_release);
    std::shared_ptr<const Call> call;
    {
      std::lock_guard lock(registry_->mutex);
      const auto it = registry_->calls.find(id);
      if (it != registry_->calls.end()) {
        call = it->second;
        if (call->eager) registry_->calls.erase(it);
      }
    }
    if (!call) {
      fail(Status(ErrorCode::kInternal,
                  fmt::format("staged: the stream rang for call {}, which is not known", id)));
      busy_ = false;
      continue;
    }
    for (std::size_t k = 0; k < call->chunks.size() && !stop_; ++k) {
      for (Backoff b; !stop_ && word(kReady + k)->load(std::memory_order_acquire) != 1;)
        b.pause();
      if (stop_) break;
      word(kReady + k)->store(0, std::memory_order_relaxed);
      Status st = error();
      if (st) st = run_work(call->chunks[k], k);
      if (!st) {
        fail(st);
        std::memset(slot_in(k), 0xFF, 2 * options_.chunk_bytes);
      }
      word(kDone + k)->store(1, std::memory_order_release);
    }
    calls_run_.fetch_add(1);
    busy_ = false;
  }
}

Status StagedComm::run_work(const Work& w, std::size_t k) {
  std::byte* in = slot_in(k);
  std::byte* out = slot_out(k);
  if (w.p2p) {
    R2CCL_RETURN_IF_ERROR(comm_->group_start());
    Status st = Status::ok();
    for (const auto& p : w.pieces) {
      st = p.is_send ? comm_->send(in + p.offset, p.bytes, DataType::kU8, p.peer)
                     : comm_->recv(out + p.offset, p.bytes, DataType::kU8, p.peer);
      if (!st) break;
    }
    const Status ended = comm_->group_end();
    return st ? ended : st;
  }
  switch (w.op) {
    case CollOp::kAllReduce:
      return comm_->all_reduce(in, in, w.count, w.type, w.red);
    case CollOp::kAllGather:
      return comm_->all_gather(in, out, w.count, w.type);
    case CollOp::kReduceScatter:
      return comm_->reduce_scatter(in, out, w.count, w.type, w.red);
    case CollOp::kBroadcast:
      return comm_->broadcast(in, in, w.count, w.type, w.root);
    case CollOp::kReduce:
      return comm_->reduce(in, out, w.count, w.type, w.red, w.root);
    case CollOp::kBarrier:
      return comm_->barrier();
  }
  return Status(ErrorCode::kInternal, "staged: an unknown operation");
}

// --- enqueueing ------------------------------------------------------------------------------

Status StagedComm::enqueue(const char* what, void* stream, std::vector<Chunk> chunks) {
  std::lock_guard lock(call_mutex_);
  R2CCL_RETURN_IF_ERROR(usable(what));
  R2CCL_RETURN_IF_ERROR(device_->begin(stream).with_context(what));
  Status st = Status::ok();
  for (std::size_t first = 0; st && first < chunks.size(); first += kMaxChunks)
    st = submit(what, stream, chunks, first, std::min(kMaxChunks, chunks.size() - first));
  const Status ended = device_->end(stream).with_context(what);
  if (!st) fail(st);  // the stream may hold part of a call: nothing later can be trusted
  return st ? ended : st;
}

Status StagedComm::submit(const char* what, void* stream, std::vector<Chunk>& chunks,
                          std::size_t first, std::size_t n) {
  R2CCL_ASSIGN_OR_RETURN(const bool captured, device_->capturing(stream));
  auto call = std::make_shared<Call>();
  call->eager = !captured;
  call->chunks.reserve(n);
  for (std::size_t k = 0; k < n; ++k)
    call->chunks.push_back(std::move(chunks[first + k].work));
  std::uint32_t id = 0;
  {
    std::lock_guard lock(registry_->mutex);
    if (registry_->calls.size() >= kMaxCalls)
      return Status(ErrorCode::kNoResource,
                    fmt::format("{}: {} calls captured in graphs that still exist (destroy some)",
                                what, registry_->calls.size()));
    do {
      id = registry_->next++;
      if (registry_->next == 0) registry_->next = 1;
    } while (id == 0 || registry_->calls.count(id) != 0);
    registry_->calls.emplace(id, std::move(call));
  }
  if (captured) {
    std::weak_ptr<Registry> reg = registry_;
    R2CCL_RETURN_IF_ERROR(device_->on_graph_destroyed(stream, [reg, id] {
      if (auto r = reg.lock()) {
        std::lock_guard lock(r->mutex);
        r->calls.erase(id);
      }
    }));
  }
  const std::uintptr_t abandon = word_device(kAbandon);
  const auto copy = [&](const Copy& c, std::size_t k) -> Status {
    std::byte* slot = (c.out ? slot_out(k) : slot_in(k)) + c.offset;
    const auto dev_slot = static_cast<std::uintptr_t>(slot - staging_.host) + staging_.device;
    auto* s = reinterpret_cast<std::byte*>(dev_slot);
    if (c.rows == 1)
      return c.to_slot ? device_->copy(stream, s, c.dev, c.width)
                       : device_->copy(stream, c.dev, s, c.width);
    return c.to_slot ? device_->copy_2d(stream, s, c.width, c.dev, c.dev_pitch, c.width, c.rows)
                     : device_->copy_2d(stream, c.dev, c.dev_pitch, s, c.width, c.width, c.rows);
  };
  const auto drain = [&](std::size_t k) -> Status {
    R2CCL_RETURN_IF_ERROR(device_->wait_word(stream, word_device(kDone + k), 1, abandon));
    R2CCL_RETURN_IF_ERROR(device_->write_word(stream, word_device(kDone + k), 0));
    for (const Copy& c : chunks[first + k].after)
      R2CCL_RETURN_IF_ERROR(copy(c, k));
    return Status::ok();
  };
  const auto w = static_cast<std::size_t>(options_.window);
  R2CCL_RETURN_IF_ERROR(device_->write_word(stream, word_device(kDoorbell), id));
  for (std::size_t k = 0; k < n; ++k) {
    if (k >= w) R2CCL_RETURN_IF_ERROR(drain(k - w));
    for (const Copy& c : chunks[first + k].before)
      R2CCL_RETURN_IF_ERROR(copy(c, k));
    R2CCL_RETURN_IF_ERROR(device_->write_word(stream, word_device(kReady + k), 1));
  }
  for (std::size_t k = n > w ? n - w : 0; k < n; ++k)
    R2CCL_RETURN_IF_ERROR(drain(k));
  return Status::ok();
}

// --- the operations --------------------------------------------------------------------------

namespace {

Status check_common(const char* what, std::size_t count, DataType type) {
  R2CCL_RETURN_IF_ERROR(check_type(type).with_context(what));
  if (count > (std::size_t{1} << 40))
    return {ErrorCode::kInvalidArgument, fmt::format("{}: a count of {}", what, count)};
  return Status::ok();
}

std::byte* bytes_of(const void* p) {
  return const_cast<std::byte*>(static_cast<const std::byte*>(p));
}

}  // namespace

Status StagedComm::all_reduce(const void* send, void* recv, std::size_t count, DataType type,
                              RedOp op, void* stream) {
  const char* what = "all-reduce";
  R2CCL_RETURN_IF_ERROR(check_common(what, count, type));
  R2CCL_RETURN_IF_ERROR(check_type_and_op(type, op).with_context(what));
  if (count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(recv, what, "receive"));
  const std::size_t e = type_size(type), per = options_.chunk_bytes / e;
  std::vector<Chunk> chunks;
  for (std::size_t at = 0; at < count; at += per) {
    const std::size_t c = std::min(per, count - at);
    Chunk ch;
    ch.work.op = CollOp::kAllReduce;
    ch.work.type = type;
    ch.work.red = op;
    ch.work.count = c;
    ch.before.push_back(Copy{true, false, 0, bytes_of(send) + at * e, 0, c * e, 1});
    ch.after.push_back(Copy{false, false, 0, bytes_of(recv) + at * e, 0, c * e, 1});
    chunks.push_back(std::move(ch));
  }
  return enqueue(what, stream, std::move(chunks));
}

Status StagedComm::all_gather(const void* send, void* recv, std::size_t count, DataType type,
                              void* stream) {
  const char* what = "all-gather";
  R2CCL_RETURN_IF_ERROR(check_common(what, count, type));
  if (count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(recv, what, "receive"));
  const auto p = static_cast<std::size_t>(size_);
  const std::size_t e = type_size(type), per = options_.chunk_bytes / (e * p);
  if (per == 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: {} ranks do not fit a staging chunk of {} bytes", what, size_,
                        options_.chunk_bytes)};
  std::vector<Chunk> chunks;
  for (std::size_t at = 0; at < count; at += per) {
    const std::size_t c = std::min(per, count - at);
    Chunk ch;
    ch.work.op = CollOp::kAllGather;
    ch.work.type = type;
    ch.work.count = c;
    ch.before.push_back(Copy{true, false, 0, bytes_of(send) + at * e, 0, c * e, 1});
    ch.after.push_back(Copy{false, true, 0, bytes_of(recv) + at * e, count * e, c * e, p});
    chunks.push_back(std::move(ch));
  }
  return enqueue(what, stream, std::move(chunks));
}

Status StagedComm::reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                  DataType type, RedOp op, void* stream) {
  const char* what = "reduce-scatter";
  R2CCL_RETURN_IF_ERROR(check_common(what, recv_count, type));
  R2CCL_RETURN_IF_ERROR(check_type_and_op(type, op).with_context(what));
  if (recv_count == 0) return Status::ok();
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(recv, what, "receive"));
  const auto p = static_cast<std::size_t>(size_);
  const std::size_t e = type_size(type), per = options_.chunk_bytes / (e * p);
  if (per == 0)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: {} ranks do not fit a staging chunk of {} bytes", what, size_,
                        options_.chunk_bytes)};
  std::vector<Chunk> chunks;
  for (std::size_t at = 0; at < recv_count; at += per) {
    const std::size_t c = std::min(per, recv_count - at);
    Chunk ch;
    ch.work.op = CollOp::kReduceScatter;
    ch.work.type = type;
    ch.work.red = op;
    ch.work.count = c;
    ch.before.push_back(Copy{true, false, 0, bytes_of(send) + at * e, recv_count * e, c * e, p});
    ch.after.push_back(Copy{false, true, 0, bytes_of(recv) + at * e, 0, c * e, 1});
    chunks.push_back(std::move(ch));
  }
  return enqueue(what, stream, std::move(chunks));
}

Status StagedComm::broadcast(const void* send, void* recv, std::size_t count, DataType type,
                             int root, void* stream) {
  const char* what = "broadcast";
  R2CCL_RETURN_IF_ERROR(check_common(what, count, type));
  if (root < 0 || root >= size_)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: root {} is not a rank (0 to {})", what, root, size_ - 1)};
  if (count == 0) return Status::ok();
  const bool is_root = root == rank_;
  if (is_root) R2CCL_RETURN_IF_ERROR(device_->check_buffer(send, what, "send"));
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(recv, what, "receive"));
  const std::size_t e = type_size(type), per = options_.chunk_bytes / e;
  std::vector<Chunk> chunks;
  for (std::size_t at = 0; at < count; at += per) {
    const std::size_t c = std::min(per, count - at);
    Chunk ch;
    ch.work.op = CollOp::kBroadcast;
    ch.work.type = type;
    ch.work.root = root;
    ch.work.count = c;
    if (is_root) ch.before.push_back(Copy{true, false, 0, bytes_of(send) + at * e, 0, c * e, 1});
    if (!is_root || send != recv)
      ch.after.push_back(Copy{false, false, 0, bytes_of(recv) + at * e, 0, c * e, 1});
    chunks.push_back(std::move(ch));
  }
  return enqueue(what, stream, std::move(chunks));
}

Status StagedComm::reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op,
                          int root, void* stream) {
  const char* what = "reduce";
  R2CCL_RETURN_IF_ERROR(check_common(what, count, type));
  R2CCL_RETURN_IF_ERROR(check_type_and_op(type, op).with_context(what));
  if (root < 0 || root >= size_)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: root {} is not a rank (0 to {})", what, root, size_ - 1)};
  if (count == 0) return Status::ok();
  const bool is_root = root == rank_;
  R2CCL_RETURN_IF_ERROR(device_->check_buffer(send, what, "send"));
  if (is_root) R2CCL_RETURN_IF_ERROR(device_->check_buffer(recv, what, "receive"));
  const std::size_t e = type_size(type), per = options_.chunk_bytes / e;
  std::vector<Chunk> chunks;
  for (std::size_t at = 0; at < count; at += per) {
    const std::size_t c = std::min(per, count - at);
    Chunk ch;
    ch.work.op = CollOp::kReduce;
    ch.work.type = type;
    ch.work.red = op;
    ch.work.root = root;
    ch.work.count = c;
    ch.before.push_back(Copy{true, false, 0, bytes_of(send) + at * e, 0, c * e, 1});
    if (is_root) ch.after.push_back(Copy{false, true, 0, bytes_of(recv) + at * e, 0, c * e, 1});
    chunks.push_back(std::move(ch));
  }
  return enqueue(what, stream, std::move(chunks));
}

// --- point to point --------------------------------------------------------------------------

Status StagedComm::group_start() {
  std::lock_guard lock(call_mutex_);
  ++group_depth_;
  return Status::ok();
}

Status StagedComm::group_end() {
  std::vector<P2p> ops;
  void* stream = nullptr;
  {
    std::lock_guard lock(call_mutex_);
    if (group_depth_ == 0) return {ErrorCode::kInvalidArgument, "group end: no group was started"};
    if (--group_depth_ > 0) return Status::ok();
    ops.swap(group_);
    stream = std::exchange(group_stream_, nullptr);
  }
  if (ops.empty()) return Status::ok();
  const char* what = "send/receive group";
  std::size_t sends = 0, recvs = 0;
  for (const auto& o : ops)
    ++(o.is_send ? sends : recvs);
  if (sends > kPieces || recvs > kPieces)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: {} sends and {} receives in one group; the staged path takes at most "
                        "{} of each",
                        what, sends, recvs, kPieces)};
  const std::size_t piece = options_.chunk_bytes / kPieces;
  std::size_t chunks_needed = 0;
  for (const auto& o : ops)
    chunks_needed = std::max(chunks_needed, (o.bytes + piece - 1) / piece);
  std::vector<Chunk> chunks(chunks_needed);
  for (std::size_t k = 0; k < chunks_needed; ++k) {
    Chunk& ch = chunks[k];
    ch.work.p2p = true;
    std::size_t in_at = 0, out_at = 0;
    for (const auto& o : ops) {
      const std::size_t at = k * piece;
      if (at >= o.bytes) continue;
      const std::size_t n = std::min(piece, o.bytes - at);
      std::size_t& off = o.is_send ? in_at : out_at;
      ch.work.pieces.push_back({o.is_send, o.peer, off, n});
      if (o.is_send)
        ch.before.push_back(Copy{true, false, off, o.buf + at, 0, n, 1});
      else
        ch.after.push_back(Copy{false, true, off, o.buf + at, 0, n, 1});
      off += piece;
    }
  }
  return enqueue(what, stream, std::move(chunks));
}

void StagedComm::post_p2p(bool is_send, const void* buf, std::size_t count, DataType type, int peer,
                          void* stream, const char* what, Status& result) {
  result = check_common(what, count, type);
  if (result && (peer < 0 || peer >= size_ || peer == rank_))
    result = {ErrorCode::kInvalidArgument,
              fmt::format("{}: peer {} is not another rank (0 to {}, this is {})", what, peer,
                          size_ - 1, rank_)};
  if (result && count > 0) result = device_->check_buffer(buf, what, "message");
  if (!result || count == 0) return;
  std::lock_guard lock(call_mutex_);
  if (group_depth_ > 0 && group_stream_ != nullptr && group_stream_ != stream) {
    result = {
        ErrorCode::kInvalidArgument,
        fmt::format("{}: one group's calls on two streams (the staged path takes one)", what)};
    return;
  }
  group_stream_ = stream;
  group_.push_back(P2p{is_send, bytes_of(buf), count * type_size(type), peer});
}

Status StagedComm::send(const void* buf, std::size_t count, DataType type, int peer, void* stream) {
  R2CCL_RETURN_IF_ERROR(usable("send"));
  const bool alone = group_depth_ == 0;
  if (alone) R2CCL_RETURN_IF_ERROR(group_start());
  Status st = Status::ok();
  post_p2p(true, buf, count, type, peer, stream, "send", st);
  const Status ended = alone ? group_end() : Status::ok();
  return st ? ended : st;
}

Status StagedComm::recv(void* buf, std::size_t count, DataType type, int peer, void* stream) {
  R2CCL_RETURN_IF_ERROR(usable("receive"));
  const bool alone = group_depth_ == 0;
  if (alone) R2CCL_RETURN_IF_ERROR(group_start());
  Status st = Status::ok();
  post_p2p(false, buf, count, type, peer, stream, "receive", st);
  const Status ended = alone ? group_end() : Status::ok();
  return st ? ended : st;
}

}  // namespace r2ccl::coll

#include "plugin.h"

#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/random.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/telemetry.h"
#include "r2ccl/runtime/wire.h"
#ifdef R2CCL_WITH_METRICS
#include "r2ccl/monitor/job_metrics.h"
#endif

namespace r2ccl::ncclnet {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The handle NCCL carries from the listener to the connector (NCCL_NET_HANDLE_MAXSIZE bytes):
// magic, version, the endpoint handle's length, the listen comm's id, the endpoint's compact
// handle (rail addresses, incarnation, token), and at the end the connector's own stage word
// (zero from the listener; the id of this process's connection attempt once connect started).
constexpr std::uint32_t kHandleMagic = 0x504e3252;  // "R2NP"
constexpr std::uint8_t kHandleVersion = 1;
constexpr std::size_t kHandleFixed = 4 + 1 + 1 + 4;
constexpr std::size_t kStageOffset = NCCL_NET_HANDLE_MAXSIZE - 8;
constexpr std::size_t kMaxEndpointHandle = kStageOffset - kHandleFixed;

// Sends this small travel inside the finish message (no write, no clear-to-send wait for the
// write); larger ones are written into the receiver's registered buffer.
constexpr std::size_t kInlineMax = 16 * 1024;
constexpr std::size_t kMaxPendingAccepts = 1024;
constexpr std::size_t kMaxClearToSend = 2 * kMaxRequests;  // more from a peer is a protocol error
constexpr std::size_t kMaxConnectQueue = 256;
constexpr auto kHealthInterval = milliseconds(200);

enum class Msg : std::uint8_t { kConnect = 1, kClearToSend = 2, kFinished = 3, kRefused = 4 };

std::atomic<ncclDebugLogger_t> g_logger{nullptr};

void nccl_log_sink(LogLevel level, std::string_view message) {
  const ncclDebugLogger_t logger = g_logger.load();
  if (logger == nullptr) return;
  const ncclDebugLogLevel l = level <= LogLevel::kWarn   ? NCCL_LOG_WARN
                              : level == LogLevel::kInfo ? NCCL_LOG_INFO
                                                         : NCCL_LOG_TRACE;
  const std::string text(message);
  logger(l, NCCL_NET, "r2ccl", 0, "NET/r2ccl: %s", text.c_str());
}

// Logs `why` as a WARN (log_write reaches NCCL's logger once init set the sink) and returns
// NCCL's code.
ncclResult_t fail(ncclResult_t code, const std::string& why) {
  log_write(LogLevel::kWarn, why);
  return code;
}

ncclResult_t code_of(const Status& s) {
  switch (s.code()) {
    case ErrorCode::kOk:
      return ncclSuccess;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kConfig:
      return ncclInvalidArgument;
    case ErrorCode::kTimeout:
    case ErrorCode::kClosed:
    case ErrorCode::kProtocol:
    case ErrorCode::kRemoteRefused:
    case ErrorCode::kAborted:
    case ErrorCode::kUnavailable:
      return ncclRemoteError;
    case ErrorCode::kNetwork:
    case ErrorCode::kBootstrap:
    case ErrorCode::kNoResource:
      return ncclSystemError;
    case ErrorCode::kNotFound:
    case ErrorCode::kInternal:
      return ncclInternalError;
  }
  return ncclInternalError;
}

ncclResult_t fail(const Status& s, std::string_view context) {
  return fail(code_of(s), fmt::format("{}: {}", context, s.message()));
}

std::uint64_t random_u64() {
  std::uint64_t v = 0;
  while (v == 0) {
    if (::getrandom(&v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) v = 0;
  }
  return v;
}

// NCCL_SOCKET_IFNAME's syntax: a comma list of name prefixes; '=' first: exact names; '^'
// first: every interface except those. Loopback only when named.
std::vector<std::string> match_ifnames(const std::string& spec) {
  std::string list = spec;
  bool exclude = false, exact = false;
  if (!list.empty() && list[0] == '^') exclude = true, list.erase(0, 1);
  if (!list.empty() && list[0] == '=') exact = true, list.erase(0, 1);
  std::vector<std::string> patterns;
  for (std::size_t pos = 0; pos <= list.size();) {
    auto comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    if (comma > pos) patterns.push_back(list.substr(pos, comma - pos));
    pos = comma + 1;
  }
  auto matches = [&](const std::string& name) {
    for (const auto& p : patterns)
      if (exact ? name == p : name.rfind(p, 0) == 0) return true;
    return false;
  };
  std::vector<std::string> out;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return out;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const std::string name = i->ifa_name;
    const bool loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    const bool take = exclude ? !matches(name) && !loopback : matches(name);
    if (take && std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  ::freeifaddrs(ifs);
  return out;
}

int link_speed_mbps(const RailNic& nic) {
  const std::string dev = nic.netdev.empty() ? nic.name : nic.netdev;
  std::ifstream f("/sys/class/net/" + dev + "/speed");
  long v = 0;
  if (f >> v && v > 0 && v < 10'000'000) return static_cast<int>(v);
  return 10'000;  // virtual NICs report none
}

struct ClearToSend {
  std::uint64_t seq = 0;
  int n = 0;
  struct Element {
    int tag = 0;
    std::uint64_t size = 0;
    bool has_region = false;
    RemoteRegion region;
    std::uint64_t offset = 0;
    bool taken = false;
  };
  std::array<Element, kMaxRecvs> elements;
};

struct Comm;

struct Request {
  Comm* comm = nullptr;
  bool used = false;
  bool send = false;
  // A send: the write (large sends), then the finish message (sent once the write completed).
  OpPtr op;
  Bytes finish;
  bool finish_sent = false;
  std::size_t size = 0;
  // A receive (its fields under the comm's mutex: the progress thread lands finish messages).
  std::uint64_t seq = 0;
  int n = 0;
  std::array<std::byte*, kMaxRecvs> data{};
  std::array<std::size_t, kMaxRecvs> posted{};
  std::array<std::size_t, kMaxRecvs> got{};
  std::array<bool, kMaxRecvs> landed{};
  int finished = 0;
};

struct Comm {
  enum class Kind { kSend, kRecv } kind;
  std::uint64_t id = 0;
  int peer = -1;
  std::string peer_label;
  std::uint64_t remote_id = 0;  // the receive comm's id (a send comm, from its clear-to-sends)
  std::mutex mutex;
  Status failed;                          // under mutex
  std::deque<ClearToSend> clear_to_send;  // a send comm's, under mutex
  std::uint64_t next_seq = 0;             // a receive comm's (NCCL's thread)
  std::array<Request, kMaxRequests> requests;
  // Health (NCCL's thread): when the last look at the rails was, since when none was usable.
  Clock::time_point last_health{};
  std::optional<Clock::time_point> no_rail_since;
};

struct Listen {
  std::uint32_t id = 0;
  std::mutex mutex;
  std::deque<std::pair<int, std::uint64_t>> pending;  // (peer, its send comm id), under mutex
};

struct MemHandle {
  RegionPtr region;
};

// A connect under way on the connector thread.
struct Attempt {
  Bytes endpoint_handle;
  std::uint32_t listen_id = 0;
  bool finished = false;
  Result<int> peer = Status(ErrorCode::kInternal, "not connected yet");
};

class State {
 public:
  ~State() { shut_down(); }

  ncclResult_t init(ncclDebugLogger_t logger, void** ctx);
  ncclResult_t finalize(void* ctx);
  ncclResult_t properties(int dev, DeviceProperties* props);
  ncclResult_t check_open(const char* what, int dev, void* handle, void** out);
  ncclResult_t listen(int dev, void* handle, void** out);
  ncclResult_t connect(int dev, void* handle, void** out);
  ncclResult_t accept(void* listen_comm, void** out);
  ncclResult_t reg_mr(void* comm, void* data, std::size_t size, int type, void** out);
  ncclResult_t dereg_mr(void* comm, void* mhandle);
  ncclResult_t isend(void* comm, void* data, std::size_t size, int tag, void* mhandle,
                     void** request);
  ncclResult_t irecv(void* comm, int n, void** data, const std::size_t* sizes, const int* tags,
                     void** mhandles, void** request);
  ncclResult_t test(void* request, int* done, int* sizes);
  ncclResult_t close_comm(void* comm, Comm::Kind kind);
  ncclResult_t close_listen(void* listen_comm);
  Endpoint* endpoint() { return endpoint_.get(); }

 private:
  std::shared_ptr<Comm> find_comm(const void* p, Comm::Kind kind);
  std::shared_ptr<Comm> route(std::uint64_t id, int peer, Comm::Kind kind);
  void on_message(int peer, Bytes payload);
  void on_peer_event(const Endpoint::PeerEvent& e);
  void connector_loop();
  Status health(Comm& c);
  Status refused_by_comm(Comm& c);
  void shut_down();

  std::mutex mutex_;  // everything below; never held while calling into the endpoint
  std::unique_ptr<Endpoint> endpoint_;
  Config config_;
  int contexts_ = 0;
  std::string device_name_;
  std::string pci_path_;
  int speed_mbps_ = 0;
  std::uint64_t next_id_ = 1;
  std::unordered_map<const void*, std::shared_ptr<Comm>> comms_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Comm>> comm_ids_;
  std::unordered_map<const void*, std::shared_ptr<Listen>> listens_;
  std::unordered_map<std::uint32_t, std::shared_ptr<Listen>> listen_ids_;
  std::unordered_map<const void*, std::unique_ptr<MemHandle>> mrs_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Attempt>> attempts_;
  std::deque<std::uint64_t> connect_queue_;
  std::condition_variable connect_cv_;
  bool stopping_ = false;
  std::thread connector_;
  std::unique_ptr<int> context_token_ = std::make_unique<int>(0);
  LogLimiter drop_limiter_;
#ifdef R2CCL_WITH_METRICS
  std::unique_ptr<mon::JobMetrics> metrics_;  // before endpoint_ in destruction: declared after
#endif
};

State& state() {
  static State s;
  return s;
}

// ---------------------------------------------------------------------------------------------

ncclResult_t State::init(ncclDebugLogger_t logger, void** ctx) {
  if (logger != nullptr) {
    g_logger.store(logger);
    set_log_sink(&nccl_log_sink);
  }
  std::unique_lock lock(mutex_);
  if (endpoint_) {
    ++contexts_;
    if (ctx != nullptr) *ctx = context_token_.get();
    return ncclSuccess;
  }
  lock.unlock();
  // R2CCL_* as everywhere; NCCL_SOCKET_IFNAME chooses the rails when R2CCL_NICS does not.
  const EnvLookup env = process_env();
  auto config = parse_config([&](const std::string& name) -> std::optional<std::string> {
    auto v = env(name);
    if (v || name != "R2CCL_NICS") return v;
    auto nccl = env("NCCL_SOCKET_IFNAME");
    if (!nccl || nccl->empty()) return std::nullopt;
    const auto names = match_ifnames(*nccl);
    if (names.empty()) return *nccl;  // the error then names the value
    return fmt::format("{}", fmt::join(names, ","));
  });
  if (!config) return fail(config.status(), "r2ccl net plugin: configuration");
  EndpointOptions options;
  auto made = Endpoint::create(*config, options);
  if (!made) return fail(made.status(), "r2ccl net plugin: no endpoint");
  std::unique_ptr<Endpoint> ep = std::move(*made);
  ep->set_message_handler(0, [this](int peer, Bytes payload) { on_message(peer, payload); });
  ep->add_peer_listener([this](const Endpoint::PeerEvent& e) { on_peer_event(e); });
  std::vector<std::string> names;
  int speed = 0;
  std::string pci;
  for (const auto& nic : ep->nics()) {
    names.push_back(nic.name);
    speed += link_speed_mbps(nic);
    if (pci.empty() && !nic.pci_bus_id.empty() && !nic.netdev.empty()) {
      char resolved[PATH_MAX];
      const std::string dev = "/sys/class/net/" + nic.netdev + "/device";
      if (::realpath(dev.c_str(), resolved) != nullptr) pci = resolved;
    }
  }
  lock.lock();
  if (endpoint_) {  // another thread's init won
    ++contexts_;
    if (ctx != nullptr) *ctx = context_token_.get();
    return ncclSuccess;
  }
  config_ = *config;
  device_name_ = fmt::format("r2ccl[{}]", fmt::join(names, "+"));
  pci_path_ = pci;
  speed_mbps_ = speed;
  endpoint_ = std::move(ep);
#ifdef R2CCL_WITH_METRICS
  // One plugin per GPU process: LOCAL_RANK (torchrun's) spreads them over consecutive ports.
  {
    const auto local = env("LOCAL_RANK");
    const auto rank = env("RANK");
    const int offset = local ? std::atoi(local->c_str()) : 0;
    metrics_ = mon::JobMetrics::start(config_, *endpoint_, std::clamp(offset, 0, 4096),
                                      rank ? *rank : endpoint_->name());
  }
#else
  if (config_.metrics_port)
    R2CCL_WARN("R2CCL_METRICS_PORT is set, but this plugin was built without metrics");
#endif
  stopping_ = false;
  connector_ = std::thread([this] { connector_loop(); });
  ++contexts_;
  if (ctx != nullptr) *ctx = context_token_.get();
  R2CCL_INFO("net plugin: endpoint {} over {} rails ({}), {} Mbit/s", endpoint_->name(),
             names.size(), fmt::join(names, ", "), speed);
  return ncclSuccess;
}

ncclResult_t State::finalize(void* ctx) {
  std::lock_guard lock(mutex_);
  if (ctx != context_token_.get() || contexts_ == 0)
    return fail(ncclInvalidArgument, "r2ccl finalize: not a context of this plugin");
  --contexts_;
  return ncclSuccess;
}

void State::shut_down() {
  std::unique_lock lock(mutex_);
  stopping_ = true;
  connect_cv_.notify_all();
  lock.unlock();
  if (connector_.joinable()) connector_.join();
  set_log_sink(nullptr);
  g_logger.store(nullptr);
#ifdef R2CCL_WITH_METRICS
  metrics_.reset();
#endif
  endpoint_.reset();
}

ncclResult_t State::properties(int dev, DeviceProperties* props) {
  std::lock_guard lock(mutex_);
  if (!endpoint_)
    return fail(ncclInvalidUsage, "r2ccl getProperties: the plugin is not initialised");
  if (dev != 0 || props == nullptr)
    return fail(ncclInvalidArgument,
                fmt::format("r2ccl getProperties: no device {} (one: 0)", dev));
  props->name = device_name_.c_str();
  props->pci_path = pci_path_.empty() ? nullptr : pci_path_.c_str();
  props->guid = endpoint_->incarnation();
  props->ptr_support = NCCL_PTR_HOST;
  props->speed_mbps = speed_mbps_;
  props->max_comms = 65536;
  props->max_recvs = kMaxRecvs;
  props->max_bytes = std::size_t{1} << 40;
  return ncclSuccess;
}

// The checks listen and connect share: the handle and out pointers, the device, init done.
ncclResult_t State::check_open(const char* what, int dev, void* handle, void** out) {
  if (out == nullptr || handle == nullptr)
    return fail(ncclInvalidArgument, fmt::format("r2ccl {}: handle or comm is NULL", what));
  *out = nullptr;
  if (dev != 0)
    return fail(ncclInvalidArgument, fmt::format("r2ccl {}: no device {} (one: 0)", what, dev));
  if (endpoint() == nullptr)
    return fail(ncclInvalidUsage, fmt::format("r2ccl {}: the plugin is not initialised", what));
  return ncclSuccess;
}

ncclResult_t State::listen(int dev, void* handle, void** out) {
  if (const ncclResult_t r = check_open("listen", dev, handle, out); r != ncclSuccess) return r;
  Endpoint* ep = endpoint();
  auto h = ep->handle();
  if (!h) return fail(h.status(), "r2ccl listen");
  if (h->size() > kMaxEndpointHandle)
    return fail(ncclInvalidArgument,
                fmt::format("r2ccl listen: this endpoint's handle takes {} bytes, NCCL's handle "
                            "leaves {} (use at most {} rails)",
                            h->size(), kMaxEndpointHandle, (kMaxEndpointHandle - 31) / 8));
  auto l = std::make_shared<Listen>();
  {
    std::lock_guard lock(mutex_);
    do
      l->id = static_cast<std::uint32_t>(random_u64());
    while (l->id == 0 || listen_ids_.contains(l->id));
    listen_ids_[l->id] = l;
    listens_[l.get()] = l;
  }
  ByteWriter w(NCCL_NET_HANDLE_MAXSIZE);
  w.u32(kHandleMagic).u8(kHandleVersion).u8(static_cast<std::uint8_t>(h->size())).u32(l->id);
  w.raw(h->data(), h->size());
  Bytes bytes = w.take();
  std::memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  std::memcpy(handle, bytes.data(), bytes.size());
  *out = l.get();
  return ncclSuccess;
}

ncclResult_t State::connect(int dev, void* handle, void** out) {
  if (const ncclResult_t r = check_open("connect", dev, handle, out); r != ncclSuccess) return r;
  Endpoint* ep = endpoint();
  auto* bytes = static_cast<std::byte*>(handle);
  ByteReader r(std::span<const std::byte>(bytes, kStageOffset));
  const auto magic = r.u32();
  const auto version = r.u8();
  const auto length = r.u8();
  const auto listen_id = r.u32();
  if (magic != kHandleMagic)
    return fail(ncclInvalidArgument,
                "r2ccl connect: the handle is not an r2ccl net plugin handle (wrong magic "
                "number): was the peer's NCCL_NET_PLUGIN the same?");
  if (version != kHandleVersion)
    return fail(ncclInvalidArgument,
                fmt::format("r2ccl connect: handle of version {} (this plugin reads {})", version,
                            kHandleVersion));
  if (length == 0 || length > kMaxEndpointHandle)
    return fail(ncclInvalidArgument,
                fmt::format("r2ccl connect: the handle's endpoint part is {} bytes (1 to {}): the "
                            "handle is truncated or corrupt",
                            length, kMaxEndpointHandle));
  Bytes endpoint_handle(bytes + kHandleFixed, bytes + kHandleFixed + length);
  if (auto info = EndpointInfo::decode(endpoint_handle); !info)
    return fail(info.status(), "r2ccl connect: bad handle");
  std::uint64_t stage = 0;
  std::memcpy(&stage, bytes + kStageOffset, sizeof stage);

  std::unique_lock lock(mutex_);
  if (stage == 0) {
    if (connect_queue_.size() >= kMaxConnectQueue)
      return fail(ncclSystemError, fmt::format("r2ccl connect: {} connections are being opened "
                                               "already (at most {})",
                                               connect_queue_.size(), kMaxConnectQueue));
    auto a = std::make_shared<Attempt>();
    a->endpoint_handle = std::move(endpoint_handle);
    a->listen_id = listen_id;
    do
      stage = random_u64();
    while (attempts_.contains(stage));
    attempts_[stage] = a;
    connect_queue_.push_back(stage);
    connect_cv_.notify_one();
    std::memcpy(bytes + kStageOffset, &stage, sizeof stage);
    return ncclSuccess;
  }
  auto it = attempts_.find(stage);
  if (it == attempts_.end())
    return fail(ncclInvalidArgument,
                "r2ccl connect: the handle names a connection attempt this process never made "
                "(its last 8 bytes must be zero when it comes from listen)");
  std::shared_ptr<Attempt> a = it->second;
  if (!a->finished) return ncclSuccess;
  attempts_.erase(it);
  std::memset(bytes + kStageOffset, 0, sizeof stage);
  if (!a->peer) return fail(a->peer.status(), "r2ccl connect");
  auto c = std::make_shared<Comm>();
  c->kind = Comm::Kind::kSend;
  c->id = next_id_++;
  c->peer = *a->peer;
  for (auto& req : c->requests)
    req.comm = c.get();
  lock.unlock();
  c->peer_label = ep->peer_label(c->peer).value_or(fmt::format("peer {}", c->peer));
  ByteWriter w(16);
  w.u8(static_cast<std::uint8_t>(Msg::kConnect)).u32(a->listen_id).u64(c->id);
  lock.lock();
  comms_[c.get()] = c;
  comm_ids_[c->id] = c;
  lock.unlock();
  if (Status st = ep->send_message(c->peer, 0, w.take()); !st) {
    lock.lock();
    comms_.erase(c.get());
    comm_ids_.erase(c->id);
    return fail(st, "r2ccl connect");
  }
  *out = c.get();
  return ncclSuccess;
}

void State::connector_loop() {
  while (true) {
    std::unique_lock lock(mutex_);
    connect_cv_.wait(lock, [&] { return stopping_ || !connect_queue_.empty(); });
    if (stopping_) return;
    const std::uint64_t id = connect_queue_.front();
    connect_queue_.pop_front();
    auto it = attempts_.find(id);
    if (it == attempts_.end()) continue;
    std::shared_ptr<Attempt> a = it->second;
    Endpoint* ep = endpoint_.get();
    lock.unlock();
    Result<int> peer = ep->connect(a->endpoint_handle);
    lock.lock();
    a->peer = std::move(peer);
    a->finished = true;
  }
}

ncclResult_t State::accept(void* listen_comm, void** out) {
  if (out == nullptr) return fail(ncclInvalidArgument, "r2ccl accept: recvComm is NULL");
  *out = nullptr;
  std::shared_ptr<Listen> l;
  {
    std::lock_guard lock(mutex_);
    auto it = listens_.find(listen_comm);
    if (it == listens_.end())
      return fail(ncclInvalidArgument, "r2ccl accept: not a listen comm of this plugin");
    l = it->second;
  }
  std::pair<int, std::uint64_t> next;
  {
    std::lock_guard lock(l->mutex);
    if (l->pending.empty()) return ncclSuccess;
    next = l->pending.front();
    l->pending.pop_front();
  }
  Endpoint* ep = endpoint();
  auto c = std::make_shared<Comm>();
  c->kind = Comm::Kind::kRecv;
  c->peer = next.first;
  c->remote_id = next.second;
  c->peer_label = ep->peer_label(c->peer).value_or(fmt::format("peer {}", c->peer));
  for (auto& req : c->requests)
    req.comm = c.get();
  {
    std::lock_guard lock(mutex_);
    c->id = next_id_++;
    comms_[c.get()] = c;
    comm_ids_[c->id] = c;
  }
  *out = c.get();
  return ncclSuccess;
}

std::shared_ptr<Comm> State::find_comm(const void* p, Comm::Kind kind) {
  std::lock_guard lock(mutex_);
  auto it = comms_.find(p);
  if (it == comms_.end() || it->second->kind != kind) return nullptr;
  return it->second;
}

std::shared_ptr<Comm> State::route(std::uint64_t id, int peer, Comm::Kind kind) {
  std::lock_guard lock(mutex_);
  auto it = comm_ids_.find(id);
  if (it == comm_ids_.end() || it->second->peer != peer || it->second->kind != kind) return nullptr;
  return it->second;
}

ncclResult_t State::reg_mr(void* comm, void* data, std::size_t size, int type, void** out) {
  if (out == nullptr) return fail(ncclInvalidArgument, "r2ccl regMr: mhandle is NULL");
  *out = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (!comms_.contains(comm))
      return fail(ncclInvalidArgument, "r2ccl regMr: not a send or receive comm of this plugin");
  }
  if (type != NCCL_PTR_HOST)
    return fail(ncclInvalidArgument,
                fmt::format("r2ccl regMr: memory of type {} (this plugin takes host memory "
                            "only, NCCL_PTR_HOST = 1: NCCL stages GPU data through host buffers)",
                            type));
  Endpoint* ep = endpoint();
  auto region = ep->register_memory(data, size, MemoryAccess::kRemoteWrite);
  if (!region) return fail(region.status(), "r2ccl regMr");
  auto mh = std::make_unique<MemHandle>();
  mh->region = std::move(*region);
  *out = mh.get();
  std::lock_guard lock(mutex_);
  mrs_[mh.get()] = std::move(mh);
  return ncclSuccess;
}

ncclResult_t State::dereg_mr(void* comm, void* mhandle) {
  std::unique_ptr<MemHandle> mh;
  {
    std::lock_guard lock(mutex_);
    if (!comms_.contains(comm))
      return fail(ncclInvalidArgument, "r2ccl deregMr: not a send or receive comm of this plugin");
    auto it = mrs_.find(mhandle);
    if (it == mrs_.end())
      return fail(ncclInvalidArgument, "r2ccl deregMr: not a memory handle of this plugin");
    mh = std::move(it->second);
    mrs_.erase(it);
  }
  if (Status st = endpoint()->deregister_memory(mh->region); !st) return fail(st, "r2ccl deregMr");
  return ncclSuccess;
}

// Where the rails to the peer stand: an error once none was usable for R2CCL_TIMEOUT, naming the
// peer and every rail; looked at most every kHealthInterval (NCCL's thread).
Status State::health(Comm& c) {
  {
    std::lock_guard lock(c.mutex);
    if (!c.failed) return c.failed;
  }
  const auto now = Clock::now();
  if (now - c.last_health < kHealthInterval) return Status::ok();
  c.last_health = now;
  Endpoint* ep = endpoint();
  const auto rails = ep->rail_snapshot();
  std::vector<std::string> seen;
  bool usable = false;
  for (const auto& r : rails) {
    if (r.peer != c.peer) continue;
    usable |= r.state == RailState::kUp || r.state == RailState::kDegraded ||
              r.state == RailState::kSuspect;
    seen.push_back(fmt::format("{}->{} {}", r.nic, r.remote_nic, rail_state_name(r.state)));
  }
  if (usable) {
    c.no_rail_since.reset();
    return Status::ok();
  }
  if (!c.no_rail_since) c.no_rail_since = now;
  if (now - *c.no_rail_since < config_.timeout) return Status::ok();
  Status st(ErrorCode::kUnavailable,
            fmt::format(
                "no rail to {} has worked for {} ms (R2CCL_TIMEOUT): {}", c.peer_label,
                std::chrono::duration_cast<milliseconds>(now - *c.no_rail_since).count(),
                seen.empty() ? std::string("no rails") : fmt::format("{}", fmt::join(seen, ", "))));
  std::lock_guard lock(c.mutex);
  if (c.failed) c.failed = st;
  return c.failed;
}

ncclResult_t State::isend(void* comm, void* data, std::size_t size, int tag, void* mhandle,
                          void** request) {
  if (request == nullptr) return fail(ncclInvalidArgument, "r2ccl isend: request is NULL");
  *request = nullptr;
  auto c = find_comm(comm, Comm::Kind::kSend);
  if (!c) return fail(ncclInvalidArgument, "r2ccl isend: not a send comm of this plugin");
  if (Status st = health(*c); !st) return fail(st, "r2ccl isend");
  Request* req = nullptr;
  ClearToSend::Element element;
  std::uint64_t seq = 0;
  int index = -1;
  {
    std::lock_guard lock(c->mutex);
    if (c->clear_to_send.empty()) return ncclSuccess;  // the receiver has not posted yet
    for (auto& r : c->requests)
      if (!r.used) {
        req = &r;
        break;
      }
    if (req == nullptr) return ncclSuccess;  // NCCL_NET_MAX_REQUESTS outstanding
    ClearToSend& cts = c->clear_to_send.front();
    for (int i = 0; i < cts.n; ++i)
      if (!cts.elements[static_cast<std::size_t>(i)].taken &&
          cts.elements[static_cast<std::size_t>(i)].tag == tag) {
        index = i;
        break;
      }
    if (index < 0)
      return fail(ncclInvalidUsage,
                  fmt::format("r2ccl isend to {}: tag {} matches no element of the receive it "
                              "pairs with (receive {} of {} elements)",
                              c->peer_label, tag, cts.seq, cts.n));
    auto& e = cts.elements[static_cast<std::size_t>(index)];
    if (size > e.size)
      return fail(ncclInvalidUsage,
                  fmt::format("r2ccl isend to {}: {} bytes, but the receive posted {} (tag {})",
                              c->peer_label, size, e.size, tag));
    e.taken = true;
    element = e;
    seq = cts.seq;
    if (std::all_of(cts.elements.begin(), cts.elements.begin() + cts.n,
                    [](const auto& x) { return x.taken; }))
      c->clear_to_send.pop_front();
    req->used = true;
    req->send = true;
    req->size = size;
    req->finish_sent = false;
    req->op.reset();
  }
  const bool inline_data = size <= kInlineMax || !element.has_region;
  ByteWriter w(32 + (inline_data ? size : 0));
  w.u8(static_cast<std::uint8_t>(Msg::kFinished)).u64(c->remote_id).u64(seq);
  w.u8(static_cast<std::uint8_t>(index)).u64(size).u8(inline_data ? 1 : 0);
  Status st;
  if (inline_data) {
    if (size > kInlineMax)
      st = Status(ErrorCode::kInvalidArgument,
                  fmt::format("{} bytes to a receive buffer that was not registered", size));
    else if (size > 0)
      w.raw(data, size);
  } else {
    const MemHandle* mh = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto f = mrs_.find(mhandle);
      if (f != mrs_.end()) mh = f->second.get();
    }
    const std::byte* base = mh ? mh->region->base : nullptr;
    const auto* p = static_cast<const std::byte*>(data);
    if (mh == nullptr)
      st = Status(ErrorCode::kInvalidArgument,
                  "the send buffer has no memory handle of this plugin");
    else if (p < base || static_cast<std::size_t>(p - base) + size > mh->region->length)
      st = Status(ErrorCode::kInvalidArgument, "the send buffer lies outside its memory handle");
    else {
      auto op = endpoint()->iwrite(c->peer, mh->region, static_cast<std::size_t>(p - base),
                                   element.region, element.offset, size);
      if (op)
        req->op = std::move(*op);
      else
        st = op.status();
    }
  }
  if (!st) {
    std::lock_guard lock(c->mutex);
    req->used = false;
    return fail(st, fmt::format("r2ccl isend to {}", c->peer_label));
  }
  req->finish = w.take();
  *request = req;
  return ncclSuccess;
}

ncclResult_t State::irecv(void* comm, int n, void** data, const std::size_t* sizes, const int* tags,
                          void** mhandles, void** request) {
  if (request == nullptr) return fail(ncclInvalidArgument, "r2ccl irecv: request is NULL");
  *request = nullptr;
  auto c = find_comm(comm, Comm::Kind::kRecv);
  if (!c) return fail(ncclInvalidArgument, "r2ccl irecv: not a receive comm of this plugin");
  if (n < 1 || n > kMaxRecvs || data == nullptr || sizes == nullptr || tags == nullptr)
    return fail(ncclInvalidArgument,
                fmt::format("r2ccl irecv: {} buffers (1 to {}), or a NULL array", n, kMaxRecvs));
  if (Status st = health(*c); !st) return fail(st, "r2ccl irecv");
  ByteWriter w(64 + static_cast<std::size_t>(n) * 64);
  w.u8(static_cast<std::uint8_t>(Msg::kClearToSend)).u64(c->remote_id).u64(c->id);
  const std::uint64_t seq = c->next_seq;
  w.u64(seq).u8(static_cast<std::uint8_t>(n));
  {
    std::lock_guard lock(mutex_);
    for (int i = 0; i < n; ++i) {
      w.u32(static_cast<std::uint32_t>(tags[i])).u64(sizes[i]);
      const MemHandle* mh = nullptr;
      if (mhandles != nullptr) {
        auto f = mrs_.find(mhandles[i]);
        if (f != mrs_.end()) mh = f->second.get();
      }
      const auto* p = static_cast<const std::byte*>(data[i]);
      if (mh != nullptr && p >= mh->region->base &&
          static_cast<std::size_t>(p - mh->region->base) + sizes[i] <= mh->region->length) {
        const Region& r = *mh->region;
        w.u8(1);
        RemoteRegion{r.id, r.length, r.keys}.encode(w);
        w.u64(static_cast<std::uint64_t>(p - r.base));
      } else if (sizes[i] > kInlineMax) {
        return fail(ncclInvalidArgument,
                    fmt::format("r2ccl irecv: buffer {} ({} bytes) lies outside the memory "
                                "handle given with it",
                                i, sizes[i]));
      } else {
        w.u8(0);
      }
    }
  }
  Request* req = nullptr;
  {
    std::lock_guard lock(c->mutex);
    for (auto& r : c->requests)
      if (!r.used) {
        req = &r;
        break;
      }
    if (req == nullptr) return ncclSuccess;
    req->used = true;
    req->send = false;
    req->seq = seq;
    req->n = n;
    req->finished = 0;
    for (int i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      req->data[k] = static_cast<std::byte*>(data[i]);
      req->posted[k] = sizes[i];
      req->got[k] = 0;
      req->landed[k] = false;
    }
  }
  Status st = endpoint()->send_message(c->peer, 0, w.take());
  if (!st) {
    std::lock_guard lock(c->mutex);
    req->used = false;
    if (st.code() == ErrorCode::kNoResource) return ncclSuccess;  // NCCL tries again
    return fail(st, fmt::format("r2ccl irecv from {}", c->peer_label));
  }
  ++c->next_seq;
  *request = req;
  return ncclSuccess;
}

ncclResult_t State::test(void* request, int* done, int* sizes) {
  if (request == nullptr || done == nullptr)
    return fail(ncclInvalidArgument, "r2ccl test: request or done is NULL");
  *done = 0;
  auto* req = static_cast<Request*>(request);
  Comm& c = *req->comm;
  if (req->send) {
    if (req->op) {
      if (!req->op->done()) {
        if (Status st = health(c); !st) return fail(st, "r2ccl test (send)");
        return ncclSuccess;
      }
      if (Status st = req->op->status(); !st) {
        std::lock_guard lock(c.mutex);
        req->used = false;
        return fail(st, fmt::format("r2ccl send to {}", c.peer_label));
      }
    }
    if (!req->finish_sent) {
      Status st = endpoint()->send_message(c.peer, 0, req->finish);
      if (st.code() == ErrorCode::kNoResource) return ncclSuccess;
      if (!st) {
        std::lock_guard lock(c.mutex);
        req->used = false;
        return fail(st, fmt::format("r2ccl send to {}", c.peer_label));
      }
      req->finish_sent = true;
    }
    *done = 1;
    if (sizes != nullptr) sizes[0] = static_cast<int>(req->size);
    std::lock_guard lock(c.mutex);
    req->op.reset();
    req->finish.clear();
    req->used = false;
    return ncclSuccess;
  }
  {
    std::lock_guard lock(c.mutex);
    if (req->finished == req->n) {
      *done = 1;
      if (sizes != nullptr)
        for (int i = 0; i < req->n; ++i)
          sizes[i] = static_cast<int>(req->got[static_cast<std::size_t>(i)]);
      req->used = false;
      return ncclSuccess;
    }
  }
  if (Status st = health(c); !st) {
    std::lock_guard lock(c.mutex);
    req->used = false;
    return fail(st, fmt::format("r2ccl receive from {}", c.peer_label));
  }
  return ncclSuccess;
}

// The progress thread: messages from peers. Every field is checked before use; a message that
// names no comm of that peer is dropped.
void State::on_message(int peer, Bytes payload) {
  ByteReader r(payload);
  const auto type = static_cast<Msg>(r.u8());
  auto drop = [&](std::string why) {
    log_limited(drop_limiter_, LogLevel::kWarn,
                fmt::format("net plugin: dropped a message from peer {}: {}", peer, why));
  };
  if (type == Msg::kConnect) {
    const auto listen_id = r.u32();
    const auto send_id = r.u64();
    if (!r.finish("connect").is_ok()) return drop("malformed connect");
    std::shared_ptr<Listen> l;
    {
      std::lock_guard lock(mutex_);
      auto it = listen_ids_.find(listen_id);
      if (it != listen_ids_.end()) l = it->second;
    }
    std::string refused;
    if (!l) {
      refused = fmt::format("no listen comm {} here (closed?)", listen_id);
    } else {
      std::lock_guard lock(l->mutex);
      if (l->pending.size() >= kMaxPendingAccepts)
        refused = fmt::format("{} connections wait to be accepted already", l->pending.size());
      else
        l->pending.emplace_back(peer, send_id);
    }
    if (!refused.empty()) {
      ByteWriter w(64);
      w.u8(static_cast<std::uint8_t>(Msg::kRefused)).u64(send_id).str(refused);
      (void)endpoint()->send_message(peer, 0, w.take());
    }
    return;
  }
  if (type == Msg::kRefused) {
    const auto send_id = r.u64();
    const std::string why = r.str(256);
    if (!r.finish("refusal").is_ok()) return drop("malformed refusal");
    if (auto c = route(send_id, peer, Comm::Kind::kSend)) {
      std::lock_guard lock(c->mutex);
      if (c->failed)
        c->failed = Status(ErrorCode::kRemoteRefused,
                           fmt::format("{} refused the connection: {}", c->peer_label, why));
    }
    return;
  }
  if (type == Msg::kClearToSend) {
    const auto send_id = r.u64();
    const auto recv_id = r.u64();
    ClearToSend cts;
    cts.seq = r.u64();
    cts.n = r.u8();
    if (!r.ok() || cts.n < 1 || cts.n > kMaxRecvs) return drop("malformed clear-to-send");
    for (int i = 0; i < cts.n && r.ok(); ++i) {
      auto& e = cts.elements[static_cast<std::size_t>(i)];
      e.tag = static_cast<int>(r.u32());
      e.size = r.u64();
      e.has_region = r.u8() != 0;
      if (e.has_region) {
        e.region = RemoteRegion::decode(r);
        e.offset = r.u64();
        if (r.ok() && (e.offset > e.region.length || e.size > e.region.length - e.offset))
          return drop("a clear-to-send names bytes outside its region");
      }
      // Without a region only inline sends can reach it: larger ones fail at the sender.
    }
    if (!r.finish("clear-to-send").is_ok()) return drop("malformed clear-to-send");
    auto c = route(send_id, peer, Comm::Kind::kSend);
    if (!c) return drop(fmt::format("clear-to-send for send comm {} (unknown)", send_id));
    std::lock_guard lock(c->mutex);
    if (c->remote_id != 0 && c->remote_id != recv_id)
      return drop("clear-to-send from a second receive comm");
    c->remote_id = recv_id;
    if (c->clear_to_send.size() >= kMaxClearToSend) {
      if (c->failed)
        c->failed = Status(
            ErrorCode::kProtocol,
            fmt::format("{} posted more than {} receives at once", c->peer_label, kMaxClearToSend));
      return;
    }
    c->clear_to_send.push_back(cts);
    return;
  }
  if (type == Msg::kFinished) {
    const auto recv_id = r.u64();
    const auto seq = r.u64();
    const auto index = r.u8();
    const auto size = r.u64();
    const bool inline_data = r.u8() != 0;
    if (!r.ok()) return drop("malformed finish");
    if (inline_data && (size > kInlineMax || r.remaining() != size))
      return drop("a finish whose inline data does not match its size");
    if (!inline_data && r.remaining() != 0) return drop("malformed finish");
    auto c = route(recv_id, peer, Comm::Kind::kRecv);
    if (!c) return drop(fmt::format("finish for receive comm {} (unknown)", recv_id));
    std::lock_guard lock(c->mutex);
    for (auto& req : c->requests) {
      if (!req.used || req.send || req.seq != seq) continue;
      if (index >= req.n || req.landed[index] || size > req.posted[index])
        return drop(fmt::format("finish of element {} of receive {} ({} bytes) does not fit it",
                                index, seq, size));
      if (inline_data && size > 0) {
        std::span<const std::byte> rest(payload.data() + (payload.size() - size), size);
        std::memcpy(req.data[index], rest.data(), size);
      }
      req.got[index] = size;
      req.landed[index] = true;
      ++req.finished;
      return;
    }
    return drop(fmt::format("finish of receive {} that is not posted", seq));
  }
  drop(fmt::format("unknown type {}", static_cast<int>(type)));
}

void State::on_peer_event(const Endpoint::PeerEvent& e) {
  if (e.kind != Endpoint::PeerEvent::Kind::kLeft) return;
  std::vector<std::shared_ptr<Comm>> hit;
  std::vector<std::shared_ptr<Listen>> listens;
  {
    std::lock_guard lock(mutex_);
    for (auto& [p, c] : comms_)
      if (c->peer == e.peer) hit.push_back(c);
    for (auto& [p, l] : listens_)
      listens.push_back(l);
  }
  for (auto& c : hit) {
    std::lock_guard lock(c->mutex);
    if (c->failed)
      c->failed = Status(ErrorCode::kClosed, fmt::format("{} left: {}", e.label, e.why));
  }
  for (auto& l : listens) {
    std::lock_guard lock(l->mutex);
    std::erase_if(l->pending, [&](const auto& x) { return x.first == e.peer; });
  }
}

ncclResult_t State::close_comm(void* comm, Comm::Kind kind) {
  std::shared_ptr<Comm> c;
  {
    std::lock_guard lock(mutex_);
    auto it = comms_.find(comm);
    if (it == comms_.end() || it->second->kind != kind)
      return fail(ncclInvalidArgument, "r2ccl close: not a comm of this plugin");
    c = it->second;
    comms_.erase(it);
    comm_ids_.erase(c->id);
  }
  // Writes still in flight finish into memory NCCL may free after this: wait for them, bounded
  // by their deadlines (the endpoint fails them there).
  for (auto& req : c->requests)
    if (req.used && req.op) (void)endpoint()->wait(req.op);
  return ncclSuccess;
}

ncclResult_t State::close_listen(void* listen_comm) {
  std::lock_guard lock(mutex_);
  auto it = listens_.find(listen_comm);
  if (it == listens_.end())
    return fail(ncclInvalidArgument, "r2ccl closeListen: not a listen comm of this plugin");
  listen_ids_.erase(it->second->id);
  listens_.erase(it);
  return ncclSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The entry points: no exception leaves them.

template <typename F>
ncclResult_t guarded(const char* what, F&& f) noexcept {
  try {
    return f();
  } catch (const std::exception& e) {
    return fail(ncclInternalError, fmt::format("r2ccl {}: {}", what, e.what()));
  } catch (...) {
    return fail(ncclInternalError, fmt::format("r2ccl {}: unknown exception", what));
  }
}

ncclResult_t init(ncclDebugLogger_t logger, void** ctx) {
  return guarded("init", [&] { return state().init(logger, ctx); });
}
ncclResult_t finalize(void* ctx) {
  return guarded("finalize", [&] { return state().finalize(ctx); });
}
ncclResult_t devices(int* ndev) {
  if (ndev == nullptr) return fail(ncclInvalidArgument, "r2ccl devices: ndev is NULL");
  *ndev = state().endpoint() != nullptr ? 1 : 0;
  return ncclSuccess;
}
ncclResult_t properties(int dev, DeviceProperties* props) {
  return guarded("getProperties", [&] { return state().properties(dev, props); });
}
ncclResult_t listen(int dev, void* handle, void** listen_comm) {
  return guarded("listen", [&] { return state().listen(dev, handle, listen_comm); });
}
ncclResult_t connect(int dev, void* handle, void** send_comm) {
  return guarded("connect", [&] { return state().connect(dev, handle, send_comm); });
}
ncclResult_t accept(void* listen_comm, void** recv_comm) {
  return guarded("accept", [&] { return state().accept(listen_comm, recv_comm); });
}
ncclResult_t reg_mr(void* comm, void* data, std::size_t size, int type, void** mhandle) {
  return guarded("regMr", [&] { return state().reg_mr(comm, data, size, type, mhandle); });
}
ncclResult_t reg_mr_dmabuf(void* comm, void* data, std::size_t size, int type, std::uint64_t,
                           int fd, void** mhandle) {
  if (fd >= 0 || type != NCCL_PTR_HOST) {
    if (mhandle != nullptr) *mhandle = nullptr;
    return fail(ncclInvalidArgument,
                "r2ccl regMrDmaBuf: DMA-BUF memory is not supported (this plugin reports "
                "NCCL_PTR_HOST only)");
  }
  return reg_mr(comm, data, size, type, mhandle);
}
ncclResult_t dereg_mr(void* comm, void* mhandle) {
  return guarded("deregMr", [&] { return state().dereg_mr(comm, mhandle); });
}
ncclResult_t isend(void* send_comm, void* data, std::size_t size, int tag, void* mhandle,
                   void** request) {
  return guarded("isend",
                 [&] { return state().isend(send_comm, data, size, tag, mhandle, request); });
}
ncclResult_t irecv(void* recv_comm, int n, void** data, const std::size_t* sizes, const int* tags,
                   void** mhandles, void** request) {
  return guarded("irecv",
                 [&] { return state().irecv(recv_comm, n, data, sizes, tags, mhandles, request); });
}
ncclResult_t iflush(void*, int, void**, const int*, void**, void** request) {
  // Host memory only: what a receive completed is in memory the CPU wrote, nothing to flush.
  if (request != nullptr) *request = nullptr;
  return ncclSuccess;
}
ncclResult_t test(void* request, int* done, int* sizes) {
  return guarded("test", [&] { return state().test(request, done, sizes); });
}
ncclResult_t close_send(void* send_comm) {
  return guarded("closeSend", [&] { return state().close_comm(send_comm, Comm::Kind::kSend); });
}
ncclResult_t close_recv(void* recv_comm) {
  return guarded("closeRecv", [&] { return state().close_comm(recv_comm, Comm::Kind::kRecv); });
}
ncclResult_t close_listen(void* listen_comm) {
  return guarded("closeListen", [&] { return state().close_listen(listen_comm); });
}

}  // namespace r2ccl::ncclnet

#include "engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <exception>
#include <set>
#include <unordered_set>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/device_memory.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/telemetry.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl::nixl {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The engine's messages (the endpoint's service 0, which the plugin owns).
enum class Msg : std::uint8_t { kNotif = 1, kReadRequest = 2, kReadDone = 3 };

// A message stays within the endpoint's 64 KiB; a read request's descriptors are cut into
// messages of at most this many bytes, the notification included.
constexpr std::size_t kMessageBudget = 60 * 1024;
constexpr std::size_t kMaxNotif = kMessageBudget - 1024;
constexpr std::size_t kMaxAgentName = 512;
constexpr std::size_t kMaxReadChunks = 1 << 16;
constexpr std::size_t kMaxReadJobs = 1 << 16;  // peers' reads in progress here
constexpr std::size_t kMaxNotifs = 1 << 20;    // notifications waiting for getNotifs
constexpr std::size_t kMaxNotifBytes = std::size_t{256} << 20;
constexpr auto kHealthInterval = milliseconds(200);

// A registration's public data: what a peer needs to address it.
constexpr std::uint32_t kPublicMagic = 0x584e3252;  // "R2NX"
constexpr std::uint8_t kPublicVersion = 1;

// This side's registration (also what loadLocalMD hands back for local transfers).
class LocalMD final : public nixlBackendMD {
 public:
  LocalMD(RegionPtr r, std::uintptr_t b) : nixlBackendMD(true), region(std::move(r)), base(b) {}
  RegionPtr region;
  std::uintptr_t base;
};

// A peer's registration, from its public data.
struct RemoteInfo {
  std::string agent;
  std::uintptr_t base = 0;
  RemoteRegion region;
};
class RemoteMD final : public nixlBackendMD {
 public:
  explicit RemoteMD(std::shared_ptr<const RemoteInfo> i)
      : nixlBackendMD(false), info(std::move(i)) {}
  std::shared_ptr<const RemoteInfo> info;
};

// Whether [addr, addr + len) lies in [base, base + length).
bool inside(std::uintptr_t addr, std::size_t len, std::uintptr_t base, std::uint64_t length) {
  return addr >= base && addr - base <= length && len <= length - (addr - base);
}

nixl_status_t status_of(const Status& s) {
  switch (s.code()) {
    case ErrorCode::kOk:
      return NIXL_SUCCESS;
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kConfig:
    case ErrorCode::kProtocol:
      return NIXL_ERR_INVALID_PARAM;
    case ErrorCode::kNotFound:
      return NIXL_ERR_NOT_FOUND;
    default:
      return NIXL_ERR_BACKEND;
  }
}

// Logs `why` as a warning and returns `code`.
nixl_status_t fail(nixl_status_t code, const std::string& why) {
  R2CCL_WARN("{}", why);
  return code;
}

// Runs `fn`, turning an exception (an allocation failed) into NIXL_ERR_BACKEND: none crosses
// into NIXL.
template <typename Fn>
nixl_status_t guarded(const char* what, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return fail(NIXL_ERR_BACKEND, fmt::format("r2ccl {}: {}", what, e.what()));
  } catch (...) {
    return fail(NIXL_ERR_BACKEND, fmt::format("r2ccl {}: unknown exception", what));
  }
}

const char* mem_name(nixl_mem_t m) {
  switch (m) {
    case DRAM_SEG:
      return "DRAM_SEG";
    case VRAM_SEG:
      return "VRAM_SEG";
    case BLK_SEG:
      return "BLK_SEG";
    case OBJ_SEG:
      return "OBJ_SEG";
    case FILE_SEG:
      return "FILE_SEG";
  }
  return "an unknown memory type";
}

// Copies n bytes between memories of this process, either of which may be a GPU's (the other
// side of a transfer within one agent): through the host in runs of at most kBounceBytes where
// both are.
Status copy_between(std::byte* dst, const DeviceMemory* dst_device, const std::byte* src,
                    const DeviceMemory* src_device, std::size_t n) {
  if (src_device == nullptr) return copy_from_host(dst_device, dst, src, n);
  if (dst_device == nullptr) return src_device->to_host(dst, src, n);
  constexpr std::size_t kBounceBytes = std::size_t{4} << 20;
  Bytes bounce(std::min(n, kBounceBytes));
  for (std::size_t done = 0; done < n; done += bounce.size()) {
    const std::size_t run = std::min(bounce.size(), n - done);
    R2CCL_RETURN_IF_ERROR(src_device->to_host(bounce.data(), src + done, run));
    R2CCL_RETURN_IF_ERROR(dst_device->to_device(dst + done, bounce.data(), run));
  }
  return Status::ok();
}

// A NIXL custom parameter's R2CCL_* name: "nics" and "R2CCL_NICS" both name R2CCL_NICS.
std::string variable_of(const std::string& key) {
  std::string upper;
  for (char c : key)
    upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return upper.rfind("R2CCL_", 0) == 0 ? upper : "R2CCL_" + upper;
}

}  // namespace

// A transfer: its descriptors (from prepXfer) and the state of its latest post.
struct Xfer {
  nixl_xfer_op_t op = NIXL_WRITE;
  std::string agent;
  bool local = false;
  struct Elem {
    std::byte* local_ptr = nullptr;  // this side's bytes
    RegionPtr region;
    std::size_t local_offset = 0;
    std::shared_ptr<const RemoteInfo> remote;     // the peer's region (remote transfers)
    std::byte* remote_ptr = nullptr;              // local transfers: the other side's bytes
    const DeviceMemory* remote_device = nullptr;  // local transfers: the other side's GPU's
    std::size_t remote_offset = 0;
    std::size_t length = 0;
  };
  std::vector<Elem> elems;
  std::uint64_t bytes = 0;

  std::mutex mu;
  std::uint64_t generation = 0;  // of the latest post
  nixl_status_t state = NIXL_ERR_NOT_POSTED;
  std::string error;
  std::size_t pending = 0;  // writes of the latest post not ended yet
  bool replayed = false;
  int peer = -1;
  std::uint64_t token = 0;  // a read's, in the latest post
  bool has_notif = false;
  std::string notif;
  Status write_error;
  Clock::time_point posted{};
  Clock::time_point last_health{};
  std::optional<Clock::time_point> no_rail_since;
};

class ReqH final : public nixlBackendReqH {
 public:
  explicit ReqH(std::shared_ptr<Xfer> x) : xfer(std::move(x)) {}
  std::shared_ptr<Xfer> xfer;
};

// A peer's read served here: its writes into the peer's memory, then "done".
struct ReadJob {
  std::uint32_t chunks = 0;
  std::uint32_t seen = 0;
  std::size_t pending = 0;
  Status failed;
  bool replayed = false;
  bool has_notif = false;
  std::string sender, notif;
};

struct Engine::Counters {
  explicit Counters(MetricRegistry& m)
      : write_ok(m.counter("r2ccl_nixl_transfers_total",
                           "NIXL transfers ended, by operation and result",
                           {{"op", "write"}, {"result", "ok"}})),
        write_failed(
            m.counter("r2ccl_nixl_transfers_total", "", {{"op", "write"}, {"result", "failed"}})),
        read_ok(m.counter("r2ccl_nixl_transfers_total", "", {{"op", "read"}, {"result", "ok"}})),
        read_failed(
            m.counter("r2ccl_nixl_transfers_total", "", {{"op", "read"}, {"result", "failed"}})),
        preserved(m.counter("r2ccl_nixl_transfers_preserved_total",
                            "NIXL transfers that completed although a rail failed under them", {})),
        bytes(m.counter("r2ccl_nixl_transfer_bytes_total", "Bytes of NIXL transfers that completed",
                        {})),
        notifs(m.counter("r2ccl_nixl_notifications_total",
                         "NIXL notifications delivered to this agent", {})),
        notifs_dropped(m.counter("r2ccl_nixl_notifications_dropped_total",
                                 "NIXL notifications dropped: too many waited for getNotifs", {})) {
  }
  MetricRegistry::Counter &write_ok, &write_failed, &read_ok, &read_failed, &preserved, &bytes,
      &notifs, &notifs_dropped;
};

// ---------------------------------------------------------------------------------------------

Engine::Engine(const nixlBackendInitParams* params) : nixlBackendEngine(params) {
  auto start = [&]() -> Status {
    // NIXL's custom parameters first ("nics" or "R2CCL_NICS"), then the environment.
    const nixl_b_params_t& custom = getCustomParams();
    std::unordered_map<std::string, std::string> given;
    std::set<std::string> known;
    for (const auto& e : config_table())
      known.insert(e.name);
    for (const auto& [k, v] : custom) {
      const std::string name = variable_of(k);
      if (!known.contains(name))
        return {ErrorCode::kConfig,
                fmt::format("unknown R2CCL backend parameter '{}' (the parameters are the "
                            "R2CCL_* settings, e.g. nics, provider, timeout)",
                            k)};
      given[name] = v;
    }
    const EnvLookup env = process_env();
    auto config = parse_config([&](const std::string& name) -> std::optional<std::string> {
      if (auto it = given.find(name); it != given.end()) return it->second;
      return env(name);
    });
    if (!config) return config.status();
    config_ = *config;
    if (config_.log_level > LogLevel::kWarn) set_log_level(config_.log_level);
    EndpointOptions options;
    options.name = localAgent;
    R2CCL_ASSIGN_OR_RETURN(endpoint_, Endpoint::create(config_, options));
    counters_ = std::make_unique<Counters>(endpoint_->metrics());
    endpoint_->set_message_handler(
        0, [this](int peer, Bytes payload) { on_message(peer, std::move(payload)); });
    listener_ =
        endpoint_->add_peer_listener([this](const Endpoint::PeerEvent& e) { on_peer_event(e); });
#ifdef R2CCL_WITH_METRICS
    const auto local_rank = env("LOCAL_RANK");
    const int offset = local_rank ? std::atoi(local_rank->c_str()) : 0;
    metrics_ = mon::JobMetrics::start(config_, *endpoint_, std::clamp(offset, 0, 4096), localAgent);
#else
    if (config_.metrics_port)
      R2CCL_WARN("R2CCL_METRICS_PORT is set, but this plugin was built without metrics");
#endif
    std::vector<std::string> nics;
    for (const auto& n : endpoint_->nics())
      nics.push_back(n.name);
    R2CCL_INFO("nixl: agent '{}' over {} rails ({})", localAgent, nics.size(),
               fmt::join(nics, ", "));
    return Status::ok();
  };
  Status st;
  try {
    st = start();
  } catch (const std::exception& e) {
    st = Status(ErrorCode::kInternal, e.what());
  }
  if (!st) {
    init_error_ = fmt::format("r2ccl NIXL backend of agent '{}': {}", localAgent, st.message());
    R2CCL_ERROR("{}", init_error_);
    initErr = true;
  }
}

Engine::~Engine() {
  if (endpoint_) {
    endpoint_->set_message_handler(0, nullptr);
    if (listener_ >= 0) endpoint_->remove_peer_listener(listener_);
  }
#ifdef R2CCL_WITH_METRICS
  metrics_.reset();
#endif
  endpoint_.reset();  // its threads end here: no callback runs after this
}

nixl_mem_list_t Engine::getSupportedMems() const {
  return {DRAM_SEG, VRAM_SEG};
}

// ---------------------------------------------------------------------------------------------
// Memory

nixl_status_t Engine::registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                                  nixlBackendMD*& out) {
  return guarded("registerMem", [&] {
    out = nullptr;
    if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG)
      return fail(
          NIXL_ERR_NOT_SUPPORTED,
          fmt::format("r2ccl registerMem: {} is not memory r2ccl moves (DRAM_SEG and VRAM_SEG)",
                      mem_name(nixl_mem)));
    if (mem.addr == 0 || mem.len == 0)
      return fail(
          NIXL_ERR_INVALID_PARAM,
          fmt::format("r2ccl registerMem: an empty region ({} bytes at {:#x})", mem.len, mem.addr));
    // GPU memory moves through its own copies (staged through the host over tcp rails); host
    // memory that CUDA knows as device memory is treated as such either way.
    const DeviceMemory* device = cuda_memory_of(reinterpret_cast<const void*>(mem.addr));
    if (nixl_mem == VRAM_SEG && device == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM,
                  fmt::format("r2ccl registerMem: the VRAM_SEG region of {} bytes at {:#x} (device "
                              "{}) is not CUDA device memory of this process (or CUDA is not "
                              "loaded here)",
                              mem.len, mem.addr, mem.devId));
    auto region = endpoint_->register_memory(reinterpret_cast<void*>(mem.addr), mem.len,
                                             MemoryAccess::kRemoteWrite, device);
    if (!region)
      return fail(status_of(region.status()),
                  fmt::format("r2ccl registerMem ({} bytes at {:#x}): {}", mem.len, mem.addr,
                              region.status().message()));
    {
      std::lock_guard lock(mu_);
      regions_[(*region)->id] = *region;
    }
    out =
        std::make_unique<LocalMD>(*region, mem.addr).release();  // NIXL owns it until deregisterMem
    return NIXL_SUCCESS;
  });
}

nixl_status_t Engine::deregisterMem(nixlBackendMD* meta) {
  return guarded("deregisterMem", [&] {
    std::unique_ptr<nixlBackendMD> owned(meta);
    auto* md = dynamic_cast<LocalMD*>(meta);
    if (md == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM, "r2ccl deregisterMem: not a registration of this engine");
    {
      std::lock_guard lock(mu_);
      regions_.erase(md->region->id);
    }
    if (Status st = endpoint_->deregister_memory(md->region); !st)
      return fail(status_of(st), fmt::format("r2ccl deregisterMem: {}", st.message()));
    return NIXL_SUCCESS;
  });
}

nixl_status_t Engine::getPublicData(const nixlBackendMD* meta, std::string& str) const {
  return guarded("getPublicData", [&] {
    const auto* md = dynamic_cast<const LocalMD*>(meta);
    if (md == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM, "r2ccl getPublicData: not a registration of this engine");
    ByteWriter w(64);
    w.u32(kPublicMagic).u8(kPublicVersion).u64(md->base);
    RemoteRegion{md->region->id, md->region->length, md->region->keys}.encode(w);
    const Bytes& b = w.bytes();
    str.assign(reinterpret_cast<const char*>(b.data()), b.size());
    return NIXL_SUCCESS;
  });
}

nixl_status_t Engine::loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem,
                                   const std::string& remote_agent, nixlBackendMD*& output) {
  return guarded("loadRemoteMD", [&] {
    output = nullptr;
    if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG)
      return fail(NIXL_ERR_NOT_SUPPORTED,
                  fmt::format("r2ccl loadRemoteMD: agent '{}' registered {}, which r2ccl does "
                              "not move",
                              remote_agent, mem_name(nixl_mem)));
    ByteReader r(std::as_bytes(std::span(input.metaInfo.data(), input.metaInfo.size())));
    const auto magic = r.u32();
    const auto version = r.u8();
    auto info = std::make_shared<RemoteInfo>();
    info->agent = remote_agent;
    info->base = r.u64();
    info->region = RemoteRegion::decode(r);
    if (Status st = r.finish("registration"); !st || magic != kPublicMagic)
      return fail(NIXL_ERR_INVALID_PARAM,
                  fmt::format("r2ccl loadRemoteMD: agent '{}' sent a registration that is not "
                              "r2ccl's ({} bytes; was its backend R2CCL too?)",
                              remote_agent, input.metaInfo.size()));
    if (version != kPublicVersion)
      return fail(NIXL_ERR_MISMATCH,
                  fmt::format("r2ccl loadRemoteMD: agent '{}' speaks registration version {}, "
                              "this side {}",
                              remote_agent, version, kPublicVersion));
    if (info->base != input.addr || info->region.length != input.len)
      return fail(
          NIXL_ERR_INVALID_PARAM,
          fmt::format("r2ccl loadRemoteMD: agent '{}' describes {} bytes at {:#x}, its "
                      "registration {} bytes at {:#x}",
                      remote_agent, input.len, input.addr, info->region.length, info->base));
    output = std::make_unique<RemoteMD>(std::move(info)).release();  // until unloadMD
    return NIXL_SUCCESS;
  });
}

// A copy of its own: NIXL unloads it after it deregistered the original when an agent ends.
nixl_status_t Engine::loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) {
  return guarded("loadLocalMD", [&] {
    output = nullptr;
    const auto* md = dynamic_cast<const LocalMD*>(input);
    if (md == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM, "r2ccl loadLocalMD: not a registration of this engine");
    output = std::make_unique<LocalMD>(md->region, md->base).release();  // until unloadMD
    return NIXL_SUCCESS;
  });
}

// What loadRemoteMD and loadLocalMD made, and nothing else, comes back here.
nixl_status_t Engine::unloadMD(nixlBackendMD* input) {
  std::unique_ptr<nixlBackendMD> owned(input);
  return NIXL_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// Peers

nixl_status_t Engine::getConnInfo(std::string& str) const {
  return guarded("getConnInfo", [&] {
    const Bytes blob = endpoint_->blob();
    str.assign(reinterpret_cast<const char*>(blob.data()), blob.size());
    return NIXL_SUCCESS;
  });
}

nixl_status_t Engine::loadRemoteConnInfo(const std::string& remote_agent,
                                         const std::string& remote_conn_info) {
  return guarded("loadRemoteConnInfo", [&] {
    const auto bytes = std::as_bytes(std::span(remote_conn_info.data(), remote_conn_info.size()));
    auto info = EndpointInfo::decode(bytes);
    if (!info)
      return fail(NIXL_ERR_INVALID_PARAM,
                  fmt::format("r2ccl loadRemoteConnInfo: agent '{}': {} (was its backend R2CCL "
                              "too?)",
                              remote_agent, info.status().message()));
    std::lock_guard lock(mu_);
    Agent& a = agents_[remote_agent];
    if (a.blob != Bytes(bytes.begin(), bytes.end())) {
      a = Agent{};  // a new process under that name: connect afresh on first use
      a.blob.assign(bytes.begin(), bytes.end());
    }
    return NIXL_SUCCESS;
  });
}

Result<int> Engine::peer_of(const std::string& agent) const {
  Bytes blob;
  {
    std::lock_guard lock(mu_);
    auto it = agents_.find(agent);
    if (it == agents_.end())
      return Status(
          ErrorCode::kNotFound,
          fmt::format("agent '{}' is unknown to the R2CCL backend (load its metadata)", agent));
    if (!it->second.left.empty())
      return Status(ErrorCode::kClosed, fmt::format("agent '{}' left: {}", agent, it->second.left));
    if (it->second.peer >= 0) return it->second.peer;
    blob = it->second.blob;
  }
  auto peer = endpoint_->connect(blob);  // bounded by R2CCL_CONNECT_TIMEOUT
  if (!peer) return peer.status().with_context(fmt::format("connecting to agent '{}'", agent));
  std::lock_guard lock(mu_);
  auto it = agents_.find(agent);
  if (it == agents_.end() || it->second.blob != blob)
    return Status(ErrorCode::kNotFound,
                  fmt::format("agent '{}' was unloaded while connecting", agent));
  it->second.peer = *peer;
  return *peer;
}

nixl_status_t Engine::connect(const std::string& remote_agent) {
  return guarded("connect", [&] {
    if (remote_agent == localAgent) return NIXL_SUCCESS;
    auto peer = peer_of(remote_agent);
    if (!peer) {
      const nixl_status_t code = peer.status().code() == ErrorCode::kClosed
                                     ? NIXL_ERR_REMOTE_DISCONNECT
                                     : status_of(peer.status());
      return fail(code, fmt::format("r2ccl connect: {}", peer.status().message()));
    }
    return NIXL_SUCCESS;
  });
}

// NIXL forgets the agent's metadata: so does the engine. The channel stays (no goodbye): the
// peer is not told that this side left, and a reload of the same agent finds it open.
nixl_status_t Engine::disconnect(const std::string& remote_agent) {
  return guarded("disconnect", [&] {
    std::lock_guard lock(mu_);
    agents_.erase(remote_agent);
    return NIXL_SUCCESS;
  });
}

void Engine::on_peer_event(const Endpoint::PeerEvent& e) {
  if (e.kind != Endpoint::PeerEvent::Kind::kLeft) return;
  std::vector<std::shared_ptr<Xfer>> reads;
  {
    std::lock_guard lock(mu_);
    for (auto& [name, a] : agents_)
      if (a.peer == e.peer && a.left.empty()) a.left = e.why.empty() ? "its process ended" : e.why;
    // Its reads served here: their writes fail now; nobody waits for their end.
    for (auto it = jobs_.begin(); it != jobs_.end();)
      it = it->first.first == e.peer ? jobs_.erase(it) : std::next(it);
    for (auto it = reads_.begin(); it != reads_.end();) {
      auto x = it->second.lock();
      if (!x) {
        it = reads_.erase(it);
        continue;
      }
      std::lock_guard xl(x->mu);
      if (x->peer == e.peer) {
        reads.push_back(x);
        it = reads_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& x : reads) {
    std::lock_guard xl(x->mu);
    finish(*x, NIXL_ERR_REMOTE_DISCONNECT,
           fmt::format("read from agent '{}': {} left ({})", x->agent, e.label, e.why));
  }
}

// ---------------------------------------------------------------------------------------------
// Transfers

nixl_status_t Engine::prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                               const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                               nixlBackendReqH*& handle, const nixl_opt_b_args_t*) const {
  return guarded("prepXfer", [&] {
    handle = nullptr;
    if (operation != NIXL_READ && operation != NIXL_WRITE)
      return fail(NIXL_ERR_INVALID_PARAM,
                  "r2ccl prepXfer: the operation is neither READ nor WRITE");
    for (const auto* list : {&local, &remote}) {
      if (list->getType() != DRAM_SEG && list->getType() != VRAM_SEG)
        return fail(
            NIXL_ERR_NOT_SUPPORTED,
            fmt::format("r2ccl prepXfer: {} is not memory r2ccl moves", mem_name(list->getType())));
    }
    if (local.descCount() != remote.descCount())
      return fail(NIXL_ERR_INVALID_PARAM,
                  fmt::format("r2ccl prepXfer: {} local descriptors but {} remote ones",
                              local.descCount(), remote.descCount()));
    auto x = std::make_shared<Xfer>();
    x->op = operation;
    x->agent = remote_agent;
    x->local = remote_agent == localAgent;
    if (!x->local) {
      std::lock_guard lock(mu_);
      if (!agents_.contains(remote_agent))
        return fail(NIXL_ERR_NOT_FOUND,
                    fmt::format("r2ccl prepXfer: agent '{}' is unknown to the R2CCL backend (load "
                                "its metadata first)",
                                remote_agent));
    }
    x->elems.reserve(static_cast<std::size_t>(local.descCount()));
    for (int i = 0; i < local.descCount(); ++i) {
      const nixlMetaDesc& l = local[static_cast<std::size_t>(i)];
      const nixlMetaDesc& r = remote[static_cast<std::size_t>(i)];
      if (l.len != r.len)
        return fail(NIXL_ERR_INVALID_PARAM,
                    fmt::format("r2ccl prepXfer: descriptor {} is {} bytes here and {} at the "
                                "remote side",
                                i, l.len, r.len));
      const auto* lmd = dynamic_cast<const LocalMD*>(l.metadataP);
      if (lmd == nullptr || !inside(l.addr, l.len, lmd->base, lmd->region->length))
        return fail(NIXL_ERR_INVALID_PARAM,
                    fmt::format("r2ccl prepXfer: local descriptor {} ({} bytes at {:#x}) is not "
                                "inside a registration of this engine",
                                i, l.len, l.addr));
      Xfer::Elem e;
      e.region = lmd->region;
      e.local_offset = l.addr - lmd->base;
      e.local_ptr = lmd->region->base + e.local_offset;
      e.length = l.len;
      if (x->local) {
        const auto* rmd = dynamic_cast<const LocalMD*>(r.metadataP);
        if (rmd == nullptr || !inside(r.addr, r.len, rmd->base, rmd->region->length))
          return fail(NIXL_ERR_INVALID_PARAM,
                      fmt::format("r2ccl prepXfer: descriptor {} of the local transfer ({} bytes "
                                  "at {:#x}) is not inside a registration of this engine",
                                  i, r.len, r.addr));
        e.remote_ptr = rmd->region->base + (r.addr - rmd->base);
        e.remote_device = rmd->region->device;
      } else {
        const auto* rmd = dynamic_cast<const RemoteMD*>(r.metadataP);
        if (rmd == nullptr || rmd->info->agent != remote_agent ||
            !inside(r.addr, r.len, rmd->info->base, rmd->info->region.length))
          return fail(NIXL_ERR_INVALID_PARAM,
                      fmt::format("r2ccl prepXfer: remote descriptor {} ({} bytes at {:#x}) is "
                                  "not inside a registration of agent '{}'",
                                  i, r.len, r.addr, remote_agent));
        e.remote = rmd->info;
        e.remote_offset = r.addr - rmd->info->base;
      }
      x->bytes += e.length;
      x->elems.push_back(std::move(e));
    }
    handle = std::make_unique<ReqH>(std::move(x)).release();  // until releaseReqH
    return NIXL_SUCCESS;
  });
}

nixl_status_t Engine::postXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t&,
                               const nixl_meta_dlist_t&, const std::string& remote_agent,
                               nixlBackendReqH*& handle, const nixl_opt_b_args_t* opt_args) const {
  return guarded("postXfer", [&] {
    auto* h = dynamic_cast<ReqH*>(handle);
    if (h == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM, "r2ccl postXfer: not a request of this engine");
    const std::shared_ptr<Xfer>& x = h->xfer;
    if (operation != x->op || remote_agent != x->agent)
      return fail(NIXL_ERR_INVALID_PARAM,
                  "r2ccl postXfer: the operation or agent differs from the prepared request's");
    const bool has_notif = opt_args != nullptr && opt_args->hasNotif;
    if (has_notif && opt_args->notifMsg.size() > kMaxNotif)
      return fail(NIXL_ERR_INVALID_PARAM,
                  fmt::format("r2ccl postXfer: a notification of {} bytes (at most {})",
                              opt_args->notifMsg.size(), kMaxNotif));
    if (x->local) return post_local(*x, opt_args);
    auto peer = peer_of(x->agent);
    if (!peer) {
      const nixl_status_t code = peer.status().code() == ErrorCode::kClosed
                                     ? NIXL_ERR_REMOTE_DISCONNECT
                                     : status_of(peer.status());
      return fail(code, fmt::format("r2ccl postXfer: {}", peer.status().message()));
    }
    {
      std::lock_guard xl(x->mu);
      if (x->state == NIXL_IN_PROG)
        return fail(NIXL_ERR_REPOST_ACTIVE, "r2ccl postXfer: the request is still in progress");
      ++x->generation;
      x->state = NIXL_IN_PROG;
      x->error.clear();
      x->write_error = Status::ok();
      x->replayed = false;
      x->peer = *peer;
      x->has_notif = has_notif;
      x->notif = has_notif ? opt_args->notifMsg : std::string();
      x->posted = Clock::now();
      x->last_health = x->posted;
      x->no_rail_since.reset();
    }
    return x->op == NIXL_WRITE ? post_write(x, *peer) : post_read(x, *peer);
  });
}

nixl_status_t Engine::post_local(Xfer& x, const nixl_opt_b_args_t* opt_args) const {
  Status copied = Status::ok();
  for (const auto& e : x.elems) {
    if (e.region->device == nullptr && e.remote_device == nullptr) {
      if (x.op == NIXL_WRITE)
        std::memmove(e.remote_ptr, e.local_ptr, e.length);
      else
        std::memmove(e.local_ptr, e.remote_ptr, e.length);
    } else if (x.op == NIXL_WRITE) {
      copied = copy_between(e.remote_ptr, e.remote_device, e.local_ptr, e.region->device, e.length);
    } else {
      copied = copy_between(e.local_ptr, e.region->device, e.remote_ptr, e.remote_device, e.length);
    }
    if (!copied) break;
  }
  if (!copied) {
    std::lock_guard xl(x.mu);
    ++x.generation;
    x.state = NIXL_IN_PROG;  // so that finish() records the failure
    finish(x, NIXL_ERR_BACKEND, fmt::format("local transfer: {}", copied.message()));
    return fail(x.state, fmt::format("r2ccl postXfer: {}", x.error));
  }
  if (opt_args != nullptr && opt_args->hasNotif) push_notif(localAgent, opt_args->notifMsg);
  std::lock_guard xl(x.mu);
  ++x.generation;
  x.state = NIXL_SUCCESS;
  (x.op == NIXL_WRITE ? counters_->write_ok : counters_->read_ok).value++;
  counters_->bytes.value += x.bytes;
  return NIXL_SUCCESS;
}

nixl_status_t Engine::post_write(const std::shared_ptr<Xfer>& x, int peer) const {
  std::uint64_t generation = 0;
  {
    std::lock_guard xl(x->mu);
    generation = x->generation;
    x->pending = x->elems.size() + 1;  // +1: held while posting
  }
  for (const auto& e : x->elems) {
    auto op = endpoint_->iwrite(peer, e.region, e.local_offset, e.remote->region, e.remote_offset,
                                e.length);
    if (!op) {
      write_done(x, generation, op.status(), false);
      continue;
    }
    OpPtr held = *op;
    held->on_complete([this, x, generation, held](const Status& st) {
      write_done(x, generation, st, held->replayed());
    });
  }
  write_done(x, generation, Status::ok(), false);  // the posting's hold
  std::lock_guard xl(x->mu);
  if (x->state == NIXL_SUCCESS) return NIXL_SUCCESS;
  if (x->state < 0) return fail(x->state, fmt::format("r2ccl postXfer: {}", x->error));
  return NIXL_IN_PROG;
}

void Engine::write_done(const std::shared_ptr<Xfer>& x, std::uint64_t generation, const Status& st,
                        bool replayed) const {
  Status error;
  std::string notif;
  bool has_notif = false;
  int peer = -1;
  {
    std::lock_guard xl(x->mu);
    if (x->generation != generation || x->pending == 0) return;
    if (replayed) x->replayed = true;
    if (!st && x->write_error) x->write_error = st;
    if (--x->pending != 0 || x->state != NIXL_IN_PROG) return;
    error = x->write_error;
    has_notif = x->has_notif;
    notif = x->notif;
    peer = x->peer;
  }
  // The last write ended: nothing of this post moves any more. (Locks: the engine's before a
  // transfer's, and neither while calling into the endpoint.)
  nixl_status_t state = NIXL_SUCCESS;
  std::string why;
  if (!error) {
    const bool gone = [&] {
      std::lock_guard lock(mu_);
      auto it = agents_.find(x->agent);
      return it != agents_.end() && !it->second.left.empty();
    }();
    state = gone ? NIXL_ERR_REMOTE_DISCONNECT : NIXL_ERR_BACKEND;
    why = fmt::format("write to agent '{}': {}", x->agent, error.message());
  } else if (has_notif) {
    // Every byte is in the peer's memory: the notification follows, after them.
    ByteWriter w(notif.size() + localAgent.size() + 16);
    w.u8(static_cast<std::uint8_t>(Msg::kNotif)).str(localAgent).str(notif);
    if (Status s = endpoint_->send_message(peer, 0, w.take()); !s) {
      state = NIXL_ERR_BACKEND;
      why = fmt::format("write to agent '{}': its notification was not sent: {}", x->agent,
                        s.message());
    }
  }
  std::lock_guard xl(x->mu);
  if (x->generation == generation) finish(*x, state, std::move(why));
}

// The read request: the descriptors in messages of at most kMessageBudget bytes, each with the
// regions of this side that its descriptors write into; the notification rides in every one
// (the peer keeps the last chunk's).
nixl_status_t Engine::post_read(const std::shared_ptr<Xfer>& x, int peer) const {
  std::uint64_t token = 0;
  std::string notif;
  bool has_notif = false;
  {
    std::lock_guard lock(mu_);
    token = next_token_++;
    reads_[token] = x;
  }
  {
    std::lock_guard xl(x->mu);
    x->token = token;
    has_notif = x->has_notif;
    notif = x->notif;
  }
  struct Chunk {
    std::vector<const RegionPtr*> regions;
    std::unordered_map<std::uint64_t, std::uint32_t> index;
    std::vector<std::size_t> elems;
  };
  std::vector<Chunk> chunks(1);
  const std::size_t fixed = 64 + localAgent.size() + (has_notif ? notif.size() : 0);
  std::size_t used = fixed;
  constexpr std::size_t kElemBytes = 8 + 8 + 8 + 4 + 8;
  for (std::size_t i = 0; i < x->elems.size(); ++i) {
    const auto& e = x->elems[i];
    const bool new_region = !chunks.back().index.contains(e.region->id);
    const std::size_t need = kElemBytes + (new_region ? 20 + 8 * e.region->keys.size() : 0);
    if (used + need > kMessageBudget && !chunks.back().elems.empty()) {
      chunks.emplace_back();
      used = fixed;
    }
    Chunk& c = chunks.back();
    if (!c.index.contains(e.region->id)) {
      c.index[e.region->id] = static_cast<std::uint32_t>(c.regions.size());
      c.regions.push_back(&e.region);
      used += 20 + 8 * e.region->keys.size();
    }
    c.elems.push_back(i);
    used += kElemBytes;
  }
  if (chunks.size() > kMaxReadChunks) {
    std::lock_guard xl(x->mu);
    finish(*x, NIXL_ERR_INVALID_PARAM,
           fmt::format("read from agent '{}': {} descriptors need {} messages (at most {})",
                       x->agent, x->elems.size(), chunks.size(), kMaxReadChunks));
    return fail(x->state, x->error);
  }
  for (std::size_t ci = 0; ci < chunks.size(); ++ci) {
    const Chunk& c = chunks[ci];
    ByteWriter w(used + 64);
    w.u8(static_cast<std::uint8_t>(Msg::kReadRequest))
        .u64(token)
        .u32(static_cast<std::uint32_t>(ci))
        .u32(static_cast<std::uint32_t>(chunks.size()))
        .u32(static_cast<std::uint32_t>(c.regions.size()));
    for (const RegionPtr* r : c.regions)
      RemoteRegion{(*r)->id, (*r)->length, (*r)->keys}.encode(w);
    w.u32(static_cast<std::uint32_t>(c.elems.size()));
    for (std::size_t i : c.elems) {
      const auto& e = x->elems[i];
      w.u64(e.remote->region.id)
          .u64(e.remote_offset)
          .u64(e.length)
          .u32(c.index.at(e.region->id))
          .u64(e.local_offset);
    }
    w.u8(has_notif ? 1 : 0).str(localAgent).str(has_notif ? notif : std::string());
    if (Status s = endpoint_->send_message(peer, 0, w.take()); !s) {
      const std::string why =
          fmt::format("read from agent '{}': request not sent: {}", x->agent, s.message());
      if (ci > 0) {
        // The chunks already sent may still be served: the request ends only when the peer
        // says so, or leaves, or no rail to it works (checkXfer).
        R2CCL_WARN("r2ccl NIXL backend of agent '{}': {}", localAgent, why);
        break;
      }
      {
        std::lock_guard lock(mu_);
        reads_.erase(token);
      }
      std::lock_guard xl(x->mu);
      finish(*x, NIXL_ERR_BACKEND, why);
      return NIXL_ERR_BACKEND;
    }
  }
  return NIXL_IN_PROG;
}

void Engine::finish(Xfer& x, nixl_status_t state, std::string error) const {
  if (x.state != NIXL_IN_PROG) return;
  x.state = state;
  x.error = std::move(error);
  const bool write = x.op == NIXL_WRITE;
  if (state == NIXL_SUCCESS) {
    (write ? counters_->write_ok : counters_->read_ok).value++;
    counters_->bytes.value += x.bytes;
    if (x.replayed) counters_->preserved.value++;
  } else {
    (write ? counters_->write_failed : counters_->read_failed).value++;
    R2CCL_WARN("r2ccl NIXL backend of agent '{}': {}", localAgent, x.error);
  }
}

Status Engine::health(Xfer& x, milliseconds limit) const {
  int peer = -1;
  const auto now = Clock::now();
  {
    std::lock_guard xl(x.mu);
    if (x.state != NIXL_IN_PROG || now - x.last_health < kHealthInterval) return Status::ok();
    x.last_health = now;
    peer = x.peer;
  }
  std::vector<std::string> seen;
  bool usable = false;
  for (const auto& r : endpoint_->rail_snapshot()) {  // no lock of this engine held
    if (r.peer != peer) continue;
    usable |= r.state == RailState::kUp || r.state == RailState::kDegraded ||
              r.state == RailState::kSuspect;
    seen.push_back(fmt::format("{}->{} {}", r.nic, r.remote_nic, rail_state_name(r.state)));
  }
  std::lock_guard xl(x.mu);
  if (usable) {
    x.no_rail_since.reset();
    return Status::ok();
  }
  if (!x.no_rail_since) x.no_rail_since = now;
  if (now - *x.no_rail_since < limit) return Status::ok();
  return {ErrorCode::kUnavailable,
          fmt::format(
              "no rail to agent '{}' has worked for {} ms: {}", x.agent,
              std::chrono::duration_cast<milliseconds>(now - *x.no_rail_since).count(),
              seen.empty() ? std::string("no rails") : fmt::format("{}", fmt::join(seen, ", ")))};
}

nixl_status_t Engine::checkXfer(nixlBackendReqH* handle) const {
  return guarded("checkXfer", [&] {
    auto* h = dynamic_cast<ReqH*>(handle);
    if (h == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM, "r2ccl checkXfer: not a request of this engine");
    Xfer& x = *h->xfer;
    {
      std::lock_guard xl(x.mu);
      if (x.state != NIXL_IN_PROG || x.op != NIXL_READ) return x.state;
    }
    // A write's own operations end by R2CCL_TIMEOUT without a rail. A read is served by the
    // peer's writes, which end by the peer's R2CCL_TIMEOUT: this side waits twice that, so that
    // nothing of it can land after the read was given up.
    Status st = health(x, 2 * config_.timeout);
    if (!st) {
      std::uint64_t token = 0;
      {
        std::lock_guard xl(x.mu);
        token = x.token;
      }
      {
        std::lock_guard lock(mu_);
        reads_.erase(token);
      }
      std::lock_guard xl(x.mu);
      if (x.token == token) finish(x, NIXL_ERR_BACKEND, fmt::format("read: {}", st.message()));
    }
    std::lock_guard xl(x.mu);
    return x.state;
  });
}

nixl_status_t Engine::releaseReqH(nixlBackendReqH* handle) const {
  return guarded("releaseReqH", [&] {
    auto* h = dynamic_cast<ReqH*>(handle);
    if (h == nullptr)
      return fail(NIXL_ERR_INVALID_PARAM, "r2ccl releaseReqH: not a request of this engine");
    {
      std::lock_guard xl(h->xfer->mu);
      // Data may still move out of or into its buffers: not released (NIXL keeps the request,
      // and the caller its buffers; it can try again).
      if (h->xfer->state == NIXL_IN_PROG) {
        R2CCL_DEBUG("nixl: request to agent '{}' not released: still in progress", h->xfer->agent);
        return NIXL_ERR_REPOST_ACTIVE;
      }
    }
    std::unique_ptr<ReqH> owned(h);
    return NIXL_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// Notifications

void Engine::push_notif(std::string agent, std::string msg) const {
  std::lock_guard lock(mu_);
  if (notifs_.size() >= kMaxNotifs || notif_bytes_ + msg.size() > kMaxNotifBytes) {
    counters_->notifs_dropped.value++;
    R2CCL_WARN_LIMITED(
        "nixl: a notification from agent '{}' dropped: {} ({} bytes) wait for "
        "getNotifs already",
        agent, notifs_.size(), notif_bytes_);
    return;
  }
  notif_bytes_ += msg.size();
  counters_->notifs.value++;
  notifs_.emplace_back(std::move(agent), std::move(msg));
}

nixl_status_t Engine::getNotifs(notif_list_t& notif_list) {
  return guarded("getNotifs", [&] {
    std::lock_guard lock(mu_);
    for (auto& n : notifs_)
      notif_list.push_back(std::move(n));
    notifs_.clear();
    notif_bytes_ = 0;
    return NIXL_SUCCESS;
  });
}

nixl_status_t Engine::genNotif(const std::string& remote_agent, const std::string& msg) const {
  return guarded("genNotif", [&] {
    if (msg.size() > kMaxNotif)
      return fail(NIXL_ERR_INVALID_PARAM,
                  fmt::format("r2ccl genNotif: a notification of {} bytes (at most {})", msg.size(),
                              kMaxNotif));
    if (remote_agent == localAgent) {
      push_notif(localAgent, msg);
      return NIXL_SUCCESS;
    }
    auto peer = peer_of(remote_agent);
    if (!peer) {
      const nixl_status_t code = peer.status().code() == ErrorCode::kClosed
                                     ? NIXL_ERR_REMOTE_DISCONNECT
                                     : status_of(peer.status());
      return fail(code, fmt::format("r2ccl genNotif: {}", peer.status().message()));
    }
    ByteWriter w(msg.size() + localAgent.size() + 16);
    w.u8(static_cast<std::uint8_t>(Msg::kNotif)).str(localAgent).str(msg);
    if (Status s = endpoint_->send_message(*peer, 0, w.take()); !s)
      return fail(NIXL_ERR_BACKEND,
                  fmt::format("r2ccl genNotif to agent '{}': {}", remote_agent, s.message()));
    return NIXL_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// Messages from peers (the endpoint's progress thread; nothing here blocks)

void Engine::on_message(int peer, Bytes payload) {
  try {
    ByteReader r(payload);
    switch (static_cast<Msg>(r.u8())) {
      case Msg::kNotif:
        return on_notif(peer, r);
      case Msg::kReadRequest:
        return on_read_request(peer, r);
      case Msg::kReadDone:
        return on_read_done(peer, r);
    }
    R2CCL_WARN_LIMITED("nixl: a message of unknown kind from peer {} ignored", peer);
  } catch (const std::exception& e) {
    R2CCL_WARN_LIMITED("nixl: a message from peer {} not handled: {}", peer, e.what());
  }
}

void Engine::on_notif(int peer, ByteReader& r) {
  std::string sender = r.str(kMaxAgentName);
  std::string msg = r.str(kMaxNotif);
  if (Status st = r.finish("notification"); !st) {
    R2CCL_WARN_LIMITED("nixl: {} from peer {}", st.message(), peer);
    return;
  }
  push_notif(std::move(sender), std::move(msg));
}

void Engine::on_read_request(int peer, ByteReader& r) {
  const std::uint64_t token = r.u64();
  const std::uint32_t chunk = r.u32();
  const std::uint32_t chunks = r.u32();
  const std::uint32_t nregions = r.u32();
  std::vector<RemoteRegion> dst;
  for (std::uint32_t i = 0; i < nregions && i < 4096 && r.ok(); ++i)
    dst.push_back(RemoteRegion::decode(r));
  const std::uint32_t nelems = r.u32();
  struct Write {
    RegionPtr src;
    std::uint64_t src_offset, length;
    std::uint32_t dst;
    std::uint64_t dst_offset;
  };
  std::vector<Write> writes;
  std::vector<std::uint64_t> src_ids;
  for (std::uint32_t i = 0; i < nelems && i < 4096 && r.ok(); ++i) {
    Write w;
    src_ids.push_back(r.u64());
    w.src_offset = r.u64();
    w.length = r.u64();
    w.dst = r.u32();
    w.dst_offset = r.u64();
    writes.push_back(std::move(w));
  }
  const bool has_notif = r.u8() != 0;
  std::string sender = r.str(kMaxAgentName);
  std::string notif = r.str(kMaxNotif);
  Status bad = r.finish("read request");
  if (bad && (nregions > 4096 || nelems > 4096 || chunks == 0 || chunks > kMaxReadChunks ||
              chunk >= chunks))
    bad = Status(ErrorCode::kProtocol,
                 fmt::format("malformed read request (chunk {} of {}, {} regions, {} descriptors)",
                             chunk, chunks, nregions, nelems));
  const auto key = std::make_pair(peer, token);
  {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(key);
    if (it == jobs_.end()) {
      if (jobs_.size() >= kMaxReadJobs && bad)
        bad = Status(ErrorCode::kNoResource,
                     fmt::format("{} reads of peers are in progress here already", jobs_.size()));
      it = jobs_.emplace(key, std::make_unique<ReadJob>()).first;
      it->second->chunks = bad ? chunks : 1;
    }
    ReadJob& job = *it->second;
    if (bad && job.chunks != chunks)
      bad = Status(ErrorCode::kProtocol, "read request chunks disagree on their count");
    for (std::size_t i = 0; bad && i < writes.size(); ++i) {
      auto reg = regions_.find(src_ids[i]);
      if (reg == regions_.end()) {
        bad = Status(ErrorCode::kNotFound,
                     fmt::format("read of region {}, which is not registered (any more) at agent "
                                 "'{}'",
                                 src_ids[i], localAgent));
        break;
      }
      writes[i].src = reg->second;
      if (writes[i].dst >= dst.size() ||
          !inside(writes[i].src_offset, writes[i].length, 0, reg->second->length))
        bad = Status(
            ErrorCode::kInvalidArgument,
            fmt::format("read of {} bytes at offset {} of a {}-byte region at agent '{}'",
                        writes[i].length, writes[i].src_offset, reg->second->length, localAgent));
    }
    if (!bad) {
      if (job.failed) job.failed = bad;
      writes.clear();
    }
    if (chunk + 1 == chunks || !bad) {
      job.has_notif = has_notif;
      job.sender = std::move(sender);
      job.notif = std::move(notif);
    }
    job.pending += writes.size();
  }
  for (const auto& w : writes) {
    auto op = endpoint_->iwrite(peer, w.src, w.src_offset, dst[w.dst], w.dst_offset, w.length);
    if (!op) {
      read_job_step(peer, token, op.status(), false, false);
      continue;
    }
    OpPtr held = *op;
    held->on_complete([this, peer, token, held](const Status& st) {
      read_job_step(peer, token, st, held->replayed(), false);
    });
  }
  read_job_step(peer, token, Status::ok(), false, true);
}

// One of a job's writes ended, or one of its chunks was taken: once every chunk was and every
// write ended, the reader hears "done" (and this side's agent the notification, on success).
void Engine::read_job_step(int peer, std::uint64_t token, const Status& st, bool replayed,
                           bool chunk_seen) {
  std::unique_ptr<ReadJob> done;
  {
    std::lock_guard lock(mu_);
    auto it = jobs_.find({peer, token});
    if (it == jobs_.end()) return;
    ReadJob& job = *it->second;
    if (chunk_seen)
      ++job.seen;
    else if (job.pending > 0)
      --job.pending;
    if (replayed) job.replayed = true;
    if (!st && job.failed) job.failed = st;
    if (job.seen < job.chunks || job.pending > 0) return;
    done = std::move(it->second);
    jobs_.erase(it);
  }
  if (done->failed && done->has_notif) push_notif(done->sender, done->notif);
  ByteWriter w(64 + done->failed.message().size());
  w.u8(static_cast<std::uint8_t>(Msg::kReadDone))
      .u64(token)
      .u8(done->failed ? 1 : 0)
      .u8(done->replayed ? 1 : 0)
      .str(done->failed.message());
  if (Status s = endpoint_->send_message(peer, 0, w.take()); !s)
    R2CCL_WARN_LIMITED("nixl: the end of a read of peer {} not sent: {}", peer, s.message());
}

void Engine::on_read_done(int peer, ByteReader& r) {
  const std::uint64_t token = r.u64();
  const bool ok = r.u8() != 0;
  const bool replayed = r.u8() != 0;
  const std::string why = r.str(4096);
  if (Status st = r.finish("read completion"); !st) {
    R2CCL_WARN_LIMITED("nixl: {} from peer {}", st.message(), peer);
    return;
  }
  std::shared_ptr<Xfer> x;
  {
    std::lock_guard lock(mu_);
    auto it = reads_.find(token);
    if (it == reads_.end()) return;  // given up already
    x = it->second.lock();
    if (x) {
      std::lock_guard xl(x->mu);
      if (x->peer != peer) return;  // not this peer's to end
    }
    reads_.erase(it);
  }
  if (!x) return;
  std::lock_guard xl(x->mu);
  if (x->token != token) return;
  if (replayed) x->replayed = true;
  if (ok)
    finish(*x, NIXL_SUCCESS, {});
  else
    finish(*x, NIXL_ERR_BACKEND, fmt::format("read from agent '{}': {}", x->agent, why));
}

}  // namespace r2ccl::nixl

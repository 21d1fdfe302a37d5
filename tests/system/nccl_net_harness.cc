// r2ccl-test-nccl-net: drives an NCCL network plugin (libnccl-net-r2ccl.so) the way NCCL's proxy
// does, through dlopen and the versioned ncclNet_vN_t tables only (tests/system/test_nccl_net.py).
// It links nothing of r2ccl: the plugin is a black box behind NCCL's ABI.
//
//   r2ccl-test-nccl-net --plugin SO --id 0|1 --handle-out F --handle-in G [options]
//       Pair mode (the default): listen on dev 0 and write the 128-byte handle as hex to F;
//       read the peer's handle from G (waiting for it, bounded); poll connect and accept in one
//       thread until both comms exist; then stream both ways at once (one progress thread, like
//       NCCL's proxy): tagged isends on the send comm, grouped irecvs (n = 1..8) on the recv comm,
//       up to --window requests outstanding on each, every received byte checked.
//   ... --listen-only SECONDS --handle-out F
//       Listen, write the handle, poll accept for SECONDS (or until F.stop exists); a comm
//       accepted is an error (the connectors were given bad handles).
//   ... --bad-handle wrong-token|truncated|length|magic --handle-in G
//       Read G, corrupt it that way (its token inverted, its endpoint part cut mid-rail, its
//       length field garbled, its magic number changed), poll connect: it must fail (not
//       ncclSuccess) within --connect-deadline; prints how long it took and the WARN lines the
//       plugin logged.
//
// Options: --version 8..12 (default 12 if the plugin exports it, else 11), --groups N (the
// sender's receive groups at most), --seconds S (the sender stops starting groups after S s),
// --size BYTES (largest posted receive element), --window W (outstanding requests per comm,
// at most 32), --max-recvs N (largest group; also capped by the device's maxRecvs), --seed X,
// --deadline S (whole run; past it: "error ... (a hang)" and exit 3), --connect-deadline S,
// --no-zero (no zero-byte sends; the end of the stream is still marked by empty groups).
// Both processes of a pair need the same --seed, --size, --window, --max-recvs and --no-zero:
// each derives the other's plan from them.
//
// Output, one line each, flushed: "symbols ncclNetPlugin_v8=yes ...", "version N",
// "properties ...", "LOG <LEVEL> <message>" (the plugin's logger), "connected in <ms> ms",
// "progress <bytes> sent <bytes> received <bytes>" (every 0.2 s), and at the end
// "ok <messages> <bytes> ..." (exit 0) or "error <text>" (exit 1; 2: bad usage; 3: deadline).
//
// The stream: group g of the direction from process `id` has a plan derived from (seed, id, g):
// n elements, their tags, posted sizes and sent sizes (some smaller than posted, some empty).
// Element e of group g is message m = 8g + e; byte o of it is a function of (id, m, o), so a lost,
// duplicated, reordered or misrouted message or byte is caught, and so is a write past what was
// sent. The sender ends the stream with a group whose elements are all empty (a normal group's
// first element never is), then window-1 more empty groups: every receive the receiver had
// posted ahead is matched, and the receiver, once it saw the end, posts exactly up to that.
// Both processes then meet (F.done / G.done) before closing, as NCCL closes only at the end.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kMaxGroup = 8;  // NCCL_NET_MAX_RECVS of NCCL's grouped receives
constexpr int kMaxWindow = NCCL_NET_MAX_REQUESTS;

// ----------------------------------------------------------------------------------- output

std::mutex out_mutex;
std::vector<std::string> warnings;  // every WARN line the plugin logged (out_mutex)

void line(const std::string& s) {
  std::lock_guard lock(out_mutex);
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string format(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  char buf[1024];
  const int n = std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  if (n < 0) return f;
  return std::string(buf, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof buf - 1));
}

const char* level_name(ncclDebugLogLevel level) {
  switch (level) {
    case NCCL_LOG_NONE:
      return "NONE";
    case NCCL_LOG_VERSION:
      return "VERSION";
    case NCCL_LOG_WARN:
      return "WARN";
    case NCCL_LOG_INFO:
      return "INFO";
    case NCCL_LOG_ABORT:
      return "ABORT";
    case NCCL_LOG_TRACE:
      return "TRACE";
  }
  return "?";
}

bool show_trace = false;

// NCCL's logger: the plugin calls it from any of its threads.
void logger(ncclDebugLogLevel level, unsigned long /*flags*/, const char* /*file*/, int /*line*/,
            const char* fmt, ...) __attribute__((format(printf, 5, 6)));
void logger(ncclDebugLogLevel level, unsigned long /*flags*/, const char* /*file*/, int /*line*/,
            const char* fmt, ...) {
  if (level == NCCL_LOG_TRACE && !show_trace) return;
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  const int n = std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::string msg =
      n < 0 ? std::string(fmt)
            : std::string(buf, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof buf - 1));
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == '\r'))
    msg.pop_back();
  for (auto& c : msg)
    if (c == '\n') c = ' ';
  std::lock_guard lock(out_mutex);
  if (level == NCCL_LOG_WARN && warnings.size() < 1000) warnings.push_back(msg);
  std::fprintf(stdout, "LOG %s %s\n", level_name(level), msg.c_str());
  std::fflush(stdout);
}

const char* result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
  }
  return "unknown ncclResult_t";
}

std::string res(ncclResult_t r) {
  return format("%s (%d)", result_name(r), static_cast<int>(r));
}

// The watchdog: past the deadline the run is a hang, whatever the plugin is doing.
std::atomic<const char*> phase{"start"};
std::atomic<bool> finished{false};

void start_watchdog(double seconds) {
  std::thread([seconds] {
    const auto until = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < until) {
      if (finished.load()) return;
      std::this_thread::sleep_for(milliseconds(50));
    }
    if (finished.load()) return;
    line(format("error the %.0f s deadline passed in phase '%s' (a hang)", seconds, phase.load()));
    std::_Exit(3);
  }).detach();
}

// ------------------------------------------------------------------------- the plugin's ABI

struct Props {
  std::string text;
  int ptr_support = 0;
  int speed = 0;
  int max_recvs = 0;
};

// One interface over ncclNet_v8_t .. ncclNet_v12_t (what NCCL's own shims do).
class Net {
 public:
  virtual ~Net() = default;
  virtual const char* name() const = 0;
  virtual std::string missing() const = 0;  // mandatory functions that are NULL
  virtual ncclResult_t init(std::uint64_t comm_id) = 0;
  virtual ncclResult_t devices(int* n) = 0;
  virtual ncclResult_t properties(int dev, Props* p) = 0;
  virtual ncclResult_t listen(int dev, void* handle, void** lc) = 0;
  virtual ncclResult_t connect(int dev, void* handle, void** sc) = 0;
  virtual ncclResult_t accept(void* lc, void** rc) = 0;
  virtual ncclResult_t reg_mr(void* comm, void* data, std::size_t size, void** mh) = 0;
  virtual ncclResult_t dereg_mr(void* comm, void* mh) = 0;
  virtual ncclResult_t isend(void* sc, void* data, std::size_t size, int tag, void* mh,
                             void** req) = 0;
  virtual ncclResult_t irecv(void* rc, int n, void** data, const std::size_t* sizes, int* tags,
                             void** mhs, void** req) = 0;
  virtual bool has_iflush() const = 0;
  virtual ncclResult_t iflush(void* rc, int n, void** data, int* sizes, void** mhs, void** req) = 0;
  virtual ncclResult_t test(void* req, int* done, int* sizes) = 0;
  virtual ncclResult_t close_send(void* c) = 0;
  virtual ncclResult_t close_recv(void* c) = 0;
  virtual ncclResult_t close_listen(void* c) = 0;
  virtual ncclResult_t finalize() = 0;
};

template <int V, typename T>
class NetImpl final : public Net {
 public:
  explicit NetImpl(T* t) : t_(t) {}
  const char* name() const override { return t_->name ? t_->name : "(null)"; }

  std::string missing() const override {
    std::string m;
    auto need = [&m](const void* f, const char* what) {
      if (f == nullptr) m += std::string(m.empty() ? "" : " ") + what;
    };
    need(reinterpret_cast<const void*>(t_->init), "init");
    need(reinterpret_cast<const void*>(t_->devices), "devices");
    need(reinterpret_cast<const void*>(t_->getProperties), "getProperties");
    need(reinterpret_cast<const void*>(t_->listen), "listen");
    need(reinterpret_cast<const void*>(t_->connect), "connect");
    need(reinterpret_cast<const void*>(t_->accept), "accept");
    need(reinterpret_cast<const void*>(t_->regMr), "regMr");
    need(reinterpret_cast<const void*>(t_->deregMr), "deregMr");
    need(reinterpret_cast<const void*>(t_->isend), "isend");
    need(reinterpret_cast<const void*>(t_->irecv), "irecv");
    need(reinterpret_cast<const void*>(t_->test), "test");
    need(reinterpret_cast<const void*>(t_->closeSend), "closeSend");
    need(reinterpret_cast<const void*>(t_->closeRecv), "closeRecv");
    need(reinterpret_cast<const void*>(t_->closeListen), "closeListen");
    if constexpr (V >= 11) need(reinterpret_cast<const void*>(t_->finalize), "finalize");
    return m;
  }

  ncclResult_t init(std::uint64_t comm_id) override {
    if constexpr (V >= 11) {
      config_.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF;
      return t_->init(&ctx_, comm_id, &config_, logger, nullptr);
    } else if constexpr (V == 10) {
      (void)comm_id;
      return t_->init(logger, nullptr);
    } else {
      (void)comm_id;
      return t_->init(logger);
    }
  }
  ncclResult_t devices(int* n) override { return t_->devices(n); }

  ncclResult_t properties(int dev, Props* p) override {
    decltype(props_type()) q;
    std::memset(&q, 0, sizeof q);
    const ncclResult_t r = t_->getProperties(dev, &q);
    if (r != ncclSuccess) return r;
    p->ptr_support = q.ptrSupport;
    p->speed = q.speed;
    p->max_recvs = q.maxRecvs;
    std::string s = format(
        "name=%s pciPath=%s guid=0x%llx ptrSupport=0x%x regIsGlobal=%d speed=%d port=%d "
        "latency=%g maxComms=%d maxRecvs=%d netDeviceType=%d netDeviceVersion=%d",
        q.name ? q.name : "(null)", q.pciPath ? q.pciPath : "(null)",
        static_cast<unsigned long long>(q.guid), static_cast<unsigned>(q.ptrSupport), q.regIsGlobal,
        q.speed, q.port, static_cast<double>(q.latency), q.maxComms, q.maxRecvs,
        static_cast<int>(q.netDeviceType), q.netDeviceVersion);
    if constexpr (requires { q.forceFlush; })
      s += format(" forceFlush=%d vProps.ndevs=%d maxP2pBytes=%zu maxCollBytes=%zu", q.forceFlush,
                  q.vProps.ndevs, q.maxP2pBytes, q.maxCollBytes);
    if constexpr (requires { q.maxMultiRequestSize; })
      s += format(" maxMultiRequestSize=%d", q.maxMultiRequestSize);
    if constexpr (requires { q.railId; })
      s += format(" railId=%d planeId=%d", static_cast<int>(q.railId), static_cast<int>(q.planeId));
    p->text = s;
    return ncclSuccess;
  }

  ncclResult_t listen(int dev, void* handle, void** lc) override {
    if constexpr (V >= 11)
      return t_->listen(ctx_, dev, handle, lc);
    else
      return t_->listen(dev, handle, lc);
  }
  ncclResult_t connect(int dev, void* handle, void** sc) override {
    // No device offload: NCCL passes a pointer to a NULL device handle.
    dev_handle_ = nullptr;
    if constexpr (V >= 11) {
      return t_->connect(ctx_, dev, handle, sc, &dev_handle_);
    } else if constexpr (V == 10) {
      config_.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF;
      return t_->connect(dev, &config_, handle, sc, &dev_handle_);
    } else {
      return t_->connect(dev, handle, sc, &dev_handle_);
    }
  }
  ncclResult_t accept(void* lc, void** rc) override {
    dev_handle_ = nullptr;
    return t_->accept(lc, rc, &dev_handle_);
  }
  ncclResult_t reg_mr(void* comm, void* data, std::size_t size, void** mh) override {
    return t_->regMr(comm, data, size, NCCL_PTR_HOST, mh);
  }
  ncclResult_t dereg_mr(void* comm, void* mh) override { return t_->deregMr(comm, mh); }

  ncclResult_t isend(void* sc, void* data, std::size_t size, int tag, void* mh,
                     void** req) override {
    if constexpr (V >= 10)
      return t_->isend(sc, data, size, tag, mh, nullptr, req);
    else if constexpr (V == 9)
      return t_->isend(sc, data, size, tag, mh, req);
    else
      return t_->isend(sc, data, static_cast<int>(size), tag, mh, req);
  }
  ncclResult_t irecv(void* rc, int n, void** data, const std::size_t* sizes, int* tags, void** mhs,
                     void** req) override {
    if constexpr (V >= 9) {
      std::size_t s[kMaxGroup];
      std::copy(sizes, sizes + n, s);
      if constexpr (V >= 10) {
        void* phandles[kMaxGroup] = {};
        return t_->irecv(rc, n, data, s, tags, mhs, phandles, req);
      } else {
        return t_->irecv(rc, n, data, s, tags, mhs, req);
      }
    } else {
      int s[kMaxGroup];
      for (int i = 0; i < n; ++i)
        s[i] = static_cast<int>(sizes[i]);
      return t_->irecv(rc, n, data, s, tags, mhs, req);
    }
  }
  bool has_iflush() const override { return t_->iflush != nullptr; }
  ncclResult_t iflush(void* rc, int n, void** data, int* sizes, void** mhs, void** req) override {
    return t_->iflush(rc, n, data, sizes, mhs, req);
  }
  ncclResult_t test(void* req, int* done, int* sizes) override {
    return t_->test(req, done, sizes);
  }
  ncclResult_t close_send(void* c) override { return t_->closeSend(c); }
  ncclResult_t close_recv(void* c) override { return t_->closeRecv(c); }
  ncclResult_t close_listen(void* c) override { return t_->closeListen(c); }
  ncclResult_t finalize() override {
    if constexpr (V >= 11) return t_->finalize(ctx_);
    return ncclSuccess;
  }

 private:
  static auto props_type() {
    if constexpr (V == 12)
      return ncclNetProperties_v12_t{};
    else if constexpr (V == 11)
      return ncclNetProperties_v11_t{};
    else if constexpr (V == 10)
      return ncclNetProperties_v10_t{};
    else if constexpr (V == 9)
      return ncclNetProperties_v9_t{};
    else
      return ncclNetProperties_v8_t{};
  }
  using Config = std::conditional_t<
      V == 12, ncclNetCommConfig_v12_t,
      std::conditional_t<V == 11, ncclNetCommConfig_v11_t, ncclNetCommConfig_v10_t>>;

  T* t_;
  void* ctx_ = nullptr;
  Config config_{};
  ncclNetDeviceHandle_v8_t* dev_handle_ = nullptr;
};

// --------------------------------------------------------------------------------- options

struct Options {
  std::string plugin;
  int version = 0;  // 0: 12 if exported, else 11
  int id = 0;
  std::string handle_out, handle_in;
  long long groups = 1000000;
  double seconds = 5;
  std::size_t size = 256 * 1024;
  int window = kMaxWindow;
  int max_recvs = kMaxGroup;
  std::uint64_t seed = 1;
  double deadline = 0;  // 0: seconds + connect_deadline + 60
  double connect_deadline = 30;
  double listen_only = 0;
  std::string bad_handle;
  bool zero = true;
  std::uint64_t comm_id = 0x7232636370616972ULL;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "r2ccl-test-nccl-net: %s\n"
               "usage: r2ccl-test-nccl-net --plugin SO [--version 8..12] [--id 0|1]\n"
               "         [--handle-out F] [--handle-in G] [--groups N] [--seconds S]\n"
               "         [--size BYTES] [--window W] [--max-recvs N] [--seed X] [--deadline S]\n"
               "         [--connect-deadline S] [--no-zero] [--trace]\n"
               "         [--listen-only S | --bad-handle wrong-token|truncated|length|magic]\n",
               why.c_str());
  std::exit(2);
}

double to_double(const std::string& opt, const char* v) {
  char* end = nullptr;
  errno = 0;
  const double d = std::strtod(v, &end);
  if (errno != 0 || end == v || *end != '\0' || !(d >= 0)) usage("bad value for " + opt);
  return d;
}

long long to_int(const std::string& opt, const char* v) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v, &end, 0);
  if (errno != 0 || end == v || *end != '\0' || n < 0) usage("bad value for " + opt);
  return n;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--plugin") {
      o.plugin = value();
    } else if (a == "--version") {
      o.version = static_cast<int>(to_int(a, value()));
      if (o.version < 8 || o.version > 12) usage("--version is 8 to 12");
    } else if (a == "--id") {
      o.id = static_cast<int>(to_int(a, value()));
      if (o.id > 1) usage("--id is 0 or 1");
    } else if (a == "--handle-out") {
      o.handle_out = value();
    } else if (a == "--handle-in") {
      o.handle_in = value();
    } else if (a == "--groups") {
      o.groups = to_int(a, value());
    } else if (a == "--seconds") {
      o.seconds = to_double(a, value());
    } else if (a == "--size") {
      o.size = static_cast<std::size_t>(to_int(a, value()));
      if (o.size < 64 || o.size > (std::size_t{1} << 26)) usage("--size is 64 to 64 MiB");
    } else if (a == "--window") {
      o.window = static_cast<int>(to_int(a, value()));
      if (o.window < 1 || o.window > kMaxWindow) usage("--window is 1 to 32");
    } else if (a == "--max-recvs") {
      o.max_recvs = static_cast<int>(to_int(a, value()));
      if (o.max_recvs < 1 || o.max_recvs > kMaxGroup) usage("--max-recvs is 1 to 8");
    } else if (a == "--seed") {
      o.seed = static_cast<std::uint64_t>(to_int(a, value()));
    } else if (a == "--deadline") {
      o.deadline = to_double(a, value());
    } else if (a == "--connect-deadline") {
      o.connect_deadline = to_double(a, value());
    } else if (a == "--listen-only") {
      o.listen_only = to_double(a, value());
    } else if (a == "--bad-handle") {
      o.bad_handle = value();
      if (o.bad_handle != "wrong-token" && o.bad_handle != "truncated" &&
          o.bad_handle != "length" && o.bad_handle != "magic")
        usage("--bad-handle is wrong-token, truncated, length or magic");
    } else if (a == "--no-zero") {
      o.zero = false;
    } else if (a == "--trace") {
      show_trace = true;
    } else {
      usage("unknown argument " + a);
    }
  }
  if (o.plugin.empty()) usage("--plugin is required");
  if (o.listen_only > 0 && !o.bad_handle.empty()) usage("--listen-only or --bad-handle, not both");
  if ((o.listen_only > 0 || o.bad_handle.empty()) && o.handle_out.empty())
    usage("--handle-out is required");
  if (o.listen_only == 0 && o.handle_in.empty()) usage("--handle-in is required");
  if (o.deadline == 0) o.deadline = o.seconds + o.connect_deadline + 60;
  return o;
}

// ------------------------------------------------------------------------------- handles

using Handle = std::array<unsigned char, NCCL_NET_HANDLE_MAXSIZE>;

std::string to_hex(const unsigned char* p, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

bool write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text << "\n";
    if (!f) return false;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  return !ec;
}

// The handle in `path`, once it exists (written whole by a rename), or an error text.
std::string read_handle(const std::string& path, Clock::time_point until, Handle* h) {
  while (!std::filesystem::exists(path)) {
    if (Clock::now() >= until) return "the peer's handle " + path + " did not appear in time";
    std::this_thread::sleep_for(milliseconds(20));
  }
  std::ifstream f(path);
  std::string hex;
  f >> hex;
  if (hex.size() != 2 * h->size())
    return format("the handle file %s holds %zu hex digits, not %zu", path.c_str(), hex.size(),
                  2 * h->size());
  for (std::size_t i = 0; i < h->size(); ++i) {
    unsigned v = 0;
    if (std::sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1)
      return "the handle file " + path + " is not hex";
    (*h)[i] = static_cast<unsigned char>(v);
  }
  return "";
}

// Corrupts a handle as --bad-handle says. r2ccl's plugin handle is: u32 magic "R2NP", u8
// version, u8 length of the endpoint part, u32 listen id, the endpoint part (r2ccl's compact
// endpoint handle: magic "R2EH", version, provider, rail count, u64 incarnation, 16-byte token,
// 8 bytes a rail), zeros, and the connector's stage word in the last 8 bytes. Returns what was
// done, or "" when the handle is not laid out so.
std::string corrupt(Handle* h, const std::string& kind) {
  static const unsigned char kPluginMagic[4] = {'R', '2', 'N', 'P'};
  static const unsigned char kEndpointMagic[4] = {'R', '2', 'E', 'H'};
  constexpr std::size_t kLength = 5, kEndpoint = 10, kToken = kEndpoint + 15;
  if (std::memcmp(h->data(), kPluginMagic, 4) != 0 ||
      std::memcmp(h->data() + kEndpoint, kEndpointMagic, 4) != 0)
    return "";
  const std::size_t length = (*h)[kLength];
  if (kind == "magic") {
    for (std::size_t i = 0; i < 4; ++i)
      (*h)[i] ^= 0x5a;
    return "bytes 0..3 (the magic number) changed";
  }
  if (kind == "wrong-token") {
    for (std::size_t i = kToken; i < kToken + 16; ++i)
      (*h)[i] ^= 0xff;
    return format("the 16-byte token at offset %zu inverted", kToken);
  }
  if (kind == "length") {
    (*h)[kLength] = 0xff;
    return format("the endpoint part's length %zu garbled to 255", length);
  }
  // truncated: the endpoint part ends in the middle of its last rail.
  if (length < 36) return "";
  const std::size_t cut = length - 4;
  (*h)[kLength] = static_cast<unsigned char>(cut);
  std::fill(h->begin() + static_cast<std::ptrdiff_t>(kEndpoint + cut),
            h->begin() + static_cast<std::ptrdiff_t>(kEndpoint + length), 0);
  return format("the endpoint part cut from %zu to %zu bytes (mid-rail)", length, cut);
}

// ----------------------------------------------------------------------------- the stream

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Byte o of message m from process `from`: word o/8 of a keyed mix, byte o%8 of it.
struct Pattern {
  std::uint64_t key;
  std::uint64_t word(std::uint64_t m, std::uint64_t w) const {
    return mix(key ^ (m * 0xd6e8feb86659fd93ULL) ^ (w * 0x9e3779b97f4a7c15ULL + w));
  }
  void fill(unsigned char* p, std::uint64_t m, std::size_t n) const {
    std::size_t o = 0;
    for (std::uint64_t w = 0; o < n; ++w) {
      const std::uint64_t v = word(m, w);
      const std::size_t k = std::min<std::size_t>(8, n - o);
      std::memcpy(p + o, &v, k);
      o += k;
    }
  }
  // The first offset < n that differs, or n.
  std::size_t check(const unsigned char* p, std::uint64_t m, std::size_t n) const {
    std::size_t o = 0;
    for (std::uint64_t w = 0; o < n; ++w) {
      const std::uint64_t v = word(m, w);
      const std::size_t k = std::min<std::size_t>(8, n - o);
      if (std::memcmp(p + o, &v, k) != 0) {
        unsigned char b[8];
        std::memcpy(b, &v, 8);
        for (std::size_t i = 0; i < k; ++i)
          if (p[o + i] != b[i]) return o + i;
      }
      o += k;
    }
    return n;
  }
  unsigned char byte(std::uint64_t m, std::size_t o) const {
    const std::uint64_t v = word(m, o / 8);
    unsigned char b[8];
    std::memcpy(b, &v, 8);
    return b[o % 8];
  }
};

constexpr unsigned char kCanary = 0xa5;

struct Plan {
  int n = 1;
  int tags[kMaxGroup] = {};
  std::size_t posted[kMaxGroup] = {};
  std::size_t sent[kMaxGroup] = {};
};

// Group g of the stream from process `from`; `last` groups (the end and the drain) send nothing.
Plan plan(const Options& o, int max_n, int from, long long g, bool empty) {
  Plan p;
  std::uint64_t r = mix(o.seed * 0x100000001b3ULL ^ (static_cast<std::uint64_t>(from) << 56) ^
                        static_cast<std::uint64_t>(g));
  auto next = [&r](std::uint64_t bound) {
    r = mix(r);
    return bound == 0 ? 0 : r % bound;
  };
  p.n = 1 + static_cast<int>(next(static_cast<std::uint64_t>(max_n)));
  const int tag_base = static_cast<int>(next(1000));
  for (int e = 0; e < p.n; ++e) {
    p.tags[e] = tag_base + 7 * e;  // distinct within the group
    p.posted[e] = next(4) == 0 ? o.size - next(o.size / 2) : o.size;
    const auto kind = next(20);
    std::size_t s;
    if (kind < 10)
      s = p.posted[e];  // the whole posted buffer
    else if (kind < 17)
      s = 1 + next(p.posted[e]);  // smaller than posted
    else if (kind < 19 || !o.zero)
      s = 1 + next(64);  // a few bytes
    else
      s = 0;
    if (e == 0 && s == 0) s = 1;  // a normal group's first element is never empty
    p.sent[e] = empty ? 0 : std::min(s, p.posted[e]);
  }
  return p;
}

struct Registered {
  std::vector<unsigned char> buf;
  void* mh = nullptr;
};

struct SendReq {
  void* req;
  long long group;
  int elem;
  std::size_t size;
};

struct RecvReq {
  void* req;
  long long group;
  int slot;
  Plan plan;
};

class Stream {
 public:
  Stream(Net& net, const Options& o, int max_n, void* sc, void* rc)
      : net_(net), o_(o), max_n_(max_n), sc_(sc), rc_(rc) {
    send_pattern_.key = mix(o.seed ^ 0x5345ULL ^ static_cast<std::uint64_t>(o.id));
    recv_pattern_.key = mix(o.seed ^ 0x5345ULL ^ static_cast<std::uint64_t>(1 - o.id));
  }

  // Registers the buffers (several, as NCCL registers its buffers once per comm); error text.
  std::string setup() {
    send_.resize(static_cast<std::size_t>(o_.window));
    recv_.resize(static_cast<std::size_t>(o_.window));
    for (auto& s : send_) {
      s.buf.assign(o_.size, 0);
      if (auto r = net_.reg_mr(sc_, s.buf.data(), s.buf.size(), &s.mh); r != ncclSuccess)
        return "regMr of a send buffer returned " + res(r);
    }
    for (auto& s : recv_) {
      s.buf.assign(o_.size * static_cast<std::size_t>(kMaxGroup), kCanary);
      if (auto r = net_.reg_mr(rc_, s.buf.data(), s.buf.size(), &s.mh); r != ncclSuccess)
        return "regMr of a receive buffer returned " + res(r);
    }
    // A few more registrations of odd sizes and alignments, released at once.
    std::vector<unsigned char> odd(3 * 4096 + 17);
    const std::pair<std::size_t, std::size_t> spans[] = {{0, 1}, {1, 4095}, {4096, 8192}, {3, 17}};
    for (auto [off, len] : spans) {
      for (void* comm : {sc_, rc_}) {
        void* mh = nullptr;
        if (auto r = net_.reg_mr(comm, odd.data() + off, len, &mh); r != ncclSuccess)
          return format("regMr of %zu bytes at offset %zu returned %s", len, off, res(r).c_str());
        if (auto r = net_.dereg_mr(comm, mh); r != ncclSuccess) return "deregMr returned " + res(r);
      }
    }
    return "";
  }

  std::string teardown() {
    std::string err;
    for (auto& s : send_)
      if (s.mh)
        if (auto r = net_.dereg_mr(sc_, s.mh); r != ncclSuccess && err.empty())
          err = "deregMr of a send buffer returned " + res(r);
    for (auto& s : recv_)
      if (s.mh)
        if (auto r = net_.dereg_mr(rc_, s.mh); r != ncclSuccess && err.empty())
          err = "deregMr of a receive buffer returned " + res(r);
    send_.clear();
    recv_.clear();
    return err;
  }

  // Runs both directions to their end; error text, or "" when every byte was right.
  std::string run() {
    const auto t0 = Clock::now();
    const auto stop_at =
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.seconds));
    auto next_progress = t0 + milliseconds(200);
    while (!(send_done() && recv_done())) {
      bool moved = false;
      // Sender: stop starting normal groups when told, then the end group and the drain.
      if (end_group_ < 0 && (send_group_ >= o_.groups || Clock::now() >= stop_at) &&
          send_elem_ == 0)
        end_group_ = send_group_;
      std::string err;
      if (!(err = post_sends(&moved)).empty()) return err;
      if (!(err = test_sends(&moved)).empty()) return err;
      if (!(err = post_recvs(&moved)).empty()) return err;
      if (!(err = test_recvs(&moved)).empty()) return err;
      const auto now = Clock::now();
      if (now >= next_progress) {
        line(format("progress %llu sent %llu received %llu groups %lld %lld",
                    sent_bytes_ + recv_bytes_, sent_bytes_, recv_bytes_, sent_groups_done_,
                    recv_groups_done_));
        next_progress = now + milliseconds(200);
      }
      if (!moved) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return "";
  }

  std::string summary() const {
    return format(
        "%llu %llu received (%lld groups), sent %llu %llu (%lld groups); %llu isend and %llu "
        "irecv calls asked to retry",
        recv_msgs_, recv_bytes_, recv_normal_groups_, sent_msgs_, sent_bytes_, sent_normal_groups_,
        send_retries_, recv_retries_);
  }

 private:
  long long total_send_groups() const { return end_group_ < 0 ? -1 : end_group_ + o_.window; }
  bool send_done() const {
    return end_group_ >= 0 && send_group_ == total_send_groups() && sends_.empty();
  }
  bool recv_done() const { return recv_end_ >= 0 && recv_group_ == recv_limit_ && recvs_.empty(); }

  std::string post_sends(bool* moved) {
    while (static_cast<int>(sends_.size()) < o_.window) {
      if (end_group_ >= 0 && send_group_ >= total_send_groups()) return "";
      const bool empty = end_group_ >= 0 && send_group_ >= end_group_;
      const Plan p = plan(o_, max_n_, o_.id, send_group_, empty);
      auto& slot = send_[send_slot_];
      const std::uint64_t m = static_cast<std::uint64_t>(send_group_) * kMaxGroup +
                              static_cast<std::uint64_t>(send_elem_);
      const std::size_t size = p.sent[send_elem_];
      if (!send_filled_) {
        send_pattern_.fill(slot.buf.data(), m, size);
        send_filled_ = true;
      }
      void* req = nullptr;
      const ncclResult_t r =
          net_.isend(sc_, slot.buf.data(), size, p.tags[send_elem_], slot.mh, &req);
      if (r != ncclSuccess)
        return format("isend of group %lld element %d (%zu bytes, tag %d) returned %s", send_group_,
                      send_elem_, size, p.tags[send_elem_], res(r).c_str());
      if (req == nullptr) {
        ++send_retries_;
        return "";  // NCCL calls again later, with the same arguments
      }
      *moved = true;
      send_filled_ = false;
      sends_.push_back({req, send_group_, send_elem_, size});
      send_slot_ = (send_slot_ + 1) % send_.size();
      if (++send_elem_ == p.n) {
        send_elem_ = 0;
        ++send_group_;
      }
    }
    return "";
  }

  std::string test_sends(bool* moved) {
    // Oldest first, as NCCL's proxy progresses its steps in order.
    while (!sends_.empty()) {
      const SendReq& s = sends_.front();
      int done = 0;
      int size = -1;
      const ncclResult_t r = net_.test(s.req, &done, &size);
      if (r != ncclSuccess)
        return format("test of the isend of group %lld element %d (%zu bytes) returned %s", s.group,
                      s.elem, s.size, res(r).c_str());
      if (!done) return "";
      *moved = true;
      if (size != static_cast<int>(s.size))
        return format("test of the isend of group %lld element %d reports %d bytes sent, not %zu",
                      s.group, s.elem, size, s.size);
      if (end_group_ < 0 || s.group < end_group_) {
        ++sent_msgs_;
        sent_bytes_ += s.size;
      }
      const Plan p = plan(o_, max_n_, o_.id, s.group, false);
      if (s.elem == p.n - 1) {
        ++sent_groups_done_;
        if (end_group_ < 0 || s.group < end_group_) ++sent_normal_groups_;
      }
      sends_.pop_front();
    }
    return "";
  }

  std::string post_recvs(bool* moved) {
    while (static_cast<int>(recvs_.size()) < o_.window) {
      if (recv_limit_ >= 0 && recv_group_ >= recv_limit_) return "";
      if (!recv_prepared_) {
        recv_plan_ = plan(o_, max_n_, 1 - o_.id, recv_group_, false);
        auto& slot = recv_[recv_slot_];
        for (int e = 0; e < recv_plan_.n; ++e)
          std::memset(slot.buf.data() + static_cast<std::size_t>(e) * o_.size, kCanary,
                      recv_plan_.posted[e]);
        recv_prepared_ = true;
      }
      auto& slot = recv_[recv_slot_];
      void* data[kMaxGroup];
      void* mhs[kMaxGroup];
      for (int e = 0; e < recv_plan_.n; ++e) {
        data[e] = slot.buf.data() + static_cast<std::size_t>(e) * o_.size;
        mhs[e] = slot.mh;
      }
      void* req = nullptr;
      const ncclResult_t r =
          net_.irecv(rc_, recv_plan_.n, data, recv_plan_.posted, recv_plan_.tags, mhs, &req);
      if (r != ncclSuccess)
        return format("irecv of group %lld (%d elements) returned %s", recv_group_, recv_plan_.n,
                      res(r).c_str());
      if (req == nullptr) {
        ++recv_retries_;
        return "";
      }
      *moved = true;
      recvs_.push_back({req, recv_group_, static_cast<int>(recv_slot_), recv_plan_});
      recv_prepared_ = false;
      recv_slot_ = (recv_slot_ + 1) % recv_.size();
      ++recv_group_;
    }
    return "";
  }

  // What message of the stream the bytes of a wrong element from offset `o` on look like (lost,
  // duplicated, reordered data shows up as a neighbour's bytes at the same offsets).
  std::string looks_like(const unsigned char* p, std::size_t o, std::size_t n,
                         std::uint64_t m) const {
    const std::size_t end = std::min(n, o + 8);
    const std::uint64_t lo = m > 8 * 64 ? m - 8 * 64 : 0;
    for (std::uint64_t k = lo; k < m + 8 * 64; ++k) {
      if (k == m) continue;
      bool same = true;
      for (std::size_t i = o; i < end && same; ++i)
        same = p[i] == recv_pattern_.byte(k, i);
      if (same)
        return format(" (it matches message %llu: group %llu element %llu)",
                      static_cast<unsigned long long>(k),
                      static_cast<unsigned long long>(k / kMaxGroup),
                      static_cast<unsigned long long>(k % kMaxGroup));
    }
    return p[o] == kCanary ? " (the canary: nothing was written there)" : "";
  }

  std::string test_recvs(bool* moved) {
    while (!recvs_.empty()) {
      RecvReq& q = recvs_.front();
      int done = 0;
      int sizes[kMaxGroup];
      std::fill(std::begin(sizes), std::end(sizes), -1);
      const ncclResult_t r = net_.test(q.req, &done, sizes);
      if (r != ncclSuccess)
        return format("test of the irecv of group %lld (%d elements) returned %s", q.group,
                      q.plan.n, res(r).c_str());
      if (!done) return "";
      *moved = true;
      auto& slot = recv_[static_cast<std::size_t>(q.slot)];
      const bool all_empty = std::all_of(sizes, sizes + q.plan.n, [](int s) { return s == 0; });
      if (recv_end_ >= 0) {
        // The drain after the end: every element empty.
        if (!all_empty)
          return format("group %lld after the end of the stream (group %lld) received %d bytes",
                        q.group, recv_end_, *std::max_element(sizes, sizes + q.plan.n));
      } else if (all_empty) {
        recv_end_ = q.group;
        recv_limit_ = q.group + o_.window;
      } else {
        const Plan sent = plan(o_, max_n_, 1 - o_.id, q.group, false);
        for (int e = 0; e < q.plan.n; ++e) {
          const unsigned char* p = slot.buf.data() + static_cast<std::size_t>(e) * o_.size;
          const std::uint64_t m =
              static_cast<std::uint64_t>(q.group) * kMaxGroup + static_cast<std::uint64_t>(e);
          if (sizes[e] < 0 || static_cast<std::size_t>(sizes[e]) != sent.sent[e])
            return format(
                "group %lld element %d (message %llu, tag %d): test reports %d bytes received, "
                "%zu were sent (posted %zu)",
                q.group, e, static_cast<unsigned long long>(m), q.plan.tags[e], sizes[e],
                sent.sent[e], q.plan.posted[e]);
          const std::size_t n = sent.sent[e];
          if (const std::size_t at = recv_pattern_.check(p, m, n); at < n)
            return format(
                "group %lld element %d (message %llu, %zu bytes): byte %zu is 0x%02x, not "
                "0x%02x%s",
                q.group, e, static_cast<unsigned long long>(m), n, at, p[at],
                recv_pattern_.byte(m, at), looks_like(p, at, n, m).c_str());
          for (std::size_t i = n; i < q.plan.posted[e]; ++i)
            if (p[i] != kCanary)
              return format(
                  "group %lld element %d (message %llu): byte %zu, past the %zu bytes sent, was "
                  "written (0x%02x)",
                  q.group, e, static_cast<unsigned long long>(m), i, n, p[i]);
          ++recv_msgs_;
          recv_bytes_ += n;
        }
        ++recv_normal_groups_;
      }
      ++recv_groups_done_;
      // Some groups flushed, as NCCL flushes a receive before the GPU reads it.
      if (net_.has_iflush() && q.group % 4 == 0) {
        void* data[kMaxGroup];
        void* mhs[kMaxGroup];
        for (int e = 0; e < q.plan.n; ++e) {
          data[e] = slot.buf.data() + static_cast<std::size_t>(e) * o_.size;
          mhs[e] = slot.mh;
        }
        const int n = q.plan.n;
        recvs_.pop_front();  // its slot is free once flushed; it is no longer outstanding
        void* freq = nullptr;
        if (auto fr = net_.iflush(rc_, n, data, sizes, mhs, &freq); fr != ncclSuccess)
          return "iflush returned " + res(fr);
        const auto until = Clock::now() + std::chrono::seconds(10);
        for (int fdone = 0; freq != nullptr && !fdone;) {
          if (auto tr = net_.test(freq, &fdone, nullptr); tr != ncclSuccess)
            return "test of an iflush returned " + res(tr);
          if (Clock::now() >= until) return "an iflush of host memory did not complete in 10 s";
        }
        continue;
      }
      recvs_.pop_front();
    }
    return "";
  }

  Net& net_;
  const Options& o_;
  const int max_n_;
  void* sc_;
  void* rc_;
  Pattern send_pattern_{}, recv_pattern_{};
  std::vector<Registered> send_, recv_;
  std::deque<SendReq> sends_;
  std::deque<RecvReq> recvs_;
  // Sender.
  long long send_group_ = 0;
  int send_elem_ = 0;
  std::size_t send_slot_ = 0;
  bool send_filled_ = false;
  long long end_group_ = -1;
  // Receiver.
  long long recv_group_ = 0;
  std::size_t recv_slot_ = 0;
  bool recv_prepared_ = false;
  Plan recv_plan_;
  long long recv_end_ = -1;
  long long recv_limit_ = -1;
  // Counts.
  unsigned long long sent_msgs_ = 0, sent_bytes_ = 0, recv_msgs_ = 0, recv_bytes_ = 0;
  unsigned long long send_retries_ = 0, recv_retries_ = 0;
  long long sent_groups_done_ = 0, recv_groups_done_ = 0;
  long long sent_normal_groups_ = 0, recv_normal_groups_ = 0;
};

// ------------------------------------------------------------------------------------ main

int fail(const std::string& why) {
  line("error " + why);
  return 1;
}

std::unique_ptr<Net> load(const Options& o, int* version) {
  void* so = ::dlopen(o.plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (so == nullptr) {
    line(format("error dlopen %s: %s", o.plugin.c_str(), ::dlerror()));
    return nullptr;
  }
  void* sym[13] = {};
  std::string have = "symbols";
  for (int v = 8; v <= 12; ++v) {
    const std::string s = "ncclNetPlugin_v" + std::to_string(v);
    sym[v] = ::dlsym(so, s.c_str());
    have += " " + s + (sym[v] ? "=yes" : "=no");
  }
  line(have);
  int v = o.version != 0 ? o.version : sym[12] ? 12 : 11;
  if (sym[v] == nullptr) {
    line(format("error the plugin does not export ncclNetPlugin_v%d", v));
    return nullptr;
  }
  *version = v;
  switch (v) {
    case 12:
      return std::make_unique<NetImpl<12, ncclNet_v12_t>>(static_cast<ncclNet_v12_t*>(sym[12]));
    case 11:
      return std::make_unique<NetImpl<11, ncclNet_v11_t>>(static_cast<ncclNet_v11_t*>(sym[11]));
    case 10:
      return std::make_unique<NetImpl<10, ncclNet_v10_t>>(static_cast<ncclNet_v10_t*>(sym[10]));
    case 9:
      return std::make_unique<NetImpl<9, ncclNet_v9_t>>(static_cast<ncclNet_v9_t*>(sym[9]));
    default:
      return std::make_unique<NetImpl<8, ncclNet_v8_t>>(static_cast<ncclNet_v8_t*>(sym[8]));
  }
}

std::string warn_text() {
  std::lock_guard lock(out_mutex);
  std::string s;
  for (const auto& w : warnings)
    s += (s.empty() ? "" : " | ") + w;
  return s;
}

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

long long ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t).count();
}

int bad_handle(Net& net, const Options& o) {
  phase = "bad-handle";
  Handle h{};
  if (auto err = read_handle(o.handle_in, after(30), &h); !err.empty()) return fail(err);
  const std::string what = corrupt(&h, o.bad_handle);
  if (what.empty())
    return fail(
        "the handle is not laid out as r2ccl's plugin handle (\"R2NP\", then \"R2EH\" at 10)");
  line("corrupted the handle: " + what);
  const auto t0 = Clock::now();
  const auto until = after(o.connect_deadline);
  void* sc = nullptr;
  for (;;) {
    const ncclResult_t r = net.connect(0, h.data(), &sc);
    if (r != ncclSuccess) {
      line(format("rejected %s handle after %lld ms: connect returned %s", o.bad_handle.c_str(),
                  ms_since(t0), res(r).c_str()));
      line("warnings: " + warn_text());
      line("ok bad-handle " + o.bad_handle);
      return 0;
    }
    if (sc != nullptr) {
      net.close_send(sc);
      return fail(format("connect with a %s handle succeeded after %lld ms", o.bad_handle.c_str(),
                         ms_since(t0)));
    }
    if (Clock::now() >= until)
      return fail(format("connect with a %s handle neither failed nor succeeded in %.0f s",
                         o.bad_handle.c_str(), o.connect_deadline));
    std::this_thread::sleep_for(milliseconds(1));
  }
}

int run(const Options& o) {
  phase = "init";
  int version = 0;
  auto net = load(o, &version);
  if (!net) return 1;
  line(format("version %d name %s", version, net->name()));
  if (auto m = net->missing(); !m.empty())
    return fail("the plugin's table has NULL functions: " + m);
  if (auto r = net->init(o.comm_id); r != ncclSuccess) return fail("init returned " + res(r));
  int ndev = 0;
  if (auto r = net->devices(&ndev); r != ncclSuccess) return fail("devices returned " + res(r));
  line(format("devices %d", ndev));
  if (ndev < 1) return fail("the plugin has no device");
  Props props;
  if (auto r = net->properties(0, &props); r != ncclSuccess)
    return fail("getProperties(0) returned " + res(r));
  line("properties dev 0: " + props.text);
  if (!(props.ptr_support & NCCL_PTR_HOST)) return fail("dev 0 does not support NCCL_PTR_HOST");
  const int max_n = std::max(1, std::min(o.max_recvs, props.max_recvs));

  if (!o.bad_handle.empty()) {
    const int rc = bad_handle(*net, o);
    net->finalize();
    return rc;
  }

  phase = "listen";
  Handle mine{};
  void* lc = nullptr;
  if (auto r = net->listen(0, mine.data(), &lc); r != ncclSuccess)
    return fail("listen returned " + res(r));
  if (lc == nullptr) return fail("listen returned no listen comm");
  if (!write_file(o.handle_out, to_hex(mine.data(), mine.size())))
    return fail("cannot write " + o.handle_out);
  line("listening; handle written to " + o.handle_out);

  if (o.listen_only > 0) {
    phase = "listen-only";
    const auto until = after(o.listen_only);
    void* rc = nullptr;
    while (Clock::now() < until && !std::filesystem::exists(o.handle_out + ".stop")) {
      if (auto r = net->accept(lc, &rc); r != ncclSuccess) {
        line("accept returned " + res(r) + " (a bad connection refused)");
        rc = nullptr;
      }
      if (rc != nullptr) {
        net->close_recv(rc);
        return fail("accept gave a comm to a connector that had a bad handle");
      }
      std::this_thread::sleep_for(milliseconds(2));
    }
    net->close_listen(lc);
    net->finalize();
    line("ok no-accept");
    return 0;
  }

  phase = "connect";
  const auto t0 = Clock::now();
  const auto until = after(o.connect_deadline);
  Handle peer{};
  if (auto err = read_handle(o.handle_in, until, &peer); !err.empty()) return fail(err);
  void* sc = nullptr;
  void* rc = nullptr;
  // One thread polls both, as NCCL's proxy does; the handle buffer stays the same across calls.
  while (sc == nullptr || rc == nullptr) {
    if (sc == nullptr)
      if (auto r = net->connect(0, peer.data(), &sc); r != ncclSuccess)
        return fail("connect returned " + res(r) + "; warnings: " + warn_text());
    if (rc == nullptr)
      if (auto r = net->accept(lc, &rc); r != ncclSuccess)
        return fail("accept returned " + res(r) + "; warnings: " + warn_text());
    if (sc != nullptr && rc != nullptr) break;
    if (Clock::now() >= until)
      return fail(format("connect/accept not done in %.0f s (send comm %s, recv comm %s)",
                         o.connect_deadline, sc ? "made" : "missing", rc ? "made" : "missing"));
    std::this_thread::sleep_for(milliseconds(1));
  }
  line(format("connected in %lld ms", ms_since(t0)));

  phase = "stream";
  Stream stream(*net, o, max_n, sc, rc);
  if (auto err = stream.setup(); !err.empty()) return fail(err);
  if (auto err = stream.run(); !err.empty()) {
    line("error " + err);
    line("warnings: " + warn_text());
    phase = "close after an error";
    stream.teardown();
    net->close_send(sc);
    net->close_recv(rc);
    net->close_listen(lc);
    net->finalize();
    line("closed after the error");
    return 1;
  }

  // Both ends verified: meet the peer before closing (NCCL closes only at the end).
  phase = "barrier";
  write_file(o.handle_out + ".done", "done");
  const auto meet_until = Clock::now() + std::chrono::seconds(30);
  while (!std::filesystem::exists(o.handle_in + ".done")) {
    if (Clock::now() >= meet_until) return fail("the peer did not finish its stream in 30 s");
    std::this_thread::sleep_for(milliseconds(20));
  }
  phase = "close";
  std::string err = stream.teardown();
  if (auto r = net->close_send(sc); r != ncclSuccess && err.empty())
    err = "closeSend returned " + res(r);
  if (auto r = net->close_recv(rc); r != ncclSuccess && err.empty())
    err = "closeRecv returned " + res(r);
  if (auto r = net->close_listen(lc); r != ncclSuccess && err.empty())
    err = "closeListen returned " + res(r);
  if (auto r = net->finalize(); r != ncclSuccess && err.empty())
    err = "finalize returned " + res(r);
  if (!err.empty()) return fail(err);
  line("ok " + stream.summary());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  start_watchdog(o.deadline);
  const int rc = run(o);
  finished = true;
  return rc;
}

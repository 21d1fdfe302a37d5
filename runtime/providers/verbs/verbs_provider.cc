// The verbs provider on rdma-core: one RC queue pair per rail.
//
// Devices: R2CCL_NICS names verbs devices (mlx5_0, rxe_h0n0); each is matched to the kernel
// interface under it (hwloc's PCI match, else sysfs: the GID table's netdevs, device/net), whose
// IPv4 address carries the connection handshake and the probes, and whose link state the link
// watcher follows. Port 1 is used.
//
// Memory: every region is registered on every device's protection domain up front, and nearly
// zero-based (ibv_reg_mr_iova with an I/O address of the start's offset in its page, which the
// kernel requires to match): the key is (that offset << 32 | rkey), so a peer addresses a region
// by (key, offset) exactly as with the tcp provider, and a failover never registers anything.
//
// Connection: the connector creates its queue pair and sends, over a short-lived TCP connection
// to the acceptor's handshake listener (the NIC's address), the rail hello and its QPN, PSN, LID,
// GID and MTU; the acceptor checks the token, creates and connects its queue pair, and answers
// with its own. The connector then sends READY through the queue pair itself: its completion
// proves the path and the peer's QPN end to end, and the acceptor hands the rail up when READY
// arrives — so neither side uses a rail whose far end cannot receive.
//
// Data: RDMA WRITE WITH IMM into the peer's region (its completion at the sender means the
// peer's NIC acknowledged the bytes in its memory; the immediate reaches the peer's handler).
// Control: SEND/RECV of 4 KiB slots (16-byte header; longer messages travel as fragments, in
// order on the one queue pair); a control message with a cookie is acknowledged by the peer
// after its handler ran.
//
// Failures: async events (PORT_ERR, DEVICE_FATAL, QP errors) and work-completion errors fail
// the rail; errors that mean a bug (the peer refused the access, a protection error) are told
// apart in the message and refuse the write concerned. A failed rail is fenced (QP to ERR) and
// its resources released; re-admission opens a new queue pair.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <span>
#include <unordered_map>

#include "common/handshake.h"
#include "common/pending_hellos.h"
#include "progress/asio.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/provider/provider.h"

namespace r2ccl {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

constexpr std::uint8_t kPort = 1;
constexpr std::uint32_t kSqDepth = 256;
constexpr std::uint32_t kRqDepth = 512;
constexpr std::uint32_t kSendSlots = 64;
constexpr std::size_t kSlot = 4096;
constexpr std::size_t kSlotHeader = 16;
constexpr std::size_t kSlotPayload = kSlot - kSlotHeader;
constexpr std::uint64_t kMaxControl = 1u << 20;
constexpr std::uint32_t kHandshakeMagic = 0x52325642;  // "R2VB"
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);

// wr_id: the kind in the top byte, an index below.
enum class WrKind : std::uint8_t { kWrite = 1, kSend = 2, kRecv = 3 };
std::uint64_t wr_id(WrKind k, std::uint64_t index) {
  return (static_cast<std::uint64_t>(k) << 56) | index;
}
WrKind wr_kind(std::uint64_t id) {
  return static_cast<WrKind>(id >> 56);
}
std::uint64_t wr_index(std::uint64_t id) {
  return id & ((1ull << 56) - 1);
}

// Slot header: u8 type | u8 flags | u16 0 | u32 length | u64 cookie.
enum class SlotType : std::uint8_t { kControl = 1, kControlAck = 2, kReady = 3 };
constexpr std::uint8_t kMoreFragments = 1;

template <auto Fn>
struct Deleter {
  template <class T>
  void operator()(T* p) const {
    if (p != nullptr) (void)Fn(p);
  }
};
using ContextPtr = std::unique_ptr<ibv_context, Deleter<ibv_close_device>>;
using PdPtr = std::unique_ptr<ibv_pd, Deleter<ibv_dealloc_pd>>;
using MrPtr = std::unique_ptr<ibv_mr, Deleter<ibv_dereg_mr>>;
using CqPtr = std::unique_ptr<ibv_cq, Deleter<ibv_destroy_cq>>;
using QpPtr = std::unique_ptr<ibv_qp, Deleter<ibv_destroy_qp>>;
using ChannelPtr = std::unique_ptr<ibv_comp_channel, Deleter<ibv_destroy_comp_channel>>;
using DeviceListPtr = std::unique_ptr<ibv_device*, Deleter<ibv_free_device_list>>;

std::string errno_text(int e) {
  return std::strerror(e);
}

std::uint64_t page_size() {
  static const auto n = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return n;
}

bool set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

std::string gid_text(const ibv_gid& g) {
  char buf[64];
  if (::inet_ntop(AF_INET6, g.raw, buf, sizeof buf) == nullptr) return "?";
  return buf;
}

bool gid_is_zero(const ibv_gid& g) {
  return std::all_of(std::begin(g.raw), std::end(g.raw), [](std::uint8_t b) { return b == 0; });
}

std::string read_line(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::string s;
  std::getline(f, s);
  return s;
}

// The kernel interface under a verbs device: hwloc's PCI match first, then sysfs.
std::string netdev_of(const Topology& topo, const std::string& dev) {
  for (const auto& i : topo.interfaces)
    if (i.verbs_device == dev) return i.name;
  std::error_code ec;
  const std::filesystem::path base = std::filesystem::path("/sys/class/infiniband") / dev;
  const auto ndevs = base / "ports" / std::to_string(kPort) / "gid_attrs" / "ndevs";
  for (int i = 0; i < 16; ++i) {
    auto s = read_line(ndevs / std::to_string(i));
    if (!s.empty()) return s;
  }
  for (const auto& e : std::filesystem::directory_iterator(base / "device" / "net", ec))
    return e.path().filename().string();
  return {};
}

// One opened verbs device (port 1): context, protection domain, addressing, registrations.
struct VerbsDevice {
  RailNic nic;
  std::string name;
  ContextPtr ctx;
  PdPtr pd;
  ibv_port_attr port{};
  int gid_index = 0;
  ibv_gid gid{};
  bool roce = false;
  struct Registration {
    std::size_t length = 0;
    std::uint64_t iova = 0;  // the I/O address of its first byte
    MrPtr mr;
  };
  std::mutex mutex;  // registrations (any thread)
  std::multimap<std::uintptr_t, Registration> by_addr;
  std::unordered_map<std::uint32_t, std::uintptr_t> by_rkey;

  // A local scatter/gather entry for [p, p+len), when a registration holds it.
  std::optional<ibv_sge> sge_of(const std::byte* p, std::size_t len) {
    std::lock_guard lock(mutex);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = by_addr.upper_bound(a);
    // Regions may nest or share a start: look back through those that start at or before `p`,
    // nearest first (a hit is usually the first; a miss, an error, looks at every one).
    while (it != by_addr.begin()) {
      --it;
      if (a + len <= it->first + it->second.length) {
        ibv_sge sge{};
        sge.addr = it->second.iova + (a - it->first);  // MRs are addressed by I/O address
        sge.length = static_cast<std::uint32_t>(len);
        sge.lkey = it->second.mr->lkey;
        return sge;
      }
    }
    return std::nullopt;
  }
};
using DevicePtr = std::shared_ptr<VerbsDevice>;

// What one side tells the other to connect a queue pair.
struct QpInfo {
  std::uint32_t qpn = 0;
  std::uint32_t psn = 0;
  std::uint16_t lid = 0;
  std::uint8_t mtu = 0;
  ibv_gid gid{};
  void encode(ByteWriter& w) const {
    w.u32(qpn).u32(psn).u16(lid).u8(mtu).raw(gid.raw, sizeof gid.raw);
  }
  static QpInfo decode(ByteReader& r) {
    QpInfo q;
    q.qpn = r.u32();
    q.psn = r.u32();
    q.lid = r.u16();
    q.mtu = r.u8();
    r.raw(q.gid.raw, sizeof q.gid.raw);
    return q;
  }
  Status validate() const {
    if (qpn == 0 || qpn == 1 || qpn >= (1u << 24))
      return {
          ErrorCode::kProtocol,
          fmt::format("the peer sent an invalid QPN 0x{:x} (RC queue pairs are 2..0xffffff)", qpn)};
    if (psn >= (1u << 24))
      return {ErrorCode::kProtocol, fmt::format("the peer sent an invalid PSN 0x{:x}", psn)};
    if (mtu < IBV_MTU_256 || mtu > IBV_MTU_4096)
      return {ErrorCode::kProtocol, fmt::format("the peer sent an invalid path MTU code {}", mtu)};
    return Status::ok();
  }
};

std::string wc_text(const ibv_wc& wc) {
  return fmt::format("{} (status {}, vendor error 0x{:x})", ibv_wc_status_str(wc.status),
                     static_cast<int>(wc.status), wc.vendor_err);
}

// Completion errors that mean this process or its peer has a bug (an access outside what was
// registered or allowed), as opposed to those that mean the path or the queue pair is gone
// (RETRY_EXC_ERR, LOC_QP_OP_ERR, WR_FLUSH_ERR, RNR_RETRY_EXC_ERR, REM_INV_REQ_ERR, ...), after
// which the rail fails over and its unconfirmed writes are replayed elsewhere. REM_INV_REQ_ERR
// stays on the fail-over side: Soft-RoCE reports it for a write whose packets it mis-tracked
// during retransmission, and a replay is the remedy; a write that is wrong everywhere still
// ends at the operation's deadline with every rail's reason.
bool is_bug(ibv_wc_status s) {
  return s == IBV_WC_REM_ACCESS_ERR || s == IBV_WC_LOC_PROT_ERR || s == IBV_WC_LOC_LEN_ERR ||
         s == IBV_WC_MW_BIND_ERR || s == IBV_WC_LOC_ACCESS_ERR;
}

class VerbsRail : public Rail, public std::enable_shared_from_this<VerbsRail> {
 public:
  VerbsRail(ProgressEngine& engine, DevicePtr dev, const Config& cfg, RailHello hello)
      : engine_(engine),
        dev_(std::move(dev)),
        timeout_(cfg.ib_timeout),
        retry_cnt_(cfg.ib_retry_cnt),
        hello_(hello) {}
  ~VerbsRail() override { release(); }

  // Creates the queue pair (INIT) and its buffers; loop thread.
  Status create() {
    channel_.reset(ibv_create_comp_channel(dev_->ctx.get()));
    if (!channel_) return fail_errno("ibv_create_comp_channel");
    if (!set_nonblocking(channel_->fd)) return fail_errno("fcntl(O_NONBLOCK)");
    cq_.reset(ibv_create_cq(dev_->ctx.get(), static_cast<int>(kSqDepth + kRqDepth + 16), nullptr,
                            channel_.get(), 0));
    if (!cq_) return fail_errno("ibv_create_cq");
    ibv_qp_init_attr qa{};
    qa.send_cq = cq_.get();
    qa.recv_cq = cq_.get();
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = kSqDepth;
    qa.cap.max_recv_wr = kRqDepth;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    qp_.reset(ibv_create_qp(dev_->pd.get(), &qa));
    if (!qp_) return fail_errno("ibv_create_qp");
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = kPort;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    if (int e = ibv_modify_qp(qp_.get(), &a,
                              IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
      return fail_code("moving the queue pair to INIT", e);
    slots_.resize((kSendSlots + kRqDepth) * kSlot);
    slots_mr_.reset(
        ibv_reg_mr(dev_->pd.get(), slots_.data(), slots_.size(), int{IBV_ACCESS_LOCAL_WRITE}));
    if (!slots_mr_) return fail_errno("registering the control buffers");
    for (std::uint32_t i = 0; i < kSendSlots; ++i)
      free_slots_.push_back(i);
    for (std::uint32_t i = 0; i < kRqDepth; ++i)
      if (Status st = post_recv(i); !st) return st;
    local_.qpn = qp_->qp_num;
    local_.psn = std::random_device{}() & 0xffffffu;
    local_.lid = dev_->port.lid;
    local_.mtu = static_cast<std::uint8_t>(dev_->port.active_mtu);
    local_.gid = dev_->gid;
    return Status::ok();
  }

  const QpInfo& local() const { return local_; }

  // INIT -> RTR -> RTS towards `remote`.
  Status connect_qp(const QpInfo& remote) {
    R2CCL_RETURN_IF_ERROR(remote.validate());
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = static_cast<ibv_mtu>(std::min(local_.mtu, remote.mtu));
    a.dest_qp_num = remote.qpn;
    a.rq_psn = remote.psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;  // 0.64 ms
    a.ah_attr.port_num = kPort;
    a.ah_attr.dlid = remote.lid;
    if (dev_->roce || !gid_is_zero(remote.gid)) {
      a.ah_attr.is_global = 1;
      a.ah_attr.grh.dgid = remote.gid;
      a.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(dev_->gid_index);
      a.ah_attr.grh.hop_limit = 64;
    }
    if (int e = ibv_modify_qp(qp_.get(), &a,
                              IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      return fail_code(fmt::format("moving the queue pair to RTR towards QPN 0x{:x} GID {}",
                                   remote.qpn, gid_text(remote.gid)),
                       e);
    ibv_qp_attr s{};
    s.qp_state = IBV_QPS_RTS;
    s.timeout = static_cast<std::uint8_t>(timeout_);
    s.retry_cnt = static_cast<std::uint8_t>(retry_cnt_);
    s.rnr_retry = 7;  // receiver-not-ready: wait for the peer to repost, however long
    s.sq_psn = local_.psn;
    s.max_rd_atomic = 1;
    if (int e = ibv_modify_qp(qp_.get(), &s,
                              IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
      return fail_code("moving the queue pair to RTS", e);
    describe_ = fmt::format("{} QPN 0x{:x} -> QPN 0x{:x} GID {}", dev_->name, local_.qpn,
                            remote.qpn, gid_text(remote.gid));
    return Status::ok();
  }

  // Starts reading completions (before the rail has an owner: READY and its completion).
  void arm() {
    if (fd_) return;
    fd_.emplace(engine_.io(), channel_->fd);
    (void)ibv_req_notify_cq(cq_.get(), 0);
    wait_for_completions();
  }

  // Connector: sends READY; `done` runs when the peer's NIC acknowledged it (or it failed).
  void send_ready(std::function<void(Status)> done) {
    ready_done_ = std::move(done);
    // READY carries the two incarnations only (never the token): its arrival is what counts.
    ByteWriter w;
    w.u64(hello_.src_incarnation).u64(hello_.dst_incarnation);
    send_fragment(SlotType::kReady, 0, 0, w.bytes());
  }
  // Acceptor: runs when READY arrives.
  void on_ready(std::function<void()> f) { on_ready_ = std::move(f); }

  void start(RailEvents* events) override {
    events_ = events;
    // Control messages that arrived before the owner did.
    auto early = std::move(early_);
    for (auto& m : early) {
      if (fenced_) return;
      deliver_control(std::move(m.first), m.second);
    }
  }

  // Back-pressure: past the send queue, posts wait here; one is refused (kNoResource) while this
  // much waits already.
  static constexpr std::size_t kMaxPendingBytes = std::size_t{64} << 20;
  static constexpr std::size_t kMaxPendingPosts = 16384;

  Status post_write(const WriteRequest& w) override {
    if (fenced_) return {ErrorCode::kUnavailable, "rail is fenced"};
    auto sge = dev_->sge_of(w.src, w.length);
    if (!sge)
      return {ErrorCode::kInvalidArgument,
              fmt::format("write source {} (+{} bytes) is not in memory registered on {}",
                          static_cast<const void*>(w.src), w.length, dev_->name)};
    if (Status st = room_for(w.length, 1); !st) return st;
    enqueue(Pending{true, w, *sge, {}});
    flush();
    return Status::ok();
  }

  Status post_control(std::shared_ptr<const Bytes> shared, std::uint64_t cookie) override {
    return queue_control(*shared, cookie, false);
  }
  // In order (the queue is not reordered), but never refused for back-pressure: the channel's
  // failover messages must get through a full queue.
  Status post_urgent_control(std::shared_ptr<const Bytes> shared, std::uint64_t cookie) override {
    return queue_control(*shared, cookie, true);
  }

  Status queue_control(const Bytes& message, std::uint64_t cookie, bool urgent) {
    if (fenced_) return {ErrorCode::kUnavailable, "rail is fenced"};
    if (message.size() > kMaxControl)
      return {ErrorCode::kInvalidArgument,
              fmt::format("control message of {} bytes exceeds {}", message.size(), kMaxControl)};
    if (!urgent) {
      if (Status st = room_for(message.size(), (message.size() + kSlotPayload - 1) / kSlotPayload);
          !st)
        return st;
    }
    std::size_t off = 0;
    do {
      const std::size_t n = std::min(kSlotPayload, message.size() - off);
      const bool more = off + n < message.size();
      send_fragment(SlotType::kControl, more ? kMoreFragments : 0, cookie,
                    std::span<const std::byte>(message).subspan(off, n));
      off += n;
    } while (off < message.size());
    return Status::ok();
  }

  void fence() override {
    if (fenced_) return;
    fenced_ = true;
    if (qp_) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      (void)ibv_modify_qp(qp_.get(), &a, IBV_QP_STATE);
    }
    // Writes whose arrival is still in the completion queue were acknowledged to the sender,
    // which will not replay them: report them now (arrivals are idempotent). Nothing can land
    // after the queue pair is in error, so this is the last of them.
    if (events_ && cq_) {
      ibv_wc wc{};
      while (ibv_poll_cq(cq_.get(), 1, &wc) == 1)
        if (wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
            wr_kind(wc.wr_id) == WrKind::kRecv)
          events_->on_write_arrived(ntohl(wc.imm_data), wc.byte_len);
    }
    events_ = nullptr;
    pending_.clear();
    pending_bytes_ = 0;
    // Resources go once the completion handler (which holds a reference) has let go.
    if (fd_) {
      error_code ec;
      fd_->cancel(ec);
    }
    engine_.post([self = shared_from_this()] { self->release(); });
  }

  const RailHello& hello() const override { return hello_; }
  std::string describe() const override { return describe_; }
  std::string remote_address() const override { return remote_address_; }
  // The peer's address of the handshake connection (loop thread, before the rail is handed out).
  void set_remote_address(std::string address) { remote_address_ = std::move(address); }
  const DevicePtr& device() const { return dev_; }
  std::uint32_t qpn() const { return qp_ ? qp_->qp_num : 0; }

  // The rail's NIC or queue pair failed (async event).
  void fail(const std::string& why) {
    if (fenced_) return;
    auto* ev = events_;
    auto ready = std::move(ready_done_);
    fence();
    if (ready) ready(Status(ErrorCode::kNetwork, why));
    if (ev) ev->on_rail_failed(Status(ErrorCode::kNetwork, why));
  }

 private:
  struct Pending {
    bool write = false;
    WriteRequest w;
    ibv_sge sge{};
    Bytes slot;  // a control fragment, header included
  };

  // kNoResource where `bytes` more in `posts` more entries would take the queue past its bounds
  // (a single post larger than the bound is let into an empty queue).
  Status room_for(std::size_t bytes, std::size_t posts) const {
    if (pending_.empty()) return Status::ok();
    if (pending_bytes_ + bytes <= kMaxPendingBytes && pending_.size() + posts <= kMaxPendingPosts)
      return Status::ok();
    return {ErrorCode::kNoResource,
            fmt::format("rail {} has {} posts ({} bytes) queued behind its full send queue",
                        describe_, pending_.size(), pending_bytes_)};
  }
  static std::size_t cost(const Pending& p) { return p.write ? p.w.length : p.slot.size(); }
  void enqueue(Pending p) {
    pending_bytes_ += cost(p);
    pending_.push_back(std::move(p));
  }

  Status fail_errno(const std::string& what) { return fail_code(what, errno); }
  Status fail_code(const std::string& what, int e) {
    return {ErrorCode::kNetwork, fmt::format("{} on {}: {}", what, dev_->name, errno_text(e))};
  }

  void release() {
    if (fd_) {
      error_code ec;
      fd_->cancel(ec);
      (void)fd_->release();  // the descriptor belongs to the completion channel
      fd_.reset();           // (and the io object must not outlive the loop)
    }
    qp_.reset();
    slots_mr_.reset();
    if (cq_ && unacked_ > 0) ibv_ack_cq_events(cq_.get(), unacked_);
    unacked_ = 0;
    cq_.reset();
    channel_.reset();
  }

  std::byte* slot(std::uint32_t i) { return slots_.data() + static_cast<std::size_t>(i) * kSlot; }
  std::byte* recv_slot(std::uint32_t i) { return slot(kSendSlots + i); }

  Status post_recv(std::uint32_t i) {
    ibv_sge sge{};
    sge.addr = reinterpret_cast<std::uintptr_t>(recv_slot(i));
    sge.length = kSlot;
    sge.lkey = slots_mr_->lkey;
    ibv_recv_wr wr{};
    wr.wr_id = wr_id(WrKind::kRecv, i);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_recv(qp_.get(), &wr, &bad)) return fail_code("ibv_post_recv", e);
    return Status::ok();
  }

  void send_fragment(SlotType type, std::uint8_t flags, std::uint64_t cookie,
                     std::span<const std::byte> body) {
    ByteWriter w;
    w.u8(static_cast<std::uint8_t>(type))
        .u8(flags)
        .u16(0)
        .u32(static_cast<std::uint32_t>(body.size()))
        .u64(cookie)
        .raw(body.data(), body.size());
    enqueue(Pending{false, {}, {}, w.take()});
    flush();
  }

  // Posts queued work while the send queue and the send slots allow.
  void flush() {
    while (!pending_.empty() && !fenced_ && sq_used_ < kSqDepth) {
      auto& p = pending_.front();
      ibv_sge sge{};
      ibv_send_wr wr{};
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.sg_list = &sge;
      if (p.write) {
        std::uint32_t idx;
        if (!free_writes_.empty()) {
          idx = free_writes_.back();
          free_writes_.pop_back();
        } else {
          idx = static_cast<std::uint32_t>(writes_.size());
          writes_.emplace_back();
        }
        writes_[idx] = p.w;
        sge = p.sge;
        wr.num_sge = p.w.length > 0 ? 1 : 0;
        wr.wr_id = wr_id(WrKind::kWrite, idx);
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(p.w.imm);
        wr.wr.rdma.remote_addr = (p.w.remote_key >> 32) + p.w.remote_offset;
        wr.wr.rdma.rkey = static_cast<std::uint32_t>(p.w.remote_key);
      } else {
        if (free_slots_.empty()) return;
        const auto s = free_slots_.back();
        free_slots_.pop_back();
        std::memcpy(slot(s), p.slot.data(), p.slot.size());
        sge.addr = reinterpret_cast<std::uintptr_t>(slot(s));
        sge.length = static_cast<std::uint32_t>(p.slot.size());
        sge.lkey = slots_mr_->lkey;
        wr.num_sge = 1;
        wr.wr_id = wr_id(WrKind::kSend, s);
        wr.opcode = IBV_WR_SEND;
      }
      ibv_send_wr* bad = nullptr;
      if (int e = ibv_post_send(qp_.get(), &wr, &bad)) {
        fail(fmt::format("ibv_post_send on {}: {}", dev_->name, errno_text(e)));
        return;
      }
      ++sq_used_;
      pending_bytes_ -= cost(p);
      pending_.pop_front();
    }
  }

  void wait_for_completions() {
    fd_->async_wait(asio::posix::stream_descriptor::wait_read,
                    [self = shared_from_this()](error_code ec) {
                      if (ec || self->fenced_ || !self->cq_) return;
                      self->drain_events();
                      if (!self->fenced_) self->wait_for_completions();
                    });
  }

  void drain_events() {
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (ibv_get_cq_event(channel_.get(), &cq, &ctx) == 0)
      if (++unacked_ >= 64) {
        ibv_ack_cq_events(cq_.get(), unacked_);
        unacked_ = 0;
      }
    (void)ibv_req_notify_cq(cq_.get(), 0);
    poll();
  }

  // One completion at a time: a handler may fence the rail, and fence() must find every
  // completion not handled yet still in the queue.
  void poll() {
    ibv_wc wc{};
    while (!fenced_ && ibv_poll_cq(cq_.get(), 1, &wc) == 1)
      on_completion(wc);
    flush();
  }

  void on_completion(const ibv_wc& wc) {
    const auto kind = wr_kind(wc.wr_id);
    const auto idx = wr_index(wc.wr_id);
    if (kind == WrKind::kWrite || kind == WrKind::kSend) --sq_used_;
    if (wc.status != IBV_WC_SUCCESS) return on_error(wc, kind, idx);
    switch (kind) {
      case WrKind::kWrite: {
        const auto cookie = writes_[idx].cookie;
        free_writes_.push_back(static_cast<std::uint32_t>(idx));
        if (events_) events_->on_write_confirmed(cookie, 0);
        return;
      }
      case WrKind::kSend: {
        free_slots_.push_back(static_cast<std::uint32_t>(idx));
        if (ready_done_) {  // READY is a connector's first send, so its first completion
          auto done = std::move(ready_done_);
          done(Status::ok());
        }
        return;
      }
      case WrKind::kRecv:
        return on_receive(wc, static_cast<std::uint32_t>(idx));
    }
    fail(fmt::format("completion with an unknown work request id 0x{:x}", wc.wr_id));
  }

  void on_error(const ibv_wc& wc, WrKind kind, std::uint64_t idx) {
    const std::string op = kind == WrKind::kWrite  ? "RDMA write"
                           : kind == WrKind::kSend ? "send"
                                                   : "receive";
    if (is_bug(wc.status)) {
      // Not a NIC fault: the access itself is wrong. The write is refused with that reason; the
      // queue pair is in error now, so the rail still has to go (its other work is replayed).
      std::string why = fmt::format(
          "{} on {} failed: {} — the access is invalid (a bug, not a "
          "NIC fault)",
          op, describe_, wc_text(wc));
      if (kind == WrKind::kWrite) {
        const auto& w = writes_[idx];
        why = fmt::format(
            "RDMA write of {} bytes at offset {} with key 0x{:x} on {} was "
            "refused: {} — the access is invalid (a bug, not a NIC fault)",
            w.length, w.remote_offset, w.remote_key, describe_, wc_text(wc));
        R2CCL_ERROR("{}", why);
        if (events_) events_->on_write_refused(w.cookie, {ErrorCode::kProtocol, why});
      } else {
        R2CCL_ERROR("{}", why);
      }
      return fail(fmt::format("queue pair in error after: {}", why));
    }
    if (wc.status == IBV_WC_WR_FLUSH_ERR)
      return fail(fmt::format("{} flushed: the queue pair of {} is in error", op, describe_));
    fail(fmt::format("{} on {} failed: {}{}", op, describe_, wc_text(wc),
                     wc.status == IBV_WC_RETRY_EXC_ERR
                         ? " — the peer's queue pair did not answer (path down, or a wrong "
                           "QPN/GID)"
                         : ""));
  }

  void on_receive(const ibv_wc& wc, std::uint32_t idx) {
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      const auto imm = ntohl(wc.imm_data);
      const auto len = wc.byte_len;
      if (Status st = post_recv(idx); !st) return fail(st.message());
      if (events_) events_->on_write_arrived(imm, len);
      return;
    }
    if (wc.byte_len < kSlotHeader) return fail("malformed control slot (shorter than its header)");
    ByteReader r(std::span<const std::byte>(recv_slot(idx), wc.byte_len));
    const auto type = static_cast<SlotType>(r.u8());
    const auto flags = r.u8();
    (void)r.u16();
    const auto len = r.u32();
    const auto cookie = r.u64();
    if (len != wc.byte_len - kSlotHeader)
      return fail(
          fmt::format("malformed control slot: length {} in a {}-byte receive", len, wc.byte_len));
    const std::byte* body = recv_slot(idx) + kSlotHeader;
    partial_.insert(partial_.end(), body, body + len);
    if (Status st = post_recv(idx); !st) return fail(st.message());
    if (partial_.size() > kMaxControl) return fail("control message exceeds 1 MiB");
    if ((flags & kMoreFragments) != 0) return;
    Bytes msg = std::move(partial_);
    partial_.clear();
    switch (type) {
      case SlotType::kReady:
        if (on_ready_) {
          auto f = std::move(on_ready_);
          f();
        }
        return;
      case SlotType::kControlAck:
        if (events_) events_->on_write_confirmed(cookie, 0);
        return;
      case SlotType::kControl:
        if (!events_) {
          early_.emplace_back(std::move(msg), cookie);
          return;
        }
        return deliver_control(std::move(msg), cookie);
    }
    fail(fmt::format("malformed control slot: type {}", static_cast<int>(type)));
  }

  void deliver_control(Bytes msg, std::uint64_t cookie) {
    auto self = shared_from_this();  // the handler may fence this rail
    if (events_) events_->on_control(msg);
    if (cookie != 0 && !fenced_) send_fragment(SlotType::kControlAck, 0, cookie, {});
  }

  ProgressEngine& engine_;
  DevicePtr dev_;
  int timeout_;
  int retry_cnt_;
  RailHello hello_;
  std::optional<asio::posix::stream_descriptor> fd_;
  ChannelPtr channel_;
  CqPtr cq_;
  QpPtr qp_;
  std::vector<std::byte> slots_;
  MrPtr slots_mr_;
  std::vector<std::uint32_t> free_slots_;
  std::vector<WriteRequest> writes_;  // posted writes by index
  std::vector<std::uint32_t> free_writes_;
  std::deque<Pending> pending_;
  std::size_t pending_bytes_ = 0;  // of the writes and control fragments in pending_
  std::uint32_t sq_used_ = 0;
  unsigned unacked_ = 0;
  QpInfo local_;
  std::string describe_;
  std::string remote_address_;
  RailEvents* events_ = nullptr;
  bool fenced_ = false;
  Bytes partial_;
  std::vector<std::pair<Bytes, std::uint64_t>> early_;
  std::function<void(Status)> ready_done_;
  std::function<void()> on_ready_;
};

class VerbsProvider final : public Provider {
 public:
  VerbsProvider(ProgressEngine& engine, const Config& cfg, const Token& token)
      : engine_(engine), cfg_(cfg), token_(token) {}

  ~VerbsProvider() override {
    engine_.call([this] {
      // Handshakes still under way end here: their handlers see `done` and touch nothing more.
      for (auto& w : handshakes_)
        if (auto hs = w.lock()) {
          error_code ec;
          hs->done = true;
          hs->timer.cancel();
          hs->socket.close(ec);
          if (hs->rail) hs->rail->fence();
        }
      handshakes_.clear();
      for (auto& d : state_) {
        error_code ec;
        d->acceptor.close(ec);
        d->async_fd.cancel(ec);
        (void)d->async_fd.release();
        for (auto& w : d->rails)
          if (auto r = w.lock()) r->fence();
        d->rails.clear();
      }
    });
    // Rails fenced above release their queue pairs on the loop; run it dry before the devices go.
    engine_.call([] {});
    state_.clear();
  }

  Status open(const Topology& topo) {
    int n = 0;
    DeviceListPtr list(ibv_get_device_list(&n));
    if (!list)
      return {ErrorCode::kUnavailable,
              fmt::format("no verbs devices: ibv_get_device_list failed: {}", errno_text(errno))};
    std::vector<std::string> have;
    for (int i = 0; i < n; ++i)
      have.push_back(ibv_get_device_name(list.get()[i]));
    std::vector<std::string> want = cfg_.nics;
    if (want.empty()) want = have;
    if (want.empty())
      return {ErrorCode::kUnavailable,
              "R2CCL_PROVIDER=verbs: this host has no verbs device (ibv_get_device_list is empty)"};
    for (const auto& name : want) {
      auto it = std::find(have.begin(), have.end(), name);
      if (it == have.end())
        return {ErrorCode::kConfig,
                fmt::format(
                    "R2CCL_NICS: no verbs device named '{}' (have: {})", name,
                    have.empty() ? std::string("none") : fmt::format("{}", fmt::join(have, ", ")))};
      R2CCL_ASSIGN_OR_RETURN(auto dev, open_device(list.get()[it - have.begin()], name, topo));
      devices_.push_back(dev->nic);
      auto st = std::make_unique<DeviceState>(engine_.io(), std::move(dev));
      state_.push_back(std::move(st));
    }
    for (auto& d : state_) {
      error_code ec;
      tcp::endpoint ep(asio::ip::make_address_v4(d->dev->nic.address, ec), 0);
      if (!ec) d->acceptor.open(ep.protocol(), ec);
      if (!ec) d->acceptor.bind(ep, ec);
      if (!ec) d->acceptor.listen(asio::socket_base::max_listen_connections, ec);
      if (ec)
        return {ErrorCode::kNetwork, fmt::format("cannot listen for rail handshakes on {} ({}): {}",
                                                 d->dev->name, d->dev->nic.address, ec.message())};
      d->port = d->acceptor.local_endpoint().port();
      if (!set_nonblocking(d->dev->ctx->async_fd))
        return {ErrorCode::kNetwork, fmt::format("fcntl on {}'s async fd", d->dev->name)};
      d->async_fd.assign(d->dev->ctx->async_fd);
    }
    engine_.call([this] {
      for (std::size_t i = 0; i < state_.size(); ++i) {
        accept(i);
        watch_async(i);
      }
    });
    return Status::ok();
  }

  std::string_view name() const override { return "verbs"; }
  // Not kCapRegistrationFollowsMappings: ibv_reg_mr without IBV_ACCESS_ON_DEMAND pins the pages
  // the range maps when it is registered.
  std::uint32_t capabilities() const override { return 0; }
  const std::vector<RailNic>& devices() const override { return devices_; }

  Result<std::uint64_t> register_memory(std::size_t device, void* base, std::size_t length,
                                        MemoryAccess access, const DeviceMemory* memory) override {
    if (device >= state_.size())
      return Status(ErrorCode::kInvalidArgument, fmt::format("no device {}", device));
    if (memory != nullptr)
      return Status(ErrorCode::kInvalidArgument,
                    fmt::format("the verbs provider cannot register {} ({} bytes at {}): "
                                "GPUDirect RDMA is not built; use R2CCL_PROVIDER=tcp, which "
                                "stages device memory through the host",
                                memory->describe(), length, base));
    auto& d = *state_[device]->dev;
    // A zero-length region still needs an MR to hand out a key: register one byte of it.
    static std::byte dummy{};
    void* p = base != nullptr ? base : &dummy;
    // Zero-based as far as the kernel allows: the I/O address keeps the offset within the page.
    const std::uint64_t iova = reinterpret_cast<std::uintptr_t>(p) & (page_size() - 1);
    // The NIC refuses a peer's RDMA write into memory registered without REMOTE_WRITE.
    const int flags = access == MemoryAccess::kRemoteWrite
                          ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
                          : int{IBV_ACCESS_LOCAL_WRITE};
    MrPtr mr(ibv_reg_mr_iova(d.pd.get(), p, std::max<std::size_t>(length, 1), iova, flags));
    if (!mr)
      return Status(ErrorCode::kUnavailable, fmt::format("ibv_reg_mr of {} bytes on {}: {}", length,
                                                         d.name, errno_text(errno)));
    const auto rkey = mr->rkey;
    std::lock_guard lock(d.mutex);
    const auto addr = reinterpret_cast<std::uintptr_t>(base);
    d.by_rkey[rkey] = addr;
    d.by_addr.emplace(addr, VerbsDevice::Registration{length, iova, std::move(mr)});
    return (iova << 32) | rkey;
  }

  Status deregister_memory(std::size_t device, std::uint64_t key) override {
    if (device >= state_.size())
      return {ErrorCode::kInvalidArgument, fmt::format("no device {}", device)};
    auto& d = *state_[device]->dev;
    std::lock_guard lock(d.mutex);
    const auto rkey = static_cast<std::uint32_t>(key);
    auto it = d.by_rkey.find(rkey);
    if (it == d.by_rkey.end())
      return {ErrorCode::kNotFound, fmt::format("key 0x{:x} is not registered on {}", key, d.name)};
    auto [lo, hi] = d.by_addr.equal_range(it->second);
    for (auto m = lo; m != hi; ++m)
      if (m->second.mr->rkey == rkey) {
        d.by_addr.erase(m);
        break;
      }
    d.by_rkey.erase(it);
    return Status::ok();
  }

  Bytes endpoint(std::size_t device) const override {
    return encode_endpoint(state_[device]->dev->nic.address, state_[device]->port);
  }

  void set_accept_handler(AcceptHandler handler) override {
    engine_.call([&] { accept_handler_ = std::move(handler); });
  }

  void connect(std::size_t device, const Bytes& remote, const RailHello& hello,
               std::chrono::milliseconds timeout, ConnectHandler handler) override {
    auto ep = decode_endpoint(remote, name());
    engine_.post([this, device, ep = std::move(ep), hello, timeout,
                  handler = std::move(handler)]() mutable {
      if (!ep) return handler(ep.status());
      if (device >= state_.size())
        return handler(Status(ErrorCode::kInvalidArgument, fmt::format("no device {}", device)));
      start_connect(device, *ep, hello, timeout, std::move(handler));
    });
  }

  ProviderCounters counters() const override { return counters_.snapshot(); }

 private:
  struct DeviceState {
    DeviceState(asio::io_context& io, DevicePtr d)
        : dev(std::move(d)), acceptor(io), async_fd(io) {}
    DevicePtr dev;
    tcp::acceptor acceptor;
    std::uint16_t port = 0;
    asio::posix::stream_descriptor async_fd;
    std::vector<std::weak_ptr<VerbsRail>> rails;  // loop thread
  };

  struct Handshake {
    Handshake(asio::io_context& io, tcp::socket s) : socket(std::move(s)), timer(io) {}
    tcp::socket socket;
    asio::steady_timer timer;
    std::array<std::byte, 8> head{};
    Bytes body;
    Bytes out;
    std::shared_ptr<VerbsRail> rail;
    crypto::Nonce challenge{};
    crypto::Nonce client{};
    bool done = false;
    // An accepted connection's: whence (the address, and with the port) and on which NIC.
    std::string source;
    std::string from;
    std::string nic;
  };

  Result<DevicePtr> open_device(ibv_device* device, const std::string& name, const Topology& topo) {
    auto d = std::make_shared<VerbsDevice>();
    d->name = name;
    d->ctx.reset(ibv_open_device(device));
    if (!d->ctx)
      return Status(ErrorCode::kUnavailable,
                    fmt::format("cannot open verbs device {}: {}", name, errno_text(errno)));
    d->pd.reset(ibv_alloc_pd(d->ctx.get()));
    if (!d->pd)
      return Status(ErrorCode::kUnavailable,
                    fmt::format("ibv_alloc_pd on {}: {}", name, errno_text(errno)));
    if (int e = ibv_query_port(d->ctx.get(), kPort, &d->port))
      return Status(ErrorCode::kUnavailable,
                    fmt::format("ibv_query_port({}, {}): {}", name, kPort, errno_text(e)));
    d->roce = d->port.link_layer == IBV_LINK_LAYER_ETHERNET;
    d->nic.name = name;
    d->nic.netdev = netdev_of(topo, name);
    for (const auto& i : topo.interfaces)
      if (i.name == d->nic.netdev) {
        d->nic.address = i.ipv4;
        d->nic.numa_node = i.numa_node;
        d->nic.pci_bus_id = i.pci_bus_id;
      }
    if (d->nic.address.empty())
      return Status(ErrorCode::kConfig,
                    fmt::format("verbs device {} has no IPv4 address on its interface '{}' "
                                "(r2ccl's rail handshake and probes need one)",
                                name, d->nic.netdev.empty() ? "(none found)" : d->nic.netdev));
    R2CCL_RETURN_IF_ERROR(choose_gid(*d));
    R2CCL_DEBUG("verbs device {}: netdev {} {} GID[{}] {} {} MTU {}", name, d->nic.netdev,
                d->nic.address, d->gid_index, gid_text(d->gid), d->roce ? "RoCE" : "InfiniBand",
                128 << d->port.active_mtu);
    return d;
  }

  Status choose_gid(VerbsDevice& d) {
    const int table = d.port.gid_tbl_len;
    if (cfg_.ib_gid_index >= 0) {
      const int i = cfg_.ib_gid_index;
      if (i >= table || ibv_query_gid(d.ctx.get(), kPort, i, &d.gid) != 0 || gid_is_zero(d.gid))
        return {ErrorCode::kConfig,
                fmt::format("R2CCL_IB_GID_INDEX={}: {} port {} has no GID at index {} (its table "
                            "holds {} entries)",
                            i, d.name, kPort, i, table)};
      d.gid_index = i;
      return Status::ok();
    }
    if (!d.roce) {  // InfiniBand: the port GID, routed by LID
      d.gid_index = 0;
      (void)ibv_query_gid(d.ctx.get(), kPort, 0, &d.gid);
      return Status::ok();
    }
    // RoCE: the v2 GID that holds the interface's IPv4 address (::ffff:a.b.c.d).
    in_addr a{};
    (void)::inet_pton(AF_INET, d.nic.address.c_str(), &a);
    ibv_gid want{};
    want.raw[10] = 0xff;
    want.raw[11] = 0xff;
    std::memcpy(&want.raw[12], &a, 4);
    for (int i = 0; i < table; ++i) {
      ibv_gid_entry e{};
      if (ibv_query_gid_ex(d.ctx.get(), kPort, static_cast<std::uint32_t>(i), &e, 0) != 0) continue;
      if (e.gid_type == IBV_GID_TYPE_ROCE_V2 &&
          std::memcmp(e.gid.raw, want.raw, sizeof want.raw) == 0) {
        d.gid_index = i;
        d.gid = e.gid;
        return Status::ok();
      }
    }
    return {ErrorCode::kConfig,
            fmt::format("{}: no RoCE v2 GID holds its address {} (set R2CCL_IB_GID_INDEX)", d.name,
                        d.nic.address)};
  }

  void remember(const std::shared_ptr<Handshake>& hs) {
    std::erase_if(handshakes_, [](const auto& w) { return w.expired(); });
    handshakes_.push_back(hs);
  }

  void track(std::size_t device, const std::shared_ptr<VerbsRail>& rail) {
    auto& v = state_[device]->rails;
    std::erase_if(v, [](const auto& w) { return w.expired(); });
    v.push_back(rail);
  }

  void watch_async(std::size_t device) {
    auto& d = *state_[device];
    d.async_fd.async_wait(asio::posix::stream_descriptor::wait_read, [this, device](error_code ec) {
      if (ec || device >= state_.size()) return;
      on_async(device);
      watch_async(device);
    });
  }

  void on_async(std::size_t device) {
    auto& d = *state_[device];
    ibv_async_event ev{};
    while (ibv_get_async_event(d.dev->ctx.get(), &ev) == 0) {
      const auto type = ev.event_type;
      const std::uint32_t qpn =
          (type == IBV_EVENT_QP_FATAL || type == IBV_EVENT_QP_REQ_ERR ||
           type == IBV_EVENT_QP_ACCESS_ERR || type == IBV_EVENT_PATH_MIG_ERR) &&
                  ev.element.qp != nullptr
              ? ev.element.qp->qp_num
              : 0;
      ibv_ack_async_event(&ev);
      const std::string what = fmt::format("{} on {}", ibv_event_type_str(type), d.dev->name);
      switch (type) {
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_DEVICE_FATAL:
          R2CCL_WARN("verbs: {}: failing its rails", what);
          for (auto& w : std::vector(d.rails))
            if (auto r = w.lock()) r->fail(what);
          break;
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR:
          for (auto& w : std::vector(d.rails))
            if (auto r = w.lock(); r && r->qpn() == qpn)
              r->fail(fmt::format("{} (QPN 0x{:x})", what, qpn));
          break;
        default:
          R2CCL_INFO("verbs: {}", what);
      }
    }
  }

  // Handshake messages: u32 magic | u32 length | body.
  static Bytes frame(const Bytes& body) {
    ByteWriter w;
    w.u32(kHandshakeMagic)
        .u32(static_cast<std::uint32_t>(body.size()))
        .raw(body.data(), body.size());
    return w.take();
  }

  template <class Done>
  static void read_frame(const std::shared_ptr<Handshake>& hs, Done done) {
    asio::async_read(hs->socket, asio::buffer(hs->head), [hs, done](error_code ec, std::size_t) {
      if (hs->done) return;
      if (ec) return done(ec, false);
      ByteReader r(hs->head);
      const auto magic = r.u32();
      const auto len = r.u32();
      if (magic != kHandshakeMagic || len > 4096)
        return done(make_error_code(boost::system::errc::protocol_error), false);
      hs->body.resize(len);
      asio::async_read(hs->socket, asio::buffer(hs->body), [hs, done](error_code e2, std::size_t) {
        if (hs->done) return;
        done(e2, !e2);
      });
    });
  }

  void start_connect(std::size_t device, tcp::endpoint ep, RailHello hello,
                     std::chrono::milliseconds timeout, ConnectHandler handler) {
    const auto& dev = state_[device]->dev;
    const std::string what = fmt::format("rail {} from {} ({}) to {}:{}", hello.rail, dev->name,
                                         dev->nic.address, ep.address().to_string(), ep.port());
    auto finish = std::make_shared<ConnectHandler>(std::move(handler));
    auto rail = std::make_shared<VerbsRail>(engine_, dev, cfg_, hello);
    rail->set_remote_address(ep.address().to_string());
    if (Status st = rail->create(); !st)
      return (*finish)(st.with_context(fmt::format("cannot open {}", what)));
    // From the NIC's address, as tcp's rails: the acceptor probes the address the handshake
    // came from (Rail::remote_address), which must be this NIC's, where its probes are answered.
    tcp::socket s(engine_.io());
    error_code bound;
    const auto local = asio::ip::make_address_v4(dev->nic.address, bound);
    if (!bound) s.open(tcp::v4(), bound);
    if (!bound) s.bind(tcp::endpoint(local, 0), bound);
    if (bound)
      return (*finish)(
          Status(ErrorCode::kNetwork, fmt::format("cannot open {}: binding to {}: {}", what,
                                                  dev->nic.address, bound.message())));
    auto hs = std::make_shared<Handshake>(engine_.io(), std::move(s));
    remember(hs);
    hs->rail = rail;
    auto fail = [hs, finish, what](const std::string& why) {
      if (hs->done) return;
      hs->done = true;
      error_code ec;
      hs->timer.cancel();
      hs->socket.close(ec);
      if (hs->rail) hs->rail->fence();
      (*finish)(Status(ErrorCode::kNetwork, fmt::format("cannot open {}: {}", what, why)));
    };
    hs->timer.expires_after(timeout);
    hs->timer.async_wait([fail, timeout](error_code ec) {
      if (!ec) fail(fmt::format("no handshake within {}ms", timeout.count()));
    });
    hs->socket.async_connect(ep, [this, hs, fail, finish, device, hello](error_code ec) {
      if (hs->done) return;
      if (ec) return fail(ec.message());
      // The acceptor's challenge first (common/handshake.h); the hello answers it.
      read_frame(hs, [this, hs, fail, finish, device, hello](error_code e1, bool ok1) {
        if (!ok1 || hs->body.size() != kChallengeSize)
          return fail("no valid challenge from the peer" + (e1 ? ": " + e1.message() : ""));
        std::memcpy(hs->challenge.data(), hs->body.data(), kChallengeSize);
        auto hello_bytes = encode_hello(hello, hs->challenge, &hs->client);
        if (!hello_bytes) return fail(hello_bytes.status().message());
        ByteWriter w;
        w.raw(hello_bytes->data(), hello_bytes->size());
        hs->rail->local().encode(w);
        hs->out = frame(w.take());
        asio::async_write(
            hs->socket, asio::buffer(hs->out),
            [this, hs, fail, finish, device, hello](error_code e2, std::size_t) {
              if (hs->done) return;
              if (e2) return fail(e2.message());
              read_frame(hs, [this, hs, fail, finish, device, hello](error_code e3, bool ok) {
                if (!ok)
                  return fail(e3 == asio::error::eof || !e3
                                  ? "the peer closed the handshake (wrong token, or it refused "
                                    "the rail)"
                                  : e3.message());
                ByteReader r(hs->body);
                const auto accepted = r.u8();
                if (accepted == 0) return fail("the peer refused: " + r.str(1024));
                Bytes ack(kAckSize);
                r.raw(ack.data(), ack.size());
                if (!r.ok()) return fail("malformed handshake reply");
                if (Status st = check_ack(ack, hello.token, hs->client, hs->challenge); !st)
                  return fail(st.message());
                const auto remote = QpInfo::decode(r);
                if (!r.finish("verbs handshake reply").is_ok())
                  return fail("malformed handshake reply");
                error_code e;
                hs->socket.close(e);
                if (Status st = hs->rail->connect_qp(remote); !st) return fail(st.message());
                auto ready = hs->rail;
                ready->arm();
                ready->send_ready([this, hs, fail, finish, device, ready](Status st) {
                  if (hs->done) return;
                  if (!st) return fail(st.message());
                  hs->done = true;
                  hs->timer.cancel();
                  hs->rail.reset();
                  track(device, ready);
                  (*finish)(std::shared_ptr<Rail>(ready));
                });
              });
            });
      });
    });
  }

  void accept(std::size_t device) {
    auto& d = *state_[device];
    d.acceptor.async_accept([this, device](error_code ec, tcp::socket s) {
      if (ec) return;  // acceptor closed
      if (device >= state_.size()) return;
      on_incoming(device, std::move(s));
      accept(device);
    });
  }

  void on_incoming(std::size_t device, tcp::socket s) {
    auto hs = std::make_shared<Handshake>(engine_.io(), std::move(s));
    error_code ec;
    auto remote = hs->socket.remote_endpoint(ec);
    hs->source = remote.address().to_string();
    hs->from = fmt::format("{}:{}", hs->source, remote.port());
    hs->nic = state_[device]->dev->name;
    if (!admit_accepted(pending_, counters_, hs, hs->source)) return;
    remember(hs);
    // A handshake that ended, or that ~VerbsProvider ended, is not touched: `done` says so.
    auto drop = [this, hs](const std::string& why) {
      if (hs->done) return;
      drop_accepted(pending_, counters_, *hs, why);
      if (hs->rail) hs->rail->fence();
    };
    hs->timer.expires_after(kHandshakeTimeout);
    hs->timer.async_wait([drop](error_code e) {
      if (!e) drop("no handshake within 5s");
    });
    // The challenge goes first; the connector's hello must answer it.
    auto challenge = crypto::make_nonce();
    if (!challenge) return drop(challenge.status().message());
    hs->challenge = *challenge;
    hs->out = frame(
        Bytes(reinterpret_cast<const std::byte*>(hs->challenge.data()),
              reinterpret_cast<const std::byte*>(hs->challenge.data()) + hs->challenge.size()));
    asio::async_write(hs->socket, asio::buffer(hs->out), [drop](error_code e, std::size_t) {
      if (e) drop(fmt::format("cannot send the challenge ({})", e.message()));
    });
    read_frame(hs, [this, hs, drop, device](error_code e, bool ok) {
      if (!ok) return drop(fmt::format("malformed or truncated handshake ({})", e.message()));
      auto accepted = accept_hello(hs->body, token_, hs->challenge);
      if (!accepted) return drop(accepted.status().message());
      // The peer proved the token: its connection no longer counts against the bound.
      pending_.settle(hs.get());
      const RailHello hello = accepted->hello;
      ByteReader r(std::span<const std::byte>(hs->body).subspan(accepted->size));
      const QpInfo peer = QpInfo::decode(r);
      if (!r.finish("verbs handshake").is_ok()) return drop("malformed handshake");
      auto ack = encode_ack(token_, accepted->client, hs->challenge);
      if (!ack) return drop(ack.status().message());
      if (!accept_handler_) return drop("not accepting rails yet");
      auto refuse = [hs, drop](const std::string& why) {
        ByteWriter w;
        w.u8(0).str(why);
        hs->out = frame(w.take());
        asio::async_write(hs->socket, asio::buffer(hs->out),
                          [drop, why](error_code, std::size_t) { drop(why); });
      };
      if (Status st = peer.validate(); !st) return refuse(st.message());
      auto rail = std::make_shared<VerbsRail>(engine_, state_[device]->dev, cfg_, hello);
      rail->set_remote_address(hs->source);
      hs->rail = rail;
      if (Status st = rail->create(); !st) return refuse(st.message());
      if (Status st = rail->connect_qp(peer); !st) return refuse(st.message());
      rail->on_ready([this, hs, rail, device] {
        if (hs->done) return;
        hs->done = true;
        hs->timer.cancel();
        hs->rail.reset();
        track(device, rail);
        if (!accept_handler_ || !accept_handler_(rail)) {
          counters_.dropped_connections.fetch_add(1);
          rail->fence();
        }
      });
      rail->arm();
      ByteWriter w;
      w.u8(1).raw(ack->data(), ack->size());
      rail->local().encode(w);
      hs->out = frame(w.take());
      asio::async_write(hs->socket, asio::buffer(hs->out), [hs, drop](error_code e2, std::size_t) {
        if (e2) drop(fmt::format("handshake reply not sent ({})", e2.message()));
        // READY through the queue pair (or the timer) finishes the handshake.
      });
    });
  }

  ProgressEngine& engine_;
  const Config cfg_;
  Token token_;
  AtomicProviderCounters counters_;
  std::vector<RailNic> devices_;
  std::vector<std::unique_ptr<DeviceState>> state_;
  std::vector<std::weak_ptr<Handshake>> handshakes_;  // loop thread
  // Accepted connections waiting for their hello (common/pending_hellos.h), bounded as for tcp.
  PendingHellos<Handshake> pending_{kMaxPendingHellosPerSource, kMaxPendingHellos};  // loop thread
  AcceptHandler accept_handler_;
};

}  // namespace

Result<std::unique_ptr<Provider>> make_verbs_provider(ProgressEngine& engine, const Topology& topo,
                                                      const Config& config, const Token& token) {
  auto p = std::make_unique<VerbsProvider>(engine, config, token);
  R2CCL_RETURN_IF_ERROR(p->open(topo));
  return std::unique_ptr<Provider>(std::move(p));
}

}  // namespace r2ccl

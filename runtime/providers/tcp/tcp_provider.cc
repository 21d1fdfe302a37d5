// The tcp provider on Boost.Asio.
//
// Wire format: every frame starts with a 40-byte header with a checksum (tcp/frame.h), followed
// by `length` payload bytes for WRITE, WRITE_NACK (reason text), CONTROL and HELLO.
// A write travels as fragments of at most 256 KiB (flag 1: more follow), each bounds-checked on
// its own; the receiver reports and acknowledges the write after its last fragment.
// A WRITE is read straight into the registered region it names after a bounds check; the
// receiver then sends WRITE_ACK (delivery confirmed) or, if the write falls outside every
// registered region, drains it and sends WRITE_NACK. Anything malformed closes that rail only.
#include <fmt/format.h>
#include <net/if.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "common/handshake.h"
#include "common/pending_hellos.h"
#include "progress/asio.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/provider/provider.h"
#include "r2ccl/runtime/topology.h"
#include "tcp/frame.h"

namespace r2ccl {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

constexpr std::uint64_t kMaxWrite = 256ull << 20;
constexpr std::uint64_t kMaxControl = 1u << 20;
constexpr std::uint64_t kMaxNackText = 4096;
constexpr auto kHelloTimeout = std::chrono::seconds(5);
// A write batch holds frames up to kBatchBytes (one fragment at most, as a fragment is that
// size), so an urgent frame (an ack) never waits behind more than the batch being written.
constexpr std::size_t kBatchFrames = 64;
constexpr std::size_t kBatchBytes = 256u << 10;
// Writes travel in fragments of this size. Larger fragments cost fewer receive calls and headers:
// on loopback 256 KiB took a 512 KiB - 2 MiB all-reduce 10-20% less time than 64 KiB did.
constexpr std::size_t kFragment = kBatchBytes;
constexpr std::uint8_t kMoreFragments = 1;     // WRITE flag: more fragments of this write follow
constexpr std::size_t kReadBatch = 64u << 10;  // bytes asked of one receive call
constexpr std::size_t kMaxSend = 16u << 20;    // bytes offered to one send call, at most
constexpr std::size_t kMaxDelayedAcks = 64;    // control acks that wait for company at most
constexpr std::size_t kStreamFrames = 16;  // frames after a write that are read header by header

using tcp_frame::decode;
using tcp_frame::encode;
using tcp_frame::HeaderBytes;
using tcp_frame::kHeaderSize;
using FrameOp = tcp_frame::Op;
using FrameHeader = tcp_frame::Header;

class TcpRail;

// Registered memory of one NIC: key -> region. Shared with that NIC's rails.
struct KeyTable {
  std::mutex mutex;
  struct Registration {
    std::byte* base = nullptr;
    std::size_t length = 0;
    bool remote_write = false;             // MemoryAccess::kRemoteWrite
    const DeviceMemory* memory = nullptr;  // device memory, reached through its copies
  };
  std::unordered_map<std::uint64_t, Registration> regions;
  // Regions that a rail's receive is streaming into right now (key -> how many rails), and the
  // rails: a deregistration closes those rails before it returns, so the network never writes
  // into memory its owner has freed.
  std::unordered_map<std::uint64_t, int> landing;
  std::vector<std::weak_ptr<TcpRail>> rails;
};

std::string errno_text(const error_code& ec) {
  return ec.message();
}

// Binds a socket to a NIC: the address always, the device too where permitted and the peer is
// on another host. Traffic to this host's own addresses never reaches the NIC (the kernel loops
// it back), and a socket bound to a NIC whose link is down could not send it.
error_code bind_to_nic(tcp::socket& s, const RailNic& nic, const tcp::endpoint& to) {
  error_code ec;
  s.open(tcp::v4(), ec);
  if (ec) return ec;
  if (!nic.netdev.empty() && !is_host_address(to.address().to_string())) {
    // SO_BINDTODEVICE keeps traffic on this NIC even when routes would pick another one; it
    // needs CAP_NET_RAW, without which the address binding alone has to do.
    (void)::setsockopt(s.native_handle(), SOL_SOCKET, SO_BINDTODEVICE, nic.netdev.c_str(),
                       static_cast<socklen_t>(nic.netdev.size()));
  }
  s.bind(tcp::endpoint(asio::ip::make_address_v4(nic.address), 0), ec);
  return ec;
}

// Completion condition of a batch write: all of what is left, offered to one send call. (Asio's
// own conditions offer at most 64 KiB per call: on loopback, whose segments are 64 KiB too, a frame
// header and a 64 KiB fragment then left as one full and one tiny segment, and every batch took
// four or more calls.)
std::size_t whole_batch(const error_code& ec, std::size_t) {
  return ec ? 0 : kMaxSend;
}

void tune(tcp::socket& s) {
  error_code ec;
  s.set_option(tcp::no_delay(true), ec);
  // Keep at most this much unsent data in the kernel: the rest waits in the rail's own queue,
  // where acknowledgements and control frames go first. Bytes in flight are not limited, so
  // links with a large bandwidth-delay product still fill.
  const int lowat = 64 * 1024;
  (void)::setsockopt(s.native_handle(), IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, sizeof lowat);
}

class TcpRail final : public Rail, public std::enable_shared_from_this<TcpRail> {
 public:
  TcpRail(ProgressEngine& engine, tcp::socket socket, RailNic nic, std::shared_ptr<KeyTable> keys,
          std::shared_ptr<AtomicProviderCounters> counters, RailHello hello)
      : engine_(engine),
        socket_(std::move(socket)),
        nic_(std::move(nic)),
        keys_(std::move(keys)),
        counters_(std::move(counters)),
        hello_(hello) {
    error_code ec;
    socket_.non_blocking(true, ec);  // read_ready's receive must not block the loop
    auto l = socket_.local_endpoint(ec);
    auto r = socket_.remote_endpoint(ec);
    description_ = fmt::format("{} {}:{} -> {}:{}", nic_.name, l.address().to_string(), l.port(),
                               r.address().to_string(), r.port());
    if (!ec) remote_address_ = r.address().to_string();
  }

  void start(RailEvents* events) override {
    events_ = events;
    process();
  }

  // Back-pressure: a post is refused (kNoResource) while this much waits to be written.
  static constexpr std::size_t kMaxPendingBytes = std::size_t{64} << 20;
  static constexpr std::size_t kMaxPendingDeviceBytes = std::size_t{8} << 20;

  Status full() const {
    return {ErrorCode::kNoResource,
            fmt::format("rail {} has {} bytes queued", description_, pending_bytes_)};
  }

  Status post_write(const WriteRequest& w) override {
    if (closed_) return {ErrorCode::kNetwork, fmt::format("rail {} is closed", description_)};
    if (pending_bytes_ > 0 && pending_bytes_ + w.length > kMaxPendingBytes) return full();
    // Device memory is copied out when queued, on this thread: only a little ahead of the wire,
    // so that the copies of many queued chunks never hold up the loop at once.
    if (w.src_device != nullptr && pending_bytes_ > 0 &&
        pending_bytes_ + w.length > kMaxPendingDeviceBytes)
      return full();
    // Device memory goes out through the host: every fragment is copied out before any is
    // queued, so that a copy that fails refuses the whole write and leaves nothing half sent.
    std::vector<std::shared_ptr<const Bytes>> staged;
    if (w.src_device != nullptr)
      for (std::size_t done = 0; done < w.length; done += kFragment) {
        const std::size_t n = std::min(kFragment, w.length - done);
        auto buf = staging_buffer(n);
        if (Status st = w.src_device->to_host(buf->data(), w.src + done, n); !st) {
          engine_.post([self = shared_from_this(), cookie = w.cookie, st] {
            if (self->events_ && !self->closed_)
              self->events_->on_write_refused(cookie, st.with_context("sending a write"));
          });
          return Status::ok();
        }
        staged.push_back(std::move(buf));
      }
    // Sent as fragments, so that acknowledgements and control frames queued meanwhile wait for
    // at most one fragment, not a whole chunk, on a slow link.
    std::size_t done = 0;
    std::size_t fragment = 0;
    do {
      const std::size_t n = std::min(kFragment, w.length - done);
      const bool last = done + n == w.length;
      FrameHeader h{FrameOp::kWrite,
                    last ? std::uint8_t{0} : kMoreFragments,
                    w.imm,
                    w.remote_key,
                    w.remote_offset + done,
                    n,
                    w.cookie};
      if (staged.empty())
        queue(h, w.src + done, n, {});
      else
        queue(h, nullptr, 0, std::move(staged[fragment]));
      done += n;
      ++fragment;
    } while (done < w.length);
    return Status::ok();
  }

  // A buffer for a fragment copied out of device memory: one of those whose frames went out, or
  // a new one while fewer than kSpareStaging exist.
  std::shared_ptr<Bytes> staging_buffer(std::size_t n) {
    for (auto& b : staging_)
      if (b.use_count() == 1) {
        b->resize(n);
        return b;
      }
    auto b = std::make_shared<Bytes>(n);
    if (staging_.size() < kSpareStaging) staging_.push_back(b);
    return b;
  }

  Status post_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie) override {
    return queue_control(std::move(message), cookie, false);
  }

  // Ahead of every frame not yet handed to the socket (frames go whole into a batch, so the
  // front of the queue is never a frame half written).
  Status post_urgent_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie) override {
    return queue_control(std::move(message), cookie, true);
  }

  Status queue_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie, bool urgent) {
    if (closed_) return {ErrorCode::kNetwork, fmt::format("rail {} is closed", description_)};
    if (message->size() > kMaxControl)
      return {ErrorCode::kInvalidArgument,
              fmt::format("control message of {} bytes exceeds {}", message->size(), kMaxControl)};
    if (!urgent && pending_bytes_ > 0 && pending_bytes_ + message->size() > kMaxPendingBytes)
      return full();
    FrameHeader h{FrameOp::kControl, 0, 0, 0, 0, message->size(), cookie};
    queue(h, nullptr, 0, std::move(message), urgent);
    return Status::ok();
  }

  void send_hello_ack(Bytes ack) {
    const std::size_t n = ack.size();
    queue(FrameHeader{FrameOp::kHelloAck, 0, 0, 0, 0, n, 0}, nullptr, 0,
          std::make_shared<const Bytes>(std::move(ack)));
  }

  void fence() override {
    events_ = nullptr;
    close();
  }

  const RailHello& hello() const override { return hello_; }
  std::string describe() const override { return description_; }
  std::string remote_address() const override { return remote_address_; }

  // TCP_INFO's age of the last ACK the kernel received on this connection (millisecond
  // resolution). Only while the rail is open: a closed socket's descriptor may be reused.
  std::optional<std::chrono::nanoseconds> since_acknowledged() const override {
    if (closed_ || !socket_.is_open()) return std::nullopt;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (::getsockopt(const_cast<tcp::socket&>(socket_).native_handle(), IPPROTO_TCP, TCP_INFO,
                     &info, &len) != 0 ||
        len < offsetof(tcp_info, tcpi_last_ack_recv) + sizeof info.tcpi_last_ack_recv)
      return std::nullopt;
    return std::chrono::milliseconds(info.tcpi_last_ack_recv);
  }

 private:
  struct OutFrame {
    HeaderBytes header;
    const std::byte* payload = nullptr;
    std::size_t length = 0;
    std::shared_ptr<const Bytes> owned;  // payload kept alive by the frame (control, nack text)
    bool write = false;                  // a write's payload (data, batched as such)
  };

  void queue(const FrameHeader& h, const std::byte* payload, std::size_t len,
             std::shared_ptr<const Bytes> owned, bool urgent = false) {
    OutFrame f{encode(h), payload, len, std::move(owned), h.op == FrameOp::kWrite};
    if (f.owned) {
      f.payload = f.owned->data();
      f.length = f.owned->size();
    }
    pending_bytes_ += f.length;
    if (urgent)
      pending_.push_front(std::move(f));
    else
      pending_.push_back(std::move(f));
    kick();
  }

  // A control message's acknowledgement waits for a frame going the same way and rides in its
  // write, or goes when the loop has been idle for its spin period (or when many wait): a
  // message exchange then costs one send per message, not two, also when successive messages
  // take different rails. Write acknowledgements go at once: they pace the sender and time the
  // link.
  void delay_ack(std::uint64_t cookie) {
    delayed_acks_.push_back(cookie);
    if (delayed_acks_.size() >= kMaxDelayedAcks && !writing_) return kick();
    flush_acks_when_idle();
  }

  // The delayed acknowledgements go with the next frame, or when the loop is idle.
  void flush_acks_when_idle() {
    if (ack_flush_due_ || delayed_acks_.empty()) return;
    ack_flush_due_ = true;
    engine_.when_idle([self = shared_from_this()] {
      self->ack_flush_due_ = false;
      if (!self->closed_ && !self->delayed_acks_.empty()) self->kick();
    });
  }

  void kick() {
    while (!writing_ && !closed_ && (!pending_.empty() || !delayed_acks_.empty())) {
      bool data = false;
      const std::size_t total = next_batch(data);
      // A batch of data (chunk writes) goes by an asynchronous write: while it is under way the
      // next chunks gather into one batch, one system call. (Sent at once one by one, 1-2 MiB
      // all-reduces on the testbed took 2-8% longer.)
      if (data) return write_rest(0);
      // Control messages and acknowledgements: one send at once, without Asio's operation
      // machinery; a small batch usually goes whole (on the path from a message's arrival to its
      // answer). What the socket does not take, or an error (reported by the asynchronous write,
      // not from inside the caller that queued the frame), goes to an asynchronous write.
      error_code ec;
      std::size_t sent = socket_.send(buffers_, 0, ec);
      if (ec) sent = 0;
      if (sent < total) return write_rest(sent);
      if (acks_wait_for_company()) return flush_acks_when_idle();
    }
  }

  // After a batch went whole: acknowledgements that came meanwhile wait for a frame to ride with
  // (or the idle flush) unless many wait. Sent alone, they would cost a send here and a receive
  // at the peer for every message of an exchange whose answer crossed the batch.
  bool acks_wait_for_company() const {
    return pending_.empty() && delayed_acks_.size() < kMaxDelayedAcks;
  }

  // Moves the delayed acknowledgements and the next frames into the write batch; returns its
  // bytes, and sets `data` if it holds a write's payload.
  std::size_t next_batch(bool& data) {
    batch_.clear();
    for (const auto cookie : delayed_acks_)  // first, as urgent frames go
      batch_.push_back(
          OutFrame{encode(FrameHeader{FrameOp::kWriteAck, 0, 0, 0, 0, 0, cookie}), nullptr, 0, {}});
    delayed_acks_.clear();
    std::size_t bytes = 0;
    while (!pending_.empty() && batch_.size() < kBatchFrames && bytes < kBatchBytes) {
      bytes += kHeaderSize + pending_.front().length;
      pending_bytes_ -= pending_.front().length;
      batch_.push_back(std::move(pending_.front()));
      pending_.pop_front();
    }
    buffers_.clear();
    std::size_t total = 0;
    for (auto& f : batch_) {
      buffers_.emplace_back(f.header.data(), f.header.size());
      if (f.length > 0) buffers_.emplace_back(f.payload, f.length);
      total += f.header.size() + f.length;
      data = data || (f.length > 0 && f.write);
    }
    return total;
  }

  // Writes the batch from byte `sent` on, asynchronously.
  void write_rest(std::size_t sent) {
    auto first = buffers_.begin();
    while (sent > 0 && sent >= first->size()) {
      sent -= first->size();
      ++first;
    }
    buffers_.erase(buffers_.begin(), first);
    if (sent > 0) buffers_.front() += sent;
    writing_ = true;
    asio::async_write(
        socket_, buffers_, whole_batch, [self = shared_from_this()](error_code ec, std::size_t) {
          self->writing_ = false;
          if (self->closed_) return;
          if (ec)
            return self->fail(
                {ec == asio::error::connection_reset || ec == asio::error::broken_pipe
                     ? ErrorCode::kClosed
                     : ErrorCode::kNetwork,
                 fmt::format("send failed on {}: {}", self->description_, errno_text(ec))});
          if (self->acks_wait_for_company()) return self->flush_acks_when_idle();
          self->kick();
        });
  }

  // Receiving. Bytes are read in batches into `rbuf_` (one system call usually brings several
  // small frames: acknowledgements, control messages) and parsed from there; a write's payload
  // beyond what the batch holds is read straight into its registered region.
  std::size_t avail() const { return rend_ - rpos_; }

  // Parses every complete frame buffered; returns when more bytes are needed (and are being
  // read) or when an asynchronous read of a payload's remainder will continue it.
  void process() {
    while (!closed_) {
      if (avail() < kHeaderSize) return fill();
      std::memcpy(header_.data(), rbuf_.data() + rpos_, kHeaderSize);
      rpos_ += kHeaderSize;
      ++frames_since_write_;
      if (!on_header()) return;
    }
  }

  // Reads at least one more byte into the buffer, then parses again.
  void fill() {
    if (rpos_ == rend_) {
      rpos_ = rend_ = 0;
    } else if (rpos_ > 0) {
      std::memmove(rbuf_.data(), rbuf_.data() + rpos_, avail());
      rend_ -= rpos_;
      rpos_ = 0;
    }
    const bool in_header = rend_ > 0;
    // While writes stream in (other frames, such as acknowledgements, come between them), read
    // one header at a time, so that each payload is received straight into place rather than
    // into this buffer and copied; after a run of other frames, read in batches again.
    const bool streaming = frames_since_write_ < kStreamFrames;
    const std::size_t want = streaming ? kHeaderSize - rend_ : rbuf_.size() - rend_;
    if (rend_ == 0 && read_dry_) {
      // The last receive took all there was: wait until the socket is readable, then receive.
      // (Asio's reads first try at once: a system call that finds nothing, once for every
      // message of an exchange.) Queueing the wait is a system call too (it re-arms the socket
      // in epoll), so a handler of its own does it: after whatever the frames just parsed
      // completed, off the path from a message's arrival to the answer. No readiness is missed:
      // re-arming reports data that came in meanwhile.
      engine_.post([self = shared_from_this(), want] {
        if (self->closed_) return;
        self->socket_.async_wait(tcp::socket::wait_read, [self, want](error_code ec) {
          if (self->closed_) return;
          if (ec) return self->fail_read(ec, 0, "frame header");
          self->read_ready(want);
        });
      });
      return;
    }
    read_header(want, in_header);
  }

  // The socket is readable and the batch buffer empty: receive without blocking.
  void read_ready(std::size_t want) {
    error_code ec;
    const std::size_t n = socket_.read_some(asio::buffer(rbuf_.data() + rend_, want), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) return fill();  // not yet
    received(ec, n, want, false);
  }

  // A receive into the batch buffer returned `n` of the `want` bytes asked: parse them.
  void received(const error_code& ec, std::size_t n, std::size_t want, bool in_header) {
    if (ec) return fail_read(ec, in_header ? 1 : 0, "frame header");
    read_dry_ = n < want;
    rend_ += n;
    process();
  }

  void read_header(std::size_t want, bool in_header) {
    socket_.async_read_some(
        asio::buffer(rbuf_.data() + rend_, want),
        [self = shared_from_this(), in_header, want](error_code ec, std::size_t n) {
          if (!self->closed_) self->received(ec, n, want, in_header);
        });
  }

  void fail_read(const error_code& ec, std::size_t got, const char* what) {
    if (ec == asio::error::eof && got == 0 && std::string_view(what) == "frame header")
      return fail({ErrorCode::kClosed, fmt::format("peer closed rail {}", description_)});
    if (ec == asio::error::connection_reset)
      return fail({ErrorCode::kClosed, fmt::format("peer reset rail {}", description_)});
    if (ec == asio::error::eof)
      return fail({ErrorCode::kClosed, fmt::format("truncated frame on rail {}: the peer closed "
                                                   "the connection in the middle of a {}",
                                                   description_, what)});
    fail({ErrorCode::kNetwork,
          fmt::format("receive failed on {}: {}", description_, errno_text(ec))});
  }

  // Handles the header in `header_`; true: go on parsing, false: an asynchronous step (or a
  // failure) took over.
  bool on_header() {
    auto h = decode(header_);
    if (!h) {
      fail(h.status().with_context(fmt::format("rail {}", description_)));
      return false;
    }
    cur_ = *h;
    switch (cur_.op) {
      case FrameOp::kWrite:
        return on_write();
      case FrameOp::kWriteAck:
        if (cur_.length != 0) return malformed("WRITE_ACK with a payload");
        if (events_) events_->on_write_confirmed(cur_.cookie, cur_.offset);
        return true;
      case FrameOp::kWriteNack:
        if (cur_.length > kMaxNackText) return malformed("WRITE_NACK reason too long");
        return take_payload(cur_.length, [this] {
          std::string why(reinterpret_cast<const char*>(payload_.data()), payload_.size());
          if (events_)
            events_->on_write_refused(cur_.cookie, Status(ErrorCode::kRemoteRefused, why));
        });
      case FrameOp::kControl:
        if (cur_.length > kMaxControl)
          return malformed(fmt::format("control message of {} bytes", cur_.length));
        if (avail() >= cur_.length) {  // handed over from the batch buffer, not copied
          const std::span<const std::byte> message(rbuf_.data() + rpos_, cur_.length);
          rpos_ += cur_.length;
          on_control(message);
          return true;
        }
        return take_payload(cur_.length, [this] { on_control(payload_); });
      case FrameOp::kHelloAck:
      case FrameOp::kHello:
      case FrameOp::kChallenge:
        return malformed("handshake frame after the handshake");
    }
    return malformed(fmt::format("unknown frame op {}", static_cast<int>(cur_.op)));
  }

  void on_control(std::span<const std::byte> message) {
    const auto cookie = cur_.cookie;
    if (events_) events_->on_control(message);
    if (cookie != 0 && !closed_) delay_ack(cookie);
  }

  bool malformed(const std::string& what) {
    fail({ErrorCode::kProtocol, fmt::format("malformed frame on rail {}: {}", description_, what)});
    return false;
  }

  // Moves `len` payload bytes into `payload_` and runs `then`: from the buffer when they are all
  // there (true), else the rest by an asynchronous read that continues parsing (false).
  template <typename F>
  bool take_payload(std::size_t len, F&& then) {
    const std::size_t have = std::min(len, avail());
    payload_.assign(rbuf_.data() + rpos_, rbuf_.data() + rpos_ + have);
    rpos_ += have;
    if (have == len) {
      then();
      return true;
    }
    payload_.resize(len);
    asio::async_read(
        socket_, asio::buffer(payload_.data() + have, len - have),
        [self = shared_from_this(), then = std::forward<F>(then)](error_code ec, std::size_t n) {
          if (self->closed_) return;
          if (ec) return self->fail_read(ec, n, "frame payload");
          then();
          self->process();
        });
    return false;
  }

  bool on_write() {
    if (fragments_bytes_ == 0) write_started_ = std::chrono::steady_clock::now();
    if (cur_.length > kMaxWrite)
      return malformed(fmt::format("write of {} bytes exceeds {}", cur_.length, kMaxWrite));
    if (refused_cookie_ && *refused_cookie_ == cur_.cookie) {
      // A later fragment of a write already refused: discard it too, quietly.
      drained_ = 0;
      return drain({});
    }
    refused_cookie_.reset();
    const std::size_t len = cur_.length;
    const std::size_t have = std::min(len, avail());
    std::byte* dest = nullptr;
    const DeviceMemory* memory = nullptr;
    std::string refusal;
    {
      // The region is resolved, the buffered bytes copied and a write that streams on marked
      // as landing under one hold of the lock: a deregistration either happens before (and the
      // write is refused) or sees the landing (and closes this rail before it returns).
      std::lock_guard lock(keys_->mutex);
      auto it = keys_->regions.find(cur_.key);
      if (it == keys_->regions.end()) {
        refusal = fmt::format(
            "write of {} bytes at offset {} names key 0x{:x}, which is not "
            "registered on {}",
            cur_.length, cur_.offset, cur_.key, nic_.name);
      } else if (!it->second.remote_write) {
        refusal = fmt::format(
            "write of {} bytes at offset {} names key 0x{:x}, a region registered for local "
            "access only on {}",
            cur_.length, cur_.offset, cur_.key, nic_.name);
      } else if (cur_.offset > it->second.length || cur_.length > it->second.length - cur_.offset) {
        refusal = fmt::format(
            "write of {} bytes at offset {} falls outside the registered region "
            "of {} bytes (key 0x{:x} on {})",
            cur_.length, cur_.offset, it->second.length, cur_.key, nic_.name);
      } else if (it->second.memory != nullptr && len > kFragment) {
        refusal = fmt::format(
            "write fragment of {} bytes into device memory exceeds {} (key 0x{:x} on {})",
            cur_.length, kFragment, cur_.key, nic_.name);
      } else {
        dest = it->second.base + cur_.offset;
        memory = it->second.memory;
        land(memory, dest, rbuf_.data() + rpos_, have);
        if (have < len) {
          landing_key_ = cur_.key;
          ++keys_->landing[cur_.key];
        }
      }
    }
    if (!refusal.empty()) {
      counters_->refused_writes.fetch_add(1);
      R2CCL_WARN_LIMITED("refused a remote write on rail {}: {}", description_, refusal);
      refused_cookie_ = cur_.cookie;
      fragments_bytes_ = 0;
      drained_ = 0;
      return drain(refusal);
    }
    rpos_ += have;
    if (have == len) {
      write_landed();
      return true;
    }
    // The rest goes straight into the region (device memory: into the landing buffer, then
    // copied in), and the same system call brings the next frame's header if it is there: a
    // stream of write fragments then costs one receive call each and no copy through the batch
    // buffer.
    const std::size_t need = len - have;
    rpos_ = rend_ = 0;                             // the batch buffer is drained (have == avail())
    if (memory != nullptr) landing_.resize(need);  // at most kFragment, checked above
    std::byte* into_first = memory != nullptr ? landing_.data() : dest + have;
    const std::array<asio::mutable_buffer, 2> into{asio::buffer(into_first, need),
                                                   asio::buffer(rbuf_.data(), kHeaderSize)};
    asio::async_read(
        socket_, into,
        [need](const error_code& ec, std::size_t n) -> std::size_t {
          return ec || n >= need ? 0 : need + kHeaderSize - n;
        },
        [self = shared_from_this(), need, memory, to = dest + have](error_code ec, std::size_t n) {
          if (self->closed_) return;
          // Copied in before the landing ends: a deregistration waits for it.
          if (memory != nullptr && !(ec && n < need))
            self->land(memory, to, self->landing_.data(), need);
          self->end_landing();
          if (ec && n < need) return self->fail_read(ec, n, "write payload");
          self->rend_ = n - need;
          self->write_landed();
          self->process();
        });
    return false;
  }

  // A write fragment's payload is in place; after the last one, report and confirm the write.
  void write_landed() {
    frames_since_write_ = 0;
    fragments_bytes_ += cur_.length;
    if (cur_.flags & kMoreFragments) return;
    const auto cookie = cur_.cookie;
    const auto total = fragments_bytes_;
    fragments_bytes_ = 0;
    if (!copy_error_.empty()) {  // a copy into device memory failed: the write is refused
      const std::string why = std::exchange(copy_error_, {});
      R2CCL_WARN_LIMITED("refused a remote write on rail {}: {}", description_, why);
      queue(FrameHeader{FrameOp::kWriteNack, 0, 0, 0, 0, why.size(), cookie}, nullptr, 0,
            std::make_shared<const Bytes>(
                reinterpret_cast<const std::byte*>(why.data()),
                reinterpret_cast<const std::byte*>(why.data()) + why.size()),
            true);
      return;
    }
    // How long this write took to arrive: from its first byte, or from the previous write's last
    // byte when it was already waiting behind it. Sent back in the ack's offset field.
    const auto done = std::chrono::steady_clock::now();
    const auto receive_ns =
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       done - std::max(write_started_, last_write_done_))
                                       .count());
    last_write_done_ = done;
    if (events_) events_->on_write_arrived(cur_.imm, total);
    if (closed_) return;
    queue(FrameHeader{FrameOp::kWriteAck, 0, 0, 0, receive_ns, 0, cookie}, nullptr, 0, {}, true);
  }

  // Discards a refused write's payload (buffered part first), then tells the sender why.
  bool drain(std::string refusal) {
    const std::size_t skip = std::min(avail(), cur_.length - drained_);
    rpos_ += skip;
    drained_ += skip;
    if (drained_ == cur_.length) {
      if (!refusal.empty())
        queue(FrameHeader{FrameOp::kWriteNack, 0, 0, 0, 0, refusal.size(), cur_.cookie}, nullptr, 0,
              std::make_shared<const Bytes>(
                  reinterpret_cast<const std::byte*>(refusal.data()),
                  reinterpret_cast<const std::byte*>(refusal.data()) + refusal.size()),
              true);
      return true;
    }
    scratch_.resize(64 * 1024);
    const std::size_t n = std::min<std::size_t>(scratch_.size(), cur_.length - drained_);
    asio::async_read(socket_, asio::buffer(scratch_.data(), n),
                     [self = shared_from_this(), refusal = std::move(refusal)](
                         error_code ec, std::size_t got) mutable {
                       if (self->closed_) return;
                       if (ec) return self->fail_read(ec, got, "write payload");
                       self->drained_ += got;
                       if (self->drain(std::move(refusal))) self->process();
                     });
    return false;
  }

  void fail(const Status& why) {
    if (closed_) return;
    R2CCL_INFO("rail {} failed: {}", description_, why.message());
    RailEvents* ev = events_;
    events_ = nullptr;
    close();
    if (ev) ev->on_rail_failed(why);
  }

  // Puts received bytes into their place: a copy into device memory, or into host memory. The
  // first failure of a write's copies is kept, and refuses the write when its last fragment is in.
  void land(const DeviceMemory* memory, std::byte* to, const std::byte* from, std::size_t n) {
    if (Status st = copy_from_host(memory, to, from, n); !st && copy_error_.empty())
      copy_error_ = st.message();
  }

  // A receive streams into region `key` (outside the table's lock): deregistering it must close
  // this rail first.
  void end_landing() {
    if (!landing_key_) return;
    std::lock_guard lock(keys_->mutex);
    if (auto it = keys_->landing.find(*landing_key_);
        it != keys_->landing.end() && --it->second == 0)
      keys_->landing.erase(it);
    landing_key_.reset();
  }

 public:
  // Closes the rail if a write queued on it, or being written, still reads from the region;
  // loop thread.
  void close_if_sending_from(const std::byte* base, std::size_t length, std::uint64_t key,
                             const std::string& device) {
    if (closed_) return;
    const auto begin = reinterpret_cast<std::uintptr_t>(base);
    auto reads = [&](const OutFrame& f) {
      const auto at = reinterpret_cast<std::uintptr_t>(f.payload);
      return !f.owned && f.length > 0 && at >= begin && at - begin < length;
    };
    if (std::none_of(pending_.begin(), pending_.end(), reads) &&
        !(writing_ && std::any_of(batch_.begin(), batch_.end(), reads)))
      return;
    fail({ErrorCode::kAborted,
          fmt::format("rail {}: the region (key 0x{:x} on {}) that a write was being sent from "
                      "was deregistered",
                      description_, key, device)});
  }

  // Closes the rail if a receive is streaming into region `key`; loop thread.
  void close_if_landing_in(std::uint64_t key, const std::string& device) {
    if (landing_key_ != key || closed_) return;
    fail({ErrorCode::kAborted,
          fmt::format("rail {}: the region (key 0x{:x} on {}) that a write was landing in was "
                      "deregistered",
                      description_, key, device)});
  }

 private:
  void close() {
    if (closed_) return;
    end_landing();
    closed_ = true;
    error_code ec;
    // Abortive close (RST): what the kernel still holds for this connection is dropped, so no
    // stale write can reach the peer after a replayed one.
    socket_.set_option(asio::socket_base::linger(true, 0), ec);
    socket_.close(ec);
    pending_.clear();
    pending_bytes_ = 0;
    delayed_acks_.clear();
  }

  ProgressEngine& engine_;
  tcp::socket socket_;
  RailNic nic_;
  std::shared_ptr<KeyTable> keys_;
  std::optional<std::uint64_t> landing_key_;  // the region a write streams into (on_write)
  std::shared_ptr<AtomicProviderCounters> counters_;
  RailHello hello_;
  std::string description_;
  std::string remote_address_;  // the peer's IPv4 address on this connection
  RailEvents* events_ = nullptr;
  bool closed_ = false;

  HeaderBytes header_{};
  std::vector<std::byte> rbuf_ = std::vector<std::byte>(kReadBatch);
  std::size_t rpos_ = 0;  // unparsed bytes are [rpos_, rend_)
  std::size_t rend_ = 0;
  std::size_t frames_since_write_ = kStreamFrames;  // frames parsed since the last write
  bool read_dry_ = false;  // the last batch read got less than it asked for
  FrameHeader cur_;
  Bytes payload_;
  std::vector<std::byte> scratch_;
  std::vector<std::byte> landing_;  // a fragment bound for device memory, before its copy in
  // Fragments copied out of device memory, reused once their frames went out: enough for
  // kMaxPendingBytes queued.
  static constexpr std::size_t kSpareStaging = kMaxPendingBytes / kFragment + 64;
  std::vector<std::shared_ptr<Bytes>> staging_;
  std::string copy_error_;  // the write being received could not be copied in
  std::size_t drained_ = 0;
  std::size_t fragments_bytes_ = 0;  // of the write being received
  std::chrono::steady_clock::time_point write_started_{};
  std::chrono::steady_clock::time_point last_write_done_{};
  std::optional<std::uint64_t> refused_cookie_;  // its remaining fragments are discarded

  std::deque<OutFrame> pending_;
  std::size_t pending_bytes_ = 0;            // payload bytes in pending_
  std::vector<std::uint64_t> delayed_acks_;  // control acknowledgements not yet queued
  bool ack_flush_due_ = false;               // an idle flush is registered
  std::vector<OutFrame> batch_;
  std::vector<asio::const_buffer> buffers_;
  bool writing_ = false;
};

class TcpProvider final : public Provider {
 public:
  TcpProvider(ProgressEngine& engine, std::vector<RailNic> devices, const Token& token)
      : engine_(engine),
        devices_(std::move(devices)),
        token_(token),
        counters_(std::make_shared<AtomicProviderCounters>()) {}

  ~TcpProvider() override {
    engine_.call([this] {
      // Handshakes still under way end here: their handlers see `done` and touch nothing more
      // (they capture this provider).
      for (auto& w : handshakes_)
        if (auto hs = w.lock()) {
          error_code ec;
          hs->done = true;
          pending_->settle(hs.get());
          hs->timer.cancel();
          hs->socket.close(ec);
        }
      handshakes_.clear();
      for (auto& d : state_) {
        error_code ec;
        d->acceptor.close(ec);
      }
      state_.clear();
    });
  }

  Status open() {
    for (const auto& nic : devices_) {
      auto d = std::make_unique<DeviceState>(engine_.io());
      error_code ec;
      tcp::endpoint ep(asio::ip::make_address_v4(nic.address, ec), 0);
      if (ec)
        return {ErrorCode::kInvalidArgument,
                fmt::format("{}: '{}' is not an IPv4 address", nic.name, nic.address)};
      d->acceptor.open(ep.protocol(), ec);
      if (!ec) d->acceptor.bind(ep, ec);
      if (!ec) d->acceptor.listen(asio::socket_base::max_listen_connections, ec);
      if (ec)
        return {ErrorCode::kNetwork,
                fmt::format("cannot listen on {} ({}): {}", nic.name, nic.address, ec.message())};
      d->port = d->acceptor.local_endpoint().port();
      state_.push_back(std::move(d));
    }
    engine_.call([this] {
      for (std::size_t i = 0; i < state_.size(); ++i)
        accept(i);
    });
    return Status::ok();
  }

  std::string_view name() const override { return "tcp"; }
  std::uint32_t capabilities() const override {
    // Registrations are ranges the loop thread copies from and into at transfer time.
    return kCapRegistrationFollowsMappings;
  }
  // A connection to one of this host's addresses is looped back by the kernel.
  bool host_local(const std::string& address) const override { return is_host_address(address); }
  const std::vector<RailNic>& devices() const override { return devices_; }

  Result<std::uint64_t> register_memory(std::size_t device, void* base, std::size_t length,
                                        MemoryAccess access, const DeviceMemory* memory) override {
    if (device >= state_.size())
      return Status(ErrorCode::kInvalidArgument, fmt::format("no device {}", device));
    auto& t = *state_[device]->keys;
    std::lock_guard lock(t.mutex);
    // Keys are 64 random bits from the kernel: a peer cannot guess another region's key.
    std::uint64_t key = 0;
    do {
      R2CCL_RETURN_IF_ERROR(crypto::random_bytes(
          std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(&key), sizeof key)));
    } while (key == 0 || t.regions.count(key) != 0);
    t.regions[key] = {static_cast<std::byte*>(base), length, access == MemoryAccess::kRemoteWrite,
                      memory};
    return key;
  }

  Status deregister_memory(std::size_t device, std::uint64_t key) override {
    if (device >= state_.size())
      return {ErrorCode::kInvalidArgument, fmt::format("no device {}", device)};
    auto& t = *state_[device]->keys;
    std::vector<std::shared_ptr<TcpRail>> rails;
    KeyTable::Registration region;
    {
      std::lock_guard lock(t.mutex);
      auto it = t.regions.find(key);
      if (it == t.regions.end())
        return {ErrorCode::kNotFound,
                fmt::format("key 0x{:x} is not registered on {}", key, devices_[device].name)};
      region = it->second;
      t.regions.erase(it);
      for (const auto& w : t.rails)
        if (auto r = w.lock()) rails.push_back(std::move(r));
    }
    // Rails read sources and copy into memory only on the loop thread: once the rails still
    // sending from the region, or landing a write in it, are closed there, the network neither
    // reads nor writes it any more.
    const std::string device_name = devices_[device].name;
    engine_.call([&] {
      for (auto& r : rails) {
        r->close_if_landing_in(key, device_name);
        r->close_if_sending_from(region.base, region.length, key, device_name);
      }
    });
    return Status::ok();
  }

  // New rails join their device's table (for deregistration); dead ones are pruned.
  void track(std::size_t device, const std::shared_ptr<TcpRail>& rail) {
    auto& t = *state_[device]->keys;
    std::lock_guard lock(t.mutex);
    std::erase_if(t.rails, [](const std::weak_ptr<TcpRail>& w) { return w.expired(); });
    t.rails.push_back(rail);
  }

  Bytes endpoint(std::size_t device) const override {
    return encode_endpoint(devices_[device].address, state_[device]->port);
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

  ProviderCounters counters() const override { return counters_->snapshot(); }

 private:
  struct DeviceState {
    explicit DeviceState(asio::io_context& io) : acceptor(io) {}
    tcp::acceptor acceptor;
    std::uint16_t port = 0;
    std::shared_ptr<KeyTable> keys = std::make_shared<KeyTable>();
  };

  // Handshake state of one connection (either side).
  struct Handshake {
    Handshake(asio::io_context& io, tcp::socket s) : socket(std::move(s)), timer(io) {}
    tcp::socket socket;
    asio::steady_timer timer;
    HeaderBytes header{};
    Bytes payload;
    Bytes out;
    crypto::Nonce challenge{};
    crypto::Nonce client{};
    bool done = false;
    // An accepted connection's: whence and on which NIC.
    std::string from;
    std::string nic;
  };

  // Reads one handshake frame of `op` with a payload of [min, max] bytes into hs->payload.
  template <typename Done>
  static void read_handshake_frame(const std::shared_ptr<Handshake>& hs, FrameOp op,
                                   std::size_t min, std::size_t max, Done done) {
    asio::async_read(hs->socket, asio::buffer(hs->header),
                     [hs, op, min, max, done](error_code ec, std::size_t) {
                       if (hs->done) return;
                       if (ec) return done(ec, false);
                       auto h = decode(hs->header);
                       if (!h || h->op != op || h->length < min || h->length > max)
                         return done(make_error_code(boost::system::errc::protocol_error), false);
                       hs->payload.resize(h->length);
                       asio::async_read(hs->socket, asio::buffer(hs->payload),
                                        [hs, done](error_code ec2, std::size_t) {
                                          if (hs->done) return;
                                          done(ec2, !ec2);
                                        });
                     });
  }

  void start_connect(std::size_t device, tcp::endpoint ep, RailHello hello,
                     std::chrono::milliseconds timeout, ConnectHandler handler) {
    const RailNic& nic = devices_[device];
    tcp::socket s(engine_.io());
    if (auto ec = bind_to_nic(s, nic, ep))
      return handler(
          Status(ErrorCode::kNetwork, fmt::format("cannot bind a rail socket to {} ({}): {}",
                                                  nic.name, nic.address, ec.message())));
    auto hs = std::make_shared<Handshake>(engine_.io(), std::move(s));
    remember(hs);
    const std::string what = fmt::format("rail {} from {} ({}) to {}:{}", hello.rail, nic.name,
                                         nic.address, ep.address().to_string(), ep.port());
    auto finish = std::make_shared<ConnectHandler>(std::move(handler));
    auto fail = [hs, finish, what](const std::string& why) {
      if (hs->done) return;
      hs->done = true;
      error_code ec;
      hs->timer.cancel();
      hs->socket.close(ec);
      (*finish)(Status(ErrorCode::kNetwork, fmt::format("cannot open {}: {}", what, why)));
    };
    hs->timer.expires_after(timeout);
    hs->timer.async_wait([fail, timeout](error_code ec) {
      if (!ec) fail(fmt::format("no handshake within {}ms", timeout.count()));
    });
    hs->socket.async_connect(ep, [this, hs, fail, finish, hello, device](error_code ec) {
      if (hs->done) return;
      if (ec) return fail(ec.message());
      tune(hs->socket);
      // The acceptor's challenge first; the hello answers it.
      read_handshake_frame(
          hs, FrameOp::kChallenge, kChallengeSize, kChallengeSize,
          [this, hs, fail, finish, hello, device](error_code ec1, bool ok) {
            if (!ok)
              return fail(ec1 == asio::error::eof ? "the peer closed the connection before its "
                                                    "challenge"
                                                  : "no valid challenge: " + ec1.message());
            std::memcpy(hs->challenge.data(), hs->payload.data(), kChallengeSize);
            auto payload = encode_hello(hello, hs->challenge, &hs->client);
            if (!payload) return fail(payload.status().message());
            HeaderBytes h = encode(FrameHeader{FrameOp::kHello, 0, 0, 0, 0, payload->size(), 0});
            hs->out.assign(h.begin(), h.end());
            hs->out.insert(hs->out.end(), payload->begin(), payload->end());
            asio::async_write(
                hs->socket, asio::buffer(hs->out),
                [this, hs, fail, finish, hello, device](error_code ec2, std::size_t) {
                  if (hs->done) return;
                  if (ec2) return fail(ec2.message());
                  read_handshake_frame(
                      hs, FrameOp::kHelloAck, kAckSize, kAckSize,
                      [this, hs, fail, finish, hello, device](error_code ec3, bool ok3) {
                        if (!ok3)
                          return fail(ec3 == asio::error::eof
                                          ? "the peer closed the connection during the handshake "
                                            "(wrong token?)"
                                          : "malformed handshake reply: " + ec3.message());
                        if (Status st =
                                check_ack(hs->payload, hello.token, hs->client, hs->challenge);
                            !st)
                          return fail(st.message());
                        hs->done = true;
                        hs->timer.cancel();
                        auto rail = std::make_shared<TcpRail>(
                            engine_, std::move(hs->socket), devices_[device], state_[device]->keys,
                            counters_, hello);
                        track(device, rail);
                        (*finish)(std::shared_ptr<Rail>(rail));
                      });
                });
          });
    });
  }

  // Handshakes under way, for ~TcpProvider to end (loop thread).
  void remember(const std::shared_ptr<Handshake>& hs) {
    std::erase_if(handshakes_, [](const auto& w) { return w.expired(); });
    handshakes_.push_back(hs);
  }

  void accept(std::size_t device) {
    auto& d = *state_[device];
    d.acceptor.async_accept([this, device](error_code ec, tcp::socket s) {
      if (ec) return;  // acceptor closed
      if (device >= state_.size()) return;
      tune(s);
      on_incoming(device, std::move(s));
      accept(device);
    });
  }

  // Accepted connections waiting for their hello (common/pending_hellos.h). Shared with the
  // handshakes' callbacks, which may run after the provider is gone.
  using Pending = PendingHellos<Handshake>;

  void on_incoming(std::size_t device, tcp::socket s) {
    auto hs = std::make_shared<Handshake>(engine_.io(), std::move(s));
    error_code ec;
    auto remote = hs->socket.remote_endpoint(ec);
    const std::string source = remote.address().to_string();
    hs->from = fmt::format("{}:{}", source, remote.port());
    hs->nic = devices_[device].name;
    if (!admit_accepted(*pending_, *counters_, hs, source)) return;
    remember(hs);
    auto drop = [pending = pending_, counters = counters_, hs](const std::string& why) {
      if (!hs->done) drop_accepted(*pending, *counters, *hs, why);
    };
    hs->timer.expires_after(kHelloTimeout);
    hs->timer.async_wait([drop](error_code e) {
      if (!e) drop("no hello within 5s");
    });
    // The challenge goes first; the connector's hello must answer it.
    auto challenge = crypto::make_nonce();
    if (!challenge) return drop(challenge.status().message());
    hs->challenge = *challenge;
    HeaderBytes ch = encode(FrameHeader{FrameOp::kChallenge, 0, 0, 0, 0, kChallengeSize, 0});
    hs->out.assign(ch.begin(), ch.end());
    for (auto b : hs->challenge)
      hs->out.push_back(std::byte{b});
    asio::async_write(hs->socket, asio::buffer(hs->out), [drop](error_code e, std::size_t) {
      if (e) drop(fmt::format("cannot send the challenge ({})", e.message()));
    });
    read_handshake_frame(
        hs, FrameOp::kHello, kHelloMinSize, kHelloMaxSize,
        [this, hs, drop, device](error_code e, bool ok) {
          if (!ok)
            return drop(e == asio::error::eof || e == asio::error::connection_reset
                            ? fmt::format("closed before its hello ({})", e.message())
                            : "malformed hello");
          auto accepted = accept_hello(hs->payload, token_, hs->challenge);
          if (!accepted) return drop(accepted.status().message());
          if (accepted->size != hs->payload.size()) return drop("malformed hello (trailing bytes)");
          auto ack = encode_ack(token_, accepted->client, hs->challenge);
          if (!ack) return drop(ack.status().message());
          if (!accept_handler_) return drop("not accepting rails yet");
          hs->done = true;
          pending_->settle(hs.get());
          hs->timer.cancel();
          auto rail = std::make_shared<TcpRail>(engine_, std::move(hs->socket), devices_[device],
                                                state_[device]->keys, counters_, accepted->hello);
          track(device, rail);
          // The handshake reply goes first: the handler may queue frames on the rail at once.
          rail->send_hello_ack(std::move(*ack));
          if (!accept_handler_(rail)) {
            counters_->dropped_connections.fetch_add(1);
            rail->fence();
          }
        });
  }

  ProgressEngine& engine_;
  std::vector<RailNic> devices_;
  Token token_;
  std::shared_ptr<AtomicProviderCounters> counters_;
  std::vector<std::unique_ptr<DeviceState>> state_;
  AcceptHandler accept_handler_;
  std::vector<std::weak_ptr<Handshake>> handshakes_;  // loop thread
  std::shared_ptr<Pending> pending_ =
      std::make_shared<Pending>(kMaxPendingHellosPerSource, kMaxPendingHellos);
};

}  // namespace

Result<std::unique_ptr<Provider>> make_tcp_provider(ProgressEngine& engine,
                                                    std::vector<RailNic> devices,
                                                    const Token& token) {
  if (devices.empty())
    return Status(ErrorCode::kInvalidArgument, "the tcp provider needs at least one NIC");
  auto p = std::make_unique<TcpProvider>(engine, std::move(devices), token);
  R2CCL_RETURN_IF_ERROR(p->open());
  return std::unique_ptr<Provider>(std::move(p));
}

}  // namespace r2ccl

#include "r2ccl/runtime/fabric.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/steady_timer.hpp>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "r2ccl/runtime/channel.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/progress.h"
#include "r2ccl/runtime/topology.h"

namespace r2ccl {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string_view rail_state_name(RailState s) {
  switch (s) {
    case RailState::kUp:
      return "up";
    case RailState::kSuspect:
      return "suspect";
    case RailState::kDown:
      return "down";
    case RailState::kProbing:
      return "probing";
    case RailState::kDegraded:
      return "degraded";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Op

bool Op::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

Status Op::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

Status Op::wait(milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; }))
    return {ErrorCode::kTimeout,
            fmt::format("operation did not complete within {}ms", timeout.count())};
  return status_;
}

void Op::complete(Status status) {
  {
    std::lock_guard lock(mutex_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
  }
  cv_.notify_all();
}

namespace {

enum class ControlType : std::uint8_t { kCts = 1, kAbort = 2 };

// The receiver's clear-to-send: where the sender writes message `seq`.
struct Cts {
  std::uint64_t seq = 0;
  std::uint64_t length = 0;
  std::uint32_t chunk = 0;
  std::uint64_t offset = 0;  // within the region
  RemoteRegion region;
};

Bytes encode_cts(const Cts& c) {
  ByteWriter w;
  w.u8(static_cast<std::uint8_t>(ControlType::kCts))
      .u64(c.seq)
      .u64(c.length)
      .u32(c.chunk)
      .u64(c.offset);
  c.region.encode(w);
  return w.take();
}

std::uint32_t chunk_count(std::uint64_t length, std::uint64_t chunk) {
  return static_cast<std::uint32_t>((length + chunk - 1) / chunk);
}

std::string describe_bytes(std::uint64_t n) {
  return fmt::format("{} bytes", n);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Channel: all rails to one peer. Progress thread only (apart from construction).

class Channel {
 public:
  Channel(const Config& config, int me, int peer, std::vector<RailNic> local,
          std::vector<std::string> remote_names)
      : config_(config), me_(me), peer_(peer), scheduler_(local.size(), config.rail_window) {
    for (std::size_t i = 0; i < local.size(); ++i) {
      auto slot = std::make_unique<RailSlot>();
      slot->nic = local[i];
      slot->remote_nic = remote_names[i];
      slot->sink.channel = this;
      slot->sink.index = static_cast<std::uint32_t>(i);
      slot->tel.state = RailState::kDown;
      rails_.push_back(std::move(slot));
      scheduler_.set_usable(i, false);
    }
  }

  std::size_t nrails() const { return rails_.size(); }
  int peer() const { return peer_; }

  bool attach(std::uint32_t index, std::shared_ptr<Rail> rail) {
    if (index >= rails_.size() || rails_[index]->rail) return false;
    auto& s = *rails_[index];
    s.rail = std::move(rail);
    s.rail->start(&s.sink);
    s.tel.state = RailState::kUp;
    scheduler_.set_usable(index, true);
    R2CCL_DEBUG("rail {} to rank {} up: {}", index, peer_, s.rail->describe());
    flush_control();
    pump();
    return true;
  }

  void connect_failed(std::uint32_t index, const Status& why) {
    if (index < rails_.size()) rails_[index]->last_error = why.message();
  }

  std::size_t attached() const {
    return static_cast<std::size_t>(std::count_if(
        rails_.begin(), rails_.end(), [](const auto& s) { return s->rail != nullptr; }));
  }
  std::string missing_rails() const {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < rails_.size(); ++i)
      if (!rails_[i]->rail)
        out.push_back(
            fmt::format("rail {} ({} -> {}){}", i, rails_[i]->nic.name, rails_[i]->remote_nic,
                        rails_[i]->last_error.empty() ? "" : ": " + rails_[i]->last_error));
    return fmt::format("{}", fmt::join(out, "; "));
  }

  void post_send(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                 Clock::time_point deadline) {
    const auto seq = next_send_seq_++;
    Send s;
    s.op = std::move(op);
    s.region = std::move(region);
    s.offset = offset;
    s.length = length;
    s.deadline = deadline;
    sends_.emplace(seq, std::move(s));
    if (auto it = early_cts_.find(seq); it != early_cts_.end()) {
      Cts c = it->second;
      early_cts_.erase(it);
      start_send(seq, c);
    }
  }

  void post_recv(OpPtr op, RegionPtr region, std::size_t offset, std::size_t length,
                 Clock::time_point deadline) {
    const auto seq = next_recv_seq_++;
    const auto slot = static_cast<std::uint32_t>(seq % ChunkImm::kSlots);
    if (recv_slots_.count(slot) != 0) {
      op->complete(
          {ErrorCode::kUnavailable,
           fmt::format("more than {} receives from rank {} outstanding", ChunkImm::kSlots, peer_)});
      return;
    }
    Cts cts;
    cts.seq = seq;
    cts.length = length;
    cts.chunk = static_cast<std::uint32_t>(config_.chunk_size);
    cts.offset = offset;
    cts.region = RemoteRegion{region->id, region->length, region->keys};
    Recv r;
    r.op = op;
    r.region = std::move(region);
    r.seq = seq;
    r.length = length;
    r.deadline = deadline;
    r.arrivals = ArrivalSet(chunk_count(length, cts.chunk));
    send_control(encode_cts(cts));
    if (length == 0) {
      op->complete(Status::ok());
      return;
    }
    recv_slots_.emplace(slot, std::move(r));
  }

  void check_deadlines(Clock::time_point now) {
    for (auto it = sends_.begin(); it != sends_.end();) {
      auto& s = it->second;
      if (now < s.deadline) {
        ++it;
        continue;
      }
      const auto seq = it->first;
      const auto confirmed = s.confirmed;
      const auto total = s.nchunks;
      auto op = s.op;
      drop_send(it++);
      op->complete(
          {ErrorCode::kTimeout,
           fmt::format("send #{} of {} to rank {} timed out after {}ms ({}): rails: {}", seq,
                       describe_bytes(s.length), peer_, config_.timeout.count(),
                       s.started ? fmt::format("{} of {} chunks confirmed", confirmed, total)
                                 : std::string("rank ") + std::to_string(peer_) +
                                       " never posted the matching receive",
                       rail_summary())});
    }
    for (auto it = recv_slots_.begin(); it != recv_slots_.end();) {
      auto& r = it->second;
      if (now < r.deadline) {
        ++it;
        continue;
      }
      r.op->complete(
          {ErrorCode::kTimeout,
           fmt::format("receive #{} of {} from rank {} timed out after {}ms ({} of {} chunks "
                       "arrived): rails: {}",
                       r.seq, describe_bytes(r.length), peer_, config_.timeout.count(),
                       r.arrivals.count(), r.arrivals.chunks(), rail_summary())});
      it = recv_slots_.erase(it);
    }
  }

  // Measured bandwidth per rail, an exponentially weighted average over `dt` periods.
  void tick(double dt) {
    for (auto& s : rails_) {
      const double inst = static_cast<double>(s->confirmed_since_tick) / dt;
      s->confirmed_since_tick = 0;
      if (inst > 0) s->bandwidth = s->bandwidth == 0 ? inst : 0.7 * s->bandwidth + 0.3 * inst;
      s->tel.bandwidth_bps = static_cast<std::uint64_t>(s->bandwidth);
    }
  }

  void snapshot(std::vector<RailSnapshot>& out) const {
    for (std::size_t i = 0; i < rails_.size(); ++i) {
      const auto& s = *rails_[i];
      RailSnapshot r;
      r.peer = peer_;
      r.rail = static_cast<std::uint32_t>(i);
      r.nic = s.nic.name;
      r.remote_nic = s.remote_nic;
      r.state = s.tel.state.load();
      r.tx_bytes = s.tel.tx_bytes.load();
      r.rx_bytes = s.tel.rx_bytes.load();
      r.tx_chunks = s.tel.tx_chunks.load();
      r.rx_chunks = s.tel.rx_chunks.load();
      r.replayed_chunks = s.tel.replayed_chunks.load();
      r.replayed_bytes = s.tel.replayed_bytes.load();
      r.errors = s.tel.errors.load();
      r.failovers = s.tel.failovers.load();
      r.bandwidth_bps = s.tel.bandwidth_bps.load();
      r.last_error = s.last_error;
      out.push_back(std::move(r));
    }
  }

  void shutdown() {
    closing_ = true;
    for (auto& s : rails_)
      if (s->rail) s->rail->fence();
    const Status gone(ErrorCode::kAborted, "the fabric was destroyed");
    for (auto& [seq, s] : sends_)
      s.op->complete(gone);
    for (auto& [slot, r] : recv_slots_)
      r.op->complete(gone);
    sends_.clear();
    recv_slots_.clear();
  }

 private:
  struct Sink final : RailEvents {
    Channel* channel = nullptr;
    std::uint32_t index = 0;
    void on_write_confirmed(std::uint64_t cookie) override { channel->on_confirmed(index, cookie); }
    void on_write_refused(std::uint64_t cookie, const Status& why) override {
      channel->on_refused(index, cookie, why);
    }
    void on_write_arrived(std::uint32_t imm, std::size_t length) override {
      channel->on_arrived(index, imm, length);
    }
    void on_control(Bytes message) override { channel->on_control(index, std::move(message)); }
    void on_rail_failed(const Status& why) override { channel->on_rail_failed(index, why); }
  };
  struct RailSlot {
    std::shared_ptr<Rail> rail;
    Sink sink;
    RailNic nic;
    std::string remote_nic;
    std::string last_error;
    RailTelemetry tel;
    std::uint64_t confirmed_since_tick = 0;
    double bandwidth = 0;
  };
  struct Send {
    OpPtr op;
    RegionPtr region;
    std::size_t offset = 0;
    std::size_t length = 0;
    Clock::time_point deadline;
    bool started = false;
    Cts cts;
    std::uint32_t nchunks = 0;
    std::uint32_t next_chunk = 0;
    std::uint32_t confirmed = 0;
  };
  struct Recv {
    OpPtr op;
    RegionPtr region;
    std::uint64_t seq = 0;
    std::size_t length = 0;
    Clock::time_point deadline;
    ArrivalSet arrivals;
  };

  std::string rail_summary() const {
    std::vector<std::string> parts;
    for (std::size_t i = 0; i < rails_.size(); ++i) {
      const auto& s = *rails_[i];
      std::string p = fmt::format("{} ({} -> {}) {}", i, s.nic.name, s.remote_nic,
                                  rail_state_name(s.tel.state.load()));
      if (scheduler_.inflight(i) > 0)
        p += fmt::format(", {} bytes unconfirmed", scheduler_.inflight(i));
      if (!s.last_error.empty()) p += ": " + s.last_error;
      parts.push_back(p);
    }
    return fmt::format("{}", fmt::join(parts, "; "));
  }

  void send_control(Bytes msg) {
    control_backlog_.push_back(std::move(msg));
    flush_control();
  }
  void flush_control() {
    while (!control_backlog_.empty()) {
      std::size_t i = 0;
      while (i < rails_.size() && !(rails_[i]->rail && scheduler_.usable(i)))
        ++i;
      if (i == rails_.size()) return;  // no rail yet; sent when one comes up
      Status st = rails_[i]->rail->post_control(control_backlog_.front());
      if (!st) return;
      control_backlog_.pop_front();
    }
  }

  void start_send(std::uint64_t seq, const Cts& cts) {
    auto it = sends_.find(seq);
    auto& s = it->second;
    if (cts.length != s.length) {
      const std::string why = fmt::format(
          "size mismatch in message #{} between rank {} and rank {}: the sender sends {}, the "
          "receiver posted {}",
          seq, me_, peer_, describe_bytes(s.length), describe_bytes(cts.length));
      ByteWriter w;
      w.u8(static_cast<std::uint8_t>(ControlType::kAbort)).u64(seq).str(why);
      send_control(w.take());
      auto op = s.op;
      sends_.erase(it);
      op->complete({ErrorCode::kInvalidArgument, why});
      return;
    }
    if (cts.region.keys.size() < rails_.size() || cts.chunk == 0) {
      auto op = s.op;
      sends_.erase(it);
      op->complete(
          {ErrorCode::kProtocol, fmt::format("rank {} sent a malformed clear-to-send", peer_)});
      return;
    }
    s.started = true;
    s.cts = cts;
    s.nchunks = chunk_count(s.length, cts.chunk);
    if (s.nchunks > ChunkImm::kMaxChunks) {
      auto op = s.op;
      sends_.erase(it);
      op->complete(
          {ErrorCode::kInvalidArgument,
           fmt::format(
               "a message of {} needs {} chunks of {}; at most {} fit: raise R2CCL_CHUNK_SIZE",
               describe_bytes(s.length), s.nchunks, cts.chunk, ChunkImm::kMaxChunks)});
      return;
    }
    if (s.nchunks == 0) {
      auto op = s.op;
      sends_.erase(it);
      op->complete(Status::ok());
      return;
    }
    ready_.push_back(seq);
    pump();
  }

  // Posts chunks while some rail has room: replays first, then new chunks round-robin over the
  // messages in flight so a large message does not starve small ones.
  void pump() {
    while (true) {
      InflightChunk c;
      bool replay = false;
      if (!replay_.empty()) {
        c = replay_.front();
        replay = true;
      } else {
        while (!ready_.empty() && sends_.count(ready_.front()) == 0)
          ready_.pop_front();
        if (ready_.empty()) return;
        auto& s = sends_.at(ready_.front());
        c.message = ready_.front();
        c.index = s.next_chunk;
        c.offset = static_cast<std::uint64_t>(c.index) * s.cts.chunk;
        c.length = std::min<std::uint64_t>(s.cts.chunk, s.length - c.offset);
      }
      auto rail = scheduler_.pick(c.length);
      if (!rail) return;
      auto sit = sends_.find(c.message);
      if (sit == sends_.end()) {  // a replayed chunk of a message that has since failed
        scheduler_.release(*rail, c.length);
        replay_.pop_front();
        continue;
      }
      auto& s = sit->second;
      c.rail = static_cast<std::uint32_t>(*rail);
      WriteRequest w;
      w.src = s.region->base + s.offset + c.offset;
      w.length = c.length;
      w.remote_key = s.cts.region.keys[*rail];
      w.remote_offset = s.cts.offset + c.offset;
      w.imm = ChunkImm::encode(static_cast<std::uint32_t>(c.message % ChunkImm::kSlots), c.index);
      w.cookie = ledger_.add(c);
      Status st = rails_[*rail]->rail->post_write(w);
      if (!st) {
        ledger_.confirm(w.cookie);
        scheduler_.release(*rail, c.length);
        scheduler_.set_usable(*rail, false);
        continue;  // the rail reports its failure separately
      }
      auto& tel = rails_[*rail]->tel;
      if (replay) {
        replay_.pop_front();
        tel.replayed_chunks.fetch_add(1, std::memory_order_relaxed);
        tel.replayed_bytes.fetch_add(c.length, std::memory_order_relaxed);
      } else {
        ready_.pop_front();
        if (++s.next_chunk < s.nchunks) ready_.push_back(c.message);
      }
    }
  }

  void drop_send(std::map<std::uint64_t, Send>::iterator it) {
    for (const auto& c : ledger_.take_message(it->first))
      scheduler_.release(c.rail, c.length);
    std::erase_if(replay_, [&](const InflightChunk& c) { return c.message == it->first; });
    sends_.erase(it);
  }

  void on_confirmed(std::uint32_t rail, std::uint64_t cookie) {
    auto c = ledger_.confirm(cookie);
    if (!c) return;  // repeated or stale confirmation
    scheduler_.release(rail, c->length);
    auto& s = *rails_[rail];
    s.tel.tx_bytes.fetch_add(c->length, std::memory_order_relaxed);
    s.tel.tx_chunks.fetch_add(1, std::memory_order_relaxed);
    s.confirmed_since_tick += c->length;
    if (auto it = sends_.find(c->message); it != sends_.end()) {
      if (++it->second.confirmed == it->second.nchunks) {
        auto op = it->second.op;
        sends_.erase(it);
        op->complete(Status::ok());
      }
    }
    pump();
  }

  void on_refused(std::uint32_t rail, std::uint64_t cookie, const Status& why) {
    auto c = ledger_.confirm(cookie);
    rails_[rail]->tel.errors.fetch_add(1, std::memory_order_relaxed);
    if (!c) return;
    scheduler_.release(rail, c->length);
    if (auto it = sends_.find(c->message); it != sends_.end()) {
      auto op = it->second.op;
      drop_send(it);
      op->complete(why.with_context(fmt::format("message #{} to rank {}", c->message, peer_)));
    }
    pump();
  }

  void on_arrived(std::uint32_t rail, std::uint32_t imm, std::size_t length) {
    auto& tel = rails_[rail]->tel;
    tel.rx_bytes.fetch_add(length, std::memory_order_relaxed);
    tel.rx_chunks.fetch_add(1, std::memory_order_relaxed);
    auto it = recv_slots_.find(ChunkImm::slot(imm));
    if (it == recv_slots_.end()) return;  // a late duplicate of a completed or failed receive
    auto& r = it->second;
    if (r.arrivals.mark(ChunkImm::index(imm)) && r.arrivals.complete()) {
      auto op = r.op;
      recv_slots_.erase(it);
      op->complete(Status::ok());
    }
  }

  void on_control(std::uint32_t rail, Bytes msg) {
    ByteReader r(msg);
    const auto type = static_cast<ControlType>(r.u8());
    if (type == ControlType::kCts) {
      Cts c;
      c.seq = r.u64();
      c.length = r.u64();
      c.chunk = r.u32();
      c.offset = r.u64();
      c.region = RemoteRegion::decode(r);
      if (!r.finish("clear-to-send").is_ok())
        return protocol_error(rail, "malformed clear-to-send");
      if (sends_.count(c.seq) != 0)
        start_send(c.seq, c);
      else
        early_cts_[c.seq] = c;
      return;
    }
    if (type == ControlType::kAbort) {
      const auto seq = r.u64();
      std::string why = r.str(4096);
      if (!r.finish("abort").is_ok()) return protocol_error(rail, "malformed abort");
      auto it = recv_slots_.find(static_cast<std::uint32_t>(seq % ChunkImm::kSlots));
      if (it != recv_slots_.end() && it->second.seq == seq) {
        auto op = it->second.op;
        recv_slots_.erase(it);
        op->complete({ErrorCode::kInvalidArgument, why});
      }
      return;
    }
    protocol_error(rail, fmt::format("unknown control message type {}", static_cast<int>(type)));
  }

  void protocol_error(std::uint32_t rail, const std::string& what) {
    R2CCL_WARN("rank {} on rail {}: {}", peer_, rail, what);
    rails_[rail]->tel.errors.fetch_add(1, std::memory_order_relaxed);
  }

  void on_rail_failed(std::uint32_t index, const Status& why) {
    auto& s = *rails_[index];
    s.last_error = why.message();
    s.tel.state = RailState::kDown;
    s.tel.errors.fetch_add(1, std::memory_order_relaxed);
    s.tel.failovers.fetch_add(1, std::memory_order_relaxed);
    scheduler_.set_usable(index, false);
    // The connection is closed (fenced): nothing more lands from it. Replay what it left
    // unconfirmed on the surviving rails.
    auto lost = ledger_.take_rail(index);
    for (const auto& c : lost) {
      scheduler_.release(index, c.length);
      replay_.push_back(c);
    }
    // A peer that closes its rails while nothing is in flight is most likely shutting down.
    const bool idle = sends_.empty() && recv_slots_.empty() && lost.empty();
    const std::size_t usable = scheduler_.usable_count();
    log(closing_ || idle ? LogLevel::kInfo : LogLevel::kWarn,
        "rail {} ({} -> {}) to rank {} failed: {}; {}", index, s.nic.name, s.remote_nic, peer_,
        why.message(),
        usable > 0 ? fmt::format("replaying {} chunk(s) on {} rail(s)", lost.size(), usable)
                   : fmt::format("no usable rail left: {} chunk(s) wait for one until the deadline",
                                 lost.size()));
    pump();
  }

  const Config& config_;
  int me_;
  int peer_;
  std::vector<std::unique_ptr<RailSlot>> rails_;
  RailScheduler scheduler_;
  InflightLedger ledger_;
  std::deque<Bytes> control_backlog_;
  bool closing_ = false;

  std::uint64_t next_send_seq_ = 0;
  std::map<std::uint64_t, Send> sends_;
  std::map<std::uint64_t, Cts> early_cts_;
  std::deque<std::uint64_t> ready_;
  std::deque<InflightChunk> replay_;

  std::uint64_t next_recv_seq_ = 0;
  std::map<std::uint32_t, Recv> recv_slots_;
};

// Messages a rank sends to itself: matched in order and copied.
class SelfChannel {
 public:
  void post(bool is_send, OpPtr op, std::byte* ptr, std::size_t length) {
    (is_send ? sends_ : recvs_).push_back({std::move(op), ptr, length});
    while (!sends_.empty() && !recvs_.empty()) {
      auto s = sends_.front();
      auto r = recvs_.front();
      sends_.pop_front();
      recvs_.pop_front();
      if (s.length != r.length) {
        Status why(ErrorCode::kInvalidArgument,
                   fmt::format("size mismatch in a message to self: sent {}, posted {}",
                               describe_bytes(s.length), describe_bytes(r.length)));
        s.op->complete(why);
        r.op->complete(why);
        continue;
      }
      if (s.length > 0) std::memmove(r.ptr, s.ptr, s.length);
      s.op->complete(Status::ok());
      r.op->complete(Status::ok());
    }
  }
  void shutdown() {
    const Status gone(ErrorCode::kAborted, "the fabric was destroyed");
    for (auto& e : sends_)
      e.op->complete(gone);
    for (auto& e : recvs_)
      e.op->complete(gone);
    sends_.clear();
    recvs_.clear();
  }

 private:
  struct Entry {
    OpPtr op;
    std::byte* ptr;
    std::size_t length;
  };
  std::deque<Entry> sends_;
  std::deque<Entry> recvs_;
};

// ---------------------------------------------------------------------------------------------
// Fabric

struct Fabric::Watchdog {
  explicit Watchdog(boost::asio::io_context& io) : timer(io) {}
  boost::asio::steady_timer timer;
  Clock::time_point last = Clock::now();
  bool stopped = false;
};

namespace {

constexpr milliseconds kTick{100};

// The local address the kernel would use to reach `host` (no packet is sent).
Result<std::string> route_source_address(const std::string& host, std::uint16_t port) {
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &dst.sin_addr) != 1)
    return Status(ErrorCode::kConfig,
                  fmt::format("R2CCL_BOOTSTRAP host '{}' is not an IPv4 address", host));
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(ErrorCode::kNetwork, "cannot open a UDP socket");
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0) {
    sockaddr_in src{};
    socklen_t len = sizeof src;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&src), &len) == 0) {
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &src.sin_addr, buf, sizeof buf);
      out = buf;
    }
  }
  ::close(fd);
  if (out.empty())
    return Status(ErrorCode::kBootstrap, fmt::format("no route to rank 0 at {}:{}", host, port));
  return out;
}

}  // namespace

Fabric::Fabric() = default;

Fabric::~Fabric() {
  if (engine_) {
    engine_->call([this] {
      if (watchdog_) {
        watchdog_->stopped = true;
        watchdog_->timer.cancel();
      }
      for (auto& c : channels_)
        if (c) c->shutdown();
      if (self_) self_->shutdown();
    });
  }
  registry_.reset();
  provider_.reset();
  engine_.reset();
  channels_.clear();
  bootstrap_.reset();
}

Result<std::unique_ptr<Fabric>> Fabric::create(const Config& config, const BootstrapOptions& boot) {
  std::unique_ptr<Fabric> f(new Fabric());
  f->config_ = config;
  f->rail_token_ = boot.token;
  set_log_level(config.log_level);
  set_log_rank(boot.rank);
  for (const auto& name : unknown_variables())
    R2CCL_WARN("unknown variable {} is ignored (a typo?)", name);

  R2CCL_ASSIGN_OR_RETURN(auto topo, discover_topology());
  std::string control;
  if (!config.socket_ifname.empty()) {
    auto a = interface_ipv4(config.socket_ifname);
    if (!a) return a.status().with_context("R2CCL_SOCKET_IFNAME");
    control = *a;
  } else {
    auto a = route_source_address(boot.root.host, boot.root.port);
    if (a) control = *a;  // a host name: rails are then chosen without excluding it
  }
  R2CCL_ASSIGN_OR_RETURN(auto nics, select_rails(topo, config.nics, control));

  f->engine_ = std::make_unique<ProgressEngine>();
  R2CCL_ASSIGN_OR_RETURN(f->provider_, make_tcp_provider(*f->engine_, nics, boot.token));
  f->registry_ = std::make_unique<MemoryRegistry>(*f->provider_);

  ByteWriter info;
  info.u32(static_cast<std::uint32_t>(nics.size()));
  for (std::size_t i = 0; i < nics.size(); ++i)
    info.str(nics[i].name).blob(f->provider_->endpoint(i));
  R2CCL_ASSIGN_OR_RETURN(f->bootstrap_, Bootstrap::join(boot, info.bytes()));
  R2CCL_RETURN_IF_ERROR(f->connect_all(f->bootstrap_->rank_info()));
  f->arm_watchdog();
  R2CCL_INFO("fabric up: rank {} of {}, {} rail(s): {}", f->rank(), f->nranks(), nics.size(),
             fmt::join(
                 [&] {
                   std::vector<std::string> n;
                   for (const auto& r : nics)
                     n.push_back(r.name + "=" + r.address);
                   return n;
                 }(),
                 ", "));
  return f;
}

Status Fabric::connect_all(const std::vector<Bytes>& infos) {
  const int me = rank();
  const auto& nics = provider_->devices();
  struct PeerInfo {
    std::vector<std::string> names;
    std::vector<Bytes> endpoints;
  };
  std::vector<PeerInfo> peers(infos.size());
  for (std::size_t p = 0; p < infos.size(); ++p) {
    ByteReader r(infos[p]);
    const auto n = r.u32();
    for (std::uint32_t i = 0; i < n && r.ok() && i < 256; ++i) {
      peers[p].names.push_back(r.str(256));
      peers[p].endpoints.push_back(r.blob(1024));
    }
    R2CCL_RETURN_IF_ERROR(
        r.finish("rail endpoints").with_context(fmt::format("rank {}'s bootstrap info", p)));
  }
  channels_.resize(infos.size());
  for (std::size_t p = 0; p < infos.size(); ++p) {
    if (static_cast<int>(p) == me) continue;
    const std::size_t n = std::min(nics.size(), peers[p].names.size());
    if (n == 0) return {ErrorCode::kUnavailable, fmt::format("rank {} has no rails", p)};
    std::vector<RailNic> local(nics.begin(), nics.begin() + static_cast<std::ptrdiff_t>(n));
    std::vector<std::string> remote(peers[p].names.begin(),
                                    peers[p].names.begin() + static_cast<std::ptrdiff_t>(n));
    channels_[p] = std::make_unique<Channel>(config_, me, static_cast<int>(p), local, remote);
  }
  self_ = std::make_unique<SelfChannel>();
  provider_->set_accept_handler([this, me](std::shared_ptr<Rail> rail) {
    const auto& h = rail->hello();
    if (h.dst_rank != static_cast<std::uint32_t>(me) || h.src_rank >= channels_.size() ||
        !channels_[h.src_rank] || static_cast<int>(h.src_rank) > me) {
      R2CCL_WARN("refused a rail claiming to be rank {} -> rank {} rail {}", h.src_rank, h.dst_rank,
                 h.rail);
      return false;
    }
    return channels_[h.src_rank]->attach(h.rail, std::move(rail));
  });
  // Everybody accepts before anybody connects.
  R2CCL_RETURN_IF_ERROR(
      bootstrap_->barrier(config_.connect_timeout).with_context("before connecting rails"));

  // The lower rank connects to the higher one; rail i joins NIC i on both sides.
  for (std::size_t p = static_cast<std::size_t>(me) + 1; p < channels_.size(); ++p) {
    Channel* ch = channels_[p].get();
    for (std::size_t i = 0; i < ch->nrails(); ++i) {
      RailHello hello;
      hello.token = rail_token_;
      hello.src_rank = static_cast<std::uint32_t>(me);
      hello.dst_rank = static_cast<std::uint32_t>(p);
      hello.rail = static_cast<std::uint32_t>(i);
      provider_->connect(i, peers[p].endpoints[i], hello, config_.connect_timeout,
                         [ch, i](Result<std::shared_ptr<Rail>> r) {
                           if (r)
                             ch->attach(static_cast<std::uint32_t>(i), std::move(*r));
                           else
                             ch->connect_failed(static_cast<std::uint32_t>(i), r.status());
                         });
    }
  }
  const auto deadline = Clock::now() + config_.connect_timeout + milliseconds(500);
  while (true) {
    std::string missing = engine_->call([&] {
      std::vector<std::string> out;
      for (const auto& c : channels_)
        if (c && c->attached() < c->nrails())
          out.push_back(fmt::format("to rank {}: {}", c->peer(), c->missing_rails()));
      return fmt::format("{}", fmt::join(out, "; "));
    });
    if (missing.empty()) break;
    if (Clock::now() >= deadline)
      return {ErrorCode::kNetwork, fmt::format("rank {} could not open every rail within {}ms: {}",
                                               me, config_.connect_timeout.count(), missing)};
    std::this_thread::sleep_for(milliseconds(5));
  }
  return bootstrap_->barrier(config_.connect_timeout).with_context("after connecting rails");
}

void Fabric::arm_watchdog() {
  watchdog_ = std::make_unique<Watchdog>(engine_->io());
  engine_->post([this] {
    struct Loop {
      Fabric* f;
      void operator()(boost::system::error_code ec) const {
        auto& w = *f->watchdog_;
        if (ec || w.stopped) return;
        const auto now = Clock::now();
        const double dt = std::chrono::duration<double>(now - w.last).count();
        w.last = now;
        for (auto& c : f->channels_) {
          if (!c) continue;
          c->check_deadlines(now);
          c->tick(dt);
        }
        w.timer.expires_after(kTick);
        w.timer.async_wait(*this);
      }
    };
    watchdog_->timer.expires_after(kTick);
    watchdog_->timer.async_wait(Loop{this});
  });
}

int Fabric::rank() const {
  return bootstrap_->rank();
}
int Fabric::nranks() const {
  return bootstrap_->nranks();
}
const std::vector<RailNic>& Fabric::nics() const {
  return provider_->devices();
}

std::size_t Fabric::rails_to(int peer) const {
  if (peer < 0 || peer >= nranks() || !channels_[static_cast<std::size_t>(peer)]) return 0;
  return channels_[static_cast<std::size_t>(peer)]->nrails();
}

Result<RegionPtr> Fabric::register_memory(void* base, std::size_t length) {
  return registry_->register_region(base, length);
}

Status Fabric::deregister_memory(const RegionPtr& region) {
  if (!region) return {ErrorCode::kInvalidArgument, "deregister_memory: null region"};
  return registry_->deregister_region(region->id);
}

Status Fabric::check_args(int peer, const RegionPtr& region, std::size_t offset, std::size_t length,
                          const char* what) const {
  if (peer < 0 || peer >= nranks())
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: peer {} is out of range (0..{})", what, peer, nranks() - 1)};
  if (!region)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: the buffer is not registered (null region)", what)};
  if (offset > region->length || length > region->length - offset)
    return {ErrorCode::kInvalidArgument,
            fmt::format("{}: {} bytes at offset {} exceed the registered region of {} bytes", what,
                        length, offset, region->length)};
  return Status::ok();
}

Result<OpPtr> Fabric::isend(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "send"));
  auto op = std::make_shared<Op>();
  const auto deadline = Clock::now() + config_.timeout;
  engine_->post([this, op, region, offset, length, peer, deadline] {
    if (peer == rank())
      self_->post(true, op, region->base + offset, length);
    else
      channels_[static_cast<std::size_t>(peer)]->post_send(op, region, offset, length, deadline);
  });
  return op;
}

Result<OpPtr> Fabric::irecv(int peer, const RegionPtr& region, std::size_t offset,
                            std::size_t length) {
  R2CCL_RETURN_IF_ERROR(check_args(peer, region, offset, length, "receive"));
  auto op = std::make_shared<Op>();
  const auto deadline = Clock::now() + config_.timeout;
  engine_->post([this, op, region, offset, length, peer, deadline] {
    if (peer == rank())
      self_->post(false, op, region->base + offset, length);
    else
      channels_[static_cast<std::size_t>(peer)]->post_recv(op, region, offset, length, deadline);
  });
  return op;
}

Status Fabric::wait(const OpPtr& op) {
  if (!op) return {ErrorCode::kInvalidArgument, "wait: null operation"};
  // The watchdog fails an operation at its deadline; the extra second only guards against a
  // stuck progress thread.
  return op->wait(config_.timeout + milliseconds(1000));
}

std::vector<RailSnapshot> Fabric::rail_snapshot() const {
  return engine_->call([this] {
    std::vector<RailSnapshot> out;
    for (const auto& c : channels_)
      if (c) c->snapshot(out);
    return out;
  });
}

ProviderCounters Fabric::provider_counters() const {
  return provider_->counters();
}

}  // namespace r2ccl

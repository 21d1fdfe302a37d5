#include "r2ccl/kv/engine.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "r2ccl/runtime/log.h"

namespace r2ccl::kv {

using Clock = std::chrono::steady_clock;

std::string_view request_state_name(RequestState s) {
  switch (s) {
    case RequestState::kPending:
      return "PENDING";
    case RequestState::kInFlight:
      return "IN_FLIGHT";
    case RequestState::kDone:
      return "DONE";
    case RequestState::kFailed:
      return "FAILED";
    case RequestState::kCancelled:
      return "CANCELLED";
  }
  return "?";
}

namespace {

constexpr std::uint32_t kMetaMagic = 0x564b3252;  // "R2KV"
constexpr std::uint32_t kMetaVersion = 2;
constexpr auto kService = static_cast<std::uint8_t>(Fabric::Service::kKvTransfer);
constexpr std::uint64_t kMaxWriteBytes = 4u << 20;  // coalesced writes stay below this

// kCancel: the requester of a pull abandoned it (the side that pushes stops issuing writes).
enum class MsgType : std::uint8_t { kNotify = 1, kPull = 2, kCancel = 3 };

std::uint64_t block_hash(const std::byte* p, std::uint64_t n, std::uint32_t layer,
                         std::uint32_t part) {
  return XXH3_64bits_withSeed(p, n, (static_cast<std::uint64_t>(layer) << 2) | part);
}

void encode_spans(ByteWriter& w, const std::vector<BlockSpan>& spans) {
  w.u32(static_cast<std::uint32_t>(spans.size()));
  for (const auto& s : spans) {
    w.u32(s.first_layer).u32(s.last_layer).u32(static_cast<std::uint32_t>(s.src_blocks.size()));
    for (std::size_t i = 0; i < s.src_blocks.size(); ++i)
      w.u32(s.src_blocks[i]).u32(s.dst_blocks[i]);
  }
}

bool decode_spans(ByteReader& r, std::vector<BlockSpan>* out) {
  const auto n = r.u32();
  if (!r.ok() || n > 1u << 16) return false;
  for (std::uint32_t i = 0; i < n; ++i) {
    BlockSpan s;
    s.first_layer = r.u32();
    s.last_layer = r.u32();
    const auto m = r.u32();
    if (!r.ok() || m > r.remaining() / 8) return false;
    for (std::uint32_t j = 0; j < m; ++j) {
      s.src_blocks.push_back(r.u32());
      s.dst_blocks.push_back(r.u32());
    }
    out->push_back(std::move(s));
  }
  return r.ok();
}

}  // namespace

struct KvEngine::Impl : std::enable_shared_from_this<KvEngine::Impl> {
  struct Pool {
    std::vector<std::span<std::byte>> buffers;
    std::vector<RegionPtr> regions;
    KvLayout layout;
  };
  struct RemotePool {
    KvLayout layout;
    std::vector<RemoteRegion> buffers;
  };
  struct Write {
    std::uint32_t src_buffer = 0, dst_buffer = 0;
    std::uint64_t src_offset = 0, dst_offset = 0, bytes = 0;
    std::vector<std::uint32_t> dst_blocks;
  };
  // A request this side pushes: its own, or one a peer pulled (requester >= 0).
  struct Key {
    int requester = -1;
    std::uint64_t id = 0;
    bool operator<(const Key& o) const {
      return requester != o.requester ? requester < o.requester : id < o.id;
    }
  };
  struct Request {
    std::uint64_t id = 0;
    int peer = -1;
    std::uint32_t local_pool = 0, remote_pool = 0;
    bool is_pull_record = false;   // we asked `peer` to push; it reports back
    Clock::time_point deadline{};  // a pull record: it fails when this passes
    // A pull record ended here (deadline, the peer left, cancelled): what the peer says of it
    // later is ignored.
    bool abandoned = false;
    RequestState state = RequestState::kPending;
    bool sealed = false;
    bool cancelled = false;
    bool failed = false;
    std::string reason;
    bool preserved = false;
    std::deque<Write> pending;
    std::size_t inflight = 0;
    std::set<std::uint32_t> dst_blocks;
    std::set<std::uint32_t> invalid;
    std::vector<std::uint32_t> invalid_list;  // once ended
    Bytes payload;
    std::uint64_t bytes = 0;
    Clock::time_point started = Clock::now();
    std::chrono::nanoseconds duration{0};
    // Verification: per destination block, the XOR of its (layer, part) hashes; the layers.
    std::map<std::uint32_t, std::uint64_t> hashes;
    std::set<std::uint32_t> layers;
    bool ended() const {
      return state == RequestState::kDone || state == RequestState::kFailed ||
             state == RequestState::kCancelled;
    }
  };
  struct PeerQueue {
    std::deque<Key> active;  // round-robin: one write per request per turn
    std::uint64_t inflight_bytes = 0;
  };
  struct Received {
    Notification note;
    bool local = false;    // a pull that ended here (no word from the peer)
    std::size_t cost = 0;  // counted in queued_bytes while it waits (inbox, then received)
    // To verify on the receiving side.
    std::uint32_t pool = 0;
    std::vector<std::uint32_t> layers;
    std::vector<std::pair<std::uint32_t, std::uint64_t>> hashes;
  };
  struct Issue {
    Key key;
    int peer;
    Write write;
  };
  struct Outgoing {
    int peer;
    Bytes message;
    bool control_path;
  };

  Endpoint& endpoint;
  Fabric* world = nullptr;  // when the engine runs in a world: ranks, and its control path
  EngineOptions options;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<Pool> pools;
  std::map<int, std::vector<RemotePool>> peers;
  std::map<Key, Request> requests;
  std::map<int, PeerQueue> queues;
  std::deque<Received> received;  // verified, for poll_notifications / wait_notification
  static constexpr std::size_t kHistory = 1u << 16;  // ended requests kept for status()
  std::deque<Key> ended;
  // Notifications from peers go from the progress loop to a worker thread, which verifies them
  // (R2CCL_KV_VERIFY) without the engine's lock and hands them to the callback outside it, or
  // queues them in `received`. Both queues are bounded: past kMaxQueued notifications each, or
  // options.max_queued_bytes for both together, a notification is dropped, saying so.
  std::function<void(const Notification&)> callback;
  std::deque<Received> inbox;
  static constexpr std::size_t kMaxQueued = 1u << 16;
  std::uint64_t queued_bytes = 0;  // of the notifications in inbox and received
  std::condition_variable inbox_cv;
  bool stopping = false;
  std::map<std::uint32_t, int> verifying;  // pool -> verifications under way
  // Pulls of peers whose checksums (R2CCL_KV_VERIFY) the worker reads before they are planned:
  // reading the blocks (out of a GPU, perhaps) stays off the progress loop. Bounded by
  // kMaxQueued; past it a pull is refused.
  struct PullJob {
    Key key;
    std::vector<BlockSpan> spans;
  };
  std::deque<PullJob> pull_jobs;
  // Pull records in flight by deadline; the worker fails them when it passes.
  std::set<std::pair<Clock::time_point, std::uint64_t>> pull_deadlines;
  int peer_listener = -1;  // the endpoint's peer events (pulls of a peer that leaves fail)
  std::thread worker;
  EngineCounters counters;

  // Published for the monitor (r2ccl_kv_*).
  MetricRegistry::Counter* m_bytes = nullptr;
  MetricRegistry::Counter* m_done = nullptr;
  MetricRegistry::Counter* m_failed = nullptr;
  MetricRegistry::Counter* m_cancelled = nullptr;
  MetricRegistry::Counter* m_preserved = nullptr;
  MetricRegistry::Histogram* m_duration = nullptr;

  Impl(Endpoint& e, Fabric* w, EngineOptions o) : endpoint(e), world(w), options(o) {
    auto& reg = e.metrics();
    // In a world, series are labelled by rank; otherwise by the endpoint's name.
    const MetricRegistry::Labels who =
        w ? MetricRegistry::Labels{{"rank", std::to_string(w->rank())}}
          : MetricRegistry::Labels{{"endpoint", e.name()}};
    auto with = [&](const char* k, const char* v) {
      auto l = who;
      l.emplace_back(k, v);
      return l;
    };
    m_bytes = &reg.counter("r2ccl_kv_transfer_bytes_total",
                           "KV-cache bytes of requests that ended DONE.", who);
    const char* help = "KV transfer requests that ended, by status.";
    m_done = &reg.counter("r2ccl_kv_requests_total", help, with("status", "done"));
    m_failed = &reg.counter("r2ccl_kv_requests_total", help, with("status", "failed"));
    m_cancelled = &reg.counter("r2ccl_kv_requests_total", help, with("status", "cancelled"));
    m_preserved =
        &reg.counter("r2ccl_kv_requests_preserved_total",
                     "KV requests that ended DONE although a rail failed under them.", who);
    m_duration = &reg.histogram("r2ccl_kv_request_duration_seconds",
                                "Time from a KV request's submission to its end.", who);
  }

  // How messages name a peer: "rank 3" in a world, "peer 'decode-1' (incarnation ...)" else.
  std::string label(int peer) const {
    return endpoint.peer_label(peer).value_or(fmt::format("peer {}", peer));
  }

  // A new request id, a connected peer, and pools that exist on both sides. Lock held.
  Status check_target(std::uint64_t id, int peer, std::uint32_t local_pool,
                      std::uint32_t remote_pool) const {
    if (requests.count(Key{-1, id}) != 0)
      return {ErrorCode::kInvalidArgument, fmt::format("request id {} is already in use", id)};
    return check_pools(peer, local_pool, remote_pool);
  }

  // A connected peer, and pools that exist on both sides and suit each other: checked when a
  // request begins and again whenever blocks are added to it (the peer's metadata may have been
  // replaced, or the peer disconnected, in between). Lock held.
  Status check_pools(int peer, std::uint32_t local_pool, std::uint32_t remote_pool) const {
    auto pit = peers.find(peer);
    if (pit == peers.end())
      return {ErrorCode::kInvalidArgument,
              fmt::format("unknown peer {}: accept_metadata() or load_remote() its metadata before "
                          "sending to it",
                          peer)};
    if (local_pool >= pools.size())
      return {ErrorCode::kInvalidArgument,
              fmt::format("no local KV pool {} (have {})", local_pool, pools.size())};
    if (pools[local_pool].regions.empty())
      return {ErrorCode::kInvalidArgument,
              fmt::format("local KV pool {} was unregistered", local_pool)};
    if (remote_pool >= pit->second.size())
      return {ErrorCode::kInvalidArgument,
              fmt::format("{} has no KV pool {} (it has {})", label(peer), remote_pool,
                          pit->second.size())};
    if (pit->second[remote_pool].buffers.empty())
      return {ErrorCode::kInvalidArgument,
              fmt::format("{}'s KV pool {} was unregistered", label(peer), remote_pool)};
    return check_pair(peer, local_pool, pit->second[remote_pool].layout, remote_pool);
  }

  // Blocks move between a local pool and a remote one only when their shapes agree (pools of
  // one side may differ from each other: hybrid models). Lock held.
  Status check_pair(int peer, std::uint32_t local_pool, const KvLayout& remote,
                    std::uint32_t remote_pool) const {
    const std::string diff = pools[local_pool].layout.incompatibility(remote);
    if (!diff.empty())
      return {ErrorCode::kInvalidArgument,
              fmt::format("KV pool {} here and {}'s pool {} are incompatible: {}", local_pool,
                          label(peer), remote_pool, diff)};
    return Status::ok();
  }

  Status check_span(const BlockSpan& s, const KvLayout& src, const KvLayout& dst,
                    const char* src_name, const char* dst_name) const {
    if (s.first_layer >= s.last_layer || s.last_layer > src.layers)
      return {ErrorCode::kInvalidArgument,
              fmt::format("layer range [{}, {}) is empty or past the {} layers", s.first_layer,
                          s.last_layer, src.layers)};
    if (s.src_blocks.size() != s.dst_blocks.size())
      return {ErrorCode::kInvalidArgument, fmt::format("{} source blocks but {} destination blocks",
                                                       s.src_blocks.size(), s.dst_blocks.size())};
    for (auto b : s.src_blocks)
      if (b >= src.blocks)
        return {ErrorCode::kInvalidArgument,
                fmt::format("source block {} is out of range: the {} pool has {} blocks", b,
                            src_name, src.blocks)};
    for (auto b : s.dst_blocks)
      if (b >= dst.blocks)
        return {ErrorCode::kInvalidArgument,
                fmt::format("destination block {} is out of range: the {} pool has {} "
                            "blocks",
                            b, dst_name, dst.blocks)};
    return Status::ok();
  }

  // Per destination block of a span, the XOR of its (layer, part) checksums, read from the source
  // pool. Device memory is copied out in runs of consecutive blocks (up to kMaxWriteBytes); a
  // block that cannot be read gets a checksum the receiver's will not match.
  static std::map<std::uint32_t, std::uint64_t> span_hashes(const Pool& src, const BlockSpan& s) {
    std::map<std::uint32_t, std::uint64_t> out;
    const auto& L = src.layout;
    Bytes staged;
    for (std::uint32_t layer = s.first_layer; layer < s.last_layer; ++layer)
      for (std::uint32_t part = 0; part < L.parts; ++part) {
        const RegionPtr& region = src.regions[L.place(layer, part).buffer];
        for (std::size_t i = 0; i < s.src_blocks.size();) {
          const std::uint64_t first = L.offset(layer, part, s.src_blocks[i]);
          std::size_t n = 1;  // blocks in this run
          while (region->device != nullptr && i + n < s.src_blocks.size() &&
                 (n + 1) * L.block_bytes <= kMaxWriteBytes &&
                 L.offset(layer, part, s.src_blocks[i + n]) == first + n * L.block_bytes)
            ++n;
          const std::byte* base = region->base + first;
          Status read = Status::ok();
          if (region->device != nullptr) {
            staged.resize(n * L.block_bytes);
            read = region->device->to_host(staged.data(), base, staged.size());
            if (!read) R2CCL_WARN("KV verification: {}", read.message());
            base = staged.data();
          }
          for (std::size_t k = 0; k < n; ++k)
            out[s.dst_blocks[i + k]] ^=
                read ? block_hash(base + k * L.block_bytes, L.block_bytes, layer, part)
                     : ~std::uint64_t{0};
          i += n;
        }
      }
    return out;
  }

  // Turns a span into coalesced writes, and adds its checksums when verifying: `hashes`, or
  // (null) read here. Lock held.
  void plan(Request& r, const BlockSpan& s, const Pool& src, const RemotePool& dst,
            const std::map<std::uint32_t, std::uint64_t>* hashes = nullptr) {
    if (options.verify) {
      const auto mine =
          hashes != nullptr ? std::map<std::uint32_t, std::uint64_t>{} : span_hashes(src, s);
      for (const auto& [block, h] : hashes != nullptr ? *hashes : mine)
        r.hashes[block] ^= h;
    }
    const auto& L = src.layout;
    for (std::uint32_t layer = s.first_layer; layer < s.last_layer; ++layer) {
      if (options.verify) r.layers.insert(layer);
      for (std::uint32_t part = 0; part < L.parts; ++part) {
        const auto& sp = L.place(layer, part);
        const auto& dp = dst.layout.place(layer, part);
        for (std::size_t i = 0; i < s.src_blocks.size(); ++i) {
          const std::uint64_t so = L.offset(layer, part, s.src_blocks[i]);
          const std::uint64_t dof = dst.layout.offset(layer, part, s.dst_blocks[i]);
          r.dst_blocks.insert(s.dst_blocks[i]);
          r.bytes += L.block_bytes;
          if (!r.pending.empty()) {
            auto& last = r.pending.back();
            if (last.src_buffer == sp.buffer && last.dst_buffer == dp.buffer &&
                last.src_offset + last.bytes == so && last.dst_offset + last.bytes == dof &&
                last.bytes + L.block_bytes <= kMaxWriteBytes) {
              last.bytes += L.block_bytes;
              last.dst_blocks.push_back(s.dst_blocks[i]);
              continue;
            }
          }
          r.pending.push_back(
              Write{sp.buffer, dp.buffer, so, dof, L.block_bytes, {s.dst_blocks[i]}});
        }
      }
    }
  }

  // Picks writes to issue for `peer`, round-robin over its requests, within the in-flight limit.
  std::vector<Issue> take_issues(int peer) {
    std::vector<Issue> out;
    auto& q = queues[peer];
    std::size_t idle_turns = 0;
    while (!q.active.empty() && q.inflight_bytes < options.max_inflight &&
           idle_turns < q.active.size()) {
      const Key key = q.active.front();
      q.active.pop_front();
      auto it = requests.find(key);
      if (it == requests.end() || it->second.ended()) continue;
      auto& r = it->second;
      q.active.push_back(key);
      if (r.pending.empty() || r.cancelled || r.failed) {
        ++idle_turns;
        continue;
      }
      idle_turns = 0;
      Write w = std::move(r.pending.front());
      r.pending.pop_front();
      ++r.inflight;
      q.inflight_bytes += w.bytes;
      out.push_back({key, peer, std::move(w)});
    }
    return out;
  }

  void issue(std::vector<Issue> issues) {
    for (auto& is : issues) {
      RegionPtr local;
      RemoteRegion remote;
      {
        // Under the lock: register_pool may grow `pools` meanwhile, and the engine may be
        // going away (its pools deregistered).
        std::lock_guard lock(mu);
        const auto& r = requests.at(is.key);
        auto pit = peers.find(r.peer);
        if (r.local_pool < pools.size() &&
            is.write.src_buffer < pools[r.local_pool].regions.size() && pit != peers.end() &&
            r.remote_pool < pit->second.size() &&
            is.write.dst_buffer < pit->second[r.remote_pool].buffers.size()) {
          local = pools[r.local_pool].regions[is.write.src_buffer];
          remote = pit->second[r.remote_pool].buffers[is.write.dst_buffer];
        }
      }
      if (!local) {
        written(is, Status(ErrorCode::kAborted, "the KV pool or the peer's metadata is gone"),
                false);
        continue;
      }
      auto op = endpoint.iwrite(is.peer, local, is.write.src_offset, remote, is.write.dst_offset,
                                is.write.bytes);
      if (!op) {
        written(is, op.status(), false);
        continue;
      }
      OpPtr held = *op;
      held->on_complete([weak = weak_from_this(), is, held](const Status& st) {
        if (auto self = weak.lock()) self->written(is, st, held->replayed());
      });
    }
  }

  // A write completed (progress thread, or the caller's on an immediate error).
  void written(const Issue& is, const Status& st, bool replayed) {
    std::vector<Outgoing> out;
    std::vector<Issue> next;
    {
      std::lock_guard lock(mu);
      queues[is.peer].inflight_bytes -= is.write.bytes;
      auto it = requests.find(is.key);
      if (it != requests.end()) {
        auto& r = it->second;
        --r.inflight;
        if (replayed) r.preserved = true;
        if (!st.is_ok()) {
          if (!r.failed) {
            r.failed = true;
            r.reason = st.message();
          }
          r.invalid.insert(is.write.dst_blocks.begin(), is.write.dst_blocks.end());
          for (const auto& w : r.pending)
            r.invalid.insert(w.dst_blocks.begin(), w.dst_blocks.end());
          r.pending.clear();
        }
        maybe_finish(is.key, r, out);
      }
      next = take_issues(is.peer);
    }
    send(out);
    issue(std::move(next));
  }

  // Ends a request whose writes are all accounted for. Lock held.
  void maybe_finish(const Key& key, Request& r, std::vector<Outgoing>& out) {
    if (r.ended() || r.inflight > 0 || !r.pending.empty()) return;
    if (!r.sealed && !r.cancelled && !r.failed) return;
    r.duration = Clock::now() - r.started;
    m_duration->histogram.observe(std::chrono::duration<double>(r.duration).count());
    if (r.cancelled) {
      m_cancelled->value.fetch_add(1, std::memory_order_relaxed);
      r.state = RequestState::kCancelled;
      if (r.reason.empty()) r.reason = "cancelled by the sender";
      r.invalid = r.dst_blocks;
      ++counters.cancelled;
    } else if (r.failed) {
      r.state = RequestState::kFailed;
      ++counters.failed;
      m_failed->value.fetch_add(1, std::memory_order_relaxed);
    } else {
      r.state = RequestState::kDone;
      ++counters.done;
      counters.bytes += r.bytes;
      m_done->value.fetch_add(1, std::memory_order_relaxed);
      m_bytes->value.fetch_add(r.bytes, std::memory_order_relaxed);
      if (r.preserved) {
        ++counters.preserved;
        m_preserved->value.fetch_add(1, std::memory_order_relaxed);
      }
    }
    r.invalid_list.assign(r.invalid.begin(), r.invalid.end());
    remember_ended(key);
    ByteWriter w;
    w.u8(static_cast<std::uint8_t>(MsgType::kNotify))
        .u64(r.id)
        .u8(static_cast<std::uint8_t>(r.state))
        .str(r.reason);
    w.blob(r.payload).u32(static_cast<std::uint32_t>(r.invalid_list.size()));
    for (auto b : r.invalid_list)
      w.u32(b);
    const bool verify = options.verify && r.state == RequestState::kDone;
    w.u8(verify ? 1 : 0);
    if (verify) {
      w.u32(r.remote_pool).u32(static_cast<std::uint32_t>(r.layers.size()));
      for (auto l : r.layers)
        w.u32(l);
      w.u32(static_cast<std::uint32_t>(r.hashes.size()));
      for (const auto& [b, h] : r.hashes)
        w.u32(b).u64(h);
    }
    // DONE travels on the rails, after the writes it reports; a failure notice takes the control
    // path, which works when no rail is left.
    out.push_back({r.peer, w.take(), r.state != RequestState::kDone});
    auto& q = queues[r.peer];
    std::erase_if(q.active, [&](const Key& k) { return !(k < key) && !(key < k); });
    cv.notify_all();
  }

  // Ended requests stay queryable for a while; the oldest are forgotten past kHistory. Lock
  // held.
  void remember_ended(const Key& key) {
    ended.push_back(key);
    while (ended.size() > kHistory) {
      auto old = requests.find(ended.front());
      if (old != requests.end() && old->second.ended() && old->second.inflight == 0)
        requests.erase(old);
      ended.pop_front();
    }
  }

  // Ends a pull record here, without the peer (its deadline passed, the peer left, this side
  // disconnected from it or cancelled it): every destination block is invalid, and this side
  // gets the notification the peer would have sent. Lock held.
  void end_pull(const Key& key, Request& q, RequestState state, std::string reason) {
    q.state = state;
    q.reason = std::move(reason);
    q.abandoned = true;
    q.invalid_list.assign(q.dst_blocks.begin(), q.dst_blocks.end());
    q.duration = Clock::now() - q.started;
    pull_deadlines.erase({q.deadline, q.id});
    if (state == RequestState::kCancelled)
      ++counters.cancelled;
    else
      ++counters.failed;
    remember_ended(key);
    cv.notify_all();
    Received rec;
    rec.local = true;
    rec.note.request = q.id;
    rec.note.peer = q.peer;
    rec.note.state = q.state;
    rec.note.reason = q.reason;
    rec.note.invalid_blocks = q.invalid_list;
    queue_for_worker(std::move(rec));
  }

  // Hands a notification to the worker (verification, then the callback or the queue). Lock
  // held.
  void queue_for_worker(Received rec) {
    // What it holds on to while it waits (an upper bound: verification only shortens it).
    rec.cost = 64 + rec.note.reason.size() + rec.note.payload.size() +
               4 * rec.note.invalid_blocks.size() + 4 * rec.layers.size() + 12 * rec.hashes.size();
    if (inbox.size() >= kMaxQueued || queued_bytes + rec.cost > options.max_queued_bytes) {
      ++counters.dropped_notifications;
      R2CCL_WARN_LIMITED(
          "kv: dropped the notification of request {} from {}: {} notifications ({} bytes) are "
          "waiting to be handled or polled already (at most {} bytes)",
          rec.note.request, label(rec.note.peer), inbox.size() + received.size(), queued_bytes,
          options.max_queued_bytes);
      return;
    }
    queued_bytes += rec.cost;
    inbox.push_back(std::move(rec));
    inbox_cv.notify_one();
  }

  // Pull records whose deadline passed fail. Lock held.
  void expire_pulls(Clock::time_point now) {
    while (!pull_deadlines.empty() && pull_deadlines.begin()->first <= now) {
      const std::uint64_t id = pull_deadlines.begin()->second;
      pull_deadlines.erase(pull_deadlines.begin());
      auto it = requests.find(Key{-1, id});
      if (it == requests.end() || !it->second.is_pull_record || it->second.ended()) continue;
      end_pull(it->first, it->second, RequestState::kFailed,
               fmt::format("pull {}: {} did not complete it within {}ms (R2CCL_TIMEOUT)", id,
                           label(it->second.peer), endpoint.config().timeout.count()));
    }
  }

  // The pulls asked of `peer` fail: it left, or this side disconnected from it.
  void fail_pulls_of(int peer, const std::string& why) {
    std::lock_guard lock(mu);
    for (auto& [key, q] : requests)
      if (key.requester < 0 && q.is_pull_record && q.peer == peer && !q.ended())
        end_pull(key, q, RequestState::kFailed, fmt::format("pull {}: {}", q.id, why));
  }

  void send(const std::vector<Outgoing>& out) {
    for (const auto& o : out) {
      // A world's control path works when no rail is left; an endpoint has only the rails.
      const bool control_path = o.control_path && world != nullptr;
      Status st = control_path
                      ? world->send_message(o.peer, Fabric::Service::kKvTransfer, o.message, true)
                      : endpoint.send_message(o.peer, kService, o.message);
      if (!st && !control_path && world)
        st = world->send_message(o.peer, Fabric::Service::kKvTransfer, o.message, true);
      if (!st) R2CCL_WARN("kv: cannot notify {}: {}", label(o.peer), st.message());
    }
  }

  void on_message(int peer, Bytes msg) {
    ByteReader r(msg);
    const auto type = static_cast<MsgType>(r.u8());
    if (type == MsgType::kNotify) return on_notify(peer, r);
    if (type == MsgType::kPull) return on_pull(peer, r);
    if (type == MsgType::kCancel) return on_cancel(peer, r);
    R2CCL_WARN_LIMITED("kv: unknown message type {} from {}", static_cast<int>(type), label(peer));
  }

  void on_notify(int peer, ByteReader& r) {
    Received rec;
    rec.note.peer = peer;
    rec.note.request = r.u64();
    // Only an end is ever notified: any other value is a protocol error, never cast blindly.
    const auto state = r.u8();
    if (r.ok() && (state < static_cast<std::uint8_t>(RequestState::kDone) ||
                   state > static_cast<std::uint8_t>(RequestState::kCancelled))) {
      R2CCL_WARN_LIMITED(
          "kv: dropped the notification of request {} from {}: its state {} is not DONE, "
          "FAILED or CANCELLED (a protocol error)",
          rec.note.request, label(peer), static_cast<int>(state));
      return;
    }
    rec.note.state = static_cast<RequestState>(state);
    rec.note.reason = r.str(4096);
    rec.note.payload = r.blob(kMaxPayloadBytes);
    const auto n = r.u32();
    for (std::uint32_t i = 0; i < n && r.ok(); ++i)
      rec.note.invalid_blocks.push_back(r.u32());
    if (r.u8() == 1) {
      rec.pool = r.u32();
      const auto nl = r.u32();
      for (std::uint32_t i = 0; i < nl && r.ok(); ++i)
        rec.layers.push_back(r.u32());
      const auto nh = r.u32();
      for (std::uint32_t i = 0; i < nh && r.ok(); ++i) {
        const auto b = r.u32();
        rec.hashes.emplace_back(b, r.u64());
      }
    }
    if (!r.finish("KV notification").is_ok()) {
      R2CCL_WARN_LIMITED("kv: malformed notification from {}", label(peer));
      return;
    }
    std::lock_guard lock(mu);
    queue_for_worker(std::move(rec));
  }

  // The worker: verification and callbacks off the progress loop and outside `mu`; pulls whose
  // deadline passed fail here.
  void work() {
    std::unique_lock lock(mu);
    while (true) {
      if (stopping) return;
      expire_pulls(Clock::now());
      if (!pull_jobs.empty()) {
        PullJob job = std::move(pull_jobs.front());
        pull_jobs.pop_front();
        plan_pull(std::move(job), lock);
        continue;
      }
      if (inbox.empty()) {
        if (pull_deadlines.empty()) {
          inbox_cv.wait(lock);
        } else {
          // A copy: the deadline's entry may be erased while this thread waits.
          const Clock::time_point until = pull_deadlines.begin()->first;
          inbox_cv.wait_until(lock, until);
        }
        continue;
      }
      Received rec = std::move(inbox.front());
      inbox.pop_front();
      // The pool's buffers stay registered while they are hashed (unregister_pool waits).
      const bool check = !rec.hashes.empty() && rec.note.state == RequestState::kDone;
      std::optional<Pool> pool;
      if (check && rec.pool < pools.size() && !pools[rec.pool].buffers.empty()) {
        pool = Pool{pools[rec.pool].buffers, pools[rec.pool].regions, pools[rec.pool].layout};
        ++verifying[rec.pool];
      }
      lock.unlock();
      if (check) verify(rec, pool ? &*pool : nullptr);
      lock.lock();
      if (pool && --verifying[rec.pool] == 0) {
        verifying.erase(rec.pool);
        cv.notify_all();
      }
      handle_verified(std::move(rec), lock);
    }
  }

  // A verified notification: the end of a pull this side asked for, then the callback or the
  // queue. Lock held (released around the callback).
  void handle_verified(Received rec, std::unique_lock<std::mutex>& lock) {
    auto it = rec.local ? requests.end() : requests.find(Key{-1, rec.note.request});
    if (it != requests.end() && it->second.is_pull_record && it->second.peer == rec.note.peer) {
      auto& q = it->second;
      if (q.abandoned) {
        // It ended here (and this side was notified then): a late word from the peer is ignored.
        R2CCL_DEBUG("kv: ignored the late {} of pull {} from {}: it ended here ({})",
                    request_state_name(rec.note.state), q.id, label(q.peer),
                    request_state_name(q.state));
        queued_bytes -= rec.cost;
        return;
      }
      if (!q.ended()) {
        q.state = rec.note.state;
        q.reason = rec.note.reason;
        q.invalid_list = rec.note.invalid_blocks;
        q.duration = Clock::now() - q.started;
        pull_deadlines.erase({q.deadline, q.id});
        if (q.state == RequestState::kDone) {
          ++counters.done;
          counters.bytes += q.bytes;
        } else if (q.state == RequestState::kCancelled) {
          ++counters.cancelled;
        } else {
          ++counters.failed;
        }
        remember_ended(it->first);
        cv.notify_all();
      }
    }
    if (callback) {
      queued_bytes -= rec.cost;
      auto fn = callback;
      lock.unlock();
      fn(rec.note);
      lock.lock();
      return;
    }
    if (received.size() >= kMaxQueued) {
      queued_bytes -= rec.cost;
      ++counters.dropped_notifications;
      R2CCL_WARN(
          "kv: dropped the notification of request {} from {}: {} notifications are not "
          "polled yet",
          rec.note.request, label(rec.note.peer), received.size());
      return;
    }
    received.push_back(std::move(rec));
    cv.notify_all();
  }

  // Checks a DONE notification's block checksums against our memory (`pool`, null when the
  // notification names a pool that does not exist). Without the lock.
  static void verify(Received& rec, const Pool* pool_ptr) {
    if (rec.hashes.empty() || rec.note.state != RequestState::kDone) return;
    if (pool_ptr == nullptr) {
      rec.note.state = RequestState::kFailed;
      rec.note.reason = fmt::format(
          "verification: the notification names pool {}, which does not exist", rec.pool);
      return;
    }
    const auto& pool = *pool_ptr;
    const auto& L = pool.layout;
    // Read layer by layer, as the sender did (runs of consecutive blocks at once).
    BlockSpan span;
    for (const auto& [block, want] : rec.hashes)
      if (block < L.blocks) {
        span.src_blocks.push_back(block);
        span.dst_blocks.push_back(block);
      }
    std::map<std::uint32_t, std::uint64_t> got;
    for (auto layer : rec.layers) {
      if (layer >= L.layers) continue;
      span.first_layer = layer;
      span.last_layer = layer + 1;
      for (const auto& [block, h] : span_hashes(pool, span))
        got[block] ^= h;
    }
    std::vector<std::uint32_t> bad;
    for (const auto& [block, want] : rec.hashes)
      if (block >= L.blocks || got[block] != want) bad.push_back(block);
    if (bad.empty()) {
      rec.note.verified = true;
      return;
    }
    rec.note.state = RequestState::kFailed;
    rec.note.reason =
        fmt::format("{} block(s) failed verification (first: block {})", bad.size(), bad.front());
    rec.note.invalid_blocks = bad;
  }

  // The requester of a pull abandoned it: nothing more is issued for it; it ends CANCELLED once
  // what was in flight lands (the requester ignores that notification).
  void on_cancel(int peer, ByteReader& r) {
    const auto id = r.u64();
    if (!r.finish("KV cancel").is_ok()) {
      R2CCL_WARN_LIMITED("kv: malformed cancel from {}", label(peer));
      return;
    }
    std::vector<Outgoing> out;
    {
      std::lock_guard lock(mu);
      auto it = requests.find(Key{peer, id});
      if (it == requests.end() || it->second.ended()) return;
      auto& q = it->second;
      q.cancelled = true;
      q.reason = "cancelled by the side that asked for the pull";
      q.pending.clear();
      maybe_finish(it->first, q, out);
    }
    send(out);
  }

  void on_pull(int peer, ByteReader& r) {
    const auto id = r.u64();
    const auto src_pool = r.u32();
    const auto dst_pool = r.u32();
    std::vector<BlockSpan> spans;
    const bool ok = decode_spans(r, &spans) && r.finish("KV pull").is_ok();
    std::vector<Outgoing> out;
    std::vector<Issue> next;
    {
      std::lock_guard lock(mu);
      const Key key{peer, id};
      if (requests.count(key) != 0) return;  // a duplicate
      Request q;
      q.id = id;
      q.peer = peer;
      q.local_pool = src_pool;
      q.remote_pool = dst_pool;
      q.sealed = true;
      Status st = ok ? Status::ok() : Status(ErrorCode::kProtocol, "malformed pull request");
      auto pit = peers.find(peer);
      if (st.is_ok() && pit == peers.end())
        st = Status(ErrorCode::kInvalidArgument,
                    fmt::format("{} is not connected here: call accept_metadata() or load_remote() "
                                "with its metadata first",
                                label(peer)));
      if (st.is_ok() && (src_pool >= pools.size() || dst_pool >= pit->second.size()))
        st = Status(ErrorCode::kInvalidArgument,
                    fmt::format("pull names pool {} here / {} there, which do not exist", src_pool,
                                dst_pool));
      if (st.is_ok() && (pools[src_pool].regions.empty() || pit->second[dst_pool].buffers.empty()))
        st = Status(ErrorCode::kInvalidArgument,
                    fmt::format("pull names pool {} here / {} there, one of which was unregistered",
                                src_pool, dst_pool));
      if (st.is_ok()) st = check_pair(peer, src_pool, pit->second[dst_pool].layout, dst_pool);
      for (const auto& s : spans) {
        if (!st.is_ok()) break;
        st = check_span(s, pools[src_pool].layout, pit->second[dst_pool].layout, "source",
                        "destination");
      }
      if (st.is_ok() && options.verify && pull_jobs.size() >= kMaxQueued)
        st = Status(
            ErrorCode::kNoResource,
            fmt::format("{} pulls are waiting for their checksums here already", pull_jobs.size()));
      // Verifying: the worker reads the checksums, then plans it (unsealed until then, so that
      // nothing ends it as done before).
      const bool defer = st.is_ok() && options.verify;
      if (st.is_ok() && !defer) {
        for (const auto& s : spans)
          plan(q, s, pools[src_pool], pit->second[dst_pool]);
        q.state = RequestState::kInFlight;
      } else if (defer) {
        q.sealed = false;
      } else {
        q.failed = true;
        q.reason = st.message();
        for (const auto& s : spans)
          q.invalid.insert(s.dst_blocks.begin(), s.dst_blocks.end());
      }
      auto& stored = requests.emplace(key, std::move(q)).first->second;
      if (st.is_ok() && !defer) queues[peer].active.push_back(key);
      if (defer) {
        pull_jobs.push_back(PullJob{key, std::move(spans)});
        inbox_cv.notify_one();
      }
      maybe_finish(key, stored, out);
      next = take_issues(peer);
    }
    send(out);
    issue(std::move(next));
  }

  // A verified pull's plan, on the worker (lock held, released while the blocks are read and
  // while the writes are handed over): the checksums of its spans, then the pools checked again
  // (they may have changed meanwhile) and the writes queued, as on_pull does without checksums.
  void plan_pull(PullJob job, std::unique_lock<std::mutex>& lock) {
    auto it = requests.find(job.key);
    if (it == requests.end() || it->second.ended() || it->second.cancelled || it->second.failed)
      return;
    const std::uint32_t src_pool = it->second.local_pool;
    std::optional<Pool> src;
    if (src_pool < pools.size() && !pools[src_pool].regions.empty()) {
      src = pools[src_pool];
      ++verifying[src_pool];  // unregister_pool waits while the blocks are read
    }
    std::vector<std::map<std::uint32_t, std::uint64_t>> hashes;
    if (src) {
      lock.unlock();
      for (const auto& s : job.spans)
        hashes.push_back(span_hashes(*src, s));
      lock.lock();
      if (--verifying[src_pool] == 0) {
        verifying.erase(src_pool);
        cv.notify_all();
      }
    }
    it = requests.find(job.key);
    if (it == requests.end() || it->second.ended()) return;
    auto& q = it->second;
    const int peer = q.peer;
    // The pools again, as add() checks them: they may have gone or changed meanwhile.
    Status st = check_pools(peer, src_pool, q.remote_pool);
    const auto pit = peers.find(peer);
    for (const auto& s : job.spans) {
      if (!st.is_ok()) break;
      st = check_span(s, pools[src_pool].layout, pit->second[q.remote_pool].layout, "source",
                      "destination");
    }
    std::vector<Outgoing> out;
    if (q.cancelled || q.failed) {
      // Ended meanwhile: nothing to issue.
    } else if (st.is_ok()) {
      for (std::size_t i = 0; i < job.spans.size(); ++i)
        plan(q, job.spans[i], pools[src_pool], pit->second[q.remote_pool], &hashes[i]);
      q.state = RequestState::kInFlight;
      queues[peer].active.push_back(job.key);
    } else {
      q.failed = true;
      q.reason = st.message();
      for (const auto& s : job.spans)
        q.invalid.insert(s.dst_blocks.begin(), s.dst_blocks.end());
    }
    q.sealed = true;
    maybe_finish(job.key, q, out);
    auto next = take_issues(peer);
    lock.unlock();
    send(out);
    issue(std::move(next));
    lock.lock();
  }
};

KvEngine::KvEngine(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEngine::~KvEngine() {
  impl_->endpoint.remove_peer_listener(impl_->peer_listener);
  impl_->endpoint.set_message_handler(kService, nullptr);
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->inbox_cv.notify_all();
  if (impl_->worker.joinable()) impl_->worker.join();
  // Let writes in flight complete (or fail at their deadline) before the pools go away.
  std::unique_lock lock(impl_->mu);
  impl_->cv.wait_for(lock, impl_->endpoint.config().timeout + std::chrono::seconds(1), [&] {
    return std::all_of(impl_->requests.begin(), impl_->requests.end(),
                       [](const auto& kv) { return kv.second.inflight == 0; });
  });
  // Peers keep the metadata: from now on their writes into these pools are refused. A write
  // still under way past the wait ends with its deregistration, and no rail reads its pool after.
  auto pools = std::move(impl_->pools);
  lock.unlock();
  for (auto& p : pools)
    for (auto& r : p.regions)
      if (r) (void)impl_->endpoint.deregister_memory(r);
}

Status KvEngine::unregister_pool(std::uint32_t pool) {
  std::vector<RegionPtr> regions;
  {
    std::unique_lock lock(impl_->mu);
    if (pool >= impl_->pools.size() || impl_->pools[pool].regions.empty())
      return {ErrorCode::kInvalidArgument,
              fmt::format("unregister_pool: no KV pool {} is registered", pool)};
    for (const auto& [key, r] : impl_->requests)
      if (!r.ended() && r.local_pool == pool)
        return {ErrorCode::kUnavailable,
                fmt::format("unregister_pool: request {} still uses KV pool {}", key.id, pool)};
    // A notification being verified against it finishes first (the owner may free the memory
    // once this returns).
    impl_->cv.wait(lock, [&] { return impl_->verifying.count(pool) == 0; });
    regions = std::move(impl_->pools[pool].regions);
    impl_->pools[pool].regions.clear();
    impl_->pools[pool].buffers.clear();
  }
  for (auto& r : regions)
    R2CCL_RETURN_IF_ERROR(impl_->endpoint.deregister_memory(r).with_context("unregister_pool"));
  return Status::ok();
}

Result<std::unique_ptr<KvEngine>> KvEngine::create(Endpoint& endpoint, const EngineOptions& options,
                                                   Fabric* world) {
  auto impl = std::make_shared<Impl>(endpoint, world, options);
  Impl* raw = impl.get();
  impl->worker = std::thread([raw] {
    try {
      raw->work();
    } catch (const std::exception& e) {  // no exception ends the process from this thread
      R2CCL_ERROR("kv: the notification worker stopped: {}", e.what());
    }
  });
  endpoint.set_message_handler(
      kService, [raw](int peer, Bytes msg) { raw->on_message(peer, std::move(msg)); });
  // Pulls of a peer that leaves fail at once (not at their deadline).
  impl->peer_listener =
      endpoint.add_peer_listener([weak = std::weak_ptr<Impl>(impl)](const Endpoint::PeerEvent& ev) {
        if (ev.kind != Endpoint::PeerEvent::Kind::kLeft) return;
        if (auto self = weak.lock())
          self->fail_pulls_of(ev.peer, fmt::format("{} left: {}", ev.label, ev.why));
      });
  return std::unique_ptr<KvEngine>(new KvEngine(std::move(impl)));
}

Result<std::unique_ptr<KvEngine>> KvEngine::create(Fabric& fabric, const EngineOptions& options) {
  return create(fabric.endpoint(), options, &fabric);
}

Result<std::uint32_t> KvEngine::register_pool(const std::vector<std::span<std::byte>>& buffers,
                                              const KvLayout& layout, const DeviceMemory* memory) {
  std::vector<std::uint64_t> lengths;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    if (b.data() == nullptr)
      return Status(ErrorCode::kInvalidArgument, "register_pool: a buffer is null");
    lengths.push_back(b.size());
  }
  R2CCL_RETURN_IF_ERROR(layout.validate(lengths).with_context("register_pool"));
  Impl::Pool pool;
  pool.buffers = buffers;
  pool.layout = layout;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    auto region = impl_->endpoint.register_memory(buffers[i].data(), buffers[i].size(),
                                                  MemoryAccess::kRemoteWrite, memory);
    if (!region) {
      // No buffer stays registered, and so writable by peers, without a pool to deregister it.
      for (const auto& r : pool.regions)
        (void)impl_->endpoint.deregister_memory(r);
      return region.status().with_context(
          fmt::format("register_pool: buffer {} of {}", i + 1, buffers.size()));
    }
    pool.regions.push_back(std::move(*region));
  }
  std::lock_guard lock(impl_->mu);
  impl_->pools.push_back(std::move(pool));
  return static_cast<std::uint32_t>(impl_->pools.size() - 1);
}

Bytes KvEngine::metadata() const {
  ByteWriter body;
  {
    std::lock_guard lock(impl_->mu);
    body.u64(impl_->endpoint.incarnation())
        .blob(impl_->endpoint.blob())
        .u32(static_cast<std::uint32_t>(impl_->pools.size()));
    for (const auto& p : impl_->pools) {
      p.layout.encode(body);
      body.u32(static_cast<std::uint32_t>(p.regions.size()));
      for (const auto& r : p.regions)
        RemoteRegion{r->id, r->length, r->keys}.encode(body);
    }
  }
  ByteWriter w;
  w.u32(kMetaMagic)
      .u32(kMetaVersion)
      .blob(body.bytes())
      .u64(XXH3_64bits(body.bytes().data(), body.bytes().size()));
  return w.take();
}

namespace {
// The checked body of KV metadata: magic, version, length and checksum verified.
Result<Bytes> metadata_body(std::span<const std::byte> metadata) {
  ByteReader r(metadata);
  const auto magic = r.u32();
  if (!r.ok()) return Status{ErrorCode::kProtocol, "KV metadata is truncated (no header)"};
  if (magic != kMetaMagic) return Status{ErrorCode::kProtocol, "not r2ccl KV metadata (bad magic)"};
  const auto version = r.u32();
  if (version != kMetaVersion)
    return Status{
        ErrorCode::kProtocol,
        fmt::format("KV metadata version {} is not supported (this build reads version {})",
                    version, kMetaVersion)};
  Bytes body = r.blob(64u << 20);
  const auto sum = r.u64();
  if (!r.ok()) return Status{ErrorCode::kProtocol, "KV metadata is truncated"};
  if (!r.at_end()) return Status{ErrorCode::kProtocol, "KV metadata has trailing bytes"};
  if (sum != XXH3_64bits(body.data(), body.size()))
    return Status{ErrorCode::kProtocol, "KV metadata is corrupted (checksum mismatch)"};
  return body;
}
}  // namespace

Result<int> KvEngine::load_remote(std::span<const std::byte> metadata) {
  R2CCL_ASSIGN_OR_RETURN(const Bytes body, metadata_body(metadata));
  ByteReader b(body);
  (void)b.u64();
  const Bytes blob = b.blob(EndpointInfo::kMaxBlob);
  if (!b.ok()) return Status(ErrorCode::kProtocol, "KV metadata is truncated (no endpoint)");
  R2CCL_ASSIGN_OR_RETURN(const int peer, impl_->endpoint.connect(blob));
  R2CCL_RETURN_IF_ERROR(accept_metadata(peer, metadata));
  return peer;
}

Status KvEngine::disconnect(int peer) {
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->peers.erase(peer) == 0)
      return {ErrorCode::kInvalidArgument,
              fmt::format("disconnect: {} is not connected here", impl_->label(peer))};
  }
  impl_->fail_pulls_of(peer, fmt::format("this side disconnected from {}", impl_->label(peer)));
  if (impl_->world) return Status::ok();  // a world's channels stay
  return impl_->endpoint.disconnect(peer);
}

Status KvEngine::accept_metadata(int peer, std::span<const std::byte> metadata) {
  if (impl_->world && (peer < 0 || peer >= impl_->world->nranks() || peer == impl_->world->rank()))
    return {ErrorCode::kInvalidArgument,
            fmt::format("accept_metadata: rank {} is not a peer (world of {} ranks)", peer,
                        impl_->world->nranks())};
  const auto known = impl_->endpoint.peers();
  const auto it = std::find_if(known.begin(), known.end(),
                               [&](const auto& p) { return p.id == peer && p.alive; });
  if (it == known.end())
    return {ErrorCode::kInvalidArgument, fmt::format("connect: no connected peer has id {}", peer)};
  R2CCL_ASSIGN_OR_RETURN(const Bytes body, metadata_body(metadata));
  ByteReader b(body);
  const auto incarnation = b.u64();
  (void)b.blob(EndpointInfo::kMaxBlob);  // its endpoint, for load_remote
  if (b.ok() && incarnation != it->incarnation) {
    std::string whose = fmt::format("incarnation {:016x}", incarnation);
    if (incarnation == impl_->endpoint.incarnation())
      whose = impl_->world ? fmt::format("rank {}", impl_->world->rank())
                           : fmt::format("'{}' (this endpoint)", impl_->endpoint.name());
    for (const auto& p : known)
      if (p.incarnation == incarnation) whose = p.label;
    return {ErrorCode::kInvalidArgument,
            fmt::format("this KV metadata is {}'s, not {}'s", whose, it->label)};
  }
  constexpr std::uint32_t kMaxPools = 1024, kMaxBuffers = 4096;
  const auto npools = b.u32();
  if (b.ok() && npools > kMaxPools)
    return {ErrorCode::kProtocol,
            fmt::format("KV metadata names {} pools (at most {})", npools, kMaxPools)};
  std::vector<Impl::RemotePool> remote;
  for (std::uint32_t i = 0; i < npools && b.ok(); ++i) {
    Impl::RemotePool rp;
    R2CCL_ASSIGN_OR_RETURN(rp.layout, KvLayout::decode(b));
    const auto nb = b.u32();
    if (b.ok() && nb > kMaxBuffers)
      return {
          ErrorCode::kProtocol,
          fmt::format("KV metadata: pool {} names {} buffers (at most {})", i, nb, kMaxBuffers)};
    for (std::uint32_t j = 0; j < nb && b.ok(); ++j)
      rp.buffers.push_back(RemoteRegion::decode(b));
    remote.push_back(std::move(rp));
  }
  R2CCL_RETURN_IF_ERROR(b.finish("KV metadata"));
  const std::size_t rails = impl_->endpoint.rails_to(peer);
  std::lock_guard lock(impl_->mu);
  // Every remote pool is checked here (whatever pools this side has): its layout must fit its
  // buffers, and every buffer must have a key for every rail. Whether a remote pool suits a local
  // one is checked per request, for the pair it names.
  for (std::size_t i = 0; i < remote.size(); ++i) {
    for (std::size_t j = 0; j < remote[i].buffers.size(); ++j)
      if (remote[i].buffers[j].keys.size() != rails)
        return {ErrorCode::kInvalidArgument,
                fmt::format("{}'s pool {} buffer {} has keys for {} rails; the channel has {}",
                            it->label, i, j, remote[i].buffers[j].keys.size(), rails)};
    if (remote[i].buffers.empty()) continue;  // a pool the peer unregistered
    std::vector<std::uint64_t> lengths;
    for (const auto& rr : remote[i].buffers)
      lengths.push_back(rr.length);
    R2CCL_RETURN_IF_ERROR(
        remote[i].layout.validate(lengths).with_context(fmt::format("{}'s pool {}", it->label, i)));
  }
  impl_->peers[peer] = std::move(remote);
  return Status::ok();
}

Status KvEngine::begin(std::uint64_t id, int peer, std::uint32_t local_pool,
                       std::uint32_t remote_pool) {
  std::lock_guard lock(impl_->mu);
  R2CCL_RETURN_IF_ERROR(impl_->check_target(id, peer, local_pool, remote_pool));
  Impl::Request r;
  r.id = id;
  r.peer = peer;
  r.local_pool = local_pool;
  r.remote_pool = remote_pool;
  impl_->requests.emplace(Impl::Key{-1, id}, std::move(r));
  impl_->queues[peer].active.push_back(Impl::Key{-1, id});
  return Status::ok();
}

Status KvEngine::add(std::uint64_t id, const BlockSpan& span) {
  std::vector<Impl::Issue> next;
  int peer = -1;
  // The checksums first, outside the lock: reading the blocks (out of a GPU, perhaps) must not
  // hold up the completions of the writes in flight. The pool cannot go meanwhile (a request
  // that began on it holds it).
  std::optional<std::map<std::uint32_t, std::uint64_t>> hashes;
  if (impl_->options.verify) {
    Impl::Pool src;
    {
      std::lock_guard lock(impl_->mu);
      auto it = impl_->requests.find(Impl::Key{-1, id});
      if (it != impl_->requests.end() && !it->second.is_pull_record &&
          it->second.local_pool < impl_->pools.size())
        src = impl_->pools[it->second.local_pool];
    }
    // Checked again under the lock below, before the checksums are used.
    const bool readable = !src.regions.empty() && span.first_layer < span.last_layer &&
                          span.last_layer <= src.layout.layers &&
                          span.src_blocks.size() == span.dst_blocks.size() &&
                          std::all_of(span.src_blocks.begin(), span.src_blocks.end(),
                                      [&](std::uint32_t b) { return b < src.layout.blocks; });
    if (readable) hashes = Impl::span_hashes(src, span);
  }
  {
    std::lock_guard lock(impl_->mu);
    auto it = impl_->requests.find(Impl::Key{-1, id});
    if (it == impl_->requests.end() || it->second.is_pull_record)
      return {ErrorCode::kNotFound, fmt::format("no push request {} (begin() it first)", id)};
    auto& r = it->second;
    if (r.sealed || r.ended())
      return {ErrorCode::kInvalidArgument,
              fmt::format("request {} is already sealed ({})", id, request_state_name(r.state))};
    // The pools again: an accept_metadata() since begin() may have replaced the peer's (fewer, or
    // of other shapes), and a disconnect() forgot them.
    R2CCL_RETURN_IF_ERROR(impl_->check_pools(r.peer, r.local_pool, r.remote_pool)
                              .with_context(fmt::format("request {}", id)));
    const auto& src = impl_->pools[r.local_pool];
    const auto& dst = impl_->peers.find(r.peer)->second[r.remote_pool];
    R2CCL_RETURN_IF_ERROR(impl_->check_span(span, src.layout, dst.layout, "local", "remote")
                              .with_context(fmt::format("request {}", id)));
    impl_->plan(r, span, src, dst, hashes ? &*hashes : nullptr);
    r.state = RequestState::kInFlight;
    peer = r.peer;
    next = impl_->take_issues(peer);
  }
  impl_->issue(std::move(next));
  return Status::ok();
}

Status KvEngine::seal(std::uint64_t id, Bytes payload) {
  if (payload.size() > kMaxPayloadBytes)
    return {ErrorCode::kInvalidArgument,
            fmt::format("payload of {} bytes exceeds {}", payload.size(), kMaxPayloadBytes)};
  std::vector<Impl::Outgoing> out;
  {
    std::lock_guard lock(impl_->mu);
    auto it = impl_->requests.find(Impl::Key{-1, id});
    if (it == impl_->requests.end() || it->second.is_pull_record)
      return {ErrorCode::kNotFound, fmt::format("no push request {}", id)};
    auto& r = it->second;
    if (r.sealed || r.ended())
      return {ErrorCode::kInvalidArgument, fmt::format("request {} is already sealed", id)};
    r.sealed = true;
    r.payload = std::move(payload);
    if (r.state == RequestState::kPending) r.state = RequestState::kInFlight;
    impl_->maybe_finish(it->first, r, out);
  }
  impl_->send(out);
  return Status::ok();
}

Status KvEngine::submit(std::uint64_t id, int peer, std::uint32_t local_pool,
                        std::uint32_t remote_pool, const std::vector<BlockSpan>& spans,
                        Bytes payload) {
  {
    // Check every span before anything is sent.
    std::lock_guard lock(impl_->mu);
    auto pit = impl_->peers.find(peer);
    if (pit != impl_->peers.end() && local_pool < impl_->pools.size() &&
        remote_pool < pit->second.size())
      for (const auto& s : spans)
        R2CCL_RETURN_IF_ERROR(impl_
                                  ->check_span(s, impl_->pools[local_pool].layout,
                                               pit->second[remote_pool].layout, "local", "remote")
                                  .with_context(fmt::format("request {}", id)));
  }
  R2CCL_RETURN_IF_ERROR(begin(id, peer, local_pool, remote_pool));
  for (const auto& s : spans)
    R2CCL_RETURN_IF_ERROR(add(id, s));
  return seal(id, std::move(payload));
}

Status KvEngine::pull(std::uint64_t id, int peer, std::uint32_t local_pool,
                      std::uint32_t remote_pool, const std::vector<BlockSpan>& spans) {
  ByteWriter w;
  Clock::time_point deadline;
  {
    std::lock_guard lock(impl_->mu);
    R2CCL_RETURN_IF_ERROR(impl_->check_target(id, peer, local_pool, remote_pool));
    auto pit = impl_->peers.find(peer);
    Impl::Request r;
    r.id = id;
    r.peer = peer;
    r.local_pool = local_pool;
    r.remote_pool = remote_pool;
    r.is_pull_record = true;
    r.sealed = true;
    r.state = RequestState::kInFlight;
    for (const auto& s : spans) {
      R2CCL_RETURN_IF_ERROR(impl_
                                ->check_span(s, pit->second[remote_pool].layout,
                                             impl_->pools[local_pool].layout, "remote", "local")
                                .with_context(fmt::format("pull {}", id)));
      r.bytes += static_cast<std::uint64_t>(s.last_layer - s.first_layer) * s.src_blocks.size() *
                 impl_->pools[local_pool].layout.block_bytes *
                 impl_->pools[local_pool].layout.parts;
      r.dst_blocks.insert(s.dst_blocks.begin(), s.dst_blocks.end());
    }
    w.u8(static_cast<std::uint8_t>(MsgType::kPull)).u64(id).u32(remote_pool).u32(local_pool);
    encode_spans(w, spans);
    if (w.bytes().size() > 64 * 1024)
      return {ErrorCode::kInvalidArgument,
              fmt::format("pull {}: its block lists take {} bytes, more than 65536 in one request "
                          "(split it)",
                          id, w.bytes().size())};
    // Recorded before it is sent (the peer's answer may come at once), forgotten if it cannot be.
    r.deadline = Clock::now() + impl_->endpoint.config().timeout;
    deadline = r.deadline;
    impl_->pull_deadlines.emplace(r.deadline, id);
    impl_->requests.emplace(Impl::Key{-1, id}, std::move(r));
    impl_->inbox_cv.notify_one();  // the worker watches the deadline
  }
  Status st = impl_->endpoint.send_message(peer, kService, w.take());
  if (!st) {
    std::lock_guard lock(impl_->mu);
    auto it = impl_->requests.find(Impl::Key{-1, id});
    if (it != impl_->requests.end() && it->second.is_pull_record && !it->second.ended()) {
      impl_->pull_deadlines.erase({deadline, id});
      impl_->requests.erase(it);
    }
  }
  return st.with_context(fmt::format("pull {}", id));
}

Result<RequestStatus> KvEngine::status(std::uint64_t id) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->requests.find(Impl::Key{-1, id});
  if (it == impl_->requests.end())
    return Status(ErrorCode::kNotFound, fmt::format("no request {}", id));
  const auto& r = it->second;
  RequestStatus s;
  s.state = r.state;
  s.reason = r.reason;
  s.preserved = r.preserved;
  s.invalid_blocks = r.invalid_list;
  s.bytes = r.bytes;
  s.duration = r.ended() ? r.duration : std::chrono::nanoseconds(Clock::now() - r.started);
  return s;
}

Result<RequestStatus> KvEngine::wait(std::uint64_t id, std::chrono::milliseconds timeout) {
  {
    std::unique_lock lock(impl_->mu);
    const Impl::Key key{-1, id};
    if (impl_->requests.count(key) == 0)
      return Status(ErrorCode::kNotFound, fmt::format("no request {}", id));
    // Looked up afresh each time: ended requests are eventually forgotten.
    auto ended = [&] {
      auto it = impl_->requests.find(key);
      return it == impl_->requests.end() || it->second.ended();
    };
    if (!impl_->cv.wait_for(lock, timeout, ended))
      return Status(ErrorCode::kTimeout,
                    fmt::format("request {} did not end within {}ms", id, timeout.count()));
  }
  return status(id);
}

Status KvEngine::cancel(std::uint64_t id) {
  std::vector<Impl::Outgoing> out;
  int peer = -1;  // a pull's: told to stop
  {
    std::lock_guard lock(impl_->mu);
    auto it = impl_->requests.find(Impl::Key{-1, id});
    if (it == impl_->requests.end())
      return {ErrorCode::kNotFound, fmt::format("no request {}", id)};
    auto& r = it->second;
    if (r.ended())
      return {ErrorCode::kInvalidArgument,
              fmt::format("request {} already ended ({}); nothing to cancel", id,
                          request_state_name(r.state))};
    if (r.is_pull_record) {
      // Abandoned here at once; the peer is asked to stop (best effort).
      peer = r.peer;
      impl_->end_pull(it->first, r, RequestState::kCancelled,
                      fmt::format("pull {}: cancelled by this side (writes of {} already in flight "
                                  "may still land in its blocks)",
                                  id, impl_->label(r.peer)));
    } else {
      r.cancelled = true;
      r.pending.clear();
      impl_->maybe_finish(it->first, r, out);
    }
  }
  impl_->send(out);
  if (peer >= 0) {
    ByteWriter w;
    w.u8(static_cast<std::uint8_t>(MsgType::kCancel)).u64(id);
    if (Status st = impl_->endpoint.send_message(peer, kService, w.take()); !st)
      R2CCL_DEBUG("kv: cannot tell {} that pull {} was cancelled: {}", impl_->label(peer), id,
                  st.message());
  }
  return Status::ok();
}

std::vector<Notification> KvEngine::poll_notifications() {
  std::vector<Notification> out;
  std::lock_guard lock(impl_->mu);
  for (auto& rec : impl_->received) {
    impl_->queued_bytes -= rec.cost;
    out.push_back(std::move(rec.note));
  }
  impl_->received.clear();
  return out;
}

Result<Notification> KvEngine::wait_notification(int peer, std::uint64_t id,
                                                 std::chrono::milliseconds timeout) {
  std::unique_lock lock(impl_->mu);
  auto match = [&] {
    return std::find_if(
        impl_->received.begin(), impl_->received.end(),
        [&](const Impl::Received& r) { return r.note.peer == peer && r.note.request == id; });
  };
  if (!impl_->cv.wait_for(lock, timeout, [&] { return match() != impl_->received.end(); }))
    return Status(ErrorCode::kTimeout,
                  fmt::format("no notification for request {} from {} within {}ms", id,
                              impl_->label(peer), timeout.count()));
  auto it = match();
  Impl::Received rec = std::move(*it);
  impl_->received.erase(it);
  impl_->queued_bytes -= rec.cost;
  return rec.note;
}

void KvEngine::set_notification_callback(std::function<void(const Notification&)> fn) {
  std::deque<Impl::Received> queued;
  {
    std::lock_guard lock(impl_->mu);
    impl_->callback = fn;
    if (!fn) return;
    queued = std::move(impl_->received);
    impl_->received.clear();
    for (const auto& rec : queued)
      impl_->queued_bytes -= rec.cost;
  }
  for (const auto& rec : queued)  // already verified; outside the engine's lock
    fn(rec.note);
}

EngineCounters KvEngine::counters() const {
  std::lock_guard lock(impl_->mu);
  return impl_->counters;
}

}  // namespace r2ccl::kv

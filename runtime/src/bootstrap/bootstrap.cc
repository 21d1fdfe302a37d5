#include "r2ccl/runtime/bootstrap.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "bootstrap/frames.h"
#include "bootstrap/inbox.h"
#include "common/pending_hellos.h"
#include "core/crypto.h"
#include "progress/asio.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/topology.h"

namespace r2ccl {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using namespace bootstrap_wire;  // NOLINT: the bootstrap speaks its own wire format

namespace {

std::span<const std::uint8_t> u8span(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}
std::span<const std::uint8_t> u8span(std::span<const std::byte> b) {
  return {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()};
}

// The peer's IP address, without the port ("?" when unknown).
std::string source_address(const tcp::socket& s) {
  boost::system::error_code ec;
  auto ep = s.remote_endpoint(ec);
  return ec ? std::string("?") : ep.address().to_string();
}

std::string endpoint_text(const tcp::socket& s) {
  boost::system::error_code ec;
  auto ep = s.remote_endpoint(ec);
  return ec ? std::string("?") : fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Root: runs in rank 0's process on its own thread.

class BootstrapRoot {
 public:
  static Result<std::shared_ptr<BootstrapRoot>> start(const HostPort& at, const Token& token,
                                                      int nranks, milliseconds timeout) {
    auto root = std::shared_ptr<BootstrapRoot>(new BootstrapRoot(token, nranks, timeout));
    boost::system::error_code ec;
    auto addr = asio::ip::make_address(at.host, ec);
    if (ec)
      return Status(
          ErrorCode::kBootstrap,
          fmt::format("rank 0 cannot listen on {}: '{}' is not an IP address of this host",
                      at.to_string(), at.host));
    tcp::endpoint ep(addr, at.port);
    root->acceptor_.open(ep.protocol(), ec);
    if (!ec) root->acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) root->acceptor_.bind(ep, ec);
    if (!ec) root->acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec)
      return Status(ErrorCode::kBootstrap,
                    fmt::format("rank 0 cannot listen on {}: {}", at.to_string(), ec.message()));
    root->bound_ = HostPort{at.host, root->acceptor_.local_endpoint().port()};
    root->run();
    return root;
  }

  ~BootstrapRoot() {
    asio::post(io_, [this] {
      boost::system::error_code ec;
      acceptor_.close(ec);
      deadline_.cancel();
      for (auto& s : sessions_) {
        s->hello_timer.cancel();
        s->socket.close(ec);
      }
      sessions_.clear();
    });
    work_.reset();
    if (thread_.joinable()) thread_.join();
  }

  const HostPort& address() const { return bound_; }

 private:
  // Before its hello is accepted, a connection may send at most this much and must say hello
  // within kHelloDeadline. At most kMaxUnauthenticated such connections are kept, of them at most
  // kMaxUnauthenticatedPerSource from one source address (the next one from there is refused at
  // once, so one host cannot keep the ranks out); past kMaxUnauthenticated the oldest is shed.
  static constexpr std::size_t kMaxHelloFrame = 4096;
  static constexpr milliseconds kHelloDeadline{10000};
  static constexpr std::size_t kMaxUnauthenticated = 64;
  static constexpr std::size_t kMaxUnauthenticatedPerSource = 16;

  struct Session {
    explicit Session(asio::io_context& io) : socket(io), hello_timer(io) {}
    tcp::socket socket;
    asio::steady_timer hello_timer;
    crypto::Nonce challenge{};
    crypto::Nonce client{};
    std::string peer;
    int rank = -1;
    std::array<std::byte, kHeaderSize> header{};
    Bytes payload;
    std::deque<Bytes> out;
    bool closing = false;  // close once `out` drains
  };
  using SessionPtr = std::shared_ptr<Session>;

  BootstrapRoot(const Token& token, int nranks, milliseconds timeout)
      : acceptor_(io_),
        deadline_(io_),
        work_(asio::make_work_guard(io_)),
        token_(token),
        nranks_(nranks),
        timeout_(timeout) {}

  void run() {
    if (nranks_ > 0) by_rank_.assign(static_cast<std::size_t>(nranks_), nullptr);
    deadline_.expires_after(timeout_);
    // `this` outlives every handler: the destructor cancels them and joins the thread (a shared
    // pointer here could make the handler the last owner and the thread join itself).
    deadline_.async_wait([this](boost::system::error_code ec) {
      if (!ec) on_deadline();
    });
    accept();
    // Nothing thrown in a handler may end the process: the rendezvous fails instead.
    thread_ = std::thread([this] {
      while (true) {
        try {
          io_.run();
          return;
        } catch (const std::exception& e) {
          R2CCL_ERROR("bootstrap root: {}", e.what());
          if (!failed_) {
            failed_ = true;
            failure_ = fmt::format("rank 0's rendezvous hit an error: {}", e.what());
          }
        }
      }
    });
  }

  void accept() {
    auto session = std::make_shared<Session>(io_);
    acceptor_.async_accept(session->socket, [this, session](boost::system::error_code ec) {
      if (ec) return;  // acceptor closed
      // The relay's messages are small and come in bursts (a fence notice, then the replay
      // query): without this, Nagle held each second one until the first was acknowledged, up
      // to the peer's delayed-ack time (40 ms).
      boost::system::error_code nd;
      session->socket.set_option(tcp::no_delay(true), nd);
      session->peer = endpoint_text(session->socket);
      auto admitted = pending_.admit(session, source_address(session->socket));
      if (!admitted) {
        R2CCL_WARN_LIMITED("bootstrap root: dropped a connection from {}: {}", session->peer,
                           admitted.status().message());
        boost::system::error_code e;
        session->socket.close(e);
        return accept();
      }
      if (const SessionPtr& shed = *admitted) {
        R2CCL_WARN_LIMITED("bootstrap root: dropped {}: {}", shed->peer, pending_.shed_reason());
        drop(shed);
      }
      sessions_.push_back(session);
      session->hello_timer.expires_after(kHelloDeadline);
      session->hello_timer.async_wait([this, session](boost::system::error_code e) {
        if (e || session->rank >= 0 || session->closing) return;
        R2CCL_WARN_LIMITED("bootstrap root: dropped {}: no valid hello within {}ms", session->peer,
                           kHelloDeadline.count());
        drop(session);
      });
      auto challenge = crypto::make_nonce();
      if (!challenge) {
        R2CCL_WARN("bootstrap root: {}", challenge.status().message());
        drop(session);
        return accept();
      }
      session->challenge = *challenge;
      send(session, FrameType::kChallenge,
           Bytes(reinterpret_cast<const std::byte*>(challenge->data()),
                 reinterpret_cast<const std::byte*>(challenge->data()) + challenge->size()));
      read(session);
      accept();
    });
  }

  void read(const SessionPtr& s) {
    asio::async_read(
        s->socket, asio::buffer(s->header), [this, s](boost::system::error_code ec, std::size_t) {
          if (ec) return on_closed(s);
          auto h = decode_header(s->header);
          if (!h) {
            R2CCL_WARN_LIMITED("bootstrap root: dropped connection from {}: {}", s->peer,
                               h.status().message());
            return drop(s);
          }
          if (s->rank < 0 && h->length > kMaxHelloFrame) {
            R2CCL_WARN_LIMITED(
                "bootstrap root: dropped {}: a frame of {} bytes before its hello was "
                "accepted (at most {})",
                s->peer, h->length, kMaxHelloFrame);
            return drop(s);
          }
          s->payload.assign(h->length, std::byte{0});
          asio::async_read(s->socket, asio::buffer(s->payload),
                           [this, s, type = h->type](boost::system::error_code ec2, std::size_t) {
                             if (ec2) return on_closed(s);
                             on_frame(s, type);
                             if (!s->closing && s->socket.is_open()) read(s);
                           });
        });
  }

  void send(const SessionPtr& s, FrameType type, const Bytes& payload) {
    s->out.push_back(frame(type, payload));
    if (s->out.size() == 1) write_next(s);
  }
  void write_next(const SessionPtr& s) {
    asio::async_write(s->socket, asio::buffer(s->out.front()),
                      [this, s](boost::system::error_code ec, std::size_t) {
                        s->out.pop_front();
                        if (ec) return on_closed(s);
                        if (!s->out.empty()) return write_next(s);
                        if (s->closing) drop(s);
                      });
  }
  void refuse(const SessionPtr& s, const std::string& why) {
    R2CCL_WARN_LIMITED("bootstrap root: refused {}: {}", s->peer, why);
    // The first few are named in the failure, if start-up fails; the rest only counted.
    if (refusals_.size() < kRefusalsNamed) {
      refusals_.push_back(fmt::format("{} ({})", s->peer, why));
    } else {
      ++refusals_more_;
    }
    send(s, FrameType::kError, ByteWriter().str(why).take());
    s->closing = true;
  }
  void drop(const SessionPtr& s) {
    boost::system::error_code ec;
    pending_.settle(s.get());
    s->hello_timer.cancel();
    s->socket.close(ec);
    std::erase(sessions_, s);
  }

  void on_frame(const SessionPtr& s, FrameType type) {
    if (type == FrameType::kHello) return on_hello(s);
    if (type == FrameType::kColl && s->rank >= 0) return on_coll(s);
    if (type == FrameType::kSend && s->rank >= 0) return on_send(s);
    R2CCL_WARN_LIMITED("bootstrap root: unexpected frame type {} from {}", static_cast<int>(type),
                       s->peer);
    drop(s);
  }

  void on_hello(const SessionPtr& s) {
    auto parsed = parse_hello(s->payload);
    if (!parsed) {
      refuse(s, parsed.status().message());
      return;
    }
    const int rank = parsed->rank;
    const int nranks = parsed->nranks;
    Bytes info = std::move(parsed->info);
    s->client = parsed->client;
    const std::size_t signed_size = parsed->signed_size;
    const crypto::Mac& mac = parsed->mac;
    auto want =
        crypto::hmac(token_, {u8span(kHelloLabel), s->challenge,
                              u8span(std::span<const std::byte>(s->payload).first(signed_size))});
    if (!want || !crypto::equal(mac, *want)) {
      refuse(s,
             "wrong bootstrap token: it does not match rank 0's (check R2CCL_BOOTSTRAP_TOKEN or "
             "the unique id)");
      return;
    }
    if (failed_) {
      refuse(s, fmt::format("the rendezvous already failed: {}", failure_));
      return;
    }
    if (nranks_ == 0) {  // unique-id launch: the first rank to arrive sets the world size
      if (nranks < 1 || nranks > kMaxRanks) {
        refuse(s, fmt::format("a world of {} ranks (1..{} are possible)", nranks, kMaxRanks));
        return;
      }
      nranks_ = nranks;
      by_rank_.assign(static_cast<std::size_t>(nranks_), nullptr);
    }
    if (nranks != nranks_) {
      refuse(s, fmt::format("world size mismatch: this process has {} ranks, rank 0 has {}", nranks,
                            nranks_));
      return;
    }
    if (rank < 0 || rank >= nranks_) {
      refuse(s, fmt::format("rank {} is out of range for a world of {} ranks (0..{})", rank,
                            nranks_, nranks_ - 1));
      return;
    }
    if (complete_) {
      refuse(s, fmt::format("rank {} joined after the rendezvous of all {} ranks completed "
                            "(two processes claim rank {}?)",
                            rank, nranks_, rank));
      return;
    }
    auto& slot = by_rank_[static_cast<std::size_t>(rank)];
    if (slot) {
      refuse(s, fmt::format("rank {} is already taken by another process (connected from {})", rank,
                            slot->peer));
      return;
    }
    s->rank = rank;
    pending_.settle(s.get());
    s->hello_timer.cancel();
    slot = s;
    info_.resize(static_cast<std::size_t>(nranks_));
    info_[static_cast<std::size_t>(rank)] = std::move(info);
    ++joined_;
    R2CCL_DEBUG("bootstrap root: rank {} joined from {} ({}/{})", rank, s->peer, joined_, nranks_);
    if (joined_ == nranks_) {
      complete_ = true;
      deadline_.cancel();
      ByteWriter w;
      w.u32(static_cast<std::uint32_t>(nranks_));
      for (const auto& i : info_)
        w.blob(i);
      const Bytes all = w.take();
      for (auto& peer : by_rank_) {
        auto proof = crypto::hmac(token_, {u8span(kWelcomeLabel), peer->client, peer->challenge});
        if (!proof) {
          send(peer, FrameType::kError, ByteWriter().str(proof.status().message()).take());
          continue;
        }
        ByteWriter welcome(proof->size() + all.size());
        welcome.raw(proof->data(), proof->size()).raw(all.data(), all.size());
        send(peer, FrameType::kWelcome, welcome.take());
      }
    }
  }

  void on_coll(const SessionPtr& s) {
    auto parsed = parse_coll(s->payload);
    if (!parsed) return drop(s);
    const auto seq = parsed->seq;
    Bytes blob = std::move(parsed->blob);
    auto& slots = colls_[seq];
    slots.resize(static_cast<std::size_t>(nranks_));
    slots[static_cast<std::size_t>(s->rank)] = std::move(blob);
    if (std::all_of(slots.begin(), slots.end(), [](const auto& b) { return b.has_value(); })) {
      ByteWriter w;
      w.u64(seq).u32(static_cast<std::uint32_t>(nranks_));
      for (const auto& b : slots)
        w.blob(*b);
      Bytes result = w.take();
      colls_.erase(seq);
      for (auto& peer : by_rank_)
        if (peer) send(peer, FrameType::kCollResult, result);
    }
  }

  // Point-to-point control messages are relayed: rank -> root -> rank.
  void on_send(const SessionPtr& s) {
    auto parsed = parse_relayed(s->payload);
    if (!parsed) return drop(s);
    const auto dst = parsed->rank;
    Bytes msg = std::move(parsed->message);
    if (dst >= by_rank_.size() || !by_rank_[dst]) return;  // gone: the sender hears PEER_LEFT
    send(by_rank_[dst], FrameType::kDeliver,
         ByteWriter().u32(static_cast<std::uint32_t>(s->rank)).blob(msg).take());
  }

  void on_closed(const SessionPtr& s) {
    if (!s->socket.is_open()) return;
    boost::system::error_code ec;
    s->socket.close(ec);
    // Its hello timer would otherwise hold the root's thread (and so rank 0's shutdown) until it
    // expires: the destructor cancels only the sessions still listed.
    s->hello_timer.cancel();
    pending_.settle(s.get());
    std::erase(sessions_, s);
    if (s->rank < 0) return;
    auto& slot = by_rank_[static_cast<std::size_t>(s->rank)];
    if (slot != s) return;
    slot = nullptr;
    if (!complete_) {
      --joined_;  // the rank may come back before the deadline
      info_[static_cast<std::size_t>(s->rank)].clear();
      return;
    }
    // After the rendezvous a rank leaving is final: tell everybody still there.
    const std::string why =
        fmt::format("rank {} ({}) left the control path (connection closed)", s->rank, s->peer);
    R2CCL_INFO("bootstrap root: {}", why);
    colls_.clear();  // they can never complete; every rank fails them on PEER_LEFT
    for (auto& peer : by_rank_)
      if (peer)
        send(peer, FrameType::kPeerLeft,
             ByteWriter().u32(static_cast<std::uint32_t>(s->rank)).str(why).take());
  }

  void on_deadline() {
    if (complete_) return;
    std::vector<int> missing;
    for (int r = 0; r < nranks_; ++r)
      if (!by_rank_[static_cast<std::size_t>(r)]) missing.push_back(r);
    failed_ = true;
    failure_ = fmt::format(
        "timed out after {}ms waiting at rank 0 ({}) for rank(s) {} to join ({} of {} joined)",
        timeout_.count(), bound_.to_string(), fmt::join(missing, ","), joined_,
        nranks_ == 0 ? std::string("?") : std::to_string(nranks_));
    if (!refusals_.empty()) failure_ += fmt::format("; refused: {}", fmt::join(refusals_, "; "));
    if (refusals_more_ > 0) failure_ += fmt::format(" and {} more", refusals_more_);
    R2CCL_WARN("bootstrap root: {}", failure_);
    for (auto& peer : by_rank_)
      if (peer) send(peer, FrameType::kError, ByteWriter().str(failure_).take());
  }

  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer deadline_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  HostPort bound_;
  Token token_;
  int nranks_;
  milliseconds timeout_;
  std::vector<SessionPtr> sessions_;
  // The sessions that have not said a valid hello yet, bounded per source and in all.
  PendingHellos<Session> pending_{kMaxUnauthenticatedPerSource, kMaxUnauthenticated};
  std::vector<SessionPtr> by_rank_;
  std::vector<Bytes> info_;
  int joined_ = 0;
  bool complete_ = false;
  bool failed_ = false;
  std::string failure_;
  static constexpr std::size_t kRefusalsNamed = 8;
  std::vector<std::string> refusals_;
  std::uint64_t refusals_more_ = 0;
  std::map<std::uint64_t, std::vector<std::optional<Bytes>>> colls_;
};

namespace {
// Roots started by UniqueId::create, waiting for rank 0 of this process to adopt them. One not
// adopted within kPendingRootLifetime is closed (rank 0 then listens again on its port when it
// joins), and at most kMaxPendingRoots wait: a new one closes the oldest, so ids that are never
// used (an init that failed before it started) cannot pile up listeners and threads.
constexpr auto kPendingRootLifetime = std::chrono::hours(1);
constexpr std::size_t kMaxPendingRoots = 64;
struct PendingRoot {
  std::shared_ptr<BootstrapRoot> root;
  Clock::time_point made;
};
std::mutex g_roots_mutex;
std::map<Token, PendingRoot> g_pending_roots;

// Closes the roots past their lifetime and, past the bound, the oldest; with g_roots_mutex held.
// Returns them, to be closed (their threads joined) once the lock is released.
std::vector<std::shared_ptr<BootstrapRoot>> expire_pending_roots(std::size_t keep) {
  std::vector<std::shared_ptr<BootstrapRoot>> out;
  const auto now = Clock::now();
  for (auto it = g_pending_roots.begin(); it != g_pending_roots.end();) {
    if (now - it->second.made > kPendingRootLifetime) {
      R2CCL_WARN("bootstrap: a unique id of {} was not used within {} min; its listener is closed",
                 it->second.root->address().to_string(),
                 std::chrono::duration_cast<std::chrono::minutes>(kPendingRootLifetime).count());
      out.push_back(std::move(it->second.root));
      it = g_pending_roots.erase(it);
    } else {
      ++it;
    }
  }
  while (g_pending_roots.size() > keep) {
    auto oldest = std::min_element(
        g_pending_roots.begin(), g_pending_roots.end(),
        [](const auto& a, const auto& b) { return a.second.made < b.second.made; });
    R2CCL_WARN("bootstrap: {} unique ids wait to be used; the oldest ({}) is closed",
               g_pending_roots.size(), oldest->second.root->address().to_string());
    out.push_back(std::move(oldest->second.root));
    g_pending_roots.erase(oldest);
  }
  return out;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// UniqueId

Result<UniqueId> UniqueId::create(const std::string& bind_host) {
  Token token{};
  R2CCL_RETURN_IF_ERROR(crypto::random_bytes(token));
  R2CCL_ASSIGN_OR_RETURN(
      auto root,
      BootstrapRoot::start(HostPort{bind_host, 0}, token, 0,
                           std::chrono::duration_cast<milliseconds>(kPendingRootLifetime)));
  UniqueId id;
  ByteWriter w;
  w.u32(kIdMagic)
      .str(root->address().host)
      .u16(root->address().port)
      .raw(token.data(), token.size());
  if (w.bytes().size() > kSize)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("host name '{}' is too long", bind_host));
  std::memcpy(id.bytes.data(), w.bytes().data(), w.bytes().size());
  std::vector<std::shared_ptr<BootstrapRoot>> closed;
  {
    std::lock_guard lock(g_roots_mutex);
    closed = expire_pending_roots(kMaxPendingRoots - 1);
    g_pending_roots[token] = PendingRoot{std::move(root), Clock::now()};
  }
  return id;
}

namespace {
Status decode_id(const UniqueId& id, HostPort* at, Token* token) {
  return bootstrap_wire::decode_id(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(id.bytes.data()),
                                 id.bytes.size()),
      at, token);
}
}  // namespace

Result<HostPort> UniqueId::address() const {
  HostPort at;
  Token t;
  R2CCL_RETURN_IF_ERROR(decode_id(*this, &at, &t));
  return at;
}

Result<Token> UniqueId::token() const {
  HostPort at;
  Token t;
  R2CCL_RETURN_IF_ERROR(decode_id(*this, &at, &t));
  return t;
}

Result<BootstrapOptions> BootstrapOptions::from_config(const Config& config) {
  BootstrapOptions o;
  if (!config.nranks)
    return Status(ErrorCode::kConfig,
                  "R2CCL_NRANKS is not set (and no mpirun world size was found)");
  if (!config.rank)
    return Status(ErrorCode::kConfig, "R2CCL_RANK is not set (and no mpirun rank was found)");
  if (!config.bootstrap)
    return Status(ErrorCode::kConfig,
                  "R2CCL_BOOTSTRAP is not set: give rank 0's host:port, e.g. "
                  "R2CCL_BOOTSTRAP=198.19.0.1:29500");
  o.rank = *config.rank;
  o.nranks = *config.nranks;
  o.root = *config.bootstrap;
  o.token = config.bootstrap_token;
  const bool loopback = o.root.host.rfind("127.", 0) == 0 || o.root.host == "localhost";
  if (o.token == Token{} && !loopback && !config.insecure_no_token)
    return Status(
        ErrorCode::kConfig,
        fmt::format("R2CCL_BOOTSTRAP_TOKEN is not set, and rank 0 ({}) is reachable outside "
                    "loopback: give every rank the same token (32 hex digits, e.g. from "
                    "`openssl rand -hex 16`), or set R2CCL_INSECURE_NO_TOKEN=1 to let anyone who "
                    "reaches its ports join",
                    o.root.to_string()));
  o.timeout = config.bootstrap_timeout;
  o.socket_ifname = config.socket_ifname;
  return o;
}

Result<BootstrapOptions> BootstrapOptions::from_unique_id(const UniqueId& id, int rank, int nranks,
                                                          const Config& config) {
  BootstrapOptions o;
  R2CCL_RETURN_IF_ERROR(decode_id(id, &o.root, &o.token));
  o.rank = rank;
  o.nranks = nranks;
  o.timeout = config.bootstrap_timeout;
  o.socket_ifname = config.socket_ifname;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Client side: one connection to the root, driven synchronously with deadlines.

struct Bootstrap::Connection {
  asio::io_context io;
  tcp::socket socket{io};
  bool broken = false;

  // Runs io until `done` or the deadline; on the deadline cancels and reports a timeout.
  bool run_until(Clock::time_point deadline, const bool& done) {
    io.restart();
    while (!done && Clock::now() < deadline)
      io.run_one_until(deadline);
    if (done) return true;
    boost::system::error_code ec;
    socket.cancel(ec);
    io.restart();
    io.run();
    broken = true;
    return false;
  }

  Status send(FrameType type, const Bytes& payload) {
    if (broken) return {ErrorCode::kNetwork, "the control connection to rank 0 is broken"};
    boost::system::error_code ec;
    asio::write(socket, asio::buffer(frame(type, payload)), ec);
    if (ec) {
      broken = true;
      return {ErrorCode::kNetwork,
              fmt::format("lost the control connection to rank 0: {}", ec.message())};
    }
    return Status::ok();
  }

  // Reads one frame; an ERROR frame from the root becomes an error with its message.
  Result<std::pair<FrameType, Bytes>> receive(Clock::time_point deadline,
                                              const std::string& waiting_for) {
    if (broken) return Status(ErrorCode::kNetwork, "the control connection to rank 0 is broken");
    std::array<std::byte, kHeaderSize> header{};
    Bytes payload;
    bool done = false;
    boost::system::error_code error;
    Result<Header> h = Status(ErrorCode::kInternal, "no header");
    asio::async_read(socket, asio::buffer(header), [&](boost::system::error_code ec, std::size_t) {
      if (ec) {
        error = ec;
        done = true;
        return;
      }
      h = decode_header(header);
      if (!h) {
        done = true;
        return;
      }
      payload.resize(h->length);
      asio::async_read(socket, asio::buffer(payload),
                       [&](boost::system::error_code ec2, std::size_t) {
                         error = ec2;
                         done = true;
                       });
    });
    if (!run_until(deadline, done))
      return Status(ErrorCode::kTimeout, fmt::format("timed out waiting for {}", waiting_for));
    if (error) {
      broken = true;
      return Status(ErrorCode::kNetwork,
                    fmt::format("lost the control connection to rank 0 while waiting for {}: {}",
                                waiting_for, error.message()));
    }
    if (!h) {
      broken = true;
      return h.status();
    }
    if (h->type == FrameType::kError) {
      auto why = parse_error(payload);
      broken = true;
      return Status(ErrorCode::kBootstrap, why ? *why : why.status().message());
    }
    return std::make_pair(h->type, std::move(payload));
  }
};

// After the rendezvous one thread reads everything rank 0 sends; senders write under a mutex.
struct Bootstrap::Reader {
  std::thread thread;
  std::mutex mutex;  // guards the fields below
  std::condition_variable cv;
  std::map<std::uint64_t, Bytes> results;  // rank 0's answers to unfinished all-gathers
  std::map<int, std::string> left;         // ranks that left the control path, and why
  std::string failure;                     // the connection to rank 0 is gone
  // All-gathers by sequence number: those this rank started and has not finished, the last
  // kKeepFinished it finished (a rank that went direct late still gets this rank's blob), and
  // the next one, when a rank's blob for it came on the direct path before this rank started it
  // (no rank can be further ahead: it would need this rank's blob for the one before).
  struct Gather {
    bool started = false;
    bool finished = false;
    bool went_direct = false;
    Bytes mine;
    std::vector<std::optional<Bytes>> direct;  // every rank's blob that came on the direct path
    std::vector<bool> sent;                    // the ranks this rank's blob went to directly
  };
  std::map<std::uint64_t, Gather> gathers;
  static constexpr std::size_t kKeepFinished = 4;
  // The last all-gather went direct (or a rank sent its blob directly): the next ones go direct
  // at once. Any answer from rank 0, even a late one, clears it.
  bool direct_mode = false;
  std::mutex write_mutex;
  std::mutex handler_mutex;  // held while a handler runs; guards `early` and `inboxes`
  MessageHandler on_message;
  PeerLeftHandler on_peer_left;
  std::deque<std::pair<int, Bytes>> early;  // messages before a handler was set
  static constexpr std::size_t kMaxEarlyMessages = 65536;
  std::vector<bootstrap_wire::InOrderInbox> inboxes;  // control messages, by source rank
  std::mutex send_mutex;               // orders send_to's sequence numbers and copies
  std::vector<std::uint64_t> sent_to;  // the last sequence number sent, by destination
  std::mutex direct_mutex;             // held while the direct path is called
  DirectPath direct;
};

Bootstrap::Bootstrap() = default;
Bootstrap::~Bootstrap() {
  if (reader_) set_handlers(nullptr, nullptr);
  if (conn_) {
    ::shutdown(conn_->socket.native_handle(), SHUT_RDWR);
    if (reader_ && reader_->thread.joinable()) reader_->thread.join();
    boost::system::error_code ec;
    conn_->socket.close(ec);
  }
}

namespace {
// Blocking, complete reads and writes on a socket descriptor; false on EOF or error.
bool read_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<std::byte*>(p);
  while (n > 0) {
    const ssize_t got = ::recv(fd, b, n, 0);
    if (got <= 0) {
      if (got < 0 && errno == EINTR) continue;
      return false;
    }
    b += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}
// Writes everything, or gives up when the peer has taken nothing more for `stall` (a stopped
// rank 0 must not hold a writer, nor the destructor that joins it, forever).
bool write_all(int fd, const void* p, std::size_t n,
               std::chrono::milliseconds stall = std::chrono::milliseconds(10000)) {
  const auto* b = static_cast<const std::byte*>(p);
  while (n > 0) {
    const ssize_t put = ::send(fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      const int ready = ::poll(&pfd, 1, static_cast<int>(stall.count()));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return false;  // stalled (or poll failed)
      continue;
    }
    if (put <= 0) return false;
    b += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}
}  // namespace

void Bootstrap::start_reader() {
  // The join used asynchronous operations, which leave the descriptor non-blocking.
  boost::system::error_code ec;
  conn_->socket.non_blocking(false, ec);
  conn_->socket.native_non_blocking(false, ec);
  reader_ = std::make_unique<Reader>();
  reader_->inboxes.resize(static_cast<std::size_t>(nranks_));
  reader_->sent_to.assign(static_cast<std::size_t>(nranks_), 0);
  reader_->thread = std::thread([this] {
    try {
      reader_loop();
    } catch (const std::exception& e) {  // no exception ends the process from this thread
      R2CCL_ERROR("bootstrap: the control path's reader stopped: {}", e.what());
      Reader& rd = *reader_;
      {
        std::lock_guard lock(rd.mutex);
        rd.failure = fmt::format("the control path's reader stopped: {}", e.what());
      }
      rd.cv.notify_all();
    }
  });
}

void Bootstrap::reader_loop() {
  const int fd = conn_->socket.native_handle();
  Reader& rd = *reader_;
  auto fail = [&](const std::string& why) {
    {
      std::lock_guard lock(rd.mutex);
      rd.failure = why;
    }
    rd.cv.notify_all();
    std::lock_guard h(rd.handler_mutex);
    if (rd.on_peer_left) rd.on_peer_left(0, why);
  };
  while (true) {
    std::array<std::byte, kHeaderSize> header{};
    if (!read_all(fd, header.data(), header.size()))
      return fail("lost the control connection to rank 0");
    auto h = decode_header(header);
    if (!h) return fail(h.status().message());
    Bytes payload(h->length);
    if (!read_all(fd, payload.data(), payload.size()))
      return fail("lost the control connection to rank 0");
    switch (h->type) {
      case FrameType::kCollResult: {
        // Only an answer to an all-gather this rank started is kept.
        const auto seq = coll_result_seq(payload);
        if (!seq || *seq == 0 || *seq > coll_seq_.load())
          return fail("rank 0 sent the result of an all-gather this rank never started");
        {
          std::lock_guard lock(rd.mutex);
          rd.direct_mode = false;  // rank 0 answers again
          // A late answer to one that completed on the direct path is dropped.
          auto g = rd.gathers.find(*seq);
          if (g != rd.gathers.end() && g->second.started && !g->second.finished)
            rd.results[*seq] = std::move(payload);
        }
        rd.cv.notify_all();
        break;
      }
      case FrameType::kDeliver: {
        auto d = parse_relayed(payload);
        if (!d) return fail(d.status().message());
        if (d->rank >= static_cast<std::uint32_t>(nranks_))
          return fail(
              fmt::format("rank 0 relayed a control message from rank {} of {}", d->rank, nranks_));
        auto m = parse_sequenced(d->message);
        if (!m) return fail(m.status().message());
        const int src = static_cast<int>(d->rank);
        std::lock_guard hl(rd.handler_mutex);
        bool kept = true;
        rd.inboxes[d->rank].accept(m->seq, std::move(m->message), [&](Bytes msg) {
          kept = dispatch(src, std::move(msg)) && kept;
        });
        if (!kept)
          return fail(
              fmt::format("more than {} control messages arrived before this rank set a handler",
                          Reader::kMaxEarlyMessages));
        break;
      }
      case FrameType::kPeerLeft: {
        auto p = parse_peer_left(payload);
        if (!p) return fail(p.status().message());
        {
          std::lock_guard lock(rd.mutex);
          rd.left[p->rank] = p->why;
        }
        rd.cv.notify_all();
        std::lock_guard hl(rd.handler_mutex);
        if (rd.on_peer_left) rd.on_peer_left(p->rank, p->why);
        break;
      }
      case FrameType::kError: {
        auto why = parse_error(payload);
        return fail(why ? *why : why.status().message());
      }
      default:
        return fail(fmt::format("rank 0 sent an unexpected control frame (type {})",
                                static_cast<int>(h->type)));
    }
  }
}

void Bootstrap::set_handlers(MessageHandler on_message, PeerLeftHandler on_peer_left) {
  Reader& rd = *reader_;
  std::lock_guard hl(rd.handler_mutex);
  rd.on_message = std::move(on_message);
  rd.on_peer_left = std::move(on_peer_left);
  if (!rd.on_message) return;
  while (!rd.early.empty()) {
    auto [src, msg] = std::move(rd.early.front());
    rd.early.pop_front();
    rd.on_message(src, std::move(msg));
  }
  std::map<int, std::string> left;
  {
    std::lock_guard lock(rd.mutex);
    left = rd.left;
  }
  if (rd.on_peer_left)
    for (const auto& [who, why] : left)
      rd.on_peer_left(who, why);
}

bool Bootstrap::dispatch(int src, Bytes message) {
  Reader& rd = *reader_;
  if (rd.on_message) {
    rd.on_message(src, std::move(message));
    return true;
  }
  if (rd.early.size() >= Reader::kMaxEarlyMessages) return false;
  rd.early.emplace_back(src, std::move(message));
  return true;
}

void Bootstrap::set_direct_path(DirectPath send) {
  std::lock_guard lock(reader_->direct_mutex);
  reader_->direct = std::move(send);
}

bool Bootstrap::has_direct_path() {
  std::lock_guard lock(reader_->direct_mutex);
  return static_cast<bool>(reader_->direct);
}

Status Bootstrap::send_direct(int rank, Bytes message) {
  std::lock_guard lock(reader_->direct_mutex);
  if (!reader_->direct) return {ErrorCode::kUnavailable, "no direct control path"};
  Status st;
  try {
    st = reader_->direct(rank, std::move(message));
  } catch (const std::exception& e) {
    st = Status(ErrorCode::kInternal, e.what());
  }
  if (!st)
    R2CCL_WARN_LIMITED("bootstrap: a control message to rank {} did not take the direct path: {}",
                       rank, st.message());
  return st;
}

Status Bootstrap::send_to(int rank, std::span<const std::byte> message) {
  if (rank < 0 || rank >= nranks_)
    return {ErrorCode::kInvalidArgument,
            fmt::format("control message to rank {} of {}", rank, nranks_)};
  Reader& rd = *reader_;
  std::lock_guard order(rd.send_mutex);
  const auto seq = rd.sent_to[static_cast<std::size_t>(rank)] + 1;
  // The direct copy first: it does not wait for anything.
  const bool direct = rank != rank_ && has_direct_path() &&
                      send_direct(rank, encode_direct(DirectKind::kMessage, seq, message)).is_ok();
  Bytes f = frame(FrameType::kSend, ByteWriter()
                                        .u32(static_cast<std::uint32_t>(rank))
                                        .blob(encode_sequenced(seq, message))
                                        .take());
  bool relayed = false;
  {
    std::lock_guard lock(rd.write_mutex);
    relayed = write_all(conn_->socket.native_handle(), f.data(), f.size());
  }
  // A number neither path took is used again, so that the receiver never waits for it.
  if (!direct && !relayed)
    return {ErrorCode::kNetwork,
            "lost the control connection to rank 0 (closed, or it took nothing for 10s), and no "
            "direct path took the message"};
  rd.sent_to[static_cast<std::size_t>(rank)] = seq;
  return Status::ok();
}

void Bootstrap::on_direct_message(int src, std::span<const std::byte> message) {
  Reader& rd = *reader_;
  if (src < 0 || src >= nranks_ || src == rank_) {
    R2CCL_WARN_LIMITED("bootstrap: a direct control message from rank {} (of {}, this is {})", src,
                       nranks_, rank_);
    return;
  }
  auto d = parse_direct(message);
  if (!d) {
    R2CCL_WARN_LIMITED("bootstrap: rank {} sent a malformed direct control message: {}", src,
                       d.status().message());
    return;
  }
  if (d->kind == DirectKind::kMessage) {
    std::lock_guard hl(rd.handler_mutex);
    const auto seq = d->seq;
    const auto outcome =
        rd.inboxes[static_cast<std::size_t>(src)].accept(seq, std::move(d->body), [&](Bytes msg) {
          if (!dispatch(src, std::move(msg)))
            R2CCL_WARN_LIMITED(
                "bootstrap: dropped a control message from rank {}: more than {} wait for a "
                "handler",
                src, Reader::kMaxEarlyMessages);
        });
    if (outcome == InOrderInbox::Outcome::kDropped)
      R2CCL_DEBUG("bootstrap: control message #{} from rank {} waits for its copy through rank 0",
                  seq, src);
    return;
  }
  Bytes reply;
  {
    std::lock_guard lock(rd.mutex);
    const auto started = coll_seq_.load();
    if (d->seq > started + 1) {
      R2CCL_WARN_LIMITED(
          "bootstrap: rank {} sent its blob for all-gather #{}, but this rank started only #{}: "
          "dropped",
          src, d->seq, started);
      return;
    }
    auto it = rd.gathers.find(d->seq);
    if (it == rd.gathers.end()) {
      if (d->seq <= started) return;  // finished long ago
      it = rd.gathers.emplace(d->seq, Reader::Gather{}).first;
    }
    Reader::Gather& g = it->second;
    if (g.direct.empty()) {
      g.direct.resize(static_cast<std::size_t>(nranks_));
      g.sent.assign(static_cast<std::size_t>(nranks_), false);
    }
    auto& slot = g.direct[static_cast<std::size_t>(src)];
    if (!slot) slot = std::move(d->body);
    rd.direct_mode = true;  // that rank does not hear rank 0 in time
    if (g.started && !g.sent[static_cast<std::size_t>(src)]) {
      g.sent[static_cast<std::size_t>(src)] = true;
      reply = encode_direct(DirectKind::kContribution, d->seq, g.mine);
    }
  }
  rd.cv.notify_all();
  if (!reply.empty()) (void)send_direct(src, std::move(reply));
}

Result<std::unique_ptr<Bootstrap>> Bootstrap::join(const BootstrapOptions& o,
                                                   std::span<const std::byte> local_info) {
  if (o.nranks < 1)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("world size {} is not positive", o.nranks));
  if (o.rank < 0 || o.rank >= o.nranks)
    return Status(ErrorCode::kInvalidArgument,
                  fmt::format("rank {} is out of range for a world of {} ranks (0..{})", o.rank,
                              o.nranks, o.nranks - 1));
  std::unique_ptr<Bootstrap> b(new Bootstrap());
  b->rank_ = o.rank;
  b->nranks_ = o.nranks;
  const auto deadline = Clock::now() + o.timeout;

  if (o.rank == 0) {
    std::vector<std::shared_ptr<BootstrapRoot>> closed;  // expired roots, closed after the lock
    {
      std::lock_guard lock(g_roots_mutex);
      closed = expire_pending_roots(kMaxPendingRoots);
      auto it = g_pending_roots.find(o.token);
      if (it != g_pending_roots.end()) {
        b->root_ = std::move(it->second.root);
        g_pending_roots.erase(it);
      }
    }
    if (!b->root_) {
      R2CCL_ASSIGN_OR_RETURN(b->root_, BootstrapRoot::start(o.root, o.token, o.nranks, o.timeout));
    }
  }

  b->conn_ = std::make_unique<Connection>();
  Connection& c = *b->conn_;
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(o.root.host, ec);
  if (ec) {
    // A host name: resolve it once.
    tcp::resolver resolver(c.io);
    auto results = resolver.resolve(o.root.host, std::to_string(o.root.port), ec);
    if (ec || results.empty())
      return Status(ErrorCode::kBootstrap, fmt::format("cannot resolve rank 0's address {}: {}",
                                                       o.root.to_string(), ec.message()));
    addr = results.begin()->endpoint().address();
  }
  const tcp::endpoint root_ep(addr, o.root.port);
  std::string bind_ip;
  if (!o.socket_ifname.empty()) {
    R2CCL_ASSIGN_OR_RETURN(bind_ip, interface_ipv4(o.socket_ifname));
  }

  // Connect, retrying while rank 0 is not up yet, until the deadline.
  std::string last_error = "no attempt";
  bool connected = false;
  while (!connected) {
    c.socket = tcp::socket(c.io);
    c.socket.open(root_ep.protocol(), ec);
    if (!ec && !bind_ip.empty())
      c.socket.bind(tcp::endpoint(asio::ip::make_address(bind_ip), 0), ec);
    if (ec)
      return Status(ErrorCode::kBootstrap,
                    fmt::format("cannot open the control socket: {}", ec.message()));
    bool done = false;
    boost::system::error_code cerr;
    c.socket.async_connect(root_ep, [&](boost::system::error_code e) {
      cerr = e;
      done = true;
    });
    c.broken = false;
    if (!c.run_until(deadline, done)) {
      last_error = "connection attempt timed out";
      break;
    }
    if (!cerr) {
      connected = true;
      break;
    }
    last_error = cerr.message();
    if (Clock::now() + milliseconds(50) >= deadline) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  if (!connected)
    return Status(ErrorCode::kBootstrap,
                  fmt::format("could not reach rank 0 at {} within {}ms (last error: {})",
                              o.root.to_string(), o.timeout.count(), last_error));
  c.socket.set_option(tcp::no_delay(true), ec);
  b->control_address_ = c.socket.local_endpoint(ec).address().to_string();

  auto challenge_frame =
      c.receive(deadline, fmt::format("rank 0's challenge ({})", o.root.to_string()));
  if (!challenge_frame)
    return challenge_frame.status().with_context(fmt::format("rank {} bootstrap", o.rank));
  if (challenge_frame->first != FrameType::kChallenge ||
      challenge_frame->second.size() != sizeof(crypto::Nonce))
    return Status(ErrorCode::kProtocol, "rank 0 did not open with a challenge");
  crypto::Nonce challenge{};
  std::memcpy(challenge.data(), challenge_frame->second.data(), challenge.size());
  R2CCL_ASSIGN_OR_RETURN(const crypto::Nonce client, crypto::make_nonce());
  ByteWriter hello;
  hello.u32(kVersion)
      .u32(static_cast<std::uint32_t>(o.rank))
      .u32(static_cast<std::uint32_t>(o.nranks))
      .blob(local_info)
      .raw(client.data(), client.size());
  R2CCL_ASSIGN_OR_RETURN(
      auto mac, crypto::hmac(o.token, {u8span(kHelloLabel), challenge,
                                       u8span(std::span<const std::byte>(hello.bytes()))}));
  hello.raw(mac.data(), mac.size());
  R2CCL_RETURN_IF_ERROR(c.send(FrameType::kHello, hello.take()));
  // The root enforces the deadline and names the missing ranks; wait a little longer for its word.
  auto reply =
      c.receive(deadline + milliseconds(1000),
                fmt::format("all {} ranks to join at rank 0 ({})", o.nranks, o.root.to_string()));
  if (!reply) return reply.status().with_context(fmt::format("rank {} bootstrap", o.rank));
  if (reply->first != FrameType::kWelcome)
    return Status(ErrorCode::kProtocol, "rank 0 answered the hello with an unexpected frame");
  auto welcome = parse_welcome(reply->second, o.nranks);
  R2CCL_ASSIGN_OR_RETURN(auto expected,
                         crypto::hmac(o.token, {u8span(kWelcomeLabel), client, challenge}));
  if (!welcome || !crypto::equal(welcome->proof, expected))
    return Status(ErrorCode::kBootstrap,
                  fmt::format("the process at {} does not know this job's token (its welcome "
                              "does not prove it)",
                              o.root.to_string()));
  b->rank_info_ = std::move(welcome->info);
  R2CCL_DEBUG("bootstrap: rank {} of {} joined via {}", o.rank, o.nranks, b->control_address_);
  b->start_reader();
  return b;
}

Result<std::vector<Bytes>> Bootstrap::allgather(std::span<const std::byte> mine,
                                                std::chrono::milliseconds timeout) {
  Reader& rd = *reader_;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  std::uint64_t seq = 0;
  bool direct_now = false;
  {
    std::lock_guard lock(rd.mutex);
    seq = ++coll_seq_;
    Reader::Gather& g = rd.gathers[seq];
    if (g.direct.empty()) {
      g.direct.resize(static_cast<std::size_t>(nranks_));
      g.sent.assign(static_cast<std::size_t>(nranks_), false);
    }
    g.started = true;
    g.mine.assign(mine.begin(), mine.end());
    g.direct[static_cast<std::size_t>(rank_)] = g.mine;
    // Direct at once when the last one needed it, or when a rank already sent its blob directly.
    direct_now = rd.direct_mode;
  }
  const bool can_go_direct = nranks_ > 1 && has_direct_path();
  // Whatever happens, this all-gather ends finished; the oldest finished ones are forgotten.
  auto finish = [&] {
    std::lock_guard lock(rd.mutex);
    rd.results.erase(seq);
    rd.gathers[seq].finished = true;
    std::size_t done = 0;
    for (auto it = rd.gathers.rbegin(); it != rd.gathers.rend(); ++it)
      done += it->second.finished ? 1 : 0;
    for (auto it = rd.gathers.begin(); it != rd.gathers.end() && done > Reader::kKeepFinished;) {
      if (it->second.finished) {
        it = rd.gathers.erase(it);
        --done;
      } else {
        ++it;
      }
    }
  };
  Bytes f = frame(FrameType::kColl, ByteWriter().u64(seq).blob(mine).take());
  bool relayed = false;
  {
    std::lock_guard lock(reader_->write_mutex);
    relayed = write_all(conn_->socket.native_handle(), f.data(), f.size());
  }
  if (!relayed && !can_go_direct) {
    finish();
    return Status(ErrorCode::kNetwork, "lost the control connection to rank 0");
  }
  const auto direct_at = direct_now || !relayed ? start : start + kDirectAfter;
  std::unique_lock lock(rd.mutex);
  Result<std::vector<Bytes>> out = Status(ErrorCode::kInternal, "no result");
  while (true) {
    Reader::Gather& g = rd.gathers[seq];
    if (auto it = rd.results.find(seq); it != rd.results.end()) {
      out = parse_coll_result(it->second, nranks_);
      if (!out)
        out = Status(ErrorCode::kProtocol,
                     fmt::format("control-path all-gather #{}: {}", seq, out.status().message()));
      break;
    }
    const auto now = Clock::now();
    const bool root_gone = !rd.failure.empty();
    // A rank that sent its blob directly waits for this rank's there too.
    bool asked = false;
    for (int r = 0; r < nranks_; ++r)
      asked = asked || (r != rank_ && g.direct[static_cast<std::size_t>(r)].has_value());
    if (can_go_direct && !g.went_direct && (now >= direct_at || root_gone || asked)) {
      // Rank 0 is silent: this rank's blob goes to every rank that has not had it directly.
      g.went_direct = true;
      rd.direct_mode = true;
      std::vector<int> to;
      for (int r = 0; r < nranks_; ++r)
        if (r != rank_ && !g.sent[static_cast<std::size_t>(r)]) {
          g.sent[static_cast<std::size_t>(r)] = true;
          to.push_back(r);
        }
      const Bytes blob = encode_direct(DirectKind::kContribution, seq, g.mine);
      R2CCL_DEBUG("bootstrap: all-gather #{} goes direct to {} rank(s)", seq, to.size());
      lock.unlock();
      for (int r : to)
        (void)send_direct(r, blob);
      lock.lock();
      continue;
    }
    if (std::all_of(g.direct.begin(), g.direct.end(),
                    [](const auto& b) { return b.has_value(); })) {
      std::vector<Bytes> all;
      all.reserve(g.direct.size());
      for (const auto& b : g.direct)
        all.push_back(*b);
      out = std::move(all);
      break;
    }
    if (!rd.left.empty()) {
      out =
          Status(ErrorCode::kAborted, fmt::format("control-path all-gather #{} cannot complete: {}",
                                                  seq, rd.left.begin()->second));
      break;
    }
    if (root_gone && !can_go_direct) {
      out = Status(ErrorCode::kNetwork, rd.failure);
      break;
    }
    if (now >= deadline) {
      out = Status(
          ErrorCode::kTimeout,
          fmt::format(
              "timed out after {}ms waiting for the other ranks in control-path all-gather "
              "#{} ({}; its blob came directly from {} of {} ranks)",
              timeout.count(), seq,
              g.went_direct ? "rank 0 did not answer, and it went direct" : "rank 0 did not answer",
              std::count_if(g.direct.begin(), g.direct.end(),
                            [](const auto& b) { return b.has_value(); }),
              nranks_));
      break;
    }
    rd.cv.wait_until(lock,
                     can_go_direct && !g.went_direct ? std::min(deadline, direct_at) : deadline);
  }
  lock.unlock();
  finish();
  return out;
}

Status Bootstrap::barrier(std::chrono::milliseconds timeout) {
  auto r = allgather({}, timeout);
  return r.status();
}

}  // namespace r2ccl

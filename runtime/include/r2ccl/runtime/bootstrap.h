// NCCL-style bootstrap: rendezvous of all ranks at rank 0 over TCP, an all-gather of each rank's
// endpoint information, and later small all-gathers and barriers on the same control path.
//
// The control path uses the interface that reaches rank 0 (or R2CCL_SOCKET_IFNAME), never a
// rail, so it outlives any rail failure. Every wait has a deadline. A world whose rails are up
// gives the bootstrap a second, direct path over them (set_direct_path): control messages go both
// ways and are taken once each, in order; an all-gather that rank 0 has not answered within
// kDirectAfter is completed over the direct path, so the management network is no single point
// of failure.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/status.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

// Rank 0's address and a random 128-bit token, as an opaque 128-byte value (like ncclUniqueId)
// that the application hands to every rank out of band.
struct UniqueId {
  static constexpr std::size_t kSize = 128;
  std::array<std::uint8_t, kSize> bytes{};

  // Starts rank 0's rendezvous listener on `bind_host` (port 0: any free port) in this process
  // and returns the id (its token from getrandom). Rank 0 must join with it from this process.
  // A listener not taken up within an hour is closed, and so is the oldest where 64 wait at
  // once; its id still works, rank 0 listening again on its port when it joins (unless another
  // socket took that port meanwhile).
  static Result<UniqueId> create(const std::string& bind_host);
  Result<HostPort> address() const;
  Result<Token> token() const;
};

struct BootstrapOptions {
  int rank = -1;
  int nranks = 0;
  HostPort root;  // rank 0's listener
  Token token{};
  std::chrono::milliseconds timeout{30000};  // rendezvous deadline
  std::string socket_ifname;                 // bind the control connection to this interface

  // From the launch environment: R2CCL_RANK/NRANKS/BOOTSTRAP (or mpirun's variables).
  static Result<BootstrapOptions> from_config(const Config& config);
  static Result<BootstrapOptions> from_unique_id(const UniqueId& id, int rank, int nranks,
                                                 const Config& config);
};

class BootstrapRoot;

class Bootstrap {
 public:
  // Joins the rendezvous; rank 0 also runs the root listener. `local_info` is published to every
  // rank. Fails with a message naming the cause: wrong token, world size mismatch, rank out of
  // range or already taken, rank 0 unreachable (naming its address), a deadline passed.
  static Result<std::unique_ptr<Bootstrap>> join(const BootstrapOptions& options,
                                                 std::span<const std::byte> local_info);
  ~Bootstrap();
  Bootstrap(const Bootstrap&) = delete;
  Bootstrap& operator=(const Bootstrap&) = delete;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  // Every rank's local_info from join(), indexed by rank.
  const std::vector<Bytes>& rank_info() const { return rank_info_; }
  // The local IPv4 address of the control connection (the interface that reaches rank 0).
  const std::string& control_address() const { return control_address_; }

  // All-gather of small blobs on the control path; every rank must call it in the same order.
  // Fails at once when a rank has left the control path. Without rank 0's answer within
  // kDirectAfter (or at once, when the last all-gather needed it or the connection to rank 0 is
  // gone), each rank also sends its blob over the direct path to every other rank; the
  // all-gather completes from whichever arrives first, rank 0's answer or every rank's blob (the
  // same bytes). Until rank 0 answers an all-gather again, the next ones go direct at once too.
  static constexpr std::chrono::milliseconds kDirectAfter{1000};
  Result<std::vector<Bytes>> allgather(std::span<const std::byte> mine,
                                       std::chrono::milliseconds timeout);
  Status barrier(std::chrono::milliseconds timeout);

  // Point-to-point control messages (relayed by rank 0, and a copy on the direct path when there
  // is one), for rail failure notices and the like. Each carries the sender's sequence number
  // for that destination: the receiver hands each to its handler once, in the order sent. OK
  // when at least one path took it.
  Status send_to(int rank, std::span<const std::byte> message);
  // The direct path: sends one message (at most 64 KiB and a few bytes) to a rank without a
  // relay; must not block; an error when it could not take it. What a rank sent this way is
  // handed in with on_direct_message. Empty: none (then everything goes through rank 0). Once
  // this returns, no call of the previous one is running.
  using DirectPath = std::function<Status(int rank, Bytes message)>;
  void set_direct_path(DirectPath send);
  // A message that `src` sent on the direct path; the path has authenticated `src`. Anything
  // malformed is logged and dropped. Does not block (it may send a reply on the direct path).
  void on_direct_message(int src, std::span<const std::byte> message);
  using MessageHandler = std::function<void(int src, Bytes message)>;
  // A rank left the control path (its process ended or lost its connection); rank 0 leaving,
  // or losing the connection to it, reports rank 0.
  using PeerLeftHandler = std::function<void(int rank, const std::string& why)>;
  // Handlers run on the control path's reader thread and must not block. Messages that arrive
  // before a handler is set are kept and delivered when it is. Passing empty handlers stops
  // delivery; once this returns, no handler is running.
  void set_handlers(MessageHandler on_message, PeerLeftHandler on_peer_left);

 private:
  struct Connection;
  struct Reader;
  Bootstrap();
  void start_reader();
  void reader_loop();
  Status send_direct(int rank, Bytes message);
  bool has_direct_path();
  // Hands a control message to the handler (or keeps it until one is set); false when too many
  // wait for a handler. Called with the reader's handler_mutex held.
  bool dispatch(int src, Bytes message);
  int rank_ = -1;
  int nranks_ = 0;
  std::atomic<std::uint64_t> coll_seq_{0};
  std::string control_address_;
  std::vector<Bytes> rank_info_;
  std::shared_ptr<BootstrapRoot> root_;  // rank 0 only
  std::unique_ptr<Connection> conn_;
  std::unique_ptr<Reader> reader_;
};

}  // namespace r2ccl

// The transport provider interface (DESIGN.md, Provider): enumerates the NICs it was given,
// registers memory per NIC (per-device keys), opens rails (one connection between a local NIC
// and a remote NIC), posts one-sided writes with a 32-bit immediate and small control messages,
// and reports completions and errors. `tcp` and `verbs` implement it.
//
// Threading: every Rail method and every RailEvents callback runs on the progress engine's loop
// thread. register_memory/deregister_memory may be called from any thread.
//
// Providers are built with the runtime: this is a C++ interface (std::function, shared_ptr,
// Status in its signatures), not a boundary a separately built provider could be checked
// against. What a provider can do beyond the minimum, where the runtime acts on it, is in its
// capability flags.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/device_memory.h"
#include "r2ccl/runtime/status.h"
#include "r2ccl/runtime/topology.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl {

class ProgressEngine;

// What a registration allows. kLocal: the memory is only read (sent from) or written by this
// process; a peer's write naming its key is refused. kRemoteWrite: peers that hold the key may
// write into it (receive windows, KV pools, one-sided write targets).
enum class MemoryAccess : std::uint8_t { kLocal = 0, kRemoteWrite = 1 };

// Capability flags (Provider::capabilities()): only what the runtime reads.
enum ProviderCapability : std::uint32_t {
  // A registration names a virtual address range, not the pages behind it: every transfer reads
  // or writes whatever the range maps at that moment (the provider copies with the CPU, or the
  // NIC faults pages in on demand, verbs' IBV_ACCESS_ON_DEMAND). Memory freed and mapped again
  // at the same address is then safe to reach through an old registration, so a registration
  // can be cached past the buffer's lifetime. Without it a registration pins the pages it found
  // (ibv_reg_mr): after free() and a new malloc() at the same address, a transfer through the
  // old registration would move the old pages' bytes.
  kCapRegistrationFollowsMappings = 1u << 0,
};

// Who is connecting, carried in a rail's first frame and checked by the acceptor.
struct RailHello {
  static constexpr std::size_t kMaxDescription = 2048;
  Token token{};
  std::uint64_t src_incarnation = 0;  // the connecting endpoint
  std::uint64_t dst_incarnation = 0;  // the endpoint it means to reach
  std::uint32_t rail = 0;             // rail index between the two endpoints
  std::uint32_t epoch = 0;            // bumped each time a rail is re-established
  // The connecting endpoint's description (its blob without the token), so that an endpoint
  // accepts peers it has never heard of. At most kMaxDescription bytes.
  std::shared_ptr<const Bytes> description;
};

struct WriteRequest {
  const std::byte* src = nullptr;
  std::size_t length = 0;
  std::uint64_t remote_key = 0;              // the peer's key for the region, on this rail's NIC
  std::uint64_t remote_offset = 0;           // from the start of that region
  std::uint32_t imm = 0;                     // delivered to the receiver with the data
  std::uint64_t cookie = 0;                  // returned in the completion
  const DeviceMemory* src_device = nullptr;  // src is this device's memory (null: host memory)
};

// Upcalls from one rail.
class RailEvents {
 public:
  virtual ~RailEvents() = default;
  // The peer confirmed that the write's bytes are in its memory (or that it handled a control
  // message posted with this cookie). `receive_ns`: how long the bytes took to arrive at the
  // peer (from their first byte, or the previous write's last, to their last), when the provider
  // can tell (0 otherwise) — the link's own rate, untouched by how long the confirmation queued.
  virtual void on_write_confirmed(std::uint64_t cookie, std::uint64_t receive_ns) = 0;
  // The peer refused the write (e.g. outside a registered region); the rail stays up.
  virtual void on_write_refused(std::uint64_t cookie, const Status& why) = 0;
  // A peer's write landed in our memory.
  virtual void on_write_arrived(std::uint32_t imm, std::size_t length) = 0;
  // A control message (valid for the call only: copy what must outlive it).
  virtual void on_control(std::span<const std::byte> message) = 0;
  // The rail is closed (peer closed, socket error, malformed frame); no more events follow.
  virtual void on_rail_failed(const Status& why) = 0;
};

class Rail {
 public:
  virtual ~Rail() = default;
  // Begins delivering events; called once.
  virtual void start(RailEvents* events) = 0;
  // Queues a write; src must stay valid until it is confirmed, refused or the rail fails.
  // kNoResource: the rail's queue is full and nothing was taken (a provider that queues
  // without bound never answers it); post again once the rail confirmed something. Any other error:
  // the rail failed (and says so through on_rail_failed).
  virtual Status post_write(const WriteRequest& write) = 0;
  // Queues a control message; with a non-zero cookie the peer confirms it (on_write_confirmed)
  // once its handler has run. Shared: the caller keeps it for a replay, and nobody copies it.
  // kNoResource as for post_write.
  virtual Status post_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie) = 0;
  // The same, for a message that must not wait behind the data already queued on the rail (the
  // channel's failover messages); it may overtake earlier writes and control messages. Providers
  // that cannot reorder their queue send it in order.
  virtual Status post_urgent_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie) {
    return post_control(std::move(message), cookie);
  }
  // Closes the rail now, abortively: data still queued is discarded, not delivered later; no
  // event is delivered afterwards.
  virtual void fence() = 0;
  virtual const RailHello& hello() const = 0;
  // How long ago the peer's end of the connection last acknowledged anything, where the provider
  // can tell from the kernel's own acknowledgement state (TCP's last ACK received): a sign of
  // life that needs neither the peer's process nor a probe datagram to get through, and that a
  // full shaper queue delays but does not drop. nullopt: unknown.
  virtual std::optional<std::chrono::nanoseconds> since_acknowledged() const {
    return std::nullopt;
  }
  // "eth1 198.18.1.1:40122 -> 198.18.1.2:38111"
  virtual std::string describe() const = 0;
  // The peer's IPv4 address on this rail as the connection itself has it: where an accepted
  // connection came from, or where a connection this side opened arrived. The endpoint probes
  // this address, never one the peer describes itself (a peer could name any host).
  virtual std::string remote_address() const = 0;
};

struct ProviderCounters {
  std::uint64_t refused_writes = 0;       // writes outside registered memory, refused
  std::uint64_t dropped_connections = 0;  // wrong token, bad hello
};

class Provider {
 public:
  using AcceptHandler = std::function<bool(std::shared_ptr<Rail>)>;  // false: refuse it
  using ConnectHandler = std::function<void(Result<std::shared_ptr<Rail>>)>;

  virtual ~Provider() = default;
  virtual std::string_view name() const = 0;
  virtual std::uint32_t capabilities() const = 0;  // ProviderCapability flags
  // Whether this provider's traffic to `address` (a rail's remote_address()) stays on this host,
  // never reaching a NIC: the NIC's link state then says nothing about the rail, and the endpoint
  // probes it around the NIC. False where the traffic always crosses the NIC (verbs: the HCA
  // loops it back).
  virtual bool host_local(const std::string& /*address*/) const { return false; }
  virtual const std::vector<RailNic>& devices() const = 0;

  // `memory`: the region is that device's memory (a GPU's), reached only through its copies;
  // null: host memory. A provider that cannot move device memory refuses it, saying so.
  virtual Result<std::uint64_t> register_memory(std::size_t device, void* base, std::size_t length,
                                                MemoryAccess access,
                                                const DeviceMemory* memory) = 0;
  Result<std::uint64_t> register_memory(std::size_t device, void* base, std::size_t length,
                                        MemoryAccess access) {
    return register_memory(device, base, length, access, nullptr);
  }
  virtual Status deregister_memory(std::size_t device, std::uint64_t key) = 0;

  // What a peer needs to open a rail to `device` (published through the bootstrap).
  virtual Bytes endpoint(std::size_t device) const = 0;
  // Incoming rails whose hello carries the right token are handed to the handler (loop thread).
  virtual void set_accept_handler(AcceptHandler handler) = 0;
  // Opens a rail from local `device` to a peer's endpoint; the handler runs on the loop thread.
  virtual void connect(std::size_t device, const Bytes& remote_endpoint, const RailHello& hello,
                       std::chrono::milliseconds timeout, ConnectHandler handler) = 0;
  virtual ProviderCounters counters() const = 0;
};

// The tcp provider (Boost.Asio): one TCP connection per rail, bound to the NIC's address;
// one-sided writes emulated with a framed header and confirmed by the receiver's ack.
Result<std::unique_ptr<Provider>> make_tcp_provider(ProgressEngine& engine,
                                                    std::vector<RailNic> devices,
                                                    const Token& token);

// The verbs provider (rdma-core): the verbs devices R2CCL_NICS names (all of them when empty),
// one RC queue pair per rail; see verbs_provider.cc. Only in builds with libibverbs
// (R2CCL_HAVE_VERBS).
Result<std::unique_ptr<Provider>> make_verbs_provider(ProgressEngine& engine, const Topology& topo,
                                                      const Config& config, const Token& token);

}  // namespace r2ccl

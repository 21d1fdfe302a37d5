// The communicator: a group of ranks and the collectives among them, over the multi-rail fabric.
//
// Operations are blocking calls from one thread at a time (like an NCCL communicator used from
// one stream): every rank calls the same collectives in the same order. Each returns a Status;
// a failed operation leaves the communicator usable unless the fabric lost a peer (then
// async_error() says which). Bad arguments are refused before any byte moves.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "r2ccl/coll/degraded.h"
#include "r2ccl/coll/plan.h"
#include "r2ccl/coll/reg_cache.h"
#include "r2ccl/coll/types.h"
#include "r2ccl/runtime/fabric.h"

namespace r2ccl::coll {

class Communicator {
 public:
  // From the launch environment (R2CCL_RANK / R2CCL_NRANKS / R2CCL_BOOTSTRAP, or mpirun's).
  static Result<std::unique_ptr<Communicator>> from_env();
  // From a unique id created by rank 0 (UniqueId::create) and handed to every rank.
  static Result<std::unique_ptr<Communicator>> from_unique_id(const UniqueId& id, int rank,
                                                              int nranks);
  static Result<std::unique_ptr<Communicator>> create(const Config& config,
                                                      const BootstrapOptions& boot);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return fabric_->rank(); }
  int size() const { return fabric_->nranks(); }
  Fabric& fabric() { return *fabric_; }
  const Config& config() const { return fabric_->config(); }

  // Collectives. `count` is in elements: all-gather's per-rank send count, reduce-scatter's
  // per-rank receive count. In place when send == recv (all-gather: send == recv + rank*count;
  // reduce-scatter: recv == send + rank*count). Broadcast reads `send` only at the root; reduce
  // writes `recv` only at the root (other ranks may pass null).
  Status all_reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op);
  Status all_gather(const void* send, void* recv, std::size_t count, DataType type);
  Status reduce_scatter(const void* send, void* recv, std::size_t count, DataType type, RedOp op);
  Status broadcast(const void* send, void* recv, std::size_t count, DataType type, int root);
  Status reduce(const void* send, void* recv, std::size_t count, DataType type, RedOp op, int root);
  Status barrier();

  // Point to point, matched in order per pair. Outside a group each call blocks until done;
  // between group_start() and group_end() they are queued and group_end() runs them all at once
  // (so a rank can send to and receive from its neighbours without ordering them).
  Status send(const void* buf, std::size_t count, DataType type, int peer);
  Status recv(void* buf, std::size_t count, DataType type, int peer);
  Status group_start();
  Status group_end();

  // Ranks with the same color form a new communicator, ordered by (key, old rank); a negative
  // color joins none (the result is null). Every rank of this communicator must call it.
  Result<std::unique_ptr<Communicator>> split(int color, int key);

  // Buffers used again and again (NCCL's ncclCommRegister): registered once on every rail, so
  // that an operation whose buffers lie inside one skips registering them (a system call and
  // pinning per NIC under verbs). Peers may write into it (it can be received into). The buffer
  // must stay allocated until deregister_buffer; only this rank's calls use it.
  using BufferHandle = std::uint64_t;
  Result<BufferHandle> register_buffer(void* base, std::size_t bytes);
  Status deregister_buffer(BufferHandle handle);

  // Other buffers above the staging size (64 KiB) keep their registrations for later operations
  // in the registration cache (coll/reg_cache.h; R2CCL_REG_CACHE, R2CCL_REG_CACHE_BYTES) where
  // the provider's registrations follow the address space's mappings (tcp): a buffer freed and
  // allocated again is then reached as it is now. Where they pin pages (verbs), operations
  // register their buffers for themselves alone unless R2CCL_REG_CACHE=on, with which the
  // application must call invalidate_cache (or deregister_buffer) before it frees or unmaps
  // memory it passed to an operation. Any thread; an operation in flight keeps what it uses
  // registered until it ends. Returns how many cached registrations it dropped.
  std::size_t invalidate_cache(const void* base, std::size_t bytes);
  // The cache (its statistics, for tests and benchmarks); null where the communicator has none.
  const RegistrationCache* registration_cache() const { return reg_cache_.get(); }

  // Fails what is in flight and everything after with an error; the object stays safe to destroy.
  // Any thread may call it (a watchdog's), also while a collective blocks.
  void abort();
  // The first asynchronous error (a peer left, no rail survived, abort()); OK while none.
  Status async_error() const;

  // The algorithm the last collective ran (for benchmarks and logs).
  Algo last_algo() const { return last_algo_; }

  // Degraded mode (R2CCL_DEGRADED_ALGO): what this rank tells the others before a large
  // all-reduce, and what they all agreed on last.
  struct LinkEstimate {
    double bandwidth = 0;     // bytes per second over all its usable rails
    std::uint64_t rails = 0;  // its usable rails (bit i: rail i)
    bool operator==(const LinkEstimate&) const = default;
  };
  // This rank's estimate from its rails: those up to some peer count fully, those the channel
  // found degraded at their weight against their siblings (in steps of 1/32), each at its NIC's
  // line rate (sysfs; 10 Gbit/s where none is known). A rank slow on every rail alike (shaped)
  // is seen by the timed probe of the agreement (R2CCL_DEGRADED_PROBE_BYTES), not here.
  LinkEstimate measure_links() const;
  // Where the estimate comes from instead (an embedder that knows its NICs better; tests). Call
  // it before the collectives, from the thread that runs them.
  void set_link_source(std::function<LinkEstimate()> source) { link_source_ = std::move(source); }
  // The table the ranks agreed on before the last large all-reduce (empty before any).
  const Network& agreed_network() const { return agreed_; }
  // How many times the ranks have agreed (the first large all-reduce, then after some rank's
  // links changed).
  std::uint64_t agreements() const { return agreements_; }

 private:
  explicit Communicator(std::unique_ptr<Fabric> fabric);
  struct Buffers {
    const void* send = nullptr;
    void* recv = nullptr;
  };
  Status validate(const CollDesc& d, const Buffers& b) const;
  Status run(const CollDesc& d, Buffers b);
  Status check_agreement(const CollDesc& d, Algo algo);
  // The algorithm for `d` (R2CCL_ALGO's, or auto's choice for this size and transport).
  Algo auto_algo(const CollDesc& d) const;
  // Whether `d` first agrees on the ranks' bandwidths (a large all-reduce, degraded mode on).
  bool agrees(const CollDesc& d) const;
  // The exchange of every rank's LinkEstimate: the agreed table (bandwidths quantised alike on
  // every rank, the latency from the last exchanges' duration).
  Result<Network> agree();
  // Every rank's `mine` (the same size on every rank), in rank order: a direct all-gather.
  Result<std::vector<std::byte>> exchange(const Bytes& mine);
  // The algorithm for an all-reduce on the agreed table.
  Algo degraded_algo(const CollDesc& d) const;
  // `what` names the operation in an error's context (built only on error).
  // `gossip`: the plan carries every rank's link generation (add_gossip); this rank's goes out
  // and everyone's comes back into gossip_.
  struct Gossip {
    std::size_t at = 0;  // scratch offset of the p generations
  };
  Status execute(const Plan& plan, const CollDesc& d, const Buffers& b,
                 const std::function<std::string()>& what, const Gossip* gossip = nullptr);
  // Adds the generation exchange to the first step of `plan` (8 bytes to and from every rank).
  Gossip add_gossip(Plan& plan) const;
  // The timed probe of the agreement: `bytes` to the ranks 1 and 2 ahead, from those behind; the
  // faster of the two rounds, in bytes per second (0 when it is off or failed).
  Result<double> probe(std::size_t bytes);
  // Operations whose buffers are at most this large run in the scratch region (staged).
  static constexpr std::size_t kStageLimit = 64 * 1024;
  Result<RegionPtr> scratch(std::size_t bytes);
  struct P2p {
    bool is_send;
    void* buf;
    std::size_t bytes;
    int peer;
  };
  Status run_p2p(const std::vector<P2p>& ops);
  Status check_p2p(const void* buf, std::size_t count, DataType type, int peer,
                   const char* what) const;
  LatencyHistogram& duration(CollOp op, Algo algo);

  std::unique_ptr<Fabric> fabric_;
  // After fabric_: it deregisters through it when destroyed.
  static constexpr std::size_t kRegCacheEntries = 64;
  std::unique_ptr<RegistrationCache> reg_cache_;
  Algo requested_algo_ = Algo::kAuto;
  Algo last_algo_ = Algo::kAuto;
  std::uint64_t epoch_ = 0;   // collectives called so far: each runs in its own message epoch
  std::uint64_t op_seq_ = 0;  // collectives run so far (in the agreement header)
  std::vector<std::byte> scratch_;
  RegionPtr scratch_region_;
  int group_depth_ = 0;
  std::vector<P2p> group_;
  std::atomic<bool> aborted_{false};
  // register_buffer's regions, by start address.
  mutable std::mutex buffers_mutex_;
  std::map<const std::byte*, RegionPtr> buffers_;
  // The registered buffer holding [p, p + bytes), with p's offset in it; null when none does.
  std::pair<RegionPtr, std::size_t> registered(const void* p, std::size_t bytes) const;
  // An operation's registrations: the registered buffers, then the cache, then its own.
  struct Registered;
  std::map<std::pair<CollOp, Algo>, LatencyHistogram*> durations_;
  // The plan of the last collective: the next one is usually the same operation (a serving
  // loop, a benchmark), and building a plan costs as much as a small message's round trip.
  struct LastPlan {
    bool valid = false;
    CollDesc desc;
    Algo requested = Algo::kAuto;
    Algo algo = Algo::kAuto;
    Network net;
    Plan plan;
    bool gossip = false;
    Gossip where;
  } last_plan_;
  Network agreed_;
  double exchange_s_ = 0;  // how long this rank's last agreement exchange took
  // Agreement only when some rank's links changed: each rank counts the changes of its own
  // estimate (link_generation_), every large all-reduce carries every rank's count to every
  // other, and a count that differs from the one agreed on makes the next large all-reduce
  // agree first. Every rank sees the same counts, so every rank decides alike.
  std::optional<LinkEstimate> last_estimate_;
  std::uint64_t link_generation_ = 0;
  bool agreement_due_ = true;
  std::vector<std::uint64_t> agreed_generations_, gossip_;
  std::uint64_t agreements_ = 0;
  // Each rail's line rate (bytes per second), read once.
  static constexpr double kNominalRailBps = 1.25e9;
  std::vector<double> line_bps_;
  std::function<LinkEstimate()> link_source_;
};

}  // namespace r2ccl::coll

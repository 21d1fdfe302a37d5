// A provider without sockets, for unit tests of the multi-rail channel: rails are in-memory links
// whose every delivery (a write, a control message, a confirmation, a reset) is an event in one
// queue that the test runs step by step. Faults are scripted per link: black holes, lost
// confirmations, duplicated control messages, held (delayed, then released out of order) events,
// resets, and NICs that refuse connections.
//
// Single-threaded: everything runs on the test's thread, in FakeNetwork::step()/run().
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/runtime/provider/provider.h"

namespace r2ccl::testing {

class FakeProvider;

// What the test can do to one rail connection (both directions).
struct LinkScript {
  bool black_hole = false;          // nothing is delivered (dropped silently)
  bool drop_confirmations = false;  // writes and control messages land, their confirmations do not
  bool duplicate_control = false;   // every control message is delivered twice
  bool hold = false;                // deliveries wait in `held` until release()
  // Back-pressure: at most this many writes per direction wait for delivery; a further post is
  // refused with kNoResource (0: no limit).
  std::size_t queue_limit = 0;
};

class FakeNetwork {
 public:
  struct Link;
  using Event = std::function<void()>;

  // Runs the next queued event; false when none is left.
  bool step();
  // Runs events until none is left or `max` have run; returns how many ran.
  std::size_t run(std::size_t max = 1'000'000);
  std::size_t pending() const { return queue_.size(); }
  std::size_t refused_posts = 0;  // posts refused for back-pressure (LinkScript::queue_limit)

  // Every connection opened on rail `rail` (the same device index on both providers).
  std::vector<std::shared_ptr<Link>> links(std::uint32_t rail) const;
  // Scripts every present and future link of rail `rail`.
  LinkScript& script(std::uint32_t rail) { return scripts_[rail]; }
  // Held events of rail `rail` go back into the queue, newest first (so that they arrive out of
  // the order they were sent in), and holding stops.
  void release(std::uint32_t rail);
  // The rail's connections are reset: both ends get on_rail_failed.
  void reset(std::uint32_t rail);
  // Connections to or from this rail are refused until allowed again.
  void refuse_connections(std::uint32_t rail, bool refuse) { refused_[rail] = refuse; }

  // Internal (FakeProvider / FakeRail).
  void post(const std::shared_ptr<Link>& link, Event e);
  void register_provider(FakeProvider* p);
  FakeProvider* provider(std::uint32_t id) const;
  std::shared_ptr<Link> open_link(std::uint32_t rail);
  bool refused(std::uint32_t rail) const;

 private:
  std::deque<Event> queue_;
  std::map<std::uint32_t, LinkScript> scripts_;
  std::map<std::uint32_t, std::vector<std::pair<std::weak_ptr<Link>, Event>>> held_;
  std::map<std::uint32_t, bool> refused_;
  std::vector<FakeProvider*> providers_;
  std::vector<std::shared_ptr<Link>> links_;
};

class FakeRail;

struct FakeNetwork::Link {
  std::uint32_t rail = 0;
  bool closed = false;  // fenced or reset: nothing more is delivered
  FakeRail* ends[2] = {nullptr, nullptr};
  std::size_t queued_writes[2] = {0, 0};  // posted by side i, not yet delivered
};

class FakeRail final : public Rail {
 public:
  // `remote_address`: the other end's NIC address.
  FakeRail(FakeNetwork& net, std::shared_ptr<FakeNetwork::Link> link, int side, FakeProvider& owner,
           RailHello hello, std::string remote_address);
  ~FakeRail() override;
  void start(RailEvents* events) override;
  Status post_write(const WriteRequest& write) override;
  Status post_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie) override;
  void fence() override;
  const RailHello& hello() const override { return hello_; }
  std::string describe() const override;
  std::string remote_address() const override { return remote_address_; }

  // Internal.
  RailEvents* events() const { return events_; }
  FakeProvider& owner() { return owner_; }
  void fail(const std::string& why);

 private:
  FakeRail* peer() const;
  void confirm(std::uint64_t cookie);

  FakeNetwork& net_;
  std::shared_ptr<FakeNetwork::Link> link_;
  int side_;
  FakeProvider& owner_;
  RailHello hello_;
  std::string remote_address_;
  RailEvents* events_ = nullptr;
  bool failed_ = false;
};

class FakeProvider final : public Provider {
 public:
  FakeProvider(FakeNetwork& net, std::uint32_t id, std::size_t rails);
  std::string_view name() const override { return "fake"; }
  std::uint32_t capabilities() const override {
    return kCapRegistrationFollowsMappings;  // writes are memcpy at the time
  }
  const std::vector<RailNic>& devices() const override { return devices_; }
  Result<std::uint64_t> register_memory(std::size_t device, void* base, std::size_t length,
                                        MemoryAccess access, const DeviceMemory* memory) override;
  Status deregister_memory(std::size_t device, std::uint64_t key) override;
  Bytes endpoint(std::size_t device) const override;
  void set_accept_handler(AcceptHandler handler) override { accept_ = std::move(handler); }
  void connect(std::size_t device, const Bytes& remote_endpoint, const RailHello& hello,
               std::chrono::milliseconds timeout, ConnectHandler handler) override;
  ProviderCounters counters() const override { return counters_; }

  // Internal: where a peer's write lands; refused (nullptr) outside a registered region.
  // Where a write lands, and whose memory that is (null: host); null where it may not land.
  std::byte* target(std::uint64_t key, std::uint64_t offset, std::size_t length,
                    const DeviceMemory*& memory);
  bool accept(std::shared_ptr<Rail> rail) { return accept_ && accept_(std::move(rail)); }
  std::uint32_t id() const { return id_; }
  ProviderCounters counters_;

 private:
  struct Registration {
    std::byte* base = nullptr;
    std::size_t length = 0;
    bool remote_write = false;
    const DeviceMemory* memory = nullptr;
  };
  FakeNetwork& net_;
  std::uint32_t id_;
  std::vector<RailNic> devices_;
  std::map<std::uint64_t, Registration> regions_;
  std::uint64_t next_key_ = 1;
  AcceptHandler accept_;
};

}  // namespace r2ccl::testing

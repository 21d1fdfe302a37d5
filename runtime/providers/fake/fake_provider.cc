#include "fake/fake_provider.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace r2ccl::testing {

// ---------------------------------------------------------------------------------------------
// Network

bool FakeNetwork::step() {
  if (queue_.empty()) return false;
  Event e = std::move(queue_.front());
  queue_.pop_front();
  e();
  return true;
}

std::size_t FakeNetwork::run(std::size_t max) {
  std::size_t n = 0;
  while (n < max && step())
    ++n;
  return n;
}

void FakeNetwork::post(const std::shared_ptr<Link>& link, Event e) {
  if (!link) {  // not on a link (connection set-up, resets): always delivered
    queue_.push_back(std::move(e));
    return;
  }
  const LinkScript& s = scripts_[link->rail];
  if (s.black_hole) return;
  std::weak_ptr<Link> weak = link;
  Event guarded = [weak, e = std::move(e)] {
    // A connection that was fenced or reset delivers nothing more (an abortive close).
    if (auto l = weak.lock(); l && !l->closed) e();
  };
  if (s.hold) {
    held_[link->rail].emplace_back(link, std::move(guarded));
    return;
  }
  queue_.push_back(std::move(guarded));
}

void FakeNetwork::release(std::uint32_t rail) {
  scripts_[rail].hold = false;
  auto held = std::move(held_[rail]);
  held_.erase(rail);
  for (auto it = held.rbegin(); it != held.rend(); ++it)
    queue_.push_back(std::move(it->second));
}

std::vector<std::shared_ptr<FakeNetwork::Link>> FakeNetwork::links(std::uint32_t rail) const {
  std::vector<std::shared_ptr<Link>> out;
  for (const auto& l : links_)
    if (l->rail == rail) out.push_back(l);
  return out;
}

void FakeNetwork::reset(std::uint32_t rail) {
  for (const auto& l : links(rail)) {
    if (l->closed) continue;
    l->closed = true;
    for (int side = 0; side < 2; ++side)
      post(nullptr, [l, side] {
        if (FakeRail* end = l->ends[side]) end->fail("connection reset (scripted)");
      });
  }
}

void FakeNetwork::register_provider(FakeProvider* p) {
  providers_.push_back(p);
}

FakeProvider* FakeNetwork::provider(std::uint32_t id) const {
  for (auto* p : providers_)
    if (p->id() == id) return p;
  return nullptr;
}

std::shared_ptr<FakeNetwork::Link> FakeNetwork::open_link(std::uint32_t rail) {
  auto l = std::make_shared<Link>();
  l->rail = rail;
  links_.push_back(l);
  return l;
}

bool FakeNetwork::refused(std::uint32_t rail) const {
  auto it = refused_.find(rail);
  return it != refused_.end() && it->second;
}

// ---------------------------------------------------------------------------------------------
// Rail

FakeRail::FakeRail(FakeNetwork& net, std::shared_ptr<FakeNetwork::Link> link, int side,
                   FakeProvider& owner, RailHello hello, std::string remote_address)
    : net_(net),
      link_(std::move(link)),
      side_(side),
      owner_(owner),
      hello_(hello),
      remote_address_(std::move(remote_address)) {
  link_->ends[side_] = this;
}

FakeRail::~FakeRail() {
  link_->ends[side_] = nullptr;
  link_->closed = true;
}

void FakeRail::start(RailEvents* events) {
  events_ = events;
}

FakeRail* FakeRail::peer() const {
  return link_->ends[1 - side_];
}

void FakeRail::fail(const std::string& why) {
  if (failed_) return;
  failed_ = true;
  link_->closed = true;
  if (events_) events_->on_rail_failed({ErrorCode::kNetwork, why});
}

void FakeRail::confirm(std::uint64_t cookie) {
  if (net_.script(link_->rail).drop_confirmations) return;
  auto link = link_;
  const int side = side_;
  net_.post(link, [link, side, cookie] {
    FakeRail* me = link->ends[side];
    if (me && !me->failed_ && me->events_) me->events_->on_write_confirmed(cookie, 0);
  });
}

Status FakeRail::post_write(const WriteRequest& w) {
  if (failed_) return {ErrorCode::kNetwork, "the rail is closed"};
  const std::size_t limit = net_.script(link_->rail).queue_limit;
  if (limit != 0 && link_->queued_writes[side_] >= limit) {
    ++net_.refused_posts;
    return {ErrorCode::kNoResource, "the fake rail's queue is full"};
  }
  auto link = link_;
  const int side = side_;
  ++link->queued_writes[side];
  net_.post(link, [link, side, w] {
    --link->queued_writes[side];
    FakeRail* from = link->ends[side];
    FakeRail* to = link->ends[1 - side];
    if (from == nullptr || to == nullptr || to->failed_ || to->events_ == nullptr) return;
    const DeviceMemory* memory = nullptr;
    std::byte* target = to->owner().target(w.remote_key, w.remote_offset, w.length, memory);
    if (target == nullptr) {
      ++to->owner().counters_.refused_writes;
      if (from->events_)
        from->events_->on_write_refused(w.cookie, {ErrorCode::kProtocol, "outside any region"});
      return;
    }
    // Through the host, as the tcp provider stages device memory.
    Bytes staged(w.length);
    Status copied = copy_to_host(w.src_device, staged.data(), w.src, w.length);
    if (copied) copied = copy_from_host(memory, target, staged.data(), w.length);
    if (!copied) {
      if (from->events_) from->events_->on_write_refused(w.cookie, copied);
      return;
    }
    to->events_->on_write_arrived(w.imm, w.length);
    from->confirm(w.cookie);
  });
  return Status::ok();
}

Status FakeRail::post_control(std::shared_ptr<const Bytes> message, std::uint64_t cookie) {
  if (failed_) return {ErrorCode::kNetwork, "the rail is closed"};
  auto link = link_;
  const int side = side_;
  const int copies = net_.script(link->rail).duplicate_control ? 2 : 1;
  for (int i = 0; i < copies; ++i)
    net_.post(link, [link, side, message, cookie] {
      FakeRail* from = link->ends[side];
      FakeRail* to = link->ends[1 - side];
      if (from == nullptr || to == nullptr || to->failed_ || to->events_ == nullptr) return;
      to->events_->on_control(*message);
      if (cookie != 0) from->confirm(cookie);
    });
  return Status::ok();
}

void FakeRail::fence() {
  if (failed_) return;
  failed_ = true;
  events_ = nullptr;  // no event after a fence
  if (link_->closed) return;
  link_->closed = true;
  auto link = link_;
  const int other = 1 - side_;
  net_.post(nullptr, [link, other] {
    if (FakeRail* end = link->ends[other]) end->fail("connection reset by peer");
  });
}

std::string FakeRail::describe() const {
  return fmt::format("fake rail {} (provider {}, side {})", link_->rail, owner_.id(), side_);
}

// ---------------------------------------------------------------------------------------------
// Provider

FakeProvider::FakeProvider(FakeNetwork& net, std::uint32_t id, std::size_t rails)
    : net_(net), id_(id) {
  for (std::size_t i = 0; i < rails; ++i) {
    const std::string name = fmt::format("fake{}", i);
    devices_.push_back({name, fmt::format("10.{}.{}.1", id, i), -1, "", name});
  }
  net_.register_provider(this);
}

Result<std::uint64_t> FakeProvider::register_memory(std::size_t device, void* base,
                                                    std::size_t length, MemoryAccess access,
                                                    const DeviceMemory* memory) {
  if (device >= devices_.size()) return Status(ErrorCode::kInvalidArgument, "no such device");
  const std::uint64_t key = (next_key_++ << 8) | device;
  regions_[key] = {static_cast<std::byte*>(base), length, access == MemoryAccess::kRemoteWrite,
                   memory};
  return key;
}

Status FakeProvider::deregister_memory(std::size_t, std::uint64_t key) {
  return regions_.erase(key) != 0 ? Status::ok()
                                  : Status(ErrorCode::kInvalidArgument, "unknown key");
}

Bytes FakeProvider::endpoint(std::size_t device) const {
  return ByteWriter().u32(id_).u32(static_cast<std::uint32_t>(device)).take();
}

std::byte* FakeProvider::target(std::uint64_t key, std::uint64_t offset, std::size_t length,
                                const DeviceMemory*& memory) {
  auto it = regions_.find(key);
  if (it == regions_.end() || !it->second.remote_write || offset > it->second.length ||
      length > it->second.length - offset)
    return nullptr;
  memory = it->second.memory;
  return it->second.base + offset;
}

void FakeProvider::connect(std::size_t device, const Bytes& remote_endpoint, const RailHello& hello,
                           std::chrono::milliseconds, ConnectHandler handler) {
  ByteReader r(remote_endpoint);
  const auto id = r.u32();
  const auto remote_device = r.u32();
  net_.post(nullptr, [this, device, id, remote_device, hello, handler = std::move(handler)] {
    FakeProvider* remote = net_.provider(id);
    const auto rail = static_cast<std::uint32_t>(device);
    if (remote == nullptr || remote_device != device || net_.refused(rail)) {
      handler(Status(ErrorCode::kNetwork, fmt::format("fake{}: connection refused", device)));
      return;
    }
    auto link = net_.open_link(rail);
    auto local =
        std::make_shared<FakeRail>(net_, link, 0, *this, hello, remote->devices()[device].address);
    auto accepted =
        std::make_shared<FakeRail>(net_, link, 1, *remote, hello, devices_[device].address);
    if (!remote->accept(accepted)) {
      handler(
          Status(ErrorCode::kNetwork, fmt::format("fake{}: the peer refused the rail", device)));
      return;
    }
    handler(std::shared_ptr<Rail>(std::move(local)));
  });
}

}  // namespace r2ccl::testing

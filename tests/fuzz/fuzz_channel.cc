// The multi-rail channel's protocol, as a peer drives it: control messages (clear-to-send,
// request-to-send, eager data, user messages, aborts, failover fences, replay queries and
// answers, goodbyes), write arrivals with any immediate, and out-of-band messages, mixed with the
// real traffic of a send and a receive between two channels over the fake provider (no sockets,
// no threads). The input is a list of records:
//   u8 kind | u8 rail | u16 length | length bytes
// kind 0: a control message arrives at rank 1 on the rail; 1: a write arrives (u32 immediate
// from the bytes, the length from the next u32); 2: an out-of-band message arrives; 3: the network
// runs up to 64 events; 4: rank 0 posts a send and rank 1 a receive of the record's length; 5:
// both channels tick; 6: rank 0 sends a user message.
// The channel may refuse anything, fail operations or treat the peer as gone; it must not crash.
// An input that injects nothing (only sends, receives, messages, network steps and ticks) must
// end with every transfer complete and every byte as sent.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "channel/channel.h"
#include "fake/fake_provider.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/memory.h"

using namespace r2ccl;
using testing::FakeNetwork;
using testing::FakeProvider;
using Clock = std::chrono::steady_clock;

namespace {
constexpr std::size_t kRails = 2;

struct Rank {
  Rank(FakeNetwork& net, int me, const Config& c)
      : config(c), provider(net, static_cast<std::uint32_t>(me), kRails), registry(provider) {}
  Config config;
  RailEventLog events;
  FakeProvider provider;
  MemoryRegistry registry;
  std::unique_ptr<Channel> channel;
};

struct Transfer {
  std::vector<std::byte> src, dst;
  RegionPtr src_region, dst_region;
  OpPtr send = std::make_shared<Op>();
  OpPtr recv = std::make_shared<Op>();
};

Config fuzz_config() {
  Config c;
  c.chunk_size = 4096;
  c.probe_timeout = std::chrono::milliseconds(600000);
  c.stall_timeout = std::chrono::milliseconds(600000);
  c.holddown = std::chrono::milliseconds(0);
  c.readmit_probes = 1;
  return c;
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  set_log_level(LogLevel::kError);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FakeNetwork net;
  const Config config = fuzz_config();
  std::unique_ptr<Rank> ranks[2];
  for (int me = 0; me < 2; ++me)
    ranks[me] = std::make_unique<Rank>(net, me, config);
  for (int me = 0; me < 2; ++me) {
    Rank& r = *ranks[me];
    Rank& peer = *ranks[1 - me];
    ChannelContext ctx;
    ctx.config = &r.config;
    ctx.incarnation = 100 + static_cast<std::uint64_t>(me);
    ctx.self_label = me == 0 ? "rank 0" : "rank 1";
    ctx.provider = &r.provider;
    ctx.out_of_band = nullptr;
    ctx.events = &r.events;
    ctx.on_fatal = [](const Status&) {};
    ctx.on_user_message = [](int, std::span<const std::byte>) {};
    std::vector<Channel::RemoteRail> remote;
    for (std::size_t i = 0; i < kRails; ++i)
      remote.push_back({peer.provider.devices()[i].name, peer.provider.endpoint(i)});
    Channel::PeerIdentity id;
    id.id = 1 - me;
    id.label = me == 0 ? "rank 1" : "rank 0";
    id.incarnation = 100 + static_cast<std::uint64_t>(1 - me);
    id.connector = me == 0;
    r.channel = std::make_unique<Channel>(ctx, id, r.provider.devices(), remote);
    Channel* ch = r.channel.get();
    r.provider.set_accept_handler(
        [ch](std::shared_ptr<Rail> rail) { return ch->attach(rail->hello().rail, rail); });
  }
  ranks[0]->channel->connect_all_rails();
  net.run(10000);

  std::vector<std::unique_ptr<Transfer>> transfers;
  bool injected = false;
  std::size_t pos = 0;
  for (int records = 0; records < 256 && pos + 4 <= size; ++records) {
    const std::uint8_t kind = data[pos];
    const std::uint32_t rail = data[pos + 1] % kRails;
    std::size_t len = static_cast<std::size_t>(data[pos + 2]) | (std::size_t{data[pos + 3]} << 8);
    pos += 4;
    len = std::min(len, size - pos);
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data + pos), len);
    pos += len;
    switch (kind % 7) {
      case 0:
      case 1: {
        injected = true;
        // As rank 0's rail would deliver it to rank 1.
        std::shared_ptr<FakeNetwork::Link> link;
        for (const auto& l : net.links(rail))
          if (!l->closed) link = l;
        if (!link || !link->ends[1] || !link->ends[1]->events()) break;
        RailEvents* ev = link->ends[1]->events();
        if (kind % 7 == 0) {
          ev->on_control(bytes);
        } else {
          ByteReader r(bytes);
          const auto imm = r.u32();
          const auto length = r.u32();
          ev->on_write_arrived(imm, length);
        }
        break;
      }
      case 2:
        injected = true;
        ranks[1]->channel->on_control_path(Bytes(bytes.begin(), bytes.end()));
        break;
      case 3:
        net.run(64);
        break;
      case 4: {
        if (transfers.size() >= 8) break;
        auto t = std::make_unique<Transfer>();
        const std::size_t n = len + 1;
        t->src.resize(n);
        for (std::size_t i = 0; i < n; ++i)
          t->src[i] = static_cast<std::byte>(i * 31 + transfers.size());
        t->dst.assign(n, std::byte{0xEE});
        t->src_region = *ranks[0]->registry.register_region(t->src.data(), n);
        t->dst_region = *ranks[1]->registry.register_region(t->dst.data(), n);
        const auto deadline = Clock::now() + std::chrono::minutes(10);
        ranks[1]->channel->post_recv(t->recv, t->dst_region, 0, n, deadline);
        ranks[0]->channel->post_send(t->send, t->src_region, 0, n, deadline);
        transfers.push_back(std::move(t));
        break;
      }
      case 5:
        for (auto& r : ranks)
          r->channel->tick(Clock::now());
        break;
      case 6:
        ranks[0]->channel->send_user_message(0, bytes.first(std::min<std::size_t>(len, 4096)));
        break;
    }
  }
  for (int round = 0; round < 100; ++round) {
    net.run(100000);
    for (auto& r : ranks)
      r->channel->tick(Clock::now());
  }
  if (!injected)
    for (const auto& t : transfers)
      if (!t->send->done() || !t->recv->done() || !t->send->status().is_ok() ||
          !t->recv->status().is_ok() || t->src != t->dst)
        __builtin_trap();
  for (auto& r : ranks)
    r->channel->shutdown();
  net.run(100000);
  return 0;
}

// The KV engine between two ranks (threads of this process) over four loopback rails each.
#include "r2ccl/kv/engine.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "../unit/standin_device_memory.h"
#include "../unit/test_util.h"
#include "r2ccl/runtime/provider/progress.h"

namespace r2ccl::kv {
namespace {

using namespace std::chrono_literals;

struct Side {
  std::unique_ptr<Fabric> fabric;
  std::unique_ptr<KvEngine> engine;
  std::vector<std::byte> memory;
  std::uint32_t pool = 0;
};

constexpr std::uint32_t kLayers = 4, kBlocks = 64, kParts = 2;
constexpr std::uint64_t kBlockBytes = 4096;

std::byte value_at(int side, std::uint32_t layer, std::uint32_t part, std::uint32_t block,
                   std::uint64_t i) {
  return static_cast<std::byte>((side * 131 + layer * 31 + part * 17 + block * 7 + i) & 0xff);
}

void fill(Side& s, int side) {
  const auto l = KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts);
  for (std::uint32_t layer = 0; layer < kLayers; ++layer)
    for (std::uint32_t part = 0; part < kParts; ++part)
      for (std::uint32_t b = 0; b < kBlocks; ++b)
        for (std::uint64_t i = 0; i < kBlockBytes; ++i)
          s.memory[l.offset(layer, part, b) + i] = value_at(side, layer, part, b, i);
}

// Does rank 1's block `dst` of `layer` hold rank 0's block `src`?
bool holds(const Side& s1, std::uint32_t layer, std::uint32_t dst, std::uint32_t src) {
  const auto l = KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts);
  for (std::uint32_t part = 0; part < kParts; ++part)
    for (std::uint64_t i = 0; i < kBlockBytes; ++i)
      if (s1.memory[l.offset(layer, part, dst) + i] != value_at(0, layer, part, src, i))
        return false;
  return true;
}

std::vector<Side> make_pair_of_engines(std::map<std::string, std::string> extra = {}) {
  const auto port = test::free_port();
  std::vector<std::future<Result<std::unique_ptr<Fabric>>>> fs;
  for (int r = 0; r < 2; ++r)
    fs.push_back(std::async(std::launch::async, [=] {
      std::map<std::string, std::string> vars = extra;
      vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2,127.0.{0}.3,127.0.{0}.4", 50 + r);
      vars.emplace("R2CCL_CHUNK_SIZE", "64K");
      auto cfg = parse_config(test::env_of(vars));
      BootstrapOptions o{r, 2, HostPort{"127.0.0.1", port}, {}, 10s, ""};
      return Fabric::create(*cfg, o);
    }));
  std::vector<Side> sides(2);
  for (int r = 0; r < 2; ++r) {
    auto f = fs[static_cast<std::size_t>(r)].get();
    EXPECT_TRUE(f.is_ok()) << f.status().to_string();
    sides[static_cast<std::size_t>(r)].fabric = std::move(*f);
  }
  auto cfg = parse_config(test::env_of(extra));
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  auto opts = EngineOptions::from(*cfg);
  for (int r = 0; r < 2; ++r) {
    auto& s = sides[static_cast<std::size_t>(r)];
    s.engine = std::move(*KvEngine::create(*s.fabric, opts));
    s.memory.assign(kLayers * kParts * kBlocks * kBlockBytes, std::byte{0});
    if (r == 0) fill(s, 0);
    auto pool =
        s.engine->register_pool({std::span<std::byte>(s.memory)},
                                KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts));
    EXPECT_TRUE(pool.is_ok()) << pool.status().to_string();
    s.pool = *pool;
  }
  EXPECT_TRUE(sides[0].engine->accept_metadata(1, sides[1].engine->metadata()).is_ok());
  EXPECT_TRUE(sides[1].engine->accept_metadata(0, sides[0].engine->metadata()).is_ok());
  return sides;
}

Bytes text(const std::string& s) {
  return Bytes(reinterpret_cast<const std::byte*>(s.data()),
               reinterpret_cast<const std::byte*>(s.data()) + s.size());
}

TEST(KvEngine, PushLandsEveryBlockAndNotifiesOnceWithThePayload) {
  auto s = make_pair_of_engines();
  BlockSpan span{0, kLayers, {3, 4, 5, 10}, {20, 21, 22, 40}};
  ASSERT_TRUE(s[0].engine->submit(7, 1, 0, 0, {span}, text("token 42")).is_ok());
  auto st = s[0].engine->wait(7, 10s);
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kDone) << st->reason;
  EXPECT_EQ(st->bytes, 4 * kLayers * kParts * kBlockBytes);
  auto note = s[1].engine->wait_notification(0, 7, 10s);
  ASSERT_TRUE(note.is_ok()) << note.status().to_string();
  EXPECT_EQ(note->state, RequestState::kDone);
  EXPECT_EQ(note->payload, text("token 42"));
  for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(holds(s[1], layer, 20, 3));
    EXPECT_TRUE(holds(s[1], layer, 21, 4));
    EXPECT_TRUE(holds(s[1], layer, 22, 5));
    EXPECT_TRUE(holds(s[1], layer, 40, 10));
    EXPECT_EQ(s[1].memory[KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts)
                              .offset(layer, 0, 23)],
              std::byte{0});
  }
  EXPECT_TRUE(s[1].engine->poll_notifications().empty());  // exactly one
  EXPECT_EQ(s[0].engine->counters().done, 1u);
  // Published for the monitor.
  std::map<std::string, std::uint64_t> published;
  s[0].fabric->metrics().for_each(
      [&](const MetricRegistry::Counter& c) {
        std::string key = c.name;
        for (const auto& [k, v] : c.labels)
          key += "," + k + "=" + v;
        published[key] = c.value.load();
      },
      [&](const MetricRegistry::Histogram& h) {
        published[h.name + "_count"] = h.histogram.count();
      });
  EXPECT_EQ(published["r2ccl_kv_requests_total,rank=0,status=done"], 1u);
  EXPECT_EQ(published["r2ccl_kv_requests_total,rank=0,status=failed"], 0u);
  EXPECT_EQ(published["r2ccl_kv_transfer_bytes_total,rank=0"], st->bytes);
  EXPECT_EQ(published["r2ccl_kv_request_duration_seconds_count"], 1u);
}

// The agent model: two engines on endpoints that were never in a world. The prefill side loads
// the decode side's metadata (which carries its endpoint blob), connects, pushes, and
// disconnects; the decode side learns of the request from its notification.
TEST(KvEngine, EnginesOnEndpointsConnectByMetadataWithoutAWorld) {
  auto make = [](int host, const std::string& name) {
    std::map<std::string, std::string> vars;
    vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2,127.0.{0}.3,127.0.{0}.4", 60 + host);
    vars["R2CCL_CHUNK_SIZE"] = "64K";
    auto cfg = parse_config(test::env_of(vars));
    EXPECT_TRUE(cfg.is_ok());
    EndpointOptions o;
    o.name = name;
    return std::move(*Endpoint::create(*cfg, o));
  };
  auto prefill = make(0, "prefill");
  auto decode = make(1, "decode");
  std::vector<Side> s(2);
  auto pe = KvEngine::create(*prefill, EngineOptions{});
  auto de = KvEngine::create(*decode, EngineOptions{});
  ASSERT_TRUE(pe.is_ok() && de.is_ok());
  s[0].engine = std::move(*pe);
  s[1].engine = std::move(*de);
  for (int r = 0; r < 2; ++r) {
    auto& side = s[static_cast<std::size_t>(r)];
    side.memory.assign(kLayers * kParts * kBlocks * kBlockBytes, std::byte{0});
    if (r == 0) fill(side, 0);
    auto pool =
        side.engine->register_pool({std::span<std::byte>(side.memory)},
                                   KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts));
    ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  }
  auto peer = s[0].engine->load_remote(s[1].engine->metadata());
  ASSERT_TRUE(peer.is_ok()) << peer.status().to_string();
  BlockSpan span{0, kLayers, {1, 2, 9}, {30, 31, 32}};
  ASSERT_TRUE(s[0].engine->submit(5, *peer, 0, 0, {span}, text("first token")).is_ok());
  auto st = s[0].engine->wait(5, 10s);
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kDone) << st->reason;
  // The decode side never loaded the prefill side's metadata: it knows it as the peer that
  // connected to its endpoint.
  const auto peers = decode->peers();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].label,
            fmt::format("peer 'prefill' (incarnation {:016x})", prefill->incarnation()));
  auto note = s[1].engine->wait_notification(peers[0].id, 5, 10s);
  ASSERT_TRUE(note.is_ok()) << note.status().to_string();
  EXPECT_EQ(note->state, RequestState::kDone);
  EXPECT_EQ(note->payload, text("first token"));
  for (std::uint32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(holds(s[1], layer, 30, 1));
    EXPECT_TRUE(holds(s[1], layer, 31, 2));
    EXPECT_TRUE(holds(s[1], layer, 32, 9));
  }
  // Metadata of a peer given to the wrong id is refused, naming both.
  EXPECT_EQ(s[0].engine->accept_metadata(*peer, s[0].engine->metadata()).message(),
            fmt::format("this KV metadata is 'prefill' (this endpoint)'s, not peer 'decode' "
                        "(incarnation {:016x})'s",
                        decode->incarnation()));
  ASSERT_TRUE(s[0].engine->disconnect(*peer).is_ok());
  EXPECT_EQ(
      s[0].engine->submit(6, *peer, 0, 0, {span}).message(),
      fmt::format(
          "unknown peer {}: accept_metadata() or load_remote() its metadata before sending to it",
          *peer));
  s[0].engine.reset();
  s[1].engine.reset();
}

// A pool its owner unregistered takes no more writes, even from a peer that still holds the old
// metadata; metadata taken afterwards shows it as gone.
TEST(KvEngine, AnUnregisteredPoolTakesNoMoreWrites) {
  auto s = make_pair_of_engines();
  ASSERT_TRUE(s[1].engine->unregister_pool(0).is_ok());
  std::fill(s[1].memory.begin(), s[1].memory.end(), std::byte{0x77});  // reused by its owner
  BlockSpan span{0, kLayers, {1, 2}, {3, 4}};
  ASSERT_TRUE(s[0].engine->submit(9, 1, 0, 0, {span}).is_ok());
  auto st = s[0].engine->wait(9, 20s);
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kFailed);
  EXPECT_NE(st->reason.find("not registered"), std::string::npos) << st->reason;
  EXPECT_EQ(std::count(s[1].memory.begin(), s[1].memory.end(), std::byte{0x77}),
            static_cast<std::ptrdiff_t>(s[1].memory.size()));
  ASSERT_TRUE(s[0].engine->accept_metadata(1, s[1].engine->metadata()).is_ok());
  EXPECT_EQ(s[0].engine->submit(10, 1, 0, 0, {span}).message(),
            "rank 1's KV pool 0 was unregistered");
  EXPECT_EQ(s[1].engine->unregister_pool(0).message(),
            "unregister_pool: no KV pool 0 is registered");
  EXPECT_EQ(s[1].engine->submit(11, 0, 0, 0, {span}).message(), "local KV pool 0 was unregistered");
}

// An engine destroyed while its writes are in flight (review M6): the destructor waits for them
// (or their deadline), deregisters its pools, and completions that come later find nothing
// instead of freed memory (the sanitizer builds run this). The receiver gets every block of a
// request or a notification that names what is not valid, never a DONE with missing blocks.
TEST(KvEngine, DestroyedWithWritesInFlightEndsCleanly) {
  auto s = make_pair_of_engines();
  std::vector<std::uint32_t> all(kBlocks);
  for (std::uint32_t b = 0; b < kBlocks; ++b)
    all[b] = b;
  for (std::uint64_t id = 1; id <= 4; ++id)
    ASSERT_TRUE(s[0].engine->submit(id, 1, 0, 0, {BlockSpan{0, kLayers, all, all}}).is_ok());
  s[0].engine.reset();  // at once, with most of 8 MiB still in flight
  // Once the destructor returned, nothing of the sender's lands any more: its pools may be
  // freed and reused by their owner right away.
  const std::vector<std::byte> landed = s[1].memory;
  std::this_thread::sleep_for(1s);
  EXPECT_TRUE(s[1].memory == landed) << "bytes landed after the sender's engine was destroyed";
  // A request the receiver was told is DONE holds every byte.
  for (const auto& note : s[1].engine->poll_notifications()) {
    if (note.state != RequestState::kDone) continue;
    for (std::uint32_t layer = 0; layer < kLayers; ++layer)
      for (std::uint32_t b = 0; b < kBlocks; b += 9)
        EXPECT_TRUE(holds(s[1], layer, b, b)) << note.request << " " << layer << " " << b;
  }
}

TEST(KvEngine, LayerStreamingNotifiesOnlyAfterSeal) {
  auto s = make_pair_of_engines();
  ASSERT_TRUE(s[0].engine->begin(1, 1, 0, 0).is_ok());
  for (std::uint32_t layer = 0; layer < kLayers; ++layer)
    ASSERT_TRUE(s[0].engine->add(1, BlockSpan{layer, layer + 1, {0, 1, 2}, {5, 6, 7}}).is_ok());
  std::this_thread::sleep_for(200ms);  // every write has long landed
  EXPECT_EQ(s[0].engine->status(1)->state, RequestState::kInFlight);
  EXPECT_TRUE(s[1].engine->poll_notifications().empty());
  ASSERT_TRUE(s[0].engine->seal(1).is_ok());
  auto note = s[1].engine->wait_notification(0, 1, 10s);
  ASSERT_TRUE(note.is_ok());
  EXPECT_EQ(note->state, RequestState::kDone);
  for (std::uint32_t layer = 0; layer < kLayers; ++layer)
    EXPECT_TRUE(holds(s[1], layer, 6, 1));
  EXPECT_EQ(s[0].engine->add(1, BlockSpan{0, 1, {0}, {0}}).message(),
            "request 1 is already sealed (DONE)");
}

TEST(KvEngine, PullMovesThePeersBlocksHere) {
  auto s = make_pair_of_engines();
  ASSERT_TRUE(s[1].engine->pull(9, 0, 0, 0, {BlockSpan{1, 3, {60, 61}, {0, 1}}}).is_ok());
  auto st = s[1].engine->wait(9, 10s);
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->state, RequestState::kDone) << st->reason;
  EXPECT_TRUE(holds(s[1], 1, 0, 60));
  EXPECT_TRUE(holds(s[1], 2, 1, 61));
  EXPECT_FALSE(holds(s[1], 0, 0, 60));  // layer 0 was not asked for
}

// A KV notification as a peer's engine sends it (MsgType kNotify), with any state byte.
Bytes notification_message(std::uint64_t id, std::uint8_t state, const Bytes& payload = {}) {
  ByteWriter w;
  w.u8(1).u64(id).u8(state).str("").blob(payload).u32(0).u8(0);
  return w.take();
}

Status send_as_engine(Side& from, int to, Bytes message) {
  return from.fabric->endpoint().send_message(
      to, static_cast<std::uint8_t>(Fabric::Service::kKvTransfer), std::move(message));
}

// A pull that cannot be sent leaves nothing behind (review N-M3): its id is free again.
TEST(KvEngine, APullThatCannotBeSentLeavesNoRecord) {
  auto s = make_pair_of_engines();
  BlockSpan huge{0, 1, {}, {}};
  for (std::uint32_t i = 0; i < 9000; ++i) {
    huge.src_blocks.push_back(i % kBlocks);
    huge.dst_blocks.push_back(i % kBlocks);
  }
  EXPECT_EQ(s[1].engine->pull(12, 0, 0, 0, {huge}).message(),
            "pull 12: its block lists take 72033 bytes, more than 65536 in one request (split it)");
  EXPECT_EQ(s[1].engine->status(12).status().message(), "no request 12");
  ASSERT_TRUE(s[1].engine->pull(12, 0, 0, 0, {BlockSpan{0, kLayers, {5}, {6}}}).is_ok());
  auto st = s[1].engine->wait(12, 10s);
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kDone) << st->reason;
}

// A pull whose peer never answers (its engine is gone; its endpoint still takes messages) fails
// at the endpoint's deadline, naming the peer; this side is notified as if the peer had.
TEST(KvEngine, APullThePeerNeverAnswersFailsAtItsDeadline) {
  auto s = make_pair_of_engines({{"R2CCL_TIMEOUT", "1s"}});
  s[0].engine.reset();
  ASSERT_TRUE(s[1].engine->pull(9, 0, 0, 0, {BlockSpan{0, kLayers, {3, 4}, {1, 0}}}).is_ok());
  auto st = s[1].engine->wait(9, 30s);  // a hang bound
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kFailed);
  EXPECT_EQ(st->reason, "pull 9: rank 0 did not complete it within 1000ms (R2CCL_TIMEOUT)");
  EXPECT_EQ(st->invalid_blocks, (std::vector<std::uint32_t>{0, 1}));
  auto note = s[1].engine->wait_notification(0, 9, 10s);
  ASSERT_TRUE(note.is_ok()) << note.status().to_string();
  EXPECT_EQ(note->state, RequestState::kFailed);
  EXPECT_EQ(note->reason, st->reason);
  EXPECT_EQ(note->invalid_blocks, (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(s[1].engine->counters().failed, 1u);
}

// A pull whose peer leaves fails at once, long before its deadline, naming the peer and why.
TEST(KvEngine, APullOfAPeerThatLeavesFailsAtOnce) {
  auto make = [](int host, const std::string& name) {
    std::map<std::string, std::string> vars;
    vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2", 70 + host);
    vars["R2CCL_TIMEOUT"] = "120s";
    auto cfg = parse_config(test::env_of(vars));
    EXPECT_TRUE(cfg.is_ok());
    EndpointOptions o;
    o.name = name;
    return std::move(*Endpoint::create(*cfg, o));
  };
  auto prefill = make(0, "prefill");
  auto decode = make(1, "decode");
  auto pe = KvEngine::create(*prefill, EngineOptions{});
  auto de = KvEngine::create(*decode, EngineOptions{});
  ASSERT_TRUE(pe.is_ok() && de.is_ok());
  std::vector<Side> s(2);
  s[0].engine = std::move(*pe);
  s[1].engine = std::move(*de);
  for (auto& side : s) {
    side.memory.assign(kLayers * kParts * kBlocks * kBlockBytes, std::byte{0});
    ASSERT_TRUE(side.engine
                    ->register_pool({std::span<std::byte>(side.memory)},
                                    KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts))
                    .is_ok());
  }
  auto back = s[1].engine->load_remote(s[0].engine->metadata());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  const auto label = fmt::format("peer 'prefill' (incarnation {:016x})", prefill->incarnation());
  s[0].engine.reset();  // it will not answer
  ASSERT_TRUE(s[1].engine->pull(4, *back, 0, 0, {BlockSpan{0, kLayers, {1}, {2}}}).is_ok());
  prefill.reset();                      // says goodbye
  auto st = s[1].engine->wait(4, 60s);  // a hang bound, half the deadline
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kFailed);
  EXPECT_EQ(st->reason, fmt::format("pull 4: {} left: it disconnected", label));
  EXPECT_EQ(st->invalid_blocks, std::vector<std::uint32_t>{2});
  s[1].engine.reset();
}

// A pull can be cancelled: it ends CANCELLED here at once, and what the peer says of it later
// is ignored (no second notification, no change of state).
TEST(KvEngine, ACancelledPullEndsHereAndALateAnswerIsIgnored) {
  auto s = make_pair_of_engines();
  s[0].engine.reset();  // it will not answer; its endpoint stands in for it below
  ASSERT_TRUE(s[1].engine->pull(5, 0, 0, 0, {BlockSpan{0, kLayers, {3}, {7}}}).is_ok());
  ASSERT_TRUE(s[1].engine->cancel(5).is_ok());
  auto st = s[1].engine->status(5);
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->state, RequestState::kCancelled);
  EXPECT_EQ(st->reason,
            "pull 5: cancelled by this side (writes of rank 0 already in flight may still land in "
            "its blocks)");
  EXPECT_EQ(st->invalid_blocks, std::vector<std::uint32_t>{7});
  EXPECT_EQ(s[1].engine->cancel(5).message(),
            "request 5 already ended (CANCELLED); nothing to cancel");
  // A late DONE for it, then another notification: once the second is here, the first was
  // handled.
  const auto kDone = static_cast<std::uint8_t>(RequestState::kDone);
  ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(5, kDone)).is_ok());
  ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(77, kDone)).is_ok());
  ASSERT_TRUE(s[1].engine->wait_notification(0, 77, 10s).is_ok());
  EXPECT_EQ(s[1].engine->status(5)->state, RequestState::kCancelled);
  const auto notes = s[1].engine->poll_notifications();
  ASSERT_EQ(notes.size(), 1u);  // the one given when it was cancelled
  EXPECT_EQ(notes[0].request, 5u);
  EXPECT_EQ(notes[0].state, RequestState::kCancelled);
  EXPECT_EQ(notes[0].invalid_blocks, std::vector<std::uint32_t>{7});
  EXPECT_EQ(s[1].engine->counters().cancelled, 1u);
  EXPECT_EQ(s[1].engine->counters().done, 0u);
}

// A notification's state must be an end (DONE, FAILED, CANCELLED): another value is a protocol
// error and the notification is dropped, never handed on with a state cast from the byte.
TEST(KvEngine, ANotificationWhoseStateIsNotAnEndIsDropped) {
  auto s = make_pair_of_engines();
  ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(3, 1)).is_ok());  // IN_FLIGHT
  ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(4, 0)).is_ok());  // PENDING
  ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(6, 9)).is_ok());  // nothing
  ASSERT_TRUE(send_as_engine(
                  s[0], 1, notification_message(8, static_cast<std::uint8_t>(RequestState::kDone)))
                  .is_ok());
  ASSERT_TRUE(s[1].engine->wait_notification(0, 8, 10s).is_ok());
  EXPECT_TRUE(s[1].engine->poll_notifications().empty());
}

// Host memory registers, whether or not this process uses CUDA (the engine asks the CUDA
// driver only where the process loaded it; here it is not loaded).
TEST(KvEngine, HostMemoryIsRegistered) {
  auto s = make_pair_of_engines();
  const auto layout = KvLayout::layer_major(1, 4, 1024, 1);
  std::vector<std::byte> heap(4096);
  auto pool = s[0].engine->register_pool({std::span<std::byte>(heap)}, layout);
  ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
  EXPECT_EQ(*pool, 1u);
  EXPECT_TRUE(s[0].engine->unregister_pool(*pool).is_ok());
}

// Blocks added to a request are checked against the peer's pools as they are then (review C1):
// an accept_metadata() since begin() may have replaced them (fewer pools, other shapes) and a
// disconnect() forgot them. Refused with the reason, never indexed blindly.
TEST(KvEngine, BlocksAddedAfterThePeersPoolsChangedAreChecked) {
  auto s = make_pair_of_engines();
  auto& e = *s[0].engine;
  std::vector<std::byte> second(kLayers * kParts * kBlocks * kBlockBytes);
  ASSERT_TRUE(s[1].engine
                  ->register_pool({std::span<std::byte>(second)},
                                  KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts))
                  .is_ok());
  ASSERT_TRUE(e.accept_metadata(1, s[1].engine->metadata()).is_ok());
  ASSERT_TRUE(e.begin(1, 1, 0, 0).is_ok());
  ASSERT_TRUE(e.begin(2, 1, 0, 1).is_ok());
  // Rank 1's metadata again, now with one pool of two layers (another engine on its endpoint).
  std::vector<std::byte> other(2 * kParts * kBlocks * kBlockBytes);
  {
    auto replaced = KvEngine::create(*s[1].fabric, EngineOptions{});
    ASSERT_TRUE(replaced.is_ok());
    ASSERT_TRUE((*replaced)
                    ->register_pool({std::span<std::byte>(other)},
                                    KvLayout::layer_major(2, kBlocks, kBlockBytes, kParts))
                    .is_ok());
    ASSERT_TRUE(e.accept_metadata(1, (*replaced)->metadata()).is_ok());
  }
  const BlockSpan span{0, kLayers, {1}, {2}};
  EXPECT_EQ(
      e.add(1, span).message(),
      "request 1: KV pool 0 here and rank 1's pool 0 are incompatible: layers differ (4 here, "
      "2 there)");
  EXPECT_EQ(e.add(2, span).message(), "request 2: rank 1 has no KV pool 1 (it has 1)");
  ASSERT_TRUE(e.disconnect(1).is_ok());
  EXPECT_EQ(e.add(1, span).message(),
            "request 1: unknown peer 1: accept_metadata() or load_remote() its metadata before "
            "sending to it");
  s[1].engine.reset();  // before `second` goes away
}

// Device pools (stand-ins with different masks: see StandinDeviceMemory) over the tcp rails: a
// block goes out of the sender's device and into the receiver's through their copies, with the
// checksums of R2CCL_KV_VERIFY taken through them too, whichever side is device memory. A copy
// into the device that fails ends the request FAILED, naming its blocks, on both sides.
TEST(KvEngine, DevicePoolsMoveThroughTheDevicesCopies) {
  auto s = make_pair_of_engines({{"R2CCL_KV_VERIFY", "1"}});
  const auto layout = KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts);
  const test::StandinDeviceMemory gpu0(std::byte{0x5A});
  test::StandinDeviceMemory gpu1(std::byte{0xC3});
  std::vector<std::byte> dev0(s[0].memory.size()), dev1(s[0].memory.size());
  gpu0.write(dev0, s[0].memory);  // the device holds what rank 0's host pool holds
  gpu1.write(dev1, std::vector<std::byte>(dev1.size(), std::byte{0}));
  auto p0 = s[0].engine->register_pool({std::span<std::byte>(dev0)}, layout, &gpu0);
  auto p1 = s[1].engine->register_pool({std::span<std::byte>(dev1)}, layout, &gpu1);
  ASSERT_TRUE(p0.is_ok()) << p0.status().to_string();
  ASSERT_TRUE(p1.is_ok()) << p1.status().to_string();
  ASSERT_TRUE(s[0].engine->accept_metadata(1, s[1].engine->metadata()).is_ok());
  // Does rank 1's device block `dst` hold rank 0's block `src`, in every layer and part?
  auto device_holds = [&](std::uint32_t dst, std::uint32_t src) {
    const auto now = gpu1.read(dev1);
    for (std::uint32_t layer = 0; layer < kLayers; ++layer)
      for (std::uint32_t part = 0; part < kParts; ++part)
        for (std::uint64_t i = 0; i < kBlockBytes; ++i)
          if (now[layout.offset(layer, part, dst) + i] != value_at(0, layer, part, src, i))
            return false;
    return true;
  };
  struct Case {
    std::uint64_t id;
    std::uint32_t src_pool, dst_pool;
    BlockSpan span;
  };
  const std::vector<Case> cases = {
      {11, *p0, *p1, BlockSpan{0, kLayers, {3, 4, 5, 60}, {20, 21, 22, 1}}},  // device -> device
      {12, s[0].pool, *p1, BlockSpan{0, kLayers, {7}, {30}}},                 // host -> device
      {13, *p0, s[1].pool, BlockSpan{0, kLayers, {9}, {31}}},                 // device -> host
  };
  for (const auto& c : cases) {
    ASSERT_TRUE(s[0].engine->submit(c.id, 1, c.src_pool, c.dst_pool, {c.span}).is_ok());
    auto st = s[0].engine->wait(c.id, 10s);
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    EXPECT_EQ(st->state, RequestState::kDone) << c.id << ": " << st->reason;
    auto note = s[1].engine->wait_notification(0, c.id, 10s);
    ASSERT_TRUE(note.is_ok()) << note.status().to_string();
    EXPECT_EQ(note->state, RequestState::kDone) << c.id << ": " << note->reason;
    EXPECT_TRUE(note->verified) << c.id;
  }
  EXPECT_TRUE(device_holds(20, 3) && device_holds(21, 4) && device_holds(22, 5) &&
              device_holds(1, 60));
  EXPECT_TRUE(device_holds(30, 7));
  for (std::uint32_t layer = 0; layer < kLayers; ++layer)
    EXPECT_TRUE(holds(s[1], layer, 31, 9)) << layer;
  EXPECT_FALSE(device_holds(2, 61));  // untouched
  EXPECT_GT(gpu0.copies_out.load(), 0u);
  EXPECT_GT(gpu1.copies_in.load(), 0u);

  // A pull of device blocks, verified: the side that serves it reads their checksums through
  // its device's copies (on its worker) before it plans the writes.
  ASSERT_TRUE(s[1].engine->accept_metadata(0, s[0].engine->metadata()).is_ok());
  const auto out_before = gpu0.copies_out.load();
  ASSERT_TRUE(
      s[1].engine->pull(15, 0, *p1, *p0, {BlockSpan{0, kLayers, {11, 12}, {41, 42}}}).is_ok());
  auto pulled = s[1].engine->wait_notification(0, 15, 10s);
  ASSERT_TRUE(pulled.is_ok()) << pulled.status().to_string();
  EXPECT_EQ(pulled->state, RequestState::kDone) << pulled->reason;
  EXPECT_TRUE(pulled->verified);
  EXPECT_TRUE(device_holds(41, 11) && device_holds(42, 12));
  EXPECT_GT(gpu0.copies_out.load(), out_before);

  gpu1.fail_to_device = true;
  ASSERT_TRUE(s[0].engine->submit(14, 1, *p0, *p1, {BlockSpan{0, kLayers, {10}, {40}}}).is_ok());
  auto st = s[0].engine->wait(14, 10s);
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ(st->state, RequestState::kFailed);
  EXPECT_NE(st->reason.find("stand-in device memory: copy in failed"), std::string::npos)
      << st->reason;
  EXPECT_EQ(st->invalid_blocks, std::vector<std::uint32_t>{40});
  auto note = s[1].engine->wait_notification(0, 14, 10s);
  ASSERT_TRUE(note.is_ok()) << note.status().to_string();
  EXPECT_EQ(note->state, RequestState::kFailed);
  EXPECT_EQ(note->invalid_blocks, std::vector<std::uint32_t>{40});
  for (auto& side : s)
    side.engine.reset();  // before the pools go away
}

// Notifications waiting to be polled are bounded in bytes, not only in count (review N-m5): with
// a 64 KiB budget, 15 notifications of 4 KiB payloads wait (64 bytes of bookkeeping each) and the
// next 25 are dropped and counted; once polled, the budget is free again.
TEST(KvEngine, WaitingNotificationsAreBoundedInBytes) {
  auto s = make_pair_of_engines();
  EngineOptions options;
  options.max_queued_bytes = 64 * 1024;
  auto small = KvEngine::create(*s[1].fabric, options);  // takes rank 1's KV messages
  ASSERT_TRUE(small.is_ok());
  auto& e = **small;
  const auto kDone = static_cast<std::uint8_t>(RequestState::kDone);
  const Bytes payload(kMaxPayloadBytes, std::byte{7});
  for (std::uint64_t id = 0; id < 40; ++id)
    ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(id, kDone, payload)).is_ok());
  for (int i = 0; i < 1000 && e.counters().dropped_notifications < 25; ++i)  // a hang bound
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(e.counters().dropped_notifications, 25u);
  // All 40 have arrived; the 15 kept may still be on their way through the worker's
  // verification, so poll until they are all out.
  std::vector<Notification> notes;
  for (int i = 0; i < 1000 && notes.size() < 15; ++i) {  // a hang bound
    for (auto& n : e.poll_notifications())
      notes.push_back(std::move(n));
    if (notes.size() < 15) std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(notes.size(), 15u);
  for (std::uint64_t id = 0; id < 15; ++id) {
    EXPECT_EQ(notes[id].request, id);
    EXPECT_EQ(notes[id].payload, payload);
  }
  ASSERT_TRUE(send_as_engine(s[0], 1, notification_message(100, kDone, payload)).is_ok());
  EXPECT_TRUE(e.wait_notification(0, 100, 10s).is_ok());
  EXPECT_EQ(e.counters().dropped_notifications, 25u);
}

TEST(KvEngine, VerifiedBlocksAndACorruptedOneIsNamed) {
  auto s = make_pair_of_engines({{"R2CCL_KV_VERIFY", "1"}});
  ASSERT_TRUE(s[0].engine->submit(3, 1, 0, 0, {BlockSpan{0, kLayers, {1, 2}, {30, 31}}}).is_ok());
  auto ok = s[1].engine->wait_notification(0, 3, 10s);
  ASSERT_TRUE(ok.is_ok());
  EXPECT_EQ(ok->state, RequestState::kDone);
  EXPECT_TRUE(ok->verified);
  // The receiver verifies a notification when its worker takes it up. Hold the worker in the
  // callback of request 5 while request 4 lands, corrupt one of 4's blocks, then let it go: the
  // verification finds the block.
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  std::vector<Notification> got;
  s[1].engine->set_notification_callback([&](const Notification& n) {
    std::unique_lock lock(m);
    got.push_back(n);
    cv.notify_all();
    if (n.request == 5) cv.wait_for(lock, 20s, [&] { return release; });
  });
  ASSERT_TRUE(s[0].engine->submit(5, 1, 0, 0, {BlockSpan{0, kLayers, {3}, {40}}}).is_ok());
  {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return got.size() == 1; }));
  }
  ASSERT_TRUE(s[0].engine->submit(4, 1, 0, 0, {BlockSpan{0, kLayers, {8, 9}, {50, 51}}}).is_ok());
  ASSERT_EQ(s[0].engine->wait(4, 10s)->state, RequestState::kDone);  // its bytes have landed
  const auto l = KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts);
  s[1].memory[l.offset(2, 1, 51) + 100] ^= std::byte{0xff};
  {
    std::unique_lock lock(m);
    release = true;
    cv.notify_all();
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return got.size() == 2; }));
  }
  s[1].engine->set_notification_callback(nullptr);
  EXPECT_EQ(got[0].request, 5u);
  EXPECT_TRUE(got[0].verified);
  const Notification& bad = got[1];
  EXPECT_EQ(bad.request, 4u);
  EXPECT_EQ(bad.state, RequestState::kFailed);
  EXPECT_FALSE(bad.verified);
  EXPECT_EQ(bad.invalid_blocks, std::vector<std::uint32_t>{51});
  EXPECT_EQ(bad.reason, "1 block(s) failed verification (first: block 51)");
}

TEST(KvEngine, ManyConcurrentRequestsOfMixedSizesAllComplete) {
  auto s = make_pair_of_engines({{"R2CCL_KV_MAX_INFLIGHT", "1M"}});
  std::mt19937 rng(5);
  constexpr int kRequests = 1000;
  for (int id = 0; id < kRequests; ++id) {
    const std::uint32_t n = 1 + rng() % 8;
    BlockSpan span{0, 1 + static_cast<std::uint32_t>(rng() % kLayers), {}, {}};
    for (std::uint32_t i = 0; i < n; ++i) {
      span.src_blocks.push_back(rng() % kBlocks);
      span.dst_blocks.push_back(rng() % kBlocks);
    }
    ASSERT_TRUE(s[0].engine->submit(static_cast<std::uint64_t>(id), 1, 0, 0, {span}).is_ok());
  }
  int done = 0;
  for (int id = 0; id < kRequests; ++id) {
    auto st = s[0].engine->wait(static_cast<std::uint64_t>(id), 30s);
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    done += st->state == RequestState::kDone;
  }
  EXPECT_EQ(done, kRequests);
  std::size_t notes = 0;
  for (int i = 0; i < 100 && notes < static_cast<std::size_t>(kRequests); ++i) {
    for (const auto& n : s[1].engine->poll_notifications()) {
      EXPECT_EQ(n.state, RequestState::kDone);
      ++notes;
    }
    if (notes < static_cast<std::size_t>(kRequests)) std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(notes, static_cast<std::size_t>(kRequests));
}

TEST(KvEngine, BadInputIsRefusedWithItsReason) {
  auto s = make_pair_of_engines();
  auto& e = *s[0].engine;
  EXPECT_EQ(e.submit(1, 1, 0, 0, {BlockSpan{0, kLayers, {64}, {0}}}).message(),
            "request 1: source block 64 is out of range: the local pool has 64 blocks");
  EXPECT_EQ(e.submit(1, 1, 0, 0, {BlockSpan{0, kLayers, {0}, {99}}}).message(),
            "request 1: destination block 99 is out of range: the remote pool has 64 blocks");
  EXPECT_EQ(e.submit(1, 1, 0, 0, {BlockSpan{0, kLayers + 1, {0}, {0}}}).message(),
            "request 1: layer range [0, 5) is empty or past the 4 layers");
  EXPECT_EQ(e.submit(1, 1, 0, 0, {BlockSpan{0, 1, {0, 1}, {0}}}).message(),
            "request 1: 2 source blocks but 1 destination blocks");
  EXPECT_EQ(e.begin(1, 5, 0, 0).message(),
            "unknown peer 5: accept_metadata() or load_remote() its metadata before sending to it");
  EXPECT_EQ(e.begin(1, 1, 3, 0).message(), "no local KV pool 3 (have 1)");
  ASSERT_TRUE(e.submit(1, 1, 0, 0, {BlockSpan{0, 1, {0}, {0}}}).is_ok());
  EXPECT_EQ(e.begin(1, 1, 0, 0).message(), "request id 1 is already in use");
  ASSERT_EQ(e.wait(1, 10s)->state, RequestState::kDone);
  EXPECT_EQ(e.cancel(1).message(), "request 1 already ended (DONE); nothing to cancel");
  EXPECT_EQ(e.cancel(77).message(), "no request 77");
  // A cancelled request ends CANCELLED and the receiver is told every block is invalid.
  ASSERT_TRUE(e.begin(2, 1, 0, 0).is_ok());
  ASSERT_TRUE(e.cancel(2).is_ok());
  EXPECT_EQ(e.status(2)->state, RequestState::kCancelled);

  // Metadata: truncated, corrupted, another version, another rank's, incompatible.
  Bytes meta = s[1].engine->metadata();
  EXPECT_EQ(e.accept_metadata(1, std::span<const std::byte>(meta.data(), 3)).message(),
            "KV metadata is truncated (no header)");
  EXPECT_EQ(
      e.accept_metadata(1, std::span<const std::byte>(meta.data(), meta.size() - 4)).message(),
      "KV metadata is truncated");
  Bytes corrupt = meta;
  corrupt[20] ^= std::byte{1};
  EXPECT_EQ(e.accept_metadata(1, corrupt).message(),
            "KV metadata is corrupted (checksum mismatch)");
  Bytes other = meta;
  other[4] = std::byte{9};
  EXPECT_EQ(e.accept_metadata(1, other).message(),
            "KV metadata version 9 is not supported (this build reads version 2)");
  EXPECT_EQ(e.accept_metadata(1, s[0].engine->metadata()).message(),
            "this KV metadata is rank 0's, not rank 1's");
  EXPECT_EQ(e.accept_metadata(0, meta).message(),
            "accept_metadata: rank 0 is not a peer (world of 2 ranks)");
  // Pools of other shapes connect (asymmetric pools are normal), but blocks never move between
  // two pools whose shapes differ: the request is refused, saying what differs.
  std::vector<std::byte> small(kLayers * kParts * kBlocks * 1024),
      big(kLayers * kParts * kBlocks * 2048);
  ASSERT_TRUE(s[1].engine
                  ->register_pool({std::span<std::byte>(small)},
                                  KvLayout::layer_major(kLayers, kBlocks, 1024, kParts))
                  .is_ok());
  ASSERT_TRUE(s[0].engine
                  ->register_pool({std::span<std::byte>(big)},
                                  KvLayout::layer_major(kLayers, kBlocks, 2048, kParts))
                  .is_ok());
  ASSERT_TRUE(e.accept_metadata(1, s[1].engine->metadata()).is_ok());
  const BlockSpan one{0, 1, {0}, {0}};
  EXPECT_EQ(e.submit(90, 1, 1, 1, {one}).message(),
            "KV pool 1 here and rank 1's pool 1 are incompatible: block sizes differ (2048 bytes "
            "here, 1024 there)");
  EXPECT_EQ(e.submit(91, 1, 0, 1, {one}).message(),
            "KV pool 0 here and rank 1's pool 1 are incompatible: block sizes differ (4096 bytes "
            "here, 1024 there)");
  EXPECT_EQ(e.submit(92, 1, 1, 0, {one}).message(),
            "KV pool 1 here and rank 1's pool 0 are incompatible: block sizes differ (2048 bytes "
            "here, 4096 there)");
  EXPECT_EQ(e.pull(93, 1, 1, 0, {one}).message(),
            "KV pool 1 here and rank 1's pool 0 are incompatible: block sizes differ (2048 bytes "
            "here, 4096 there)");
  // A layout whose arithmetic overflows 64 bits is refused, not wrapped around.
  KvLayout huge = KvLayout::layer_major(1, 3, 1024, 1);
  huge.places[0].stride = std::uint64_t{1} << 63;
  EXPECT_EQ(e.register_pool({std::span<std::byte>(small)}, huge).status().message(),
            "register_pool: KV layout: layer 0 part 0 (offset 0, stride 9223372036854775808, 3 "
            "blocks of 1024 bytes) overflows 64 bits");
  // A layout that does not fit its buffer.
  EXPECT_EQ(e.register_pool({std::span<std::byte>(small)},
                            KvLayout::layer_major(kLayers, kBlocks + 1, 1024, kParts))
                .status()
                .message(),
            "register_pool: KV layout: layer 3 part 1 ends at byte 532480, past buffer 0 of "
            "524288 bytes");
  s[1].engine.reset();  // before the buffers above go away
  s[0].engine.reset();
}

TEST(KvEngine, NotificationsCanArriveThroughACallback) {
  auto s = make_pair_of_engines({{"R2CCL_KV_VERIFY", "1"}});
  std::mutex m;
  std::condition_variable cv;
  std::vector<Notification> got;
  std::thread::id on;
  bool on_the_loop = true;
  // The callback runs outside the engine's lock and off the progress loop: it may call the
  // engine (before, this deadlocked), and the loop keeps moving data while it runs.
  s[1].engine->set_notification_callback([&](const Notification& n) {
    (void)s[1].engine->counters();
    const bool loop = s[1].fabric->endpoint().engine().in_loop();
    std::lock_guard lock(m);
    on_the_loop = loop;
    on = std::this_thread::get_id();
    got.push_back(n);
    cv.notify_all();
  });
  ASSERT_TRUE(
      s[0].engine->submit(11, 1, 0, 0, {BlockSpan{0, kLayers, {1}, {2}}}, text("x")).is_ok());
  std::unique_lock lock(m);
  ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return !got.empty(); }));
  EXPECT_EQ(got[0].request, 11u);
  EXPECT_EQ(got[0].state, RequestState::kDone);
  EXPECT_TRUE(got[0].verified);
  EXPECT_EQ(got[0].payload, text("x"));
  EXPECT_NE(on, std::this_thread::get_id());
  EXPECT_FALSE(on_the_loop);
  lock.unlock();
  s[1].engine->set_notification_callback(nullptr);
}

TEST(KvEngine, SettingsAreNamedWhenBad) {
  EXPECT_EQ(parse_config(test::env_of({{"R2CCL_KV_VERIFY", "yes"}})).status().message(),
            "R2CCL_KV_VERIFY='yes' is invalid: expected 0 or 1");
  EXPECT_EQ(parse_config(test::env_of({{"R2CCL_KV_MAX_INFLIGHT", "10K"}})).status().message(),
            "R2CCL_KV_MAX_INFLIGHT='10K' is invalid: expected a size from 1M to 16G bytes "
            "(suffixes K, M, G)");
}

}  // namespace
}  // namespace r2ccl::kv

// The multi-rail channel's failover state machine, driven through the fake provider: no sockets,
// no threads, no timing. Two channels (rank 0 and rank 1) over four fake rails; the test runs the
// network's events one by one and scripts the faults (link down, reset, lost confirmations,
// duplicated and held control messages, refused connections).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel.h"
#include "channel/protocol.h"
#include "fake/fake_provider.h"
#include "r2ccl/runtime/memory.h"
#include "standin_device_memory.h"

namespace r2ccl {
namespace {

using testing::FakeNetwork;
using testing::FakeProvider;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kRails = 4;
constexpr int kMaxRounds = 20000;  // bound of every drive loop (each round runs the whole queue)
constexpr auto kDriveLimit = std::chrono::seconds(20);

struct Rank {
  Rank(FakeNetwork& net, int me, const Config& c)
      : config(c), provider(net, me, kRails), registry(provider) {}
  Config config;
  RailEventLog events;
  FakeProvider provider;
  MemoryRegistry registry;
  std::unique_ptr<Channel> channel;
  std::vector<std::string> messages;  // user messages, in the order handled
  std::vector<Status> fatal;

  std::vector<RailEvent> of(const std::string& kind) const {
    std::vector<RailEvent> out;
    for (const auto& e : events.snapshot())
      if (e.kind == kind) out.push_back(e);
    return out;
  }
  RailSnapshot rail(std::uint32_t i) const {
    std::vector<RailSnapshot> all;
    channel->snapshot(all);
    return all.at(i);
  }
};

Config test_config() {
  Config c;
  c.chunk_size = 64 * 1024;  // many chunks per message, so that some are in flight on every rail
  // Silence never fails a rail here (no probes run): faults come from the script only.
  c.probe_timeout = std::chrono::milliseconds(600000);
  c.stall_timeout = std::chrono::milliseconds(600000);
  c.holddown = std::chrono::milliseconds(0);
  c.readmit_probes = 1;
  return c;
}

class ChannelFailover : public ::testing::Test {
 protected:
  virtual Config make_config() const { return test_config(); }

  void SetUp() override {
    const Config c = make_config();
    ranks_[0] = std::make_unique<Rank>(net_, 0, c);
    ranks_[1] = std::make_unique<Rank>(net_, 1, c);
    for (int me = 0; me < 2; ++me) {
      Rank& r = *ranks_[me];
      Rank& peer = *ranks_[1 - me];
      ChannelContext ctx;
      ctx.config = &r.config;
      ctx.incarnation = 100 + static_cast<std::uint64_t>(me);
      ctx.self_label = "rank " + std::to_string(me);
      ctx.provider = &r.provider;
      ctx.out_of_band = nullptr;  // no out-of-band path: failover must go over the rails
      ctx.events = &r.events;
      ctx.on_fatal = [&r](const Status& st) { r.fatal.push_back(st); };
      ctx.on_user_message = [&r](int, std::span<const std::byte> message) {
        const auto payload = message.subspan(1);  // after the service byte
        r.messages.emplace_back(reinterpret_cast<const char*>(payload.data()), payload.size());
      };
      std::vector<Channel::RemoteRail> remote;
      for (std::size_t i = 0; i < kRails; ++i)
        remote.push_back({peer.provider.devices()[i].name, peer.provider.endpoint(i)});
      Channel::PeerIdentity peer_id;
      peer_id.id = 1 - me;
      peer_id.label = "rank " + std::to_string(1 - me);
      peer_id.incarnation = 100 + static_cast<std::uint64_t>(1 - me);
      peer_id.connector = me == 0;  // rank 0 opens the rails
      r.channel = std::make_unique<Channel>(ctx, peer_id, r.provider.devices(), remote);
      Channel* ch = r.channel.get();
      r.provider.set_accept_handler(
          [ch](std::shared_ptr<Rail> rail) { return ch->attach(rail->hello().rail, rail); });
    }
  }

  void TearDown() override {
    for (auto& r : ranks_)
      if (r && r->channel) r->channel->shutdown();
    net_.run();
  }

  Rank& r0() { return *ranks_[0]; }
  Rank& r1() { return *ranks_[1]; }

  void connect() {
    r0().channel->connect_all_rails();
    drive([&] { return r0().channel->attached() == kRails && r1().channel->attached() == kRails; });
  }

  // Runs the network and ticks both channels until `done`: at most kMaxRounds rounds and
  // kDriveLimit (a re-connection waits kReconnectBackoff after a failed attempt).
  template <typename Pred>
  bool drive(Pred done) {
    const auto until = Clock::now() + kDriveLimit;
    for (int i = 0; i < kMaxRounds && !done() && Clock::now() < until; ++i) {
      if (net_.run() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      for (auto& r : ranks_)
        r->channel->tick(Clock::now());
    }
    return done();
  }

  struct Transfer {
    std::vector<std::byte> src, dst;
    RegionPtr src_region, dst_region;
    OpPtr send = std::make_shared<Op>();
    OpPtr recv = std::make_shared<Op>();
    bool done() const { return send->done() && recv->done(); }
    bool intact() const { return src == dst; }
  };

  // `src_memory`, `dst_memory`: the buffers are that stand-in device memory, whose bytes `src`
  // and `dst` then hold (scrambled: see StandinDeviceMemory).
  std::unique_ptr<Transfer> start_transfer(std::size_t bytes,
                                           const test::StandinDeviceMemory* src_memory = nullptr,
                                           const test::StandinDeviceMemory* dst_memory = nullptr) {
    auto t = std::make_unique<Transfer>();
    t->src.resize(bytes);
    t->dst.assign(bytes, std::byte{0xEE});
    for (std::size_t i = 0; i < bytes; ++i)
      t->src[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
    if (src_memory != nullptr) src_memory->write(t->src, std::vector<std::byte>(t->src));
    t->src_region =
        *r0().registry.register_region(t->src.data(), bytes, MemoryAccess::kLocal, src_memory);
    t->dst_region = *r1().registry.register_region(t->dst.data(), bytes, MemoryAccess::kRemoteWrite,
                                                   dst_memory);
    const auto deadline = Clock::now() + std::chrono::minutes(10);
    r1().channel->post_recv(t->recv, t->dst_region, 0, bytes, deadline);
    r0().channel->post_send(t->send, t->src_region, 0, bytes, deadline);
    return t;
  }

  void send_messages(int from, int to_exclusive) {
    for (int i = from; i < to_exclusive; ++i) {
      const std::string m = "message " + std::to_string(i);
      r0().channel->send_user_message(0, std::as_bytes(std::span(m.data(), m.size())));
    }
  }

  static std::vector<std::string> numbered(int n) {
    std::vector<std::string> out;
    for (int i = 0; i < n; ++i)
      out.push_back("message " + std::to_string(i));
    return out;
  }

  FakeNetwork net_;
  std::unique_ptr<Rank> ranks_[2];
};

TEST_F(ChannelFailover, EveryByteArrivesOverEveryRail) {
  connect();
  for (std::size_t bytes : {std::size_t{1000}, std::size_t{1} << 20}) {
    auto t = start_transfer(bytes);
    ASSERT_TRUE(drive([&] { return t->done(); })) << bytes;
    EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
    EXPECT_TRUE(t->recv->status().is_ok()) << t->recv->status().to_string();
    EXPECT_TRUE(t->intact()) << bytes;
  }
  for (std::uint32_t i = 0; i < kRails; ++i)
    EXPECT_GT(r0().rail(i).tx_chunks, 0u) << "rail " << i << " carried nothing";
  EXPECT_TRUE(r0().fatal.empty());
}

TEST_F(ChannelFailover, BackPressureHoldsChunksUntilTheRailHasRoomAndLosesNone) {
  for (std::uint32_t i = 0; i < kRails; ++i)
    net_.script(i).queue_limit = 1;
  connect();
  auto t = start_transfer(std::size_t{3} << 20);
  ASSERT_TRUE(drive([&] { return t->done(); }));
  EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
  EXPECT_TRUE(t->recv->status().is_ok()) << t->recv->status().to_string();
  EXPECT_TRUE(t->intact());
  EXPECT_GT(net_.refused_posts, 0u);  // the providers did push back
  EXPECT_TRUE(r0().fatal.empty());
  // Nothing was taken for a rail failure: no rail was fenced.
  for (const auto& e : r0().events.snapshot())
    EXPECT_NE(e.kind, "failed") << e.detail;
}

// A send whose region is deregistered mid-transfer ends at once with the reason, its chunks are
// given to no rail again, and the peer's receive ends with the same reason instead of waiting
// for its deadline.
TEST_F(ChannelFailover, ASendWhoseRegionIsDeregisteredEndsAndSoDoesThePeersReceive) {
  connect();
  auto t = start_transfer(std::size_t{16} << 20);  // 256 chunks: most not yet posted
  for (int i = 0; i < 40; ++i)
    net_.step();
  ASSERT_FALSE(t->send->done());
  const std::string why = "region #7 was deregistered while the operation used it";
  r0().channel->abandon_region(t->src_region->id, why);
  ASSERT_TRUE(t->send->done());
  EXPECT_EQ(t->send->status().code(), ErrorCode::kAborted);
  EXPECT_EQ(t->send->status().message(), why);
  std::uint64_t posted = 0;
  for (std::uint32_t i = 0; i < kRails; ++i)
    posted += r0().rail(i).tx_chunks;
  ASSERT_LT(posted, 256u);
  ASSERT_TRUE(drive([&] { return t->recv->done(); }));
  EXPECT_EQ(t->recv->status().code(), ErrorCode::kAborted) << t->recv->status().to_string();
  EXPECT_EQ(t->recv->status().message(), why);
  net_.run();
  std::uint64_t after = 0;
  for (std::uint32_t i = 0; i < kRails; ++i)
    after += r0().rail(i).tx_chunks;
  EXPECT_EQ(after, posted) << "chunks of the abandoned send were posted after it ended";
  // The channel carries the next transfer whole.
  auto next = start_transfer(std::size_t{1} << 20);
  ASSERT_TRUE(drive([&] { return next->done(); }));
  EXPECT_TRUE(next->send->status().is_ok()) << next->send->status().to_string();
  EXPECT_TRUE(next->intact());
}

// A send ended before the peer posted its receive: the receive, posted later, ends at once with
// the sender's reason, and the next message pairs as before.
TEST_F(ChannelFailover, AReceivePostedAfterItsSendWasAbandonedEndsWithTheReason) {
  connect();
  constexpr std::size_t kBytes = std::size_t{1} << 20;
  std::vector<std::byte> src(kBytes, std::byte{0x21}), dst(kBytes, std::byte{0});
  auto s_region = *r0().registry.register_region(src.data(), kBytes, MemoryAccess::kLocal);
  auto d_region = *r1().registry.register_region(dst.data(), kBytes, MemoryAccess::kRemoteWrite);
  const auto deadline = Clock::now() + std::chrono::minutes(10);
  auto send = std::make_shared<Op>();
  r0().channel->post_send(send, s_region, 0, kBytes, deadline);
  net_.run();
  const std::string why = "region #3 was deregistered while the operation used it";
  r0().channel->abandon_region(s_region->id, why);
  ASSERT_TRUE(send->done());
  net_.run();  // the abort reaches rank 1 before its receive is posted
  auto recv = std::make_shared<Op>();
  r1().channel->post_recv(recv, d_region, 0, kBytes, deadline);
  ASSERT_TRUE(recv->done());
  EXPECT_EQ(recv->status().code(), ErrorCode::kAborted) << recv->status().to_string();
  EXPECT_EQ(recv->status().message(), why);
  auto next = start_transfer(kBytes);
  ASSERT_TRUE(drive([&] { return next->done(); }));
  EXPECT_TRUE(next->recv->status().is_ok()) << next->recv->status().to_string();
  EXPECT_TRUE(next->intact());
}

// An operation's completion may end others on the same channel (its callback deregisters their
// region): sends timing out in one tick (their receives never posted), whose first callback
// abandons the others' region, all end once, each with a reason.
TEST_F(ChannelFailover, ACompletionThatEndsOtherOperationsOfTheChannelIsSafe) {
  connect();
  constexpr std::size_t kBytes = std::size_t{1} << 20;  // by request-to-send: no receive, no end
  std::vector<std::byte> first(kBytes), rest(4 * kBytes);
  auto first_region = *r0().registry.register_region(first.data(), kBytes, MemoryAccess::kLocal);
  auto rest_region = *r0().registry.register_region(rest.data(), rest.size(), MemoryAccess::kLocal);
  const auto deadline = Clock::now() + std::chrono::milliseconds(1);
  auto head = std::make_shared<Op>();
  std::vector<OpPtr> others;
  const std::string why = "region #5 was deregistered while the operation used it";
  head->on_complete([&](const Status&) { r0().channel->abandon_region(rest_region->id, why); });
  r0().channel->post_send(head, first_region, 0, kBytes, deadline);
  for (std::size_t i = 0; i < 4; ++i) {
    others.push_back(std::make_shared<Op>());
    r0().channel->post_send(others.back(), rest_region, i * kBytes, kBytes, deadline);
  }
  net_.run();
  r0().channel->tick(Clock::now() + r0().config.timeout);
  ASSERT_TRUE(head->done());
  EXPECT_EQ(head->status().code(), ErrorCode::kTimeout) << head->status().to_string();
  for (const auto& op : others) {
    ASSERT_TRUE(op->done());
    EXPECT_TRUE(op->status().code() == ErrorCode::kTimeout ||
                (op->status().code() == ErrorCode::kAborted && op->status().message() == why))
        << op->status().to_string();
  }
}

// The same from the receiving side: its receive ends, and so does the peer's send.
TEST_F(ChannelFailover, AReceiveWhoseRegionIsDeregisteredEndsAndSoDoesThePeersSend) {
  connect();
  auto t = start_transfer(std::size_t{4} << 20);
  for (int i = 0; i < 40; ++i)
    net_.step();
  ASSERT_FALSE(t->recv->done());
  const std::string why = "region #9 was deregistered while the operation used it";
  r1().channel->abandon_region(t->dst_region->id, why);
  ASSERT_TRUE(t->recv->done());
  EXPECT_EQ(t->recv->status().code(), ErrorCode::kAborted);
  EXPECT_EQ(t->recv->status().message(), why);
  ASSERT_TRUE(drive([&] { return t->send->done(); }));
  EXPECT_EQ(t->send->status().code(), ErrorCode::kAborted) << t->send->status().to_string();
  EXPECT_EQ(t->send->status().message(), why);
  auto next = start_transfer(std::size_t{1} << 20);
  ASSERT_TRUE(drive([&] { return next->done(); }));
  EXPECT_TRUE(next->recv->status().is_ok()) << next->recv->status().to_string();
  EXPECT_TRUE(next->intact());
}

// A peer's messages from any number of epochs ahead wait for their receives and sends here: a
// legal program runs collectives ahead of a busy peer (its eager sends complete once queued), and
// its next large message (request-to-send) or large receive (clear-to-send) is then hundreds of
// epochs ahead of this side. Every byte arrives once this side catches up, and nothing is
// called a protocol violation.
TEST_F(ChannelFailover, MessagesFromHundredsOfEpochsAheadWaitForThisSideToCatchUp) {
  connect();
  constexpr std::uint64_t kEpochs = 300;
  constexpr std::size_t kSmall = 1000, kLarge = (std::size_t{1} << 20) + 5;
  std::vector<std::byte> src(kEpochs * kSmall + kLarge), dst(src.size(), std::byte{0xEE});
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<std::byte>((i * 131 + i / 977) & 0xff);
  auto src_region = *r0().registry.register_region(src.data(), src.size());
  auto dst_region = *r1().registry.register_region(dst.data(), dst.size());
  const auto deadline = Clock::now() + std::chrono::minutes(10);
  // Rank 0 runs ahead: an eager send in each of kEpochs epochs (each completes at once), then a
  // large send announced by request-to-send in the next.
  std::vector<OpPtr> sends, recvs;
  for (std::uint64_t e = 1; e <= kEpochs + 1; ++e) {
    r0().channel->enter_epoch(e);
    sends.push_back(std::make_shared<Op>());
    const bool large = e == kEpochs + 1;
    r0().channel->post_send(sends.back(), src_region, (e - 1) * kSmall, large ? kLarge : kSmall,
                            deadline);
  }
  ASSERT_TRUE(drive([&] { return r1().channel->unexpected_bytes() == kEpochs * kSmall; }));
  EXPECT_TRUE(
      std::all_of(sends.begin(), sends.end() - 1, [](const OpPtr& o) { return o->done(); }));
  // Rank 1 catches up.
  for (std::uint64_t e = 1; e <= kEpochs + 1; ++e) {
    r1().channel->enter_epoch(e);
    recvs.push_back(std::make_shared<Op>());
    const bool large = e == kEpochs + 1;
    r1().channel->post_recv(recvs.back(), dst_region, (e - 1) * kSmall, large ? kLarge : kSmall,
                            deadline);
  }
  auto all_done = [](const std::vector<OpPtr>& ops) {
    return std::all_of(ops.begin(), ops.end(), [](const OpPtr& o) { return o->done(); });
  };
  ASSERT_TRUE(drive([&] { return all_done(sends) && all_done(recvs); }));
  for (const auto& op : sends)
    EXPECT_TRUE(op->status().is_ok()) << op->status().to_string();
  for (const auto& op : recvs)
    EXPECT_TRUE(op->status().is_ok()) << op->status().to_string();
  EXPECT_TRUE(src == dst);
  // Now rank 1 runs ahead: its large receive, kEpochs epochs further on, sends its clear-to-send
  // to a rank 0 that has not posted the send yet.
  std::fill(dst.begin(), dst.end(), std::byte{0xEE});
  const std::uint64_t later = 2 * kEpochs + 1;
  r1().channel->enter_epoch(later);
  auto recv = std::make_shared<Op>();
  r1().channel->post_recv(recv, dst_region, 0, kLarge, deadline);
  for (int round = 0; round < 50; ++round) {
    net_.run();
    for (auto& r : ranks_)
      r->channel->tick(Clock::now());
  }
  EXPECT_FALSE(recv->done());
  r0().channel->enter_epoch(later);
  auto send = std::make_shared<Op>();
  r0().channel->post_send(send, src_region, 0, kLarge, deadline);
  ASSERT_TRUE(drive([&] { return send->done() && recv->done(); }));
  EXPECT_TRUE(send->status().is_ok()) << send->status().to_string();
  EXPECT_TRUE(recv->status().is_ok()) << recv->status().to_string();
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + kLarge, dst.begin()));
  EXPECT_TRUE(r0().fatal.empty()) << r0().fatal[0].to_string();
  EXPECT_TRUE(r1().fatal.empty()) << r1().fatal[0].to_string();
  EXPECT_FALSE(r0().channel->dead());
  EXPECT_FALSE(r1().channel->dead());
}

// What a peer sends early is bounded by its size, not by how far ahead its epochs are: a peer
// that announces more clear-to-sends than it can have receives posted breaks the protocol, and
// the channel says so (the job's error) and treats it as gone, instead of keeping whatever
// peer-chosen sequence numbers ask it to keep.
class ChannelEarlyBounds : public ChannelFailover {
 protected:
  // Control message `control` of rank 1: a clear-to-send for rank 0's message `message`.
  void inject_cts(std::uint64_t control, std::uint64_t message) {
    ByteWriter w;
    w.u64(control).u8(1);  // a clear-to-send
    w.u64(message).u64(100).u32(65536).u64(0);
    RemoteRegion{1, 100, std::vector<std::uint64_t>(kRails, 1)}.encode(w);
    testing::FakeRail* from_rank1 = net_.links(0).at(0)->ends[1];
    ASSERT_NE(from_rank1, nullptr);
    ASSERT_TRUE(from_rank1->post_control(std::make_shared<const Bytes>(w.take()), 0).is_ok());
  }
};

TEST_F(ChannelEarlyBounds, ClearToSendsOfFarEpochsAreKeptUpToTheReceiveSlots) {
  connect();
  // One clear-to-send in each of ChunkImm::kSlots epochs far ahead: kept.
  for (std::uint64_t k = 0; k < ChunkImm::kSlots; ++k)
    inject_cts(1 + k, (1000 + k) << kEpochShift);
  for (int round = 0; round < 50; ++round)
    net_.run();
  EXPECT_TRUE(r0().fatal.empty()) << r0().fatal[0].to_string();
  EXPECT_FALSE(r0().channel->dead());
  // One more is more than a receiver has receives.
  inject_cts(1 + ChunkImm::kSlots, std::uint64_t{1} << 40);
  ASSERT_TRUE(drive([&] { return !r0().fatal.empty(); }));
  EXPECT_EQ(r0().fatal[0].message(),
            "rank 1 sent a clear-to-send for message #65536.0, with 4095 of its messages kept "
            "early here already (at most 4095)");
  EXPECT_TRUE(r0().channel->dead());
}

TEST_F(ChannelEarlyBounds, AClearToSendFurtherIntoItsEpochThanTheReceiveSlotsIsAViolation) {
  connect();
  inject_cts(1, (std::uint64_t{1} << 40) + 5000);
  ASSERT_TRUE(drive([&] { return !r0().fatal.empty(); }));
  EXPECT_EQ(r0().fatal[0].message(),
            "rank 1 sent a clear-to-send for message #65536.5000, 5000 ahead of the next one here "
            "in its epoch (at most 4094)");
  EXPECT_TRUE(r0().channel->dead());
}

// Eager sends complete once queued, but only within the sender's eager credit: a sender that
// outruns a receiver with no receives posted sends the rest by request-to-send, whose sends
// complete only once their data is confirmed. The receiver never keeps more than the credit;
// once it posts its receives, every message arrives intact and the credit comes back.
TEST_F(ChannelFailover, EagerSendsBeyondTheCreditWaitForTheReceiverInsteadOfFillingIt) {
  connect();
  constexpr std::size_t kMsg = 4096, kCount = 3000;  // 12 MiB: three times the credit
  std::vector<std::byte> src(kMsg * kCount), dst(kMsg * kCount, std::byte{0xEE});
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<std::byte>((i * 131 + i / kMsg) & 0xff);
  auto src_region = *r0().registry.register_region(src.data(), src.size());
  auto dst_region = *r1().registry.register_region(dst.data(), dst.size());
  const auto deadline = Clock::now() + std::chrono::minutes(10);
  std::vector<OpPtr> sends, recvs;
  for (std::size_t i = 0; i < kCount; ++i) {
    sends.push_back(std::make_shared<Op>());
    r0().channel->post_send(sends.back(), src_region, i * kMsg, kMsg, deadline);
  }
  for (int round = 0; round < 50; ++round) {
    net_.run();
    for (auto& r : ranks_)
      r->channel->tick(Clock::now());
  }
  EXPECT_LE(r1().channel->unexpected_bytes(), kEagerCredit);
  EXPECT_GT(r1().channel->unexpected_bytes(), 0u);
  const auto done =
      std::count_if(sends.begin(), sends.end(), [](const OpPtr& o) { return o->done(); });
  EXPECT_EQ(static_cast<std::size_t>(done), kEagerCredit / kMsg);  // the rest wait
  for (std::size_t i = 0; i < kCount; ++i) {
    recvs.push_back(std::make_shared<Op>());
    r1().channel->post_recv(recvs.back(), dst_region, i * kMsg, kMsg, deadline);
  }
  auto all_done = [](const std::vector<OpPtr>& ops) {
    return std::all_of(ops.begin(), ops.end(), [](const OpPtr& o) { return o->done(); });
  };
  ASSERT_TRUE(drive(
      [&] { return all_done(sends) && all_done(recvs) && r0().channel->eager_unconsumed() == 0; }));
  for (std::size_t i = 0; i < kCount; ++i) {
    EXPECT_TRUE(sends[i]->status().is_ok()) << i << ": " << sends[i]->status().to_string();
    EXPECT_TRUE(recvs[i]->status().is_ok()) << i << ": " << recvs[i]->status().to_string();
  }
  EXPECT_TRUE(src == dst);
  EXPECT_EQ(r1().channel->unexpected_bytes(), 0u);
  EXPECT_TRUE(r0().fatal.empty());
  EXPECT_TRUE(r1().fatal.empty());
}

// A peer that sends eager data beyond its credit breaks the protocol: the receiver says so and
// treats it as gone instead of keeping the data.
TEST_F(ChannelFailover, EagerDataBeyondTheCreditIsAProtocolViolation) {
  connect();
  auto link = net_.links(0).at(0);
  testing::FakeRail* from_rank1 = link->ends[1];
  ASSERT_NE(from_rank1, nullptr);
  const Bytes data(8192, std::byte{7});
  for (std::uint64_t i = 0; i <= kEagerCredit / data.size(); ++i) {
    ByteWriter w;
    w.u64(i + 1).u8(4).u64(i).u64(data.size()).raw(data.data(), data.size());  // kEager
    ASSERT_TRUE(from_rank1->post_control(std::make_shared<const Bytes>(w.take()), 0).is_ok());
  }
  ASSERT_TRUE(drive([&] { return !r0().fatal.empty(); }));
  EXPECT_NE(r0().fatal[0].message().find(
                "rank 1 sent eager message #512 (8192 bytes) beyond its eager credit: 4194304 "
                "bytes already wait for receives here (at most 4194304)"),
            std::string::npos)
      << r0().fatal[0].message();
  EXPECT_TRUE(r0().channel->dead());
}

TEST_F(ChannelFailover, ALinkDownMidTransferIsReplayedOnTheOtherRailsWithoutAnyControlPath) {
  connect();
  auto t = start_transfer(std::size_t{4} << 20);
  // Some chunks posted and delivered, others in flight on every rail.
  for (int i = 0; i < 40; ++i)
    net_.step();
  ASSERT_FALSE(t->done());
  r0().channel->on_link("fake1", false);
  ASSERT_TRUE(drive([&] { return t->done(); }));
  EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
  EXPECT_TRUE(t->recv->status().is_ok()) << t->recv->status().to_string();
  EXPECT_TRUE(t->intact());
  // The fence, its acknowledgement, the replay query and its answer all went over the surviving
  // rails (the channels have no control path at all).
  ASSERT_EQ(r0().of("failed").size(), 1u);
  EXPECT_EQ(r0().of("failed")[0].rail, 1u);
  ASSERT_EQ(r1().of("failed").size(), 1u);
  ASSERT_EQ(r0().of("replay_started").size(), 1u);
  ASSERT_EQ(r0().of("replay_reconciled").size(), 1u);
  EXPECT_EQ(r0().rail(1).state, RailState::kDown);
  std::uint64_t replayed = 0;
  for (std::uint32_t i : {0u, 2u, 3u})
    replayed += r0().rail(i).replayed_chunks;
  EXPECT_GT(replayed, 0u);
  EXPECT_EQ(r0().rail(1).replayed_chunks, 0u);
  EXPECT_TRUE(t->send->replayed());
}

// Device memory (stand-ins with different masks on the two sides) goes through its copies: out
// of the sender's device and into the receiver's, eagerly and in chunks; chunks in flight on a
// rail that goes down are replayed from the device like any other. A copy that fails refuses
// the write, and the send fails saying why.
TEST_F(ChannelFailover, DeviceMemoryMovesThroughItsCopiesAndItsChunksAreReplayed) {
  connect();
  const test::StandinDeviceMemory gpu0(std::byte{0x5A}), gpu1(std::byte{0xC3});
  for (std::size_t bytes : {std::size_t{1000}, std::size_t{4} << 20}) {
    auto t = start_transfer(bytes, &gpu0, &gpu1);
    const auto want = gpu0.read(t->src);
    if (bytes > 1000) {
      for (int i = 0; i < 40; ++i)
        net_.step();
      ASSERT_FALSE(t->done());
      r0().channel->on_link("fake1", false);
    }
    ASSERT_TRUE(drive([&] { return t->done(); })) << bytes;
    EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
    EXPECT_TRUE(t->recv->status().is_ok()) << t->recv->status().to_string();
    EXPECT_TRUE(gpu1.read(t->dst) == want) << bytes << " bytes arrived wrong";
    if (bytes > 1000) {
      EXPECT_TRUE(t->send->replayed());
    }
  }
  EXPECT_GT(gpu0.copies_out.load(), 0u);
  EXPECT_GT(gpu1.copies_in.load(), 0u);
  test::StandinDeviceMemory broken(std::byte{0x11});
  broken.fail_to_device = true;
  auto t = start_transfer(std::size_t{1} << 20, &gpu0, &broken);
  ASSERT_TRUE(drive([&] { return t->send->done(); }));
  EXPECT_NE(t->send->status().message().find("stand-in device memory: copy in failed"),
            std::string::npos)
      << t->send->status().to_string();
  EXPECT_TRUE(r0().fatal.empty());
}

TEST_F(ChannelFailover, ChunksWhoseConfirmationsWereLostAreReconciledNotReplayed) {
  connect();
  net_.script(2).drop_confirmations = true;
  auto t = start_transfer(std::size_t{2} << 20);
  // Everything lands, but rail 2's chunks stay unconfirmed at the sender.
  ASSERT_TRUE(drive([&] { return t->recv->done(); }));
  ASSERT_TRUE(t->intact());
  ASSERT_FALSE(t->send->done());
  net_.script(2).drop_confirmations = false;
  r0().channel->on_link("fake2", false);
  ASSERT_TRUE(drive([&] { return t->done(); }));
  EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
  const auto answers = r0().of("replay_reconciled");
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_NE(answers[0].detail.find("chunk(s) had arrived"), std::string::npos) << answers[0].detail;
  EXPECT_NE(answers[0].detail.find(", 0 to replay"), std::string::npos) << answers[0].detail;
  for (std::uint32_t i = 0; i < kRails; ++i)
    EXPECT_EQ(r0().rail(i).replayed_chunks, 0u) << "rail " << i;
}

TEST_F(ChannelFailover, DuplicatedControlMessagesAreHandledOnce) {
  connect();
  for (std::uint32_t i = 0; i < kRails; ++i)
    net_.script(i).duplicate_control = true;
  send_messages(0, 20);
  ASSERT_TRUE(drive([&] { return r1().messages.size() >= 20; }));
  net_.run();
  EXPECT_EQ(r1().messages, numbered(20));
}

TEST_F(ChannelFailover, MessagesSentAroundAFailoverAreHandledInTheOrderSent) {
  connect();
  // Messages 0..9 take rail 0 and are held there; rail 0 goes down, so they wait for the fence
  // and their replay while 10..19 go at once on rail 1.
  net_.script(0).hold = true;
  send_messages(0, 10);
  net_.run();
  EXPECT_TRUE(r1().messages.empty());
  r0().channel->on_link("fake0", false);
  send_messages(10, 20);
  net_.release(0);  // what rail 0 held is dropped: its connection is fenced
  ASSERT_TRUE(drive([&] { return r1().messages.size() >= 20; }));
  EXPECT_EQ(r1().messages, numbered(20));
  EXPECT_EQ(r0().of("failed").size(), 1u);
}

TEST_F(ChannelFailover, HeldMessagesReleasedOutOfOrderAreHandledInOrder) {
  connect();
  net_.script(0).hold = true;
  send_messages(0, 10);
  net_.release(0);  // delivered newest first
  ASSERT_TRUE(drive([&] { return r1().messages.size() >= 10; }));
  EXPECT_EQ(r1().messages, numbered(10));
}

TEST_F(ChannelFailover, AResetRailIsReplayedThenReadmittedAndCarriesTrafficAgain) {
  connect();
  auto t = start_transfer(std::size_t{4} << 20);
  for (int i = 0; i < 40; ++i)
    net_.step();
  net_.reset(3);  // both ends see the connection fail
  ASSERT_TRUE(drive([&] { return t->done(); }));
  EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
  EXPECT_TRUE(t->intact());
  EXPECT_EQ(r0().rail(3).state, RailState::kDown);
  // Probes answer again: the lower rank reconnects the rail at the next epoch.
  for (auto* r : {&r0(), &r1()})
    r->channel->on_probe_reply(3, std::chrono::microseconds(50));
  ASSERT_TRUE(drive([&] { return r0().channel->attached() == kRails; }));
  ASSERT_EQ(r0().of("readmitted").size(), 1u);
  EXPECT_EQ(r0().rail(3).epoch, 1u);
  const auto before = r0().rail(3).tx_chunks;
  auto again = start_transfer(std::size_t{2} << 20);
  ASSERT_TRUE(drive([&] { return again->done(); }));
  EXPECT_TRUE(again->intact());
  EXPECT_GT(r0().rail(3).tx_chunks, before);
}

TEST_F(ChannelFailover, ARailThatCannotConnectAtStartJoinsWhenItAnswers) {
  net_.refuse_connections(2, true);
  r0().channel->connect_all_rails();
  ASSERT_TRUE(drive([&] { return r0().channel->connecting() == 0; }));
  EXPECT_EQ(r0().channel->attached(), kRails - 1);
  EXPECT_NE(r0().channel->missing_rails().find("fake2: connection refused"), std::string::npos)
      << r0().channel->missing_rails();
  r0().channel->mark_started();
  r1().channel->mark_started();
  auto t = start_transfer(std::size_t{1} << 20);  // runs on three rails meanwhile
  ASSERT_TRUE(drive([&] { return t->done(); }));
  EXPECT_TRUE(t->intact());
  net_.refuse_connections(2, false);
  for (auto* r : {&r0(), &r1()})
    r->channel->on_probe_reply(2, std::chrono::microseconds(50));
  ASSERT_TRUE(drive([&] { return r0().channel->attached() == kRails; }));
  EXPECT_EQ(r0().of("readmitted").size(), 1u);
}

TEST_F(ChannelFailover, ARailThatConnectedOnceIsNotCountedAmongThoseNeverOpened) {
  // What start-up reports ("starting without these rails") is the rails that never connected; a
  // rail that connected and was closed again (the peer's own connections won a simultaneous
  // connect, and its arrive on that rail) is not among them.
  net_.refuse_connections(2, true);
  r0().channel->connect_all_rails();
  ASSERT_TRUE(drive([&] { return r0().channel->connecting() == 0; }));
  ASSERT_EQ(r0().channel->attached(), kRails - 1);
  net_.reset(3);
  ASSERT_TRUE(drive([&] { return r0().channel->attached() == kRails - 2; }));
  const std::string all = r0().channel->missing_rails();
  const std::string never = r0().channel->missing_rails(true);
  EXPECT_NE(all.find("rail 2 (fake2 -> "), std::string::npos) << all;
  EXPECT_NE(all.find("rail 3 (fake3 -> "), std::string::npos) << all;
  EXPECT_NE(never.find("rail 2 (fake2 -> "), std::string::npos) << never;
  EXPECT_EQ(never.find("rail 3"), std::string::npos) << never;
}

// Silence with real (short) limits: nothing is sent and no prober runs, so each rail goes
// SUSPECT after half its silence limit. The keepalive a SUSPECT rail then carries is a sign of
// life at both ends (its arrival, its confirmation): no rail that can carry it is ever declared
// down. A black-holed rail loses its keepalives too, and still goes DOWN.
class ChannelKeepalive : public ChannelFailover {
 protected:
  Config make_config() const override {
    Config c = test_config();
    c.probe_interval = std::chrono::milliseconds(10);
    c.probe_timeout = std::chrono::milliseconds(200);
    return c;
  }
};

TEST_F(ChannelKeepalive, ASilentRailProvesItselfWithKeepalivesAndABlackHoleStillFails) {
  connect();
  net_.script(1).black_hole = true;
  const auto until = Clock::now() + std::chrono::milliseconds(1500);  // 7 silence limits
  drive([&] { return Clock::now() >= until; });
  for (Rank* r : {&r0(), &r1()}) {
    const auto failed = r->of("failed");
    ASSERT_FALSE(failed.empty()) << "the black-holed rail was not declared down";
    for (const auto& e : failed) {
      EXPECT_EQ(e.rail, 1u) << e.detail;
    }
    EXPECT_NE(failed[0].detail.find("no probe reply or data for"), std::string::npos)
        << failed[0].detail;
    for (std::uint32_t i : {0u, 2u, 3u}) {
      EXPECT_EQ(r->rail(i).failovers, 0u) << "rail " << i;
      EXPECT_NE(r->rail(i).state, RailState::kDown) << "rail " << i;
    }
    EXPECT_EQ(r->rail(1).state, RailState::kDown);
  }
  // And the rails that stayed carry a transfer, every byte right.
  auto t = start_transfer(1 << 20);
  ASSERT_TRUE(drive([&] { return t->done(); }));
  EXPECT_TRUE(t->send->status().is_ok()) << t->send->status().to_string();
  EXPECT_TRUE(t->intact());
}

}  // namespace
}  // namespace r2ccl

// Two and three ranks, as threads of this process, over four loopback rails each.
#include <gtest/gtest.h>

#include <algorithm>

#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <tuple>

#include "r2ccl/runtime/fabric.h"
#include "r2ccl/runtime/provider/progress.h"
#include "test_util.h"

namespace r2ccl {
namespace {

using std::chrono::milliseconds;

struct World {
  std::vector<std::unique_ptr<Fabric>> ranks;
};

// Rank r's rails are 127.0.(10+r).1 .. 127.0.(10+r).4
World make_world(int n, std::map<std::string, std::string> extra = {}) {
  const auto port = test::free_port();
  std::vector<std::future<Result<std::unique_ptr<Fabric>>>> fs;
  for (int r = 0; r < n; ++r) {
    fs.push_back(std::async(std::launch::async, [=] {
      std::map<std::string, std::string> vars = extra;
      vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2,127.0.{0}.3,127.0.{0}.4", 10 + r);
      vars.emplace("R2CCL_CHUNK_SIZE", "64K");
      vars.emplace("R2CCL_RAIL_WINDOW", "256K");
      vars.emplace("R2CCL_TIMEOUT", "10s");
      auto cfg = parse_config(test::env_of(vars));
      EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
      BootstrapOptions b{r, n, HostPort{"127.0.0.1", port}, {}, milliseconds(10000), ""};
      return Fabric::create(*cfg, b);
    }));
  }
  World w;
  for (auto& f : fs) {
    auto fab = f.get();
    EXPECT_TRUE(fab.is_ok()) << fab.status().to_string();
    if (fab.is_ok()) w.ranks.push_back(std::move(*fab));
  }
  return w;
}

std::vector<std::byte> pattern(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(seed) * 17) >> 3);
  return v;
}

TEST(Fabric, SendRecvOfEverySizeArrivesIntactOverAllRails) {
  auto w = make_world(2);
  ASSERT_EQ(w.ranks.size(), 2u);
  auto& a = *w.ranks[0];
  auto& b = *w.ranks[1];
  EXPECT_EQ(a.rails_to(1), 4u);
  const std::size_t max = 3 * 1024 * 1024 + 7;
  std::vector<std::byte> src(max + 3), dst(max);
  auto rs = a.register_memory(src.data(), src.size());
  auto rd = b.register_memory(dst.data(), dst.size());
  ASSERT_TRUE(rs.is_ok() && rd.is_ok());
  // 0, 1, odd counts, exactly one chunk, one past a chunk, many chunks with a ragged tail.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{65536},
                        std::size_t{65537}, max}) {
    auto p = pattern(n, static_cast<int>(n % 251));
    std::copy(p.begin(), p.end(), src.begin() + 3);
    std::fill(dst.begin(), dst.end(), std::byte{0xEE});
    auto recv = b.irecv(0, *rd, 0, n);
    auto send = a.isend(1, *rs, 3, n);
    ASSERT_TRUE(recv.is_ok() && send.is_ok());
    ASSERT_TRUE(a.wait(*send).is_ok()) << n;
    ASSERT_TRUE(b.wait(*recv).is_ok()) << n;
    ASSERT_TRUE(std::equal(p.begin(), p.end(), dst.begin())) << "size " << n;
    if (n < max) {
      EXPECT_EQ(dst[n], std::byte{0xEE}) << "wrote past the message";
    }
  }
  // Every rail carried part of the large message.
  auto snap = a.rail_snapshot();
  ASSERT_EQ(snap.size(), 4u);
  for (const auto& r : snap) {
    EXPECT_GT(r.tx_bytes, 0u) << r.nic;
    EXPECT_EQ(r.state, RailState::kUp);
    EXPECT_EQ(r.peer, 1);
  }
  std::uint64_t total = 0;
  for (const auto& r : snap)
    total += r.tx_bytes;
  EXPECT_EQ(total, 1u + 4095 + 65536 + 65537 + max);  // each byte confirmed exactly once
  std::uint64_t rx = 0;
  for (const auto& r : b.rail_snapshot())
    rx += r.rx_bytes;
  EXPECT_EQ(rx, total);
}

TEST(Fabric, ManyMessagesInFlightBothWaysMatchInOrder) {
  auto w = make_world(2);
  ASSERT_EQ(w.ranks.size(), 2u);
  constexpr int kMsgs = 16;
  constexpr std::size_t kLen = 100000;
  std::vector<std::vector<std::byte>> src(2, std::vector<std::byte>(kMsgs * kLen));
  std::vector<std::vector<std::byte>> dst(2, std::vector<std::byte>(kMsgs * kLen));
  std::vector<RegionPtr> rs(2), rd(2);
  for (int r = 0; r < 2; ++r) {
    src[r] = pattern(kMsgs * kLen, r + 1);
    rs[r] = *w.ranks[r]->register_memory(src[r].data(), src[r].size());
    rd[r] = *w.ranks[r]->register_memory(dst[r].data(), dst[r].size());
  }
  std::vector<OpPtr> ops;
  for (int m = 0; m < kMsgs; ++m)
    for (int r = 0; r < 2; ++r) {
      ops.push_back(*w.ranks[r]->irecv(1 - r, rd[r], m * kLen, kLen));
      ops.push_back(*w.ranks[r]->isend(1 - r, rs[r], m * kLen, kLen));
    }
  for (auto& op : ops)
    ASSERT_TRUE(w.ranks[0]->wait(op).is_ok());
  EXPECT_EQ(dst[0], src[1]);
  EXPECT_EQ(dst[1], src[0]);
}

TEST(Fabric, ThreeRanksRingAndMessagesToSelf) {
  auto w = make_world(3);
  ASSERT_EQ(w.ranks.size(), 3u);
  constexpr std::size_t kLen = 300001;
  std::vector<std::vector<std::byte>> src(3), dst(3);
  std::vector<OpPtr> ops;
  std::vector<RegionPtr> keep;
  for (int r = 0; r < 3; ++r) {
    src[r] = pattern(kLen, r + 10);
    dst[r].assign(2 * kLen, std::byte{0});
    auto s = *w.ranks[r]->register_memory(src[r].data(), kLen);
    auto d = *w.ranks[r]->register_memory(dst[r].data(), 2 * kLen);
    keep.push_back(s);
    keep.push_back(d);
    ops.push_back(*w.ranks[r]->irecv((r + 2) % 3, d, 0, kLen));
    ops.push_back(*w.ranks[r]->isend((r + 1) % 3, s, 0, kLen));
    ops.push_back(*w.ranks[r]->irecv(r, d, kLen, kLen));  // to self
    ops.push_back(*w.ranks[r]->isend(r, s, 0, kLen));
  }
  for (auto& op : ops)
    ASSERT_TRUE(w.ranks[0]->wait(op).is_ok()) << op->status().to_string();
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(std::equal(src[(r + 2) % 3].begin(), src[(r + 2) % 3].end(), dst[r].begin())) << r;
    EXPECT_TRUE(std::equal(src[r].begin(), src[r].end(), dst[r].begin() + kLen)) << r;
  }
}

TEST(Fabric, SizeMismatchFailsWithAClearErrorAndTheFabricStaysUsable) {
  auto w = make_world(2);
  ASSERT_EQ(w.ranks.size(), 2u);
  std::vector<std::byte> buf(100000, std::byte{1}), out(100000);
  auto rs = *w.ranks[0]->register_memory(buf.data(), buf.size());
  auto rd = *w.ranks[1]->register_memory(out.data(), out.size());
  // One mismatched pair (message #seq): rank 0 sends `sent` bytes, rank 1 posts `posted`, the
  // send first when `send_first`. Returns both statuses.
  std::uint64_t seq = 0;
  auto pair = [&](std::size_t sent, std::size_t posted, bool send_first) {
    const std::string want = "size mismatch in message #" + std::to_string(seq++) +
                             " between rank 0 and rank 1: the sender sends " +
                             std::to_string(sent) + " bytes, the receiver posted " +
                             std::to_string(posted) + " bytes";
    OpPtr send, recv;
    if (send_first) {
      send = *w.ranks[0]->isend(1, rs, 0, sent);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      recv = *w.ranks[1]->irecv(0, rd, 0, posted);
    } else {
      recv = *w.ranks[1]->irecv(0, rd, 0, posted);
      send = *w.ranks[0]->isend(1, rs, 0, sent);
    }
    Status st = w.ranks[0]->wait(send);
    Status rt = w.ranks[1]->wait(recv);
    EXPECT_EQ(rt.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(rt.message(), want);
    return std::make_pair(st, want);
  };
  // A small (eager) send is buffered and complete at once, as MPI's: the receiver reports it.
  EXPECT_TRUE(pair(100, 200, false).first.is_ok());
  // A large send waits for the receiver's clear-to-send: both sides fail.
  // A large send to a receive of eager size (which sends no clear-to-send): the send announces
  // its length and the receiver refuses it, both fail — also when the announcement arrives
  // before the receive is posted.
  for (auto [sent, posted, send_first] :
       {std::tuple{50000, 60000, false}, std::tuple{40000, 300, false},
        std::tuple{40000, 300, true}}) {
    auto [st, want] =
        pair(static_cast<std::size_t>(sent), static_cast<std::size_t>(posted), send_first);
    EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(st.message(), want);
  }
  // The next message pairs work, small and large.
  for (std::size_t n : {std::size_t{1000}, buf.size()}) {
    std::fill(out.begin(), out.end(), std::byte{0});
    auto recv2 = *w.ranks[1]->irecv(0, rd, 0, n);
    auto send2 = *w.ranks[0]->isend(1, rs, 0, n);
    EXPECT_TRUE(w.ranks[0]->wait(send2).is_ok());
    EXPECT_TRUE(w.ranks[1]->wait(recv2).is_ok());
    EXPECT_TRUE(std::equal(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n), buf.begin()));
  }
}

TEST(Fabric, BadArgumentsAreRefusedWithTheirReason) {
  auto w = make_world(2);
  ASSERT_EQ(w.ranks.size(), 2u);
  auto& a = *w.ranks[0];
  std::vector<std::byte> buf(100);
  auto reg = *a.register_memory(buf.data(), buf.size());
  auto e1 = a.isend(2, reg, 0, 10);
  EXPECT_EQ(e1.status().message(), "send: peer 2 is out of range (0..1)");
  auto e2 = a.irecv(-1, reg, 0, 10);
  EXPECT_EQ(e2.status().message(), "receive: peer -1 is out of range (0..1)");
  auto e3 = a.isend(1, nullptr, 0, 10);
  EXPECT_EQ(e3.status().message(), "send: the buffer is not registered (null region)");
  auto e4 = a.isend(1, reg, 50, 51);
  EXPECT_EQ(e4.status().message(),
            "send: 51 bytes at offset 50 exceed the registered region of 100 bytes");
  auto e5 = a.isend(1, reg, SIZE_MAX, 2);
  EXPECT_EQ(e5.status().code(), ErrorCode::kInvalidArgument);
  auto e6 = a.register_memory(nullptr, 5);
  EXPECT_EQ(e6.status().message(), "cannot register a null buffer");
}

TEST(Fabric, ASendWithoutAMatchingReceiveFailsAtTheDeadline) {
  auto w = make_world(2, {{"R2CCL_TIMEOUT", "300ms"}});
  ASSERT_EQ(w.ranks.size(), 2u);
  std::vector<std::byte> buf(100000);
  auto reg = *w.ranks[0]->register_memory(buf.data(), buf.size());
  // A small send is buffered (eager): it completes without the receiver.
  auto small = *w.ranks[0]->isend(1, reg, 0, 100);
  EXPECT_TRUE(w.ranks[0]->wait(small).is_ok());
  // A large one needs the receiver's clear-to-send, and fails at the deadline without it.
  auto op = *w.ranks[0]->isend(1, reg, 0, 100000);
  Status s = w.ranks[0]->wait(op);
  EXPECT_EQ(s.code(), ErrorCode::kTimeout);
  EXPECT_NE(s.message().find("send #1 of 100000 bytes to rank 1 timed out after 300ms (rank 1 "
                             "never posted the matching receive)"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("rails tried: 0 (127.0.10.1 -> 127.0.11.1) up"), std::string::npos)
      << s.message();
}

// Messages posted on one side only: in epoch 1 rank 0's eager send (complete at once) and its
// large send, which rank 1 never receives; in epoch 2 rank 1's large receive, which rank 0 never
// sends. In epoch 3 every message pairs with its own: rank 1 gets exactly what rank 0 sent then.
TEST(Fabric, AnEpochLeavesBehindWhatOnlyOneSideOfThePairPosted) {
  auto w = make_world(2, {{"R2CCL_TIMEOUT", "300ms"}});
  ASSERT_EQ(w.ranks.size(), 2u);
  auto& a = *w.ranks[0];
  auto& b = *w.ranks[1];
  constexpr std::size_t kLarge = 200000, kSmall = 100;
  std::vector<std::byte> stale(kLarge, std::byte{0xee}), src = pattern(kLarge + kSmall, 5);
  std::vector<std::byte> dst(kLarge + kSmall, std::byte{0});
  auto rstale = *a.register_memory(stale.data(), stale.size());
  auto rs = *a.register_memory(src.data(), src.size());
  auto rd = *b.register_memory(dst.data(), dst.size());
  a.set_epoch(1);
  b.set_epoch(1);
  EXPECT_TRUE(a.wait(*a.isend(1, rstale, 0, kSmall)).is_ok());  // eager: buffered
  Status s = a.wait(*a.isend(1, rstale, 0, kLarge));
  EXPECT_NE(s.message().find("send #1.1 of 200000 bytes to rank 1 timed out after 300ms (rank 1 "
                             "never posted the matching receive)"),
            std::string::npos)
      << s.message();
  a.set_epoch(2);
  b.set_epoch(2);
  Status r = b.wait(*b.irecv(0, rd, 0, kLarge));
  EXPECT_NE(r.message().find("receive #2.0 of 200000 bytes from rank 0 timed out"),
            std::string::npos)
      << r.message();
  a.set_epoch(3);
  b.set_epoch(3);
  // A small and a large message, received in the order they were sent.
  auto r1 = *b.irecv(0, rd, 0, kSmall);
  auto r2 = *b.irecv(0, rd, kSmall, kLarge);
  auto s1 = *a.isend(1, rs, 0, kSmall);
  auto s2 = *a.isend(1, rs, kSmall, kLarge);
  for (const auto& op : {s1, s2})
    EXPECT_TRUE(a.wait(op).is_ok());
  for (const auto& op : {r1, r2}) {
    Status st = b.wait(op);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_EQ(dst, src);
}

TEST(Fabric, OneSidedWritesLandBeforeTheMessageThatFollowsThem) {
  auto w = make_world(2);
  ASSERT_EQ(w.ranks.size(), 2u);
  auto& a = *w.ranks[0];
  auto& b = *w.ranks[1];
  constexpr std::size_t kLen = 3 * 1024 * 1024 + 5;
  std::vector<std::byte> src = pattern(kLen, 9), dst(kLen + 100, std::byte{0});
  auto rs = *a.register_memory(src.data(), src.size());
  auto rd = *b.register_memory(dst.data(), dst.size());
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::string> got;
  b.set_message_handler([&](int peer, Bytes payload) {
    std::lock_guard lock(m);
    got.push_back(std::to_string(peer) + ":" +
                  std::string(reinterpret_cast<const char*>(payload.data()), payload.size()));
    // The write that completed before this message was sent has landed.
    if (got.back() == "0:done")
      got.back() += std::equal(src.begin(), src.end(), dst.begin() + 50) ? "+intact" : "+torn";
    cv.notify_all();
  });
  RemoteRegion remote{rd->id, rd->length, rd->keys};  // what rank 1 would publish
  auto op = a.iwrite(1, rs, 0, remote, 50, kLen);
  ASSERT_TRUE(op.is_ok()) << op.status().to_string();
  ASSERT_TRUE(a.wait(*op).is_ok());
  const std::string done = "done";
  ASSERT_TRUE(
      a.send_message(1, Bytes(reinterpret_cast<const std::byte*>(done.data()),
                              reinterpret_cast<const std::byte*>(done.data()) + done.size()))
          .is_ok());
  std::unique_lock lock(m);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return !got.empty(); }));
  EXPECT_EQ(got[0], "0:done+intact");
  EXPECT_EQ(dst[49], std::byte{0});
  EXPECT_EQ(dst[50 + kLen], std::byte{0});
  // Bad input: past the remote region, to self, an oversized message.
  EXPECT_EQ(a.iwrite(1, rs, 0, remote, 200, kLen).status().message(),
            "write: " + std::to_string(kLen) + " bytes at offset 200 exceed rank 1's region of " +
                std::to_string(kLen + 100) + " bytes");
  EXPECT_EQ(a.iwrite(0, rs, 0, remote, 0, 10).status().message(),
            "write: a one-sided write to this rank itself");
  EXPECT_EQ(a.send_message(1, Bytes(70000)).message(), "message of 70000 bytes exceeds 64 KiB");
}

// The KV engine and the application share the channels: each service's messages reach its own
// handler only, on the rails and on the control path alike.
TEST(Fabric, MessagesOfEachServiceReachOnlyItsOwnHandler) {
  auto w = make_world(2);
  ASSERT_EQ(w.ranks.size(), 2u);
  auto& a = *w.ranks[0];
  auto& b = *w.ranks[1];
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::string> app, kv;
  const auto text = [](const Bytes& p) {
    return std::string(reinterpret_cast<const char*>(p.data()), p.size());
  };
  const auto bytes = [](const std::string& t) {
    return Bytes(reinterpret_cast<const std::byte*>(t.data()),
                 reinterpret_cast<const std::byte*>(t.data()) + t.size());
  };
  b.set_message_handler([&](int, Bytes p) {
    std::lock_guard lock(m);
    app.push_back(text(p));
    cv.notify_all();
  });
  b.set_message_handler(Fabric::Service::kKvTransfer, [&](int, Bytes p) {
    std::lock_guard lock(m);
    kv.push_back(text(p));
    cv.notify_all();
  });
  ASSERT_TRUE(a.send_message(1, bytes("app 1")).is_ok());
  ASSERT_TRUE(a.send_message(1, Fabric::Service::kKvTransfer, bytes("kv 1")).is_ok());
  ASSERT_TRUE(a.send_message(1, bytes("app 2"), true).is_ok());
  ASSERT_TRUE(a.send_message(1, Fabric::Service::kKvTransfer, bytes("kv 2"), true).is_ok());
  ASSERT_TRUE(a.send_message(1, Fabric::Service::kKvTransfer, Bytes{}).is_ok());
  // From the progress loop (a completion's or a handler's), the control path is written by the
  // out-of-band sender's thread: the loop does not wait for it, and the message arrives.
  ASSERT_TRUE(a.endpoint()
                  .engine()
                  .call([&] {
                    return a.send_message(1, Fabric::Service::kKvTransfer, bytes("kv 3"), true);
                  })
                  .is_ok());
  {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10),
                            [&] { return app.size() == 2 && kv.size() == 4; }));
    // The control path is not ordered with the rails.
    std::sort(app.begin(), app.end());
    std::sort(kv.begin(), kv.end());
    EXPECT_EQ(app, (std::vector<std::string>{"app 1", "app 2"}));
    EXPECT_EQ(kv, (std::vector<std::string>{"", "kv 1", "kv 2", "kv 3"}));
  }
  // Without a handler, a service's messages are dropped; the others still arrive.
  b.set_message_handler(Fabric::Service::kKvTransfer, nullptr);
  ASSERT_TRUE(a.send_message(1, Fabric::Service::kKvTransfer, bytes("kv 5")).is_ok());
  ASSERT_TRUE(a.send_message(1, bytes("app 3")).is_ok());
  std::unique_lock lock(m);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return app.size() == 3; }));
  EXPECT_EQ(app.back(), "app 3");
  EXPECT_EQ(kv.size(), 4u);
  EXPECT_EQ(a.send_message(1, static_cast<Fabric::Service>(7), Bytes{}).message(),
            "message: unknown service 7");
}

}  // namespace
// A job without a token keys its rails' handshakes with the all-zero token, which anyone knows:
// allowed only where every rail is loopback, or where R2CCL_INSECURE_NO_TOKEN=1 says so.
TEST(Fabric, NoTokenOnlyWhereEveryRailIsLoopback) {
  const auto rail = [](const char* nic, const char* address) {
    EndpointInfo::Rail r;
    r.nic = nic;
    r.address = address;
    return r;
  };
  const std::vector<EndpointInfo::Rail> loopback = {rail("lo", "127.0.0.11"),
                                                    rail("lo", "127.1.2.3")};
  const std::vector<EndpointInfo::Rail> mixed = {
      rail("lo", "127.0.0.11"), rail("eth1", "198.18.0.1"), rail("eth2", "198.18.1.1")};
  EXPECT_TRUE(check_rails_need_no_token(Token{}, loopback, false).is_ok());
  const Status refused = check_rails_need_no_token(Token{}, mixed, false);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.code(), ErrorCode::kConfig);
  for (const char* part : {"R2CCL_BOOTSTRAP_TOKEN is not set", "eth1 198.18.0.1", "eth2 198.18.1.1",
                           "R2CCL_INSECURE_NO_TOKEN=1"})
    EXPECT_NE(refused.message().find(part), std::string::npos) << part << ": " << refused.message();
  EXPECT_EQ(refused.message().find("127.0.0.11"), std::string::npos) << refused.message();
  Token token{};
  token[0] = 1;
  EXPECT_TRUE(check_rails_need_no_token(token, mixed, false).is_ok());
  EXPECT_TRUE(check_rails_need_no_token(Token{}, mixed, true).is_ok());
}

}  // namespace r2ccl

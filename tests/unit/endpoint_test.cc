// Endpoints that were never in a world: blobs and handles, connection by blob, peers that
// disconnect, restart as a new incarnation, connect at the same time as each other.
#include "r2ccl/runtime/endpoint.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "test_util.h"

namespace r2ccl {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<Endpoint> make_endpoint(int host, const std::string& name,
                                        std::map<std::string, std::string> vars = {},
                                        std::optional<Token> token = std::nullopt) {
  vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2,127.0.{0}.3,127.0.{0}.4", 20 + host);
  vars["R2CCL_CHUNK_SIZE"] = "64K";
  vars["R2CCL_TIMEOUT"] = "10s";
  auto cfg = parse_config(test::env_of(vars));
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  EndpointOptions o;
  o.name = name;
  o.token = token;
  auto e = Endpoint::create(*cfg, o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return e.is_ok() ? std::move(*e) : nullptr;
}

std::vector<std::byte> pattern(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(seed) * 17) >> 3);
  return v;
}

// Peer events of an endpoint, waited for from the test.
struct PeerLog {
  std::mutex m;
  std::condition_variable cv;
  std::vector<Endpoint::PeerEvent> events;
  void attach(Endpoint& e) {
    e.set_peer_handler([this](const Endpoint::PeerEvent& ev) {
      std::lock_guard lock(m);
      events.push_back(ev);
      cv.notify_all();
    });
  }
  // The first event of `kind`, waited for at most 10 s.
  std::optional<Endpoint::PeerEvent> wait(Endpoint::PeerEvent::Kind kind, std::size_t nth = 0) {
    std::unique_lock lock(m);
    std::optional<Endpoint::PeerEvent> out;
    cv.wait_for(lock, std::chrono::seconds(10), [&] {
      std::size_t seen = 0;
      for (const auto& e : events)
        if (e.kind == kind && seen++ == nth) {
          out = e;
          return true;
        }
      return false;
    });
    return out;
  }
};

// Sends n bytes a -> b (b receives from its peer id `from`), verified.
void exchange(Endpoint& a, int to, Endpoint& b, int from, std::size_t n, int seed) {
  auto src = pattern(n, seed);
  std::vector<std::byte> dst(n, std::byte{0xEE});
  auto rs = a.register_memory(src.data(), n, MemoryAccess::kLocal);  // only sent from
  auto rd = b.register_memory(dst.data(), n);
  ASSERT_TRUE(rs.is_ok() && rd.is_ok());
  // Nothing is received into memory that peers may not write.
  EXPECT_EQ(a.irecv(to, *rs, 0, n).status().message(),
            "receive: the region is registered for local access only; register it with "
            "MemoryAccess::kRemoteWrite to let peers write into it");
  auto recv = b.irecv(from, *rd, 0, n);
  auto send = a.isend(to, *rs, 0, n);
  ASSERT_TRUE(recv.is_ok() && send.is_ok());
  ASSERT_TRUE(a.wait(*send).is_ok()) << a.wait(*send).to_string();
  ASSERT_TRUE(b.wait(*recv).is_ok()) << b.wait(*recv).to_string();
  EXPECT_EQ(src, dst);
  (void)a.deregister_memory(*rs);
  (void)b.deregister_memory(*rd);
}

TEST(EndpointBlob, RoundTripsAndTheHandleFitsIn128Bytes) {
  auto a = make_endpoint(0, "prefill-0");
  ASSERT_TRUE(a);
  const Bytes blob = a->blob();
  auto info = EndpointInfo::decode(blob);
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  EXPECT_EQ(info->name, "prefill-0");
  EXPECT_EQ(info->incarnation, a->incarnation());
  EXPECT_NE(info->incarnation, 0u);
  ASSERT_TRUE(info->token);
  ASSERT_EQ(info->rails.size(), 4u);
  EXPECT_EQ(info->rails[2].address, "127.0.20.3");
  EXPECT_EQ(info->label(), fmt::format("peer 'prefill-0' (incarnation {:016x})", a->incarnation()));

  auto handle = a->handle();
  ASSERT_TRUE(handle.is_ok()) << handle.status().to_string();
  EXPECT_LE(handle->size(), 128u);
  auto h = EndpointInfo::decode(*handle);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h->incarnation, a->incarnation());
  EXPECT_EQ(h->token, info->token);
  ASSERT_EQ(h->rails.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(h->rails[i].address, info->rails[i].address);
    EXPECT_EQ(h->rails[i].endpoint, info->rails[i].endpoint);
    EXPECT_EQ(h->rails[i].probe_port, info->rails[i].probe_port);
  }

  // A handle is refused, saying why, when it names no rail, more rails than fit, or a provider
  // that does not exist (byte 5: provider, byte 6: rails).
  Bytes none = *handle;
  none[6] = std::byte{0};
  EXPECT_EQ(EndpointInfo::decode(none).status().message(),
            "endpoint handle names 0 rails (1 to 12)");
  Bytes many = *handle;
  many[6] = std::byte{200};
  EXPECT_EQ(EndpointInfo::decode(many).status().message(),
            "endpoint handle names 200 rails (1 to 12)");
  Bytes odd = *handle;
  odd[5] = std::byte{7};
  EXPECT_EQ(EndpointInfo::decode(odd).status().message(),
            "endpoint handle names provider 7 (0: tcp, 1: verbs)");

  // Text form, and what is wrong with bad input.
  auto back = blob_from_hex(blob_to_hex(blob) + "\n");
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(*back, blob);
  EXPECT_EQ(blob_from_hex("12z4").status().message(),
            "endpoint blob text has 'z' at 2: not a hex digit");
  EXPECT_NE(blob_from_hex("123").status().message().find("not an even number of hex digits"),
            std::string::npos);
  Bytes junk(40, std::byte{7});
  EXPECT_EQ(EndpointInfo::decode(junk).status().message(),
            "not an r2ccl endpoint blob or handle (wrong magic number)");
  Bytes cut(blob.begin(), blob.begin() + 30);
  EXPECT_FALSE(EndpointInfo::decode(cut).is_ok());
  Bytes huge(3000, std::byte{0});
  EXPECT_EQ(EndpointInfo::decode(huge).status().message(),
            "endpoint blob of 3000 bytes exceeds 2048");
  // A blob of a later version is refused, naming both versions.
  Bytes later = blob;
  later[4] = std::byte{9};
  EXPECT_EQ(EndpointInfo::decode(later).status().message(),
            "endpoint blob of version 9 (this build reads 1)");
  EXPECT_EQ(a->connect(blob).status().message(), "that blob describes this endpoint itself");
}

TEST(Endpoint, TwoEndpointsNeverInAWorldExchangeDataOverEveryRail) {
  PeerLog log;  // outlives the endpoints: their handlers write to it
  auto a = make_endpoint(0, "A");
  auto b = make_endpoint(1, "B");
  ASSERT_TRUE(a && b);
  log.attach(*a);
  auto id = b->connect(a->blob());
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  auto joined = log.wait(Endpoint::PeerEvent::Kind::kJoined);
  ASSERT_TRUE(joined);
  EXPECT_EQ(joined->label, fmt::format("peer 'B' (incarnation {:016x})", b->incarnation()));
  EXPECT_EQ(b->rails_to(*id), 4u);
  exchange(*b, *id, *a, joined->peer, 3 * 1024 * 1024 + 5, 1);
  exchange(*a, joined->peer, *b, *id, 2 * 1024 * 1024 + 1, 2);
  std::map<std::uint32_t, std::uint64_t> tx;
  for (const auto& r : b->rail_snapshot())
    tx[r.rail] += r.tx_bytes;
  ASSERT_EQ(tx.size(), 4u);
  for (const auto& [rail, bytes] : tx)
    EXPECT_GT(bytes, 0u) << "rail " << rail;
  // Connecting again to the same endpoint gives the same peer.
  auto again = b->connect(a->blob());
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, *id);
}

// A blob whose token was changed does not get in: every rail's hello fails the challenge, and
// the connection attempt ends with the reason.
TEST(Endpoint, ABlobWithAnotherTokenDoesNotConnect) {
  auto a = make_endpoint(0, "A");
  auto b = make_endpoint(1, "B", {{"R2CCL_CONNECT_TIMEOUT", "1s"}});
  ASSERT_TRUE(a && b);
  auto info = EndpointInfo::decode(a->blob());
  ASSERT_TRUE(info.is_ok());
  (*info->token)[0] ^= 0xff;
  auto id = b->connect(info->encode(true));
  ASSERT_FALSE(id.is_ok());
  EXPECT_NE(id.status().message().find("could not open any rail"), std::string::npos)
      << id.status().message();
  EXPECT_NE(id.status().message().find("wrong token"), std::string::npos) << id.status().message();
  EXPECT_GE(a->provider_counters().dropped_connections, 1u);
  EXPECT_TRUE(a->peers().empty());
}

// Whether every rail of `e` to `peer` has a round-trip time (its probes were answered), waited for
// at most 10 s.
bool probes_answered(Endpoint& e, int peer) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    std::size_t rails = 0, answered = 0;
    for (const auto& r : e.rail_snapshot())
      if (r.peer == peer) {
        ++rails;
        answered += r.rtt_ns > 0;
      }
    if (rails > 0 && answered == rails) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return false;
}

// Probes go where the rails' connections go, never to the address a peer's description names for
// them (review N-m20: a peer could make the endpoint probe any host, 50 times a second per rail).
// A's blob is altered to name decoy addresses, at the probe ports A really uses: B connects, both
// sides' probes are answered at the real NICs, and not one probe reaches a decoy.
TEST(Endpoint, ProbesGoWhereTheRailsConnectNeverWhereThePeerSaysTheyShould) {
  PeerLog log;  // outlives the endpoints: their handlers write to it
  // One token for both, as in a world: a probe's tag is its sender's token's.
  Token token{};
  token.fill(0x5a);
  auto a = make_endpoint(0, "A", {}, token);
  auto b = make_endpoint(1, "B", {}, token);
  ASSERT_TRUE(a && b);
  log.attach(*a);
  auto info = EndpointInfo::decode(a->blob());
  ASSERT_TRUE(info.is_ok());
  std::vector<int> decoys;
  for (std::size_t i = 0; i < info->rails.size(); ++i) {
    const std::string decoy = fmt::format("127.0.30.{}", i + 1);
    const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(info->rails[i].probe_port);
    inet_pton(AF_INET, decoy.c_str(), &sa.sin_addr);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << decoy;
    decoys.push_back(fd);
    info->rails[i].address = decoy;
  }
  auto id = b->connect(info->encode(true));
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  auto joined = log.wait(Endpoint::PeerEvent::Kind::kJoined);
  ASSERT_TRUE(joined);
  EXPECT_TRUE(probes_answered(*b, *id));
  EXPECT_TRUE(probes_answered(*a, joined->peer));
  for (std::size_t i = 0; i < decoys.size(); ++i) {
    std::array<std::byte, 256> buf{};
    EXPECT_LT(::recv(decoys[i], buf.data(), buf.size(), MSG_DONTWAIT), 0)
        << "a probe reached decoy " << info->rails[i].address;
    ::close(decoys[i]);
  }
}

TEST(Endpoint, ConnectsFromTheCompactHandle) {
  PeerLog log;  // outlives the endpoints: their handlers write to it
  auto a = make_endpoint(0, "A");
  auto b = make_endpoint(1, "B");
  ASSERT_TRUE(a && b);
  log.attach(*a);
  auto id = b->connect(*a->handle());
  ASSERT_TRUE(id.is_ok()) << id.status().to_string();
  auto joined = log.wait(Endpoint::PeerEvent::Kind::kJoined);
  ASSERT_TRUE(joined);
  exchange(*b, *id, *a, joined->peer, 1024 * 1024, 3);
}

TEST(Endpoint, OperationsWithAPeerThatLeftFailNamingIt) {
  PeerLog log;  // outlives the endpoints: their handlers write to it
  auto a = make_endpoint(0, "A");
  auto b = make_endpoint(1, "B");
  ASSERT_TRUE(a && b);
  log.attach(*a);
  ASSERT_TRUE(b->connect(a->blob()).is_ok());
  auto joined = log.wait(Endpoint::PeerEvent::Kind::kJoined);
  ASSERT_TRUE(joined);
  const std::string label = joined->label;
  std::vector<std::byte> buf(1 << 20);
  auto reg = a->register_memory(buf.data(), buf.size());
  ASSERT_TRUE(reg.is_ok());
  auto pending = a->irecv(joined->peer, *reg, 0, buf.size());
  ASSERT_TRUE(pending.is_ok());
  b.reset();  // says goodbye
  auto left = log.wait(Endpoint::PeerEvent::Kind::kLeft);
  ASSERT_TRUE(left);
  EXPECT_EQ(left->why, "it disconnected");
  Status st = a->wait(*pending);
  EXPECT_EQ(st.code(), ErrorCode::kAborted);
  EXPECT_EQ(st.message(), label + " is gone: it disconnected");
  // Later operations fail at once, naming it too.
  auto later = a->isend(joined->peer, *reg, 0, 100);
  ASSERT_TRUE(later.is_ok());
  EXPECT_EQ(a->wait(*later).message(), label + " is gone: it disconnected");
  EXPECT_EQ(a->isend(12345, *reg, 0, 1).status().message(), "send: no peer has id 12345");
}

// Deregistering a region ends the operations still on it, naming the region, on this side and
// (for a two-sided one) on the peer's: neither waits for its deadline, and the endpoint carries
// the next operation whole.
TEST(Endpoint, DeregisteringARegionEndsTheOperationsOnIt) {
  PeerLog log;
  auto a = make_endpoint(0, "A");
  auto b = make_endpoint(1, "B");
  ASSERT_TRUE(a && b);
  log.attach(*a);
  ASSERT_TRUE(b->connect(a->blob()).is_ok());
  auto joined = log.wait(Endpoint::PeerEvent::Kind::kJoined);
  ASSERT_TRUE(joined);
  const int b_on_a = joined->peer;
  const auto peers_on_b = b->peers();
  ASSERT_EQ(peers_on_b.size(), 1u);
  const int a_on_b = peers_on_b[0].id;
  constexpr std::size_t kLen = std::size_t{8} << 20;  // sent by clear-to-send, not eagerly
  std::vector<std::byte> src(kLen, std::byte{0x5a}), dst(kLen, std::byte{0});
  auto sreg = a->register_memory(src.data(), src.size(), MemoryAccess::kLocal);
  ASSERT_TRUE(sreg.is_ok());
  // A's receive, which B never sends to: it ends once its region goes.
  auto rreg = a->register_memory(dst.data(), dst.size());
  ASSERT_TRUE(rreg.is_ok());
  auto recv = a->irecv(b_on_a, *rreg, 0, kLen);
  ASSERT_TRUE(recv.is_ok());
  ASSERT_TRUE(a->deregister_memory(*rreg).is_ok());
  Status st = a->wait(*recv);
  EXPECT_EQ(st.code(), ErrorCode::kAborted) << st.to_string();
  EXPECT_NE(st.message().find(fmt::format("region #{} ({} bytes at ", (*rreg)->id, kLen)),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("was deregistered while the operation used it"), std::string::npos)
      << st.message();
  // A's send, whose receive B has not posted yet: it ends, and B's receive posted later ends
  // with the same reason instead of waiting for the data.
  auto send = a->isend(b_on_a, *sreg, 0, kLen);
  ASSERT_TRUE(send.is_ok());
  ASSERT_TRUE(a->deregister_memory(*sreg).is_ok());
  st = a->wait(*send);
  EXPECT_EQ(st.code(), ErrorCode::kAborted) << st.to_string();
  EXPECT_NE(st.message().find("was deregistered while the operation used it"), std::string::npos)
      << st.message();
  // B's receive of that message, posted afterwards, ends at once with A's reason.
  auto dreg = b->register_memory(dst.data(), dst.size());
  ASSERT_TRUE(dreg.is_ok());
  auto late = b->irecv(a_on_b, *dreg, 0, kLen);
  ASSERT_TRUE(late.is_ok());
  st = b->wait(*late);
  EXPECT_EQ(st.code(), ErrorCode::kAborted) << st.to_string();
  EXPECT_NE(st.message().find("was deregistered while the operation used it"), std::string::npos)
      << st.message();
  // The endpoint carries the next transfer whole.
  auto sreg2 = a->register_memory(src.data(), src.size(), MemoryAccess::kLocal);
  ASSERT_TRUE(sreg2.is_ok());
  auto recv2 = b->irecv(a_on_b, *dreg, 0, kLen);
  auto send2 = a->isend(b_on_a, *sreg2, 0, kLen);
  ASSERT_TRUE(recv2.is_ok() && send2.is_ok());
  EXPECT_TRUE(a->wait(*send2).is_ok());
  EXPECT_TRUE(b->wait(*recv2).is_ok());
  EXPECT_EQ(dst, src);
}

// A process that started again connects with its old name at a new incarnation. Its old
// incarnation's connections are gone (its process ended without a goodbye: here, abort() closes
// them), so the old peer is evicted: operations towards it fail at once, naming why.
TEST(Endpoint, APeerStartedAgainIsANewIncarnationAndTheOldOneIsGone) {
  PeerLog log;  // outlives the endpoints: their handlers write to it
  auto a = make_endpoint(0, "A");
  auto b1 = make_endpoint(1, "B");
  // The same name again, from another process (here: another endpoint), made ready beforehand.
  auto b2 = make_endpoint(2, "B");
  ASSERT_TRUE(a && b1 && b2);
  log.attach(*a);
  ASSERT_TRUE(b1->connect(a->blob()).is_ok());
  auto first = log.wait(Endpoint::PeerEvent::Kind::kJoined, 0);
  ASSERT_TRUE(first);
  b1->abort("it crashed");  // closes its rails; no goodbye
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto rails_of_first = [&] {
    for (const auto& p : a->peers())
      if (p.id == first->peer) return p.rails;
    return std::size_t{99};
  };
  while (rails_of_first() != 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(milliseconds(5));
  ASSERT_EQ(rails_of_first(), 0u);
  auto id2 = b2->connect(a->blob());
  ASSERT_TRUE(id2.is_ok()) << id2.status().to_string();
  auto second = log.wait(Endpoint::PeerEvent::Kind::kJoined, 1);
  ASSERT_TRUE(second);
  EXPECT_NE(second->peer, first->peer);
  auto left = log.wait(Endpoint::PeerEvent::Kind::kLeft);
  ASSERT_TRUE(left);
  EXPECT_EQ(left->peer, first->peer);
  EXPECT_EQ(left->why, fmt::format("it started again as incarnation {:016x}", b2->incarnation()));
  std::vector<std::byte> buf(64);
  auto reg = a->register_memory(buf.data(), buf.size());
  auto op = a->isend(first->peer, *reg, 0, 64);
  ASSERT_TRUE(op.is_ok());
  EXPECT_EQ(a->wait(*op).message(),
            fmt::format("peer 'B' (incarnation {:016x}) is gone: it started again as incarnation "
                        "{:016x}",
                        b1->incarnation(), b2->incarnation()));
  exchange(*b2, *id2, *a, second->peer, 1024 * 1024 + 3, 4);
}

// A name proves nothing: it is chosen by the process that connects (two replicas configured
// alike, or anyone holding the token). A peer that connects with the name of a peer that is
// still connected does not evict it: both are peers, each with its own id, and both exchange data.
TEST(Endpoint, APeerWithTheNameOfALiveOneIsAnotherPeerAndEvictsNothing) {
  PeerLog log;  // outlives the endpoints: their handlers write to it
  auto a = make_endpoint(0, "A");
  auto b1 = make_endpoint(1, "B");
  auto b2 = make_endpoint(2, "B");
  ASSERT_TRUE(a && b1 && b2);
  log.attach(*a);
  auto id1 = b1->connect(a->blob());
  ASSERT_TRUE(id1.is_ok()) << id1.status().to_string();
  auto first = log.wait(Endpoint::PeerEvent::Kind::kJoined, 0);
  ASSERT_TRUE(first);
  auto id2 = b2->connect(a->blob());
  ASSERT_TRUE(id2.is_ok()) << id2.status().to_string();
  auto second = log.wait(Endpoint::PeerEvent::Kind::kJoined, 1);
  ASSERT_TRUE(second);
  EXPECT_NE(second->peer, first->peer);
  EXPECT_EQ(second->label, fmt::format("peer 'B' (incarnation {:016x})", b2->incarnation()));
  // Both are still there, and each carries its own data, both ways.
  exchange(*b1, *id1, *a, first->peer, 1024 * 1024 + 7, 7);
  exchange(*b2, *id2, *a, second->peer, 1024 * 1024 + 9, 8);
  exchange(*a, first->peer, *b1, *id1, 5000, 9);
  exchange(*a, second->peer, *b2, *id2, 5001, 10);
  const auto peers = a->peers();
  ASSERT_EQ(peers.size(), 2u);
  for (const auto& p : peers)
    EXPECT_TRUE(p.alive) << p.label;
  std::lock_guard lock(log.m);
  for (const auto& e : log.events)
    EXPECT_NE(e.kind, Endpoint::PeerEvent::Kind::kLeft) << e.label << ": " << e.why;
}

// An operation is checked on the caller's thread and posted on the progress loop; the peer may be
// forgotten in between (a departed peer's channel is dropped once 256 more have left). The loop
// then fails the operation naming the peer, instead of using a channel that is gone. Here the
// loop is held inside the peer handler while the 257th departure is being retired.
TEST(Endpoint, AnOperationWhosePeerIsForgottenBeforeTheLoopRunsItFailsNamingIt) {
  // Declared before the endpoint, whose handler uses them.
  std::mutex m;
  std::condition_variable cv;
  bool holding = false, release = false;
  int hold_on = -1;
  auto a = make_endpoint(0, "A");
  ASSERT_TRUE(a);
  auto self = EndpointInfo::decode(a->blob());
  ASSERT_TRUE(self.is_ok());
  // Peers that are added and never connected (their blobs name this endpoint's rails).
  auto add = [&](std::uint64_t incarnation) {
    EndpointInfo info = *self;
    info.incarnation = incarnation;
    info.name = fmt::format("gone-{}", incarnation);
    auto id = a->add_peer(info.encode(true), Endpoint::PeerOptions{});
    EXPECT_TRUE(id.is_ok()) << id.status().to_string();
    return id.value_or(-1);
  };
  a->set_peer_handler([&](const Endpoint::PeerEvent& e) {
    std::unique_lock lock(m);
    if (e.kind != Endpoint::PeerEvent::Kind::kLeft || e.peer != hold_on) return;
    holding = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return release; });
  });
  const int first = add(1000);
  a->peer_left(first, "it went away");
  std::vector<int> others;
  for (std::uint64_t k = 1; k <= 256; ++k)
    others.push_back(add(1000 + k));
  {
    std::lock_guard lock(m);
    hold_on = others.back();
  }
  for (int id : others)
    a->peer_left(id, "it went away");
  {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return holding; }));
  }
  // The loop is held in the 257th departure's handler: `first` is still known here...
  std::vector<std::byte> buf(4096);
  auto reg = a->register_memory(buf.data(), buf.size());
  ASSERT_TRUE(reg.is_ok());
  auto send = a->isend(first, *reg, 0, 100);
  auto recv = a->irecv(first, *reg, 0, 100);
  auto write = a->iwrite(first, *reg, 0, RemoteRegion{1, 4096, {1, 1, 1, 1}}, 0, 100);
  ASSERT_TRUE(send.is_ok() && recv.is_ok() && write.is_ok());
  EXPECT_TRUE(a->send_message(first, 0, Bytes(10)).is_ok());
  // ... and forgotten by the time the loop runs the operations.
  {
    std::lock_guard lock(m);
    release = true;
  }
  cv.notify_all();
  EXPECT_EQ(a->wait(*send).to_string(), "aborted: send: peer 0 left long ago");
  EXPECT_EQ(a->wait(*recv).to_string(), "aborted: receive: peer 0 left long ago");
  EXPECT_EQ(a->wait(*write).to_string(), "aborted: write: peer 0 left long ago");
  EXPECT_EQ(a->peer_label(first).status().message(), "peer 0 left long ago");
  EXPECT_EQ(a->isend(first, *reg, 0, 100).status().message(), "send: peer 0 left long ago");
  a->set_peer_handler(nullptr);
}

// Ids are never handed out twice and have no cap short of INT_MAX (a long-lived endpoint whose
// peers keep coming and going must not run out); what a departed peer held is dropped once 256
// more have left, so the table stays as large as the peers that are there.
TEST(Endpoint, PeerIdsAreNeverReusedAndDepartedPeersAreForgotten) {
  auto a = make_endpoint(0, "A");
  ASSERT_TRUE(a);
  auto self = EndpointInfo::decode(a->blob());
  ASSERT_TRUE(self.is_ok());
  auto add = [&](std::uint64_t incarnation, int id) {
    EndpointInfo info = *self;
    info.incarnation = incarnation;
    info.name = fmt::format("peer-{}", incarnation);
    Endpoint::PeerOptions o;
    o.id = id;
    return a->add_peer(info.encode(true), o);
  };
  const int high = (1 << 20) + 5;  // past the 2^20 ids an endpoint used to hand out at most
  auto explicit_id = add(5000, high);
  ASSERT_TRUE(explicit_id.is_ok()) << explicit_id.status().to_string();
  EXPECT_EQ(*explicit_id, high);
  EXPECT_EQ(add(5001, high).status().message(), fmt::format("peer id {} is in use", high));
  int last = high;
  for (std::uint64_t k = 0; k < 300; ++k) {
    auto id = add(6000 + k, -1);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    EXPECT_EQ(*id, last + 1);
    last = *id;
    a->peer_left(*id, "it went away");
  }
  // peers() runs on the loop, after the departures: the explicit peer, and the last 256 that
  // left; the 44 before them are forgotten.
  EXPECT_EQ(a->peers().size(), 1u + 256u);
  EXPECT_TRUE(a->peer_label(high).is_ok());
  EXPECT_EQ(a->peer_label(high + 1).status().message(),
            fmt::format("peer {} left long ago", high + 1));
  EXPECT_EQ(a->peer_label(last + 1).status().message(), fmt::format("no peer has id {}", last + 1));
}

TEST(Endpoint, ConnectingToAPeerAlreadyConnectedReturnsItsChannel) {
  auto a = make_endpoint(0, "A");
  auto b = make_endpoint(1, "B");
  ASSERT_TRUE(a && b);
  auto first = a->connect(b->blob());
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  auto again = a->connect(b->blob());
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(*again, *first);
  EXPECT_EQ(a->peers().size(), 1u);
  const auto from_b = b->peers();
  ASSERT_EQ(from_b.size(), 1u);
  exchange(*a, *first, *b, from_b[0].id, 1024 * 1024, 8);
}

std::mutex warnings_mutex;
std::vector<std::string> warnings;
void keep_warnings(LogLevel level, std::string_view message) {
  if (level > LogLevel::kWarn) return;
  std::lock_guard lock(warnings_mutex);
  warnings.emplace_back(message);
}

TEST(Endpoint, TwoEndpointsConnectingToEachOtherAtOnceShareOneChannelAndStartWithEveryRail) {
  // The higher incarnation's rails are opened, then closed by the peer, whose own arrive a moment
  // later: that side must not report starting without them, whichever comes first.
  set_log_sink(keep_warnings);
  for (int round = 0; round < 5; ++round) {
    auto a = make_endpoint(0, "A");
    auto b = make_endpoint(1, "B");
    ASSERT_TRUE(a && b);
    auto fa = std::async(std::launch::async, [&] { return a->connect(b->blob()); });
    auto fb = std::async(std::launch::async, [&] { return b->connect(a->blob()); });
    auto ia = fa.get();
    auto ib = fb.get();
    ASSERT_TRUE(ia.is_ok()) << round << ": " << ia.status().to_string();
    ASSERT_TRUE(ib.is_ok()) << round << ": " << ib.status().to_string();
    EXPECT_EQ(a->peers().size(), 1u);
    EXPECT_EQ(b->peers().size(), 1u);
    exchange(*a, *ia, *b, *ib, 2 * 1024 * 1024, 5);
    exchange(*b, *ib, *a, *ia, 100, 6);
  }
  set_log_sink(nullptr);
  std::lock_guard lock(warnings_mutex);
  EXPECT_TRUE(warnings.empty()) << fmt::format("{}", fmt::join(warnings, "\n"));
}

}  // namespace
}  // namespace r2ccl

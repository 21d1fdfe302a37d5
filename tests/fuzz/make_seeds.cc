// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/NAME/): well-formed inputs of
// every kind each target reads, made with the encoders the runtime itself uses.
//   make_seeds CORPUS_DIR
#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bootstrap/frames.h"
#include "channel/protocol.h"
#include "common/handshake.h"
#include "r2ccl/kv/layout.h"
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/memory.h"
#include "r2ccl/runtime/probe_protocol.h"
#include "tcp/frame.h"

using namespace r2ccl;
namespace fs = std::filesystem;

namespace {
fs::path g_root;

void seed(const std::string& fuzzer, const std::string& name, const Bytes& bytes) {
  const fs::path dir = g_root / fuzzer;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
}
Bytes with_selector(std::uint8_t selector, const Bytes& body) {
  Bytes out{std::byte{selector}};
  out.insert(out.end(), body.begin(), body.end());
  return out;
}
Bytes text(const std::string& s) {
  return Bytes(reinterpret_cast<const std::byte*>(s.data()),
               reinterpret_cast<const std::byte*>(s.data()) + s.size());
}

void bootstrap() {
  using namespace bootstrap_wire;
  const auto h = encode_header(FrameType::kHello, 100);
  seed("fuzz_bootstrap", "header", with_selector(0, Bytes(h.begin(), h.end())));
  ByteWriter hello;
  hello.u32(kVersion).u32(1).u32(4).blob(text("rank 1's endpoint blob"));
  const std::uint8_t zeros[48] = {};
  hello.raw(zeros, 48);
  seed("fuzz_bootstrap", "hello", with_selector(1, hello.take()));
  seed("fuzz_bootstrap", "coll", with_selector(2, ByteWriter().u64(3).blob(text("mine")).take()));
  seed("fuzz_bootstrap", "send", with_selector(3, ByteWriter().u32(2).blob(text("msg")).take()));
  ByteWriter welcome;
  welcome.raw(zeros, 32).u32(2).blob(text("a")).blob(text("b"));
  seed("fuzz_bootstrap", "welcome", with_selector(24, welcome.take()));
  seed("fuzz_bootstrap", "coll_result",
       with_selector(25, ByteWriter().u64(1).u32(2).blob(text("a")).blob(text("b")).take()));
  seed("fuzz_bootstrap", "deliver",
       with_selector(6, ByteWriter().u32(1).blob(encode_sequenced(1, text("m"))).take()));
  seed("fuzz_bootstrap", "direct",
       with_selector(6, encode_direct(DirectKind::kContribution, 2, text("blob"))));
  seed("fuzz_bootstrap", "peer_left",
       with_selector(7, ByteWriter().u32(1).str("rank 1 left").take()));
  seed("fuzz_bootstrap", "error", with_selector(8, ByteWriter().str("refused").take()));
  const std::uint8_t token[16] = {1, 2, 3};
  seed("fuzz_bootstrap", "unique_id",
       with_selector(9,
                     ByteWriter().u32(kIdMagic).str("127.0.0.1").u16(5000).raw(token, 16).take()));
}

void handshake() {
  const Token token{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const crypto::Nonce challenge{9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};
  RailHello h{token, 5, 6, 2, 1, std::make_shared<const Bytes>(text("description"))};
  crypto::Nonce client{};
  seed("fuzz_handshake", "hello", *encode_hello(h, challenge, &client));
  seed("fuzz_handshake", "endpoint", encode_endpoint("198.18.0.1", 4000));
}

Bytes tcp_frame(std::uint8_t op, std::uint64_t key, std::uint64_t offset, const Bytes& payload,
                std::uint64_t cookie, std::uint8_t flags = 0) {
  // The harness gives key 1 the region's key, and a checksum of 0 its checksum: left 0 here.
  const auto h = tcp_frame::encode(
      {static_cast<tcp_frame::Op>(op), flags, 7, key, offset, payload.size(), cookie});
  Bytes f(h.begin(), h.end());
  store_le(f.data() + tcp_frame::kChecksumAt, std::uint32_t{0});
  f.insert(f.end(), payload.begin(), payload.end());
  return f;
}

void tcp_stream() {
  const Bytes data(200, std::byte{0x42});
  Bytes s = tcp_frame(3, 1, 0, data, 11);
  const Bytes more = tcp_frame(3, 1, 1000, data, 12, 1);
  s.insert(s.end(), more.begin(), more.end());
  const Bytes last = tcp_frame(3, 1, 1200, data, 12);
  s.insert(s.end(), last.begin(), last.end());
  seed("fuzz_tcp_stream", "writes", s);
  Bytes c = tcp_frame(6, 0, 0, text("control"), 13);
  const Bytes ack = tcp_frame(4, 0, 0, {}, 11);
  const Bytes nack = tcp_frame(5, 0, 0, text("refused"), 12);
  c.insert(c.end(), ack.begin(), ack.end());
  c.insert(c.end(), nack.begin(), nack.end());
  seed("fuzz_tcp_stream", "control", c);
  seed("fuzz_tcp_stream", "outside", tcp_frame(3, 1, 65500, data, 14));
}

Bytes record(std::uint8_t kind, std::uint8_t rail, const Bytes& body) {
  Bytes r{std::byte{kind}, std::byte{rail}, static_cast<std::byte>(body.size() & 0xff),
          static_cast<std::byte>(body.size() >> 8)};
  r.insert(r.end(), body.begin(), body.end());
  return r;
}

void channel() {
  Bytes clean;
  for (const Bytes& r : {record(4, 0, Bytes(100)), record(4, 0, Bytes(9000)), record(3, 0, {}),
                         record(6, 0, text("hello")), record(5, 0, {}), record(3, 0, {})})
    clean.insert(clean.end(), r.begin(), r.end());
  seed("fuzz_channel", "transfers", clean);
  Bytes forged = clean;
  ByteWriter cts = control_writer(ControlType::kCts);
  cts.u64(1).u64(0).u64(64);
  Bytes cts_bytes = cts.take();
  store_le(cts_bytes.data(), std::uint64_t{1});
  ByteWriter eager = control_writer(ControlType::kEager);
  eager.blob(text("eager data"));
  Bytes eager_bytes = eager.take();
  store_le(eager_bytes.data(), std::uint64_t{2});
  ByteWriter fence = control_writer(ControlType::kFailover);
  fence.u8(static_cast<std::uint8_t>(FenceType::kFence)).u32(1).u32(0).str("test");
  for (const Bytes& r :
       {record(0, 0, cts_bytes), record(0, 1, eager_bytes), record(0, 1, fence.take()),
        record(1, 0, ByteWriter().u32(5).u32(4096).take()), record(3, 0, {})})
    forged.insert(forged.end(), r.begin(), r.end());
  seed("fuzz_channel", "forged", forged);
}

void descriptors() {
  EndpointInfo info;
  info.name = "decode-3";
  info.incarnation = 0x5f2c09a1e3b74d10;
  info.provider = "tcp";
  info.token = Token{1, 2, 3};
  info.rails.push_back({"eth1", "198.18.1.1", encode_endpoint("198.18.1.1", 4000), 4001});
  info.rails.push_back({"eth2", "198.18.2.1", encode_endpoint("198.18.2.1", 4000), 4001});
  seed("fuzz_descriptors", "blob", with_selector(0, info.encode(true)));
  seed("fuzz_descriptors", "handle", with_selector(0, *info.encode_handle()));
  const std::string hex = blob_to_hex(info.encode(false));
  seed("fuzz_descriptors", "hex", with_selector(1, text(hex)));
  ByteWriter region;
  RemoteRegion{7, 4096, {11, 22, 33}}.encode(region);
  seed("fuzz_descriptors", "region", with_selector(2, region.take()));
  ByteWriter layout;
  kv::KvLayout::layer_major(4, 16, 512, 2).encode(layout);
  seed("fuzz_descriptors", "layout", with_selector(3, layout.take()));
  ProbePacket p;
  p.tag = 1;
  p.src = 2;
  p.dst = 3;
  p.sequence = 4;
  const auto pb = p.encode();
  seed("fuzz_descriptors", "probe",
       with_selector(4, Bytes(reinterpret_cast<const std::byte*>(pb.data()),
                              reinterpret_cast<const std::byte*>(pb.data()) + pb.size())));
}

void netlink() {
  // RTM_NEWLINK (16), an ifinfomsg (16 bytes) with IFF_UP | IFF_RUNNING, IFLA_IFNAME "eth1".
  Bytes m(16 + 16 + 12);
  store_le(m.data(), static_cast<std::uint32_t>(m.size()));
  store_le(m.data() + 4, std::uint16_t{16});
  store_le(m.data() + 16 + 8, std::uint32_t{0x41});
  store_le(m.data() + 32, std::uint16_t{9});
  store_le(m.data() + 34, std::uint16_t{3});
  std::memcpy(m.data() + 36, "eth1", 5);
  Bytes two = m;
  store_le(two.data() + 4, std::uint16_t{17});  // RTM_DELLINK
  two.insert(two.begin(), m.begin(), m.end());
  seed("fuzz_netlink", "newlink", m);
  seed("fuzz_netlink", "new_and_del", two);
}

void config() {
  seed("fuzz_config", "rails",
       text("NICS=eth1,eth2\nCHUNK_SIZE=512K\nPROBE_INTERVAL=20ms\nPROBE_TIMEOUT=200ms\n"));
  seed("fuzz_config", "timers", text("HOLDDOWN=2s\nHOLDDOWN_MAX=30s\nREADMIT_PROBES=3\n"));
  seed("fuzz_config", "provider", text("PROVIDER=verbs\nRAIL_WINDOW=8M\nKV_VERIFY=1\n"));
}

void kv_engine() {
  seed("fuzz_kv", "real_metadata", Bytes{std::byte{1}});
  ByteWriter notify;
  notify.u8(1).u64(5).u8(2).str("").blob(text("first token")).u32(0).u8(0);
  seed("fuzz_kv", "notify", with_selector(0, notify.take()));
  ByteWriter pull;
  pull.u8(2).u64(6).u32(0).u32(0).u32(1).u32(0).u32(2).u32(1).u32(1).u32(1).u32(2);
  seed("fuzz_kv", "pull", with_selector(0, pull.take()));
}

// The NIXL engine's messages (selector 0), a registration's public data (1, laid over the real
// one: empty is the real one) and connection info (2).
void nixl_engine() {
  ByteWriter notif;
  notif.u8(1).str("peer").str("hello");
  seed("fuzz_nixl", "notification", with_selector(0, notif.take()));
  ByteWriter read;
  read.u8(2).u64(9).u32(0).u32(1).u32(1);
  RemoteRegion{1, 4096, {11, 22}}.encode(read);
  read.u32(1).u64(1).u64(128).u64(256).u32(0).u64(0).u8(1).str("peer").str("done?");
  seed("fuzz_nixl", "read_request", with_selector(0, read.take()));
  ByteWriter done;
  done.u8(3).u64(9).u8(1).u8(0).str("");
  seed("fuzz_nixl", "read_done", with_selector(0, done.take()));
  seed("fuzz_nixl", "public_data", Bytes{std::byte{1}});
  EndpointInfo info;
  info.name = "peer";
  info.incarnation = 0x1234;
  info.provider = "tcp";
  info.token = Token{9, 8, 7};
  info.rails.push_back({"lo", "127.0.0.1", encode_endpoint("127.0.0.1", 4000), 4001});
  seed("fuzz_nixl", "conn_info", with_selector(2, info.encode(true)));
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR\n");
    return 2;
  }
  g_root = argv[1];
  bootstrap();
  handshake();
  tcp_stream();
  channel();
  descriptors();
  netlink();
  config();
  kv_engine();
  nixl_engine();
  return 0;
}

// The tcp provider's rail reader, fed by a real socket: each input is the byte stream an
// authenticated peer sends after the handshake (the harness does the handshake with the job's
// token, then writes the input and closes). The stream is read as records of a 40-byte frame
// header (tcp/frame.h) and up to 64 KiB of payload; a header whose key is 1 is given the key of
// the registered region, so that writes reach it, and one whose checksum is 0 its checksum. The
// rail may refuse writes or fail; it must not crash, it must end when the peer closes, and no byte
// outside the registered region may change.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "common/handshake.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"
#include "r2ccl/runtime/provider/provider.h"
#include "tcp/frame.h"

using namespace r2ccl;

namespace {
constexpr std::size_t kHeader = 40;
constexpr std::size_t kRegion = 64 * 1024;
constexpr std::size_t kGuard = 4096;
const Token kToken{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};

struct Events final : RailEvents {
  std::mutex m;
  std::condition_variable cv;
  bool failed = false;
  void on_write_confirmed(std::uint64_t, std::uint64_t) override {}
  void on_write_refused(std::uint64_t, const Status&) override {}
  void on_write_arrived(std::uint32_t, std::size_t) override {}
  void on_control(std::span<const std::byte>) override {}
  void on_rail_failed(const Status&) override {
    std::lock_guard l(m);
    failed = true;
    cv.notify_all();
  }
};

struct State {
  ProgressEngine engine;
  std::unique_ptr<Provider> provider;
  std::vector<std::byte> memory;  // guard | region | guard
  std::uint64_t key = 0;
  std::uint16_t port = 0;
  std::mutex m;
  std::condition_variable cv;
  std::shared_ptr<Rail> rail;
};
State* g = nullptr;

std::array<std::byte, kHeader> header(std::uint8_t op, std::uint64_t length) {
  return tcp_frame::encode({static_cast<tcp_frame::Op>(op), 0, 0, 0, 0, length, 0});
}

bool read_exact(int fd, void* p, std::size_t n) {
  auto* b = static_cast<std::byte*>(p);
  while (n > 0) {
    const ssize_t got = ::recv(fd, b, n, 0);
    if (got <= 0) return false;
    b += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}
bool write_exact(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  while (n > 0) {
    const ssize_t put = ::send(fd, b, n, MSG_NOSIGNAL);
    if (put <= 0) return false;
    b += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}

// A connected, authenticated socket to the provider's NIC, or -1 when the provider closed it
// during the handshake (its log says why).
int try_handshake() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(g->port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) std::abort();
  std::array<std::byte, kHeader> h{};
  crypto::Nonce challenge{};
  if (!read_exact(fd, h.data(), h.size()) || !read_exact(fd, challenge.data(), challenge.size())) {
    ::close(fd);
    return -1;
  }
  RailHello hello{kToken, 5, 6, 0, 0, std::make_shared<const Bytes>()};
  crypto::Nonce client{};
  auto body = encode_hello(hello, challenge, &client);
  if (!body) std::abort();
  const auto hh = header(1, body->size());
  Bytes frame(hh.begin(), hh.end());
  frame.insert(frame.end(), body->begin(), body->end());
  std::array<std::byte, kHeader + kAckSize> ack{};
  if (!write_exact(fd, frame.data(), frame.size()) || !read_exact(fd, ack.data(), ack.size())) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int handshake() {
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int fd = try_handshake();
    if (fd >= 0) return fd;
    std::fprintf(stderr, "fuzz_tcp_stream: the provider closed handshake %d\n", attempt + 1);
  }
  std::abort();  // a provider that refuses every valid handshake is broken
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  set_log_level(std::getenv("FUZZ_LOG") ? LogLevel::kDebug : LogLevel::kError);
  g = new State();  // lives for the process
  auto p = make_tcp_provider(g->engine, {RailNic{"127.0.0.1", "127.0.0.1", -1, "", ""}}, kToken);
  if (!p) std::abort();
  g->provider = std::move(*p);
  g->memory.assign(kGuard + kRegion + kGuard, std::byte{0xA5});
  auto key = g->provider->register_memory(0, g->memory.data() + kGuard, kRegion,
                                          MemoryAccess::kRemoteWrite);
  if (!key) std::abort();
  g->key = *key;
  const Bytes endpoint = g->provider->endpoint(0);
  ByteReader r(endpoint);
  (void)r.str(64);
  g->port = r.u16();
  g->provider->set_accept_handler([](std::shared_ptr<Rail> rail) {
    std::lock_guard l(g->m);
    g->rail = std::move(rail);
    g->cv.notify_all();
    return true;
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = handshake();
  std::shared_ptr<Rail> rail;
  {
    std::unique_lock l(g->m);
    if (!g->cv.wait_for(l, std::chrono::seconds(10), [] { return g->rail != nullptr; }))
      std::abort();
    rail = std::move(g->rail);
    g->rail = nullptr;
  }
  Events events;
  g->engine.call([&] { rail->start(&events); });
  // The input, with key 1 turned into the region's key.
  std::vector<std::uint8_t> stream(data, data + size);
  for (std::size_t pos = 0; pos + kHeader <= stream.size();) {
    auto* at = reinterpret_cast<std::byte*>(&stream[pos]);
    if (load_le(at + 8, 8) == 1) store_le(at + 8, g->key);
    // A checksum of 0 is filled in (so that the stream reaches what follows the check); any
    // other is left as the input has it.
    if (load_le(at + tcp_frame::kChecksumAt, 4) == 0) {
      tcp_frame::HeaderBytes h;
      std::memcpy(h.data(), at, kHeader);
      store_le(at + tcp_frame::kChecksumAt, tcp_frame::checksum(h));
    }
    const auto length = load_le(at + 24, 4);
    pos += kHeader + static_cast<std::size_t>(std::min<std::uint64_t>(length, 64 * 1024));
  }
  (void)write_exact(fd, stream.data(), stream.size());
  ::shutdown(fd, SHUT_WR);
  {
    std::unique_lock l(events.m);
    // A rail that does not end when its peer has closed is a hang.
    if (!events.cv.wait_for(l, std::chrono::seconds(20), [&] { return events.failed; }))
      __builtin_trap();
  }
  ::close(fd);
  g->engine.call([&] { rail->fence(); });
  rail.reset();
  for (std::size_t i = 0; i < kGuard; ++i)
    if (g->memory[i] != std::byte{0xA5} || g->memory[kGuard + kRegion + i] != std::byte{0xA5})
      __builtin_trap();
  return 0;
}

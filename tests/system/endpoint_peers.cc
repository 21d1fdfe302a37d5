// r2ccl-test-endpoint: processes that were never in a world, connected by endpoint blobs
// (tests/system/test_endpoint.py).
//
//   r2ccl-test-endpoint serve BLOB_FILE NAME SECONDS
//   r2ccl-test-endpoint connect BLOB_FILE NAME MESSAGES
//
// `serve` creates an endpoint, writes its blob (hex) to BLOB_FILE, and for SECONDS (or until a
// file BLOB_FILE.stop appears) echoes the messages of every peer that connects: it receives message
// k (kSize bytes), checks every byte against the pattern of k, and sends it back. `connect` reads
// the blob, connects, and sends MESSAGES messages, checking every byte of each echo. Both print
// what happens, one line each, prefixed with NAME and a wall-clock time in milliseconds:
//   "<ms> NAME: serving as incarnation <hex>"            (serve, once listening)
//   "<ms> NAME: <label> joined (peer <id>)"                (serve)
//   "<ms> NAME: <label> left: <why>"                       (serve)
//   "<ms> NAME: <label>: <error>"                          (an operation with the peer failed)
//   "<ms> NAME: connected to <label> as incarnation <hex>" (connect)
//   "<ms> NAME: <n> messages verified; rail tx bytes: <b0> <b1> ..."  (every 10, and at the end)
// Exit status: 0 when every byte arrived right (and, for connect, every message was echoed);
// 1 otherwise; 2 on bad usage.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/endpoint.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
constexpr std::size_t kSize = 1 << 20;
constexpr std::size_t kMaxPeers = 16;

std::mutex print_mutex;

template <typename... Args>
void say(const std::string& name, fmt::format_string<Args...> f, Args&&... args) {
  const auto ms =
      std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  std::lock_guard lock(print_mutex);
  fmt::print("{} {}: {}\n", ms, name, fmt::format(f, std::forward<Args>(args)...));
  std::fflush(stdout);
}

void fill(std::vector<std::byte>& buf, std::uint64_t k) {
  for (std::size_t i = 0; i < buf.size(); ++i)
    buf[i] = static_cast<std::byte>((i * 131 + k * 17 + 7) >> 3);
}

// The first byte that is not the pattern of message k, or -1.
long long first_wrong(const std::vector<std::byte>& buf, std::uint64_t k) {
  for (std::size_t i = 0; i < buf.size(); ++i)
    if (buf[i] != static_cast<std::byte>((i * 131 + k * 17 + 7) >> 3))
      return static_cast<long long>(i);
  return -1;
}

std::string rail_bytes(r2ccl::Endpoint& e, int peer) {
  std::map<std::uint32_t, std::uint64_t> tx;
  for (const auto& r : e.rail_snapshot())
    if (r.peer == peer) tx[r.rail] += r.tx_bytes;
  std::string out;
  for (const auto& [rail, bytes] : tx)
    out += fmt::format("{}{}", out.empty() ? "" : " ", bytes);
  return out;
}

std::unique_ptr<r2ccl::Endpoint> open(const std::string& name) {
  auto cfg = r2ccl::parse_config(r2ccl::process_env());
  if (!cfg) {
    say(name, "bad configuration: {}", cfg.status().message());
    return nullptr;
  }
  r2ccl::EndpointOptions o;
  o.name = name;
  auto e = r2ccl::Endpoint::create(*cfg, o);
  if (!e) {
    say(name, "cannot create the endpoint: {}", e.status().message());
    return nullptr;
  }
  return std::move(*e);
}

int serve(const std::string& file, const std::string& name, int seconds) {
  auto ep = open(name);
  if (!ep) return 1;
  std::mutex m;
  std::condition_variable cv;
  std::deque<r2ccl::Endpoint::PeerEvent> joined;
  ep->set_peer_handler([&](const r2ccl::Endpoint::PeerEvent& ev) {
    if (ev.kind == r2ccl::Endpoint::PeerEvent::Kind::kLeft) {
      say(name, "{} left: {}", ev.label, ev.why);
      return;
    }
    std::lock_guard lock(m);
    joined.push_back(ev);
    cv.notify_all();
  });
  {
    const std::string tmp = file + ".tmp";
    std::ofstream(tmp) << r2ccl::blob_to_hex(ep->blob()) << "\n";
    std::filesystem::rename(tmp, file);
  }
  say(name, "serving as incarnation {:016x}", ep->incarnation());
  std::atomic<bool> corrupt{false};
  std::vector<std::thread> workers;
  auto echo = [&](r2ccl::Endpoint::PeerEvent peer) {
    std::vector<std::byte> buf(kSize);
    auto reg = ep->register_memory(buf.data(), buf.size());
    if (!reg) return say(name, "cannot register memory: {}", reg.status().message());
    for (std::uint64_t k = 0;; ++k) {
      auto recv = ep->irecv(peer.peer, *reg, 0, kSize);
      r2ccl::Status st = recv ? ep->wait(*recv) : recv.status();
      if (!st) return say(name, "{}: {}", peer.label, st.message());
      if (const auto at = first_wrong(buf, k); at >= 0) {
        corrupt = true;
        return say(name, "{}: message {} is wrong at byte {}", peer.label, k, at);
      }
      auto send = ep->isend(peer.peer, *reg, 0, kSize);
      st = send ? ep->wait(*send) : send.status();
      if (!st) return say(name, "{}: {}", peer.label, st.message());
    }
  };
  const auto until = Clock::now() + std::chrono::seconds(seconds);
  while (Clock::now() < until && !std::filesystem::exists(file + ".stop")) {
    std::unique_lock lock(m);
    cv.wait_until(lock, std::min(until, Clock::now() + milliseconds(200)),
                  [&] { return !joined.empty(); });
    while (!joined.empty()) {
      auto ev = joined.front();
      joined.pop_front();
      say(name, "{} joined (peer {})", ev.label, ev.peer);
      if (workers.size() < kMaxPeers)
        workers.emplace_back(echo, ev);
      else
        say(name, "more than {} peers: {} is not served", kMaxPeers, ev.label);
    }
  }
  ep->abort("the serving time is over");
  for (auto& t : workers)
    t.join();
  return corrupt ? 1 : 0;
}

int connect(const std::string& file, const std::string& name, long messages) {
  auto ep = open(name);
  if (!ep) return 1;
  std::string hex;
  const auto give_up = Clock::now() + std::chrono::seconds(20);
  while (hex.empty() && Clock::now() < give_up) {
    std::ifstream in(file);
    if (in) std::getline(in, hex);
    if (hex.empty()) std::this_thread::sleep_for(milliseconds(50));
  }
  auto blob = r2ccl::blob_from_hex(hex);
  if (!blob) {
    say(name, "bad blob in {}: {}", file, blob.status().message());
    return 1;
  }
  auto peer = ep->connect(*blob);
  if (!peer) {
    say(name, "cannot connect: {}", peer.status().message());
    return 1;
  }
  say(name, "connected to {} as incarnation {:016x}", ep->peer_label(*peer).value_or("?"),
      ep->incarnation());
  std::vector<std::byte> out(kSize), back(kSize);
  auto ro = ep->register_memory(out.data(), out.size());
  auto rb = ep->register_memory(back.data(), back.size());
  if (!ro || !rb) return 1;
  for (long k = 0; k < messages; ++k) {
    fill(out, static_cast<std::uint64_t>(k));
    std::fill(back.begin(), back.end(), std::byte{0});
    auto recv = ep->irecv(*peer, *rb, 0, kSize);
    auto send = ep->isend(*peer, *ro, 0, kSize);
    r2ccl::Status st = send ? ep->wait(*send) : send.status();
    if (st) st = recv ? ep->wait(*recv) : recv.status();
    if (!st) {
      say(name, "message {}: {}", k, st.message());
      return 1;
    }
    if (const auto at = first_wrong(back, static_cast<std::uint64_t>(k)); at >= 0) {
      say(name, "the echo of message {} is wrong at byte {}", k, at);
      return 1;
    }
    if ((k + 1) % 10 == 0 || k + 1 == messages)
      say(name, "{} messages verified; rail tx bytes: {}", k + 1, rail_bytes(*ep, *peer));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: r2ccl-test-endpoint serve BLOB_FILE NAME SECONDS\n"
      "       r2ccl-test-endpoint connect BLOB_FILE NAME MESSAGES\n";
  if (argc != 5) {
    std::fputs(usage.c_str(), stderr);
    return 2;
  }
  const std::string mode = argv[1];
  char* end = nullptr;
  const long n = std::strtol(argv[4], &end, 10);
  if (*end != '\0' || n <= 0 || n > 100000000) {
    std::fprintf(stderr, "r2ccl-test-endpoint: '%s' is not a positive count\n%s", argv[4],
                 usage.c_str());
    return 2;
  }
  try {
    if (mode == "serve") return serve(argv[2], argv[3], static_cast<int>(n));
    if (mode == "connect") return connect(argv[2], argv[3], n);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "r2ccl-test-endpoint: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "r2ccl-test-endpoint: unknown mode '%s'\n%s", mode.c_str(), usage.c_str());
  return 2;
}

// r2ccl-test-msg-order: checks that Fabric::send_message delivers every message once and in the
// order sent, also across a rail failover (tests/system/test_failover.py).
//
//   R2CCL_RANK=0|1 R2CCL_NRANKS=2 R2CCL_BOOTSTRAP=... r2ccl-test-msg-order SECONDS [EVENTS]
//
// Rank 0 sends numbered messages to rank 1 for SECONDS, at most kWindow ahead of what rank 1 has
// acknowledged, then one that says how many it sent. Rank 1 checks that message k is the k-th it
// receives and that the count matches, and acknowledges every kAckEvery messages. Rank 0 prints
// "# Check: N messages arrived once each, in order" when rank 1 confirms, or what went wrong.
// With EVENTS, each rank writes its rail events as JSON lines to EVENTS.rankN.
// Exit status: 0 when every message arrived once, in order; 1 otherwise; 2 on bad usage.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "r2ccl/runtime/bootstrap.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/fabric.h"
#include "r2ccl/runtime/wire.h"

namespace {

using Clock = std::chrono::steady_clock;
using r2ccl::Bytes;

constexpr std::uint64_t kWindow = 2048;  // messages rank 0 may be ahead of rank 1's acks
constexpr std::uint64_t kAckEvery = 256;
constexpr std::size_t kPayload = 64;
constexpr std::uint8_t kData = 1;
constexpr std::uint8_t kEnd = 2;
constexpr std::uint8_t kAck = 3;
constexpr std::uint8_t kVerdict = 4;
constexpr auto kFinishTimeout = std::chrono::seconds(60);

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t acked = 0;     // rank 0: highest count rank 1 acknowledged
  std::uint64_t received = 0;  // rank 1: messages received in order so far
  std::string error;           // rank 1: the first order violation
  bool ended = false;          // rank 1: the end message came (its count checked)
  std::string verdict;         // rank 0: what rank 1 concluded
  bool have_verdict = false;
};

Bytes message(std::uint8_t type, std::uint64_t value, std::size_t size,
              const std::string& text = {}) {
  r2ccl::ByteWriter w;
  w.u8(type).u64(value).str(text);
  Bytes b = w.take();
  if (b.size() < size) b.resize(size, std::byte{0x5a});
  return b;
}

void write_events(const r2ccl::Fabric& f, const std::string& path) {
  std::ofstream ev(fmt::format("{}.rank{}", path, f.rank()));
  for (const auto& e : f.rail_events())
    ev << nlohmann::json{{"wall_ns", e.wall_ns}, {"rank", f.rank()}, {"peer", e.peer},
                         {"rail", e.rail},       {"nic", e.nic},     {"kind", e.kind},
                         {"detail", e.detail}}
              .dump()
       << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3 || std::atof(argv[1]) <= 0) {
    fmt::print(stderr, "usage: r2ccl-test-msg-order SECONDS [EVENTS]\n");
    return 2;
  }
  const auto seconds = std::chrono::duration<double>(std::atof(argv[1]));
  auto cfg = r2ccl::parse_config(r2ccl::process_env());
  if (!cfg) {
    fmt::print(stderr, "r2ccl-test-msg-order: {}\n", cfg.status().message());
    return 2;
  }
  auto boot = r2ccl::BootstrapOptions::from_config(*cfg);
  if (!boot || boot->nranks != 2) {
    fmt::print(stderr, "r2ccl-test-msg-order: needs two ranks: {}\n",
               boot ? "R2CCL_NRANKS is not 2" : boot.status().message());
    return 2;
  }
  auto fabric = r2ccl::Fabric::create(*cfg, *boot);
  if (!fabric) {
    fmt::print(stderr, "r2ccl-test-msg-order: rank {}: {}\n", boot->rank,
               fabric.status().to_string());
    return 2;
  }
  r2ccl::Fabric& f = **fabric;
  const int me = f.rank();
  State st;
  f.set_message_handler([&](int peer, Bytes payload) {
    r2ccl::ByteReader r(payload);
    const auto type = r.u8();
    const auto value = r.u64();
    const std::string text = r.str(4096);
    std::lock_guard lock(st.mu);
    if (!r.ok() || peer != 1 - me) {
      if (st.error.empty()) st.error = fmt::format("a malformed message from rank {}", peer);
    } else if (type == kData) {
      if (value != st.received && st.error.empty())
        st.error = fmt::format("message #{} arrived where #{} was due", value, st.received);
      ++st.received;
      if (st.received % kAckEvery == 0) (void)f.send_message(peer, message(kAck, st.received, 16));
    } else if (type == kEnd) {
      if (value != st.received && st.error.empty())
        st.error = fmt::format("rank 0 sent {} messages, {} arrived", value, st.received);
      st.ended = true;
    } else if (type == kAck) {
      st.acked = std::max(st.acked, value);
    } else if (type == kVerdict) {
      st.verdict = text;
      st.have_verdict = true;
    }
    st.cv.notify_all();
  });
  if (auto b = f.bootstrap().barrier(std::chrono::seconds(60)); !b) {
    fmt::print(stderr, "r2ccl-test-msg-order: rank {}: {}\n", me, b.to_string());
    return 2;
  }

  int rc = 0;
  if (me == 0) {
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(seconds);
    std::uint64_t sent = 0;
    std::string failed;
    while (Clock::now() < until && failed.empty()) {
      {
        std::unique_lock lock(st.mu);
        if (!st.cv.wait_for(lock, std::chrono::seconds(30),
                            [&] { return sent < st.acked + kWindow; })) {
          failed = fmt::format("rank 1 acknowledged no message for 30 s ({} sent, {} acked)", sent,
                               st.acked);
          break;
        }
      }
      if (auto s = f.send_message(1, message(kData, sent, kPayload)); !s)
        failed = s.to_string();
      else
        ++sent;
    }
    if (failed.empty())
      if (auto s = f.send_message(1, message(kEnd, sent, 16)); !s) failed = s.to_string();
    std::unique_lock lock(st.mu);
    if (failed.empty() && !st.cv.wait_for(lock, kFinishTimeout, [&] { return st.have_verdict; }))
      failed = "rank 1 sent no verdict";
    if (!failed.empty()) {
      fmt::print("# Check: FAILED: {}\n", failed);
      rc = 1;
    } else if (!st.verdict.empty()) {
      fmt::print("# Check: FAILED: {}\n", st.verdict);
      rc = 1;
    } else {
      fmt::print("# Check: {} messages arrived once each, in order\n", sent);
    }
  } else {
    std::unique_lock lock(st.mu);
    const auto bound = std::chrono::duration_cast<Clock::duration>(seconds) + kFinishTimeout;
    if (!st.cv.wait_for(lock, bound, [&] { return st.ended; })) {
      st.error = fmt::format("no end message; {} messages arrived", st.received);
    }
    const std::string verdict = st.error;
    lock.unlock();
    if (auto s = f.send_message(0, message(kVerdict, 0, 16, verdict)); !s) {
      fmt::print(stderr, "r2ccl-test-msg-order: rank 1: {}\n", s.to_string());
      rc = 1;
    }
    if (!verdict.empty()) rc = 1;
  }
  // Both ranks stay until the verdict is through.
  (void)f.bootstrap().barrier(std::chrono::seconds(60));
  if (argc == 3) write_events(f, argv[2]);
  return rc;
}

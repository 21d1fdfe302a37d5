// A RailEvents that records every upcall of a rail, for the provider tests (tcp and verbs).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "r2ccl/runtime/provider/provider.h"

namespace r2ccl::test {

struct Recorder final : RailEvents {
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::uint64_t> confirmed;
  std::vector<std::pair<std::uint64_t, std::string>> refused;
  std::vector<std::pair<std::uint32_t, std::size_t>> arrived;
  std::vector<Bytes> control;
  std::vector<std::string> failed;

  void on_write_confirmed(std::uint64_t c, std::uint64_t) override {
    push([&] { confirmed.push_back(c); });
  }
  void on_write_refused(std::uint64_t c, const Status& why) override {
    push([&] { refused.emplace_back(c, why.message()); });
  }
  void on_write_arrived(std::uint32_t imm, std::size_t n) override {
    push([&] { arrived.emplace_back(imm, n); });
  }
  void on_control(std::span<const std::byte> b) override {
    push([&] { control.emplace_back(b.begin(), b.end()); });
  }
  void on_rail_failed(const Status& why) override {
    push([&] { failed.push_back(why.message()); });
  }

  template <typename F>
  void push(F f) {
    {
      std::lock_guard l(m);
      f();
    }
    cv.notify_all();
  }
  // Waits (bounded: a hang fails the test, it does not hang it) until `pred` holds.
  template <typename P>
  bool wait(P pred, std::chrono::seconds limit = std::chrono::seconds(20)) {
    std::unique_lock l(m);
    return cv.wait_for(l, limit, pred);
  }
};

inline Token token_of(std::uint8_t b) {
  Token t{};
  t.fill(b);
  return t;
}

}  // namespace r2ccl::test

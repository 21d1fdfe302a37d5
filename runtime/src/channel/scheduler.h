// The channel's rail scheduler (DESIGN.md, The data path): assigns each chunk to the usable rail
// that would finish it first, given what the rail already has in flight and its measured
// bandwidth (earliest finish time), each rail limited to a window of unconfirmed bytes. A rail at
// a quarter of the others' rate gets a quarter of their share, and the tail of a message goes to
// the fast rails. Progress thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

namespace r2ccl {

class RailScheduler {
 public:
  RailScheduler(std::size_t rails, std::uint64_t window_bytes);
  std::size_t rails() const { return rails_.size(); }
  // Measured bandwidth in bytes per second (> 0). Until measured, a rail is assumed as fast as
  // the fastest measured one (so that it gets work, and so gets measured).
  void set_bandwidth(std::size_t rail, double bytes_per_second);
  // Forgets the measurement (a re-admitted rail).
  void clear_bandwidth(std::size_t rail);
  double bandwidth(std::size_t rail) const;
  // Bandwidth relative to the fastest usable rail, in (0, 1]; 0 for an unusable rail.
  double weight(std::size_t rail) const;
  void set_usable(std::size_t rail, bool usable);
  bool usable(std::size_t rail) const { return rails_[rail].usable; }
  std::size_t usable_count() const;
  // The usable rail of `mask` (bit i: rail i; every usable rail when none of the mask is) that
  // would finish `bytes` first; reserves the bytes on it. nullopt when no rail is usable, or when
  // that rail's window is full (waiting for it beats a slower rail). An idle rail always has room.
  std::optional<std::size_t> pick(std::uint64_t bytes, std::uint64_t mask = ~std::uint64_t{0});
  // Releases bytes reserved by pick() (confirmed, refused or taken back for replay).
  void release(std::size_t rail, std::uint64_t bytes);
  std::uint64_t inflight(std::size_t rail) const { return rails_[rail].inflight; }
  std::uint64_t window() const { return window_; }

 private:
  struct State {
    double bandwidth = 0;  // 0: not measured
    bool usable = true;
    std::uint64_t inflight = 0;
  };
  std::vector<State> rails_;
  std::uint64_t window_;
};

}  // namespace r2ccl

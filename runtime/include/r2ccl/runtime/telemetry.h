// Per-rail telemetry: plain atomics written on the data path, read by anybody (the monitor reads
// them at scrape time). No locks, no Prometheus here.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace r2ccl {

enum class RailState : std::uint8_t { kUp = 0, kSuspect, kDown, kProbing, kDegraded };
std::string_view rail_state_name(RailState s);

struct RailTelemetry {
  std::atomic<RailState> state{RailState::kUp};
  std::atomic<std::uint64_t> tx_bytes{0};  // confirmed by the peer
  std::atomic<std::uint64_t> rx_bytes{0};  // landed in our memory
  std::atomic<std::uint64_t> tx_chunks{0};
  std::atomic<std::uint64_t> rx_chunks{0};
  std::atomic<std::uint64_t> replayed_chunks{0};  // re-posted here after another rail failed
  std::atomic<std::uint64_t> replayed_bytes{0};
  std::atomic<std::uint64_t> errors{0};
  std::atomic<std::uint64_t> failovers{0};        // times this rail failed and was fenced
  std::atomic<std::uint64_t> bandwidth_bps{0};    // measured, confirmed bytes per second (EWMA)
  std::atomic<std::uint64_t> flaps{0};            // times the rail went bad (link or probes)
  std::atomic<std::uint64_t> rtt_ns{0};           // last probe round trip
  std::atomic<std::uint64_t> detection_ns{0};     // how long the last failure took to detect
  std::atomic<std::uint32_t> weight_milli{1000};  // scheduler weight x 1000 (1000 = fastest)
  std::atomic<std::uint64_t> holddown_ms{0};      // current re-admission hold-down
  std::atomic<std::uint32_t> epoch{0};            // connection generation of the rail
};

// A copy of one rail's telemetry with its identity.
struct RailSnapshot {
  int peer = -1;
  std::uint32_t rail = 0;
  std::string nic;         // local NIC
  std::string remote_nic;  // the peer's NIC
  RailState state = RailState::kUp;
  std::uint64_t tx_bytes = 0;
  std::uint64_t rx_bytes = 0;
  std::uint64_t tx_chunks = 0;
  std::uint64_t rx_chunks = 0;
  std::uint64_t replayed_chunks = 0;
  std::uint64_t replayed_bytes = 0;
  std::uint64_t errors = 0;
  std::uint64_t failovers = 0;
  std::uint64_t bandwidth_bps = 0;
  std::uint64_t flaps = 0;
  std::uint64_t rtt_ns = 0;
  std::uint64_t detection_ns = 0;
  double weight = 1.0;
  std::uint64_t holddown_ms = 0;
  std::uint32_t epoch = 0;
  std::string last_error;
};

// A fixed-bucket latency histogram of plain atomics (observed on the progress thread, read at
// scrape time). Bucket bounds in seconds: 50us .. 10s, roughly doubling (small collectives take
// tens of microseconds, failovers and KV requests milliseconds to seconds).
class LatencyHistogram {
 public:
  static constexpr std::array<double, 18> kBounds{0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002,
                                                  0.005,   0.01,   0.02,   0.05,   0.1,   0.2,
                                                  0.3,     0.5,    1,      2,      5,     10};
  void observe(double seconds);
  // Cumulative counts per bound (as Prometheus wants them), the total count and the sum.
  std::array<std::uint64_t, kBounds.size()> cumulative() const;
  std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9; }

 private:
  std::array<std::atomic<std::uint64_t>, kBounds.size()> buckets_{};  // not cumulative
  std::atomic<std::uint64_t> count_{0};
  std::atomic<std::uint64_t> sum_ns_{0};
};

// Counters and histograms that modules above the runtime (the KV engine) publish through the
// fabric, so that the monitor exports them without depending on those modules. Registration
// takes a lock; updates are plain atomics; entries never move.
class MetricRegistry {
 public:
  using Labels = std::vector<std::pair<std::string, std::string>>;
  struct Counter {
    std::string name, help;
    Labels labels;
    std::atomic<std::uint64_t> value{0};
  };
  struct Histogram {
    std::string name, help;
    Labels labels;
    LatencyHistogram histogram;
  };
  Counter& counter(const std::string& name, const std::string& help, Labels labels);
  Histogram& histogram(const std::string& name, const std::string& help, Labels labels);
  void for_each(const std::function<void(const Counter&)>& counters,
                const std::function<void(const Histogram&)>& histograms) const;

 private:
  mutable std::mutex mutex_;
  std::deque<Counter> counters_;
  std::deque<Histogram> histograms_;
};

// A rail's identity with a pointer to its live telemetry (valid while the fabric lives): what a
// metrics collector reads at scrape time without touching the data path.
struct RailTelemetryView {
  int peer = -1;
  std::uint32_t rail = 0;
  std::string nic;
  std::string remote_nic;
  const RailTelemetry* telemetry = nullptr;
};

// What happened to the rails, with wall-clock times (for fault benchmarks and post-mortems).
// Written only on state changes, never per chunk.
struct RailEvent {
  std::int64_t wall_ns = 0;  // CLOCK_REALTIME
  int peer = -1;
  std::uint32_t rail = 0;
  std::string nic;
  // link_down, link_up, failed, replay_started, first_replay_confirmed, readmitted, joined (a
  // rail first connected after start-up)
  std::string kind;
  std::string detail;
};

// The latest kMaxEvents rail events (a ring: the oldest go first), and how many were dropped.
class RailEventLog {
 public:
  static constexpr std::size_t kMaxEvents = 100000;
  void add(RailEvent event);
  std::vector<RailEvent> snapshot() const;
  std::uint64_t dropped() const;

 private:
  mutable std::mutex mutex_;
  std::deque<RailEvent> events_;
  std::uint64_t dropped_ = 0;
};

}  // namespace r2ccl

// Per-rail telemetry: plain atomics written on the data path, read by anybody (the monitor reads
// them at scrape time). No locks, no Prometheus here.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

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
  std::atomic<std::uint64_t> failovers{0};      // times this rail failed and was fenced
  std::atomic<std::uint64_t> bandwidth_bps{0};  // measured, confirmed bytes per second (EWMA)
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
  std::string last_error;
};

}  // namespace r2ccl

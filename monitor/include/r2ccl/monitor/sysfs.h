// NIC state and counters read from sysfs, fresh on every call (no caching).
//
// The sysfs root is injectable so tests can point the reader at a fake tree in a temp dir; the
// layout below it is the kernel's: class/net/DEV/{operstate,carrier,speed,carrier_changes,flags,
// statistics/*} and class/infiniband/DEV/ports/N/{state,rate,counters/*}.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace r2ccl::mon {

// One error/drop counter of a NIC: direction "rx" or "tx", kind "errors" (the kernel's total),
// "dropped", or a breakdown such as "crc", "frame", "fifo", "missed", "carrier".
struct NicErrorCounter {
  std::string direction;
  std::string kind;
  std::uint64_t value = 0;
};

struct NicReading {
  std::string device;
  bool present = false;         // class/net/DEV exists
  std::string operstate;        // "up", "down", "lowerlayerdown", "unknown", ...; empty if unread
  std::optional<bool> carrier;  // absent when unreadable (the kernel refuses while admin down)
  bool up = false;              // carrier present and operstate "up" (or "unknown", as for tun)
  std::optional<double> speed_bytes_per_second;  // absent when the driver reports none (-1)
  std::optional<std::uint64_t> carrier_changes;
  std::optional<std::uint64_t> rx_bytes;
  std::optional<std::uint64_t> tx_bytes;
  std::vector<NicErrorCounter> errors;  // the counters that exist for this device
};

// One port of a verbs (InfiniBand / RoCE) device.
struct IbPortReading {
  std::string device;  // e.g. mlx5_0
  std::string port;    // "1"
  std::string state;   // e.g. "ACTIVE", "DOWN" (the text after "N: ")
  bool active = false;
  std::optional<double> rate_bytes_per_second;
  std::optional<std::uint64_t> rx_bytes;  // port_rcv_data × 4 (the kernel counts 32-bit words)
  std::optional<std::uint64_t> tx_bytes;  // port_xmit_data × 4
  std::vector<NicErrorCounter> errors;    // direction empty; kind = the counter's file name
};

class SysfsReader {
 public:
  explicit SysfsReader(std::filesystem::path root = "/sys");

  const std::filesystem::path& root() const { return root_; }
  // Every interface under class/net, sorted (loopback included).
  std::vector<std::string> all_nics() const;
  // Every non-loopback interface, sorted: the default set the monitor exports.
  std::vector<std::string> default_nics() const;
  bool has_nic(const std::string& device) const;
  bool is_loopback(const std::string& device) const;
  // Reads everything about `device` now. A device that does not exist gives present = false.
  NicReading read_nic(const std::string& device) const;
  // Every port of every verbs device; empty when class/infiniband does not exist.
  std::vector<IbPortReading> read_ib_ports() const;

 private:
  std::filesystem::path net_dir(const std::string& device) const;
  std::filesystem::path root_;
};

// Parses a sysfs port rate such as "100 Gb/sec (4X EDR)" or "2.5 Gb/sec (1X SDR)" to bytes/s.
std::optional<double> parse_ib_rate(const std::string& text);

}  // namespace r2ccl::mon

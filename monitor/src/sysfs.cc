#include "r2ccl/monitor/sysfs.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <fstream>
#include <system_error>

namespace r2ccl::mon {
namespace fs = std::filesystem;

namespace {

constexpr unsigned kIffLoopback = 0x8;  // IFF_LOOPBACK in class/net/DEV/flags

// The first line of a sysfs file, trimmed; nullopt when it cannot be read (missing file, or a
// driver that refuses the read, as carrier and speed do while a link is administratively down).
std::optional<std::string> read_line(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  const auto not_space = [](char c) { return c != ' ' && c != '\t' && c != '\r' && c != '\n'; };
  line.erase(line.begin(), std::find_if(line.begin(), line.end(), not_space));
  line.erase(std::find_if(line.rbegin(), line.rend(), not_space).base(), line.end());
  return line;
}

template <typename T>
std::optional<T> parse_number(const std::string& text, int base = 10) {
  T value{};
  const char* first = text.data();
  const char* last = text.data() + text.size();
  if (base == 16 && text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X'))
    first += 2;
  auto [end, ec] = std::from_chars(first, last, value, base);
  if (ec != std::errc() || end != last || first == last) return std::nullopt;
  return value;
}

std::optional<std::uint64_t> read_u64(const fs::path& path) {
  auto line = read_line(path);
  if (!line) return std::nullopt;
  return parse_number<std::uint64_t>(*line);
}

struct CounterName {
  const char* file;
  const char* direction;
  const char* kind;
};

// statistics/* files exported as r2ccl_nic_errors_total{direction,kind}.
constexpr std::array kNicErrorCounters = {
    CounterName{"rx_errors", "rx", "errors"},
    CounterName{"rx_dropped", "rx", "dropped"},
    CounterName{"rx_crc_errors", "rx", "crc"},
    CounterName{"rx_frame_errors", "rx", "frame"},
    CounterName{"rx_fifo_errors", "rx", "fifo"},
    CounterName{"rx_missed_errors", "rx", "missed"},
    CounterName{"rx_over_errors", "rx", "over"},
    CounterName{"rx_length_errors", "rx", "length"},
    CounterName{"rx_nohandler", "rx", "nohandler"},
    CounterName{"tx_errors", "tx", "errors"},
    CounterName{"tx_dropped", "tx", "dropped"},
    CounterName{"tx_aborted_errors", "tx", "aborted"},
    CounterName{"tx_carrier_errors", "tx", "carrier"},
    CounterName{"tx_fifo_errors", "tx", "fifo"},
    CounterName{"tx_heartbeat_errors", "tx", "heartbeat"},
    CounterName{"tx_window_errors", "tx", "window"},
};

// ports/N/counters/* files exported as r2ccl_ib_port_errors_total{kind}.
constexpr std::array kIbErrorCounters = {
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_rcv_constraint_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
};

std::vector<std::string> sorted_dir_names(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return names;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

SysfsReader::SysfsReader(fs::path root) : root_(std::move(root)) {}

fs::path SysfsReader::net_dir(const std::string& device) const {
  return root_ / "class" / "net" / device;
}

std::vector<std::string> SysfsReader::all_nics() const {
  return sorted_dir_names(root_ / "class" / "net");
}

std::vector<std::string> SysfsReader::default_nics() const {
  std::vector<std::string> out;
  for (auto& name : all_nics())
    if (!is_loopback(name)) out.push_back(std::move(name));
  return out;
}

bool SysfsReader::has_nic(const std::string& device) const {
  if (device.empty() || device == "." || device == ".." || device.find('/') != std::string::npos)
    return false;
  std::error_code ec;
  return fs::exists(net_dir(device), ec);
}

bool SysfsReader::is_loopback(const std::string& device) const {
  if (auto flags = read_line(net_dir(device) / "flags")) {
    if (auto v = parse_number<unsigned>(*flags, 16)) return (*v & kIffLoopback) != 0;
  }
  return device == "lo";
}

NicReading SysfsReader::read_nic(const std::string& device) const {
  NicReading r;
  r.device = device;
  r.present = has_nic(device);
  if (!r.present) return r;
  const fs::path dir = net_dir(device);
  r.operstate = read_line(dir / "operstate").value_or("");
  if (auto c = read_line(dir / "carrier")) {
    if (*c == "1") r.carrier = true;
    if (*c == "0") r.carrier = false;
  }
  r.up = r.carrier.value_or(false) && (r.operstate == "up" || r.operstate == "unknown");
  if (auto line = read_line(dir / "speed")) {
    // Mbit/s; -1 (or an unreadable file) when the driver does not know.
    if (auto mbit = parse_number<long long>(*line); mbit && *mbit > 0)
      r.speed_bytes_per_second = static_cast<double>(*mbit) * 1e6 / 8.0;
  }
  r.carrier_changes = read_u64(dir / "carrier_changes");
  const fs::path stats = dir / "statistics";
  r.rx_bytes = read_u64(stats / "rx_bytes");
  r.tx_bytes = read_u64(stats / "tx_bytes");
  for (const auto& c : kNicErrorCounters) {
    if (auto v = read_u64(stats / c.file)) r.errors.push_back({c.direction, c.kind, *v});
  }
  return r;
}

std::optional<double> parse_ib_rate(const std::string& text) {
  // "<number> Gb/sec (...)"
  const auto space = text.find(' ');
  if (space == std::string::npos) return std::nullopt;
  const std::string number = text.substr(0, space);
  const std::string rest = text.substr(space + 1);
  double value = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (ec != std::errc() || end != number.data() + number.size() || value < 0) return std::nullopt;
  if (rest.rfind("Gb/sec", 0) == 0) return value * 1e9 / 8.0;
  if (rest.rfind("Mb/sec", 0) == 0) return value * 1e6 / 8.0;
  return std::nullopt;
}

std::vector<IbPortReading> SysfsReader::read_ib_ports() const {
  std::vector<IbPortReading> out;
  const fs::path ib = root_ / "class" / "infiniband";
  for (const auto& device : sorted_dir_names(ib)) {
    const fs::path ports = ib / device / "ports";
    for (const auto& port : sorted_dir_names(ports)) {
      const fs::path dir = ports / port;
      IbPortReading p;
      p.device = device;
      p.port = port;
      if (auto state = read_line(dir / "state")) {
        // "4: ACTIVE"
        const auto colon = state->find(": ");
        p.state = colon == std::string::npos ? *state : state->substr(colon + 2);
      }
      p.active = p.state == "ACTIVE";
      if (auto rate = read_line(dir / "rate")) p.rate_bytes_per_second = parse_ib_rate(*rate);
      const fs::path counters = dir / "counters";
      if (auto v = read_u64(counters / "port_rcv_data")) p.rx_bytes = *v * 4;
      if (auto v = read_u64(counters / "port_xmit_data")) p.tx_bytes = *v * 4;
      for (const char* name : kIbErrorCounters) {
        if (auto v = read_u64(counters / name)) p.errors.push_back({"", name, *v});
      }
      out.push_back(std::move(p));
    }
  }
  return out;
}

}  // namespace r2ccl::mon

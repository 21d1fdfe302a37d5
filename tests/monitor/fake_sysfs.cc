#include "fake_sysfs.h"

#include <unistd.h>

#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

namespace r2ccl::mon::test {
namespace fs = std::filesystem;

FakeSysfs::FakeSysfs() {
  std::string pattern = (fs::temp_directory_path() / "r2ccl-sysfs-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  root_ = pattern;
}

FakeSysfs::~FakeSysfs() {
  std::error_code ec;
  fs::remove_all(root_, ec);
}

void FakeSysfs::write(const fs::path& relative, const std::string& content) const {
  const fs::path path = root_ / relative;
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::trunc);
  out << content << "\n";
}

void FakeSysfs::remove(const fs::path& relative) const {
  std::error_code ec;
  fs::remove_all(root_ / relative, ec);
}

void FakeSysfs::add_nic(const std::string& device, bool up, long long speed_mbit) const {
  const fs::path dir = fs::path("class/net") / device;
  write(dir / "flags", up ? "0x1003" : "0x1002");
  write(dir / "speed", std::to_string(speed_mbit));
  write(dir / "carrier_changes", "0");
  for (const char* stat :
       {"rx_bytes", "tx_bytes", "rx_errors", "rx_dropped", "rx_crc_errors", "rx_frame_errors",
        "rx_fifo_errors", "rx_missed_errors", "tx_errors", "tx_dropped", "tx_carrier_errors"})
    write(dir / "statistics" / stat, "0");
  set_link(device, up);
}

void FakeSysfs::set_link(const std::string& device, bool up) const {
  const fs::path dir = fs::path("class/net") / device;
  write(dir / "operstate", up ? "up" : "down");
  if (up) {
    write(dir / "carrier", "1");
  } else {
    remove(dir / "carrier");  // the kernel answers EINVAL while the link is admin down
  }
}

void FakeSysfs::add_loopback(const std::string& device) const {
  const fs::path dir = fs::path("class/net") / device;
  write(dir / "flags", "0x9");
  write(dir / "operstate", "unknown");
  write(dir / "carrier", "1");
  write(dir / "statistics" / "rx_bytes", "0");
  write(dir / "statistics" / "tx_bytes", "0");
}

void FakeSysfs::set_stat(const std::string& device, const std::string& name,
                         std::uint64_t value) const {
  write(fs::path("class/net") / device / "statistics" / name, std::to_string(value));
}

void FakeSysfs::add_ib_port(const std::string& device, const std::string& port, bool active) const {
  const fs::path dir = fs::path("class/infiniband") / device / "ports" / port;
  write(dir / "state", active ? "4: ACTIVE" : "1: DOWN");
  write(dir / "rate", "100 Gb/sec (4X EDR)");
  write(dir / "counters" / "port_rcv_data", "1000");
  write(dir / "counters" / "port_xmit_data", "250");
  write(dir / "counters" / "symbol_error", "3");
  write(dir / "counters" / "link_downed", "1");
}

}  // namespace r2ccl::mon::test

// A fake sysfs tree in a temporary directory, for the monitor's unit tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace r2ccl::mon::test {

class FakeSysfs {
 public:
  FakeSysfs();
  ~FakeSysfs();
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  const std::filesystem::path& root() const { return root_; }

  // Writes root/relative (creating directories) with `content` + "\n".
  void write(const std::filesystem::path& relative, const std::string& content) const;
  void remove(const std::filesystem::path& relative) const;

  // class/net/DEV with operstate, carrier, speed (Mbit/s; -1 unknown), flags, carrier_changes
  // and statistics/{rx,tx}_bytes plus the error counters (all 0).
  void add_nic(const std::string& device, bool up, long long speed_mbit = 10000) const;
  // The link goes down the way the kernel shows it: operstate down, carrier unreadable.
  void set_link(const std::string& device, bool up) const;
  void add_loopback(const std::string& device = "lo") const;
  void set_stat(const std::string& device, const std::string& name, std::uint64_t value) const;
  // class/infiniband/DEV/ports/PORT with state, rate and counters.
  void add_ib_port(const std::string& device, const std::string& port, bool active) const;

 private:
  std::filesystem::path root_;
};

}  // namespace r2ccl::mon::test

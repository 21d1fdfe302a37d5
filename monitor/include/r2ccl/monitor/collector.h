// The NIC-health collector: a prometheus::Collectable whose Collect() reads sysfs and the probe
// windows at scrape time, so a link change shows on the very next scrape.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <functional>
#include <string>
#include <vector>

#include "r2ccl/monitor/prober.h"
#include "r2ccl/monitor/sysfs.h"

namespace r2ccl::mon {

// One metric family: name, type and help text (the README's table is written from these).
struct FamilyInfo {
  const char* name;
  prometheus::MetricType type;
  const char* labels;
  const char* help;
};
// Every family r2ccl-monitor exports, in exposition order.
const std::vector<FamilyInfo>& exported_families();

// This build's version (the CMake project version).
const char* monitor_version();

class NicHealthCollector : public prometheus::Collectable {
 public:
  using ProbeSource = std::function<std::vector<ProbeStatus>()>;

  // `nics`: the devices to export; empty: every non-loopback interface at each scrape.
  // `probes` may be empty (no probes configured).
  NicHealthCollector(SysfsReader sysfs, std::vector<std::string> nics, ProbeSource probes);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  SysfsReader sysfs_;
  std::vector<std::string> nics_;
  ProbeSource probes_;
};

}  // namespace r2ccl::mon

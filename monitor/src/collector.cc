#include "r2ccl/monitor/collector.h"

#include <map>
#include <utility>

namespace r2ccl::mon {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

#ifndef R2CCL_VERSION
#define R2CCL_VERSION "unknown"
#endif

enum Family : std::size_t {
  kBuildInfo,
  kNicUp,
  kNicDegraded,
  kCarrierChanges,
  kSpeed,
  kRxBytes,
  kTxBytes,
  kErrors,
  kProbeRtt,
  kProbeLoss,
  kIbPortUp,
  kIbRate,
  kIbRxBytes,
  kIbTxBytes,
  kIbErrors,
  kFamilyCount,
};

const std::vector<FamilyInfo> kFamilies = {
    {"r2ccl_build_info", MetricType::Gauge, "version",
     "Always 1; the version label says which r2ccl-monitor build is running."},
    {"r2ccl_nic_up", MetricType::Gauge, "device",
     "1 when the NIC has carrier and its operational state is up, else 0 (read from sysfs at "
     "scrape time)."},
    {"r2ccl_nic_degraded", MetricType::Gauge, "device",
     "1 when the NIC's link is down or a probe on it lost at least half of its window, else 0."},
    {"r2ccl_nic_carrier_changes_total", MetricType::Counter, "device",
     "Link carrier changes (up or down) the kernel counted on the NIC."},
    {"r2ccl_nic_speed_bytes_per_second", MetricType::Gauge, "device",
     "Link speed the driver reports, in bytes per second (absent when unknown)."},
    {"r2ccl_nic_rx_bytes_total", MetricType::Counter, "device", "Bytes received by the NIC."},
    {"r2ccl_nic_tx_bytes_total", MetricType::Counter, "device", "Bytes sent by the NIC."},
    {"r2ccl_nic_errors_total", MetricType::Counter, "device, direction, kind",
     "NIC error and drop counters by direction (rx, tx) and kind (errors is the kernel's total; "
     "dropped; crc, frame, fifo, missed, over, length, nohandler, aborted, carrier, heartbeat, "
     "window)."},
    {"r2ccl_nic_probe_rtt_seconds", MetricType::Gauge, "device, peer",
     "Mean round-trip time of the answered UDP echo probes in the window, from the NIC to the "
     "peer (absent while none was answered)."},
    {"r2ccl_nic_probe_loss_ratio", MetricType::Gauge, "device, peer",
     "Share of the probes in the window (sent from the NIC to the peer) that got no reply in "
     "time, 0 to 1."},
    {"r2ccl_ib_port_up", MetricType::Gauge, "device, port",
     "1 when the verbs port's state is ACTIVE, else 0."},
    {"r2ccl_ib_port_rate_bytes_per_second", MetricType::Gauge, "device, port",
     "Verbs port rate in bytes per second."},
    {"r2ccl_ib_port_rx_bytes_total", MetricType::Counter, "device, port",
     "Bytes received by the verbs port."},
    {"r2ccl_ib_port_tx_bytes_total", MetricType::Counter, "device, port",
     "Bytes sent by the verbs port."},
    {"r2ccl_ib_port_errors_total", MetricType::Counter, "device, port, kind",
     "Verbs port error counters; kind is the sysfs counter's name (symbol_error, "
     "port_rcv_errors, link_downed, ...)."},
};

ClientMetric sample(std::vector<ClientMetric::Label> labels, MetricType type, double value) {
  ClientMetric m;
  m.label = std::move(labels);
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

}  // namespace

const std::vector<FamilyInfo>& exported_families() {
  return kFamilies;
}

const char* monitor_version() {
  return R2CCL_VERSION;
}

NicHealthCollector::NicHealthCollector(SysfsReader sysfs, std::vector<std::string> nics,
                                       ProbeSource probes)
    : sysfs_(std::move(sysfs)), nics_(std::move(nics)), probes_(std::move(probes)) {}

std::vector<MetricFamily> NicHealthCollector::Collect() const {
  static_assert(kFamilyCount > 0);
  std::vector<MetricFamily> families(kFamilyCount);
  for (std::size_t i = 0; i < kFamilyCount; ++i) {
    families[i].name = kFamilies[i].name;
    families[i].help = kFamilies[i].help;
    families[i].type = kFamilies[i].type;
  }
  auto add = [&](Family f, std::vector<ClientMetric::Label> labels, double value) {
    families[f].metric.push_back(sample(std::move(labels), families[f].type, value));
  };

  add(kBuildInfo, {{"version", monitor_version()}}, 1);

  const std::vector<ProbeStatus> probes = probes_ ? probes_() : std::vector<ProbeStatus>{};
  std::map<std::string, bool> probe_degraded;  // device -> any probe on it degraded
  for (const auto& p : probes) {
    probe_degraded[p.device] = probe_degraded[p.device] || p.degraded;
    std::vector<ClientMetric::Label> labels = {{"device", p.device}, {"peer", p.peer}};
    if (p.stats.rtt_mean_seconds) add(kProbeRtt, labels, *p.stats.rtt_mean_seconds);
    add(kProbeLoss, labels, p.stats.loss_ratio);
  }

  const std::vector<std::string> devices = nics_.empty() ? sysfs_.default_nics() : nics_;
  for (const auto& device : devices) {
    const NicReading r = sysfs_.read_nic(device);
    const std::vector<ClientMetric::Label> dev = {{"device", device}};
    add(kNicUp, dev, r.up ? 1 : 0);
    const auto it = probe_degraded.find(device);
    const bool degraded = !r.up || (it != probe_degraded.end() && it->second);
    add(kNicDegraded, dev, degraded ? 1 : 0);
    if (r.carrier_changes) add(kCarrierChanges, dev, static_cast<double>(*r.carrier_changes));
    if (r.speed_bytes_per_second) add(kSpeed, dev, *r.speed_bytes_per_second);
    if (r.rx_bytes) add(kRxBytes, dev, static_cast<double>(*r.rx_bytes));
    if (r.tx_bytes) add(kTxBytes, dev, static_cast<double>(*r.tx_bytes));
    for (const auto& e : r.errors) {
      add(kErrors, {{"device", device}, {"direction", e.direction}, {"kind", e.kind}},
          static_cast<double>(e.value));
    }
  }

  for (const auto& p : sysfs_.read_ib_ports()) {
    const std::vector<ClientMetric::Label> port = {{"device", p.device}, {"port", p.port}};
    add(kIbPortUp, port, p.active ? 1 : 0);
    if (p.rate_bytes_per_second) add(kIbRate, port, *p.rate_bytes_per_second);
    if (p.rx_bytes) add(kIbRxBytes, port, static_cast<double>(*p.rx_bytes));
    if (p.tx_bytes) add(kIbTxBytes, port, static_cast<double>(*p.tx_bytes));
    for (const auto& e : p.errors) {
      add(kIbErrors, {{"device", p.device}, {"port", p.port}, {"kind", e.kind}},
          static_cast<double>(e.value));
    }
  }
  // Verbs families only where verbs devices exist; the NIC families always (with HELP).
  std::vector<MetricFamily> out;
  for (std::size_t i = 0; i < kFamilyCount; ++i) {
    if (i >= kIbPortUp && families[i].metric.empty()) continue;
    out.push_back(std::move(families[i]));
  }
  return out;
}

}  // namespace r2ccl::mon

#include "r2ccl/monitor/job_metrics.h"

#include <prometheus/client_metric.h>
#include <prometheus/metric_family.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "r2ccl/monitor/http_exporter.h"
#include "r2ccl/runtime/log.h"

#ifndef R2CCL_VERSION
#define R2CCL_VERSION "unknown"
#endif

namespace r2ccl::mon {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily family(const char* name, const char* help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void add(MetricFamily& f, std::vector<ClientMetric::Label> labels, double value) {
  ClientMetric m;
  m.label = std::move(labels);
  if (f.type == MetricType::Counter)
    m.counter.value = value;
  else
    m.gauge.value = value;
  f.metric.push_back(std::move(m));
}

constexpr RailState kStates[] = {RailState::kUp, RailState::kSuspect, RailState::kDown,
                                 RailState::kProbing, RailState::kDegraded};

}  // namespace

RailCollector::RailCollector(const Fabric& fabric)
    : endpoint_(fabric.endpoint()), rank_(std::to_string(fabric.rank())) {}

std::vector<MetricFamily> RailCollector::Collect() const {
  auto up =
      family("r2ccl_rail_up", "1 while the rail carries traffic (state up or degraded), else 0.",
             MetricType::Gauge);
  auto state = family("r2ccl_rail_state", "The rail's health state, one-hot over the label state.",
                      MetricType::Gauge);
  auto degraded =
      family("r2ccl_rail_degraded",
             "1 when the rail's measured bandwidth is well below its peers' (kept in use).",
             MetricType::Gauge);
  auto tx = family("r2ccl_rail_tx_bytes_total", "Bytes sent on the rail and confirmed by the peer.",
                   MetricType::Counter);
  auto rx = family("r2ccl_rail_rx_bytes_total", "Bytes that arrived from the peer on the rail.",
                   MetricType::Counter);
  auto errors =
      family("r2ccl_rail_errors_total", "Errors on the rail, by kind.", MetricType::Counter);
  auto failovers =
      family("r2ccl_rail_failovers_total",
             "Times the rail failed and was fenced, its in-flight data moved to the other rails.",
             MetricType::Counter);
  auto replayed =
      family("r2ccl_rail_replayed_bytes_total",
             "Bytes re-sent on this rail after another rail failed.", MetricType::Counter);
  auto flaps = family("r2ccl_rail_flaps_total",
                      "Times the rail went bad (link down or probes lost).", MetricType::Counter);
  auto bandwidth = family("r2ccl_rail_bandwidth_bytes_per_second",
                          "Measured bandwidth of the rail.", MetricType::Gauge);
  auto rtt = family("r2ccl_rail_rtt_seconds", "Round-trip time of the rail's last probe.",
                    MetricType::Gauge);
  auto weight = family(
      "r2ccl_rail_weight",
      "The scheduler's weight of the rail: its bandwidth relative to the fastest usable rail.",
      MetricType::Gauge);
  auto holddown =
      family("r2ccl_rail_holddown_seconds",
             "How long the rail must be stable before re-admission after its next failure.",
             MetricType::Gauge);

  const std::string& rank = rank_;
  for (const auto& v : endpoint_.rail_telemetry()) {
    const auto& t = *v.telemetry;
    const std::vector<ClientMetric::Label> labels = {{"rank", rank},
                                                     {"peer", std::to_string(v.peer)},
                                                     {"device", v.nic},
                                                     {"remote_device", v.remote_nic}};
    const RailState s = t.state.load(std::memory_order_relaxed);
    add(up, labels, s == RailState::kUp || s == RailState::kDegraded ? 1 : 0);
    for (RailState each : kStates) {
      auto l = labels;
      l.push_back({"state", std::string(rail_state_name(each))});
      add(state, l, each == s ? 1 : 0);
    }
    add(degraded, labels, s == RailState::kDegraded ? 1 : 0);
    add(tx, labels, static_cast<double>(t.tx_bytes.load(std::memory_order_relaxed)));
    add(rx, labels, static_cast<double>(t.rx_bytes.load(std::memory_order_relaxed)));
    auto el = labels;
    el.push_back({"kind", "transport"});
    add(errors, el, static_cast<double>(t.errors.load(std::memory_order_relaxed)));
    add(failovers, labels, static_cast<double>(t.failovers.load(std::memory_order_relaxed)));
    add(replayed, labels, static_cast<double>(t.replayed_bytes.load(std::memory_order_relaxed)));
    add(flaps, labels, static_cast<double>(t.flaps.load(std::memory_order_relaxed)));
    add(bandwidth, labels, static_cast<double>(t.bandwidth_bps.load(std::memory_order_relaxed)));
    add(rtt, labels, static_cast<double>(t.rtt_ns.load(std::memory_order_relaxed)) / 1e9);
    add(weight, labels,
        static_cast<double>(t.weight_milli.load(std::memory_order_relaxed)) / 1000.0);
    add(holddown, labels,
        static_cast<double>(t.holddown_ms.load(std::memory_order_relaxed)) / 1000.0);
  }

  auto detection =
      family("r2ccl_failover_detection_seconds",
             "How long rail failures took to detect (from the last sign of life, or the event).",
             MetricType::Histogram);
  {
    const auto& h = endpoint_.failover_detection();
    ClientMetric m;
    m.label = {{"rank", rank}};
    const auto cum = h.cumulative();
    for (std::size_t i = 0; i < LatencyHistogram::kBounds.size(); ++i)
      m.histogram.bucket.push_back({cum[i], LatencyHistogram::kBounds[i]});
    m.histogram.bucket.push_back({h.count(), std::numeric_limits<double>::infinity()});
    m.histogram.sample_count = h.count();
    m.histogram.sample_sum = h.sum();
    detection.metric.push_back(std::move(m));
  }
  // What modules above the runtime published (the KV engine's r2ccl_kv_*), one family per name.
  std::vector<MetricFamily> published;
  auto family_for = [&](const std::string& name, const std::string& help,
                        MetricType type) -> MetricFamily& {
    for (auto& f : published)
      if (f.name == name) return f;
    published.push_back(family(name.c_str(), help.c_str(), type));
    return published.back();
  };
  endpoint_.metrics().for_each(
      [&](const MetricRegistry::Counter& c) {
        std::vector<ClientMetric::Label> l;
        for (const auto& [k, v] : c.labels)
          l.push_back({k, v});
        add(family_for(c.name, c.help, MetricType::Counter), l,
            static_cast<double>(c.value.load(std::memory_order_relaxed)));
      },
      [&](const MetricRegistry::Histogram& h) {
        ClientMetric m;
        for (const auto& [k, v] : h.labels)
          m.label.push_back({k, v});
        const auto cum = h.histogram.cumulative();
        for (std::size_t i = 0; i < LatencyHistogram::kBounds.size(); ++i)
          m.histogram.bucket.push_back({cum[i], LatencyHistogram::kBounds[i]});
        m.histogram.bucket.push_back(
            {h.histogram.count(), std::numeric_limits<double>::infinity()});
        m.histogram.sample_count = h.histogram.count();
        m.histogram.sample_sum = h.histogram.sum();
        family_for(h.name, h.help, MetricType::Histogram).metric.push_back(std::move(m));
      });

  auto build = family("r2ccl_build_info", "r2ccl's version; always 1.", MetricType::Gauge);
  add(build, {{"version", R2CCL_VERSION}, {"rank", rank}}, 1);

  std::vector<MetricFamily> out = {up,     state,     degraded, tx,        rx,
                                   errors, failovers, replayed, flaps,     bandwidth,
                                   rtt,    weight,    holddown, detection, build};
  for (auto& f : published)
    out.push_back(std::move(f));
  return out;
}

std::unique_ptr<JobMetrics> JobMetrics::start(const Config& config, const Fabric& fabric) {
  return start(config, fabric.endpoint(), fabric.rank(), std::to_string(fabric.rank()));
}

namespace detail {

// The collectors behind one endpoint, each under its comm label. A scrape holds the lock while it
// reads them, so that a collector removed is never read again (its endpoint may go next).
class ProcessCollector final : public prometheus::Collectable {
 public:
  std::string add(std::shared_ptr<RailCollector> c) {
    std::lock_guard lock(mutex_);
    std::string comm = std::to_string(next_++);
    members_.emplace_back(comm, std::move(c));
    return comm;
  }
  void remove(const std::string& comm) {
    std::lock_guard lock(mutex_);
    std::erase_if(members_, [&](const auto& m) { return m.first == comm; });
  }
  std::vector<MetricFamily> Collect() const override {
    std::lock_guard lock(mutex_);
    std::vector<MetricFamily> out;
    for (const auto& [comm, collector] : members_) {
      for (auto& f : collector->Collect()) {
        for (auto& m : f.metric)
          m.label.push_back({"comm", comm});
        auto same = std::find_if(out.begin(), out.end(),
                                 [&](const MetricFamily& o) { return o.name == f.name; });
        if (same == out.end()) {
          out.push_back(std::move(f));
        } else {
          for (auto& m : f.metric)
            same->metric.push_back(std::move(m));
        }
      }
    }
    return out;
  }

 private:
  mutable std::mutex mutex_;
  std::uint64_t next_ = 0;
  std::vector<std::pair<std::string, std::shared_ptr<RailCollector>>> members_;
};

// The process's endpoints by configured address and R2CCL_METRICS_PORT. Each endpoint holds it,
// so that it outlives them whatever the order of destruction at exit.
struct Exporters {
  std::mutex mutex;
  std::map<std::pair<std::string, int>, std::weak_ptr<SharedExporter>> by_setting;
};

struct SharedExporter {
  std::shared_ptr<Exporters> exporters;
  std::shared_ptr<ProcessCollector> collector = std::make_shared<ProcessCollector>();
  std::unique_ptr<HttpExporter> http;
};

}  // namespace detail

namespace {
std::shared_ptr<detail::Exporters> exporters() {
  static const auto all = std::make_shared<detail::Exporters>();
  return all;
}
}  // namespace

std::unique_ptr<JobMetrics> JobMetrics::start(const Config& config, const Endpoint& endpoint,
                                              int port_offset, std::string rank) {
  if (!config.metrics_port) return nullptr;
  auto collector = std::make_shared<RailCollector>(endpoint, std::move(rank));
  const auto all = exporters();
  std::lock_guard lock(all->mutex);
  const std::pair<std::string, int> key{config.metrics_addr, *config.metrics_port};
  std::shared_ptr<detail::SharedExporter> shared = all->by_setting[key].lock();
  if (!shared) {
    const int port = *config.metrics_port + port_offset;
    if (port > 65535) {
      R2CCL_WARN("metrics: R2CCL_METRICS_PORT {} + {} is past 65535; running without metrics",
                 *config.metrics_port, port_offset);
      return nullptr;
    }
    shared = std::make_shared<detail::SharedExporter>();
    shared->exporters = all;
    const HostPort at{config.metrics_addr, static_cast<std::uint16_t>(port)};
    auto http = HttpExporter::start(at, shared->collector);
    if (!http) {
      R2CCL_WARN("metrics: cannot serve on {}: {}; running without metrics", at.to_string(),
                 http.status().message());
      return nullptr;
    }
    shared->http = std::move(*http);
    all->by_setting[key] = shared;
    R2CCL_INFO("metrics: serving /metrics on {}", at.to_string());
  }
  std::unique_ptr<JobMetrics> m(new JobMetrics());
  m->comm_ = shared->collector->add(std::move(collector));
  m->shared_ = std::move(shared);
  if (m->comm_ != "0")
    R2CCL_INFO("metrics: series with comm=\"{}\" added to /metrics on port {}", m->comm_,
               m->port());
  return m;
}

JobMetrics::~JobMetrics() {
  shared_->collector->remove(comm_);
  const auto all = shared_->exporters;
  std::lock_guard lock(all->mutex);
  shared_.reset();  // the last one stops the endpoint, before its setting can be taken again
}

std::uint16_t JobMetrics::port() const {
  return shared_->http->port();
}

}  // namespace r2ccl::mon

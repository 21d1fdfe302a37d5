// Prometheus exposition of a running job's rail telemetry.
//
// A job (r2ccl-perf today; the communicator and the KV engine with their issues) starts it when
// R2CCL_METRICS_PORT is set. The collector reads the fabric's plain atomics at scrape time: the
// data path never takes a lock or calls into Prometheus.
#pragma once

#include <prometheus/collectable.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "r2ccl/runtime/fabric.h"

namespace r2ccl::mon {

// r2ccl_rail_* families (labels rank, peer, device, remote_device), the failover detection
// histogram and r2ccl_build_info.
class RailCollector final : public prometheus::Collectable {
 public:
  explicit RailCollector(const Fabric& fabric);
  // An endpoint outside a world (the NCCL network plugin's): `rank` is the label's value.
  RailCollector(const Endpoint& endpoint, std::string rank)
      : endpoint_(endpoint), rank_(std::move(rank)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const Endpoint& endpoint_;
  std::string rank_;
};

namespace detail {
struct SharedExporter;
}

// One HTTP endpoint per process and configured address: the first JobMetrics started with it
// listens on R2CCL_METRICS_PORT + its offset; every later one in the process with the same
// setting (another communicator, a split, a KV engine) joins that endpoint rather than take a
// port of its own. Every series carries label comm, the order in which the process started them
// ("0" for the first), so that two communicators' rails stay apart.
class JobMetrics {
 public:
  // nullptr when R2CCL_METRICS_PORT is not set, or — with a warning naming the address and the
  // reason — when the endpoint cannot start (port in use, foreign address): the job runs on.
  static std::unique_ptr<JobMetrics> start(const Config& config, const Fabric& fabric);
  // The same for an endpoint outside a world: served on R2CCL_METRICS_PORT + `port_offset`,
  // its series labelled rank=`rank`.
  static std::unique_ptr<JobMetrics> start(const Config& config, const Endpoint& endpoint,
                                           int port_offset, std::string rank);
  // Its series leave the endpoint (a scrape in progress finishes first); the endpoint closes
  // with the last of the process's JobMetrics that share it.
  ~JobMetrics();
  JobMetrics(const JobMetrics&) = delete;
  JobMetrics& operator=(const JobMetrics&) = delete;
  std::uint16_t port() const;
  // Its series' value of label comm.
  const std::string& comm() const { return comm_; }

 private:
  JobMetrics() = default;
  std::shared_ptr<detail::SharedExporter> shared_;
  std::string comm_;
};

}  // namespace r2ccl::mon

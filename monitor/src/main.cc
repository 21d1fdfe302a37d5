// r2ccl-monitor: a standalone NIC-health exporter (see monitor/README.md).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>

#include <cstdio>
#include <exception>
#include <memory>

#include "r2ccl/monitor/collector.h"
#include "r2ccl/monitor/http_exporter.h"
#include "r2ccl/monitor/options.h"
#include "r2ccl/monitor/prober.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/topology.h"

namespace {

using namespace r2ccl;
using namespace r2ccl::mon;

int fail(const Status& st) {
  fmt::print(stderr, "r2ccl-monitor: {}\n", st.message());
  return kExitUsage;
}

int run(int argc, char** argv) {
  const CommandLine cl = parse_command_line(argc, argv);
  if (!cl.options) {
    std::fputs(cl.output.c_str(), cl.exit_code == 0 ? stdout : stderr);
    return cl.exit_code;
  }
  const MonitorOptions& o = *cl.options;
  set_log_level(o.log_level);

  SysfsReader sysfs(o.sysfs_root);
  auto plan =
      plan_monitor(o, sysfs, [](const std::string& device) { return interface_ipv4(device); });
  if (!plan) return fail(plan.status());

  // SIGINT/SIGTERM are taken by sigwait() below; block them before any thread starts so that
  // every thread inherits the mask and none of them is interrupted.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto prober_or = Prober::start(plan->prober);
  if (!prober_or) return fail(prober_or.status());
  std::shared_ptr<Prober> prober = std::move(*prober_or);

  auto collector = std::make_shared<NicHealthCollector>(sysfs, plan->nics,
                                                        [prober] { return prober->status(); });
  auto http = HttpExporter::start(o.listen, collector);
  if (!http) return fail(http.status());

  std::vector<std::string> probe_names;
  for (const auto& t : plan->prober.targets)
    probe_names.push_back(
        fmt::format("{}({})->{}", t.spec.device, t.local_address, t.spec.peer_label()));
  R2CCL_INFO(
      "r2ccl-monitor {}: metrics on http://{}:{}/metrics, NICs: {}, echo port: {}, "
      "probes: {}",
      monitor_version(), o.listen.host, (*http)->port(),
      plan->nics.empty() ? std::string("every non-loopback interface")
                         : fmt::format("{}", fmt::join(plan->nics, ",")),
      prober->echo_port() == 0 ? std::string("off") : std::to_string(prober->echo_port()),
      probe_names.empty() ? std::string("none") : fmt::format("{}", fmt::join(probe_names, " ")));

  int sig = 0;
  if (const int err = sigwait(&signals, &sig); err != 0) {
    R2CCL_ERROR("r2ccl-monitor: sigwait failed ({}), shutting down", err);
  } else {
    R2CCL_INFO("r2ccl-monitor: {}, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
  }
  // Stop serving first (its threads call into the collector), then the probe thread.
  http->reset();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "r2ccl-monitor: unexpected error: %s\n", e.what());
    return 1;
  }
}

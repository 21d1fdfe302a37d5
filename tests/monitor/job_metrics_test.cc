// The job's rail metrics: two ranks (threads of this process) over two loopback rails each.
#include "r2ccl/monitor/job_metrics.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include <future>
#include <map>
#include <set>
#include <sstream>

#include "net_util.h"

namespace r2ccl::mon {
namespace {

using std::chrono::milliseconds;

Config config_for(int rank, const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> vars = extra;
  vars["R2CCL_NICS"] = rank == 0 ? "127.0.30.1,127.0.30.2" : "127.0.31.1,127.0.31.2";
  auto c = parse_config([&](const std::string& n) -> std::optional<std::string> {
    auto it = vars.find(n);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return *c;
}

struct Pair {
  std::unique_ptr<Fabric> a, b;
};

Pair make_pair_of_ranks(const std::map<std::string, std::string>& extra = {}) {
  const auto port = test::free_port();
  auto make = [&](int rank) {
    return std::async(std::launch::async, [=] {
      BootstrapOptions o{rank, 2, HostPort{"127.0.0.1", port}, {}, milliseconds(10000), ""};
      return Fabric::create(config_for(rank, extra), o);
    });
  };
  auto fa = make(0);
  auto fb = make(1);
  auto a = fa.get();
  auto b = fb.get();
  EXPECT_TRUE(a.is_ok() && b.is_ok());
  return {std::move(*a), std::move(*b)};
}

const prometheus::MetricFamily* find(const std::vector<prometheus::MetricFamily>& fs,
                                     const std::string& name) {
  for (const auto& f : fs)
    if (f.name == name) return &f;
  return nullptr;
}

TEST(JobMetrics, RailFamiliesReadTheLiveTelemetry) {
  auto p = make_pair_of_ranks();
  std::vector<std::byte> src(3 << 20, std::byte{7}), dst(3 << 20);
  auto rs = *p.a->register_memory(src.data(), src.size());
  auto rd = *p.b->register_memory(dst.data(), dst.size());
  auto recv = *p.b->irecv(0, rd, 0, src.size());
  auto send = *p.a->isend(1, rs, 0, src.size());
  ASSERT_TRUE(p.a->wait(send).is_ok());
  ASSERT_TRUE(p.b->wait(recv).is_ok());

  RailCollector collector(*p.a);
  const auto families = collector.Collect();
  for (const char* name :
       {"r2ccl_rail_up", "r2ccl_rail_state", "r2ccl_rail_degraded", "r2ccl_rail_tx_bytes_total",
        "r2ccl_rail_rx_bytes_total", "r2ccl_rail_errors_total", "r2ccl_rail_failovers_total",
        "r2ccl_rail_replayed_bytes_total", "r2ccl_rail_flaps_total",
        "r2ccl_rail_bandwidth_bytes_per_second", "r2ccl_rail_rtt_seconds",
        "r2ccl_failover_detection_seconds", "r2ccl_build_info"}) {
    const auto* f = find(families, name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_FALSE(f->help.empty()) << name;
  }
  const auto* up = find(families, "r2ccl_rail_up");
  ASSERT_EQ(up->metric.size(), 2u);
  for (const auto& m : up->metric) {
    EXPECT_EQ(m.gauge.value, 1);
    std::map<std::string, std::string> labels;
    for (const auto& l : m.label)
      labels[l.name] = l.value;
    EXPECT_EQ(labels["rank"], "0");
    EXPECT_EQ(labels["peer"], "1");
    EXPECT_TRUE(labels["device"] == "127.0.30.1" || labels["device"] == "127.0.30.2")
        << labels["device"];
  }
  double tx = 0;
  for (const auto& m : find(families, "r2ccl_rail_tx_bytes_total")->metric)
    tx += m.counter.value;
  EXPECT_EQ(tx, static_cast<double>(src.size()));  // every byte confirmed exactly once
  // One-hot state: exactly one state per rail is 1.
  double ones = 0;
  for (const auto& m : find(families, "r2ccl_rail_state")->metric)
    ones += m.gauge.value;
  EXPECT_EQ(ones, 2);
  // Counters published by modules above the runtime are exported too, one family per name.
  auto& c = p.a->metrics().counter("r2ccl_kv_requests_total", "help",
                                   {{"rank", "0"}, {"status", "done"}});
  c.value = 5;
  const auto again = collector.Collect();
  const auto* kv = find(again, "r2ccl_kv_requests_total");
  ASSERT_NE(kv, nullptr);
  EXPECT_EQ(kv->metric.at(0).counter.value, 5);
  const auto* h = find(families, "r2ccl_failover_detection_seconds");
  EXPECT_EQ(h->type, prometheus::MetricType::Histogram);
  EXPECT_EQ(h->metric.at(0).histogram.sample_count, 0u);
}

TEST(JobMetrics, ServedOverHttpWhenAPortIsSetAndOffOtherwise) {
  const auto port = test::free_port();
  auto p = make_pair_of_ranks({{"R2CCL_METRICS_PORT", std::to_string(port)}});
  EXPECT_EQ(JobMetrics::start(config_for(0, {}), *p.a), nullptr);  // no port: off
  auto m = JobMetrics::start(config_for(0, {{"R2CCL_METRICS_PORT", std::to_string(port)}}), *p.a);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->port(), port);  // rank 0: the port itself
  const std::string body = test::http_get(port, "/metrics");
  EXPECT_NE(body.find("200"), std::string::npos) << body.substr(0, 200);
  EXPECT_NE(body.find("# HELP r2ccl_rail_up "), std::string::npos);
  EXPECT_NE(body.find("r2ccl_rail_up{rank=\"0\",peer=\"1\",device=\"127.0.30.1\",remote_device="
                      "\"127.0.31.1\",comm=\"0\"} 1"),
            std::string::npos)
      << body;
}

// The lines of a scrape that belong to rank 0's rail to 127.0.31.1 under the given comm label.
std::size_t rail_up_lines(const std::string& body, const std::string& comm) {
  const std::string line =
      "r2ccl_rail_up{rank=\"0\",peer=\"1\",device=\"127.0.30.1\",remote_device="
      "\"127.0.31.1\",comm=\"" +
      comm + "\"} 1";
  std::size_t n = 0;
  for (auto at = body.find(line); at != std::string::npos; at = body.find(line, at + 1))
    ++n;
  return n;
}

TEST(JobMetrics, CommunicatorsOfOneProcessShareTheEndpointUnderTheirOwnLabel) {
  const auto port = test::free_port();
  const auto config = config_for(0, {{"R2CCL_METRICS_PORT", std::to_string(port)}});
  auto first = make_pair_of_ranks();
  auto second = make_pair_of_ranks();
  auto m0 = JobMetrics::start(config, *first.a);
  ASSERT_NE(m0, nullptr);
  // The second would have taken the same port (rank 0 of its own world): it joins instead.
  auto m1 = JobMetrics::start(config, *second.a);
  ASSERT_NE(m1, nullptr);
  EXPECT_EQ(m0->port(), port);
  EXPECT_EQ(m1->port(), port);
  EXPECT_EQ(m0->comm(), "0");
  EXPECT_EQ(m1->comm(), "1");
  std::string body = test::http_get(port, "/metrics");
  EXPECT_EQ(rail_up_lines(body, "0"), 1u) << body;
  EXPECT_EQ(rail_up_lines(body, "1"), 1u) << body;
  // Each family once, the two communicators' series under it.
  std::set<std::string> types;
  std::istringstream lines(body);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("# TYPE ", 0) == 0) {
      EXPECT_TRUE(types.insert(line).second) << line;
    }
  EXPECT_EQ(types.count("# TYPE r2ccl_rail_up gauge"), 1u) << body;
  // The first communicator goes: its series leave, the endpoint stays for the second.
  m0.reset();
  first = Pair{};
  body = test::http_get(port, "/metrics");
  EXPECT_EQ(rail_up_lines(body, "0"), 0u) << body;
  EXPECT_EQ(rail_up_lines(body, "1"), 1u) << body;
  // The last one closes it: the next one in the process listens anew, its series comm="0".
  m1.reset();
  auto m2 = JobMetrics::start(config, *second.a);
  ASSERT_NE(m2, nullptr);
  EXPECT_EQ(m2->port(), port);
  EXPECT_EQ(m2->comm(), "0");
  EXPECT_EQ(rail_up_lines(test::http_get(port, "/metrics"), "0"), 1u);
}

TEST(JobMetrics, APortInUseLeavesTheJobRunningWithoutMetrics) {
  const auto port = test::free_port();
  test::PortHolder busy(port, false);
  ASSERT_TRUE(busy.ok());
  auto p = make_pair_of_ranks();
  auto m = JobMetrics::start(config_for(0, {{"R2CCL_METRICS_PORT", std::to_string(port)}}), *p.a);
  EXPECT_EQ(m, nullptr);
  // The fabric still works.
  std::vector<std::byte> buf(1000, std::byte{1}), out(1000);
  auto rs = *p.a->register_memory(buf.data(), buf.size());
  auto rd = *p.b->register_memory(out.data(), out.size());
  auto recv = *p.b->irecv(0, rd, 0, 1000);
  auto send = *p.a->isend(1, rs, 0, 1000);
  EXPECT_TRUE(p.a->wait(send).is_ok());
  EXPECT_TRUE(p.b->wait(recv).is_ok());
  EXPECT_EQ(out, buf);
}

TEST(JobMetrics, BadSettingsAreNamed) {
  auto bad_port = parse_config([](const std::string& n) -> std::optional<std::string> {
    if (n == "R2CCL_METRICS_PORT") return std::string("99999");
    return std::nullopt;
  });
  ASSERT_FALSE(bad_port.is_ok());
  EXPECT_EQ(bad_port.status().message(),
            "R2CCL_METRICS_PORT='99999' is invalid: expected a TCP port from 1 to 65535");
  auto bad_addr = parse_config([](const std::string& n) -> std::optional<std::string> {
    if (n == "R2CCL_METRICS_ADDR") return std::string("localhost");
    return std::nullopt;
  });
  ASSERT_FALSE(bad_addr.is_ok());
  EXPECT_EQ(bad_addr.status().message(),
            "R2CCL_METRICS_ADDR='localhost' is invalid: expected an IPv4 address such as 127.0.0.1 "
            "or 0.0.0.0");
}

}  // namespace
}  // namespace r2ccl::mon

#include "coll_test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "../unit/test_util.h"

namespace r2ccl::test {

std::vector<std::unique_ptr<coll::Communicator>> make_comms(
    int n, std::map<std::string, std::string> extra) {
  const auto port = free_port();
  std::vector<std::future<Result<std::unique_ptr<coll::Communicator>>>> fs;
  for (int r = 0; r < n; ++r) {
    fs.push_back(std::async(std::launch::async, [=] {
      std::map<std::string, std::string> vars = extra;
      vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2", 20 + r);
      vars.emplace("R2CCL_CHUNK_SIZE", "64K");
      vars.emplace("R2CCL_RAIL_WINDOW", "256K");
      vars.emplace("R2CCL_TIMEOUT", "20s");
      // Many ranks share two cores here: probe less often than a real deployment would.
      vars.emplace("R2CCL_PROBE_INTERVAL", "250ms");
      vars.emplace("R2CCL_PROBE_TIMEOUT", "5s");
      vars.emplace("R2CCL_STALL_TIMEOUT", "10s");
      auto cfg = parse_config(env_of(vars));
      EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
      if (!cfg) return Result<std::unique_ptr<coll::Communicator>>(cfg.status());
      BootstrapOptions b{r, n, HostPort{"127.0.0.1", port}, {}, std::chrono::milliseconds(20000),
                         ""};
      return coll::Communicator::create(*cfg, b);
    }));
  }
  std::vector<std::unique_ptr<coll::Communicator>> out;
  for (auto& f : fs) {
    auto c = f.get();
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
    if (c) out.push_back(std::move(*c));
  }
  return out;
}

void on_all(std::vector<std::unique_ptr<coll::Communicator>>& comms,
            const std::function<void(int, coll::Communicator&)>& fn) {
  std::vector<std::thread> ts;
  for (std::size_t r = 0; r < comms.size(); ++r)
    ts.emplace_back([&, r] { fn(static_cast<int>(r), *comms[r]); });
  for (auto& t : ts)
    t.join();
}

}  // namespace r2ccl::test

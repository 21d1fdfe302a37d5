// Helpers of the collectives tests: communicators of n ranks as threads of this process, each
// rank with two loopback rails of its own (127.0.(20+r).1 and .2).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "r2ccl/coll/communicator.h"

namespace r2ccl::test {

std::vector<std::unique_ptr<coll::Communicator>> make_comms(
    int n, std::map<std::string, std::string> extra = {});

// Runs fn(rank, communicator) on one thread per rank and joins them.
void on_all(std::vector<std::unique_ptr<coll::Communicator>>& comms,
            const std::function<void(int, coll::Communicator&)>& fn);

}  // namespace r2ccl::test

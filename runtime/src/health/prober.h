// Liveness and RTT probes on every rail, busy or idle (DESIGN.md, Rail health).
//
// One UDP socket per local NIC, bound to its address (and to the device where permitted), so a
// probe takes exactly the path of the rail's data but not its TCP queues: a probe's round trip
// is the network's, and a black-holed NIC stops answering even while its link stays up. Every
// prober also answers the probes it receives. Packets carry a tag of the token that
// authenticated the rail's channel (the job's, in a world); others are ignored.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/status.h"
#include "r2ccl/runtime/topology.h"

namespace r2ccl {

class ProgressEngine;

class Prober {
 public:
  // `peer` is the caller's number for the peer (echoed back in the reply, never interpreted).
  using ReplyHandler =
      std::function<void(int peer, std::uint32_t rail, std::chrono::nanoseconds rtt)>;
  // Opens one probe socket per NIC; probes start once targets are added. A probe names the
  // endpoint it is meant for by incarnation: only that endpoint answers it.
  static Result<std::unique_ptr<Prober>> open(ProgressEngine& engine,
                                              const std::vector<RailNic>& nics, const Token& token,
                                              std::uint64_t my_incarnation,
                                              std::chrono::milliseconds interval,
                                              ReplyHandler on_reply);
  virtual ~Prober() = default;
  // The UDP port of NIC `device`'s probe socket (published to the peers).
  virtual std::uint16_t port(std::size_t device) const = 0;
  // The tag that probes authenticated by `token` carry (an HMAC of it: probes go in the clear).
  static std::uint64_t tag_of(const Token& token);
  // Probe the NIC (address:port) of the endpoint `incarnation`, which the caller calls `peer`,
  // from local device `rail` every interval, instead of where that peer's rail was probed until
  // now. `tag`: the tag of the token that authenticates the channel to that peer (the token of
  // the endpoint it was dialled at); 0: this prober's own. `on_host`: the rail's traffic to that
  // peer stays on this host (Provider::host_local): its probes, and the replies to its probes, go
  // around the NIC (whose link state says nothing about the rail). Loop thread.
  virtual void add_target(int peer, std::uint64_t incarnation, std::uint32_t rail,
                          const std::string& address, std::uint16_t port, std::uint64_t tag = 0,
                          bool on_host = false) = 0;
  // Also answers probes that carry `tag` (that of a peer's token this endpoint dialled with).
  // At most kMaxTags are kept (the oldest go). Loop thread.
  static constexpr std::size_t kMaxTags = 4096;
  virtual void accept_tag(std::uint64_t tag) = 0;
  // Stops probing `peer`. Loop thread.
  virtual void remove_targets(int peer) = 0;
  virtual void stop() = 0;
};

}  // namespace r2ccl

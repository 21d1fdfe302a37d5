// The NIXL backend's bytes from a peer: its messages (notifications, read requests, read ends)
// as the engine's message handler takes them, and the registration public data and connection
// info that loadRemoteMD and loadRemoteConnInfo read. An engine ("target", the plugin's
// r2ccl::nixl::Engine, as NIXL makes it) and a plain endpoint ("peer") over loopback, made once;
// each input is either sent by the peer to the engine, followed by a notification that marks its
// end, or handed to loadRemoteMD / loadRemoteConnInfo. Whatever the peer sends, the target's
// registered memory never changes, nothing is read or written outside it (the sanitizers watch),
// and the engine keeps taking messages.
#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"  // integrations/nixl/src
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/wire.h"

// NIXL's descriptor constructors live in libnixl, which this harness does not load; these set
// the same fields.
nixlBasicDesc::nixlBasicDesc(const uintptr_t& a, const size_t& l, const uint64_t& d)
    : addr(a), len(l), devId(d) {}
nixlBlobDesc::nixlBlobDesc(const uintptr_t& a, const size_t& l, const uint64_t& d,
                           const nixl_blob_t& meta)
    : nixlBasicDesc(a, l, d), metaInfo(meta) {}

using namespace r2ccl;
using namespace std::chrono_literals;

namespace {

struct World {
  nixl_b_params_t params{{"nics", "127.0.81.1,127.0.81.2"}, {"log", "error"}};
  nixlBackendInitParams init;
  std::unique_ptr<nixl::Engine> target;
  nixlBackendMD* md = nullptr;
  std::vector<std::byte> memory, copy;
  std::string public_data;
  std::unique_ptr<Endpoint> peer;
  int to_target = -1;
  std::uint64_t sync = 0;
};
World* g = nullptr;

std::unique_ptr<Endpoint> make_peer() {
  std::map<std::string, std::string> vars{{"R2CCL_NICS", "127.0.82.1,127.0.82.2"}};
  auto cfg = parse_config([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  if (!cfg) std::abort();
  EndpointOptions o;
  o.name = "peer";
  auto ep = Endpoint::create(*cfg, o);
  if (!ep) std::abort();
  return std::move(*ep);
}

// Waits (bounded) until the target has taken the notification "sync-N" the peer sent after the
// input: everything before it on the channel was handled.
void wait_handled() {
  const std::string tag = fmt::format("sync-{}", ++g->sync);
  ByteWriter w;
  w.u8(1).str("peer").str(tag);
  if (!g->peer->send_message(g->to_target, 0, w.take())) std::abort();
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < until) {
    notif_list_t got;
    if (g->target->getNotifs(got) != NIXL_SUCCESS) std::abort();
    for (const auto& [agent, msg] : got)
      if (msg == tag) return;
    std::this_thread::sleep_for(1ms);
  }
  fmt::print(stderr, "fuzz_nixl: the engine stopped taking messages\n");
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  set_log_level(LogLevel::kError);
  g = new World();  // lives for the process (the fuzzer never returns from main)
  g->init.localAgent = "target";
  g->init.type = "R2CCL";
  g->init.customParams = &g->params;
  g->target = std::make_unique<nixl::Engine>(&g->init);
  if (g->target->getInitErr()) std::abort();
  g->memory.resize(64 * 1024);
  for (std::size_t i = 0; i < g->memory.size(); ++i)
    g->memory[i] = static_cast<std::byte>(i * 13 + 5);
  g->copy = g->memory;
  const nixlBlobDesc desc(reinterpret_cast<std::uintptr_t>(g->memory.data()), g->memory.size(), 0,
                          "");
  if (g->target->registerMem(desc, DRAM_SEG, g->md) != NIXL_SUCCESS) std::abort();
  if (g->target->getPublicData(g->md, g->public_data) != NIXL_SUCCESS) std::abort();
  std::string conn;
  if (g->target->getConnInfo(conn) != NIXL_SUCCESS) std::abort();
  g->peer = make_peer();
  auto id = g->peer->connect(std::as_bytes(std::span(conn.data(), conn.size())));
  if (!id) std::abort();
  g->to_target = *id;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string in(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: {  // a message from the peer
      if (in.size() > 60 * 1024) return 0;
      Bytes msg(reinterpret_cast<const std::byte*>(in.data()),
                reinterpret_cast<const std::byte*>(in.data()) + in.size());
      if (!g->peer->send_message(g->to_target, 0, std::move(msg))) return 0;
      wait_handled();
      break;
    }
    case 1: {  // a registration's public data: the real one with the input laid over it
      std::string pub = g->public_data;
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (i < pub.size())
          pub[i] = static_cast<char>(pub[i] ^ in[i]);
        else
          pub.push_back(in[i]);
      }
      nixlBackendMD* out = nullptr;
      const nixlBlobDesc desc(reinterpret_cast<std::uintptr_t>(g->memory.data()), g->memory.size(),
                              0, pub);
      if (g->target->loadRemoteMD(desc, DRAM_SEG, "peer", out) == NIXL_SUCCESS)
        (void)g->target->unloadMD(out);
      break;
    }
    default:  // connection info
      (void)g->target->loadRemoteConnInfo("someone", in);
      (void)g->target->disconnect("someone");
      break;
  }
  if (g->memory != g->copy) {
    fmt::print(stderr, "fuzz_nixl: the target's registered memory changed\n");
    std::abort();
  }
  return 0;
}

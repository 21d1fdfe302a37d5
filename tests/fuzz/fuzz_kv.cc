// The KV engine's bytes from a peer: its metadata (the pools and remote keys it describes, as
// KvEngine::connect reads them) and its notify and pull messages. Two engines on endpoints over
// loopback, made once; each input either replaces the decode side's metadata as the prefill side
// knows it (the real pool descriptions with the input laid over them by XOR, re-signed so that
// the checksum passes: an empty input is the real metadata, and every mutation is a neighbour of
// it, real remote keys included) and then pushes blocks into it, or arrives at the prefill side
// as a message from its peer. Afterwards the real metadata is loaded again. Whatever the peer
// describes or asks, prefill's memory never changes and nothing is read or written outside the
// registered regions (the sanitizers watch the second).
#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "r2ccl/kv/engine.h"
#include "r2ccl/runtime/endpoint.h"
#include "r2ccl/runtime/log.h"
#include "r2ccl/runtime/provider/progress.h"

using namespace r2ccl;
using namespace r2ccl::kv;
using namespace std::chrono_literals;

namespace {
constexpr std::uint32_t kLayers = 2, kBlocks = 8, kBlockBytes = 256, kParts = 2;

struct Side {
  std::unique_ptr<Endpoint> endpoint;
  std::unique_ptr<KvEngine> engine;
  std::vector<std::byte> memory;
};

struct World {
  Side prefill, decode;
  int peer = -1;  // decode, as prefill knows it
  Bytes decode_metadata;
  Bytes decode_pools;  // the part of its body after the incarnation and the endpoint blob
  std::vector<std::byte> prefill_copy;
  std::uint64_t next_request = 1;
};
World* g = nullptr;

std::unique_ptr<Endpoint> make_endpoint(int host, const char* name) {
  std::map<std::string, std::string> vars{
      {"R2CCL_NICS", fmt::format("127.0.{0}.1,127.0.{0}.2", 70 + host)},
      {"R2CCL_LOG_LEVEL", "error"}};
  auto cfg = parse_config([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  if (!cfg) std::abort();
  EndpointOptions o;
  o.name = name;
  auto ep = Endpoint::create(*cfg, o);
  if (!ep) {
    fmt::print(stderr, "fuzz_kv: {}\n", ep.status().to_string());
    std::abort();
  }
  return std::move(*ep);
}

Bytes sign(std::span<const std::byte> body) {
  ByteWriter w;
  w.u32(0x564b3252).u32(2).blob(body).u64(XXH3_64bits(body.data(), body.size()));
  return w.take();
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  set_log_level(LogLevel::kError);
  g = new World();  // lives for the process (the fuzzer never returns from main)
  g->prefill.endpoint = make_endpoint(0, "prefill");
  g->decode.endpoint = make_endpoint(1, "decode");
  for (Side* s : {&g->prefill, &g->decode}) {
    auto e = KvEngine::create(*s->endpoint, EngineOptions{});
    if (!e) std::abort();
    s->engine = std::move(*e);
    s->memory.assign(std::size_t{kLayers} * kParts * kBlocks * kBlockBytes, std::byte{0});
    auto pool =
        s->engine->register_pool({std::span<std::byte>(s->memory)},
                                 KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts));
    if (!pool) std::abort();
  }
  for (std::size_t i = 0; i < g->prefill.memory.size(); ++i)
    g->prefill.memory[i] = static_cast<std::byte>(i * 7 + 1);
  g->prefill_copy = g->prefill.memory;
  g->decode_metadata = g->decode.engine->metadata();
  {
    ByteReader r(g->decode_metadata);
    (void)r.u32();
    (void)r.u32();
    const Bytes body = r.blob(64u << 20);
    ByteReader b(body);
    (void)b.u64();
    (void)b.blob(EndpointInfo::kMaxBlob);
    if (!b.ok()) std::abort();
    g->decode_pools.assign(body.end() - static_cast<std::ptrdiff_t>(b.remaining()), body.end());
  }
  auto peer = g->prefill.engine->load_remote(g->decode_metadata);
  if (!peer) std::abort();
  g->peer = *peer;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  KvEngine& prefill = *g->prefill.engine;
  if (data[0] & 1) {
    // The decode side's metadata as the fuzzer wrote its pools: the header is the real one
    // (incarnation and endpoint blob), the rest is the input.
    Bytes pools = g->decode_pools;
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (i < pools.size())
        pools[i] ^= in[i];
      else
        pools.push_back(in[i]);
    }
    if (data[0] & 2) pools.resize(std::min(pools.size(), in.size()));
    ByteWriter body;
    body.u64(g->decode.endpoint->incarnation()).blob(g->decode.endpoint->blob());
    body.raw(pools.data(), pools.size());
    if (prefill.accept_metadata(g->peer, sign(body.bytes())).is_ok()) {
      // Accepted: a push into whatever it described must be refused or land inside its pools.
      const std::uint32_t remote_pool = data[0] >> 4;
      const std::uint64_t id = g->next_request++;
      BlockSpan span{0, kLayers, {0, 1}, {static_cast<std::uint32_t>(data[0] >> 1 & 7), 3}};
      if (prefill.submit(id, g->peer, 0, remote_pool, {span}).is_ok()) (void)prefill.wait(id, 5s);
    }
    // The real metadata again.
    if (!prefill.accept_metadata(g->peer, g->decode_metadata).is_ok()) std::abort();
  } else {
    // A notify or pull message from the decode side, as it arrives at prefill.
    Bytes message;
    message.push_back(std::byte{1});  // the KV service
    message.insert(message.end(), in.begin(), in.end());
    Endpoint& ep = *g->prefill.endpoint;
    ep.engine().call([&] { ep.deliver_message(g->peer, message); });
    (void)prefill.poll_notifications();
  }
  // Nothing the peer says changes what prefill holds.
  if (g->prefill.memory != g->prefill_copy) __builtin_trap();
  return 0;
}

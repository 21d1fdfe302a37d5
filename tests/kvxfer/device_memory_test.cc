// KV pools in GPU memory, for real: CUDA device and managed memory on one side or both, moved
// by two engines on their own endpoints over four loopback rails (tcp, staged through the host),
// every block checked by reading the destination back from the GPU, and by R2CCL_KV_VERIFY's
// checksums. Needs a CUDA device (label gpu): without one it skips, saying why.
#include <gtest/gtest.h>

#include <map>

#include "../../bench/src/cuda_buffer.h"
#include "../unit/test_util.h"
#include "r2ccl/kv/engine.h"

namespace r2ccl::kv {
namespace {

using namespace std::chrono_literals;
using bench::CudaBuffer;

constexpr std::uint32_t kLayers = 3, kBlocks = 40, kParts = 2;
constexpr std::uint64_t kBlockBytes = 32 * 1024;  // Llama-3.1-8B's: 16 tokens x 8 heads x 128 x 2
constexpr std::size_t kPoolBytes = kLayers * kParts * kBlocks * kBlockBytes;

std::byte value_at(std::size_t pool_offset, int salt) {
  return static_cast<std::byte>((pool_offset * 2654435761u + static_cast<unsigned>(salt)) >> 13);
}

std::unique_ptr<Endpoint> make_endpoint(int host, const std::string& name) {
  std::map<std::string, std::string> vars;
  vars["R2CCL_NICS"] = fmt::format("127.0.{0}.1,127.0.{0}.2,127.0.{0}.3,127.0.{0}.4", 90 + host);
  vars["R2CCL_CHUNK_SIZE"] = "256K";
  auto cfg = parse_config(test::env_of(vars));
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  EndpointOptions o;
  o.name = name;
  auto e = Endpoint::create(*cfg, o);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(*e);
}

// Every (src, dst) pairing of host, device and managed pools: the destination blocks hold the
// source's after DONE, checked byte by byte from the GPU, and the receiver verified them.
TEST(KvEngineGpu, DeviceAndManagedPoolsMoveEveryByteOverTheRails) {
  auto probe = CudaBuffer::make(0, 4096);
  if (!probe) GTEST_SKIP() << probe.status().message();
  probe->reset();
  auto prefill = make_endpoint(0, "prefill");
  auto decode = make_endpoint(1, "decode");
  EngineOptions opts;
  opts.verify = true;
  auto pe = KvEngine::create(*prefill, opts);
  auto de = KvEngine::create(*decode, opts);
  ASSERT_TRUE(pe.is_ok() && de.is_ok());
  const auto layout = KvLayout::layer_major(kLayers, kBlocks, kBlockBytes, kParts);

  // One pool of each kind per side; a source pool holds value_at(offset, 1).
  std::vector<std::byte> host_src(kPoolBytes), host_dst(kPoolBytes);
  for (std::size_t i = 0; i < kPoolBytes; ++i)
    host_src[i] = value_at(i, 1);
  std::map<std::string, std::unique_ptr<CudaBuffer>> gpu;
  for (const auto* name : {"device_src", "device_dst", "managed_src", "managed_dst"}) {
    const auto kind = std::string(name).starts_with("managed") ? CudaBuffer::Kind::kManaged
                                                               : CudaBuffer::Kind::kDevice;
    auto b = CudaBuffer::make(0, kPoolBytes, kind);
    ASSERT_TRUE(b.is_ok()) << name << ": " << b.status().to_string();
    ASSERT_TRUE((*b)->upload(std::string(name).ends_with("src")
                                 ? std::span<const std::byte>(host_src)
                                 : std::span<const std::byte>(host_dst))
                    .is_ok());
    gpu[name] = std::move(*b);
  }
  auto reg = [&](KvEngine& e, std::span<std::byte> m) {
    auto p = e.register_pool({m}, layout);
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    return p.is_ok() ? *p : 0u;
  };
  const std::map<std::string, std::uint32_t> src = {
      {"host", reg(**pe, host_src)},
      {"device", reg(**pe, gpu["device_src"]->span())},
      {"managed", reg(**pe, gpu["managed_src"]->span())}};
  const std::map<std::string, std::uint32_t> dst = {
      {"host", reg(**de, host_dst)},
      {"device", reg(**de, gpu["device_dst"]->span())},
      {"managed", reg(**de, gpu["managed_dst"]->span())}};
  auto peer = (*pe)->load_remote((*de)->metadata());
  ASSERT_TRUE(peer.is_ok()) << peer.status().to_string();
  const int from = decode->peers().at(0).id;

  std::uint64_t id = 0;
  std::uint32_t next_dst = 0;
  for (const auto& [sname, spool] : src)
    for (const auto& [dname, dpool] : dst) {
      SCOPED_TRACE(sname + " -> " + dname);
      // Four blocks, two of them consecutive (one coalesced write), to fresh destination blocks.
      const std::vector<std::uint32_t> sblocks = {next_dst, next_dst + 1, 39 - next_dst, 7};
      const std::vector<std::uint32_t> dblocks = {next_dst, next_dst + 1, next_dst + 2,
                                                  next_dst + 3};
      next_dst += 4;
      ++id;
      ASSERT_TRUE((*pe)
                      ->submit(id, *peer, spool, dpool, {BlockSpan{0, kLayers, sblocks, dblocks}})
                      .is_ok());
      auto st = (*pe)->wait(id, 30s);
      ASSERT_TRUE(st.is_ok()) << st.status().to_string();
      ASSERT_EQ(st->state, RequestState::kDone) << st->reason;
      auto note = (*de)->wait_notification(from, id, 30s);
      ASSERT_TRUE(note.is_ok()) << note.status().to_string();
      ASSERT_EQ(note->state, RequestState::kDone) << note->reason;
      EXPECT_TRUE(note->verified);
      std::vector<std::byte> now;
      if (dname == "host") {
        now = host_dst;
      } else {
        auto d = gpu[dname + "_dst"]->download(0, kPoolBytes);
        ASSERT_TRUE(d.is_ok()) << d.status().to_string();
        now = std::move(*d);
      }
      std::size_t wrong = 0;
      for (std::uint32_t layer = 0; layer < kLayers; ++layer)
        for (std::uint32_t part = 0; part < kParts; ++part)
          for (std::size_t b = 0; b < sblocks.size(); ++b) {
            const auto so = layout.offset(layer, part, sblocks[b]);
            const auto dof = layout.offset(layer, part, dblocks[b]);
            for (std::uint64_t i = 0; i < kBlockBytes; ++i)
              wrong += now[dof + i] != value_at(so + i, 1);
          }
      EXPECT_EQ(wrong, 0u) << "bytes wrong";
      // A block nobody wrote is still zero.
      EXPECT_EQ(now[layout.offset(0, 0, 39)], std::byte{0});
    }
  (*pe).reset();
  (*de).reset();
}

}  // namespace
}  // namespace r2ccl::kv

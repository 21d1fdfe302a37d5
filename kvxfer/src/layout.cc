#include "r2ccl/kv/layout.h"

#include <fmt/format.h>

namespace r2ccl::kv {

KvLayout KvLayout::layer_major(std::uint32_t layers, std::uint32_t blocks,
                               std::uint64_t block_bytes, std::uint32_t parts) {
  KvLayout l{layers, blocks, block_bytes, parts, {}};
  for (std::uint32_t layer = 0; layer < layers; ++layer)
    for (std::uint32_t part = 0; part < parts; ++part)
      l.places.push_back({0,
                          (static_cast<std::uint64_t>(layer) * parts + part) * blocks * block_bytes,
                          block_bytes});
  return l;
}

KvLayout KvLayout::per_layer_buffers(std::uint32_t layers, std::uint32_t blocks,
                                     std::uint64_t block_bytes, std::uint32_t parts) {
  KvLayout l{layers, blocks, block_bytes, parts, {}};
  for (std::uint32_t i = 0; i < layers * parts; ++i)
    l.places.push_back({i, 0, block_bytes});
  return l;
}

Status KvLayout::validate(const std::vector<std::uint64_t>& lengths) const {
  if (layers == 0 || blocks == 0 || block_bytes == 0 || parts == 0 || parts > 2)
    return {ErrorCode::kInvalidArgument,
            fmt::format(
                "bad KV layout: {} layers, {} blocks, {} bytes per block, {} parts (need all > 0, "
                "1 or 2 parts)",
                layers, blocks, block_bytes, parts)};
  if (places.size() != static_cast<std::size_t>(layers) * parts)
    return {ErrorCode::kInvalidArgument,
            fmt::format("bad KV layout: {} places for {} layers x {} parts", places.size(), layers,
                        parts)};
  for (std::uint32_t layer = 0; layer < layers; ++layer)
    for (std::uint32_t part = 0; part < parts; ++part) {
      const auto& p = place(layer, part);
      if (p.buffer >= lengths.size())
        return {ErrorCode::kInvalidArgument,
                fmt::format(
                    "KV layout: layer {} part {} is in buffer {}, but the pool has {} buffer(s)",
                    layer, part, p.buffer, lengths.size())};
      if (p.stride < block_bytes)
        return {ErrorCode::kInvalidArgument,
                fmt::format("KV layout: layer {} part {} has stride {} < block size {}", layer,
                            part, p.stride, block_bytes)};
      // offset + (blocks - 1) * stride + block_bytes, refused where it overflows 64 bits.
      std::uint64_t span = 0, end = 0;
      if (__builtin_mul_overflow(static_cast<std::uint64_t>(blocks - 1), p.stride, &span) ||
          __builtin_add_overflow(span, block_bytes, &span) ||
          __builtin_add_overflow(p.offset, span, &end))
        return {ErrorCode::kInvalidArgument,
                fmt::format("KV layout: layer {} part {} (offset {}, stride {}, {} blocks of {} "
                            "bytes) overflows 64 bits",
                            layer, part, p.offset, p.stride, blocks, block_bytes)};
      if (end > lengths[p.buffer])
        return {
            ErrorCode::kInvalidArgument,
            fmt::format("KV layout: layer {} part {} ends at byte {}, past buffer {} of {} bytes",
                        layer, part, end, p.buffer, lengths[p.buffer])};
    }
  return Status::ok();
}

std::string KvLayout::incompatibility(const KvLayout& o) const {
  if (layers != o.layers) return fmt::format("layers differ ({} here, {} there)", layers, o.layers);
  if (parts != o.parts) return fmt::format("K/V parts differ ({} here, {} there)", parts, o.parts);
  if (block_bytes != o.block_bytes)
    return fmt::format("block sizes differ ({} bytes here, {} there)", block_bytes, o.block_bytes);
  return {};
}

void KvLayout::encode(ByteWriter& w) const {
  w.u32(layers)
      .u32(blocks)
      .u64(block_bytes)
      .u32(parts)
      .u32(static_cast<std::uint32_t>(places.size()));
  for (const auto& p : places)
    w.u32(p.buffer).u64(p.offset).u64(p.stride);
}

Result<KvLayout> KvLayout::decode(ByteReader& r) {
  KvLayout l;
  l.layers = r.u32();
  l.blocks = r.u32();
  l.block_bytes = r.u64();
  l.parts = r.u32();
  const auto n = r.u32();
  if (!r.ok() || n > (1u << 20) || n > r.remaining() / 20)
    return Status(ErrorCode::kProtocol, "KV metadata: malformed layout");
  for (std::uint32_t i = 0; i < n; ++i) {
    LayerPart p;
    p.buffer = r.u32();
    p.offset = r.u64();
    p.stride = r.u64();
    l.places.push_back(p);
  }
  if (!r.ok()) return Status(ErrorCode::kProtocol, "KV metadata: truncated layout");
  return l;
}

}  // namespace r2ccl::kv

// KV-cache pool layouts: where each (layer, part, block) of a pool lives.
//
// A pool is one or more registered buffers. A layout says, for every layer and part (K and V as
// two parts, or one joined part — MLA's latent cache is one part), which buffer holds its blocks,
// where block 0 starts and the stride between blocks. That covers vLLM's paged caches (one tensor
// per layer, K and V split on the outer dimension; NHD or HND only changes the inside of a
// block), SGLang's per-layer K and V buffers, and MLA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "r2ccl/runtime/status.h"
#include "r2ccl/runtime/wire.h"

namespace r2ccl::kv {

struct LayerPart {
  std::uint32_t buffer = 0;  // index of the pool's buffer
  std::uint64_t offset = 0;  // of block 0 in that buffer
  std::uint64_t stride = 0;  // between consecutive blocks
};

struct KvLayout {
  std::uint32_t layers = 0;
  std::uint32_t blocks = 0;       // blocks per layer
  std::uint64_t block_bytes = 0;  // one part of one block of one layer
  std::uint32_t parts = 1;        // 2: K and V separate; 1: joined, or MLA
  std::vector<LayerPart> places;  // layers x parts, index layer * parts + part

  // One buffer; layer l is [parts][blocks][block_bytes] at l * parts * blocks * block_bytes.
  static KvLayout layer_major(std::uint32_t layers, std::uint32_t blocks, std::uint64_t block_bytes,
                              std::uint32_t parts);
  // One buffer per (layer, part), blocks contiguous in each (buffer index layer * parts + part).
  static KvLayout per_layer_buffers(std::uint32_t layers, std::uint32_t blocks,
                                    std::uint64_t block_bytes, std::uint32_t parts);

  const LayerPart& place(std::uint32_t layer, std::uint32_t part) const {
    return places[layer * parts + part];
  }
  std::uint64_t offset(std::uint32_t layer, std::uint32_t part, std::uint32_t block) const {
    const auto& p = place(layer, part);
    return p.offset + static_cast<std::uint64_t>(block) * p.stride;
  }
  std::uint64_t bytes_per_block() const { return block_bytes * parts * layers; }
  // Checks the shape and that every block lies inside its buffer; names what is wrong.
  Status validate(const std::vector<std::uint64_t>& buffer_lengths) const;
  // Empty when a transfer between the two layouts is possible, else what differs.
  std::string incompatibility(const KvLayout& other) const;

  void encode(ByteWriter& w) const;
  static Result<KvLayout> decode(ByteReader& r);
};

}  // namespace r2ccl::kv

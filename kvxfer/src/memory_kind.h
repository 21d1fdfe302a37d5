// What kind of memory a pool's buffer is. KV pools are host memory only for now (the tcp rail
// copies into and out of them on the host, and R2CCL_KV_VERIFY hashes them there), so device and
// managed memory are refused at registration instead of crashing at the first transfer.
#pragma once

namespace r2ccl::kv {

enum class PointerKind { kHost, kDevice, kManaged };

struct PointerInfo {
  PointerKind kind = PointerKind::kHost;
  int device = -1;  // kDevice, kManaged: the CUDA device ordinal, where the driver says
};

// Asks the CUDA driver only where this process has already loaded it (a process that never used
// CUDA holds no device memory): nothing here loads the driver, initialises it or creates a
// context, and the build needs no CUDA. Memory the driver does not know is host memory.
PointerInfo pointer_info(const void* p);

}  // namespace r2ccl::kv

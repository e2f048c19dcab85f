// XPU (Kunlun XRE) variant: block copies on device memory and peer addresses.
// Compiled only when setup.py finds KVFLOW_XPU_SDK (then -DKVFLOW_WITH_XPU, -lxpurt).
// API from the public XPU runtime header xpu/runtime.h (XRE): xpu_memcpy_async(dst, src, size,
// XPUMemcpyKind, XPUStream), xpu_wait(stream), xpu_mmap(&cpu_ptr, dev_ptr, size),
// xpu_strerror(code); every call returns 0 (XPU_SUCCESS) or an error code.
#ifdef KVFLOW_WITH_XPU
#include "kvflow_native/xpu_runtime.h"

#include <stdexcept>
#include <string>

#include "xpu/runtime.h"

namespace kvflow {
namespace xpu {
namespace {

void check(int rc, const char* call) {
  if (rc != 0) throw std::runtime_error(std::string(call) + " failed: " + xpu_strerror(rc) + " (code " + std::to_string(rc) + ")");
}

inline bool valid(int64_t id, int64_t limit) { return id >= 0 && id < limit; }

}  // namespace

int64_t copy_runs_device(const CopyRuns& j, uint64_t stream) {
  auto s = reinterpret_cast<XPUStream>(stream);
  int64_t copied = 0;
  for (int64_t t = 0; t < j.n_tensors; ++t) {
    for (int64_t i = 0; i < j.n; ++i) {
      const int64_t src = j.src_ids ? j.src_ids[i] : i;
      const int64_t dst = j.dst_ids ? j.dst_ids[i] : i;
      if (!valid(src, j.src_n) || !valid(dst, j.dst_n)) continue;
      check(xpu_memcpy_async(reinterpret_cast<void*>(j.dst_ptrs[t] + dst * j.dst_stride),
                             reinterpret_cast<const void*>(j.src_ptrs[t] + src * j.src_stride),
                             static_cast<uint64_t>(j.run_bytes), XPU_DEVICE_TO_DEVICE, s),
            "xpu_memcpy_async");
      ++copied;
    }
  }
  check(xpu_wait(s), "xpu_wait");
  return copied;
}

uint64_t peer_mem_addr(uint64_t ptr, uint64_t nbytes) {
  void* cpu = nullptr;
  check(xpu_mmap(&cpu, reinterpret_cast<void*>(ptr), static_cast<size_t>(nbytes)), "xpu_mmap");
  return reinterpret_cast<uint64_t>(cpu);
}

}  // namespace xpu
}  // namespace kvflow
#endif  // KVFLOW_WITH_XPU

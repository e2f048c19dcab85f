// The XPU (Kunlun XRE) variant of the ops: compiled only with -DKVFLOW_WITH_XPU and the SDK's
// include/lib directories (setup.py, KVFLOW_XPU_SDK). Written from the public XPU runtime API
// (xpu/runtime.h: xpu_memcpy_async, xpu_wait, xpu_mmap, xpu_strerror); not compiled on
// machines without the SDK.
#pragma once

#ifdef KVFLOW_WITH_XPU
#include <cstdint>

#include "kvflow_native/copy_runs.h"

namespace kvflow {
namespace xpu {

// Device-to-device copy of every valid run: one xpu_memcpy_async per run on `stream` (0: the
// default stream), then xpu_wait(stream). Ids are host arrays. Returns runs copied.
int64_t copy_runs_device(const CopyRuns& job, uint64_t stream);

// Host-visible address of device memory [ptr, ptr + nbytes) for registering with a transport
// (xpu_mmap). Throws std::runtime_error with xpu_strerror's text on failure.
uint64_t peer_mem_addr(uint64_t ptr, uint64_t nbytes);

}  // namespace xpu
}  // namespace kvflow
#endif  // KVFLOW_WITH_XPU

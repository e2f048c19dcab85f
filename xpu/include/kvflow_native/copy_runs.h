// Block movement as "copy runs" over int64 pointer tables (host memory).
//
// Every block of every per-layer tensor of a paged KV cache is one contiguous run of
// `run_bytes` bytes (KVCacheSpec.block_bytes), in every layout. Consecutive blocks of one tensor
// lie `stride` bytes apart (KVCacheSpec.block_stride_bytes: run_bytes in layer-major layouts,
// num_tensors * run_bytes in block-major BM_NHD; a staging buffer: run_bytes). One work item
// (t, i) copies the run at  src_ptrs[t] + src_id(i) * src_stride  to
// dst_ptrs[t] + dst_id(i) * dst_stride, where a null id array means the identity (slot i), which
// describes a staging buffer. Ids outside [0, src_n) / [0, dst_n) -- padding -1 included -- are
// skipped and leave the destination untouched. Same semantics as kernels/numba/cpu.py.
#pragma once

#include <cstdint>

namespace kvflow {

struct CopyRuns {
  const int64_t* src_ptrs;  // [n_tensors] base addresses
  const int64_t* dst_ptrs;  // [n_tensors] base addresses
  int64_t n_tensors;
  const int64_t* src_ids;  // [n] or nullptr (identity)
  const int64_t* dst_ids;  // [n] or nullptr (identity)
  int64_t n;
  int64_t src_n;  // runs in each source tensor (ids >= src_n are skipped)
  int64_t dst_n;  // runs in each destination tensor
  int64_t run_bytes;
  int64_t src_stride;  // bytes from run k to run k + 1 of one source tensor (>= run_bytes)
  int64_t dst_stride;  // same for the destination
};

// Copy every valid run with up to `num_threads` threads (0: hardware concurrency; small copies
// run on the calling thread). Returns the number of runs copied.
int64_t copy_runs_host(const CopyRuns& job, int num_threads);

// Threads the host pool uses when num_threads == 0.
int default_num_threads();

}  // namespace kvflow

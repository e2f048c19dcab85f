// Host backend of the block-movement ops: a multithreaded memcpy of contiguous runs.
//
// Work item w = t * n + i (tensor-major, like kernels/numba/cpu.py) copies one run. The items
// are split into chunks taken from an atomic counter by the threads of a small persistent pool
// (created on first use; re-created after fork()). Within a chunk, runs that continue the
// previous one in memory on both sides (e.g. a gather of blocks 7, 8, 9 into slots 0, 1, 2 of
// a layer-major cache, stride == run_bytes) are merged into one memcpy; with a larger stride
// (block-major) consecutive ids are not adjacent, and the address check keeps them apart.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kvflow_native/copy_runs.h"

namespace kvflow {
namespace {

constexpr int64_t kMinBytesPerThread = 256 << 10;  // below this a thread costs more than it moves
constexpr int kMaxThreads = 16;

class Pool {
 public:
  explicit Pool(int n) : pid_(getpid()) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }  // workers + caller
  pid_t pid() const { return pid_; }

  // Run fn(k) on the caller (k = 0) and on `extra` workers (k = 1..extra); returns when all end.
  void run(int extra, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> call(call_mu_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      want_ = std::min<int>(extra, static_cast<int>(workers_.size()));
      remaining_ = want_;
      ++generation_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [this] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int idx) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (idx >= want_) continue;
      const std::function<void(int)>* job = job_;
      lk.unlock();
      (*job)(idx + 1);
      lk.lock();
      if (--remaining_ == 0) done_cv_.notify_one();
    }
  }

  pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int want_ = 0, remaining_ = 0;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // intentionally leaked: idle workers must not be joined at exit

Pool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool == nullptr || g_pool->pid() != getpid()) {
    // After fork() the child has no worker threads: leak the parent's pool object, start anew.
    g_pool = new Pool(default_num_threads() - 1);
  }
  return *g_pool;
}

inline bool valid(int64_t id, int64_t limit) { return id >= 0 && id < limit; }

// Copy items [begin, end); returns runs copied.
int64_t copy_items(const CopyRuns& j, int64_t begin, int64_t end) {
  const int64_t rb = j.run_bytes;
  uint8_t* pend_dst = nullptr;
  const uint8_t* pend_src = nullptr;
  int64_t pend_len = 0, copied = 0;
  for (int64_t w = begin; w < end; ++w) {
    const int64_t t = w / j.n, i = w - t * j.n;
    const int64_t s = j.src_ids ? j.src_ids[i] : i;
    const int64_t d = j.dst_ids ? j.dst_ids[i] : i;
    if (!valid(s, j.src_n) || !valid(d, j.dst_n)) continue;
    auto* src = reinterpret_cast<const uint8_t*>(j.src_ptrs[t] + s * j.src_stride);
    auto* dst = reinterpret_cast<uint8_t*>(j.dst_ptrs[t] + d * j.dst_stride);
    if (pend_len && src == pend_src + pend_len && dst == pend_dst + pend_len) {
      pend_len += rb;  // continues the pending run on both sides
    } else {
      if (pend_len) std::memcpy(pend_dst, pend_src, static_cast<size_t>(pend_len));
      pend_src = src, pend_dst = dst, pend_len = rb;
    }
    ++copied;
  }
  if (pend_len) std::memcpy(pend_dst, pend_src, static_cast<size_t>(pend_len));
  return copied;
}

}  // namespace

int default_num_threads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return std::max(1, std::min<int>(hw ? static_cast<int>(hw) : 1, kMaxThreads));
}

int64_t copy_runs_host(const CopyRuns& job, int num_threads) {
  const int64_t items = job.n_tensors * job.n;
  if (items <= 0 || job.run_bytes <= 0) return 0;
  const int64_t total_bytes = items * job.run_bytes;
  int threads = num_threads > 0 ? std::min(num_threads, kMaxThreads) : default_num_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, total_bytes / kMinBytesPerThread)));
  threads = static_cast<int>(std::min<int64_t>(threads, items));
  if (threads <= 1) return copy_items(job, 0, items);

  Pool& p = pool();
  threads = std::min(threads, p.size());
  // ~4 chunks per thread (balance), each at least one run.
  const int64_t chunk = std::max<int64_t>(1, items / (static_cast<int64_t>(threads) * 4));
  std::atomic<int64_t> next{0}, copied{0};
  p.run(threads - 1, [&](int) {
    int64_t mine = 0;
    for (;;) {
      const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= items) break;
      mine += copy_items(job, b, std::min(items, b + chunk));
    }
    copied.fetch_add(mine, std::memory_order_relaxed);
  });
  return copied.load();
}

}  // namespace kvflow

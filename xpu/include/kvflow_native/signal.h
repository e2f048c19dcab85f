// Per-instance signal segment (POSIX shared memory) and the native kv signal sender.
//
// Segment layout (fixed; kvflow/signal/segment.py writes the same bytes), little-endian:
//   header, 64 bytes: magic "KVFSIG01" (8) | u32 version = 1 | u32 num_layers |
//                     u64 owner_pid | u64 owner_start_time (/proc/<pid>/stat field 22, clock
//                     ticks since boot) | u64 created_ns (CLOCK_REALTIME) | zero padding
//   then one 64-byte slot per layer: i64 step at +0 (latest completed prefill step, -1
//   initially) | i64 count at +8 (completions written, monotone) | zero padding;
//   file size 64 + 64 * num_layers rounded up to 4096 bytes, the rest zero.
// Writer: store count, then release-store step. Reader: acquire-load step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace kvflow {

constexpr uint32_t kSignalVersion = 1;
constexpr int64_t kHeaderBytes = 64;
constexpr int64_t kSlotBytes = 64;
constexpr int64_t kPageBytes = 4096;

// File size: 64 + 64 * num_layers rounded up to a 4096-byte page (so it can be host-registered).
int64_t segment_bytes(int64_t num_layers);

struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

uint64_t process_start_time(int64_t pid);  // /proc/<pid>/stat field 22; 0 if unreadable

class SignalSegment {
 public:
  // Create (O_CREAT|O_EXCL, mode 0600) or attach the segment `name` (with or without a leading
  // '/'). Attaching checks magic, version and, when num_layers > 0, the layer count.
  SignalSegment(const std::string& name, int64_t num_layers, bool create);
  ~SignalSegment();
  SignalSegment(const SignalSegment&) = delete;
  SignalSegment& operator=(const SignalSegment&) = delete;

  // count += 1, then release-store step. One writer per segment. Throws std::invalid_argument
  // for a negative step or one older than the layer's last (steps must not decrease).
  void write(int64_t layer, int64_t step);
  int64_t step(int64_t layer) const;             // acquire load
  int64_t count(int64_t layer) const;            // acquire load
  // Wait until step(layer) >= step; spin `spin_us`, then sleep in short steps. Throws
  // TimeoutError naming layer, step and segment. Returns the step seen.
  int64_t wait(int64_t layer, int64_t step, double timeout_s, double spin_us = 50.0) const;
  void close();   // unmap (idempotent)
  void unlink();  // remove the name from /dev/shm (idempotent)

  const std::string& name() const { return name_; }
  int64_t num_layers() const { return num_layers_; }
  bool owner() const { return owner_; }
  uint64_t owner_pid() const;
  uint64_t owner_start_time() const;
  uint64_t created_ns() const;
  bool closed() const { return base_ == nullptr; }

 private:
  int64_t* slot(int64_t layer) const;
  const uint8_t* header() const;
  std::string name_;
  int64_t num_layers_ = 0;
  bool owner_ = false;
  bool unlinked_ = false;
  uint8_t* base_ = nullptr;
  int64_t size_ = 0;
};

// A completion the caller sets once the layer's cache write has finished (host backend).
class CompletionFlag {
 public:
  void set();
  bool is_set() const { return done_.load(std::memory_order_acquire); }
  bool wait_for(double timeout_s);  // true once set; false on timeout
 private:
  std::atomic<bool> done_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
};

// One queued signal: write `step` into `layer` once `wait_done` returns true.
struct SignalItem {
  int64_t layer;
  int64_t step;
  std::function<bool(double)> wait_done;  // empty: complete already; arg: timeout in seconds
};

// A worker thread with a FIFO queue: for each item it waits for completion (bounded), then
// writes the shared flag. stop() drains every pending item, then joins.
class KVSignalSender {
 public:
  KVSignalSender(std::shared_ptr<SignalSegment> segment, double completion_timeout_s);
  ~KVSignalSender();
  void enqueue(SignalItem item);
  int64_t stop();  // drain + join; returns signals written in total; idempotent
  int64_t written() const { return written_.load(); }
  int64_t failed() const { return failed_.load(); }
  int64_t pending() const;
  std::string last_error() const;
  bool running() const { return !stopped_; }
  std::shared_ptr<SignalSegment> segment() const { return segment_; }

 private:
  void run();
  std::shared_ptr<SignalSegment> segment_;
  double completion_timeout_s_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SignalItem> queue_;
  bool stopping_ = false;
  bool stopped_ = false;
  int64_t busy_ = 0;
  std::atomic<int64_t> written_{0}, failed_{0};
  std::string last_error_;
  std::thread worker_;
};

// The process-wide layerwise channel (the seed's init_signal_layerwise / send_signal).
// send_signal is a no-op (counted) until a channel is initialised, and during a profile run:
// either the native switch set_profile_run(true) or sends_allowed == false from the caller
// (kvflow.context.sends_allowed()). init_signal_layerwise refuses during a profile run.
struct SignalStats {
  int64_t written = 0;
  int64_t suppressed_uninit = 0;   // send before the channel was initialised
  int64_t suppressed_profile = 0;  // send (or init) during a profile / dummy run
};
bool init_signal_layerwise(std::shared_ptr<SignalSegment> segment, bool sends_allowed);
void reset_signal_layerwise();
std::shared_ptr<SignalSegment> current_channel();
bool send_signal(int64_t layer, int64_t step, bool sends_allowed);
void set_profile_run(bool on);
bool profile_run();
SignalStats signal_stats();
void reset_signal_stats();

}  // namespace kvflow

// The native kv signal sender (a worker thread that writes each layer's flag once that layer's
// cache write has completed) and the process-wide layerwise channel with its gating.
#include <chrono>

#include "kvflow_native/signal.h"

namespace kvflow {

// ---- CompletionFlag ---------------------------------------------------------------------------
void CompletionFlag::set() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

bool CompletionFlag::wait_for(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [this] { return is_set(); });
}

// ---- KVSignalSender ---------------------------------------------------------------------------
KVSignalSender::KVSignalSender(std::shared_ptr<SignalSegment> segment, double completion_timeout_s)
    : segment_(std::move(segment)), completion_timeout_s_(completion_timeout_s) {
  if (!segment_ || segment_->closed()) throw std::invalid_argument("segment must be an open signal segment");
  if (!(completion_timeout_s > 0)) {
    throw std::invalid_argument("completion_timeout_s must be positive, got " + std::to_string(completion_timeout_s));
  }
  worker_ = std::thread([this] { run(); });
}

KVSignalSender::~KVSignalSender() { stop(); }

void KVSignalSender::enqueue(SignalItem item) {
  if (item.layer < 0 || item.layer >= segment_->num_layers()) {
    throw std::out_of_range("layer=" + std::to_string(item.layer) + " is outside the segment's " +
                            std::to_string(segment_->num_layers()) + " layers");
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) throw std::runtime_error("the kv signal sender is destroyed; enqueue refused");
    queue_.push_back(std::move(item));
  }
  cv_.notify_one();
}

int64_t KVSignalSender::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(queue_.size()) + busy_;
}

std::string KVSignalSender::last_error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_error_;
}

void KVSignalSender::run() {
  for (;;) {
    SignalItem item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = 1;
    }
    std::string error;
    bool done = true;
    try {
      if (item.wait_done) done = item.wait_done(completion_timeout_s_);
      if (!done) {
        error = "layer " + std::to_string(item.layer) + " step " + std::to_string(item.step) +
                " did not complete within " + std::to_string(completion_timeout_s_) + " s; signal not written";
      } else {
        segment_->write(item.layer, item.step);
        written_.fetch_add(1);
      }
    } catch (const std::exception& e) {
      done = false;
      error = "layer " + std::to_string(item.layer) + " step " + std::to_string(item.step) + ": " + e.what();
    }
    item.wait_done = nullptr;  // release the handle (may hold a Python object) before unlocking
    std::lock_guard<std::mutex> lk(mu_);
    busy_ = 0;
    if (!done) {
      failed_.fetch_add(1);
      last_error_ = error;
    }
  }
}

int64_t KVSignalSender::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return written_.load();
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  stopped_ = true;
  return written_.load();
}

// ---- the process-wide layerwise channel --------------------------------------------------------
namespace {
std::mutex g_mu;
std::shared_ptr<SignalSegment> g_channel;
std::atomic<bool> g_profile_run{false};
std::atomic<int64_t> g_written{0}, g_uninit{0}, g_profile{0};
}  // namespace

bool init_signal_layerwise(std::shared_ptr<SignalSegment> segment, bool sends_allowed) {
  if (!sends_allowed || g_profile_run.load()) {
    g_profile.fetch_add(1);
    return false;
  }
  if (!segment || segment->closed()) throw std::invalid_argument("segment must be an open signal segment");
  std::lock_guard<std::mutex> lk(g_mu);
  g_channel = std::move(segment);
  return true;
}

void reset_signal_layerwise() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_channel.reset();
}

std::shared_ptr<SignalSegment> current_channel() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_channel;
}

bool send_signal(int64_t layer, int64_t step, bool sends_allowed) {
  if (!sends_allowed || g_profile_run.load()) {
    g_profile.fetch_add(1);
    return false;
  }
  std::shared_ptr<SignalSegment> ch = current_channel();
  if (!ch) {
    g_uninit.fetch_add(1);
    return false;
  }
  ch->write(layer, step);
  g_written.fetch_add(1);
  return true;
}

void set_profile_run(bool on) { g_profile_run.store(on); }
bool profile_run() { return g_profile_run.load(); }

SignalStats signal_stats() { return SignalStats{g_written.load(), g_uninit.load(), g_profile.load()}; }

void reset_signal_stats() {
  g_written = 0;
  g_uninit = 0;
  g_profile = 0;
}

}  // namespace kvflow

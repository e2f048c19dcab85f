// The per-instance signal segment: create/attach, release-store writes, acquire-load reads,
// bounded waits. Layout in kvflow_native/signal.h (mirrors kvflow/signal/segment.py).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "kvflow_native/signal.h"

namespace kvflow {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'F', 'S', 'I', 'G', '0', '1'};
// Header field offsets (bytes).
constexpr int kOffVersion = 8, kOffLayers = 12, kOffPid = 16, kOffStart = 24, kOffCreated = 32;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the segment layout is little-endian");

std::string shm_name(const std::string& name) { return name.rfind('/', 0) == 0 ? name : "/" + name; }

std::string errno_text(const std::string& what, const std::string& name) {
  return what + " " + name + ": " + std::strerror(errno);
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

uint64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

uint64_t process_start_time(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto close_paren = text.rfind(')');  // the command name may hold spaces and ')'
  if (close_paren == std::string::npos) return 0;
  std::istringstream rest(text.substr(close_paren + 1));
  std::string field;
  for (int k = 3; k <= 22 && rest >> field; ++k) {
    if (k == 22) return std::stoull(field);
  }
  return 0;
}

SignalSegment::SignalSegment(const std::string& name, int64_t num_layers, bool create)
    : name_(name), owner_(create) {
  const std::string path = shm_name(name);
  if (name.empty() || path.find('/', 1) != std::string::npos || path.size() > 255) {
    throw std::invalid_argument("name=" + name + " is not a valid shared-memory name (no '/', at most 254 chars)");
  }
  if (create && num_layers <= 0) {
    throw std::invalid_argument("num_layers must be positive to create a segment, got " + std::to_string(num_layers));
  }
  if (num_layers < 0) throw std::invalid_argument("num_layers must be >= 0, got " + std::to_string(num_layers));
  const int fd = create ? shm_open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(path.c_str(), O_RDWR, 0);
  if (fd < 0) throw std::runtime_error(errno_text(create ? "cannot create signal segment" : "cannot attach signal segment", name));
  int64_t size = 0;
  if (create) {
    size = segment_bytes(num_layers);
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, size) != 0) {  // fchmod: exact mode despite umask
      const std::string msg = errno_text("cannot size signal segment", name);
      ::close(fd);
      shm_unlink(path.c_str());
      throw std::runtime_error(msg);
    }
  } else {
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      const std::string msg = errno_text("cannot stat signal segment", name);
      ::close(fd);
      throw std::runtime_error(msg);
    }
    size = st.st_size;
    if (size < kHeaderBytes) {
      ::close(fd);
      throw std::runtime_error("signal segment " + name + " holds " + std::to_string(size) +
                               " bytes, less than its 64-byte header");
    }
  }
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    const std::string msg = errno_text("cannot map signal segment", name);
    if (create) shm_unlink(path.c_str());
    throw std::runtime_error(msg);
  }
  base_ = static_cast<uint8_t*>(p);
  size_ = size;
  if (create) {
    num_layers_ = num_layers;
    std::memset(base_, 0, static_cast<size_t>(size));
    for (int64_t l = 0; l < num_layers; ++l) {
      int64_t* s = slot(l);
      __atomic_store_n(&s[1], int64_t{0}, __ATOMIC_RELAXED);
      __atomic_store_n(&s[0], int64_t{-1}, __ATOMIC_RELAXED);
    }
    std::memcpy(base_, kMagic, 8);
    store<uint32_t>(base_ + kOffVersion, kSignalVersion);
    store<uint32_t>(base_ + kOffLayers, static_cast<uint32_t>(num_layers));
    store<uint64_t>(base_ + kOffPid, static_cast<uint64_t>(getpid()));
    store<uint64_t>(base_ + kOffStart, process_start_time(getpid()));
    store<uint64_t>(base_ + kOffCreated, realtime_ns());
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return;
  }
  std::string error;
  const auto layers = load<uint32_t>(base_ + kOffLayers);
  if (std::memcmp(base_, kMagic, 8) != 0) {
    error = "signal segment " + name + " has a bad magic (not a kvflow signal segment)";
  } else if (load<uint32_t>(base_ + kOffVersion) != kSignalVersion) {
    error = "signal segment " + name + " has version " + std::to_string(load<uint32_t>(base_ + kOffVersion)) +
            "; this build reads version " + std::to_string(kSignalVersion);
  } else if (num_layers > 0 && layers != num_layers) {
    error = "signal segment " + name + " holds " + std::to_string(layers) + " layers; num_layers=" +
            std::to_string(num_layers) + " was expected";
  } else if (size < kHeaderBytes + kSlotBytes * static_cast<int64_t>(layers)) {
    error = "signal segment " + name + " is " + std::to_string(size) + " bytes, too small for " +
            std::to_string(layers) + " layers";
  }
  if (!error.empty()) {
    close();
    throw std::runtime_error(error);
  }
  num_layers_ = layers;
}

SignalSegment::~SignalSegment() {
  close();
  if (owner_) unlink();
}

int64_t* SignalSegment::slot(int64_t layer) const {
  if (base_ == nullptr) throw std::runtime_error("signal segment " + name_ + " is closed");
  if (layer < 0 || layer >= num_layers_) {
    throw std::out_of_range("layer=" + std::to_string(layer) + " is outside the segment's " +
                            std::to_string(num_layers_) + " layers");
  }
  return reinterpret_cast<int64_t*>(base_ + kHeaderBytes + kSlotBytes * layer);
}

int64_t segment_bytes(int64_t num_layers) {
  const int64_t need = kHeaderBytes + kSlotBytes * num_layers;
  return (need + kPageBytes - 1) / kPageBytes * kPageBytes;
}

void SignalSegment::write(int64_t layer, int64_t step) {
  int64_t* s = slot(layer);
  const int64_t last = __atomic_load_n(&s[0], __ATOMIC_RELAXED);
  if (step < 0 || step < last) {
    throw std::invalid_argument("step=" + std::to_string(step) + " for layer " + std::to_string(layer) +
                                (step < 0 ? " must be non-negative" : " is older than the layer's last signalled step " + std::to_string(last)) +
                                "; steps must not decrease");
  }
  const int64_t c = __atomic_load_n(&s[1], __ATOMIC_RELAXED);  // one writer per segment
  __atomic_store_n(&s[1], c + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&s[0], step, __ATOMIC_RELEASE);
}

int64_t SignalSegment::step(int64_t layer) const { return __atomic_load_n(&slot(layer)[0], __ATOMIC_ACQUIRE); }

int64_t SignalSegment::count(int64_t layer) const { return __atomic_load_n(&slot(layer)[1], __ATOMIC_ACQUIRE); }

int64_t SignalSegment::wait(int64_t layer, int64_t step, double timeout_s, double spin_us) const {
  const int64_t* s = slot(layer);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto spin_until = start + std::chrono::duration<double, std::micro>(spin_us);
  const auto deadline = start + std::chrono::duration<double>(timeout_s);
  int spins = 0;
  for (;;) {
    const int64_t seen = __atomic_load_n(&s[0], __ATOMIC_ACQUIRE);
    if (seen >= step) return seen;
    const auto now = clock::now();
    if (now >= deadline) {
      std::ostringstream msg;
      msg << "no signal for layer " << layer << " step " << step << " in segment " << name_ << " within "
          << timeout_s << " s (last step seen: " << seen << ")";
      throw TimeoutError(msg.str());
    }
    if (now >= spin_until) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    } else if (++spins > 64) {
      std::this_thread::yield();  // let a runnable writer (e.g. the sender thread) have this core
    }
  }
}

void SignalSegment::close() {
  if (base_ != nullptr) {
    munmap(base_, static_cast<size_t>(size_));
    base_ = nullptr;
  }
}

void SignalSegment::unlink() {
  if (!unlinked_) {
    unlinked_ = true;
    shm_unlink(shm_name(name_).c_str());  // ENOENT (already removed) is fine
  }
}

const uint8_t* SignalSegment::header() const {
  if (base_ == nullptr) throw std::runtime_error("signal segment " + name_ + " is closed");
  return base_;
}

uint64_t SignalSegment::owner_pid() const { return load<uint64_t>(header() + kOffPid); }
uint64_t SignalSegment::owner_start_time() const { return load<uint64_t>(header() + kOffStart); }
uint64_t SignalSegment::created_ns() const { return load<uint64_t>(header() + kOffCreated); }

}  // namespace kvflow

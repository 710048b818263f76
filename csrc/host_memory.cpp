// Pinned host buffers: cuMemHostAlloc, or mmap + NUMA policy + parallel first touch +
// cuMemHostRegister.
#include "host_memory.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cuda_driver.h"

namespace offload {
namespace {

constexpr size_t kSmallPage = 4096;
constexpr size_t kHugePage = size_t(2) << 20;
// Each touch thread zeroes at least this much: below it, starting a thread costs more than it
// saves. Measured on an H200 host (16 cores, 2026-11-28), a 64 MiB block pinned at 5.7 GB/s from
// one thread and 17.7 from 8; 16 MiB at 4.9 and 9.5.
constexpr size_t kTouchBytesPerThread = size_t(4) << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Linux memory-policy constants (linux/mempolicy.h), spelled out: we call the syscalls directly
// rather than depend on libnuma's headers and library.
constexpr int kMpolDefault = 0;
constexpr int kMpolPreferred = 1;
constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;
constexpr int kMaxNodes = 1024;  // the kernel's largest MAX_NUMNODES (NODES_SHIFT = 10)
constexpr int kBitsPerWord = 8 * sizeof(unsigned long);
constexpr int kMaskWords = kMaxNodes / kBitsPerWord;
// The kernel reads `maxnode - 1` bits of a node mask (a long-standing off-by-one that libnuma
// pads for too), so every call passes one more than the mask holds.
constexpr unsigned long kMaskArg = kMaxNodes + 1;

std::string errno_text(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

// The calling thread's memory policy set to "prefer `node`" for one scope, then put back as it
// was: cuMemHostAlloc allocates (and faults in) its pages in the calling thread, so that is the
// one way to place them.
class ThreadPrefersNode {
 public:
  explicit ThreadPrefersNode(int node) {
    if (syscall(SYS_get_mempolicy, &old_mode_, old_mask_, kMaskArg, nullptr, 0) != 0) {
      error = errno_text("get_mempolicy");
      return;
    }
    unsigned long mask[kMaskWords] = {};
    mask[node / kBitsPerWord] |= 1UL << (node % kBitsPerWord);
    if (syscall(SYS_set_mempolicy, kMpolPreferred, mask, kMaskArg) != 0) {
      error = errno_text("set_mempolicy(MPOL_PREFERRED)");
      return;
    }
    active = true;
  }
  ~ThreadPrefersNode() {
    if (active) syscall(SYS_set_mempolicy, old_mode_, old_mode_ == kMpolDefault ? nullptr : old_mask_, kMaskArg);
  }
  ThreadPrefersNode(const ThreadPrefersNode&) = delete;
  ThreadPrefersNode& operator=(const ThreadPrefersNode&) = delete;

  bool active = false;
  std::string error;

 private:
  int old_mode_ = kMpolDefault;
  unsigned long old_mask_[kMaskWords] = {};
};

// Faulting the pages in is the slow part of pinning a fresh mapping (the kernel zeroes each page
// on first touch); cuMemHostRegister would do it on one thread. Writing one byte per page from
// several threads spreads the zeroing over cores, and the registration then only locks pages
// that already exist.
void touch_pages(char* p, size_t n, size_t page, int threads) {
  if (threads <= 1 || n < kTouchBytesPerThread) {
    for (size_t off = 0; off < n; off += page) p[off] = 0;
    return;
  }
  std::vector<std::thread> pool;
  const size_t pages = n / page;
  const size_t per = (pages + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const size_t first = t * per, last = std::min(pages, first + per);
    if (first >= last) break;
    pool.emplace_back([=] {
      for (size_t i = first; i < last; ++i) p[i * page] = 0;
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace

std::string prefer_node(void* p, size_t n, int node) {
  if (node < 0 || node >= kMaxNodes)
    return "NUMA node " + std::to_string(node) + " is out of range 0.." + std::to_string(kMaxNodes - 1);
  unsigned long mask[kMaskWords] = {};
  mask[node / kBitsPerWord] |= 1UL << (node % kBitsPerWord);
  if (syscall(SYS_mbind, p, n, kMpolPreferred, mask, kMaskArg, 0) != 0)
    return errno_text(("mbind(MPOL_PREFERRED, node " + std::to_string(node) + ")").c_str());
  return "";
}

int node_of_address(const void* p) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, const_cast<void*>(p), kMpolFNode | kMpolFAddr) != 0)
    return -1;
  return node;
}

PinMethod parse_pin_method(const std::string& name) {
  if (name == "host_alloc") return PinMethod::kHostAlloc;
  if (name == "register") return PinMethod::kRegister;
  if (name == "register_huge") return PinMethod::kRegisterHuge;
  if (name == "mapped") return PinMethod::kMapped;
  throw std::invalid_argument("pin method must be 'host_alloc', 'register', 'register_huge' or 'mapped', got '" +
                              name + "'");
}

const char* pin_method_name(PinMethod m) {
  switch (m) {
    case PinMethod::kHostAlloc: return "host_alloc";
    case PinMethod::kRegister: return "register";
    case PinMethod::kRegisterHuge: return "register_huge";
    case PinMethod::kMapped: return "mapped";
  }
  return "?";
}

PinnedHostBuffer::PinnedHostBuffer(size_t nbytes, PinMethod method, uintptr_t context,
                                   int touch_threads, int numa_node, bool lock_now)
    : size_(nbytes), method_(method), context_(context) {
  if (nbytes == 0) throw std::invalid_argument("pinned buffer size must be > 0");
  if (method == PinMethod::kHostAlloc) {
    mapped_ = round_up(nbytes, kSmallPage);
    if (numa_node < 0) {
      data_ = host_alloc(mapped_, context);
      return;
    }
    ThreadPrefersNode scope(numa_node);
    data_ = host_alloc(mapped_, context);
    if (scope.active)
      numa_node_ = numa_node;
    else
      numa_error_ = scope.error;
    return;
  }
  const bool huge = method == PinMethod::kRegisterHuge;
  const size_t page = huge ? kHugePage : kSmallPage;
  mapped_ = round_up(nbytes, page);
  // Huge pages need a 2 MiB-aligned range: map one page more and trim both ends.
  const size_t span = huge ? mapped_ + kHugePage : mapped_;
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED)
    throw std::runtime_error("offload pinned buffer: mmap of " + std::to_string(span) +
                             " bytes failed: " + std::strerror(errno));
  char* base = static_cast<char*>(m);
  if (huge) {
    const uintptr_t aligned = round_up(reinterpret_cast<uintptr_t>(base), kHugePage);
    char* start = reinterpret_cast<char*>(aligned);
    if (start > base) munmap(base, start - base);
    const size_t tail = (base + span) - (start + mapped_);
    if (tail) munmap(start + mapped_, tail);
    base = start;
    // Advice only: without THP support the pages are simply small (slower, still correct).
    madvise(base, mapped_, MADV_HUGEPAGE);
  }
  mapping_ = base;
  // Not inherited by a fork (a DataLoader's workers, the plan search's process): a private
  // mapping is shared copy-on-write with the child, and the kernel copies pages pinned for DMA
  // into the child at the fork itself (each worker would take a copy of every pinned block) or,
  // where it does not, a later write here would move the page away from the one the device
  // copies into. No child reads our blocks. Advice only: on failure the fork shares them as before.
  madvise(base, mapped_, MADV_DONTFORK);
  if (numa_node >= 0) {
    // Before the first touch: that is when each page gets its node, for good once pinned.
    numa_error_ = prefer_node(base, mapped_, numa_node);
    if (numa_error_.empty()) numa_node_ = numa_node;
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (touch_threads <= 0)  // half the cores: the training thread and its data loaders keep the rest
    touch_threads = static_cast<int>(std::min<size_t>(std::max(1, std::min(16, cores / 2)),
                                                      std::max<size_t>(1, mapped_ / kTouchBytesPerThread)));
  touch_threads = std::min(touch_threads, cores);
  touch_pages(base, mapped_, kSmallPage * (huge ? 512 : 1), touch_threads);
  data_ = base;
  if (method == PinMethod::kMapped || !lock_now) return;  // plain host memory, or locked later
  lock_pages();
}

void PinnedHostBuffer::lock_pages() {
  if (method_ == PinMethod::kHostAlloc || method_ == PinMethod::kMapped || registered_) return;
  if (mapping_ == nullptr) throw std::runtime_error("offload pinned buffer: locked after a refusal emptied it");
  try {
    if (context_ == 0) context_ = current_context();  // made with lock_now=false and no context
    host_register(mapping_, mapped_, context_);
  } catch (...) {
    // Refused (locked-memory limit, out of memory): the pages go back to the host now, not when
    // the caller drops the object (a refused block must not keep what the budget refunded).
    munmap(mapping_, mapped_);
    mapping_ = data_ = nullptr;
    size_ = mapped_ = 0;
    throw;
  }
  registered_ = true;
}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (method_ == PinMethod::kHostAlloc) {
    if (data_) host_free(data_, context_);
    return;
  }
  if (registered_) host_unregister(mapping_, context_);
  if (mapping_) munmap(mapping_, mapped_);
}

}  // namespace offload

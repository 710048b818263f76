// Pinned host buffers: cuMemHostAlloc, or mmap + parallel first touch + cuMemHostRegister.
#include "host_memory.h"

#include <sys/mman.h>
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

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Faulting the pages in is the slow part of pinning a fresh mapping (the kernel zeroes each page
// on first touch); cuMemHostRegister would do it on one thread. Writing one byte per page from
// several threads spreads the zeroing over cores, and the registration then only locks pages
// that already exist.
void touch_pages(char* p, size_t n, size_t page, int threads) {
  if (threads <= 1 || n < size_t(64) << 20) {
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

PinMethod parse_pin_method(const std::string& name) {
  if (name == "host_alloc") return PinMethod::kHostAlloc;
  if (name == "register") return PinMethod::kRegister;
  if (name == "register_huge") return PinMethod::kRegisterHuge;
  throw std::invalid_argument("pin method must be 'host_alloc', 'register' or 'register_huge', got '" +
                              name + "'");
}

const char* pin_method_name(PinMethod m) {
  switch (m) {
    case PinMethod::kHostAlloc: return "host_alloc";
    case PinMethod::kRegister: return "register";
    case PinMethod::kRegisterHuge: return "register_huge";
  }
  return "?";
}

PinnedHostBuffer::PinnedHostBuffer(size_t nbytes, PinMethod method, uintptr_t context,
                                   int touch_threads)
    : size_(nbytes), method_(method), context_(context) {
  if (nbytes == 0) throw std::invalid_argument("pinned buffer size must be > 0");
  if (method == PinMethod::kHostAlloc) {
    mapped_ = round_up(nbytes, kSmallPage);
    data_ = host_alloc(mapped_, context);
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
  if (touch_threads <= 0)
    touch_threads = static_cast<int>(std::min<size_t>(8, std::max<size_t>(1, mapped_ >> 26)));
  touch_threads = std::min<int>(touch_threads, std::max(1u, std::thread::hardware_concurrency()));
  touch_pages(base, mapped_, kSmallPage * (huge ? 512 : 1), touch_threads);
  try {
    host_register(base, mapped_, context);
  } catch (...) {
    munmap(base, mapped_);
    mapping_ = nullptr;
    throw;
  }
  registered_ = true;
  data_ = base;
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

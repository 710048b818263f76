// Page-locked (pinned) host buffers, allocated without torch's caching host allocator.
//
// Why our own: torch pins with cudaHostAlloc at ~1.5 GB/s on our H100 host and rounds requests
// up to a power of two behind our back, so the first step of a large model froze for seconds
// and "bytes held" was not what the arena asked for. Here a buffer is exactly the bytes mapped
// and pinned (rounded to the page size used), and the fastest method measured is the default.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offload {

enum class PinMethod {
  kHostAlloc,      // cuMemHostAlloc: the driver allocates and pins (what torch does)
  kRegister,       // anonymous mmap (4 KiB pages), touched in parallel, then cuMemHostRegister
  kRegisterHuge,   // the same with transparent huge pages (2 MiB), so pinning walks 512x fewer pages
};

PinMethod parse_pin_method(const std::string& name);  // "host_alloc" | "register" | "register_huge"
const char* pin_method_name(PinMethod m);

// One pinned host buffer. Owns its memory: the destructor unpins and unmaps (or frees) it.
class PinnedHostBuffer {
 public:
  // Throws std::runtime_error (naming the call and the size) when the host refuses; nothing is
  // left allocated then. `touch_threads` <= 0 picks one per 64 MiB, at most 8 (the
  // host's other threads still run Python and autograd meanwhile).
  PinnedHostBuffer(size_t nbytes, PinMethod method, uintptr_t context, int touch_threads);
  ~PinnedHostBuffer();
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }          // the bytes asked for (what the buffer exposes)
  size_t pinned_bytes() const { return mapped_; }  // the bytes really locked (page-rounded)
  PinMethod method() const { return method_; }

 private:
  void* data_ = nullptr;
  void* mapping_ = nullptr;  // mmap methods: start of the mapping
  size_t size_ = 0;
  size_t mapped_ = 0;
  PinMethod method_;
  uintptr_t context_ = 0;
  bool registered_ = false;
};

}  // namespace offload

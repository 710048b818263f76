// Page-locked (pinned) host buffers, allocated without torch's caching host allocator.
//
// Why our own: torch pins with cudaHostAlloc at ~1.5 GB/s on our H100 host and rounds requests
// up to a power of two behind our back, so the first step of a large model froze for seconds
// and "bytes held" was not what the arena asked for. Here a buffer is exactly the bytes mapped
// and pinned (rounded to the page size used), and the fastest method measured is the default.
//
// NUMA: on a host with several sockets, a buffer can be placed on a given node (the GPU's own,
// whose memory controller sits next to its PCIe root): the mapping gets a preferred-node policy
// with the raw mbind syscall (no libnuma) *before* its pages are first touched, since a page's
// node is fixed when it is faulted in and pinned pages cannot migrate afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offload {

enum class PinMethod {
  kHostAlloc,      // cuMemHostAlloc: the driver allocates and pins (what torch does)
  kRegister,       // anonymous mmap (4 KiB pages), touched in parallel, then cuMemHostRegister
  kRegisterHuge,   // the same with transparent huge pages (2 MiB), so pinning walks 512x fewer pages
  kMapped,         // anonymous mmap touched like kRegisterHuge's, NOT pinned: plain host memory
                   // (no CUDA needed), for the host transport and for checking NUMA placement
};

// "host_alloc" | "register" | "register_huge" | "mapped"
PinMethod parse_pin_method(const std::string& name);
const char* pin_method_name(PinMethod m);

// Give [p, p + n) (page-aligned, not touched yet) a preferred-node policy for `node`. Preferred,
// not bound: a node that runs out of memory then serves from another instead of invoking the
// OOM killer. Returns "" on success, else why not (the mapping is left as it was).
std::string prefer_node(void* p, size_t n, int node);
// The NUMA node holding the page at `p` (faulted in), or -1 when the kernel will not say.
int node_of_address(const void* p);

// One pinned host buffer. Owns its memory: the destructor unpins and unmaps (or frees) it.
class PinnedHostBuffer {
 public:
  // Throws std::runtime_error (naming the call and the size) when the host refuses; nothing is
  // left allocated then. `touch_threads` <= 0 picks one per 4 MiB, at most half
  // the cores and 16 (the host's other threads still run Python and autograd meanwhile). `numa_node` >= 0: place the
  // pages on that node (see prefer_node; cuMemHostAlloc gets it through the calling thread's
  // policy for the duration of the call). A node the kernel refuses is not an error: the
  // buffer is allocated without it, and numa_node() is -1 with numa_error() saying why.
  //
  // `lock_now` false (the mmap methods only): the pages are faulted in, but not locked until
  // lock_pages(), and no driver call is made before it (`context` 0: the one current where it is
  // locked). Faulting in is the slow part on a fresh host; cuMemHostRegister holds the driver's
  // lock, which every driver call of the process waits behind, so a caller can fault in while
  // the GPU's own work is being set up and lock later. (benchmarks/first_step.py measures each
  // half's cost; the arena pins blocks whole: locking them apart, back to back or paced, gained
  // T22 nothing on the H200, see docs/benchmarks.md.)
  PinnedHostBuffer(size_t nbytes, PinMethod method, uintptr_t context, int touch_threads,
                   int numa_node = -1, bool lock_now = true);
  ~PinnedHostBuffer();
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  // Lock (register) the pages of a buffer made with lock_now=false; a no-op once locked, and for
  // the methods that lock as they allocate. Throws std::runtime_error when the host refuses; the
  // buffer's pages are then released at once, and it is empty (size 0).
  void lock_pages();
  // Whether the pages are locked (pinned): always for host_alloc, never for mapped.
  bool locked() const { return method_ == PinMethod::kHostAlloc || registered_; }

  void* data() const { return data_; }
  size_t size() const { return size_; }          // the bytes asked for (what the buffer exposes)
  size_t pinned_bytes() const { return mapped_; }  // the bytes really locked (page-rounded)
  PinMethod method() const { return method_; }
  int numa_node() const { return numa_node_; }  // the node asked for and applied, else -1
  const std::string& numa_error() const { return numa_error_; }

 private:
  void* data_ = nullptr;
  void* mapping_ = nullptr;  // mmap methods: start of the mapping
  size_t size_ = 0;
  size_t mapped_ = 0;
  PinMethod method_;
  uintptr_t context_ = 0;
  bool registered_ = false;
  int numa_node_ = -1;
  std::string numa_error_;
};

}  // namespace offload

// Batched copy submission through the CUDA driver API, loaded at run time.
//
// Nothing here includes a CUDA header: the handful of driver types, enums and entry-point
// signatures we need are declared in cuda_driver.cpp, so the extension builds with g++ alone and
// one build works with any torch / CUDA toolkit. libcuda.so.1 is dlopen()ed lazily on first use,
// so a CPU-only machine imports the module fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offload {

// One snapshot of the CUDA copy machinery, for cuda_copy_info().
struct CudaCopyInfo {
  std::string path;    // "batch", "loop" or "unavailable"
  std::string reason;  // why the path is what it is (human readable)
  int driver_version = 0;       // cuDriverGetVersion(), e.g. 13000; 0 when unknown
  int batch_abi = 0;            // ABI version cuMemcpyBatchAsync is bound with (12080), 0 if unbound
  uint64_t batch_calls = 0;     // calls fully submitted by one cuMemcpyBatchAsync
  uint64_t loop_calls = 0;      // calls submitted by the cuMemcpyAsync loop (any reason)
  uint64_t batch_fallbacks = 0; // batch call refused (invalid value), retried as a loop
  uint64_t capture_loop_calls = 0;  // stream was capturing: loop used on purpose
  uint64_t legacy_stream_loop_calls = 0;  // legacy NULL stream: batch API refuses it
  std::string last_batch_error;  // name of the last error the batch call returned, "" if none
};

// Submit `n` copies (all sizes > 0, pointers non-null: the caller validated) on `stream`.
// `index` maps each of the n entries back to its position in the caller's lists (for errors).
// Must be called WITHOUT the GIL held (it may block in the driver); throws std::runtime_error.
void cuda_copy(const uint64_t* dsts, const uint64_t* srcs, const size_t* sizes,
               const size_t* index, size_t n, uintptr_t stream, bool force_loop);

// Loads the driver if not done yet and reports the live path.
CudaCopyInfo cuda_copy_info();

// ---- Events (pooled per context; see cuda_driver.cpp) -----------------------------------------
// A CUevent borrowed from the pool of the context current on this thread. Handles are the raw
// driver pointers as integers, like torch's `cuda_stream`.
struct PooledEvent {
  uintptr_t handle = 0;
  uintptr_t context = 0;
  bool timing = false;
};
PooledEvent event_acquire(bool timing);       // throws without a current context
void event_release(const PooledEvent& e) noexcept;
void event_record(uintptr_t event, uintptr_t stream);
bool event_query(uintptr_t event);           // true once the recorded work has completed
void event_synchronize(uintptr_t event);     // blocks: call without the GIL
float event_elapsed_ms(uintptr_t start, uintptr_t end);
void stream_wait_event(uintptr_t stream, uintptr_t event);
// `waiter` waits for everything queued on `producer` so far (one pooled event, given back).
void stream_wait_stream(uintptr_t waiter, uintptr_t producer);

// ---- Page-locked host memory ------------------------------------------------------------------
uintptr_t current_context();  // the calling thread's current context (throws if none)
// Each runs with `ctx` pushed on the calling thread, so a background thread may call them.
void* host_alloc(size_t nbytes, uintptr_t ctx);             // cuMemHostAlloc(PORTABLE)
void host_free(void* p, uintptr_t ctx) noexcept;
void host_register(void* p, size_t nbytes, uintptr_t ctx);  // cuMemHostRegister(PORTABLE)
void host_unregister(void* p, uintptr_t ctx) noexcept;

// ---- Devices -----------------------------------------------------------------------------------
// "domain:bus:device.function" of CUDA device `ordinal` (cuDeviceGetPCIBusId; CUDA must be
// initialised, which torch has done by the time a device is in use). Throws std::runtime_error.
std::string pci_bus_id(int ordinal);

}  // namespace offload

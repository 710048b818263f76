// CUDA driver API, resolved at run time, and the batched copy submission built on it.
//
// Why the driver API and not the runtime: the runtime library's soname changes with each CUDA
// major version (libcudart.so.12, .13, ...) and torch wheels bundle their own copy, while
// libcuda.so.1 is the one stable entry point installed with the driver. Binding it through
// cuGetProcAddress with an explicit ABI version pins the exact signature we call, independent of
// which toolkit (if any) is installed, so one g++ build serves every torch / CUDA combination.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace offload {
namespace {

// ---- The few driver declarations we need (values and layouts as in cuda.h). ------------------
using CUresult = int;  // an enum in cuda.h; enums are int-sized on every platform we target
using CUdeviceptr = unsigned long long;  // CUdeviceptr_v2
using CUstream = struct CUstream_st*;
using CUcontext = struct CUctx_st*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;

// cuGetProcAddress flags / status.
constexpr uint64_t CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1;  // non-_ptsz variants, like torch
constexpr int CU_GET_PROC_ADDRESS_SUCCESS = 0;

// CUstreamCaptureStatus
constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;

// The legacy default stream handles: 0 (NULL) and CU_STREAM_LEGACY (0x1). cuMemcpyBatchAsync
// documents that it must not be given the legacy NULL stream.
constexpr uintptr_t CU_STREAM_LEGACY_HANDLE = 0x1;

// CUmemcpySrcAccessOrder
constexpr int CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1;

// CUmemLocation: {CUmemLocationType type; int id;}
struct CUmemLocation {
  int type;
  int id;
};
// CUmemcpyAttributes_v1 (CUDA 12.8; unchanged in 13.x).
struct CUmemcpyAttributes {
  int srcAccessOrder;       // CUmemcpySrcAccessOrder
  CUmemLocation srcLocHint;  // ignored for non-managed memory: left zero ("no hint")
  CUmemLocation dstLocHint;
  unsigned int flags;        // CUmemcpyFlags: 0 = CU_MEMCPY_FLAG_DEFAULT
};
static_assert(sizeof(CUmemcpyAttributes) == 24, "CUmemcpyAttributes layout");

// The ABI version we ask cuGetProcAddress for when binding cuMemcpyBatchAsync. 12080 is the
// version that introduced it, with this signature (note failIdx). The CUDA 13 headers map the
// name to a newer ABI without failIdx; asking for 12080 explicitly keeps the signature below
// correct on every driver from 12.8 on (a 13.x driver still serves the 12.8 ABI to binaries built
// against 12.8), and failIdx lets an error name the copy that failed.
constexpr int kBatchAbi = 12080;

using PFN_cuDriverGetVersion = CUresult (*)(int*);
using PFN_cuGetProcAddress_v1 = CUresult (*)(const char*, void**, int, uint64_t);
using PFN_cuGetProcAddress_v2 = CUresult (*)(const char*, void**, int, uint64_t, int*);
using PFN_cuGetErrorName = CUresult (*)(CUresult, const char**);
using PFN_cuGetErrorString = CUresult (*)(CUresult, const char**);
using PFN_cuCtxGetCurrent = CUresult (*)(CUcontext*);
using PFN_cuStreamIsCapturing = CUresult (*)(CUstream, int*);
using PFN_cuMemcpyAsync = CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
using CUevent = struct CUevent_st*;
using PFN_cuEventCreate = CUresult (*)(CUevent*, unsigned int);
using PFN_cuEventRecord = CUresult (*)(CUevent, CUstream);
using PFN_cuEventQuery = CUresult (*)(CUevent);
using PFN_cuEventSynchronize = CUresult (*)(CUevent);
using PFN_cuEventElapsedTime = CUresult (*)(float*, CUevent, CUevent);
using PFN_cuStreamWaitEvent = CUresult (*)(CUstream, CUevent, unsigned int);
using PFN_cuMemHostAlloc = CUresult (*)(void**, size_t, unsigned int);
using PFN_cuMemFreeHost = CUresult (*)(void*);
using PFN_cuMemHostRegister = CUresult (*)(void*, size_t, unsigned int);
using PFN_cuMemHostUnregister = CUresult (*)(void*);
using PFN_cuCtxPushCurrent = CUresult (*)(CUcontext);
using PFN_cuCtxPopCurrent = CUresult (*)(CUcontext*);
using PFN_cuDeviceGet = CUresult (*)(int*, int);  // CUdevice is an int
using PFN_cuDeviceGetPCIBusId = CUresult (*)(char*, int, int);
using PFN_cuThreadExchangeStreamCaptureMode = CUresult (*)(int*);  // CUstreamCaptureMode is an int

constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr unsigned int CU_EVENT_DEFAULT = 0;
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned int CU_MEMHOSTALLOC_PORTABLE = 1;
constexpr unsigned int CU_MEMHOSTREGISTER_PORTABLE = 1;
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
using PFN_cuMemcpyBatchAsync_v12080 = CUresult (*)(CUdeviceptr* dsts, CUdeviceptr* srcs,
                                                   size_t* sizes, size_t count,
                                                   CUmemcpyAttributes* attrs, size_t* attrsIdxs,
                                                   size_t numAttrs, size_t* failIdx,
                                                   CUstream hStream);

struct Driver {
  bool loaded = false;
  std::string reason;  // why unavailable, or why the batch entry point is absent
  int driver_version = 0;
  PFN_cuGetErrorName get_error_name = nullptr;
  PFN_cuGetErrorString get_error_string = nullptr;
  PFN_cuCtxGetCurrent ctx_get_current = nullptr;
  PFN_cuStreamIsCapturing stream_is_capturing = nullptr;
  PFN_cuMemcpyAsync memcpy_async = nullptr;
  PFN_cuMemcpyBatchAsync_v12080 memcpy_batch = nullptr;
  // Events and host memory (see cuda_driver.h). Bound with the copy calls; a driver missing one
  // of them is not "loaded" (they all predate CUDA 11).
  PFN_cuEventCreate event_create = nullptr;
  PFN_cuEventRecord event_record = nullptr;
  PFN_cuEventQuery event_query = nullptr;
  PFN_cuEventSynchronize event_synchronize = nullptr;
  PFN_cuEventElapsedTime event_elapsed = nullptr;
  PFN_cuStreamWaitEvent stream_wait_event = nullptr;
  PFN_cuMemHostAlloc mem_host_alloc = nullptr;
  PFN_cuMemFreeHost mem_free_host = nullptr;
  PFN_cuMemHostRegister mem_host_register = nullptr;
  PFN_cuMemHostUnregister mem_host_unregister = nullptr;
  PFN_cuCtxPushCurrent ctx_push = nullptr;
  PFN_cuCtxPopCurrent ctx_pop = nullptr;
  // Optional (NUMA placement asks them once; torch's device properties usually answer first).
  PFN_cuDeviceGet device_get = nullptr;
  PFN_cuDeviceGetPCIBusId device_pci_bus_id = nullptr;
  // Optional (CUDA >= 10.1): host memory calls run in the relaxed capture mode when it is bound.
  PFN_cuThreadExchangeStreamCaptureMode exchange_capture_mode = nullptr;
};

std::string version_str(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

Driver load_driver() {
  Driver d;
  // RTLD_LOCAL: we only look symbols up through this handle. The handle is never closed: the
  // driver must outlive every stream we submit to, i.e. the process (torch keeps it loaded too).
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    d.reason = std::string("dlopen(libcuda.so.1) failed: ") + (e ? e : "unknown error");
    return d;
  }
  auto get_version = reinterpret_cast<PFN_cuDriverGetVersion>(dlsym(h, "cuDriverGetVersion"));
  if (!get_version || get_version(&d.driver_version) != CUDA_SUCCESS) {
    d.reason = "cuDriverGetVersion unavailable or failed";
    return d;
  }
  // cuGetProcAddress works before cuInit, so loading never initialises CUDA behind torch's back
  // (which would, e.g., break fork-based data loader workers).
  auto gpa2 = reinterpret_cast<PFN_cuGetProcAddress_v2>(dlsym(h, "cuGetProcAddress_v2"));
  auto gpa1 = reinterpret_cast<PFN_cuGetProcAddress_v1>(dlsym(h, "cuGetProcAddress"));
  auto resolve = [&](const char* name, int abi, void** out) -> bool {
    *out = nullptr;
    if (gpa2) {
      int status = -1;
      CUresult r = gpa2(name, out, abi, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
      return r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && *out;
    }
    if (gpa1) {
      CUresult r = gpa1(name, out, abi, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
      return r == CUDA_SUCCESS && *out;
    }
    // Drivers older than 11.3: the exported names carry the ABI these stable calls always had.
    *out = dlsym(h, name);
    return *out != nullptr;
  };
  // The stable calls have had one ABI since long before 12.x: ask for the driver's own version,
  // capped at the version we were written against so a future ABI change cannot surprise us.
  const int abi = std::min(d.driver_version, kBatchAbi);
  void* p = nullptr;
  if (resolve("cuGetErrorName", abi, &p)) d.get_error_name = reinterpret_cast<PFN_cuGetErrorName>(p);
  if (resolve("cuGetErrorString", abi, &p))
    d.get_error_string = reinterpret_cast<PFN_cuGetErrorString>(p);
  if (resolve("cuStreamIsCapturing", abi, &p))
    d.stream_is_capturing = reinterpret_cast<PFN_cuStreamIsCapturing>(p);
  if (!resolve("cuCtxGetCurrent", abi, &p)) {
    d.reason = "cuCtxGetCurrent not found in libcuda.so.1";
    return d;
  }
  d.ctx_get_current = reinterpret_cast<PFN_cuCtxGetCurrent>(p);
  if (!resolve("cuMemcpyAsync", abi, &p)) {
    d.reason = "cuMemcpyAsync not found in libcuda.so.1";
    return d;
  }
  d.memcpy_async = reinterpret_cast<PFN_cuMemcpyAsync>(p);
  struct Entry {
    const char* name;
    void** slot;
  };
  const Entry entries[] = {
      {"cuEventCreate", reinterpret_cast<void**>(&d.event_create)},
      {"cuEventRecord", reinterpret_cast<void**>(&d.event_record)},
      {"cuEventQuery", reinterpret_cast<void**>(&d.event_query)},
      {"cuEventSynchronize", reinterpret_cast<void**>(&d.event_synchronize)},
      {"cuEventElapsedTime", reinterpret_cast<void**>(&d.event_elapsed)},
      {"cuStreamWaitEvent", reinterpret_cast<void**>(&d.stream_wait_event)},
      {"cuMemHostAlloc", reinterpret_cast<void**>(&d.mem_host_alloc)},
      {"cuMemFreeHost", reinterpret_cast<void**>(&d.mem_free_host)},
      {"cuMemHostRegister", reinterpret_cast<void**>(&d.mem_host_register)},
      {"cuMemHostUnregister", reinterpret_cast<void**>(&d.mem_host_unregister)},
      {"cuCtxPushCurrent", reinterpret_cast<void**>(&d.ctx_push)},
      {"cuCtxPopCurrent", reinterpret_cast<void**>(&d.ctx_pop)},
  };
  for (const Entry& e : entries) {
    if (!resolve(e.name, abi, e.slot)) {
      d.reason = std::string(e.name) + " not found in libcuda.so.1";
      return d;
    }
  }
  d.loaded = true;
  if (resolve("cuDeviceGet", abi, &p)) d.device_get = reinterpret_cast<PFN_cuDeviceGet>(p);
  if (resolve("cuDeviceGetPCIBusId", abi, &p))
    d.device_pci_bus_id = reinterpret_cast<PFN_cuDeviceGetPCIBusId>(p);
  if (resolve("cuThreadExchangeStreamCaptureMode", abi, &p))
    d.exchange_capture_mode = reinterpret_cast<PFN_cuThreadExchangeStreamCaptureMode>(p);

  if (d.driver_version < kBatchAbi) {
    d.reason = "driver CUDA " + version_str(d.driver_version) +
               " has no cuMemcpyBatchAsync (needs >= 12.8): cuMemcpyAsync loop";
  } else if (!(gpa1 || gpa2)) {
    d.reason = "cuGetProcAddress missing: cuMemcpyAsync loop";
  } else if (!resolve("cuMemcpyBatchAsync", kBatchAbi, &p)) {
    d.reason = "cuGetProcAddress(cuMemcpyBatchAsync, 12080) failed: cuMemcpyAsync loop";
  } else {
    d.memcpy_batch = reinterpret_cast<PFN_cuMemcpyBatchAsync_v12080>(p);
    d.reason = "cuMemcpyBatchAsync bound with the CUDA 12.8 ABI (driver CUDA " +
               version_str(d.driver_version) + ")";
  }
  return d;
}

Driver& driver() {
  // Function-local static: initialised once, thread-safe, and only on first CUDA use.
  static Driver d = load_driver();
  return d;
}

// Run-time state: counters, and the batch entry point switched off after CUDA_ERROR_NOT_SUPPORTED.
std::atomic<uint64_t> g_batch_calls{0}, g_loop_calls{0}, g_batch_fallbacks{0},
    g_capture_loop_calls{0}, g_legacy_loop_calls{0};
std::atomic<bool> g_batch_disabled{false};
std::mutex g_text_mutex;  // guards the two strings below (rare writes, rare reads)
std::string g_batch_disabled_reason;
std::string g_last_batch_error;

std::string error_name(const Driver& d, CUresult r) {
  const char* s = nullptr;
  if (d.get_error_name && d.get_error_name(r, &s) == CUDA_SUCCESS && s) return s;
  return "CUDA_ERROR_CODE_" + std::to_string(r);
}

std::string error_text(const Driver& d, CUresult r) {
  std::string out = error_name(d, r);
  const char* s = nullptr;
  if (d.get_error_string && d.get_error_string(r, &s) == CUDA_SUCCESS && s)
    out += std::string(" (") + s + ")";
  return out;
}

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIx64, v);
  return buf;
}

[[noreturn]] void fail(const Driver& d, const std::string& call, CUresult r,
                       const std::string& where) {
  throw std::runtime_error("offload copy_batch: " + call + " failed with " + error_text(d, r) +
                           where);
}

}  // namespace

void cuda_copy(const uint64_t* dsts, const uint64_t* srcs, const size_t* sizes,
               const size_t* index, size_t n, uintptr_t stream, bool force_loop) {
  Driver& d = driver();
  if (!d.loaded)
    throw std::runtime_error("offload copy_batch: the CUDA driver is unavailable (" + d.reason +
                             ")");
  // The driver submits into the calling thread's current context. torch's runtime makes the
  // device's primary context current lazily, per thread, on its first CUDA call there; we do not
  // create or push contexts ourselves (that would be a second owner of torch's device state).
  CUcontext ctx = nullptr;
  CUresult r = d.ctx_get_current(&ctx);
  if (r == CUDA_ERROR_NOT_INITIALIZED || r == CUDA_ERROR_DEINITIALIZED ||
      (r == CUDA_SUCCESS && ctx == nullptr))
    throw std::runtime_error(
        "offload copy_batch: no CUDA context is current on this thread; CUDA must be initialised "
        "by torch first (run a torch CUDA operation on this thread, e.g. torch.cuda.synchronize(), "
        "before submitting copies)");
  if (r != CUDA_SUCCESS) fail(d, "cuCtxGetCurrent", r, "");
  if (n == 0) return;

  CUstream s = reinterpret_cast<CUstream>(stream);
  const std::string stream_txt = ", stream " + hex(stream);
  bool use_batch = d.memcpy_batch && !force_loop && !g_batch_disabled.load(std::memory_order_relaxed);
  if (use_batch && (stream == 0 || stream == CU_STREAM_LEGACY_HANDLE)) {
    // The batch API refuses the legacy NULL stream; torch's default stream is that stream.
    use_batch = false;
    g_legacy_loop_calls.fetch_add(1, std::memory_order_relaxed);
  }
  if (use_batch && d.stream_is_capturing) {
    // Under stream capture a refused call would invalidate the whole capture, and the drivers we
    // target do not all capture the batch API; cuMemcpyAsync nodes are always capturable.
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    r = d.stream_is_capturing(s, &status);
    if (r != CUDA_SUCCESS) fail(d, "cuStreamIsCapturing", r, stream_txt);
    if (status != CU_STREAM_CAPTURE_STATUS_NONE) {
      use_batch = false;
      g_capture_loop_calls.fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::string batch_note;
  if (use_batch) {
    CUmemcpyAttributes attr{};
    // STREAM: the sources were produced by earlier work ordered before this stream position
    // (the caller makes the stream wait on the producer's event), so they must be read in stream
    // order, never early.
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t attr_idx = 0;  // one attribute set, applying from copy 0 to the end
    size_t fail_idx = SIZE_MAX;
    // The driver takes non-const arrays but does not write them.
    r = d.memcpy_batch(const_cast<CUdeviceptr*>(reinterpret_cast<const CUdeviceptr*>(dsts)),
                       const_cast<CUdeviceptr*>(reinterpret_cast<const CUdeviceptr*>(srcs)),
                       const_cast<size_t*>(sizes), n, &attr, &attr_idx, 1, &fail_idx, s);
    if (r == CUDA_SUCCESS) {
      g_batch_calls.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const std::string name = error_name(d, r);
    {
      std::lock_guard<std::mutex> lock(g_text_mutex);
      g_last_batch_error = name;
      if (r == CUDA_ERROR_NOT_SUPPORTED) {
        // The driver has the entry point but not the feature: stop trying for this process.
        g_batch_disabled_reason = "cuMemcpyBatchAsync returned " + name + ": cuMemcpyAsync loop";
        g_batch_disabled.store(true, std::memory_order_relaxed);
      }
    }
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_SUPPORTED) {
      // Retry one by one: either this combination of pointers is one the batch call refuses but
      // cuMemcpyAsync takes, or an entry really is bad and the loop names it. Copies the batch may
      // have enqueued before failing are simply done again, in stream order, with the same bytes.
      g_batch_fallbacks.fetch_add(1, std::memory_order_relaxed);
      batch_note = " (after cuMemcpyBatchAsync returned " + name;
      if (fail_idx < n) batch_note += " at entry " + std::to_string(index[fail_idx]);
      batch_note += " and the copies were retried one by one)";
    } else {
      std::string where = stream_txt;
      if (fail_idx < n)
        where += ", entry " + std::to_string(index[fail_idx]) + " (dst " + hex(dsts[fail_idx]) +
                 ", src " + hex(srcs[fail_idx]) + ", " + std::to_string(sizes[fail_idx]) +
                 " bytes)";
      fail(d, "cuMemcpyBatchAsync", r, where + " of " + std::to_string(n) + " copies");
    }
  }

  for (size_t i = 0; i < n; ++i) {
    r = d.memcpy_async(dsts[i], srcs[i], sizes[i], s);
    if (r != CUDA_SUCCESS)
      fail(d, "cuMemcpyAsync", r,
           " on entry " + std::to_string(index[i]) + " (dst " + hex(dsts[i]) + ", src " +
               hex(srcs[i]) + ", " + std::to_string(sizes[i]) + " bytes" + stream_txt + ")" +
               batch_note);
  }
  g_loop_calls.fetch_add(1, std::memory_order_relaxed);
}

CudaCopyInfo cuda_copy_info() {
  const Driver& d = driver();
  CudaCopyInfo info;
  info.driver_version = d.driver_version;
  info.batch_abi = d.memcpy_batch ? kBatchAbi : 0;
  info.batch_calls = g_batch_calls.load();
  info.loop_calls = g_loop_calls.load();
  info.batch_fallbacks = g_batch_fallbacks.load();
  info.capture_loop_calls = g_capture_loop_calls.load();
  info.legacy_stream_loop_calls = g_legacy_loop_calls.load();
  std::lock_guard<std::mutex> lock(g_text_mutex);
  info.last_batch_error = g_last_batch_error;
  if (!d.loaded) {
    info.path = "unavailable";
    info.reason = d.reason;
  } else if (!d.memcpy_batch) {
    info.path = "loop";
    info.reason = d.reason;
  } else if (g_batch_disabled.load()) {
    info.path = "loop";
    info.reason = g_batch_disabled_reason;
  } else {
    info.path = "batch";
    info.reason = d.reason;
  }
  return info;
}

// ---- Events ----------------------------------------------------------------------------------
// Creating an event is a driver allocation (microseconds); recording a pooled one is a queue
// write. Events are therefore taken from a per-context free list and given back when their last
// holder lets go. Re-recording a pooled event is safe: a cuStreamWaitEvent already issued keeps
// the state the event had at that call, and nobody else holds it any more.
namespace {

struct EventPool {
  std::mutex mutex;
  // (context, timing) -> idle events. A handful of contexts per process at most.
  std::vector<std::pair<std::pair<CUcontext, bool>, std::vector<CUevent>>> idle;

  std::vector<CUevent>& list(CUcontext ctx, bool timing) {
    for (auto& entry : idle)
      if (entry.first.first == ctx && entry.first.second == timing) return entry.second;
    idle.push_back({{ctx, timing}, {}});
    return idle.back().second;
  }
};

EventPool& event_pool() {
  static EventPool* pool = new EventPool();  // never destroyed: events may be given back at exit
  return *pool;
}

CUcontext require_context(const Driver& d, const char* what) {
  if (!d.loaded)
    throw std::runtime_error(std::string("offload ") + what + ": the CUDA driver is unavailable (" +
                             d.reason + ")");
  CUcontext ctx = nullptr;
  CUresult r = d.ctx_get_current(&ctx);
  if (r == CUDA_ERROR_NOT_INITIALIZED || r == CUDA_ERROR_DEINITIALIZED ||
      (r == CUDA_SUCCESS && ctx == nullptr))
    throw std::runtime_error(std::string("offload ") + what +
                             ": no CUDA context is current on this thread; CUDA must be "
                             "initialised by torch first");
  if (r != CUDA_SUCCESS) fail(d, "cuCtxGetCurrent", r, std::string(" in ") + what);
  return ctx;
}

void check(const Driver& d, CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) fail(d, call, r, "");
}

}  // namespace

PooledEvent event_acquire(bool timing) {
  Driver& d = driver();
  CUcontext ctx = require_context(d, "event");
  EventPool& pool = event_pool();
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    auto& idle = pool.list(ctx, timing);
    if (!idle.empty()) {
      CUevent ev = idle.back();
      idle.pop_back();
      return {reinterpret_cast<uintptr_t>(ev), reinterpret_cast<uintptr_t>(ctx), timing};
    }
  }
  CUevent ev = nullptr;
  check(d, d.event_create(&ev, timing ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING),
        "cuEventCreate");
  return {reinterpret_cast<uintptr_t>(ev), reinterpret_cast<uintptr_t>(ctx), timing};
}

void event_release(const PooledEvent& e) noexcept {
  EventPool& pool = event_pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  pool.list(reinterpret_cast<CUcontext>(e.context), e.timing)
      .push_back(reinterpret_cast<CUevent>(e.handle));
}

void event_record(uintptr_t event, uintptr_t stream) {
  Driver& d = driver();
  check(d, d.event_record(reinterpret_cast<CUevent>(event), reinterpret_cast<CUstream>(stream)),
        "cuEventRecord");
}

bool event_query(uintptr_t event) {
  Driver& d = driver();
  CUresult r = d.event_query(reinterpret_cast<CUevent>(event));
  if (r == CUDA_ERROR_NOT_READY) return false;
  check(d, r, "cuEventQuery");
  return true;
}

void event_synchronize(uintptr_t event) {
  Driver& d = driver();
  check(d, d.event_synchronize(reinterpret_cast<CUevent>(event)), "cuEventSynchronize");
}

float event_elapsed_ms(uintptr_t start, uintptr_t end) {
  Driver& d = driver();
  float ms = 0.0f;
  check(d, d.event_elapsed(&ms, reinterpret_cast<CUevent>(start), reinterpret_cast<CUevent>(end)),
        "cuEventElapsedTime");
  return ms;
}

void stream_wait_event(uintptr_t stream, uintptr_t event) {
  Driver& d = driver();
  check(d, d.stream_wait_event(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUevent>(event), 0),
        "cuStreamWaitEvent");
}

void stream_wait_stream(uintptr_t waiter, uintptr_t producer) {
  // The wait is captured when cuStreamWaitEvent is called, so the pooled event can go back at
  // once (under capture too: the dependency becomes a graph edge then).
  PooledEvent e = event_acquire(false);
  try {
    event_record(e.handle, producer);
    stream_wait_event(waiter, e.handle);
  } catch (...) {
    event_release(e);
    throw;
  }
  event_release(e);
}

// ---- Host memory -----------------------------------------------------------------------------
uintptr_t current_context() {
  Driver& d = driver();
  return reinterpret_cast<uintptr_t>(require_context(d, "host memory"));
}

namespace {

// Runs `fn` with `ctx` current on this thread (a background thread has none of its own).
template <typename Fn>
CUresult with_context(const Driver& d, uintptr_t ctx, Fn fn) {
  CUcontext c = reinterpret_cast<CUcontext>(ctx);
  CUresult r = d.ctx_push(c);
  if (r != CUDA_SUCCESS) return r;
  CUresult out = fn();
  CUcontext popped = nullptr;
  d.ctx_pop(&popped);
  return out;
}

// Runs a host memory call (pin, unpin, pinned alloc or free) with `ctx` current, in the relaxed
// stream-capture mode. Such calls are not stream work and no captured graph depends on them, but
// torch captures in the driver's global mode, where one made by *any* thread fails and
// invalidates the capture in progress: measured on an H200, a thread pinning and dropping 256 MiB
// blocks broke 229 of 1009 captures on another thread, and the process's later CUDA calls then
// failed with "resource already mapped". The arena never pins or unpins on the capturing thread
// itself; this covers a pinner worker and whichever thread drops a block.
template <typename Fn>
CUresult host_memory_call(const Driver& d, uintptr_t ctx, Fn fn) {
  int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  const bool exchanged = d.exchange_capture_mode && d.exchange_capture_mode(&mode) == CUDA_SUCCESS;
  CUresult r = with_context(d, ctx, fn);
  if (exchanged) d.exchange_capture_mode(&mode);  // the thread's own mode back
  return r;
}

}  // namespace

void* host_alloc(size_t nbytes, uintptr_t ctx) {
  Driver& d = driver();
  if (!d.loaded) throw std::runtime_error("offload host_alloc: the CUDA driver is unavailable (" + d.reason + ")");
  void* p = nullptr;
  CUresult r = host_memory_call(d, ctx, [&] { return d.mem_host_alloc(&p, nbytes, CU_MEMHOSTALLOC_PORTABLE); });
  if (r != CUDA_SUCCESS) fail(d, "cuMemHostAlloc", r, " of " + std::to_string(nbytes) + " bytes");
  return p;
}

void host_free(void* p, uintptr_t ctx) noexcept {
  Driver& d = driver();
  if (!d.loaded) return;
  // At interpreter exit the context may be gone already; the process is ending, nothing leaks.
  host_memory_call(d, ctx, [&] { return d.mem_free_host(p); });
}

void host_register(void* p, size_t nbytes, uintptr_t ctx) {
  Driver& d = driver();
  if (!d.loaded) throw std::runtime_error("offload host_register: the CUDA driver is unavailable (" + d.reason + ")");
  CUresult r = host_memory_call(d, ctx, [&] { return d.mem_host_register(p, nbytes, CU_MEMHOSTREGISTER_PORTABLE); });
  if (r != CUDA_SUCCESS) fail(d, "cuMemHostRegister", r, " of " + std::to_string(nbytes) + " bytes");
}

void host_unregister(void* p, uintptr_t ctx) noexcept {
  Driver& d = driver();
  if (!d.loaded) return;
  host_memory_call(d, ctx, [&] { return d.mem_host_unregister(p); });
}

std::string pci_bus_id(int ordinal) {
  Driver& d = driver();
  if (!d.loaded) throw std::runtime_error("offload pci_bus_id: the CUDA driver is unavailable (" + d.reason + ")");
  if (!d.device_get || !d.device_pci_bus_id)
    throw std::runtime_error("offload pci_bus_id: cuDeviceGet or cuDeviceGetPCIBusId not found in libcuda.so.1");
  int device = 0;
  CUresult r = d.device_get(&device, ordinal);
  if (r != CUDA_SUCCESS) fail(d, "cuDeviceGet", r, " for device " + std::to_string(ordinal));
  char buf[64] = {};
  r = d.device_pci_bus_id(buf, sizeof buf, device);
  if (r != CUDA_SUCCESS) fail(d, "cuDeviceGetPCIBusId", r, " for device " + std::to_string(ordinal));
  return buf;
}

}  // namespace offload

// offload._C: layout planning, batched copy submission, pooled events, pinned host buffers.
//
// Built with g++ and pybind11 only (no torch or CUDA headers), so one build works with any torch
// version. The Python face is offload/native.py, which also holds the pure-Python fallback.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "host_memory.h"

namespace py = pybind11;

namespace {

// Same contract as offload.layout.plan_layout_py (the reference): each entry starts on an
// `alignment`-byte boundary, zero-size entries get the current aligned position and no space,
// the total is rounded up to the alignment. Errors carry the reference's exact messages.
py::tuple plan_layout(const std::vector<int64_t>& sizes, int64_t alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0)
    throw std::invalid_argument("alignment must be a positive power of two, got " +
                                std::to_string(alignment));
  const int64_t mask = alignment - 1;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> offsets;
  offsets.reserve(sizes.size());
  int64_t cursor = 0;  // always a multiple of alignment
  for (int64_t size : sizes) {
    if (size < 0)
      throw std::invalid_argument("entry sizes must be >= 0, got " + std::to_string(size));
    offsets.push_back(cursor);
    // Python ints do not overflow; int64 does. No real group comes near 2**63 bytes, but a wrong
    // total must never be returned silently.
    if (size > kMax - cursor - mask)
      throw std::overflow_error("layout total exceeds 2**63 - 1 bytes");
    cursor = (cursor + size + mask) & ~mask;
  }
  return py::make_tuple(py::cast(offsets), cursor);
}

// Checks every entry before anything is copied: a bad list must leave every destination intact.
// Fills the compacted (non-zero-size) arrays the copy loops use.
void validate(const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
              const std::vector<int64_t>& sizes, std::vector<uint64_t>& d_out,
              std::vector<uint64_t>& s_out, std::vector<size_t>& n_out,
              std::vector<size_t>& idx_out) {
  if (dsts.size() != srcs.size() || dsts.size() != sizes.size())
    throw std::invalid_argument(
        "copy_batch: dst_ptrs, src_ptrs and sizes must have the same length, got " +
        std::to_string(dsts.size()) + ", " + std::to_string(srcs.size()) + " and " +
        std::to_string(sizes.size()));
  d_out.reserve(dsts.size());
  s_out.reserve(dsts.size());
  n_out.reserve(dsts.size());
  idx_out.reserve(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (sizes[i] < 0)
      throw std::invalid_argument("copy_batch: sizes[" + std::to_string(i) +
                                  "] must be >= 0, got " + std::to_string(sizes[i]));
    if (sizes[i] == 0) continue;  // nothing to move; its pointers may be anything, even 0
    if (dsts[i] == 0 || srcs[i] == 0)
      throw std::invalid_argument("copy_batch: entry " + std::to_string(i) +
                                  " has a null pointer and size " + std::to_string(sizes[i]));
    d_out.push_back(dsts[i]);
    s_out.push_back(srcs[i]);
    n_out.push_back(static_cast<size_t>(sizes[i]));
    idx_out.push_back(i);
  }
}

void copy_batch(const std::vector<uint64_t>& dst_ptrs, const std::vector<uint64_t>& src_ptrs,
                const std::vector<int64_t>& sizes, std::optional<uint64_t> stream,
                bool force_loop) {
  std::vector<uint64_t> d, s;
  std::vector<size_t> n, idx;
  validate(dst_ptrs, src_ptrs, sizes, d, s, n, idx);
  // Copies (and driver submissions, which can block when the launch queue is full) never need
  // Python objects: let other Python threads run meanwhile.
  py::gil_scoped_release release;
  if (!stream.has_value()) {
    for (size_t i = 0; i < d.size(); ++i)
      std::memcpy(reinterpret_cast<void*>(d[i]), reinterpret_cast<const void*>(s[i]), n[i]);
    return;
  }
  offload::cuda_copy(d.data(), s.data(), n.data(), idx.data(), d.size(),
                     static_cast<uintptr_t>(*stream), force_loop);
}

// A pooled CUDA event owned by Python: given back to the pool when the last reference goes.
class Event {
 public:
  explicit Event(offload::PooledEvent e) : e_(e) {}
  ~Event() { offload::event_release(e_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  uintptr_t handle() const { return e_.handle; }
  bool timing() const { return e_.timing; }

 private:
  offload::PooledEvent e_;
};

std::unique_ptr<Event> record_event(uint64_t stream, bool timing) {
  offload::PooledEvent e = offload::event_acquire(timing);
  auto out = std::make_unique<Event>(e);  // owns it from here, so a failed record gives it back
  offload::event_record(e.handle, stream);
  return out;
}

// One group's copy, submitted in one call: `copy_stream` waits for `after_stream` (the producer
// of the sources, or the allocating stream of the destination) and for `after_event` (a region's
// previous reader), then the copies are queued and an event is recorded after them. With
// `timing`, a timing event before the copies too. Returns (start or None, done).
py::tuple submit_copies(const std::vector<uint64_t>& dst_ptrs, const std::vector<uint64_t>& src_ptrs,
                        const std::vector<int64_t>& sizes, uint64_t copy_stream,
                        uint64_t after_stream, const Event* after_event, bool timing) {
  std::vector<uint64_t> d, s;
  std::vector<size_t> n, idx;
  validate(dst_ptrs, src_ptrs, sizes, d, s, n, idx);
  const uintptr_t wait_on = after_event ? after_event->handle() : 0;
  offload::PooledEvent start{}, done{};
  {
    py::gil_scoped_release release;
    offload::stream_wait_stream(copy_stream, after_stream);
    if (wait_on) offload::stream_wait_event(copy_stream, wait_on);
    if (timing) {
      start = offload::event_acquire(true);
      offload::event_record(start.handle, copy_stream);
    }
    try {
      offload::cuda_copy(d.data(), s.data(), n.data(), idx.data(), d.size(), copy_stream, false);
      done = offload::event_acquire(timing);
      offload::event_record(done.handle, copy_stream);
    } catch (...) {
      if (start.handle) offload::event_release(start);
      if (done.handle) offload::event_release(done);
      throw;
    }
  }
  py::object start_obj = timing ? py::cast(std::make_unique<Event>(start)) : py::none();
  return py::make_tuple(start_obj, py::cast(std::make_unique<Event>(done)));
}

py::dict cuda_copy_info() {
  offload::CudaCopyInfo info;
  {
    py::gil_scoped_release release;  // first call dlopens the driver
    info = offload::cuda_copy_info();
  }
  py::dict out;
  out["path"] = info.path;
  out["reason"] = info.reason;
  out["driver_version"] = info.driver_version;
  out["batch_abi"] = info.batch_abi ? py::object(py::int_(info.batch_abi)) : py::object(py::none());
  out["batch_calls"] = info.batch_calls;
  out["loop_calls"] = info.loop_calls;
  out["batch_fallbacks"] = info.batch_fallbacks;
  out["capture_loop_calls"] = info.capture_loop_calls;
  out["legacy_stream_loop_calls"] = info.legacy_stream_loop_calls;
  out["last_batch_error"] = info.last_batch_error;
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload native extension: layout planning and batched copy submission "
            "(CUDA driver API loaded at run time).";

  m.def("plan_layout", &plan_layout, py::arg("sizes"), py::arg("alignment") = 256,
        "plan_layout(sizes, alignment=256) -> (offsets, total)\n\n"
        "Byte offset of each entry in a group region, every entry on an `alignment` boundary,\n"
        "and the total rounded up to the alignment. Identical to offload.layout.plan_layout_py,\n"
        "errors included (ValueError for a negative size or a bad alignment).");

  m.def("copy_batch", &copy_batch, py::arg("dst_ptrs"), py::arg("src_ptrs"), py::arg("sizes"),
        py::arg("stream").none(true), py::arg("force_loop") = false,
        "copy_batch(dst_ptrs, src_ptrs, sizes, stream, force_loop=False) -> None\n\n"
        "Copy sizes[i] bytes from src_ptrs[i] to dst_ptrs[i]. stream=None: host-to-host memcpy,\n"
        "done when this returns. Otherwise `stream` is a CUstream handle (torch.cuda.Stream\n"
        ".cuda_stream) and the copies are submitted asynchronously on it: one cuMemcpyBatchAsync\n"
        "where available, else (or with force_loop=True) a loop of cuMemcpyAsync. Zero-size\n"
        "entries are skipped. ValueError for mismatched lengths, negative sizes or null pointers,\n"
        "raised before anything is copied; RuntimeError naming the CUDA error for driver errors.");

  py::class_<Event>(m, "Event",
                    "A CUDA event from the extension's pool (see record_event). Duck-types the\n"
                    "parts of torch.cuda.Event the engine uses: query, synchronize, elapsed_time.")
      .def("query", [](const Event& e) { return offload::event_query(e.handle()); },
           "Whether the work recorded before the event has completed (never blocks).")
      .def("synchronize",
           [](const Event& e) {
             py::gil_scoped_release release;
             offload::event_synchronize(e.handle());
           },
           "Block the host until the event has completed (GIL released).")
      .def("elapsed_time",
           [](const Event& a, const Event& b) {
             if (!a.timing() || !b.timing())
               throw std::invalid_argument("elapsed_time needs two timing events (record_event(..., timing=True))");
             return offload::event_elapsed_ms(a.handle(), b.handle());
           },
           py::arg("end"), "Milliseconds from this event to `end` (both timing events, completed).")
      .def("wait", [](const Event& e, uint64_t stream) { offload::stream_wait_event(stream, e.handle()); },
           py::arg("stream"), "Make `stream` (a CUstream handle) wait for the event on the GPU.")
      .def_property_readonly("handle", &Event::handle)
      .def_property_readonly("timing", &Event::timing);

  m.def("record_event", &record_event, py::arg("stream"), py::arg("timing") = false,
        "record_event(stream, timing=False) -> Event: a pooled event recorded on `stream`.");
  m.def("stream_wait_stream", &offload::stream_wait_stream, py::arg("waiter"), py::arg("producer"),
        "stream_wait_stream(waiter, producer): `waiter` waits for all work queued on `producer`.");
  m.def("submit_copies", &submit_copies, py::arg("dst_ptrs"), py::arg("src_ptrs"), py::arg("sizes"),
        py::arg("copy_stream"), py::arg("after_stream"), py::arg("after_event").none(true),
        py::arg("timing") = false,
        "submit_copies(dsts, srcs, sizes, copy_stream, after_stream, after_event, timing=False)\n"
        "-> (start Event or None, done Event)\n\n"
        "One group's copy in one call: copy_stream waits for after_stream and after_event (None:\n"
        "none), the copies are submitted as by copy_batch, and an event is recorded after them.");

  py::class_<offload::PinnedHostBuffer>(m, "PinnedBuffer", py::buffer_protocol(),
                                        "Pinned host memory owned by this object (unpinned and "
                                        "freed when it goes). Exposes the buffer protocol: wrap it "
                                        "with torch.frombuffer(buf, dtype=torch.uint8).")
      .def(py::init([](size_t nbytes, const std::string& method, uint64_t context, int touch_threads,
                       int numa_node, bool lock_now) {
             const offload::PinMethod m = offload::parse_pin_method(method);
             py::gil_scoped_release release;  // pinning takes milliseconds per 100 MB
             // Plain mapped memory needs no CUDA context (and works on a machine without one); a
             // buffer locked later takes the context current where it is locked.
             const uintptr_t ctx = m == offload::PinMethod::kMapped || (!lock_now && m != offload::PinMethod::kHostAlloc)
                                       ? context
                                       : (context ? context : offload::current_context());
             return std::make_unique<offload::PinnedHostBuffer>(nbytes, m, ctx, touch_threads, numa_node,
                                                                lock_now);
           }),
           py::arg("nbytes"), py::arg("method") = "register_huge", py::arg("context") = 0,
           py::arg("touch_threads") = 0, py::arg("numa_node") = -1, py::arg("lock_now") = true,
           "PinnedBuffer(nbytes, method='register_huge', context=0, touch_threads=0, numa_node=-1,\n"
           "             lock_now=True)\n\n"
           "method: 'host_alloc', 'register', 'register_huge' (pinned; need a CUDA context) or\n"
           "'mapped' (plain host memory, no CUDA). numa_node >= 0 places the pages on that node\n"
           "(mbind before first touch); if the kernel refuses, the buffer is allocated anyway and\n"
           "numa_node reads -1, numa_error why. lock_now=False ('register', 'register_huge'):\n"
           "the pages are faulted in now and locked by lock_pages() (no driver call before it).")
      .def("lock_pages",
           [](offload::PinnedHostBuffer& b) {
             py::gil_scoped_release release;  // cuMemHostRegister walks the pages
             b.lock_pages();
           },
           "lock_pages(): lock (register) a buffer made with lock_now=False; a no-op once locked.\n"
           "RuntimeError when the host refuses: the pages are released then, and the buffer is empty.")
      .def_property_readonly("locked", &offload::PinnedHostBuffer::locked)
      .def_buffer([](offload::PinnedHostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      })
      .def_property_readonly("ptr", [](const offload::PinnedHostBuffer& b) {
        return reinterpret_cast<uintptr_t>(b.data());
      })
      .def_property_readonly("nbytes", &offload::PinnedHostBuffer::size)
      .def_property_readonly("pinned_bytes", &offload::PinnedHostBuffer::pinned_bytes)
      .def_property_readonly("numa_node", &offload::PinnedHostBuffer::numa_node)
      .def_property_readonly("numa_error", &offload::PinnedHostBuffer::numa_error)
      .def_property_readonly("method", [](const offload::PinnedHostBuffer& b) {
        return std::string(offload::pin_method_name(b.method()));
      });

  m.def("node_of_address", [](uint64_t ptr) { return offload::node_of_address(reinterpret_cast<const void*>(ptr)); },
        py::arg("ptr"),
        "node_of_address(ptr) -> int: the NUMA node holding the (touched) page at ptr, -1 if\n"
        "the kernel will not say (get_mempolicy with MPOL_F_NODE | MPOL_F_ADDR).");

  m.def("pci_bus_id",
        [](int ordinal) {
          py::gil_scoped_release release;  // first call dlopens the driver
          return offload::pci_bus_id(ordinal);
        },
        py::arg("ordinal"),
        "pci_bus_id(ordinal) -> str: 'domain:bus:device.function' of CUDA device `ordinal`\n"
        "(cuDeviceGetPCIBusId). RuntimeError without a driver or an initialised CUDA.");

  m.def("cuda_copy_path",
        []() -> std::string {
          py::gil_scoped_release release;  // first call dlopens the driver
          return offload::cuda_copy_info().path;
        },
        "cuda_copy_path() -> str: 'batch', 'loop' or 'unavailable' (see cuda_copy_info()).");

  m.def("cuda_copy_info", &cuda_copy_info,
        "cuda_copy_info() -> dict: live path, the reason, driver version, the ABI\n"
        "cuMemcpyBatchAsync is bound with, and counters of how calls were submitted.");
}

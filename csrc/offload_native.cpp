// offload._C: layout planning and batched copy submission.
//
// Built with g++ and pybind11 only (no torch or CUDA headers), so one build works with any torch
// version. The Python face is offload/native.py, which also holds the pure-Python fallback.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_driver.h"

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

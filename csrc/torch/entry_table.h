// offload._entries: a group's per-tensor bookkeeping against torch's C++ API (the EntryTable).
//
// The same contract as offload/engine/entry_table.py (the reference, used where this extension
// is not built): record each saved tensor (its storage slot, byte offset, dtype, shape, stride,
// lazy conj/neg bits, version at pack, and an alias the group owns), give the slot spans to the
// layout and the copy, empty the aliases at release keeping their version counters, and hand
// each entry back as the original or as a typed view of the reload buffer.
//
// Why C++: these run once per saved tensor (pack, release, unpack), and in Python each is a dozen
// interpreted steps and a few tensor objects built and dropped; here they are direct calls on
// TensorImpl. A header because two translation units use the class: the module's bindings
// (entry_table.cpp) and the native saved-tensor hooks (saved_hooks.cpp), which call it directly.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace offload_entries {

constexpr int64_t kConjBit = 1;
constexpr int64_t kNegBit = 2;

struct Entry {
  int64_t slot;
  int64_t byte_offset;  // of the tensor's first element in its storage
  at::ScalarType dtype;
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t lazy;      // kConjBit | kNegBit, as the tensor carried them
  int64_t version;   // the version counter at pack
  int64_t element_offset = 0;  // in the region, in elements of dtype (set by close)
  // The tensor's version counter itself (shared with its alias), where the table retains: the
  // in-place check at unpack reads it here, in the entries' contiguous array, rather than
  // through the alias's TensorImpl, one cold cache line fewer per tensor in backward.
  c10::VariableVersion counter;
};

// Bytes from the first to one past the last element `t` addresses in its storage.
inline int64_t extent_bytes(const at::Tensor& t) {
  const int64_t itemsize = static_cast<int64_t>(t.element_size());
  if (t.is_contiguous()) return t.numel() * itemsize;
  int64_t span = 1;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    span += (sizes[d] - 1) * strides[d];
  }
  return span * itemsize;
}

// Slot numbers by storage address: open addressing over one power-of-two array of cells, linear
// probing. Why not std::unordered_map: its lookup walks heap-allocated nodes scattered among the
// step's tensors, two or three cache misses a saved tensor (two thirds of add()'s own time on
// our CPU box); these cells are one contiguous array, a few KiB for a layer's group.
class SlotIndex {
 public:
  // The slot of `ptr`, or -1.
  int64_t find(const void* ptr) const {
    if (cells_.empty()) return -1;
    for (size_t i = home(ptr);; i = (i + 1) & mask()) {
      const Cell& c = cells_[i];
      if (c.slot < 0) return -1;
      if (c.ptr == ptr) return c.slot;
    }
  }

  // Record `ptr` (not present) as `slot`.
  void insert(const void* ptr, int64_t slot) {
    if (2 * (count_ + 1) > cells_.size()) grow();
    place(ptr, slot);
    ++count_;
  }

  void clear() {
    cells_.clear();
    cells_.shrink_to_fit();
    count_ = 0;
  }

 private:
  struct Cell {
    const void* ptr = nullptr;  // may be nullptr itself (empty storages): `slot` tells a used cell
    int64_t slot = -1;
  };

  size_t mask() const { return cells_.size() - 1; }

  size_t home(const void* ptr) const {
    // Fibonacci hashing of the address (allocations are aligned: the low bits carry nothing).
    const uint64_t h = (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)) >> 4) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 32) & mask();
  }

  void place(const void* ptr, int64_t slot) {
    size_t i = home(ptr);
    while (cells_[i].slot >= 0) i = (i + 1) & mask();
    cells_[i] = Cell{ptr, slot};
  }

  void grow() {
    std::vector<Cell> old = std::move(cells_);
    cells_.assign(old.empty() ? 64 : 2 * old.size(), Cell{});
    for (const Cell& c : old)
      if (c.slot >= 0) place(c.ptr, c.slot);
  }

  std::vector<Cell> cells_;
  size_t count_ = 0;
};

class EntryTable {
 public:
  EntryTable(bool retain, int64_t alignment) : retain_(retain), align_mask_(~(alignment - 1)) {
    if (alignment <= 0 || (alignment & (alignment - 1)) != 0)
      throw std::invalid_argument("alignment must be a positive power of two, got " +
                                  std::to_string(alignment));
  }

  // Record `t`; returns its entry index. Views of one storage share one slot, keyed by the data
  // pointer: the table holds the storage while the key is in use, so no other live storage can
  // have that address.
  int64_t add(const at::Tensor& t) {
    if (closed_) throw std::runtime_error("offload: add() on a closed entry table");
    const c10::Storage& storage = t.storage();
    const void* ptr = storage.data();
    const int64_t itemsize = static_cast<int64_t>(t.element_size());
    const int64_t lo = t.storage_offset() * itemsize;
    const int64_t hi = lo + extent_bytes(t);
    const int64_t aligned_lo = lo & align_mask_;
    int64_t slot = slot_of_ptr_.find(ptr);
    if (slot < 0) {
      slot = static_cast<int64_t>(slot_lo_.size());
      slot_of_ptr_.insert(ptr, slot);
      slot_storages_.push_back(retain_ ? storage : c10::Storage());
      slot_lo_.push_back(aligned_lo);
      slot_hi_.push_back(hi);
    } else {
      if (aligned_lo < slot_lo_[slot]) slot_lo_[slot] = aligned_lo;
      if (hi > slot_hi_[slot]) slot_hi_[slot] = hi;
    }
    Entry entry{slot, lo, t.scalar_type(), {}, {}, 0, t._version()};
    if (retain_) entry.counter = t.unsafeGetTensorImpl()->version_counter();
    entry.sizes.assign(t.sizes().begin(), t.sizes().end());
    entry.strides.assign(t.strides().begin(), t.strides().end());
    entry.lazy = (t.is_conj() ? kConjBit : 0) | (t.is_neg() ? kNegBit : 0);
    entries_.push_back(std::move(entry));
    if (retain_) {
      // What torch.Tensor._make_subclass(torch.Tensor, t) makes: same storage and version
      // counter, no autograd history, and free to change its storage later (release needs it).
      // Never `t` itself: a node's output held here would close a reference cycle through the
      // graph (see offload/engine/packing.py). A shallow copy of the TensorImpl, not detach():
      // detach() is a dispatched view op that also records the view's autograd metadata, which
      // nothing here reads.
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      aliases_.emplace_back(impl->shallow_copy_and_detach(impl->version_counter(),
                                                          /*allow_tensor_metadata_change=*/true));
    }
    return static_cast<int64_t>(entries_.size()) - 1;
  }

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  int64_t slot_count() const { return static_cast<int64_t>(slot_lo_.size()); }
  int64_t slot_of(int64_t index) const { return at(index).slot; }
  bool holds_originals() const { return holds_; }

  std::vector<int64_t> slot_sizes() const {
    std::vector<int64_t> out(slot_lo_.size());
    for (size_t s = 0; s < out.size(); ++s) out[s] = slot_hi_[s] - slot_lo_[s];
    return out;
  }

  // Freeze the table with the slots' planned offsets in the region (offload.host.native's
  // plan_layout, the one layout function): every entry's element offset follows.
  void close(const std::vector<int64_t>& offsets) {
    if (offsets.size() != slot_lo_.size())
      throw std::invalid_argument("close: one offset per slot expected, got " +
                                  std::to_string(offsets.size()) + " for " +
                                  std::to_string(slot_lo_.size()) + " slots");
    for (Entry& e : entries_) {
      const int64_t bytes = offsets[e.slot] + e.byte_offset - slot_lo_[e.slot];
      e.element_offset = bytes / static_cast<int64_t>(c10::elementSize(e.dtype));
    }
    offsets_ = offsets;
    slot_of_ptr_.clear();
    closed_ = true;
  }

  // (dsts, srcs, sizes) of the offload copy: each slot's span to its offset from `base`.
  std::tuple<std::vector<uint64_t>, std::vector<uint64_t>, std::vector<int64_t>> copy_lists(
      uint64_t base) const {
    check_storages("copy_lists");
    const size_t n = slot_lo_.size();
    std::vector<uint64_t> dsts(n), srcs(n);
    for (size_t s = 0; s < n; ++s) {
      dsts[s] = base + static_cast<uint64_t>(offsets_[s]);
      srcs[s] = reinterpret_cast<uint64_t>(slot_storages_[s].data()) +
                static_cast<uint64_t>(slot_lo_[s]);
    }
    return {std::move(dsts), std::move(srcs), slot_sizes()};
  }

  // Each slot's span as a uint8 tensor over its storage (the torch copy path).
  std::vector<at::Tensor> slot_byte_views(c10::Device device) const {
    check_storages("slot_byte_views");
    std::vector<at::Tensor> out;
    out.reserve(slot_lo_.size());
    const auto options = at::TensorOptions().dtype(at::kByte).device(device);
    for (size_t s = 0; s < slot_lo_.size(); ++s) {
      at::Tensor view = at::empty({0}, options);
      view.set_(slot_storages_[s], slot_lo_[s], {slot_hi_[s] - slot_lo_[s]}, {1});
      out.push_back(std::move(view));
    }
    return out;
  }

  // Let go of the originals' memory: each alias is emptied in place and kept as its entry's
  // version sentinel (its version counter is the original's, shared).
  //
  // Done on the TensorImpl directly, not through set_(): every alias gets the same empty
  // storage (one per release, on the aliases' device) with sizes {0}. set_() went through the
  // dispatcher, made a new empty storage for each alias and bumped the shared version counter
  // (which then had to be put back). Nothing here touches the version counter, so a change made
  // later through any alias the caller holds still moves it, and unpack still refuses it. In a
  // MOE step on the H100 host (~900 tensors a group) a release took 2.1 us a tensor with set_(),
  // 1.0-1.2 us this way: most of it is now the caching allocator taking the originals back, here
  // (once slot_storages_ lets go too), as before.
  void release() {
    c10::Storage empty;  // made for the first alias's device, again only if one differs
    for (at::Tensor& alias : aliases_) {
      c10::TensorImpl* impl = alias.unsafeGetTensorImpl();
      const c10::Device device = impl->device();
      if (!empty || empty.device() != device)
        empty = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device),
                             /*allocator=*/nullptr, /*resizable=*/false);
      impl->set_storage_keep_dtype(empty);
      impl->set_sizes_contiguous({0});
      impl->set_storage_offset(0);
    }
    slot_storages_.clear();
    holds_ = false;
  }

  // The saved tensor as it was (while the originals are held), or None if it was changed in
  // place since it was saved.
  std::optional<at::Tensor> original(int64_t index) const {
    const Entry& e = at(index);
    if (!holds_) throw std::runtime_error("offload: original() after the originals were released");
    const at::Tensor& alias = aliases_.at(index);
    if (alias._version() != e.version) return std::nullopt;
    return alias;
  }

  // The entry as a typed view of `buffer` (the reload buffer, uint8), with its dtype, shape,
  // stride and lazy bits; None if the tensor was changed in place since it was saved.
  std::optional<at::Tensor> restore(int64_t index, const at::Tensor& buffer) {
    const Entry& e = at(index);
    if (retain_ && e.counter.current_version() != e.version) return std::nullopt;
    // The views are made below autograd's view tracking: recording a base and a view function
    // for each (what the ADInplaceOrView kernels do) is a quarter of this call, and nothing
    // reads it. The buffer has no autograd history, and autograd makes what the unpack hook
    // returns into a fresh saved variable of its own (SavedVariable::unpack), so the view's
    // own autograd metadata is never looked at.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (!typed_buffer_.defined() || !typed_buffer_.is_same(buffer)) {
      typed_buffer_ = buffer;
      typed_.clear();
    }
    at::Tensor* typed = nullptr;
    for (auto& [dtype, view] : typed_) {
      if (dtype == e.dtype) typed = &view;
    }
    if (typed == nullptr) {
      typed_.emplace_back(e.dtype, buffer.view(e.dtype));
      typed = &typed_.back().second;
    }
    at::Tensor view = typed->as_strided(e.sizes, e.strides, e.element_offset);
    if (e.lazy & kConjBit) view = at::conj(view);
    if (e.lazy & kNegBit) view = at::_neg_view(view);
    return view;
  }

  // Forget the reload buffer's typed views (the group dropped the buffer).
  void drop_buffer() {
    typed_.clear();
    typed_buffer_ = at::Tensor();
  }

  // (shape, dtype, version now, version at pack) of an entry: what the in-place error names.
  py::tuple describe(int64_t index) const {
    const Entry& e = at(index);
    const int64_t now = retain_ ? aliases_.at(index)._version() : e.version;
    py::object dtype = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(e.dtype)));
    return py::make_tuple(std::vector<int64_t>(e.sizes.begin(), e.sizes.end()), dtype, now,
                          e.version);
  }

  // (slot, byte offset in its storage, dtype, shape, stride, lazy bits) of an entry.
  py::tuple entry(int64_t index) const {
    const Entry& e = at(index);
    py::object dtype = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(e.dtype)));
    return py::make_tuple(e.slot, e.byte_offset, dtype,
                          std::vector<int64_t>(e.sizes.begin(), e.sizes.end()),
                          std::vector<int64_t>(e.strides.begin(), e.strides.end()), e.lazy);
  }

  std::vector<int64_t> slot_lo() const { return slot_lo_; }
  std::vector<int64_t> slot_hi() const { return slot_hi_; }
  std::vector<int64_t> element_offsets() const {
    std::vector<int64_t> out;
    out.reserve(entries_.size());
    for (const Entry& e : entries_) out.push_back(e.element_offset);
    return out;
  }

 private:
  const Entry& at(int64_t index) const {
    if (index < 0 || index >= static_cast<int64_t>(entries_.size()))
      throw py::index_error("entry index " + std::to_string(index) + " out of range for " +
                            std::to_string(entries_.size()) + " entries");
    return entries_[index];
  }

  void check_storages(const char* what) const {
    if (!retain_ || !holds_ || !closed_)
      throw std::runtime_error(std::string("offload: ") + what +
                               "() needs a closed table that still holds its storages");
  }

  bool retain_;
  int64_t align_mask_;
  bool closed_ = false;
  bool holds_ = true;
  SlotIndex slot_of_ptr_;
  std::vector<c10::Storage> slot_storages_;
  std::vector<int64_t> slot_lo_;
  std::vector<int64_t> slot_hi_;
  std::vector<int64_t> offsets_;
  std::vector<Entry> entries_;
  std::vector<at::Tensor> aliases_;
  at::Tensor typed_buffer_;
  std::vector<std::pair<at::ScalarType, at::Tensor>> typed_;
};

}  // namespace offload_entries

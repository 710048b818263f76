// The engine's saved-tensor hooks as C functions: the common cases of pack and unpack without a
// Python frame, everything else handed to the Python hooks (offload/engine/packing.py).
//
// Why: autograd calls the hooks once per saved tensor, thousands of times a step, and on a
// host-bound model (many small layers) the Python frames of pack and unpack and the dozen
// attribute reads in each are a large part of what offloading adds to the step. Here a pack or
// an unpack that takes the common path is a few attribute reads and direct calls on the
// EntryTable.
//
// The contract (offload/engine/saved_hooks.py gives the Python side): the Python pack and unpack
// stay the definition. A native hook either does exactly what they would do for this input, or
// calls them with the same argument before it has changed anything, so every case it does not
// know (a mark, a subclass, a tensor of another device, an on-demand reload, the last entry of a
// group, an in-place change to report...) is decided by the one Python policy and the one Python
// unpack.
// What the native pack takes on:
// - a parameter, a leaf that requires grad, or a view of one: kept, counted as "parameter";
// - an unmarked plain tensor of the engine's device, strided, over no module's parameter or
//   buffer memory and at least the floor in size: offloaded into the open group after the
//   arena's claim (which is asked through Python: the budget has one definition; once for many
//   small tensors, through a credit the group claims ahead, see claim_host), or kept as
//   "budget" when the claim is refused;
// - such a tensor under the size floor: kept as "small".
// What the native unpack takes on:
// - a kept tensor whose version did not move;
// - an entry of a reloaded group whose H2D the compute stream already waited for, other than
//   the last entry of that reload, in a step whose forward is over.
#include "saved_hooks.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>
#include <string>

#include "entry_table.h"
#include "slot_attr.h"

namespace offload_entries {
namespace {

// The state tuple's items, in the order offload/engine/saved_hooks.py builds it. A tuple, not a
// struct: it is a GC-tracked object, so the cycle engine -> hooks -> state -> Python hooks ->
// engine is one the garbage collector can see and break.
enum Slot : Py_ssize_t {
  kForward = 0,     // the engine's ForwardState
  kPolicy,          // the SelectionPolicy
  kPythonPack,      // the Python pack hook (the definition; called for anything else)
  kPythonUnpack,    // the Python unpack hook
  kParameterType,   // torch.nn.Parameter
  kReloaded,        // GroupState.RELOADED
  kKeepParameter,   // the KEEP_PARAMETER reason (a stats["kept"] key)
  kKeepBudget,      // the KEEP_BUDGET reason
  kKeepSmall,       // the KEEP_SMALL reason
  kMarkNames,       // tuple of the attribute names that mark a tensor (offload.engine.marks)
  kDeviceIndex,     // the policy's device index (fixed when it is made; -1 for the CPU)
  kSlotCount,
};

// The attributes the hooks read and write, each with its slot cache (slot_attr.h), named once
// (see register_saved_hooks).
struct Names {
  Attr open_group;
  Attr layer;
  Attr counters;
  Attr kept;
  Attr module_storages;
  Attr min_offload_bytes;
  Attr reserve_host_bytes;
  Attr saved_bytes;
  Attr table;
  Attr step;
  Attr forward_done;
  Attr index;
  Attr state;
  Attr h2d_waited;
  Attr unpacks;
  Attr unpacks_since_reload;
  Attr gpu;
  Attr largest_small;
  Attr claim_ahead;
  Attr claim_credit;
};
Names names;

// An owned reference, released at scope exit.
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p_); }
  PyObject* get() const { return p_; }
  PyObject* release() {
    PyObject* p = p_;
    p_ = nullptr;
    return p;
  }
  void reset(PyObject* p) {
    Py_XDECREF(p_);
    p_ = p;
  }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_;
};

// A Python error is pending: unwound to the hook's entry, which returns nullptr to autograd.
struct PythonError {};

PyObject* check(PyObject* p) {
  if (p == nullptr) throw PythonError{};
  return p;
}

PyObject* item(PyObject* state, Slot slot) { return PyTuple_GET_ITEM(state, slot); }

PyObject* get(PyObject* obj, Attr& attr) { return check(attr.get(obj)); }

// obj.<attr> = value, a new reference that this takes over.
void set(PyObject* obj, Attr& attr, PyObject* value) {
  Ref owned(value);
  if (attr.set(obj, check(value)) < 0) throw PythonError{};
}

int64_t get_int(PyObject* obj, Attr& attr) {
  Ref value(get(obj, attr));
  const long long n = PyLong_AsLongLong(value.get());
  if (n == -1 && PyErr_Occurred()) throw PythonError{};
  return n;
}

bool truthy(PyObject* value) {
  const int b = PyObject_IsTrue(value);
  if (b < 0) throw PythonError{};
  return b == 1;
}

// Whether `obj` carries any of the mark attributes (whatever their value: the Python policy
// reads the value, so any mark at all sends the tensor there).
bool has_mark(PyObject* obj, PyObject* mark_names) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mark_names); ++i) {
    PyObject* found = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
    const int r = PyObject_GetOptionalAttr(obj, PyTuple_GET_ITEM(mark_names, i), &found);
#else
    const int r = _PyObject_LookupAttr(obj, PyTuple_GET_ITEM(mark_names, i), &found);
#endif
    if (r < 0) throw PythonError{};
    Py_XDECREF(found);
    if (r == 1) return true;
  }
  return false;
}

// group.counters.kept[reason] += 1 (StepCounters.keep).
void count_kept(PyObject* group, PyObject* reason) {
  Ref counters(get(group, names.counters));
  Ref kept(get(counters.get(), names.kept));
  PyObject* old = PyDict_GetItemWithError(kept.get(), reason);  // borrowed
  if (old == nullptr && PyErr_Occurred()) throw PythonError{};
  long long n = 1;
  if (old != nullptr) {
    n = PyLong_AsLongLong(old) + 1;
    if (n == 0 && PyErr_Occurred()) throw PythonError{};
  }
  Ref count(check(PyLong_FromLongLong(n)));
  if (PyDict_SetItem(kept.get(), reason, count.get()) < 0) throw PythonError{};
}

// A handle for autograd, untracked by the cyclic garbage collector. Only autograd's C++ holds
// a handle (an edge the collector cannot see), so to the collector it is a root whatever it
// holds, tracked or not; tracked, every young-generation collection (which the step's own
// allocations set off, every 700 of them) traverses a few thousand of them a step. What it
// holds stays tracked on its own.
PyObject* handle(PyObject* tuple) {
  PyObject_GC_UnTrack(check(tuple));
  return tuple;
}

// The kept handle (tensor, version at pack, group.layer) of packing.keep_handle.
PyObject* kept_handle(PyObject* tensor, const at::Tensor& t, PyObject* group) {
  Ref version(check(PyLong_FromLongLong(t._version())));
  Ref layer(get(group, names.layer));
  return handle(PyTuple_Pack(3, tensor, version.get(), layer.get()));
}

// A kept activation's handle, counted under `reason`: detached when it has a node, as
// packing.keep_handle does (it may be that node's own output: the cycle reason in packing.py).
// Only plain tensors reach here (subclasses and parameters are decided before).
PyObject* keep_activation(PyObject* obj, const at::Tensor& t, PyObject* group, PyObject* reason) {
  count_kept(group, reason);
  if (t.requires_grad() && !t.is_leaf()) {
    Ref detached(check(THPVariable_Wrap(t.detach())));
    return kept_handle(detached.get(), t, group);
  }
  return kept_handle(obj, t, group);
}

// The bound EntryTable type (set by register_saved_hooks, after the class is bound).
PyTypeObject* entry_table_type = nullptr;

// The EntryTable behind `table`, or nullptr if it is not one (the Python reference table). Read
// off pybind11's instance directly: py::isinstance and cast look the type up in pybind11's
// registry (a hash lookup or two each), twice per saved tensor.
EntryTable* native_table(PyObject* table) {
  if (Py_TYPE(table) != entry_table_type) return nullptr;
  auto* inst = reinterpret_cast<py::detail::instance*>(table);
  return static_cast<EntryTable*>(inst->get_value_and_holder().value_ptr());
}

// The credit the native pack claims ahead of a group's next tensors (see claim_host).
constexpr int64_t kClaimAheadBytes = 1 << 20;

// The host budget's answer for `nbytes` more (`size`, the same as a Python int) in `group`.
// With the policy's claim_ahead (HostArena.claim_ahead), a group claims a credit ahead of its
// next tensors and spends it here, so that a layer of many small tensors calls Python once per
// kClaimAheadBytes instead of once per tensor. A tensor is refused exactly when claiming it
// alone would be: what the credit lacks is what is asked, and the credit only ever holds bytes
// that fit (claim_ahead adds no more). The group gives back its credit with its claim
// (Group.take_claim). Without claim_ahead, reserve_host_bytes is asked per tensor.
bool claim_host(PyObject* policy, PyObject* group, int64_t nbytes, PyObject* size) {
  Ref ahead_fn(get(policy, names.claim_ahead));
  if (ahead_fn.get() == Py_None) {
    Ref reserve(get(policy, names.reserve_host_bytes));
    Ref granted(check(PyObject_CallOneArg(reserve.get(), size)));
    return truthy(granted.get());
  }
  const int64_t credit = get_int(group, names.claim_credit);
  if (credit >= nbytes) {
    set(group, names.claim_credit, PyLong_FromLongLong(credit - nbytes));
    return true;
  }
  Ref lacking(check(PyLong_FromLongLong(nbytes - credit)));
  Ref ahead(check(PyLong_FromLongLong(kClaimAheadBytes)));
  PyObject* args[2] = {lacking.get(), ahead.get()};
  Ref promised_obj(check(PyObject_Vectorcall(ahead_fn.get(), args, 2, nullptr)));
  const long long promised = PyLong_AsLongLong(promised_obj.get());
  if (promised == -1 && PyErr_Occurred()) throw PythonError{};
  if (promised <= 0) return false;  // refused: the credit stays the group's, claimed as it was
  set(group, names.claim_credit, PyLong_FromLongLong(credit + promised - nbytes));
  return true;
}

PyObject* call_python(PyObject* state, Slot hook, PyObject* arg) {
  return PyObject_CallOneArg(item(state, hook), arg);
}

// What the hook returns, or nullptr to hand the argument to the Python hook.
PyObject* pack_common(PyObject* state, PyObject* obj) {
  Ref group(get(item(state, kForward), names.open_group));
  if (group.get() == Py_None || !THPVariable_Check(obj)) return nullptr;
  const bool parameter_type = Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(item(state, kParameterType));
  if (!parameter_type && !THPVariable_CheckExact(obj)) return nullptr;  // other subclasses
  const at::Tensor& t = THPVariable_Unpack(obj);

  // SelectionPolicy.decide's parameter rules, in its order.
  bool parameter = parameter_type || (t.requires_grad() && t.is_leaf());
  Ref base;
  if (!parameter && t.is_view()) {
    const at::TensorBase& b = t._base();
    base.reset(check(THPVariable_Wrap(b)));
    parameter = Py_TYPE(base.get()) == reinterpret_cast<PyTypeObject*>(item(state, kParameterType)) ||
                (b.requires_grad() && b.is_leaf());
  }
  if (parameter) {
    count_kept(group.get(), item(state, kKeepParameter));
    return kept_handle(obj, t, group.get());  // a parameter is never detached (packing.pack)
  }
  PyObject* marks = item(state, kMarkNames);
  if (has_mark(obj, marks) || (base && has_mark(base.get(), marks))) return nullptr;

  // No opt-in check: engine_hooks never pushes these hooks for an opt-in (``marked``) policy,
  // where every unmarked activation would go through both paths.
  PyObject* policy = item(state, kPolicy);
  if (t.get_device() != PyLong_AsLongLong(item(state, kDeviceIndex))) return nullptr;
  if (t.is_meta() || t.layout() != c10::kStrided || t.is_nested()) return nullptr;
  {
    Ref storages(get(policy, names.module_storages));
    if (PyAnySet_Check(storages.get()) && PySet_GET_SIZE(storages.get()) > 0) {
      // The address only: data(), not mutable_data(), which would copy a lazily cloned storage.
      Ref ptr(check(PyLong_FromVoidPtr(const_cast<void*>(t.storage().data()))));
      const int hit = PySet_Contains(storages.get(), ptr.get());
      if (hit < 0) throw PythonError{};
      if (hit == 1) return nullptr;
    } else if (!PyAnySet_Check(storages.get())) {
      return nullptr;
    }
  }
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  {
    Ref floor(get(group.get(), names.min_offload_bytes));
    if (floor.get() == Py_None) floor.reset(get(policy, names.min_offload_bytes));
    const long long min_bytes = PyLong_AsLongLong(floor.get());
    if (min_bytes == -1 && PyErr_Occurred()) throw PythonError{};
    if (nbytes == 0 || nbytes < min_bytes) {
      // KEEP_SMALL, and the policy's tally of the largest such tensor (the "nothing offloaded"
      // diagnosis names it). No opted-in exception here: a marked tensor went to Python above.
      Ref largest(get(policy, names.largest_small));
      const long long so_far = PyLong_AsLongLong(largest.get());
      if (so_far == -1 && PyErr_Occurred()) throw PythonError{};
      if (nbytes > so_far) set(policy, names.largest_small, PyLong_FromLongLong(nbytes));
      return keep_activation(obj, t, group.get(), item(state, kKeepSmall));
    }
  }
  Ref table_obj(get(group.get(), names.table));
  EntryTable* table = native_table(table_obj.get());
  if (table == nullptr) return nullptr;

  // From here on the hook acts: the claim is the last question, as in the policy.
  Ref size(check(PyLong_FromLongLong(nbytes)));
  if (!claim_host(policy, group.get(), nbytes, size.get()))
    return keep_activation(obj, t, group.get(), item(state, kKeepBudget));
  {
    Ref saved(get(group.get(), names.saved_bytes));
    set(group.get(), names.saved_bytes, PyNumber_Add(saved.get(), size.get()));
  }
  const int64_t index = table->add(t);
  Ref index_obj(check(PyLong_FromLongLong(index)));
  return handle(PyTuple_Pack(2, group.get(), index_obj.get()));
}

PyObject* unpack_common(PyObject* state, PyObject* packed) {
  if (!PyTuple_CheckExact(packed)) return nullptr;  // a StorageHandle
  const Py_ssize_t n = PyTuple_GET_SIZE(packed);
  if (n == 3) {  // kept: (tensor, version at pack, layer)
    PyObject* obj = PyTuple_GET_ITEM(packed, 0);
    if (!THPVariable_Check(obj)) return nullptr;
    const long long version = PyLong_AsLongLong(PyTuple_GET_ITEM(packed, 1));
    if (version == -1 && PyErr_Occurred()) throw PythonError{};
    if (THPVariable_Unpack(obj)._version() != version) return nullptr;  // Python raises
    Py_INCREF(obj);
    return obj;
  }
  if (n != 2) return nullptr;
  PyObject* group = PyTuple_GET_ITEM(packed, 0);
  {
    // The first unpack of a step whose forward is still open ends that forward (Python).
    Ref step(get(item(state, kForward), names.step));
    if (step.get() != Py_None) {
      Ref done(get(step.get(), names.forward_done));
      if (!truthy(done.get())) {
        Ref group_step(get(group, names.step));
        Ref step_index(get(step.get(), names.index));
        const int same = PyObject_RichCompareBool(group_step.get(), step_index.get(), Py_EQ);
        if (same < 0) throw PythonError{};
        if (same == 1) return nullptr;
      }
    }
  }
  {
    Ref group_state(get(group, names.state));
    if (group_state.get() != item(state, kReloaded)) return nullptr;
  }
  {
    Ref waited(get(group, names.h2d_waited));
    if (!truthy(waited.get())) return nullptr;  // the first unpack waits for the H2D (Python)
  }
  Ref table_obj(get(group, names.table));
  EntryTable* table = native_table(table_obj.get());
  if (table == nullptr) return nullptr;
  const int64_t since = get_int(group, names.unpacks_since_reload);
  if (since + 1 >= table->size()) return nullptr;  // the last entry drops the buffer (Python)
  Ref gpu(get(group, names.gpu));
  if (!THPVariable_Check(gpu.get())) return nullptr;
  const long long index = PyLong_AsLongLong(PyTuple_GET_ITEM(packed, 1));
  if (index == -1 && PyErr_Occurred()) throw PythonError{};
  std::optional<at::Tensor> view = table->restore(index, THPVariable_Unpack(gpu.get()));
  if (!view) return nullptr;  // changed in place: Python raises autograd's error
  Ref result(check(THPVariable_Wrap(*view)));
  const int64_t unpacks = get_int(group, names.unpacks);
  set(group, names.unpacks, PyLong_FromLongLong(unpacks + 1));
  set(group, names.unpacks_since_reload, PyLong_FromLongLong(since + 1));
  return result.release();
}

// The hooks' entries: the common path, or the Python hook; errors become Python exceptions.
template <PyObject* (*Common)(PyObject*, PyObject*), Slot Fallback>
PyObject* hook(PyObject* state, PyObject* arg) {
  try {
    PyObject* out = Common(state, arg);
    return out != nullptr ? out : call_python(state, Fallback, arg);
  } catch (const PythonError&) {
    return nullptr;
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef pack_def = {
    "pack", hook<pack_common, kPythonPack>, METH_O,
    "offload's pack hook: the common cases natively, the rest through the Python pack"};
PyMethodDef unpack_def = {
    "unpack", hook<unpack_common, kPythonUnpack>, METH_O,
    "offload's unpack hook: the common cases natively, the rest through the Python unpack"};

PyObject* intern(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw py::error_already_set();
  return s;
}

}  // namespace

void register_saved_hooks(py::module_& m) {
  names = Names{
      Attr(intern("open_group")),
      Attr(intern("layer")),
      Attr(intern("counters")),
      Attr(intern("kept")),
      Attr(intern("module_storages")),
      Attr(intern("min_offload_bytes")),
      Attr(intern("reserve_host_bytes")),
      Attr(intern("saved_bytes")),
      Attr(intern("table")),
      Attr(intern("step")),
      Attr(intern("forward_done")),
      Attr(intern("index")),
      Attr(intern("state")),
      Attr(intern("h2d_waited")),
      Attr(intern("unpacks")),
      Attr(intern("unpacks_since_reload")),
      Attr(intern("gpu")),
      Attr(intern("largest_small")),
      Attr(intern("claim_ahead")),
      Attr(intern("claim_credit")),
  };
  entry_table_type = reinterpret_cast<PyTypeObject*>(py::type::of<EntryTable>().ptr());
  m.attr("SAVED_HOOKS_STATE_SIZE") = static_cast<int>(kSlotCount);
  m.def(
      "make_saved_hooks",
      [](py::tuple state) {
        if (PyTuple_GET_SIZE(state.ptr()) != kSlotCount)
          throw py::value_error("make_saved_hooks: a state tuple of " + std::to_string(kSlotCount) +
                                " items expected, got " + std::to_string(PyTuple_GET_SIZE(state.ptr())));
        if (!PyType_Check(PyTuple_GET_ITEM(state.ptr(), kParameterType)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(state.ptr(), kMarkNames)) ||
            !PyLong_Check(PyTuple_GET_ITEM(state.ptr(), kDeviceIndex)))
          throw py::type_error("make_saved_hooks: the state's parameter type or mark names are malformed");
        // m_self is the state tuple: each C function holds it, and the GC traverses it.
        py::object pack = py::reinterpret_steal<py::object>(PyCFunction_New(&pack_def, state.ptr()));
        py::object unpack = py::reinterpret_steal<py::object>(PyCFunction_New(&unpack_def, state.ptr()));
        if (!pack || !unpack) throw py::error_already_set();
        return py::make_tuple(pack, unpack);
      },
      py::arg("state"),
      "The (pack, unpack) saved-tensor hooks over a state tuple (offload.engine.saved_hooks).");
}

}  // namespace offload_entries

// An attribute the native saved-tensor hooks read and write on every saved tensor, with an inline
// cache for objects whose class declares it in __slots__ (offload's Group and ForwardState).
//
// Why: PyObject_GetAttr on a slotted object looks the name up in the type's MRO (through the
// method cache) and calls the member descriptor, 20-30 ns a call on our CPU box, and the hooks
// make about ten such calls per saved tensor (MOE: 1799 offloaded tensors a step, each packed and
// unpacked). A __slots__ member is a PyObject* at a fixed offset in the object: once the
// descriptor is found for a type, reading the slot is a load. Everything else (an object of
// another type, a class with its own __getattribute__ or __setattr__, a name that is not a plain
// object slot, an empty slot that must raise AttributeError) takes PyObject_GetAttr /
// PyObject_SetAttr, so behaviour is the generic one's.
//
// Each Attr caches two types (a name such as "step" is read on both ForwardState and Group), keyed
// by the type's version tag, which CPython changes whenever the type or a base is modified (a
// slot replaced by a property, say); it holds a reference to each type it caches. Used with the
// GIL held only (the hooks run under it).
#pragma once

#include <Python.h>
#include <structmember.h>

namespace offload_entries {

class Attr {
 public:
  Attr() = default;
  explicit Attr(PyObject* name) : name_(name) {}

  PyObject* name() const { return name_; }

  // A new reference to obj.<name>, or nullptr with a Python error set.
  PyObject* get(PyObject* obj) {
    const Entry* e = lookup(Py_TYPE(obj));
    if (e != nullptr) {
      PyObject* value = *slot(obj, *e);
      if (value != nullptr) {  // an empty slot raises AttributeError: the generic path says so
        Py_INCREF(value);
        return value;
      }
    }
    return PyObject_GetAttr(obj, name_);
  }

  // obj.<name> = value (a borrowed reference); 0, or -1 with a Python error set.
  int set(PyObject* obj, PyObject* value) {
    const Entry* e = lookup(Py_TYPE(obj));
    if (e == nullptr || !e->writable) return PyObject_SetAttr(obj, name_, value);
    PyObject** at = slot(obj, *e);
    PyObject* old = *at;
    Py_INCREF(value);
    *at = value;
    Py_XDECREF(old);  // last: it may run arbitrary code (as the member descriptor's set does)
    return 0;
  }

 private:
  struct Entry {
    PyTypeObject* type = nullptr;
    unsigned int version = 0;
    Py_ssize_t offset = 0;  // 0: not a plain object slot of that type (the generic path)
    bool writable = false;
  };

  static PyObject** slot(PyObject* obj, const Entry& e) {
    return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + e.offset);
  }

  // The cached slot of `type`, or nullptr for the generic path.
  const Entry* lookup(PyTypeObject* type) {
    for (const Entry& e : cache_) {
      if (e.type == type && e.version != 0 && e.version == type->tp_version_tag)
        return e.offset > 0 ? &e : nullptr;
    }
    Entry learned = learn(type);
    if (learned.version == 0) return nullptr;  // no valid version tag: nothing cached
    Entry& victim = cache_[next_];
    next_ = 1 - next_;
    Py_INCREF(reinterpret_cast<PyObject*>(type));
    Py_XDECREF(reinterpret_cast<PyObject*>(victim.type));
    victim = learned;
    return victim.offset > 0 ? &victim : nullptr;
  }

  Entry learn(PyTypeObject* type) const {
    Entry e;
    e.type = type;
    // _PyType_Lookup gives the type a valid version tag where it can (a borrowed result).
    PyObject* descr = _PyType_Lookup(type, name_);
    e.version = PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG) ? type->tp_version_tag : 0;
    if (descr == nullptr || Py_TYPE(descr) != &PyMemberDescr_Type) return e;
    if (type->tp_getattro != PyObject_GenericGetAttr) return e;
    const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
    if (member->type != T_OBJECT_EX || member->offset <= 0) return e;
    e.offset = member->offset;
    e.writable = !(member->flags & READONLY) && type->tp_setattro == PyObject_GenericSetAttr;
    return e;
  }

  PyObject* name_ = nullptr;
  Entry cache_[2];
  int next_ = 0;
};

}  // namespace offload_entries

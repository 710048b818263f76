// offload._entries: the module. Binds the EntryTable (entry_table.h) and the native
// saved-tensor hooks (saved_hooks.cpp).
//
// Built only when torch's headers are present at build time (setup.py), against that exact
// torch: offload/host/native.py checks the version before using it.
#include "entry_table.h"
#include "saved_hooks.h"

using offload_entries::EntryTable;


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offload's per-tensor group bookkeeping against torch's C++ API";
  // The torch this was compiled against; offload.host.native refuses any other.
  m.attr("TORCH_VERSION") = OFFLOAD_TORCH_VERSION;
  py::class_<EntryTable>(m, "EntryTable")
      .def(py::init<bool, int64_t>(), py::arg("retain"), py::arg("alignment"))
      .def("add", &EntryTable::add)
      .def("__len__", &EntryTable::size)
      .def("slot_count", &EntryTable::slot_count)
      .def("slot_of", &EntryTable::slot_of)
      .def("slot_sizes", &EntryTable::slot_sizes)
      .def("close", &EntryTable::close)
      .def("copy_lists", &EntryTable::copy_lists)
      .def("slot_byte_views", &EntryTable::slot_byte_views)
      .def("release", &EntryTable::release)
      .def("original", &EntryTable::original)
      .def("restore", &EntryTable::restore)
      .def("drop_buffer", &EntryTable::drop_buffer)
      .def("describe", &EntryTable::describe)
      .def("entry", &EntryTable::entry)
      .def_property_readonly("holds_originals", &EntryTable::holds_originals)
      .def_property_readonly("slot_lo", &EntryTable::slot_lo)
      .def_property_readonly("slot_hi", &EntryTable::slot_hi)
      .def_property_readonly("element_offsets", &EntryTable::element_offsets);
  offload_entries::register_saved_hooks(m);
}

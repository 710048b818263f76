// The native saved-tensor hooks of offload._entries (saved_hooks.cpp).
#pragma once

#include <torch/extension.h>

namespace offload_entries {

// Adds make_saved_hooks(state) to the module: see saved_hooks.cpp.
void register_saved_hooks(pybind11::module_& m);

}  // namespace offload_entries

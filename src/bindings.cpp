// The Python module functions._C_<capability> (see setup.py). Importing it registers the CPU
// kernels as the CPU implementations of the torch.ops.syncbn operators (declared in
// functions/ops.py); the module itself only says which instruction set it was built for.
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu/batch_norm_cpu.h"

SYNCBN_REGISTER_KERNELS(CPU, syncbn::cpu)

namespace syncbn {
void bind_sync_batch_norm(pybind11::module_& m);  // src/sync_batch_norm.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CPU kernels of the synchronized batch norm, registered as torch.ops.syncbn.* for CPU tensors";
  m.attr("capability") = syncbn::cpu::capability();
  syncbn::bind_sync_batch_norm(m);
}

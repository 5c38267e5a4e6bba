// The Python module functions._C_cuda (see setup.py): the CUDA kernels of src/cuda/, registered as
// the CUDA implementations of the torch.ops.syncbn operators (declared in syncbn.functions.operators.ops) when
// syncbn.functions.operators.backend asks (use_kernels(cuda="compiled")).
#include <torch/extension.h>
#include <torch/library.h>

#include "built_with.h"

#include "batch_norm_cuda.h"

namespace {
void set_kernels(bool on) {
  static std::unique_ptr<torch::Library> library;
  syncbn::switch_kernels(library, c10::DispatchKey::CUDA, on, [](torch::Library& m) {
    SYNCBN_IMPL_KERNELS(m, syncbn::cuda)
    m.impl("masked_local_stats", TORCH_FN(syncbn::cuda::masked_local_stats));
    m.impl("masked_backward_elemt", TORCH_FN(syncbn::cuda::masked_backward_elemt));
  });
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of the synchronized batch norm, registered as torch.ops.syncbn.* for CUDA tensors";
  m.attr("built_with_torch") = SYNCBN_BUILT_WITH_TORCH;  // checked at import against the running torch
  m.def("set_kernels", &set_kernels,
        "Register (True) or unregister (False) these kernels as the CUDA kernels of torch.ops.syncbn");
}

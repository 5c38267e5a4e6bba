// The Python module functions._C_cuda (see setup.py). Importing it registers the CUDA kernels of
// src/cuda/ as the CUDA implementations of the torch.ops.syncbn operators (declared in
// functions/ops.py).
#include <torch/extension.h>
#include <torch/library.h>

#include "batch_norm_cuda.h"

SYNCBN_REGISTER_KERNELS(CUDA, syncbn::cuda)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of the synchronized batch norm, registered as torch.ops.syncbn.* for CUDA tensors";
}

// The Python module functions._C_cuda (see setup.py): the CUDA kernels of src/cuda/, with the
// argument names of functions/reference.py.
#include <torch/extension.h>

#include "batch_norm_cuda.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of the synchronized batch norm (see functions/reference.py)";
  m.def("local_stats", &syncbn::cuda::local_stats, py::arg("x"));
  m.def("merge_stats", &syncbn::cuda::merge_stats, py::arg("counts"), py::arg("means"), py::arg("m2s"));
  m.def("elemt_forward", &syncbn::cuda::elemt_forward, py::arg("x"), py::arg("mean"), py::arg("invstd"),
        py::arg("weight"), py::arg("bias"), py::arg("residual") = py::none(),
        py::arg("negative_slope") = py::none());
  m.def("backward_reduce", &syncbn::cuda::backward_reduce, py::arg("dy"), py::arg("x"), py::arg("mean"));
  m.def("backward_elemt", &syncbn::cuda::backward_elemt, py::arg("dy"), py::arg("x"), py::arg("mean"),
        py::arg("invstd"), py::arg("weight"), py::arg("sum_dy"), py::arg("sum_dy_xmu"), py::arg("count"));
  m.def("backward_affine_act", &syncbn::cuda::backward_affine_act, py::arg("dy"), py::arg("x"), py::arg("mean"),
        py::arg("invstd"), py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("negative_slope"),
        py::arg("input_grad"), py::arg("residual_grad"), py::arg("sums"));
}

// The Python module functions._C_<capability> (see setup.py): the compiled kernels, one submodule per device type.
#include <torch/extension.h>

#include "cpu/batch_norm_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Compiled kernels of the synchronized batch norm (see functions/reference.py)";
  auto cpu = m.def_submodule("cpu", "CPU kernels (at::vec, at::parallel_for)");
  cpu.def("local_stats", &syncbn::cpu::local_stats, py::arg("x"));
  cpu.def("merge_stats", &syncbn::cpu::merge_stats, py::arg("counts"), py::arg("means"), py::arg("m2s"));
  cpu.def("elemt_forward", &syncbn::cpu::elemt_forward, py::arg("x"), py::arg("mean"), py::arg("invstd"),
          py::arg("weight"), py::arg("bias"), py::arg("residual") = py::none(), py::arg("negative_slope") = py::none());
  cpu.def("backward_reduce", &syncbn::cpu::backward_reduce, py::arg("dy"), py::arg("x"), py::arg("mean"));
  cpu.def("backward_elemt", &syncbn::cpu::backward_elemt, py::arg("dy"), py::arg("x"), py::arg("mean"),
          py::arg("invstd"), py::arg("weight"), py::arg("sum_dy"), py::arg("sum_dy_xmu"), py::arg("count"));
  cpu.def("backward_affine_act", &syncbn::cpu::backward_affine_act, py::arg("dy"), py::arg("x"), py::arg("mean"),
          py::arg("invstd"), py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("negative_slope"),
          py::arg("input_grad"), py::arg("residual_grad"), py::arg("sums"));
  cpu.attr("capability") = syncbn::cpu::capability();
}

// The CUDA kernels of a synchronized batch norm (declared in src/kernels.inc; tested in
// tests/test_cuda_kernels.py). Host declarations only: this header is what src/cuda/bindings.cpp
// (compiled by the C++ compiler) sees of the kernels in src/cuda/*.cu.
#pragma once

#include <ATen/ATen.h>

#include "operators.h"

#include <optional>
#include <tuple>

namespace syncbn::cuda {

#include "kernels.inc"

// The masked operators (src/cuda/masked.cu, src/cuda/elementwise.cu; what they compute:
// src/cpu/batch_norm_cpu.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_local_stats(const at::Tensor& input, const at::Tensor& mask);
at::Tensor masked_backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                 const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& mean_dy, const at::Tensor& mean_dy_xmu, const at::Tensor& mask);

}  // namespace syncbn::cuda

// The default kernels of the torch.ops.syncbn operators on CUDA tensors (src/torch_cuda_ops.cpp):
// torch's SyncBN CUDA ops and ATen, built into the CPU extension.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "operators.h"

namespace syncbn::torch_cuda {

// The operators' kernels, as src/kernels.inc declares them (their math: syncbn.functions.operators.reference).
std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& x);
at::Tensor elemt_forward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, std::optional<double> negative_slope);
std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean);
at::Tensor backward_elemt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                          const std::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
                          const at::Tensor& sum_dy_xmu, int64_t count);
AffineActGrads backward_affine_act(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                   const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                                   std::optional<double> negative_slope, bool input_grad, bool residual_grad,
                                   bool sums);
std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_gathered_stats(
    const at::Tensor& rows, int64_t header, int64_t agreeing, std::optional<int64_t> flag,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum);

// Registers them, with the device-generic composite operators (src/operators.h), as the CUDA
// kernels of torch.ops.syncbn; once per process (syncbn.functions.operators.backend calls it where our own
// CUDA kernels are not loaded).
void set_torch_cuda_ops(bool on);

}  // namespace syncbn::torch_cuda

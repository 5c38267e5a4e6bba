// The six CUDA operations of a synchronized batch norm. Signatures and semantics follow the
// pure-PyTorch reference in functions/reference.py, against which they are tested
// (tests/test_cuda.py). Host declarations only: this header is what src/cuda/bindings.cpp
// (compiled by the C++ compiler) sees of the kernels in src/cuda/*.cu.
#pragma once

#include <ATen/ATen.h>

#include "operators.h"

#include <optional>
#include <tuple>

namespace syncbn::cuda {

// Mean and M2 of each channel of x (N, C, *), in float64.
std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& input);

// Mean and biased variance of the union of R parts: counts (R,), means and m2s (R, C).
std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s);

// y = act(x * scale + shift + residual), scale = invstd * weight, shift = bias - mean * scale;
// act(p) = p > 0 ? p : p * negative_slope, none without negative_slope.
at::Tensor elemt_forward(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, std::optional<double> negative_slope);

// sum(dy) and sum(dy * (x - mean)) per channel, in mean's dtype.
std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& grad_output, const at::Tensor& input,
                                                   const at::Tensor& mean);

// dx = (dy - sum_dy / count - (x - mean) * invstd^2 * sum_dy_xmu / count) * invstd * weight.
at::Tensor backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                          const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, int64_t count);

// One pass: g = dy * act'(pre) (pre recomputed as elemt_forward computes it); returns
// (dx = g * scale, g, sum(g), sum(g * (x - mean))), each an empty tensor unless asked for.
AffineActGrads backward_affine_act(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                    std::optional<double> negative_slope, bool input_grad, bool residual_grad, bool sums);

}  // namespace syncbn::cuda

// The CPU operations of a synchronized batch norm. Signatures and semantics follow the
// pure-PyTorch reference in functions/reference.py, against which they are tested.
#pragma once

#include <ATen/ATen.h>

#include "operators.h"

#include <optional>
#include <tuple>

namespace syncbn::cpu {

// Mean and M2 of each channel of x (N, C, *), in float64.
std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& input);

// Mean and biased variance of the union of R parts: counts (R,), means and m2s (R, C).
std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s);

// y = act(x * scale + shift + residual), scale = invstd * weight, shift = bias - mean * scale,
// act(p) = p > 0 ? p : p * negative_slope (none without a slope; no residual: 0).
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

// The backward of elemt_forward with mean and invstd fixed, in one pass: g = dy * act'(pre)
// (pre recomputed as in the forward), dx = g * scale, and per-channel sum(g) and
// sum(g * (x - mean)) in mean's dtype; each only when asked for (else an empty tensor).
AffineActGrads backward_affine_act(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                    std::optional<double> negative_slope, bool input_grad, bool residual_grad, bool sums);

// The instruction set the kernels were built for: "AVX512", "AVX2" or "DEFAULT".
const char* capability();

}  // namespace syncbn::cpu

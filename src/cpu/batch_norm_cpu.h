// The CPU kernels of a synchronized batch norm (declared in src/kernels.inc), and the
// instruction set they were built for.
#pragma once

#include <ATen/ATen.h>

#include "operators.h"

#include <optional>
#include <tuple>

namespace syncbn::cpu {

#include "kernels.inc"

// Chan's merge of R parts' per-channel moments, in part order: the total count's mean and M2
// (sum of squared deviations) per channel, from each part's count, mean and M2 (part r's C values
// at means[r], m2s[r]). The one loop behind merge_stats and the native path's merge of host
// replicas (src/sync_batch_norm.cpp), so that both give the same bits.
void merge_moments(const double* counts, const double* const* means, const double* const* m2s, int64_t R, int64_t C,
                   double* mean, double* m2);

// Statistics over the valid positions of a padded batch (syncbn.functions.operators.reference_masked
// has the math): mask is bool (N, *spatial), True where valid. Mean and M2 per channel (float64)
// over the valid positions, and their count (0-dim float64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_local_stats(const at::Tensor& input, const at::Tensor& mask);

// dx = (dy - m * (mean_dy + (x - mean) * invstd^2 * mean_dy_xmu)) * invstd * weight, the sums
// given per valid value (divided by the whole batch's valid count already).
at::Tensor masked_backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                 const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& mean_dy, const at::Tensor& mean_dy_xmu, const at::Tensor& mask);

// The instruction set the kernels were built for: "AVX512", "AVX2" or "DEFAULT".
const char* capability();

}  // namespace syncbn::cpu

// The operators' arguments on the CPU: the input's checks, per-channel tensors as doubles, the
// affine coefficients, and the residual laid out as the input.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "layout.h"

namespace syncbn::cpu {

// A (C,) tensor (or None) as doubles; `fill` where it is absent.
inline std::vector<double> per_channel_doubles(const std::optional<at::Tensor>& t, int64_t C, double fill) {
  std::vector<double> out(C, fill);
  if (t.has_value() && t->defined()) {
    TORCH_CHECK(t->numel() == C, "syncbn: expected ", C, " per-channel values, got ", t->numel());
    const auto d = t->is_cpu() ? t->contiguous() : t->to(at::kCPU).contiguous();  // no copy in the usual case
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, d.scalar_type(), "syncbn_per_channel_doubles", [&] {
      const scalar_t* p = d.const_data_ptr<scalar_t>();
      for (int64_t c = 0; c < C; ++c) out[c] = double(p[c]);
    });
  }
  return out;
}

// Per-channel scale = invstd * weight and shift = bias - mean * scale, in double.
inline std::pair<std::vector<double>, std::vector<double>> affine_coefficients(
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, int64_t C) {
  auto scale = per_channel_doubles(invstd, C, 1.0);
  const auto m = per_channel_doubles(mean, C, 0.0);
  const auto w = per_channel_doubles(weight, C, 1.0);
  auto shift = per_channel_doubles(bias, C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    scale[c] *= w[c];
    shift[c] -= m[c] * scale[c];
  }
  return {scale, shift};
}

// An optional tensor shaped and laid out as x (the residual against the input), or None.
inline std::optional<at::Tensor> optional_like_layout(const std::optional<at::Tensor>& other, const at::Tensor& x,
                                                      const char* op, const char* name) {
  if (!other.has_value() || !other->defined()) return std::nullopt;
  TORCH_CHECK(other->scalar_type() == x.scalar_type(), "syncbn.", op, ": ", name, " is ", other->scalar_type(),
              " but the input is ", x.scalar_type());
  return like_layout(*other, x, name);
}

inline void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), "syncbn.", op, ": expected a CPU tensor, got ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) &&
                  (x.scalar_type() == at::kDouble || x.scalar_type() == at::kFloat ||
                   x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "syncbn.", op, ": expected float64, float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 2, "syncbn.", op, ": expected an input of rank >= 2, got ", x.dim());
}

}  // namespace syncbn::cpu

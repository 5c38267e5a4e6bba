// Per-channel elementwise passes, elemt_forward, backward_elemt and masked_backward_elemt (what
// they compute: src/kernels.inc, batch_norm_cpu.h), each one pass over memory with its
// per-channel coefficients computed once (in double, then rounded to the accumulation type).
#include "batch_norm_cpu.h"
#include "activation.h"
#include "map_per_channel.h"
#include "per_channel.h"
#include "pieces.h"
#include "vectors.h"

namespace syncbn::cpu {
namespace {

// y = act(x * scale + shift [+ z]); z is read only with kResidual.
template <typename scalar_t, bool kResidual, bool kActivation>
void elemt_forward_kernel(const at::Tensor& x, const std::optional<at::Tensor>& z, const Layout& l, at::Tensor& y,
                          const std::vector<double>& scale, const std::vector<double>& shift, double slope) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;
  const auto scale_acc = padded_params<acc_t>(scale, A::kWidth), shift_acc = padded_params<acc_t>(shift, A::kWidth);
  const Vec slope_vec(static_cast<acc_t>(slope));
  const auto op = [&](const std::array<Vec, kResidual ? 2 : 1>& v, const std::array<Vec, 2>& p) {
    const Vec pre = pre_activation<kResidual>(v[0], v[kResidual ? 1 : 0], p[0], p[1]);
    return activation<kActivation>(pre, slope_vec);
  };
  const std::array<const acc_t*, 2> params{scale_acc.data(), shift_acc.data()};
  if constexpr (kResidual) {
    map_per_channel<scalar_t, 2, 2>(l, {x.const_data_ptr<scalar_t>(), z->const_data_ptr<scalar_t>()},
                                    y.data_ptr<scalar_t>(), params, op);
  } else {
    map_per_channel<scalar_t, 1, 2>(l, {x.const_data_ptr<scalar_t>()}, y.data_ptr<scalar_t>(), params, op);
  }
}

// dx = (dy - mean_dy - (x - mean) * xmu_coef) * scale; with `valid` (masked_backward_elemt) the
// correction at valid positions only.
template <typename scalar_t>
void backward_elemt_kernel(const at::Tensor& dy, const at::Tensor& x, const Layout& l, at::Tensor& dx,
                           const std::array<std::vector<double>, 4>& coefficients, const bool* valid = nullptr) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;
  std::array<std::vector<acc_t>, 4> acc;
  for (size_t j = 0; j < 4; ++j) acc[j] = padded_params<acc_t>(coefficients[j], A::kWidth);
  // params: mean, mean_dy, xmu_coef, scale
  const std::array<const scalar_t*, 2> in{dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>()};
  const std::array<const acc_t*, 4> params{acc[0].data(), acc[1].data(), acc[2].data(), acc[3].data()};
  if (valid == nullptr) {
    map_per_channel<scalar_t, 2, 4>(l, in, dx.data_ptr<scalar_t>(), params,
                                    [](const std::array<Vec, 2>& v, const std::array<Vec, 4>& p) {
                                      const Vec xmu = v[1] - p[0];
                                      return at::vec::fnmadd(xmu, p[2], v[0] - p[1]) * p[3];
                                    });
    return;
  }
  map_per_channel<scalar_t, 2, 4, true>(
      l, in, dx.data_ptr<scalar_t>(), params,
      [](const std::array<Vec, 2>& v, const std::array<Vec, 4>& p, const Vec& select) {
        const Vec correction = at::vec::fmadd(v[1] - p[0], p[2], p[1]);  // a select: padding may hold inf or nan
        return (v[0] - Vec::blendv(Vec(0), correction, select)) * p[3];
      },
      valid);
}

// backward_elemt's per-channel coefficients (mean, mean_dy, xmu_coef, scale) from the sums and
// the count they are divided by.
std::array<std::vector<double>, 4> backward_coefficients(const at::Tensor& mean, const at::Tensor& invstd,
                                                         const std::optional<at::Tensor>& weight,
                                                         const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                                                         double count, int64_t C) {
  const auto invstd_d = per_channel_doubles(invstd, C, 1.0);
  std::array<std::vector<double>, 4> coefficients{per_channel_doubles(mean, C, 0.0), per_channel_doubles(sum_dy, C, 0.0),
                                                  per_channel_doubles(sum_dy_xmu, C, 0.0),
                                                  affine_coefficients(mean, invstd, weight, std::nullopt, C).first};
  for (int64_t c = 0; c < C; ++c) {
    coefficients[1][c] /= count;
    coefficients[2][c] *= invstd_d[c] * invstd_d[c] / count;
  }
  return coefficients;
}

}  // namespace

at::Tensor elemt_forward(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, std::optional<double> negative_slope) {
  check_input(input, "elemt_forward");
  const auto [x, l] = as_layout(input);
  const auto z = optional_like_layout(residual, x, "elemt_forward", "residual");
  const auto [scale, shift] = affine_coefficients(mean, invstd, weight, bias, l.C);
  auto y = at::empty_like(x);
  if (l.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_elemt_forward", [&] {
    with_flags(z.has_value(), negative_slope.has_value(), [&](auto has_residual, auto has_activation) {
      elemt_forward_kernel<scalar_t, has_residual.value, has_activation.value>(x, z, l, y, scale, shift,
                                                                                negative_slope.value_or(1.0));
    });
  });
  return y;
}

at::Tensor backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                          const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, int64_t count) {
  check_input(input, "backward_elemt");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "syncbn.backward_elemt: grad_output is ",
              grad_output.scalar_type(), " but the input is ", input.scalar_type());
  const auto [x, l] = as_layout(input);
  const auto dy = like_layout(grad_output, x, "grad_output");
  auto dx = at::empty_like(x);
  if (l.numel() == 0) return dx;
  TORCH_CHECK(count > 0, "syncbn.backward_elemt: the batch count must be positive, got ", count);
  const auto coefficients = backward_coefficients(mean, invstd, weight, sum_dy, sum_dy_xmu, double(count), l.C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_backward_elemt",
                                  [&] { backward_elemt_kernel<scalar_t>(dy, x, l, dx, coefficients); });
  return dx;
}

at::Tensor masked_backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                 const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& mean_dy, const at::Tensor& mean_dy_xmu, const at::Tensor& mask) {
  check_input(input, "masked_backward_elemt");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "syncbn.masked_backward_elemt: grad_output is ",
              grad_output.scalar_type(), " but the input is ", input.scalar_type());
  const auto [x, l] = as_layout(input);
  const auto dy = like_layout(grad_output, x, "grad_output");
  const auto valid = positions_mask(mask, input, "masked_backward_elemt");
  auto dx = at::empty_like(x);
  if (l.numel() == 0) return dx;
  const auto coefficients = backward_coefficients(mean, invstd, weight, mean_dy, mean_dy_xmu, 1.0, l.C);  // per value
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_masked_backward_elemt", [&] {
    backward_elemt_kernel<scalar_t>(dy, x, l, dx, coefficients, valid.const_data_ptr<bool>());
  });
  return dx;
}

}  // namespace syncbn::cpu

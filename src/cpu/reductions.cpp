// Per-channel reductions: local statistics (count, mean, M2) and the backward passes
// (sum_dy and sum_dy_xmu; with frozen statistics also dx and the gradient through the fused
// activation), each in one pass over memory; and the merge of replicas' statistics.
//
// Values accumulate per vector lane in the accumulation type (float for float32, bfloat16 and
// float16; double for float64): Welford lanes fold into double every kFoldUpdates updates, the
// backward sums after at most kMaxLaneUpdates; lanes and pieces merge in double. Welford runs
// on values shifted by a pivot (the channel's first value), so that a float32 running mean
// carries the data's spread, not its offset: mean 1e4 and std 1 keeps the variance to ~1e-7.
#include "batch_norm_cpu.h"
#include "activation.h"
#include "per_channel.h"
#include "pieces.h"
#include "vectors.h"
#include "welford.h"
#include "grad_passes.h"

#include <cmath>

namespace syncbn::cpu {
namespace {

template <typename scalar_t>
void local_stats_kernel(const at::Tensor& x, const Layout& l, double* mean_out, double* m2_out) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  // the first row's values: offsets of a finite pivot, 0 where the first value is not finite
  auto pivot = padded_params<acc_t>(l.C, A::kWidth);
  for (int64_t c = 0; c < l.C; ++c) {
    const acc_t first = acc_t(data[l.channels_last ? c : c * l.S]);
    pivot[c] = std::isfinite(double(first)) ? first : acc_t(0);
  }
  std::vector<Moments> moments;
  if (l.channels_last) {
    moments = reduce_channels_last<Moments>(
        l, [&] { return ChannelsLastWelford<scalar_t>(l.C, pivot.data()); },
        [&](ChannelsLastWelford<scalar_t>& acc, int64_t offset, int64_t count) {
          for (int64_t r = 0; r < count; ++r) acc.add_row(data + offset + r * l.C);
        });
  } else {
    moments = reduce_contiguous<Moments>(l, A::kWidth, [&](int64_t c) { return ContiguousWelford<scalar_t>(data, pivot[c]); });
  }
  for (int64_t c = 0; c < l.C; ++c) {
    mean_out[c] = double(pivot[c]) + moments[c].mean;
    if (!std::isfinite(mean_out[c])) mean_out[c] = plain_sum(data, l, c) / double(l.rows());
    m2_out[c] = moments[c].m2;
  }
}

// Per-channel coefficients of a backward pass: mean, scale and shift (see affine_coefficients).
struct GradCoefficients {
  std::vector<double> mean, scale, shift;
  double slope;
};

// The backward pass over every value of x (either layout); returns the per-channel sums.
template <typename scalar_t, bool kResidual, bool kActivation>
std::vector<GradSums> grad_pass(const Layout& l, const GradPassData<scalar_t>& d, const GradCoefficients& k) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  const auto mean = padded_params<acc_t>(k.mean, A::kWidth);
  const auto scale = padded_params<acc_t>(k.scale, A::kWidth);
  const auto shift = padded_params<acc_t>(k.shift, A::kWidth);
  const auto slope = static_cast<acc_t>(k.slope);
  if (l.channels_last && !kResidual && !kActivation && d.dx == nullptr && d.g == nullptr && d.sums) {
    using Acc = ChannelsLastSumsPass<scalar_t>;
    return reduce_channels_last<GradSums>(
        l, [&] { return Acc(d, l.C, mean.data()); }, [](Acc& acc, int64_t offset, int64_t count) { acc.add_rows(offset, count); });
  }
  if (l.channels_last) {
    using Acc = ChannelsLastGradPass<scalar_t, kResidual, kActivation>;
    return reduce_channels_last<GradSums>(
        l, [&] { return Acc(d, l.C, mean.data(), scale.data(), shift.data(), slope); },
        [&](Acc& acc, int64_t offset, int64_t count) { acc.add_rows(offset, count); });
  }
  // a run shorter than a vector still takes one update of each lane
  const int64_t lanes = std::max<int64_t>(1, l.S / ceil_div(l.S, A::kWidth));
  return reduce_contiguous<GradSums>(l, lanes, [&](int64_t c) {
    return ContiguousGradPass<scalar_t, kResidual, kActivation>(d, mean[c], scale[c], shift[c], slope);
  });
}

// The pass with the residual and activation flags taken at compile time.
template <typename scalar_t>
std::vector<GradSums> dispatch_grad_pass(const Layout& l, const GradPassData<scalar_t>& d, const GradCoefficients& k,
                                         bool residual, bool activation) {
  std::vector<GradSums> sums;
  with_flags(residual, activation, [&](auto has_residual, auto has_activation) {
    sums = grad_pass<scalar_t, has_residual.value, has_activation.value>(l, d, k);
  });
  return sums;
}

// (C,) tensors of the sums, in `dtype`.
std::pair<at::Tensor, at::Tensor> sums_to_tensors(const std::vector<GradSums>& sums, int64_t C,
                                                  const at::TensorOptions& options, at::ScalarType dtype) {
  auto sum_g = at::zeros({C}, options.dtype(at::kDouble));
  auto sum_g_xmu = at::zeros({C}, options.dtype(at::kDouble));
  for (int64_t c = 0; c < static_cast<int64_t>(sums.size()); ++c) {
    sum_g.data_ptr<double>()[c] = sums[c].dy;
    sum_g_xmu.data_ptr<double>()[c] = sums[c].dy_xmu;
  }
  return {sum_g.to(dtype), sum_g_xmu.to(dtype)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& input) {
  check_input(input, "local_stats");
  const auto [x, l] = as_layout(input);
  auto mean = at::zeros({l.C}, input.options().dtype(at::kDouble));
  auto m2 = at::zeros({l.C}, input.options().dtype(at::kDouble));
  if (l.rows() == 0 || l.C == 0) return {mean, m2};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_local_stats", [&] {
    local_stats_kernel<scalar_t>(x, l, mean.data_ptr<double>(), m2.data_ptr<double>());
  });
  return {mean, m2};
}

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& grad_output, const at::Tensor& input,
                                                   const at::Tensor& mean) {
  check_input(input, "backward_reduce");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "syncbn.backward_reduce: grad_output is ",
              grad_output.scalar_type(), " but the input is ", input.scalar_type());
  const auto [x, l] = as_layout(input);
  const auto dy = like_layout(grad_output, x, "grad_output");
  TORCH_CHECK(mean.numel() == l.C, "syncbn.backward_reduce: mean has ", mean.numel(), " values for ", l.C,
              " channels");
  std::vector<GradSums> sums(l.C);
  if (l.numel() > 0) {
    const GradCoefficients k{per_channel_doubles(mean, l.C, 0.0), std::vector<double>(l.C, 1.0),
                             std::vector<double>(l.C, 0.0), 1.0};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_backward_reduce", [&] {
      const GradPassData<scalar_t> d{dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), nullptr, nullptr,
                                     nullptr, true};
      sums = grad_pass<scalar_t, false, false>(l, d, k);
    });
  }
  const auto [sum_dy, sum_dy_xmu] = sums_to_tensors(sums, l.C, input.options(), mean.scalar_type());
  return {sum_dy, sum_dy_xmu};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_affine_act(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                    std::optional<double> negative_slope, bool input_grad, bool residual_grad, bool sums) {
  check_input(input, "backward_affine_act");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "syncbn.backward_affine_act: grad_output is ",
              grad_output.scalar_type(), " but the input is ", input.scalar_type());
  const auto [x, l] = as_layout(input);
  const auto dy = like_layout(grad_output, x, "grad_output");
  const auto z = optional_like_layout(residual, x, "backward_affine_act", "residual");
  TORCH_CHECK(mean.numel() == l.C && invstd.numel() == l.C, "syncbn.backward_affine_act: mean and invstd need ",
              l.C, " values, got ", mean.numel(), " and ", invstd.numel());
  const auto [scale, shift] = affine_coefficients(mean, invstd, weight, bias, l.C);
  const GradCoefficients k{per_channel_doubles(mean, l.C, 0.0), scale, shift, negative_slope.value_or(1.0)};
  std::optional<at::Tensor> dx, g;
  if (input_grad) dx = at::empty_like(x);
  if (residual_grad) g = at::empty_like(x);
  std::vector<GradSums> channel_sums(l.C);
  if (l.numel() > 0 && (input_grad || residual_grad || sums)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_backward_affine_act", [&] {
      const GradPassData<scalar_t> d{dy.const_data_ptr<scalar_t>(),
                                     x.const_data_ptr<scalar_t>(),
                                     z ? z->const_data_ptr<scalar_t>() : nullptr,
                                     dx ? dx->data_ptr<scalar_t>() : nullptr,
                                     g ? g->data_ptr<scalar_t>() : nullptr,
                                     sums};
      channel_sums = dispatch_grad_pass<scalar_t>(l, d, k, z.has_value(), negative_slope.has_value());
    });
  }
  std::optional<at::Tensor> sum_g, sum_g_xmu;
  if (sums) std::tie(sum_g, sum_g_xmu) = sums_to_tensors(channel_sums, l.C, input.options(), mean.scalar_type());
  return affine_act_outputs(dx, g, sum_g, sum_g_xmu, x, mean);
}

void merge_moments(const double* counts, const double* const* means, const double* const* m2s, int64_t R, int64_t C,
                   double* mean, double* m2) {
  double total = 0;
  for (int64_t r = 0; r < R; ++r) total += counts[r];
  // R-way Chan: M2 = sum_r M2_r + sum_r n_r (m_r - m)^2, deviations from the global mean only
  for (int64_t c = 0; c < C; ++c) {
    double weighted = 0;
    for (int64_t r = 0; r < R; ++r) weighted += counts[r] * means[r][c];
    const double mu = weighted / total;
    double sum = 0;
    for (int64_t r = 0; r < R; ++r) {
      const double d = means[r][c] - mu;
      sum += m2s[r][c] + counts[r] * d * d;
    }
    mean[c] = mu;
    m2[c] = sum;
  }
}

std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s) {
  TORCH_CHECK(means.dim() == 2 && m2s.sizes() == means.sizes() && counts.dim() == 1 &&
                  counts.size(0) == means.size(0),
              "syncbn.merge_stats: expected counts (R,), means and m2s (R, C), got ", counts.sizes(), ", ",
              means.sizes(), ", ", m2s.sizes());
  const auto n = counts.to(at::kDouble).contiguous();
  const auto m = means.to(at::kDouble).contiguous();
  const auto s = m2s.to(at::kDouble).contiguous();
  const int64_t R = m.size(0), C = m.size(1);
  const double* pn = n.const_data_ptr<double>();
  double total = 0;
  for (int64_t r = 0; r < R; ++r) total += pn[r];
  TORCH_CHECK(total > 0, "syncbn.merge_stats: the total count must be positive");
  std::vector<const double*> part_means(R), part_m2s(R);
  for (int64_t r = 0; r < R; ++r) {
    part_means[r] = m.const_data_ptr<double>() + r * C;
    part_m2s[r] = s.const_data_ptr<double>() + r * C;
  }
  auto mean = at::empty({C}, m.options());
  auto var = at::empty({C}, m.options());
  double* out_var = var.data_ptr<double>();
  merge_moments(pn, part_means.data(), part_m2s.data(), R, C, mean.data_ptr<double>(), out_var);
  for (int64_t c = 0; c < C; ++c) out_var[c] /= total;
  return {mean.to(means.scalar_type()), var.to(means.scalar_type())};
}

}  // namespace syncbn::cpu

namespace syncbn::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_gathered_stats(
    const at::Tensor& rows, int64_t header, int64_t agreeing, std::optional<int64_t> flag,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum) {
  const int64_t C = check_gathered_rows(rows, header, agreeing, flag);
  const auto r = rows.contiguous();
  const int64_t R = r.size(0), width = r.size(1);
  const double* first = r.const_data_ptr<double>();
  std::vector<double> counts(R);
  std::vector<const double*> means(R), m2s(R);
  bool valid = true;
  double total = 0;
  for (int64_t i = 0; i < R; ++i) {
    const double* row = first + i * width;
    for (int64_t k = 0; k < agreeing; ++k) valid = valid && row[k] == first[k];
    if (flag) valid = valid && row[*flag] == 0;
    counts[i] = row[header - 1];
    total += counts[i];
    means[i] = row + header;
    m2s[i] = row + header + C;
  }
  valid = valid && is_whole_count(total) && total != 1;
  auto mean = at::zeros({C}, r.options()), var = at::ones({C}, r.options());
  if (total > 0) {  // merge_stats' loop and division: the bits of the checks-at-once path
    double* out_var = var.data_ptr<double>();
    merge_moments(counts.data(), means.data(), m2s.data(), R, C, mean.data_ptr<double>(), out_var);
    for (int64_t c = 0; c < C; ++c) out_var[c] /= total;
  }
  // a valid total is a whole number of values (not 1): update_running_stats' int count
  if (valid) update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, int64_t(total));
  return {at::scalar_tensor(total, r.options()), mean, var, at::scalar_tensor(valid, r.options().dtype(at::kBool))};
}

}  // namespace syncbn::cpu

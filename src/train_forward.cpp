// The composite operators (see operators.h): written once on ATen and the torch.ops.syncbn
// operators, so that each extension's kernels serve them on its device. Where the per-channel
// tensors live on the host, their few arithmetic steps are one loop instead of a dozen ATen
// calls (which cost more than the work for any realistic C, and dominate a small layer).
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>

#include "operators.h"

namespace syncbn {
namespace {


// update_running_stats on host tensors: running = batch * factor + running * (1 - factor) per
// channel in double, rounded once to the running statistics' dtype.
void update_on_host(const at::Tensor& running_mean, const at::Tensor& running_var, double factor,
                    const at::Tensor& mean, const at::Tensor& var, double unbias) {
  const auto m = mean.to(at::kDouble).contiguous(), v = var.to(at::kDouble).contiguous();
  const double* pm = m.const_data_ptr<double>();
  const double* pv = v.const_data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, running_mean.scalar_type(), "syncbn_update_on_host", [&] {
    scalar_t* rm = running_mean.data_ptr<scalar_t>();
    for (int64_t c = 0; c < running_mean.numel(); ++c) rm[c] = scalar_t(pm[c] * factor + double(rm[c]) * (1 - factor));
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, running_var.scalar_type(), "syncbn_update_on_host", [&] {
    scalar_t* rv = running_var.data_ptr<scalar_t>();
    for (int64_t c = 0; c < running_var.numel(); ++c) {
      rv[c] = scalar_t(pv[c] * unbias * factor + double(rv[c]) * (1 - factor));
    }
  });
}

// values as a float64 host tensor, in pinned memory where asked.
at::Tensor host_values(c10::ArrayRef<double> values, bool pinned) {
  auto host = at::empty({int64_t(values.size())}, at::TensorOptions().dtype(at::kDouble).pinned_memory(pinned));
  std::copy(values.begin(), values.end(), host.data_ptr<double>());
  return host;
}

// t's values (1-D, floating, on the host) converted to double into out.
void copy_as_double(const at::Tensor& t, double* out) {
  const auto values = t.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "syncbn_pack_row", [&] {
    const scalar_t* in = values.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < values.numel(); ++i) out[i] = double(in[i]);
  });
}

}  // namespace

at::Tensor host_values_on(c10::ArrayRef<double> values, const at::Device& device) {
  auto host = host_values(values, /*pinned=*/!device.is_cpu());
  return device.is_cpu() ? host : host.to(device, /*non_blocking=*/true);
}

at::Tensor pack_row(c10::ArrayRef<double> head, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 1 && b.dim() == 1, "syncbn.pack_row: expected 1-D a and b, got shapes ", a.sizes(), " and ",
              b.sizes());
  TORCH_CHECK(a.is_floating_point() && b.is_floating_point(), "syncbn.pack_row: expected floating a and b, got ",
              a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "syncbn.pack_row: expected a and b on one device, got ", a.device(), " and ",
              b.device());
  const int64_t H = int64_t(head.size()), A = a.numel(), B = b.numel();
  auto row = at::empty({H + A + B}, a.options().dtype(at::kDouble));
  if (row.is_cpu()) {
    double* out = row.data_ptr<double>();
    std::copy(head.begin(), head.end(), out);
    copy_as_double(a, out + H);
    copy_as_double(b, out + H + A);
    return row;
  }
  if (H > 0) row.narrow(0, 0, H).copy_(host_values(head, /*pinned=*/true), /*non_blocking=*/true);
  row.narrow(0, H, A).copy_(a);
  row.narrow(0, H + A, B).copy_(b);
  return row;
}

std::tuple<at::Tensor, at::Tensor> unpack_row(const at::Tensor& row, int64_t head, at::ScalarType dtype) {
  TORCH_CHECK(row.dim() == 1 && row.scalar_type() == at::kDouble, "syncbn.unpack_row: expected a 1-D float64 row, got ",
              row.scalar_type(), " of shape ", row.sizes());
  TORCH_CHECK(0 <= head && head <= row.numel() && (row.numel() - head) % 2 == 0, "syncbn.unpack_row: expected head (",
              head, ") plus two halves of equal size in a row of ", row.numel());
  TORCH_CHECK(at::isFloatingType(dtype), "syncbn.unpack_row: expected a floating dtype, got ", dtype);
  const int64_t C = (row.numel() - head) / 2;
  const auto whole = row.is_cpu() ? row.contiguous() : row;
  const auto half = [&](int64_t start) {
    auto out = at::empty({C}, row.options().dtype(dtype));
    if (!row.is_cpu()) return out.copy_(row.narrow(0, start, C));
    const double* in = whole.const_data_ptr<double>() + start;  // one pass, no ATen call
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "syncbn_unpack_row", [&] {
      scalar_t* values = out.data_ptr<scalar_t>();
      for (int64_t i = 0; i < C; ++i) values[i] = scalar_t(in[i]);
    });
    return out;
  };
  return {half(head), half(head + C)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> normalization_stats(const at::Tensor& mean, const at::Tensor& m2,
                                                                  int64_t count, double eps, at::ScalarType acc) {
  if (!(is_host_vector(mean) && is_host_vector(m2) && mean.scalar_type() == at::kDouble &&
        m2.scalar_type() == at::kDouble)) {
    const auto var = count > 0 ? m2 / double(count) : at::ones_like(m2);
    return {mean.to(acc), (var + eps).rsqrt().to(acc), var};
  }
  const int64_t C = mean.numel();
  auto var = at::empty_like(m2);
  auto mean_acc = at::empty({C}, mean.options().dtype(acc)), invstd = at::empty({C}, mean.options().dtype(acc));
  const double* pm = mean.const_data_ptr<double>();
  const double* ps = m2.const_data_ptr<double>();
  double* pv = var.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES(acc, "syncbn_normalization_stats", [&] {
    scalar_t* out_mean = mean_acc.data_ptr<scalar_t>();
    scalar_t* out_invstd = invstd.data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      pv[c] = count > 0 ? ps[c] / double(count) : 1.0;
      out_mean[c] = scalar_t(pm[c]);
      out_invstd[c] = scalar_t(1.0 / std::sqrt(pv[c] + eps));
    }
  });
  return {mean_acc, invstd, var};
}

void update_running_stats(const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
                          const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum,
                          const at::Tensor& mean, const at::Tensor& var, int64_t count) {
  const bool counts = num_batches_tracked && num_batches_tracked->defined();
  if (counts) num_batches_tracked->add_(1);
  if (!running_mean || !running_mean->defined() || !running_var || !running_var->defined() || count == 0) return;
  TORCH_CHECK(count > 1, "syncbn.update_running_stats: the unbiased variance needs more than 1 value, got ", count);
  const double unbias = double(count) / double(count - 1);
  const bool on_host = is_host_vector(*running_mean) && is_host_vector(*running_var) &&
                       (!counts || num_batches_tracked->is_cpu());
  if (on_host && (momentum || counts)) {
    const double factor = momentum ? *momentum : 1.0 / double(num_batches_tracked->item<int64_t>());
    update_on_host(*running_mean, *running_var, factor, mean, var, unbias);
    return;
  }
  blend_running_stats(*running_mean, *running_var, num_batches_tracked, momentum, mean, var * unbias, at::Tensor());
}

void blend_running_stats(const at::Tensor& running_mean, const at::Tensor& running_var,
                         const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum,
                         const at::Tensor& mean, const at::Tensor& unbiased, const at::Tensor& where) {
  const auto blend = [&](const at::Tensor& running, const at::Tensor& batch, const auto& factor) {
    const auto blended = batch * factor + running * (1 - factor);
    running.copy_(where.defined() ? at::where(where, blended, running) : blended);
  };
  if (momentum) {
    blend(running_mean, mean, *momentum);
    blend(running_var, unbiased, *momentum);
  } else if (num_batches_tracked && num_batches_tracked->defined()) {  // no host read of the count
    const auto factor = num_batches_tracked->to(mean.options()).reciprocal();
    blend(running_mean, mean, factor);
    blend(running_var, unbiased, factor);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_train(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum, double eps,
    const std::optional<at::Tensor>& residual, std::optional<double> negative_slope) {
  using OptTensor = std::optional<at::Tensor>;
  static const auto local_stats = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("syncbn::local_stats", "")
                                      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  static const auto elemt_forward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("syncbn::elemt_forward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const OptTensor&, const OptTensor&, std::optional<double>)>();
  TORCH_CHECK(input.dim() >= 2, "syncbn.batch_norm_train: expected an input of rank >= 2, got ", input.dim());
  const int64_t channels = input.size(1);
  const int64_t count = channels == 0 ? 0 : input.numel() / channels;
  const auto [mean, m2] = local_stats.call(input);
  const auto acc = accumulation_type(input.scalar_type());
  const auto [mean_acc, invstd, var] = normalization_stats(mean, m2, count, eps, acc);
  update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, count);
  return {elemt_forward.call(input, mean_acc, invstd, weight, bias, residual, negative_slope), mean_acc, invstd};
}

}  // namespace syncbn

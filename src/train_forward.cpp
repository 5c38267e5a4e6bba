// The composite operators (see operators.h): written once on ATen and the torch.ops.syncbn
// operators, so that each extension's kernels serve them on its device.
#include <ATen/core/dispatch/Dispatcher.h>

#include "operators.h"

namespace syncbn {
namespace {

// mean * factor + running * (1 - factor) into running, factor a double or a 0-dim tensor.
template <typename Factor>
void blend_into(const at::Tensor& running, const at::Tensor& batch, const Factor& factor) {
  running.copy_(batch * factor + running * (1 - factor));
}

}  // namespace

void update_running_stats(const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
                          const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum,
                          const at::Tensor& mean, const at::Tensor& var, int64_t count) {
  const bool counts = num_batches_tracked && num_batches_tracked->defined();
  if (counts) num_batches_tracked->add_(1);
  if (!running_mean || !running_mean->defined() || !running_var || !running_var->defined() || count == 0) return;
  TORCH_CHECK(count > 1, "syncbn.update_running_stats: the unbiased variance needs more than 1 value, got ", count);
  const auto unbiased = var * (double(count) / double(count - 1));
  if (momentum) {
    blend_into(*running_mean, mean, *momentum);
    blend_into(*running_var, unbiased, *momentum);
  } else if (counts) {  // the cumulative average, on the device (no host read of the count)
    const auto factor = num_batches_tracked->to(mean.options()).reciprocal();
    blend_into(*running_mean, mean, factor);
    blend_into(*running_var, unbiased, factor);
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
  const auto var = count > 0 ? m2 / double(count) : at::ones_like(m2);  // an empty batch: mean 0, var 1
  update_running_stats(running_mean, running_var, num_batches_tracked, momentum, mean, var, count);
  const auto acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto mean_acc = mean.to(acc), invstd = (var + eps).rsqrt().to(acc);
  return {elemt_forward.call(input, mean_acc, invstd, weight, bias, residual, negative_slope), mean_acc, invstd};
}

}  // namespace syncbn

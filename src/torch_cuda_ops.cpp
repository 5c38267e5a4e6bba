// The default kernels of the torch.ops.syncbn operators on CUDA tensors, where our own CUDA
// kernels (src/cuda) are not loaded: torch's SyncBN CUDA ops (batch_norm_stats,
// batch_norm_elemt, batch_norm_backward_reduce, batch_norm_backward_elemt: one pass over memory
// each) and the rest composed on ATen. Built into the CPU extension (no nvcc needed) and
// registered for the CUDA key at run time (set_torch_cuda_ops, from syncbn.functions.operators.backend),
// so that a replica thread on the synchronized CUDA route never takes the GIL for an operator.
// The math is syncbn.functions.operators.reference's, which the tests hold these to (on CPU tensors: every
// ATen call here has a CPU kernel too). No host read of a device value.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <memory>
#include <optional>
#include <tuple>

#include "operators.h"
#include "torch_cuda_ops.h"

namespace syncbn::torch_cuda {
namespace {

using OptTensor = std::optional<at::Tensor>;

int64_t values_per_channel(const at::Tensor& x) { return x.size(1) ? x.numel() / x.size(1) : 0; }

std::vector<int64_t> reduction_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// v (C,) viewed to broadcast over x (N, C, *).
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = -1;
  return v.view(shape);
}

at::Tensor laid_out_as(const at::Tensor& y, const at::Tensor& x) { return y.contiguous(memory_format_of(x)); }

// (scale, shift) of y = x * scale + shift in invstd's dtype: scale = invstd * weight,
// shift = bias - mean * scale (syncbn.functions.operators.reference.affine_params).
std::pair<at::Tensor, at::Tensor> affine_params(const at::Tensor& mean, const at::Tensor& invstd,
                                                const OptTensor& weight, const OptTensor& bias) {
  const auto scale = weight && weight->defined() ? invstd * weight->to(invstd.scalar_type()) : invstd;
  auto shift = -mean * scale;
  if (bias && bias->defined()) shift = shift + bias->to(invstd.scalar_type());
  return {scale, shift};
}

// x * scale + shift (+ residual), in scale's dtype: the activation's input.
at::Tensor pre_activation(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                          const OptTensor& residual) {
  auto pre = at::addcmul(per_channel(shift, x), x.to(scale.scalar_type()), per_channel(scale, x));
  return residual && residual->defined() ? pre + residual->to(scale.scalar_type()) : pre;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& x) {
  const int64_t count = values_per_channel(x);
  if (count == 0) {  // torch's ops reshape to (N, C, -1), which an empty batch cannot
    auto zeros = at::zeros({x.size(1)}, x.options().dtype(at::kDouble));
    return {zeros, zeros.clone()};
  }
  // one Welford pass; M2 = count * var, var recovered from invstd with eps = 0 (torch gives
  // invstd 0 where var is 0); a nan (an inf in the channel) stays
  const auto [mean, invstd] = at::batch_norm_stats(x, 0.0);
  const auto inv = invstd.to(at::kDouble);
  const auto m2 = at::where(inv == 0, at::zeros_like(inv), double(count) / inv.square());
  return {mean.to(at::kDouble), m2};
}

at::Tensor elemt_forward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                         const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                         std::optional<double> negative_slope) {
  if ((residual && residual->defined()) || negative_slope) {  // torch has no fused op for these
    const auto [scale, shift] = affine_params(mean, invstd, weight, bias);
    auto y = pre_activation(x, scale, shift, residual);
    if (negative_slope) y = at::where(y > 0, y, y * *negative_slope);
    return laid_out_as(y.to(x.scalar_type()), x);
  }
  if (x.numel() == 0) return at::empty_like(x);
  return at::batch_norm_elemt(x, weight, bias, mean, invstd, 0.0);
}

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean) {
  if (x.numel() == 0) return {at::zeros_like(mean), at::zeros_like(mean)};
  // invstd only scales grad_weight, which is not asked for here
  const auto [sum_dy, sum_dy_xmu, unused_weight, unused_bias] = at::batch_norm_backward_reduce(
      dy, x, mean, at::ones_like(mean), std::nullopt, /*input_g=*/true, /*weight_g=*/false, /*bias_g=*/false);
  return {sum_dy, sum_dy_xmu};
}

at::Tensor backward_elemt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                          const OptTensor& weight, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                          int64_t count) {
  if (x.numel() == 0) return at::empty_like(x);
  auto dy_sum = sum_dy, dy_xmu_sum = sum_dy_xmu;
  if (count > std::numeric_limits<int32_t>::max()) {  // torch's op takes int32 counts: divide here
    dy_sum = sum_dy / double(count);
    dy_xmu_sum = sum_dy_xmu / double(count);
    count = 1;
  }
  OptTensor w = weight;
  if (w && w->defined() && w->scalar_type() != mean.scalar_type()) w = w->to(mean.scalar_type());
  // a fill kernel, not a copy from pageable host memory (which waits for the stream to drain)
  const auto counts = at::full({1}, count, x.options().dtype(at::kInt));
  return at::batch_norm_backward_elemt(dy, x, mean, invstd, w, dy_sum, dy_xmu_sum, counts);
}

AffineActGrads backward_affine_act(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                   const at::Tensor& invstd, const OptTensor& weight, const OptTensor& bias,
                                   const OptTensor& residual, std::optional<double> negative_slope, bool input_grad,
                                   bool residual_grad, bool sums) {
  const auto acc = mean.scalar_type();
  const auto [scale, shift] = affine_params(mean, invstd, weight, bias);
  auto g = dy.to(acc);
  if (negative_slope) {
    const auto pre = pre_activation(x, scale, shift, residual);
    g = at::where(pre > 0, g, g * *negative_slope);
  }
  OptTensor dx, g_out, sum_g, sum_g_xmu;
  if (input_grad) dx = laid_out_as((g * per_channel(scale, x)).to(x.scalar_type()), x);
  if (sums) {
    const auto dims = reduction_dims(x);
    sum_g = g.sum(dims);
    sum_g_xmu = (g * (x.to(acc) - per_channel(mean, x))).sum(dims);
  }
  if (residual_grad) g_out = laid_out_as(g.to(dy.scalar_type()), x).clone();  // never an alias of dy
  return affine_act_outputs(dx, g_out, sum_g, sum_g_xmu, x, mean);
}

std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s) {
  const auto n = counts.to(means.scalar_type()).unsqueeze(1);
  const auto total = n.sum();
  const auto mean = (n * means).sum(0) / total;
  const auto m2 = m2s.sum(0) + (n * (means - mean).square()).sum(0);
  return {mean, m2 / total};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_gathered_stats(
    const at::Tensor& rows, int64_t header, int64_t agreeing, std::optional<int64_t> flag,
    const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& num_batches_tracked,
    std::optional<double> momentum) {
  const int64_t C = check_gathered_rows(rows, header, agreeing, flag);
  const auto heads = rows.narrow(1, 0, header), means = rows.narrow(1, header, C), m2s = rows.narrow(1, header + C, C);
  const auto counts = heads.select(1, header - 1);
  const auto total = counts.sum();
  const auto empty = total == 0;
  // all empty: any positive weights give mean 0 and M2 0 (the parts' are 0), then var := 1
  auto [mean, var] = merge_stats(at::where(empty, at::ones_like(counts), counts), means, m2s);
  var = at::where(empty, at::ones_like(var), var);
  const auto whole = (total >= 0) & (total < 9223372036854775808.0) & (total == total.floor());  // NaN: false
  auto valid = (heads.narrow(1, 0, agreeing) == heads.narrow(0, 0, 1).narrow(1, 0, agreeing)).all() & whole & (total != 1);
  if (flag) valid = valid & (heads.select(1, *flag) == 0).all();
  // where invalid nothing changes, num_batches_tracked included; where valid as
  // update_running_stats with the total as count (an empty batch only counts)
  if (num_batches_tracked && num_batches_tracked->defined()) num_batches_tracked->add_(valid);
  if (running_mean && running_mean->defined() && running_var && running_var->defined()) {
    blend_running_stats(*running_mean, *running_var, num_batches_tracked, momentum, mean, var * (total / (total - 1)),
                        valid & (total > 1));
  }
  return {total, mean, var, valid};
}

void set_torch_cuda_ops(bool on) {
  static std::unique_ptr<torch::Library> library;
  switch_kernels(library, c10::DispatchKey::CUDA, on, [](torch::Library& m) {
    m.impl("local_stats", TORCH_FN(local_stats));
    m.impl("elemt_forward", TORCH_FN(elemt_forward));
    m.impl("backward_reduce", TORCH_FN(backward_reduce));
    m.impl("backward_elemt", TORCH_FN(backward_elemt));
    m.impl("backward_affine_act", TORCH_FN(backward_affine_act));
    m.impl("merge_stats", TORCH_FN(merge_stats));
    m.impl("merge_gathered_stats", TORCH_FN(merge_gathered_stats));
    m.impl("update_running_stats", TORCH_FN(syncbn::update_running_stats));
    m.impl("batch_norm_train", TORCH_FN(syncbn::batch_norm_train));
    m.impl("pack_row", TORCH_FN(syncbn::pack_row));
    m.impl("unpack_row", TORCH_FN(syncbn::unpack_row));
  });
}

}  // namespace syncbn::torch_cuda

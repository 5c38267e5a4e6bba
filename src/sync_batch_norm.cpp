// Every synchronized call, one native call per replica and direction, without the GIL:
// sync_batch_norm (the plain and fused layers) and inplace_abn (the in-place activated ones).
// Replicas meet at their ReplicaRound, where the master's merge combines every replica's
// statistics and, through Ranks, every rank's; the backward nodes meet again with the sums. The
// math is syncbn.functions.sync_batchnorm's and syncbn.functions.inplace_abn's, over the same
// torch.ops.syncbn operators; what crosses devices is fenced by an event and record_stream.
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <type_traits>

#include "graph_task.h"
#include "meeting.h"
#include "ranks.h"

namespace syncbn::native {
namespace {

// ---- autograd ----

// A new autograd node, held as the installed torch's Edge holds them (intrusive_ptr or shared_ptr).
template <typename T>
auto make_node() {
  using Held = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// A node's own handle, as a saved output's unpack takes it.
template <typename T>
auto held(T* node) {
  using Held = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>) {
    return std::static_pointer_cast<torch::autograd::Node>(node->shared_from_this());
  } else {
    return c10::intrusive_ptr<torch::autograd::Node>::reclaim_copy(static_cast<torch::autograd::Node*>(node));
  }
}

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
at::Tensor undefined_if_none(const OptTensor& t) { return t ? *t : at::Tensor(); }

// What both backward nodes share: the meeting of the sums, the failure reporting, the errors as
// Python sees them. `Layer::backward(grads)` is the layer's own math.
template <typename Layer>
struct MeetingBackward : public torch::autograd::Node {
  Meeting meeting;
  int64_t count = 0;  // values per channel over every replica, where no ranks divide the sums
  std::string layer;

  // Once no one owns the node: its Ranks let go of the Synchronizer, whose weak reference to this
  // node (an intrusive_ptr's) would otherwise keep the node, its saved tensors and the group alive.
  // Not marked override: where torch holds nodes in shared_ptr, no base declares it (nor needs it).
  void release_resources() { meeting = Meeting{}; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    try {
      return apply_as_replica(grads);
    } catch (...) {  // the other ranks wait in a backward collective: told there, then this error
      if (meeting.ranks && *meeting.ranks) meeting.ranks->fail_backward();
      throw;
    }
  }

  torch::autograd::variable_list apply_as_replica(torch::autograd::variable_list& grads) {
    try {
      return as_replica(meeting.round.get(), meeting.index, [&] {
        TORCH_CHECK(!at::GradMode::is_enabled(), layer,
                    ": double backward (create_graph=True) through a layer synchronized across replicas or processes "
                    "is not supported; it is on one device in one process");
        return static_cast<Layer*>(this)->backward(grads);
      });
    } catch (const RoundBroken& broken) {
      raise_replica_sync_error(broken.what());
    } catch (pybind11::error_already_set& error) {  // from the ranks' Python: raised as it is
      python_error raised;
      {
        pybind11::gil_scoped_acquire gil;
        error.restore();
        raised.persist();
      }
      throw std::move(raised);
    }
  }

  // Every replica meets, whichever gradients it wants: the others wait for its sums.
  std::pair<Sums, int64_t> totals(const at::Tensor& a, const at::Tensor& b, const at::Device& device) {
    const std::function<std::vector<Sums>(std::vector<SumsPart>&)> combine = [this](std::vector<SumsPart>& parts) {
      return std::vector<Sums>(parts.size(), sum_replicas(parts, *meeting.ranks));
    };
    const auto stream = current_stream(device);
    const auto ready = meeting.round ? mark_ready(stream) : nullptr;
    auto sums = meet<SumsPart, Sums>(meeting.round, "backward", meeting.call, meeting.index, stream,
                                     SumsPart{a, b, ready}, combine, current_graph_task_failed);
    std::tie(sums.sum_dy, sums.sum_dy_xmu) = fetch_pair(sums.sum_dy, sums.sum_dy_xmu, device, sums.ready);
    return {sums, sums.count >= 0 ? sums.count : count};
  }
};

struct SyncBatchNormBackward : public MeetingBackward<SyncBatchNormBackward> {
  std::optional<double> negative_slope;
  torch::autograd::SavedVariable x, weight, bias, residual, mean, invstd, mask;

  std::string name() const override { return "SyncBatchNormBackward"; }

  void release_variables() override {
    for (auto* saved : {&x, &weight, &bias, &residual, &mean, &invstd, &mask}) saved->reset_data();
  }

  torch::autograd::variable_list backward(const torch::autograd::variable_list& grads) {
    // unpacked with autograd on: an unpack hook may recompute a checkpointed region, which must
    // record its graph (torch.utils.checkpoint with use_reentrant=False)
    const auto input = x.unpack(), mean_ = mean.unpack(), invstd_ = invstd.unpack();
    const auto weight_ = weight.unpack(), bias_ = bias.unpack(), residual_ = residual.unpack(), mask_ = mask.unpack();
    check_not_capturing(input.device(), layer);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto dy = (grads[0].defined() ? grads[0] : at::zeros_like(input)).contiguous(memory_format_of(input));
    at::Tensor sum_dy, sum_dy_xmu;
    if (!negative_slope) {
      std::tie(sum_dy, sum_dy_xmu) = ops().backward_reduce.call(dy, input, mean_);
    } else {  // dy through the activation (z's gradient too), and its sums, in one pass
      std::tie(std::ignore, dy, sum_dy, sum_dy_xmu) = ops().backward_affine_act.call(
          dy, input, mean_, invstd_, optional(weight_), optional(bias_), optional(residual_), negative_slope,
          /*input_grad=*/false, /*residual_grad=*/true, /*sums=*/true);
    }
    const auto [sums, total] = totals(sum_dy, sum_dy_xmu, input.device());
    torch::autograd::variable_list result(4);
    if (task_should_compute_output(0) && mask_.defined()) {  // the correction at valid positions only
      result[0] = ops().masked_backward_elemt.call(dy, input, mean_, invstd_, optional(weight_),
                                                   sums.sum_dy / double(total), sums.sum_dy_xmu / double(total), mask_);
    } else if (task_should_compute_output(0)) {
      result[0] = ops().backward_elemt.call(dy, input, mean_, invstd_, optional(weight_), sums.sum_dy, sums.sum_dy_xmu,
                                            c10::SymInt(total));
    }
    if (weight_.defined() && task_should_compute_output(1)) result[1] = (sum_dy_xmu * invstd_).to(weight_.scalar_type());
    if (bias_.defined() && task_should_compute_output(2)) result[2] = sum_dy.to(bias_.scalar_type());
    if (residual_.defined() && task_should_compute_output(3)) result[3] = dy;
    return result;
  }
};

// From the output y and dy alone (the math: syncbn.functions.inplace_abn).
struct InPlaceABNBackward : public MeetingBackward<InPlaceABNBackward> {
  double eps = 0, activation_param = 0;
  std::string activation;
  torch::autograd::SavedVariable y, invstd, weight, bias;

  std::string name() const override { return "InPlaceABNBackward"; }

  void release_variables() override {
    for (auto* saved : {&y, &invstd, &weight, &bias}) saved->reset_data();
  }

  torch::autograd::variable_list backward(torch::autograd::variable_list& grads) {
    const auto output = y.unpack(held(this)), invstd_ = invstd.unpack();
    const auto weight_ = weight.unpack(), bias_ = bias.unpack();
    check_not_capturing(output.device(), layer);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor grad = grads[0].defined() ? std::move(grads[0]) : at::zeros_like(output);
    const auto dy = grad.contiguous(memory_format_of(output));
    // written over where nothing else holds or shares it: one full-size tensor less at the peak
    const bool dy_is_ours = !dy.is_same(grad) || (!grad.is_view() && grad.use_count() == 1 &&
                                                  grad.storage().use_count() == 1 && grad.dtype() == output.dtype());
    grad.reset();
    const auto w = optional(weight_), b = optional(bias_);
    const auto [sum_dz, sum_xhat_dz] =
        ops().abn_backward_reduce.call(output, dy, w, b, eps, activation, activation_param);
    const auto [sums, total] = totals(sum_dz, sum_xhat_dz, output.device());
    torch::autograd::variable_list result(3);
    if (task_should_compute_output(0)) {
      const auto a = optional(sums.sum_dy), c = optional(sums.sum_dy_xmu);
      if (dy_is_ours) {
        ops().abn_backward_elemt_.call(dy, output, invstd_, w, b, eps, activation, activation_param, a, c,
                                       c10::SymInt(total));
        result[0] = dy;
      } else {
        result[0] = ops().abn_backward_elemt.call(output, dy, invstd_, w, b, eps, activation, activation_param, a, c,
                                                  c10::SymInt(total));
      }
    }
    if (weight_.defined() && task_should_compute_output(1)) {
      result[1] = at::where(weight_ < 0, -sum_xhat_dz, sum_xhat_dz).to(weight_.scalar_type());
    }
    if (bias_.defined() && task_should_compute_output(2)) result[2] = sum_dz.to(bias_.scalar_type());
    return result;
  }
};

void check_no_forward_grads(const std::string& layer, std::initializer_list<at::Tensor> tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK_NOT_IMPLEMENTED(!t.defined() || !torch::autograd::isFwGradDefined(t), layer,
                                ": forward-mode AD (jvp) through a synchronized layer is not supported");
  }
}

// This replica's normalization of `x`: the given one (a checkpoint's recomputation: met
// already), else its statistics met with every replica's (and rank's), on its own device.
Normalization normalization_of(const Meeting& meeting, const at::Tensor& x, const MasterCall& master_call,
                               const std::optional<Normalization>& given, const OptTensor& mask = std::nullopt) {
  if (given) return *given;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor mean, m2, valid;
  int64_t count = -1;
  if (mask) {  // the merge weighs parts by their counts, read here (a host read on a GPU)
    std::tie(mean, m2, valid) = ops().masked_local_stats.call(x, *mask);
    count = int64_t(valid.item<double>());
  } else {
    std::tie(mean, m2) = ops().local_stats.call(x);
  }
  const auto stream = current_stream(x.device());
  const auto ready = meeting.round ? mark_ready(stream) : nullptr;  // the master reads it
  StatsPart part{mean, m2, ready, x.scalar_type(), x.sizes().vec(), count};
  const auto& ranks = meeting.ranks;
  const std::function<std::vector<Normalization>(std::vector<StatsPart>&)> combine =
      [&master_call, &ranks](std::vector<StatsPart>& parts) {
        return std::vector<Normalization>(parts.size(), merge_replicas(parts, master_call, *ranks));
      };
  auto normalization =
      meet<StatsPart, Normalization>(meeting.round, "forward", meeting.call, meeting.index, stream, std::move(part),
                                     combine);
  std::tie(normalization.mean, normalization.invstd) =
      fetch_pair(normalization.mean, normalization.invstd, x.device(), normalization.ready);
  return normalization;
}

}  // namespace

// Returns y and the replica's mean, invstd and process count, which a checkpoint's recomputation
// reuses as `given`.
CallResult sync_batch_norm(const Meeting& meeting, const at::Tensor& input, const OptTensor& weight,
                           const OptTensor& bias, const MasterCall& master_call, const OptTensor& residual,
                           std::optional<double> negative_slope, const std::optional<Normalization>& given,
                           const OptTensor& mask) {
  return as_replica(meeting.round.get(), meeting.index, [&] {
    const auto w = undefined_if_none(weight), b = undefined_if_none(bias), z = undefined_if_none(residual);
    check_no_forward_grads(master_call.layer, {input, w, b, z});
    const at::Tensor x = input.contiguous(memory_format_of(input));
    const auto normalization = normalization_of(meeting, x, master_call, given, mask);
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      y = ops().elemt_forward.call(x, normalization.mean, normalization.invstd, weight, bias, residual, negative_slope);
    }
    if (at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(x, w, b, z)) {
      auto node = make_node<SyncBatchNormBackward>();
      node->set_next_edges(torch::autograd::collect_next_edges(x, w, b, z));
      node->meeting = meeting;
      node->count = normalization.count;
      node->negative_slope = negative_slope;
      node->layer = master_call.layer;
      node->x = torch::autograd::SavedVariable(x, false);
      node->weight = torch::autograd::SavedVariable(w, false);
      node->bias = torch::autograd::SavedVariable(b, false);
      node->residual = torch::autograd::SavedVariable(z, false);
      node->mean = torch::autograd::SavedVariable(normalization.mean, false);
      node->invstd = torch::autograd::SavedVariable(normalization.invstd, false);
      node->mask = torch::autograd::SavedVariable(undefined_if_none(mask), false);
      torch::autograd::set_history(y, node);
    }
    return std::make_tuple(y, normalization.mean, normalization.invstd, normalization.count);
  });
}

// `x` written over with act((x - mean) * invstd * (|weight| + eps) + bias)
// (syncbn.functions.inplace_abn); returns as sync_batch_norm, x as y.
CallResult inplace_abn(const Meeting& meeting, const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                       const MasterCall& master_call, const std::string& activation, double activation_param,
                       const std::optional<Normalization>& given) {
  return as_replica(meeting.round.get(), meeting.index, [&] {
    const auto w = undefined_if_none(weight), b = undefined_if_none(bias);
    check_no_forward_grads(master_call.layer, {x, w, b});
    const bool records = at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(x, w, b);
    if (records) torch::autograd::check_inplace(x, true);
    const auto normalization = normalization_of(meeting, x, master_call, given);
    decltype(make_node<InPlaceABNBackward>()) node;
    if (records) {  // the edges of x's history before it is written over
      node = make_node<InPlaceABNBackward>();
      node->set_next_edges(torch::autograd::collect_next_edges(x, w, b));
    }
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      ops().abn_forward_.call(x, normalization.mean, normalization.invstd, weight, bias, master_call.eps, activation,
                              activation_param);
    }
    if (!x.is_inference()) torch::autograd::increment_version(x);
    if (records) {
      node->meeting = meeting;
      node->count = normalization.count;
      node->layer = master_call.layer;
      node->eps = master_call.eps;
      node->activation = activation;
      node->activation_param = activation_param;
      torch::autograd::rebase_history(x, node);
      node->y = torch::autograd::SavedVariable(x, /*is_output=*/true, x.is_view());
      node->invstd = torch::autograd::SavedVariable(normalization.invstd, false);
      node->weight = torch::autograd::SavedVariable(w, false);
      node->bias = torch::autograd::SavedVariable(b, false);
    }
    return std::make_tuple(x, normalization.mean, normalization.invstd, normalization.count);
  });
}

}  // namespace syncbn::native

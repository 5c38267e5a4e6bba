// The synchronized layer's one-call path for the replicas of one process (DataParallel threads,
// no process group): replica_batch_norm posts this replica's part of the call to its
// ReplicaRound (src/replica_round.h) and waits without the GIL; the master does the forward of
// every replica (local statistics, merge, running statistics, y), and its backward node the
// backward of every replica. The math is functions/sync_batchnorm.py's (_forward_every_replica,
// _backward_every_replica), over the same torch.ops.syncbn operators, called through the
// dispatcher (so a part on a GPU takes the CUDA kernels); functions/replicas.py says when this
// path serves. Device-generic: each part runs on the stream its replica runs on, and what crosses
// devices is fenced by an event and kept alive for the copying stream (record_stream), as
// functions/devices.py does.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include <array>
#include <type_traits>
#include <memory>

#include "operators.h"
#include "replica_round.h"

namespace syncbn {
namespace {

using OptTensor = std::optional<at::Tensor>;
using OptStream = std::optional<c10::Stream>;
using Ready = std::shared_ptr<c10::Event>;

PyObject* replica_sync_error = PyExc_RuntimeError;  // functions.ReplicaSyncError, once Python has set it

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

struct Operators {
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)> local_stats =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>("syncbn::local_stats");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      merge_stats = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "syncbn::merge_stats");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      const OptTensor&, const OptTensor&, std::optional<double>)>
      elemt_forward = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                    const OptTensor&, const OptTensor&, std::optional<double>)>("syncbn::elemt_forward");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      backward_reduce = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&)>("syncbn::backward_reduce");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&, const at::Tensor&, const at::Tensor&, c10::SymInt)>
      backward_elemt = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const OptTensor&, const at::Tensor&, const at::Tensor&, c10::SymInt)>(
          "syncbn::backward_elemt");
  c10::TypedOperatorHandle<AffineActGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const OptTensor&, const OptTensor&, const OptTensor&, std::optional<double>,
                                          bool, bool, bool)>
      backward_affine_act =
          op<AffineActGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, const OptTensor&, const OptTensor&, std::optional<double>, bool, bool,
                            bool)>("syncbn::backward_affine_act");
};

const Operators& ops() {
  static const Operators operators;  // looked up once, after functions/ops.py defined them
  return operators;
}

// The stream this thread runs `device`'s work on (none for the CPU).
OptStream current_stream(const at::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// An event after the work queued so far on `stream` (none for the CPU).
Ready mark_ready(const OptStream& stream) {
  if (!stream) return nullptr;
  auto event = std::make_shared<c10::Event>(stream->device_type());
  event->record(*stream);
  return event;
}

// `t` on `device`, copied after `ready`, its memory kept until the copying stream has run.
at::Tensor fetch(const at::Tensor& t, const at::Device& device, const Ready& ready) {
  if (t.device() == device) return t;
  if (t.device().is_cpu()) return t.to(device, /*non_blocking=*/true);
  const auto copying = *current_stream(t.device());
  if (ready) ready->block(copying);
  auto copy = t.to(device, /*non_blocking=*/!device.is_cpu());  // to the host: it is read next
  t.record_stream(copying);
  return copy;
}

at::MemoryFormat memory_format_of(const at::Tensor& x) {  // functions.reference.memory_format_of
  if (x.is_contiguous()) return at::MemoryFormat::Contiguous;
  if (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

int64_t values_per_channel(const at::Tensor& x) { return x.size(1) ? x.numel() / x.size(1) : 0; }

std::string python_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return "torch.float64";
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    default: return std::string("torch.") + c10::toString(dtype);
  }
}

std::string python_tuple(at::IntArrayRef sizes) {
  std::ostringstream text;
  text << "(";
  for (size_t i = 0; i < sizes.size(); ++i) text << (i ? ", " : "") << sizes[i];
  text << (sizes.size() == 1 ? ",)" : ")");
  return text.str();
}

// ---- the forward of every replica, on the master ----

struct ForwardPart {
  at::Tensor x;
  OptTensor weight, bias, residual;
  OptStream stream;
};

struct ForwardResult {
  at::Tensor y, mean, invstd;
  int64_t count;  // values per channel over every replica, for the backward
};

// The master's own arguments of the call.
struct ForwardCall {
  OptTensor running_mean, running_var, num_batches_tracked;
  std::optional<double> momentum;
  double eps;
  std::optional<double> negative_slope;
  std::string layer;
};

void check_parts_agree(const std::vector<ForwardPart>& parts, const std::string& layer) {
  const auto& first = parts[0].x;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& x = parts[i].x;
    if (x.size(1) != first.size(1) || x.scalar_type() != first.scalar_type()) {
      std::ostringstream text;
      text << layer << ": replicas disagree on their input: replica 0 has " << first.size(1) << " channels of "
           << python_dtype(first.scalar_type()) << ", replica " << i << " has " << x.size(1) << " channels of "
           << python_dtype(x.scalar_type());
      throw std::runtime_error(text.str());
    }
  }
}

void check_values_per_channel(const std::vector<ForwardPart>& parts, int64_t total, const std::string& layer) {
  if (total != 1) return;
  std::ostringstream text;
  text << layer << ": Expected more than 1 value per channel when training, got input size ";
  for (size_t i = 0; i < parts.size(); ++i) text << (i ? ", " : "") << python_tuple(parts[i].x.sizes());
  text << " over " << parts.size() << " replicas";
  throw std::invalid_argument(text.str());
}

// Counts (host numbers) as a float64 vector on `device`, from pinned memory without a wait on a GPU.
at::Tensor host_values_on(const std::vector<double>& values, const at::Device& device) {
  const auto options = at::TensorOptions().dtype(at::kDouble);
  auto host = at::empty({int64_t(values.size())}, device.is_cpu() ? options : options.pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<double>());
  return device.is_cpu() ? host : host.to(device, /*non_blocking=*/true);
}

std::vector<ForwardResult> forward_every_replica(std::vector<ForwardPart>& parts, const ForwardCall& call) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_parts_agree(parts, call.layer);
  const auto device = parts[0].x.device();
  std::vector<at::Tensor> means, m2s;
  std::vector<double> counts;
  int64_t total = 0;
  for (auto& part : parts) {
    at::Tensor mean, m2;
    Ready ready;
    {
      c10::OptionalStreamGuard on_its_stream(part.stream);
      std::tie(mean, m2) = ops().local_stats.call(part.x);
      ready = mark_ready(part.stream);
    }
    means.push_back(fetch(mean, device, ready));
    m2s.push_back(fetch(m2, device, ready));
    counts.push_back(double(values_per_channel(part.x)));
    total += values_per_channel(part.x);
  }
  check_values_per_channel(parts, total, call.layer);
  at::Tensor mean, var;
  if (total == 0) {
    mean = at::zeros_like(means[0]);
    var = at::ones_like(means[0]);
  } else if (parts.size() == 1) {
    mean = means[0];
    var = m2s[0] / double(total);
  } else {
    std::tie(mean, var) = ops().merge_stats.call(host_values_on(counts, device), at::stack(means), at::stack(m2s));
  }
  update_running_stats(call.running_mean, call.running_var, call.num_batches_tracked, call.momentum, mean, var, total);
  const auto acc = parts[0].x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto mean_acc = mean.to(acc), invstd = (var + call.eps).rsqrt().to(acc);
  const auto ready = mark_ready(current_stream(device));
  std::vector<ForwardResult> results;
  for (auto& part : parts) {
    c10::OptionalStreamGuard on_its_stream(part.stream);
    const auto part_mean = fetch(mean_acc, part.x.device(), ready), part_invstd = fetch(invstd, part.x.device(), ready);
    auto y = ops().elemt_forward.call(part.x, part_mean, part_invstd, part.weight, part.bias, part.residual,
                                      call.negative_slope);
    results.push_back({std::move(y), part_mean, part_invstd, total});
  }
  return results;
}

// ---- the backward of every replica, on the master ----

struct BackwardPart {
  at::Tensor dy, x, mean, invstd;
  OptTensor weight, bias, residual;
  std::array<bool, 4> wants;  // the gradients of input, weight, bias, residual
  OptStream stream;
};

using BackwardResult = std::array<at::Tensor, 4>;  // undefined where not wanted

std::vector<BackwardResult> backward_every_replica(std::vector<BackwardPart>& parts, int64_t count,
                                                   std::optional<double> negative_slope) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<at::Tensor> dys, sums_dy, sums_dy_xmu;
  std::vector<Ready> readies;
  for (auto& part : parts) {
    c10::OptionalStreamGuard on_its_stream(part.stream);
    at::Tensor dy = part.dy, sum_dy, sum_dy_xmu;
    if (!negative_slope) {
      std::tie(sum_dy, sum_dy_xmu) = ops().backward_reduce.call(dy, part.x, part.mean);
    } else {  // dy through the activation, and its sums, in one pass
      std::tie(std::ignore, dy, sum_dy, sum_dy_xmu) = ops().backward_affine_act.call(
          part.dy, part.x, part.mean, part.invstd, part.weight, part.bias, part.residual, negative_slope,
          /*input_grad=*/false, /*residual_grad=*/true, /*sums=*/true);
    }
    dys.push_back(dy);
    sums_dy.push_back(sum_dy);
    sums_dy_xmu.push_back(sum_dy_xmu);
    readies.push_back(mark_ready(part.stream));
  }
  at::Tensor total_dy, total_dy_xmu;
  Ready total_ready;
  if (std::any_of(parts.begin(), parts.end(), [](const BackwardPart& part) { return part.wants[0]; })) {
    const auto device = sums_dy[0].device();
    std::vector<at::Tensor> on_device_dy, on_device_dy_xmu;
    for (size_t i = 0; i < parts.size(); ++i) {
      on_device_dy.push_back(fetch(sums_dy[i], device, readies[i]));
      on_device_dy_xmu.push_back(fetch(sums_dy_xmu[i], device, readies[i]));
    }
    total_dy = parts.size() == 1 ? on_device_dy[0] : at::stack(on_device_dy).sum(0);
    total_dy_xmu = parts.size() == 1 ? on_device_dy_xmu[0] : at::stack(on_device_dy_xmu).sum(0);
    total_ready = mark_ready(current_stream(device));
  }
  std::vector<BackwardResult> results;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto& part = parts[i];
    c10::OptionalStreamGuard on_its_stream(part.stream);
    BackwardResult grads;
    if (part.wants[0]) {
      grads[0] = ops().backward_elemt.call(dys[i], part.x, part.mean, part.invstd, part.weight,
                                           fetch(total_dy, part.x.device(), total_ready),
                                           fetch(total_dy_xmu, part.x.device(), total_ready), c10::SymInt(count));
    }
    if (part.wants[1]) grads[1] = (sums_dy_xmu[i] * part.invstd).to(part.weight->scalar_type());
    if (part.wants[2]) grads[2] = sums_dy[i].to(part.bias->scalar_type());
    if (part.wants[3]) grads[3] = dys[i];
    results.push_back(std::move(grads));
  }
  return results;
}

// ---- errors as Python sees them ----

// Raise `message` as functions.ReplicaSyncError from a thread without the GIL (an autograd
// engine thread): the engine re-raises a python_error as the Python exception it holds.
[[noreturn]] void raise_replica_sync_error(const std::string& message) {
  python_error error;
  {
    pybind11::gil_scoped_acquire gil;  // one thread state for both: it may not outlive this scope
    PyErr_SetString(replica_sync_error, message.c_str());
    error.persist();
  }
  throw std::move(error);
}

// Run this replica's side of an exchange; its own failures break the round for the others.
template <typename Work>
auto as_replica(ReplicaRound& round, int64_t index, Work work) -> decltype(work()) {
  try {
    return work();
  } catch (const RoundBroken&) {
    throw;
  } catch (const python_error&) {
    round.abort("replica " + std::to_string(index) + " failed");
    throw;
  } catch (const std::exception& error) {
    round.abort("replica " + std::to_string(index) + " failed: " + ReplicaRound::python_type_of(error) + ": " +
                error.what());
    throw;
  }
}

// ---- autograd ----

struct ReplicaBatchNormBackward : public torch::autograd::Node {
  std::shared_ptr<ReplicaRound> round;
  int64_t index = 0, call = 0, count = 0;
  std::optional<double> negative_slope;
  std::string layer;
  torch::autograd::SavedVariable x, weight, bias, residual, mean, invstd;

  std::string name() const override { return "SyncBatchNormReplicaBackward"; }

  void release_variables() override {
    for (auto* saved : {&x, &weight, &bias, &residual, &mean, &invstd}) saved->reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    try {
      return as_replica(*round, index, [&] { return backward(grads); });
    } catch (const RoundBroken& broken) {
      raise_replica_sync_error(broken.what());
    }
  }

  torch::autograd::variable_list backward(const torch::autograd::variable_list& grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), layer,
                ": double backward (create_graph=True) through a layer synchronized across replicas or processes "
                "is not supported; it is on one device in one process");
    const auto input = x.unpack();
    const auto dy = (grads[0].defined() ? grads[0] : at::zeros_like(input)).contiguous(memory_format_of(input));
    const auto weight_ = weight.unpack(), bias_ = bias.unpack(), residual_ = residual.unpack();
    const auto optional = [](const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; };
    BackwardPart part{dy,
                      input,
                      mean.unpack(),
                      invstd.unpack(),
                      optional(weight_),
                      optional(bias_),
                      optional(residual_),
                      {task_should_compute_output(0), weight_.defined() && task_should_compute_output(1),
                       bias_.defined() && task_should_compute_output(2),
                       residual_.defined() && task_should_compute_output(3)},
                      current_stream(input.device())};
    const std::function<std::vector<BackwardResult>(std::vector<BackwardPart>&)> combine =
        [this](std::vector<BackwardPart>& parts) { return backward_every_replica(parts, count, negative_slope); };
    const auto result = round->exchange<BackwardPart, BackwardResult>("backward", call, index, std::move(part), combine);
    return {result[0], result[1], result[2], result[3]};
  }
};

// A new autograd node, held as the installed torch holds them (intrusive_ptr since torch 2.12 or
// so, shared_ptr before).
template <typename T>
auto make_node() {
  using Held = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<Held, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

}  // namespace

// One replica's call of a synchronized layer (see the file's comment): y, with the autograd
// history whose backward meets the other replicas again.
at::Tensor replica_batch_norm(const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call,
                              const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
                              const OptTensor& running_mean, const OptTensor& running_var,
                              const OptTensor& num_batches_tracked, std::optional<double> momentum, double eps,
                              const OptTensor& residual, std::optional<double> negative_slope,
                              const std::string& layer) {
  return as_replica(*round, index, [&] {
    const auto x = input.contiguous(memory_format_of(input));
    ForwardPart part{x, weight, bias, residual, current_stream(x.device())};
    const ForwardCall master_call{running_mean, running_var, num_batches_tracked, momentum, eps, negative_slope, layer};
    const std::function<std::vector<ForwardResult>(std::vector<ForwardPart>&)> combine =
        [&master_call](std::vector<ForwardPart>& parts) { return forward_every_replica(parts, master_call); };
    auto result = round->exchange<ForwardPart, ForwardResult>("forward", call, index, std::move(part), combine);
    const auto undefined = [](const OptTensor& t) { return t ? *t : at::Tensor(); };
    const auto w = undefined(weight), b = undefined(bias), z = undefined(residual);
    if (at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(x, w, b, z)) {
      auto node = make_node<ReplicaBatchNormBackward>();
      node->set_next_edges(torch::autograd::collect_next_edges(x, w, b, z));
      node->round = round;
      node->index = index;
      node->call = call;
      node->count = result.count;
      node->negative_slope = negative_slope;
      node->layer = layer;
      node->x = torch::autograd::SavedVariable(x, false);
      node->weight = torch::autograd::SavedVariable(w, false);
      node->bias = torch::autograd::SavedVariable(b, false);
      node->residual = torch::autograd::SavedVariable(z, false);
      node->mean = torch::autograd::SavedVariable(result.mean, false);
      node->invstd = torch::autograd::SavedVariable(result.invstd, false);
      torch::autograd::set_history(result.y, node);
    }
    return result.y;
  });
}

void bind_replica_rounds(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ReplicaRound, std::shared_ptr<ReplicaRound>>(
      m, "ReplicaRound", "The native side of functions.replicas.ReplicaRound (src/replica_round.h)")
      .def(py::init<int64_t, double, std::string, int64_t, double>(), py::arg("size"), py::arg("timeout"),
           py::arg("layer"), py::arg("number"), py::arg("spin_us"))
      .def_property_readonly("size", &ReplicaRound::size)
      .def("abort", &ReplicaRound::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>());
  m.def("set_replica_sync_error", [](py::object type) {
    replica_sync_error = type.release().ptr();  // kept for the life of the process
  });
  m.def(
      "replica_batch_norm",
      [](const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call, const at::Tensor& input,
         const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean, const OptTensor& running_var,
         const OptTensor& num_batches_tracked, std::optional<double> momentum, double eps, const OptTensor& residual,
         std::optional<double> negative_slope, const std::string& layer) {
        std::optional<std::string> broken;
        at::Tensor y;
        {
          py::gil_scoped_release no_gil;  // the wait, and the master's work, without the GIL
          try {
            y = replica_batch_norm(round, index, call, input, weight, bias, running_mean, running_var,
                                   num_batches_tracked, momentum, eps, residual, negative_slope, layer);
          } catch (const RoundBroken& error) {
            broken = error.what();
          }
        }
        if (broken) {
          PyErr_SetString(replica_sync_error, broken->c_str());
          throw py::error_already_set();
        }
        return y;
      },
      "One replica's call of a synchronized layer: y (see src/replica_batch_norm.cpp)");
}

}  // namespace syncbn

// The native meeting's shared work: device copies in stream order, the checks of the replicas'
// parts, the master's merges of statistics and sums, and the replicas' failures.
#include "meeting.h"

#include <ATen/Dispatch.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <type_traits>

#include "cpu/batch_norm_cpu.h"
#include "ranks.h"

namespace syncbn::native {

PyObject* replica_sync_error = PyExc_RuntimeError;

const Operators& ops() {
  static const Operators operators;  // looked up once, after syncbn.functions.operators.ops defined them
  return operators;
}

// The stream this thread runs `device`'s work on (none for the CPU).
OptStream current_stream(const at::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// An event after the work queued so far on `stream` (none off CUDA: record_stream, which a fence
// pairs with, has CUDA kernels only).
Ready mark_ready(const OptStream& stream) {
  if (!stream || stream->device_type() != c10::DeviceType::CUDA) return nullptr;
  auto event = std::make_shared<c10::Event>(stream->device_type());
  event->record(*stream);
  return event;
}

// Its memory is kept until the stream that reads it has run: replicas on one GPU may run on
// different streams.
at::Tensor fetch(const at::Tensor& t, const at::Device& device, const Ready& ready) {
  if (t.device() == device) {
    if (ready) {
      const auto reading = *current_stream(device);
      ready->block(reading);
      t.record_stream(reading);
    }
    return t;
  }
  if (t.device().is_cpu()) return t.to(device, /*non_blocking=*/true);
  const auto copying = *current_stream(t.device());
  if (ready) ready->block(copying);
  auto copy = t.to(device, /*non_blocking=*/!device.is_cpu());  // to the host: it is read next
  t.record_stream(copying);
  return copy;
}

// Two (C,) tensors of one device and dtype, as fetch gives them: across devices in one copy (a
// (2, C) stack made behind `ready` on the source's stream), so a meeting pays one copy per pair.
std::pair<at::Tensor, at::Tensor> fetch_pair(const at::Tensor& a, const at::Tensor& b, const at::Device& device,
                                             const Ready& ready) {
  if (a.device() == device || a.scalar_type() != b.scalar_type()) {
    return {fetch(a, device, ready), fetch(b, device, ready)};
  }
  const auto source = current_stream(a.device());
  if (ready) ready->block(*source);
  const auto pair = fetch(at::stack({a, b}), device, nullptr);  // ordered behind `ready` by the block
  if (source && source->device_type() == c10::DeviceType::CUDA) {
    a.record_stream(*source);
    b.record_stream(*source);
  }
  return {pair[0], pair[1]};
}

RowLayout& row_layout() {
  static RowLayout layout;
  return layout;
}

namespace {

void check_parts_agree(const std::vector<StatsPart>& parts, const std::string& layer) {
  const auto disagrees = [&](const StatsPart& part) {
    return part.mean.numel() != parts[0].mean.numel() || part.dtype != parts[0].dtype ||
           (part.count >= 0) != (parts[0].count >= 0);
  };
  if (std::none_of(parts.begin(), parts.end(), disagrees)) return;
  std::vector<int64_t> channels;
  std::vector<at::ScalarType> dtypes;
  std::vector<bool> masked;
  for (const auto& part : parts) {
    channels.push_back(part.mean.numel());
    dtypes.push_back(part.dtype);
    masked.push_back(part.count >= 0);
  }
  raise_failed_check("check_inputs_agree", layer, channels, dtypes, masked);
}

// More than one value per channel over the replicas (with a mask: more than one valid position).
void check_values_per_channel(const std::vector<StatsPart>& parts, int64_t total, bool masked,
                              const std::string& layer) {
  if (total > 1 || (total == 0 && !masked)) return;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& part : parts) shapes.push_back(part.sizes);
  if (masked) raise_failed_check("check_valid_positions", total, layer, shapes);
  raise_failed_check("check_values_per_channel", total, layer, shapes);
}

// Whether a device guard can say that a stream is capturing (torch >= 2.12 or so).
template <typename Guard, typename = void>
struct HasCaptureQuery : std::false_type {};
template <typename Guard>
struct HasCaptureQuery<Guard, std::void_t<decltype(std::declval<const Guard&>().isStreamCapturing(
                                  std::declval<const c10::Stream&>()))>> : std::true_type {};

// Whether `device`'s current stream is being captured into a CUDA graph: the device guard's
// answer, or torch.cuda's where the guard has no such query.
template <typename Guard>
bool capturing(const Guard* guard, const at::Device& device) {
  if constexpr (HasCaptureQuery<Guard>::value) {
    return guard->isStreamCapturing(guard->getStream(device));
  } else {
    pybind11::gil_scoped_acquire gil;
    return pybind11::module_::import("torch.cuda").attr("is_current_stream_capturing")().template cast<bool>();
  }
}

// The same bits as merge_stats and normalization_stats in two loops, not a dozen ATen calls: the
// merge is a meeting's one serial step, which every other replica waits through.
Normalization merge_on_host(const std::vector<StatsPart>& parts, const std::vector<double>& counts,
                            const MasterCall& call, int64_t total, at::ScalarType acc) {
  const int64_t R = int64_t(parts.size()), C = parts[0].mean.numel();
  std::vector<const double*> means(R), m2s(R);
  for (int64_t r = 0; r < R; ++r) {
    means[r] = parts[r].mean.const_data_ptr<double>();
    m2s[r] = parts[r].m2.const_data_ptr<double>();
  }
  auto mean = at::empty({C}, parts[0].mean.options()), m2 = at::empty({C}, parts[0].mean.options());
  cpu::merge_moments(counts.data(), means.data(), m2s.data(), R, C, mean.data_ptr<double>(), m2.data_ptr<double>());
  const auto [mean_acc, invstd, var] = normalization_stats(mean, m2, total, call.eps, acc);
  update_running_stats(call.running_mean, call.running_var, call.num_batches_tracked, call.momentum, mean, var, total);
  return Normalization(mean_acc, invstd, total, /*shared=*/false);  // host tensors: no stream
}

}  // namespace

void check_not_capturing(const at::Device& device, const std::string& layer) {
  if (device.type() != c10::DeviceType::CUDA) return;
  if (capturing(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA), device)) {
    raise_failed_check("check_not_capturing", true, layer, "backward");
  }
}

Normalization merge_replicas(std::vector<StatsPart>& parts, const MasterCall& call, Ranks& ranks) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_parts_agree(parts, call.layer);
  const auto device = parts[0].mean.device();
  std::vector<at::Tensor> means, m2s;
  std::vector<double> counts;
  int64_t total = 0;
  bool masked = false;
  for (auto& part : parts) {
    masked = masked || part.count >= 0;
    const int64_t values = part.sizes[1] ? c10::multiply_integers(part.sizes) / part.sizes[1] : 0;
    const int64_t count = part.count >= 0 ? part.count : values;
    auto [mean, m2] = fetch_pair(part.mean, part.m2, device, part.ready);
    means.push_back(mean);
    m2s.push_back(m2);
    counts.push_back(double(count));
    total += count;
  }
  if (!ranks) check_values_per_channel(parts, total, masked, call.layer);  // else the ranks' checks, over all of them
  const auto acc = accumulation_type(parts[0].dtype);
  const bool on_host = std::all_of(parts.begin(), parts.end(), [](const StatsPart& part) {
    return is_host_vector(part.mean) && is_host_vector(part.m2) && part.mean.scalar_type() == at::kDouble &&
           part.m2.scalar_type() == at::kDouble;
  });
  if (on_host && !ranks && total > 0) return merge_on_host(parts, counts, call, total, acc);
  at::Tensor mean, var;
  if (parts.size() == 1 && ranks) {
    std::tie(mean, var) = ranks.merge(total, means[0], m2s[0], parts[0].sizes, call, masked);
  } else {
    if (total == 0) {
      mean = at::zeros_like(means[0]);
      var = at::ones_like(means[0]);
    } else {
      std::tie(mean, var) = ops().merge_stats.call(host_values_on(counts, device), at::stack(means), at::stack(m2s));
    }
    if (ranks) {  // the process's part, as one input of the replicas' batches together
      auto sizes = parts[0].sizes;
      for (size_t i = 1; i < parts.size(); ++i) sizes[0] += parts[i].sizes[0];
      std::tie(mean, var) = ranks.merge(total, mean, var * double(total), sizes, call, masked);
    } else {
      update_running_stats(call.running_mean, call.running_var, call.num_batches_tracked, call.momentum, mean, var,
                           total);
    }
  }
  if (ranks && masked) {  // checked at once; the running statistics after the check (none valid: an error)
    if (ranks.global_count() == 0) check_values_per_channel(parts, 0, masked, call.layer);
    update_running_stats(call.running_mean, call.running_var, call.num_batches_tracked, call.momentum, mean, var,
                         ranks.global_count());
  }
  // other replicas read these on their streams (behind the constructor's event); the only one on its own
  return Normalization(mean.to(acc), (var + call.eps).rsqrt().to(acc), total, /*shared=*/parts.size() > 1);
}

namespace {

bool are_host_vectors_alike(const std::vector<at::Tensor>& ts) {
  const auto dtype = ts[0].scalar_type();
  return (dtype == at::kFloat || dtype == at::kDouble) && std::all_of(ts.begin(), ts.end(), [&](const at::Tensor& t) {
           return is_host_vector(t) && t.scalar_type() == dtype && t.numel() == ts[0].numel();
         });
}

// The bits of stacking and summing in replica order, in one loop: the merge is a meeting's serial step.
at::Tensor sum_on_host(const std::vector<at::Tensor>& ts) {
  auto total = at::empty_like(ts[0]);
  AT_DISPATCH_FLOATING_TYPES(total.scalar_type(), "syncbn_sum_on_host", [&] {
    std::vector<const scalar_t*> parts;
    for (const auto& t : ts) parts.push_back(t.const_data_ptr<scalar_t>());
    scalar_t* out = total.data_ptr<scalar_t>();
    for (int64_t c = 0; c < total.numel(); ++c) {
      scalar_t sum = 0;
      for (const scalar_t* part : parts) sum += part[c];
      out[c] = sum;
    }
  });
  return total;
}

// The replicas' per-channel vectors summed in replica order on the first one's device.
at::Tensor sum_in_replica_order(const std::vector<at::Tensor>& ts) {
  return are_host_vectors_alike(ts) ? sum_on_host(ts) : at::stack(ts).sum(0);
}

}  // namespace

Sums sum_replicas(std::vector<SumsPart>& parts, const Ranks& ranks) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto device = parts[0].sum_dy.device();
  std::vector<at::Tensor> sums_dy, sums_dy_xmu;
  for (auto& part : parts) {
    auto [sum_dy, sum_dy_xmu] = fetch_pair(part.sum_dy, part.sum_dy_xmu, device, part.ready);
    sums_dy.push_back(sum_dy);
    sums_dy_xmu.push_back(sum_dy_xmu);
  }
  auto sum_dy = parts.size() > 1 ? sum_in_replica_order(sums_dy) : sums_dy[0];
  auto sum_dy_xmu = parts.size() > 1 ? sum_in_replica_order(sums_dy_xmu) : sums_dy_xmu[0];
  int64_t count = -1;
  if (ranks) std::tie(sum_dy, sum_dy_xmu, count) = ranks.sum(sum_dy, sum_dy_xmu);
  return Sums(sum_dy, sum_dy_xmu, count, /*shared=*/parts.size() > 1);
}

void raise_replica_sync_error(const std::string& message) {
  python_error error;
  {
    pybind11::gil_scoped_acquire gil;  // one thread state for both: it may not outlive this scope
    PyErr_SetString(replica_sync_error, message.c_str());
    error.persist();
  }
  throw std::move(error);
}

// torch.utils.checkpoint's _StopRecomputationError: control flow, not a failure (non-reentrant
// checkpointing stops a recomputation with it once the tensors it needs are saved).
bool stops_recomputation(python_error& raised) {
  pybind11::gil_scoped_acquire gil;
  raised.persist();
  const auto* type = reinterpret_cast<PyTypeObject*>(raised.type);
  return type && std::string(type->tp_name) == "_StopRecomputationError";
}

}  // namespace syncbn::native

namespace syncbn {

// The Python name and message of a C++ exception, as pybind11 and torch translate it.
std::string describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const RoundBroken& broken) {
    return std::string("ReplicaSyncError: ") + broken.what();
  } catch (python_error& raised) {
    pybind11::gil_scoped_acquire gil;
    raised.persist();  // fetched already where it came through the engine; builds its message
    const auto* type = reinterpret_cast<PyTypeObject*>(raised.type);
    return std::string(type ? type->tp_name : "Exception") + ": " + raised.what();
  } catch (pybind11::error_already_set& raised) {
    pybind11::gil_scoped_acquire gil;
    return pybind11::str(raised.type().attr("__name__")).cast<std::string>() + ": " +
           pybind11::str(raised.value()).cast<std::string>();
  } catch (const c10::OutOfMemoryError& failed) {
    return std::string("OutOfMemoryError: ") + failed.what_without_backtrace();
  } catch (const c10::NotImplementedError& failed) {
    return std::string("NotImplementedError: ") + failed.what_without_backtrace();
  } catch (const c10::ValueError& failed) {
    return std::string("ValueError: ") + failed.what_without_backtrace();
  } catch (const c10::TypeError& failed) {
    return std::string("TypeError: ") + failed.what_without_backtrace();
  } catch (const c10::IndexError& failed) {
    return std::string("IndexError: ") + failed.what_without_backtrace();
  } catch (const c10::Error& failed) {
    return std::string("RuntimeError: ") + failed.what_without_backtrace();
  } catch (const std::invalid_argument& invalid) {  // pybind11 raises it as a ValueError
    return std::string("ValueError: ") + invalid.what();
  } catch (const std::out_of_range& invalid) {  // and this as an IndexError
    return std::string("IndexError: ") + invalid.what();
  } catch (const std::exception& failed) {
    return std::string("RuntimeError: ") + failed.what();
  }
}

std::string failure_reason(int64_t index, const std::exception_ptr& error) {
  std::string what;
  try {
    what = describe(error);
  } catch (...) {  // a message that cannot be printed must not keep the round from breaking
    what = "an exception whose message could not be read";
  }
  return "replica " + std::to_string(index) + " failed: " + what;
}

}  // namespace syncbn

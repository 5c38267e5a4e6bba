// Every synchronized call, in one native call per replica and direction, without the GIL:
// sync_batch_norm (the plain and fused layers) and inplace_abn (the in-place activated ones).
// The replica computes its statistics, posts them to its ReplicaRound (src/replica_round.h; none:
// the only replica of its process) and waits; the master's merge (run by the replica that arrives
// last, on the master's stream) merges every replica's and, with a process group, the ranks'
// (Ranks: the row, the merge of the gathered rows with the running statistics' update, the
// checks; the all_gather through Synchronizer.gather_rows), else updates the running statistics
// itself; each replica normalizes its own input. A checkpoint's recomputation is given the first
// run's statistics and meets no one in its forward. The backward nodes meet again with the
// per-channel sums (the all_reduce through Synchronizer.reduce_row). The math is
// functions/sync_batchnorm.py's and functions/inplace_abn.py's, over the same torch.ops.syncbn
// operators called through the dispatcher (a part on a GPU takes the CUDA kernels). What crosses
// devices is fenced by an event and kept alive for the copying stream (record_stream).
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "cpu/batch_norm_cpu.h"
#include "graph_task.h"
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
  c10::TypedOperatorHandle<at::Tensor(c10::ArrayRef<double>, const at::Tensor&, const at::Tensor&)> pack_row =
      op<at::Tensor(c10::ArrayRef<double>, const at::Tensor&, const at::Tensor&)>("syncbn::pack_row");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, at::ScalarType)> unpack_row =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, at::ScalarType)>("syncbn::unpack_row");
  using MergeGathered = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, int64_t, int64_t, std::optional<int64_t>, const OptTensor&, const OptTensor&, const OptTensor&,
      std::optional<double>);
  c10::TypedOperatorHandle<MergeGathered> merge_gathered_stats = op<MergeGathered>("syncbn::merge_gathered_stats");
  using AbnForward = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                          double, c10::string_view, double);
  c10::TypedOperatorHandle<AbnForward> abn_forward_ = op<AbnForward>("syncbn::abn_forward_");
  using AbnReduce = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                        const OptTensor&, double, c10::string_view, double);
  c10::TypedOperatorHandle<AbnReduce> abn_backward_reduce = op<AbnReduce>("syncbn::abn_backward_reduce");
  using AbnElemt = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                              const OptTensor&, double, c10::string_view, double, const OptTensor&, const OptTensor&,
                              c10::SymInt);
  c10::TypedOperatorHandle<AbnElemt> abn_backward_elemt = op<AbnElemt>("syncbn::abn_backward_elemt");
  using AbnElemtInPlace = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                               const OptTensor&, double, c10::string_view, double, const OptTensor&, const OptTensor&,
                               c10::SymInt);
  c10::TypedOperatorHandle<AbnElemtInPlace> abn_backward_elemt_ = op<AbnElemtInPlace>("syncbn::abn_backward_elemt_");
};

const Operators& ops() {
  static const Operators operators;  // looked up once, after functions/operators/ops.py defined them
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

// `t` on `device`, usable on this thread's current stream there: copied (or, on its own device,
// used) after `ready`, its memory kept until the stream that reads it has run (replicas on one
// GPU may run on different streams).
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

// A deferred verdict's event, as functions/synchronization/checks.py reads it (the methods of a torch.cuda.Event
// that it calls): whether the device has run the copies to host memory, and a wait for them.
struct ReadyEvent {
  Ready event;
  bool query() const { return event->query(); }
  void synchronize() const { event->synchronize(); }
};

// A verdict on its way to host memory: copied from a device without waiting (into pinned memory,
// as Tensor.to does for a non-blocking copy to the host), readable once `ready` has passed (none:
// on the host already).
struct HostVerdict {
  at::Tensor values, valid;  // `valid` undefined where the verdict has no device judgement
  Ready ready;
};

HostVerdict to_host(const at::Tensor& values, const at::Tensor& valid) {
  if (values.is_cpu()) return {values, valid, nullptr};
  const auto copy = [](const at::Tensor& t) { return t.defined() ? t.to(at::kCPU, /*non_blocking=*/true) : t; };
  auto host_values = copy(values), host_valid = copy(valid);
  return {host_values, host_valid, mark_ready(current_stream(values.device()))};
}

pybind11::object ready_object(const Ready& ready) {
  return ready ? pybind11::cast(ReadyEvent{ready}) : pybind11::none();
}



// ---- what crosses replicas: the forward's statistics, the backward's sums ----

// One replica's statistics of its input, after the work that made them.
struct StatsPart {
  at::Tensor mean, m2;  // (C,) float64 on the replica's device
  Ready ready;
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
};

// What every replica normalizes with, on the master's device. Made only from finished tensors:
// the event that hands them to other replicas (`shared`) is recorded in the constructor, after
// the work that made them was queued on this thread's stream.
struct Normalization {
  at::Tensor mean, invstd;  // (C,) in the accumulation dtype
  Ready ready;
  int64_t count = 0;  // values per channel over every replica, for the backward

  Normalization() = default;
  Normalization(at::Tensor mean_, at::Tensor invstd_, int64_t count_, bool shared)
      : mean(std::move(mean_)), invstd(std::move(invstd_)),
        ready(shared ? mark_ready(current_stream(mean.device())) : nullptr), count(count_) {}
};

// The master's own arguments of the call.
struct MasterCall {
  OptTensor running_mean, running_var, num_batches_tracked;
  std::optional<double> momentum;
  double eps;
  std::string layer;
};

// A failed check, explained and raised by its function in syncbn.functions.stats (each message
// has one text), as a python_error that crosses threads and the autograd engine.
template <typename... Args>
[[noreturn]] void raise_failed_check(const char* check, const Args&... args) {
  python_error error;
  {
    pybind11::gil_scoped_acquire gil;
    try {
      pybind11::module_::import("syncbn.functions.stats").attr(check)(args...);
      PyErr_SetString(PyExc_AssertionError, (std::string(check) + " passed what the native path failed").c_str());
    } catch (pybind11::error_already_set& raised) {
      raised.restore();
    }
    error.persist();
  }
  throw std::move(error);
}

void check_parts_agree(const std::vector<StatsPart>& parts, const std::string& layer) {
  const auto disagrees = [&](const StatsPart& part) {
    return part.mean.numel() != parts[0].mean.numel() || part.dtype != parts[0].dtype;
  };
  if (std::none_of(parts.begin(), parts.end(), disagrees)) return;
  std::vector<int64_t> channels;
  std::vector<at::ScalarType> dtypes;
  for (const auto& part : parts) {
    channels.push_back(part.mean.numel());
    dtypes.push_back(part.dtype);
  }
  raise_failed_check("check_inputs_agree", layer, channels, dtypes);
}

void check_values_per_channel(const std::vector<StatsPart>& parts, int64_t total, const std::string& layer) {
  if (total != 1) return;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& part : parts) shapes.push_back(part.sizes);
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

// A synchronized backward on a CUDA stream that a graph captures: refused before any work, as the
// forward is (functions/synchronization/synchronizer.py: check_not_captured).
void check_not_capturing(const at::Device& device, const std::string& layer) {
  if (device.type() != c10::DeviceType::CUDA) return;
  if (capturing(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA), device)) {
    raise_failed_check("check_not_capturing", true, layer, "backward");
  }
}

// The collectives' rows (functions/synchronization/distributed.py, which sets this once: set_row_layout).
struct RowLayout {
  int64_t header = 0, agreeing = 0, failed = 0, shape_dims = 0, identities = 0;
};

RowLayout& row_layout() {
  static RowLayout layout;
  return layout;
}

// This process's ranks, as Python holds them (functions.synchronization.synchronizer.Synchronizer), or none.
// The rows are built, merged, unpacked and (read at once, where they pass) judged here; Python is
// called for the collectives, for the checks where they fail, and, where they are deferred, to
// queue the verdicts that this copies to host memory (functions/synchronization/checks.py reads them later). Made
// with the GIL held (the binding), which reads the call's identity (Synchronizer.native:
// functions.synchronization.distributed.native_ranks); its calls take the GIL; kept by the backward node and
// released under the GIL.
class Ranks {
 public:
  explicit Ranks(PyObject* sync) : sync_(sync) {
    if (!sync_) return;
    Py_INCREF(sync_);
    const auto native = pybind11::reinterpret_borrow<pybind11::object>(sync_).attr("native").cast<pybind11::tuple>();
    layer_id_ = native[0].cast<double>();
    number_ = native[1].cast<double>();
    dtype_code_ = native[2].cast<double>();
    world_ = native[3].cast<int64_t>();
    reads_at_once_ = native[4].cast<bool>();
  }
  Ranks(const Ranks&) = delete;
  Ranks& operator=(const Ranks&) = delete;
  ~Ranks() {
    if (sync_ && Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      Py_DECREF(sync_);
    }
  }
  explicit operator bool() const { return sync_ != nullptr; }

  // This process failed in a backward pass: Synchronizer.fail_backward tells the other ranks
  // through the backward collective they wait in. Its own failure is reported, not raised: the
  // error that caused it is the one the caller re-raises.
  void fail_backward() const {
    pybind11::gil_scoped_acquire gil;
    pybind11::error_scope raised;  // the error being handled may still be Python's current one
    try {
      python().attr("fail_backward")();
    } catch (pybind11::error_already_set& error) {
      error.discard_as_unraisable("syncbn: telling the other ranks of a failed backward pass");
    }
  }

  // The global count of the forward that merged, as Synchronizer.count holds it: an int, or the
  // device total where the checks are deferred; `process` without ranks.
  pybind11::object count(int64_t process) const {
    if (device_count_.defined()) return pybind11::cast(device_count_);
    return pybind11::int_(sync_ ? count_ : process);
  }

  // The count that a checkpoint's first run returned (count()), for its recomputation's backward:
  // an int, returned, or the device total (then 1: the sums are divided by it).
  int64_t take_count(pybind11::handle count) {
    if (THPVariable_Check(count.ptr())) {
      device_count_ = THPVariable_Unpack(count.ptr());
      return 1;
    }
    count_ = count.cast<int64_t>();
    return count_;
  }

  // (mean, var) over every rank, from this process's (count, mean, M2) of an input of `sizes`:
  // one all_gather of the row [header, mean, M2], the rows merged in rank order with the running
  // statistics' update (where they pass the checks: merge_gathered_stats).
  std::tuple<at::Tensor, at::Tensor> merge(int64_t count, const at::Tensor& mean, const at::Tensor& m2,
                                           const std::vector<int64_t>& sizes, const MasterCall& call) {
    const auto& layout = row_layout();
    std::vector<double> head{layer_id_, number_, dtype_code_, 0.0, double(sizes.size())};
    for (int64_t d = 0; d < layout.shape_dims; ++d) head.push_back(d < int64_t(sizes.size()) ? double(sizes[d]) : 0.0);
    head.push_back(double(count));
    const auto row = ops().pack_row.call(head, mean, m2);
    at::Tensor rows;
    {
      pybind11::gil_scoped_acquire gil;
      rows = python().attr("gather_rows")(row).cast<at::Tensor>();
    }
    auto [total, merged_mean, var, valid] =
        ops().merge_gathered_stats.call(rows, layout.header, layout.agreeing, layout.failed, call.running_mean,
                                        call.running_var, call.num_batches_tracked, call.momentum);
    if (!reads_at_once_) {  // read later, from host memory, where Python queues it
      const auto verdict = to_host(rows.narrow(1, 0, layout.header), valid);
      pybind11::gil_scoped_acquire gil;
      python().attr("defer_gathered")(verdict.valid, verdict.values, ready_object(verdict.ready));
    } else if (!valid.item<bool>()) {  // failed: Python explains and raises
      pybind11::gil_scoped_acquire gil;
      python().attr("judge_gathered")(valid, rows);
    }
    if (reads_at_once_) {
      count_ = int64_t(total.item<double>());
    } else {
      device_count_ = total;  // never read on the host: the backward divides by it on the device
    }
    return {merged_mean, var};
  }

  // (sum_dy, sum_dy_xmu, count) over every rank, as backward_elemt takes them: one all_reduce of
  // the row [id, id^2, n, n^2, sum_dy, sum_dy_xmu].
  std::tuple<at::Tensor, at::Tensor, int64_t> sum(const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu) const {
    const std::vector<double> identities{layer_id_, layer_id_ * layer_id_, number_, number_ * number_};
    const auto row = ops().pack_row.call(identities, sum_dy, sum_dy_xmu);
    {
      pybind11::gil_scoped_acquire gil;
      python().attr("reduce_row")(row);
    }
    if (!reads_at_once_) {  // read later, from host memory, where Python queues it
      const auto verdict = to_host(row.narrow(0, 0, row_layout().identities), at::Tensor());
      pybind11::gil_scoped_acquire gil;
      python().attr("defer_summed")(verdict.values, ready_object(verdict.ready));
    } else if (!identities_agree(row)) {  // failed: Python explains and raises
      pybind11::gil_scoped_acquire gil;
      python().attr("judge_summed")(row);
    }
    auto [total_dy, total_dy_xmu] = ops().unpack_row.call(row, row_layout().identities, sum_dy.scalar_type());
    if (device_count_.defined()) {  // functions.operators.reference.sums_per_value: the kernel divides by 1
      return {total_dy / device_count_, total_dy_xmu / device_count_, 1};
    }
    return {total_dy, total_dy_xmu, count_};
  }

 private:
  pybind11::object python() const { return pybind11::reinterpret_borrow<pybind11::object>(sync_); }

  // The ranks are at the same call of the same layer iff world * sum(v^2) == sum(v)^2 for the
  // layer id and the call number (functions.synchronization.distributed._explain_backward); read at once.
  bool identities_agree(const at::Tensor& row) const {
    const auto summed = row.narrow(0, 0, 4).cpu();
    const double* v = summed.const_data_ptr<double>();
    const double world = double(world_);
    return world * v[1] == v[0] * v[0] && world * v[3] == v[2] * v[2];
  }

  PyObject* sync_;
  double layer_id_ = 0, number_ = 0, dtype_code_ = -1;
  int64_t world_ = 1;
  bool reads_at_once_ = true;
  int64_t count_ = -1;       // the global count, where the checks are read at once
  at::Tensor device_count_;  // else the total as a 0-dim float64 on the collective's device
};

// merge_replicas where every part is on the host and no ranks take part: Chan's merge and the
// normalization as two loops (merge_stats's and normalization_stats's: the same bits), not a dozen
// ATen calls. The merge is the one serial step of a meeting: every other replica waits through it.
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

// On the master: the replicas' statistics merged (Chan's formula, in replica order) and, with
// ranks, over every rank; the running statistics updated once; mean and invstd as the
// elementwise kernels take them.
Normalization merge_replicas(std::vector<StatsPart>& parts, const MasterCall& call, Ranks& ranks) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_parts_agree(parts, call.layer);
  const auto device = parts[0].mean.device();
  std::vector<at::Tensor> means, m2s;
  std::vector<double> counts;
  int64_t total = 0;
  for (auto& part : parts) {
    const int64_t count = part.sizes[1] ? c10::multiply_integers(part.sizes) / part.sizes[1] : 0;
    auto [mean, m2] = fetch_pair(part.mean, part.m2, device, part.ready);
    means.push_back(mean);
    m2s.push_back(m2);
    counts.push_back(double(count));
    total += count;
  }
  if (!ranks) check_values_per_channel(parts, total, call.layer);  // else the ranks' checks, over all of them
  const auto acc = accumulation_type(parts[0].dtype);
  const bool on_host = std::all_of(parts.begin(), parts.end(), [](const StatsPart& part) {
    return is_host_vector(part.mean) && is_host_vector(part.m2) && part.mean.scalar_type() == at::kDouble &&
           part.m2.scalar_type() == at::kDouble;
  });
  if (on_host && !ranks && total > 0) return merge_on_host(parts, counts, call, total, acc);
  at::Tensor mean, var;
  if (parts.size() == 1 && ranks) {
    std::tie(mean, var) = ranks.merge(total, means[0], m2s[0], parts[0].sizes, call);
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
      std::tie(mean, var) = ranks.merge(total, mean, var * double(total), sizes, call);
    } else {
      update_running_stats(call.running_mean, call.running_var, call.num_batches_tracked, call.momentum, mean, var,
                           total);
    }
  }
  // other replicas read these on their streams (behind the constructor's event); the only one on its own
  return Normalization(mean.to(acc), (var + call.eps).rsqrt().to(acc), total, /*shared=*/parts.size() > 1);
}

// One replica's (sum_dy, sum_dy_xmu), after the work that made them.
struct SumsPart {
  at::Tensor sum_dy, sum_dy_xmu;
  Ready ready;
};

// The sums every replica's input gradient takes, on the master's device; made, as Normalization,
// only from finished tensors, its event recorded after them.
struct Sums {
  at::Tensor sum_dy, sum_dy_xmu;
  Ready ready;
  int64_t count = -1;  // with ranks: the count that backward_elemt divides by (-1: the forward's)

  Sums() = default;
  Sums(at::Tensor sum_dy_, at::Tensor sum_dy_xmu_, int64_t count_, bool shared)
      : sum_dy(std::move(sum_dy_)), sum_dy_xmu(std::move(sum_dy_xmu_)),
        ready(shared ? mark_ready(current_stream(sum_dy.device())) : nullptr), count(count_) {}
};

bool are_host_vectors_alike(const std::vector<at::Tensor>& ts) {
  const auto dtype = ts[0].scalar_type();
  return (dtype == at::kFloat || dtype == at::kDouble) && std::all_of(ts.begin(), ts.end(), [&](const at::Tensor& t) {
           return is_host_vector(t) && t.scalar_type() == dtype && t.numel() == ts[0].numel();
         });
}

// Host vectors summed per channel in replica order, in their dtype (the bits of stacking and
// summing a few replicas): one loop where that takes two ATen calls (the merge is a meeting's
// serial step).
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

// On the master: the replicas' sums, summed in replica order, then over the ranks.
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

// A meeting of this replica with the others of its process (none: it is the only one).
// `stream`: this replica's stream on its device (none on the CPU). The replica that arrives last
// runs the master's combine on its own thread, so each replica's combine carries its stream: the
// master's runs on the master's stream, as if the master ran it.
template <typename Part, typename Result>
Result meet(const std::shared_ptr<ReplicaRound>& round, const char* direction, int64_t call, int64_t index,
            const OptStream& stream, Part part, const std::function<std::vector<Result>(std::vector<Part>&)>& combine,
            bool (*abandoned)() = nullptr) {
  if (!round) {
    std::vector<Part> parts;
    parts.push_back(std::move(part));
    return std::move(combine(parts)[0]);
  }
  const std::function<std::vector<Result>(std::vector<Part>&)> on_own_stream = [&](std::vector<Part>& parts) {
    std::optional<c10::StreamGuard> guard;
    if (stream) guard.emplace(*stream);
    return combine(parts);
  };
  return round->exchange<Part, Result>(direction, call, index, std::move(part), on_own_stream, abandoned);
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

}  // namespace

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

namespace {

// torch.utils.checkpoint's _StopRecomputationError: control flow, not a failure (non-reentrant
// checkpointing stops a recomputation with it once the tensors it needs are saved).
bool stops_recomputation(python_error& raised) {
  pybind11::gil_scoped_acquire gil;
  raised.persist();
  const auto* type = reinterpret_cast<PyTypeObject*>(raised.type);
  return type && std::string(type->tp_name) == "_StopRecomputationError";
}

// Run this replica's side of a call; its own failures break the round (if any) for the others.
template <typename Work>
auto as_replica(ReplicaRound* round, int64_t index, Work work) -> decltype(work()) {
  try {
    return work();
  } catch (const RoundBroken&) {
    throw;
  } catch (python_error& raised) {
    if (round && !stops_recomputation(raised)) round->abort(failure_reason(index, std::current_exception()));
    throw;
  } catch (...) {
    if (round) round->abort(failure_reason(index, std::current_exception()));
    throw;
  }
}

// ---- autograd ----

// Where a replica's call meets the others: its round (none: the only replica of its process),
// its index and call number there, and its process's ranks.
struct Meeting {
  std::shared_ptr<ReplicaRound> round;
  int64_t index = 0, call = 0;
  std::shared_ptr<Ranks> ranks;
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

  // This replica's per-channel sums met with every replica's and rank's: the totals that the
  // input gradient takes, and the count it divides them by. Every replica meets, whichever
  // gradients it wants: the others wait for its sums.
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
  torch::autograd::SavedVariable x, weight, bias, residual, mean, invstd;

  std::string name() const override { return "SyncBatchNormBackward"; }

  void release_variables() override {
    for (auto* saved : {&x, &weight, &bias, &residual, &mean, &invstd}) saved->reset_data();
  }

  torch::autograd::variable_list backward(const torch::autograd::variable_list& grads) {
    // unpacked with autograd on: an unpack hook may recompute a checkpointed region, which must
    // record its graph (torch.utils.checkpoint with use_reentrant=False)
    const auto input = x.unpack(), mean_ = mean.unpack(), invstd_ = invstd.unpack();
    const auto weight_ = weight.unpack(), bias_ = bias.unpack(), residual_ = residual.unpack();
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
    if (task_should_compute_output(0)) {
      result[0] = ops().backward_elemt.call(dy, input, mean_, invstd_, optional(weight_), sums.sum_dy, sums.sum_dy_xmu,
                                            c10::SymInt(total));
    }
    if (weight_.defined() && task_should_compute_output(1)) result[1] = (sum_dy_xmu * invstd_).to(weight_.scalar_type());
    if (bias_.defined() && task_should_compute_output(2)) result[2] = sum_dy.to(bias_.scalar_type());
    if (residual_.defined() && task_should_compute_output(3)) result[3] = dy;
    return result;
  }
};

// The in-place activated layer's backward (functions/inplace_abn.py has the math): from the
// output y and dy alone.
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
                               const std::optional<Normalization>& given) {
  if (given) return *given;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto [mean, m2] = ops().local_stats.call(x);
  const auto stream = current_stream(x.device());
  const auto ready = meeting.round ? mark_ready(stream) : nullptr;  // the master reads it
  StatsPart part{mean, m2, ready, x.scalar_type(), x.sizes().vec()};
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

using CallResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t>;

// One replica's call of a synchronized layer (see the file's comment): y, with the autograd
// history whose backward meets the other replicas (and ranks) again, and the replica's mean,
// invstd and its process's count (which a checkpoint's recomputation reuses as `given`).
CallResult sync_batch_norm(const Meeting& meeting, const at::Tensor& input, const OptTensor& weight,
                           const OptTensor& bias, const MasterCall& master_call, const OptTensor& residual,
                           std::optional<double> negative_slope, const std::optional<Normalization>& given) {
  return as_replica(meeting.round.get(), meeting.index, [&] {
    const auto w = undefined_if_none(weight), b = undefined_if_none(bias), z = undefined_if_none(residual);
    check_no_forward_grads(master_call.layer, {input, w, b, z});
    const at::Tensor x = input.contiguous(memory_format_of(input));
    const auto normalization = normalization_of(meeting, x, master_call, given);
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
      torch::autograd::set_history(y, node);
    }
    return std::make_tuple(y, normalization.mean, normalization.invstd, normalization.count);
  });
}

// One replica's call of a synchronized in-place activated layer: `x` written over with
// act((x - mean) * invstd * (|weight| + eps) + bias) (functions/inplace_abn.py), its history
// rebased on a node whose backward meets again; returns as sync_batch_norm, x as y.
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

void throw_replica_sync_error(const std::string& reason) {
  PyErr_SetString(replica_sync_error, reason.c_str());
  throw pybind11::error_already_set();
}

// A replica's call, `work(meeting, given)`, run without the GIL (the wait and the master's
// work); its errors raised as Python sees them. `sync`: the process master's Synchronizer where a
// process group takes part; `given`: None, or the (mean, invstd, count) that a checkpoint's first
// run returned, for its recomputation.
template <typename Work>
pybind11::tuple run_call(const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call,
                         const pybind11::object& sync, const pybind11::object& given, const Work& work) {
  namespace py = pybind11;
  const Meeting meeting{round, index, call, std::make_shared<Ranks>(sync.is_none() ? nullptr : sync.ptr())};
  std::optional<Normalization> normalization;
  if (!given.is_none()) {
    const auto kept = given.cast<py::tuple>();
    const auto count = meeting.ranks->take_count(kept[2]);
    normalization.emplace(kept[0].cast<at::Tensor>(), kept[1].cast<at::Tensor>(), count, /*shared=*/false);
  }
  std::optional<std::string> broken;
  std::optional<python_error> raised;  // a Python exception, as it is (checkpoint's control flow too)
  CallResult result;
  {
    py::gil_scoped_release no_gil;
    try {
      result = work(meeting, normalization);
    } catch (const RoundBroken& error) {
      broken = error.what();
    } catch (python_error& error) {
      raised.emplace(std::move(error));
    }
  }
  if (raised) {
    raised->restore();
    throw py::error_already_set();
  }
  if (broken) throw_replica_sync_error(*broken);
  const auto& [y, mean, invstd, count] = result;
  return py::make_tuple(y, mean, invstd, meeting.ranks->count(count));
}

void bind_sync_batch_norm(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ReplicaRound, std::shared_ptr<ReplicaRound>> round(
      m, "ReplicaRound", "The meeting of a layer's replicas in one step (src/replica_round.h)");
  round
      .def(py::init<int64_t, double, std::string, int64_t, double, int64_t>(), py::arg("size"), py::arg("timeout"),
           py::arg("layer"), py::arg("number"), py::arg("spin_us"), py::arg("cores") = 0)
      .def_property_readonly("size", &ReplicaRound::size)
      .def_property_readonly("spin_us", &ReplicaRound::spin_us, "How long a waiter polls before it sleeps")
      .def_property_readonly("cores", &ReplicaRound::cores,
                             "The CPUs the replicas share (0: unknown); waiters poll long only on spare ones")
      .def("abort", &ReplicaRound::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "set_row_layout",
      [](int64_t header, int64_t agreeing, int64_t failed, int64_t shape_dims, int64_t identities) {
        row_layout() = RowLayout{header, agreeing, failed, shape_dims, identities};
      },
      "The collectives' row layout (functions.synchronization.distributed.row_layout), set once at import");
  py::class_<ReadyEvent>(m, "ReadyEvent", "The event after a deferred verdict's copies to host memory")
      .def("query", &ReadyEvent::query, "Whether the device has run the copies")
      .def("synchronize", &ReadyEvent::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Wait until the device has run the copies");
  m.def(
      "current_backward_pass",
      [] {
        const auto* task = current_graph_task();
        return task ? py::make_tuple(task->has_error_.load(), task->keep_graph_) : py::object(py::none());
      },
      "(failed, retain_graph) of the backward pass this thread runs, read from torch's graph task as the "
      "meetings read it (src/graph_task.h); None outside one");
  m.def("graph_task_reading_holds", &graph_task_reading_holds,
        "Inside a backward pass: whether the graph task read from torch's struct (src/graph_task.h) agrees with "
        "the exported accessors of its other members");
  m.def(
      "use_graph_task_reading", [](bool checked) { graph_task_reading_checked().store(checked); },
      "Whether backward waiters read their graph task's failure (set once the reading was checked)");
  m.def("set_replica_sync_error", [](py::object type) {
    replica_sync_error = type.release().ptr();  // kept for the life of the process
  });
  m.def(
      "sync_batch_norm",
      [](const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call, const at::Tensor& input,
         const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean, const OptTensor& running_var,
         const OptTensor& num_batches_tracked, std::optional<double> momentum, double eps, const OptTensor& residual,
         std::optional<double> negative_slope, const std::string& layer, const py::object& sync,
         const py::object& given) {
        const MasterCall master{running_mean, running_var, num_batches_tracked, momentum, eps, layer};
        return run_call(round, index, call, sync, given, [&](const Meeting& meeting, const auto& normalization) {
          return sync_batch_norm(meeting, input, weight, bias, master, residual, negative_slope, normalization);
        });
      },
      py::arg("round").none(true), py::arg("index"), py::arg("call"), py::arg("input"), py::arg("weight"),
      py::arg("bias"), py::arg("running_mean"), py::arg("running_var"), py::arg("num_batches_tracked"),
      py::arg("momentum"), py::arg("eps"), py::arg("residual"), py::arg("negative_slope"), py::arg("layer"),
      py::arg("sync"), py::arg("given"),
      "One replica's call of a synchronized layer: (y, mean, invstd, count) (see src/sync_batch_norm.cpp)");
  m.def(
      "inplace_abn",
      [](const std::shared_ptr<ReplicaRound>& round, int64_t index, int64_t call, const at::Tensor& x,
         const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean, const OptTensor& running_var,
         const OptTensor& num_batches_tracked, std::optional<double> momentum, double eps,
         const std::string& activation, double activation_param, const std::string& layer, const py::object& sync,
         const py::object& given) {
        const MasterCall master{running_mean, running_var, num_batches_tracked, momentum, eps, layer};
        return run_call(round, index, call, sync, given, [&](const Meeting& meeting, const auto& normalization) {
          return inplace_abn(meeting, x, weight, bias, master, activation, activation_param, normalization);
        });
      },
      py::arg("round").none(true), py::arg("index"), py::arg("call"), py::arg("x"), py::arg("weight"), py::arg("bias"),
      py::arg("running_mean"), py::arg("running_var"), py::arg("num_batches_tracked"), py::arg("momentum"),
      py::arg("eps"), py::arg("activation"), py::arg("activation_param"), py::arg("layer"), py::arg("sync"),
      py::arg("given"),
      "One replica's call of a synchronized in-place activated layer: (x written over, mean, invstd, count)");
}

}  // namespace syncbn

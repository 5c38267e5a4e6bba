// What the native synchronized calls share: the operators, the parts replicas post and what the
// master's merge hands back, the meeting, and how a replica's failure breaks its round.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "operators.h"
#include "replica_round.h"

namespace syncbn::native {

using OptTensor = std::optional<at::Tensor>;
using OptStream = std::optional<c10::Stream>;
using Ready = std::shared_ptr<c10::Event>;

extern PyObject* replica_sync_error;  // syncbn.functions.ReplicaSyncError, once Python has set it

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
  using MaskedStats = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&);
  c10::TypedOperatorHandle<MaskedStats> masked_local_stats = op<MaskedStats>("syncbn::masked_local_stats");
  using MaskedElemt = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
  c10::TypedOperatorHandle<MaskedElemt> masked_backward_elemt = op<MaskedElemt>("syncbn::masked_backward_elemt");
};

const Operators& ops();

// The stream this thread runs `device`'s work on (none for the CPU).
OptStream current_stream(const at::Device& device);
// An event after the work queued so far on `stream` (none off CUDA).
Ready mark_ready(const OptStream& stream);
// `t` on `device`, usable on this thread's current stream there, after `ready`.
at::Tensor fetch(const at::Tensor& t, const at::Device& device, const Ready& ready);
// Two (C,) tensors of one device and dtype, as fetch gives them, across devices in one copy.
std::pair<at::Tensor, at::Tensor> fetch_pair(const at::Tensor& a, const at::Tensor& b, const at::Device& device,
                                             const Ready& ready);

// One replica's statistics of its input, after the work that made them.
struct StatsPart {
  at::Tensor mean, m2;  // (C,) float64 on the replica's device
  Ready ready;
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  int64_t count = -1;  // a mask's valid positions (-1: no mask, every value counts)
};

// Made only once the work on mean and invstd is queued: the constructor records the event that
// hands them to the other replicas (`shared`).
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

// Refuses a synchronized backward on a stream that a CUDA graph captures, as
// syncbn.functions.synchronization.synchronizer.check_not_captured does the forward.
void check_not_capturing(const at::Device& device, const std::string& layer);

// Set once from syncbn.functions.synchronization.distributed.row_layout.
struct RowLayout {
  int64_t header = 0, agreeing = 0, failed = 0, shape_dims = 0, identities = 0;
};

RowLayout& row_layout();

class Ranks;

// On the master: the replicas' statistics merged (Chan's formula, in replica order), then over the
// ranks; the running statistics updated once.
Normalization merge_replicas(std::vector<StatsPart>& parts, const MasterCall& call, Ranks& ranks);

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

// On the master: the replicas' sums, summed in replica order, then over the ranks.
Sums sum_replicas(std::vector<SumsPart>& parts, const Ranks& ranks);

// The last to arrive runs the master's combine on its own thread, so the combine carries its
// replica's `stream` (none on the CPU) to run as if the master ran it.
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

// Raise `message` as syncbn.functions.ReplicaSyncError from a thread without the GIL (an autograd
// engine thread): the engine re-raises a python_error as the Python exception it holds.
[[noreturn]] void raise_replica_sync_error(const std::string& message);

// torch.utils.checkpoint's _StopRecomputationError: control flow, not a failure.
bool stops_recomputation(python_error& raised);

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

// Where a replica's call meets the others: its round (none: the only replica of its process),
// its index and call number there, and its process's ranks.
struct Meeting {
  std::shared_ptr<ReplicaRound> round;
  int64_t index = 0, call = 0;
  std::shared_ptr<Ranks> ranks;
};

// What a synchronized call returns: y, this replica's mean and invstd, its process's count.
using CallResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t>;

// `given`: a checkpoint's recomputation's normalization. `mask`: bool (N, *spatial), the
// statistics over its valid positions (syncbn.functions.masking).
CallResult sync_batch_norm(const Meeting& meeting, const at::Tensor& input, const OptTensor& weight,
                           const OptTensor& bias, const MasterCall& master_call, const OptTensor& residual,
                           std::optional<double> negative_slope, const std::optional<Normalization>& given,
                           const OptTensor& mask);
CallResult inplace_abn(const Meeting& meeting, const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                       const MasterCall& master_call, const std::string& activation, double activation_param,
                       const std::optional<Normalization>& given);

}  // namespace syncbn::native

// This process's ranks in a native synchronized call: the collectives' rows built, merged and
// judged in C++, Python called for the collectives and the checks' explanations.
#pragma once

#include <torch/csrc/autograd/python_variable.h>

#include "meeting.h"

namespace syncbn::native {

// A deferred verdict's event, with the torch.cuda.Event methods that
// syncbn.functions.synchronization.checks calls on it.
struct ReadyEvent {
  Ready event;
  bool query() const { return event->query(); }
  void synchronize() const { event->synchronize(); }
};

// A verdict copied to pinned host memory without waiting, readable once `ready` has passed (none:
// on the host already).
struct HostVerdict {
  at::Tensor values, valid;  // `valid` undefined where the verdict has no device judgement
  Ready ready;
};

inline HostVerdict to_host(const at::Tensor& values, const at::Tensor& valid) {
  if (values.is_cpu()) return {values, valid, nullptr};
  const auto copy = [](const at::Tensor& t) { return t.defined() ? t.to(at::kCPU, /*non_blocking=*/true) : t; };
  auto host_values = copy(values), host_valid = copy(valid);
  return {host_values, host_valid, mark_ready(current_stream(values.device()))};
}

inline pybind11::object ready_object(const Ready& ready) {
  return ready ? pybind11::cast(ReadyEvent{ready}) : pybind11::none();
}



// This process's ranks (syncbn.functions.synchronization.synchronizer.Synchronizer), or none; Python
// is called only for the collectives, failed checks and deferred verdicts. Made with the GIL held
// (it reads Synchronizer.native); its calls and its release take the GIL themselves.
class Ranks {
 public:
  explicit Ranks(PyObject* sync) : sync_(sync) {
    if (!sync_) return;
    Py_INCREF(sync_);
    const auto native = pybind11::reinterpret_borrow<pybind11::object>(sync_).attr("native").cast<pybind11::tuple>();
    layer_id_ = native[0].cast<double>();
    number_ = native[1].cast<double>();
    dtype_code_ = native[2].cast<double>();
    masked_dtype_code_ = native[3].cast<double>();
    world_ = native[4].cast<int64_t>();
    reads_at_once_ = native[5].cast<bool>();
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

  // Its own failure is reported, not raised: the caller re-raises the error that caused it.
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

  // The global count of the forward that merged, where the checks were read at once (a masked call's).
  int64_t global_count() const { return count_; }

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

  // (mean, var) over every rank: one all_gather of [header, mean, M2], merged in rank order. A masked
  // call's running statistics are left to the caller, which must reject a global count of 0 that
  // merge_gathered_stats lets pass.
  std::tuple<at::Tensor, at::Tensor> merge(int64_t count, const at::Tensor& mean, const at::Tensor& m2,
                                           const std::vector<int64_t>& sizes, const MasterCall& call, bool masked) {
    const bool reads_at_once = reads_at_once_ || masked;
    const auto& layout = row_layout();
    std::vector<double> head{layer_id_, number_, masked ? masked_dtype_code_ : dtype_code_, 0.0, double(sizes.size())};
    for (int64_t d = 0; d < layout.shape_dims; ++d) head.push_back(d < int64_t(sizes.size()) ? double(sizes[d]) : 0.0);
    head.push_back(double(count));
    const auto row = ops().pack_row.call(head, mean, m2);
    at::Tensor rows;
    {
      pybind11::gil_scoped_acquire gil;
      rows = python().attr("gather_rows")(row).cast<at::Tensor>();
    }
    const auto running = [masked](const OptTensor& t) { return masked ? std::nullopt : t; };
    auto [total, merged_mean, var, valid] = ops().merge_gathered_stats.call(
        rows, layout.header, layout.agreeing, layout.failed, running(call.running_mean), running(call.running_var),
        running(call.num_batches_tracked), call.momentum);
    if (!reads_at_once) {  // read later, from host memory, where Python queues it
      const auto verdict = to_host(rows.narrow(1, 0, layout.header), valid);
      pybind11::gil_scoped_acquire gil;
      python().attr("defer_gathered")(verdict.valid, verdict.values, ready_object(verdict.ready));
    } else if (!valid.item<bool>()) {  // failed: Python explains and raises
      pybind11::gil_scoped_acquire gil;
      python().attr("judge_gathered")(valid, rows);
    }
    if (reads_at_once) {
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
    if (device_count_.defined()) {  // syncbn.functions.operators.reference.sums_per_value: the kernel divides by 1
      return {total_dy / device_count_, total_dy_xmu / device_count_, 1};
    }
    return {total_dy, total_dy_xmu, count_};
  }

 private:
  pybind11::object python() const { return pybind11::reinterpret_borrow<pybind11::object>(sync_); }

  // The ranks are at the same call of the same layer iff world * sum(v^2) == sum(v)^2 for the
  // layer id and the call number (syncbn.functions.synchronization.distributed._explain_backward); read at once.
  bool identities_agree(const at::Tensor& row) const {
    const auto summed = row.narrow(0, 0, 4).cpu();
    const double* v = summed.const_data_ptr<double>();
    const double world = double(world_);
    return world * v[1] == v[0] * v[0] && world * v[3] == v[2] * v[2];
  }

  PyObject* sync_;
  double layer_id_ = 0, number_ = 0, dtype_code_ = -1, masked_dtype_code_ = -1;
  int64_t world_ = 1;
  bool reads_at_once_ = true;
  int64_t count_ = -1;       // the global count, where the checks are read at once
  at::Tensor device_count_;  // else the total as a 0-dim float64 on the collective's device
};

}  // namespace syncbn::native

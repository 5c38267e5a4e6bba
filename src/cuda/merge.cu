// The merge of the rows that an all_gather over ranks brought (merge_gathered_stats, declared in
// src/kernels.inc): judged, merged and the running statistics updated in one kernel, which every
// rank runs on the same rows (the same bits everywhere), with no host read.
#include "batch_norm_cuda.h"
#include "host.cuh"

namespace syncbn::cuda {
namespace {

// The running statistics' update where the rows are valid (null pointers: none to update).
template <typename running_t>
struct RunningUpdate {
  running_t* mean;
  running_t* var;
  const int64_t* num_batches_tracked;  // read before its increment (queued after this kernel)
  double momentum;
  bool cumulative;  // no momentum: the factor is 1 / (num_batches_tracked + 1)
};

// One thread per channel (one block where C is 0). Every thread judges the R rows' headers and
// adds their counts itself (R is the number of ranks: a few reads each, all threads the same
// addresses), so that no thread waits for another. Chan in row order, the CPU's merge_moments'
// formula (not its bits: nvcc contracts to FMAs); every rank runs this kernel on the same rows.
template <typename running_t>
__global__ void __launch_bounds__(kMergeThreads)
    merge_gathered_kernel(const double* rows, int64_t R, int64_t width, int64_t header, int64_t agreeing,
                          int64_t flag, RunningUpdate<running_t> running, double* mean, double* var, double* total_out,
                          bool* valid_out) {
  const int64_t C = (width - header) / 2;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  double total = 0;
  bool valid = true;
  for (int64_t r = 0; r < R; ++r) {
    const double* row = rows + r * width;
    total += row[header - 1];
    for (int64_t k = 0; k < agreeing; ++k) valid = valid && row[k] == rows[k];
    if (flag >= 0) valid = valid && row[flag] == 0;
  }
  valid = valid && is_whole_count(total) && total != 1;
  if (c == 0) {
    *total_out = total;
    *valid_out = valid;
  }
  if (c >= C) return;
  double mu = 0, m2 = 0;
  if (total > 0) {
    double weighted = 0;
    for (int64_t r = 0; r < R; ++r) weighted += rows[r * width + header - 1] * rows[r * width + header + c];
    mu = weighted / total;
    for (int64_t r = 0; r < R; ++r) {
      const double* row = rows + r * width;
      const double d = row[header + c] - mu;
      m2 += row[header + C + c] + row[header - 1] * d * d;
    }
  }
  const double v = total > 0 ? m2 / total : 1.0;
  mean[c] = mu;
  var[c] = v;
  if (running.mean == nullptr || !valid || !(total > 1)) return;
  const double factor = running.cumulative ? 1.0 / double(*running.num_batches_tracked + 1) : running.momentum;
  running.mean[c] = running_t(mu * factor + double(running.mean[c]) * (1 - factor));
  running.var[c] = running_t(v * (total / (total - 1)) * factor + double(running.var[c]) * (1 - factor));
}

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The running statistics, checked for the kernel: (C,) contiguous, one floating dtype, on the
// rows' device; num_batches_tracked int64 there. Whether there is anything to update.
bool updates_running(const at::Tensor& rows, int64_t C, const std::optional<at::Tensor>& running_mean,
                     const std::optional<at::Tensor>& running_var,
                     const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum) {
  if (defined(num_batches_tracked)) {
    TORCH_CHECK(num_batches_tracked->device() == rows.device() && num_batches_tracked->scalar_type() == at::kLong,
                "syncbn.cuda.merge_gathered_stats: num_batches_tracked must be int64 on ", rows.device());
  }
  if (!defined(running_mean) || !defined(running_var) || !(momentum || defined(num_batches_tracked))) return false;
  for (const auto* t : {&*running_mean, &*running_var}) {
    TORCH_CHECK(t->device() == rows.device() && t->numel() == C && t->is_contiguous() &&
                    t->scalar_type() == running_mean->scalar_type(),
                "syncbn.cuda.merge_gathered_stats: the running statistics must be contiguous (", C,
                ",) tensors of one dtype on ", rows.device());
  }
  return true;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_gathered_stats(
    const at::Tensor& rows, int64_t header, int64_t agreeing, std::optional<int64_t> flag,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum) {
  const int64_t C = check_gathered_rows(rows, header, agreeing, flag);
  TORCH_CHECK(rows.is_cuda(), "syncbn.cuda.merge_gathered_stats: expected CUDA rows, got them on ", rows.device());
  c10::cuda::CUDAGuard guard(rows.device());
  const auto r = rows.contiguous();
  const bool updates = updates_running(r, C, running_mean, running_var, num_batches_tracked, momentum);
  const bool counts = defined(num_batches_tracked);
  auto mean = at::empty({C}, r.options()), var = at::empty({C}, r.options()), total = at::empty({}, r.options());
  auto valid = at::empty({}, r.options().dtype(at::kBool));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto blocks = unsigned(std::max<int64_t>(1, ceil_div(C, kMergeThreads)));
  const auto dtype = updates ? running_mean->scalar_type() : at::kDouble;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "syncbn_cuda_merge_gathered_stats", [&] {
    RunningUpdate<scalar_t> update{nullptr, nullptr, nullptr, momentum.value_or(0.0), !momentum.has_value()};
    if (updates) {
      update.mean = running_mean->data_ptr<scalar_t>();
      update.var = running_var->data_ptr<scalar_t>();
      update.num_batches_tracked = counts ? num_batches_tracked->const_data_ptr<int64_t>() : nullptr;
    }
    merge_gathered_kernel<scalar_t><<<blocks, kMergeThreads, 0, stream>>>(
        r.const_data_ptr<double>(), r.size(0), r.size(1), header, agreeing, flag.value_or(-1), update,
        mean.data_ptr<double>(), var.data_ptr<double>(), total.data_ptr<double>(), valid.data_ptr<bool>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // after the kernel, on its stream: the cumulative average read the count before its increment
  if (counts) num_batches_tracked->add_(valid);
  return {total, mean, var, valid};
}

}  // namespace syncbn::cuda

// What the CPU and CUDA kernels share as implementations of the torch.ops.syncbn operators,
// whose schemas are declared once, in syncbn.functions.operators.ops: the output convention of
// backward_affine_act, the lone replica's training forward (composed of the other operators),
// and the registration of one device's kernels.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <tuple>

namespace syncbn {

// The dtype that statistics and per-channel coefficients are computed in: float64 for float64
// inputs, float32 for the others (half inputs included).
inline at::ScalarType accumulation_type(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

// A contiguous (C,) tensor on the host, whose values the composite operators read in a loop.
inline bool is_host_vector(const at::Tensor& t) { return t.is_cpu() && t.dim() == 1 && t.is_contiguous(); }

// The layout that full-size outputs take: x's, where x is laid out channels-last and not also
// contiguous; contiguous otherwise (syncbn.functions.operators.reference.memory_format_of).
inline at::MemoryFormat memory_format_of(const at::Tensor& x) {
  if (x.is_contiguous()) return at::MemoryFormat::Contiguous;
  if (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

// merge_gathered_stats' arguments (src/kernels.inc): rows (R, header + 2C), header >= 1 (the
// count), agreeing <= header, flag a header column. Returns C.
inline int64_t check_gathered_rows(const at::Tensor& rows, int64_t header, int64_t agreeing,
                                   std::optional<int64_t> flag) {
  TORCH_CHECK(rows.dim() == 2 && header >= 1 && rows.size(1) >= header && (rows.size(1) - header) % 2 == 0,
              "syncbn.merge_gathered_stats: expected rows (R, header + 2C) with header ", header, ", got ",
              rows.sizes());
  TORCH_CHECK(0 <= agreeing && agreeing <= header && (!flag || (0 <= *flag && *flag < header)),
              "syncbn.merge_gathered_stats: agreeing (", agreeing, ") and flag must be within the ", header,
              " header columns");
  TORCH_CHECK(rows.scalar_type() == at::kDouble, "syncbn.merge_gathered_stats: expected float64 rows, got ",
              rows.scalar_type());
  return (rows.size(1) - header) / 2;
}

// merge_gathered_stats' rule for a total count that can update the running statistics: a whole
// number in [0, 2^63) (NaN fails every comparison), so that it converts to int64_t exactly.
#ifdef __CUDACC__
__host__ __device__
#endif
inline bool is_whole_count(double total) {
  return total >= 0 && total < 9223372036854775808.0 && total == static_cast<double>(static_cast<int64_t>(total));
}

// backward_affine_act's (dx, g, sum_g, sum_g_xmu): what was not asked for is an empty tensor
// (an operator returns tensors, never None), with x's options for dx and g, mean's for the sums.
using AffineActGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline AffineActGrads affine_act_outputs(const std::optional<at::Tensor>& dx, const std::optional<at::Tensor>& g,
                                         const std::optional<at::Tensor>& sum_g,
                                         const std::optional<at::Tensor>& sum_g_xmu, const at::Tensor& x,
                                         const at::Tensor& mean) {
  const auto or_empty = [](const std::optional<at::Tensor>& t, const at::Tensor& like) {
    return t && t->defined() ? *t : at::empty({0}, like.options());
  };
  return {or_empty(dx, x), or_empty(g, x), or_empty(sum_g, mean), or_empty(sum_g_xmu, mean)};
}

// running = (1 - factor) * running + factor * batch with the unbiased var * count / (count - 1);
// factor = momentum, or 1 / num_batches_tracked (after its increment) when momentum is None.
// num_batches_tracked counts every call, an empty batch (count 0) only counts. No host sync.
void update_running_stats(const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
                          const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum,
                          const at::Tensor& mean, const at::Tensor& var, int64_t count);

// update_running_stats' blend on the device, after num_batches_tracked's increment: running =
// (1 - factor) * running + factor * batch for the mean and the unbiased variance, only where the
// 0-dim bool `where` holds (undefined: everywhere). Nothing without momentum or num_batches_tracked.
void blend_running_stats(const at::Tensor& running_mean, const at::Tensor& running_var,
                         const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum,
                         const at::Tensor& mean, const at::Tensor& unbiased, const at::Tensor& where);

// (mean, invstd) in `acc` from the float64 mean and M2 of `count` values per channel: var = M2 /
// count (an empty batch: var 1), invstd = 1 / sqrt(var + eps); also var itself (float64). Where both
// are host vectors, one loop (invstd correctly rounded) instead of a handful of ATen
// calls (rsqrt, whose vectorized CPU kernel may be 1 ulp off; torch's own eval kernel on the CPU
// gives rsqrt's bits, which is why the frozen and eval paths keep rsqrt).
std::tuple<at::Tensor, at::Tensor, at::Tensor> normalization_stats(const at::Tensor& mean, const at::Tensor& m2,
                                                                  int64_t count, double eps, at::ScalarType acc);

// Host numbers (counts, a collective's header) as a float64 vector on `device`, copied from pinned
// memory without a wait where `device` is not the CPU (the caching host allocator keeps the block
// until the copy has run).
at::Tensor host_values_on(c10::ArrayRef<double> values, const at::Device& device);

// The float64 row [head, a, b] on a's device (a and b 1-D floating tensors there): what one
// collective over ranks sends (syncbn.functions.synchronization.distributed: a forward's header, mean and M2; a
// backward's identities, sum_dy and sum_dy_xmu). One call instead of a handful of ATen calls;
// on the host, one pass.
at::Tensor pack_row(c10::ArrayRef<double> head, const at::Tensor& a, const at::Tensor& b);

// pack_row's inverse for two halves: row[head:head + C] and row[head + C:] (row 1-D float64 of
// head + 2C values) as new tensors in `dtype`: the sums that a backward's collective brought.
std::tuple<at::Tensor, at::Tensor> unpack_row(const at::Tensor& row, int64_t head, at::ScalarType dtype);

// A lone replica's training forward in one call: local_stats, update_running_stats and
// elemt_forward. Returns (y, mean, invstd), mean and invstd in the accumulation dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_train(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
    const std::optional<at::Tensor>& num_batches_tracked, std::optional<double> momentum, double eps,
    const std::optional<at::Tensor>& residual, std::optional<double> negative_slope);

}  // namespace syncbn

// The kernels of namespace NS (local_stats, merge_stats, merge_gathered_stats, elemt_forward,
// backward_reduce, backward_elemt, backward_affine_act, abn_*) and the composite operators, as
// impl calls on the torch::Library `m` of one dispatch key (in a file that includes
// <torch/library.h>).
#define SYNCBN_IMPL_KERNELS(m, NS)                                         \
  m.impl("local_stats", TORCH_FN(NS::local_stats));                       \
  m.impl("merge_stats", TORCH_FN(NS::merge_stats));                       \
  m.impl("elemt_forward", TORCH_FN(NS::elemt_forward));                   \
  m.impl("backward_reduce", TORCH_FN(NS::backward_reduce));               \
  m.impl("backward_elemt", TORCH_FN(NS::backward_elemt));                 \
  m.impl("backward_affine_act", TORCH_FN(NS::backward_affine_act));       \
  m.impl("abn_forward_", TORCH_FN(NS::abn_forward_));                     \
  m.impl("abn_backward_reduce", TORCH_FN(NS::abn_backward_reduce));       \
  m.impl("abn_backward_elemt", TORCH_FN(NS::abn_backward_elemt));         \
  m.impl("abn_backward_elemt_", TORCH_FN(NS::abn_backward_elemt_));       \
  m.impl("merge_gathered_stats", TORCH_FN(NS::merge_gathered_stats));     \
  m.impl("update_running_stats", TORCH_FN(syncbn::update_running_stats)); \
  m.impl("batch_norm_train", TORCH_FN(syncbn::batch_norm_train));         \
  m.impl("pack_row", TORCH_FN(syncbn::pack_row));                         \
  m.impl("unpack_row", TORCH_FN(syncbn::unpack_row));

// Registers (on) or unregisters (off) a set of kernels for one dispatch key: they live in a
// torch::Library whose destruction unregisters them. `impl(library)` makes the impl calls; the
// registration is recorded at the caller's file and line (what the dispatcher reports).
namespace syncbn {
template <typename Impl>
void switch_kernels(std::unique_ptr<torch::Library>& library, c10::DispatchKey key, bool on, Impl impl,
                    const char* file = __builtin_FILE(), uint32_t line = __builtin_LINE()) {
  if (!on) {
    library.reset();
  } else if (!library) {
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "syncbn", key, file, line);
    impl(*library);
  }
}
}  // namespace syncbn

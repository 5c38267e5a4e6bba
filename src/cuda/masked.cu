// The statistics of the valid positions of a padded batch on CUDA (the math:
// syncbn.functions.operators.reference_masked), in two passes of the reduction framework (sums about
// 0, then about their mean, whose residue corrects it, as the CPU kernels do); the masked input
// gradient is backward_elemt's op with a mask (elementwise.cu). One byte of mask per position,
// shared by every channel; the valid count stays on the device.
#include "batch_norm_cuda.h"
#include "accumulators.cuh"
#include "elementwise.cuh"
#include "operands.cuh"
#include "positions.cuh"
#include "reduction.cuh"

namespace syncbn::cuda {
namespace {

// sum(d) and sum(d^2) of each channel's valid values, d = x - center (center null: 0)
template <typename scalar_t>
struct MaskedSumsOp {
  using acc_t = at::opmath_type<scalar_t>;
  template <typename T>
  using Kind = Sums<T>;
  using Partial = Kind<double>;
  using State = acc_t;  // the center

  const scalar_t* x;
  Positions positions;
  const acc_t* center;
  double* first;
  double* second;

  __device__ __forceinline__ acc_t channel(int64_t c) const { return center == nullptr ? acc_t(0) : center[c]; }

  template <int V, bool kPerLane, typename Acc>
  __device__ __forceinline__ void item(int64_t i, const State* st, Acc& acc) const {
    const auto v = load_pack<V>(x, i);
    const int64_t p = positions.first(i);
    acc_t d[V], d2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {  // a select, not a product: padding may hold inf or nan
      d[j] = positions.valid(p, j) ? acc_t(v.val[j]) - st[kPerLane ? j : 0] : acc_t(0);
      d2[j] = d[j] * d[j];
    }
    add_pack<kPerLane>(acc, d, d2);
  }

  __device__ __forceinline__ void finish(int64_t c, const Partial& t) const {
    first[c] = t.sum_g;
    second[c] = t.sum_g_xmu;
  }
};

}  // namespace


std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_local_stats(const at::Tensor& input, const at::Tensor& mask) {
  const Operands o("masked_local_stats", input);
  const auto& [x, l] = std::tie(o.x, o.l);
  const auto m = positions_mask(mask, input, "masked_local_stats");
  const auto options = input.options().dtype(at::kDouble);
  const auto count = m.sum(at::kDouble);  // on the device: no host read
  if (l.rows() == 0 || l.C == 0) return {at::zeros({l.C}, options), at::zeros({l.C}, options), count};
  auto first = at::empty({l.C}, options), second = at::empty({l.C}, options);
  const auto n = count.clamp_min(1);
  at::Tensor center;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_masked_local_stats", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Positions positions(m.const_data_ptr<bool>(), l.C, l.S, l.channels_last);
    const bool vectorize = can_vectorize(l, kVec<scalar_t>, {x.const_data_ptr()});
    const MaskedSumsOp<scalar_t> raw{x.const_data_ptr<scalar_t>(), positions, nullptr, first.data_ptr<double>(),
                                     second.data_ptr<double>()};
    launch_reduction<scalar_t>(raw, l, vectorize, options, stream);
    center = (first / n).to(o.acc);  // a new tensor: the second pass writes `first` again, after this (stream order)
    const MaskedSumsOp<scalar_t> centered{x.const_data_ptr<scalar_t>(), positions, center.const_data_ptr<acc_t>(),
                                          first.data_ptr<double>(), second.data_ptr<double>()};
    launch_reduction<scalar_t>(centered, l, vectorize, options, stream);
  });
  const auto& residue = first;
  const auto m2 = second - residue * residue / n;
  // an inf makes the residue nan; the mean stays inf, as in torch's batch norm
  const auto mean = center.to(at::kDouble) + at::where(residue.isfinite(), residue / n, at::zeros_like(residue));
  return {mean, m2, count};
}

}  // namespace syncbn::cuda

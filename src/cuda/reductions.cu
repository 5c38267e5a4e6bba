// Per-channel reductions on CUDA: local statistics (count, mean, M2), the backward sums
// (sum_dy, sum_dy_xmu), and the one-pass backward of the affine transform and activation
// (dx, g and their sums); plus the merge of replicas' statistics.
//
// Values accumulate per thread in the accumulation type (float for float32, bfloat16 and
// float16, folded into double every kFoldUpdates values; double for float64); warps merge with
// shuffles, blocks through shared memory, and splits, all in float64 (accumulators.cuh, reduction.cuh).
// Welford runs on values shifted by a pivot (the channel's first value, 0 where that is not
// finite), so a float32 running mean carries the data's spread, not its offset.
#include "batch_norm_cuda.h"
#include "accumulators.cuh"
#include "elementwise.cuh"
#include "operands.cuh"
#include "reduction.cuh"

#include <limits>

namespace syncbn::cuda {
namespace {

template <typename scalar_t>
struct StatsOp {
  using acc_t = at::opmath_type<scalar_t>;
  template <typename T>
  using Kind = Welford<T>;
  using Partial = Kind<double>;
  using State = acc_t;  // the pivot
  // channels_last: 2 Welford lanes a thread; 4 lanes' float and double accumulators spilled from 80 registers
  static constexpr int kMaxLanes = 2;

  const scalar_t* x;
  int64_t first_stride;  // x[c * first_stride] is channel c's first value: S contiguous, 1 channels_last
  double* mean;
  double* m2;

  __device__ __forceinline__ acc_t channel(int64_t c) const {
    const acc_t first = acc_t(x[c * first_stride]);
    return isfinite(first) ? first : acc_t(0);
  }

  template <int V, bool kPerLane, typename Acc>
  __device__ __forceinline__ void item(int64_t i, const State* pivot, Acc& acc) const {
    const auto v = load_pack<V>(x, i);
    acc_t d[V];
#pragma unroll
    for (int j = 0; j < V; ++j) d[j] = acc_t(v.val[j]) - pivot[kPerLane ? j : 0];
    add_pack<kPerLane>(acc, d);
  }

  __device__ __forceinline__ void finish(int64_t c, const Partial& t) const {
    const double pivot = double(channel(c));
    const double m = pivot + t.mean;
    if (isfinite(m)) {
      mean[c] = m;
      m2[c] = t.m2;
    } else {  // inf or nan in the channel: torch's mean (inf stays inf), and M2 nan
      mean[c] = pivot + t.sum / t.n;
      m2[c] = __longlong_as_double(0x7ff8000000000000LL);
    }
  }
};

template <typename scalar_t>
struct GradSumsOp {
  using acc_t = at::opmath_type<scalar_t>;
  template <typename T>
  using Kind = Sums<T>;
  using Partial = Kind<double>;
  using State = acc_t;  // the channel's mean

  const scalar_t* dy;
  const scalar_t* x;
  const acc_t* mean;
  acc_t* sum_dy;
  acc_t* sum_dy_xmu;

  __device__ __forceinline__ acc_t channel(int64_t c) const { return mean[c]; }

  template <int V, bool kPerLane, typename Acc>
  __device__ __forceinline__ void item(int64_t i, const State* m, Acc& acc) const {
    const auto g = load_pack<V>(dy, i);
    const auto v = load_pack<V>(x, i);
    acc_t d[V], d_xmu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      d[j] = acc_t(g.val[j]);
      d_xmu[j] = d[j] * (acc_t(v.val[j]) - m[kPerLane ? j : 0]);
    }
    add_pack<kPerLane>(acc, d, d_xmu);
  }

  __device__ __forceinline__ void finish(int64_t c, const Partial& t) const {
    sum_dy[c] = acc_t(t.sum_g);
    sum_dy_xmu[c] = acc_t(t.sum_g_xmu);
  }
};

// g = dy * act'(pre); dx = g * scale; sum(g), sum(g * (x - mean)). Serves both frameworks:
// item(i, st) elementwise (no sums), item(i, st, acc) as a reduction.
template <typename scalar_t>
struct AffineActOp {
  using acc_t = at::opmath_type<scalar_t>;
  template <typename T>
  using Kind = Sums<T>;
  using Partial = Kind<double>;
  struct State {
    acc_t mean, scale, shift;
  };

  const scalar_t* dy;
  const scalar_t* x;
  const scalar_t* residual;  // null: none
  scalar_t* dx;              // null: not asked for
  scalar_t* g_out;           // null: not asked for
  const acc_t* mean;
  const acc_t* coef;  // (4, C): scale, shift
  int64_t C;
  acc_t slope;
  bool act;
  acc_t* sum_g;
  acc_t* sum_g_xmu;

  __device__ __forceinline__ State channel(int64_t c) const { return {mean[c], coef[c], coef[C + c]}; }

  // Acc void: the elementwise pass (no sums)
  template <int V, bool kPerLane, typename Acc>
  __device__ __forceinline__ void apply(int64_t i, const State* st, Acc* acc) const {
    const auto d = load_pack<V>(dy, i);
    const auto v = load_pack<V>(x, i);
    Pack<scalar_t, V> r{};
    if (act && residual != nullptr) r = load_pack<V>(residual, i);
    Pack<scalar_t, V> out_dx, out_g;
    acc_t gs[V], g_xmu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      const acc_t xv = acc_t(v.val[j]);
      acc_t g = acc_t(d.val[j]);
      if (act) {
        const acc_t pre = pre_activation(xv, s.scale, s.shift, residual != nullptr, acc_t(r.val[j]));
        if (negative_side(pre)) g *= slope;
      }
      out_dx.val[j] = scalar_t(g * s.scale);
      out_g.val[j] = scalar_t(g);
      gs[j] = g;
      g_xmu[j] = g * (xv - s.mean);
    }
    if constexpr (!std::is_void_v<Acc>) add_pack<kPerLane>(*acc, gs, g_xmu);
    if (dx != nullptr) store_pack<V>(dx, i, out_dx);
    if (g_out != nullptr) store_pack<V>(g_out, i, out_g);
  }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    apply<V, kPerLane, void>(i, st, nullptr);
  }
  template <int V, bool kPerLane, typename Acc>
  __device__ __forceinline__ void item(int64_t i, const State* st, Acc& acc) const {
    apply<V, kPerLane>(i, st, &acc);
  }

  __device__ __forceinline__ void finish(int64_t c, const Partial& t) const {
    sum_g[c] = acc_t(t.sum_g);
    sum_g_xmu[c] = acc_t(t.sum_g_xmu);
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> local_stats(const at::Tensor& input) {
  const Operands o("local_stats", input);
  const auto& x = o.x;
  const auto& l = o.l;
  const auto options = input.options().dtype(at::kDouble);
  if (l.rows() == 0 || l.C == 0) return {at::zeros({l.C}, options), at::zeros({l.C}, options)};
  auto mean = at::empty({l.C}, options), m2 = at::empty({l.C}, options);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_local_stats", [&] {
    const StatsOp<scalar_t> op{x.const_data_ptr<scalar_t>(), l.channels_last ? 1 : l.S, mean.data_ptr<double>(),
                               m2.data_ptr<double>()};
    launch_reduction<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.x}), options, stream);
  });
  return {mean, m2};
}

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& grad_output, const at::Tensor& input,
                                                   const at::Tensor& mean) {
  const Operands o("backward_reduce", input, &grad_output);
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  const auto m = o.channel(mean, "mean");
  if (l.numel() == 0) return {at::zeros_like(mean), at::zeros_like(mean)};
  // two allocations, not two rows of one: an operator's outputs never alias each other (opcheck)
  auto sum_dy = at::empty({l.C}, m.options()), sum_dy_xmu = at::empty({l.C}, m.options());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_backward_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const GradSumsOp<scalar_t> op{dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                  m.const_data_ptr<acc_t>(), sum_dy.data_ptr<acc_t>(), sum_dy_xmu.data_ptr<acc_t>()};
    launch_reduction<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.dy, op.x}), x.options(), stream);
  });
  return {sum_dy.to(mean.scalar_type()), sum_dy_xmu.to(mean.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_affine_act(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                    const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                    std::optional<double> negative_slope, bool input_grad, bool residual_grad, bool sums) {
  const Operands o("backward_affine_act", input, &grad_output);
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  const auto m = o.channel(mean, "mean"), s = o.channel(invstd, "invstd");
  const auto w = o.channel(weight, "weight"), b = o.channel(bias, "bias");
  const bool act = negative_slope.has_value();
  const auto r = act ? o.like_x(residual, "residual") : at::Tensor();  // no activation: not read
  std::optional<at::Tensor> dx, g, sum_g, sum_g_xmu;
  if (input_grad) dx = at::empty_like(x);
  // without an activation g is dy (a copy: an operator's output never aliases its input)
  if (residual_grad) g = act ? at::empty_like(x) : dy.clone();
  if (sums) {  // two allocations: the outputs never alias each other
    sum_g = at::zeros({l.C}, m.options());
    sum_g_xmu = at::zeros({l.C}, m.options());
  }
  const bool writes = input_grad || (residual_grad && act);
  if (l.numel() == 0 || (!writes && !sums)) {
    if (sums) return affine_act_outputs(dx, g, sum_g->to(mean.scalar_type()), sum_g_xmu->to(mean.scalar_type()), x, mean);
    return affine_act_outputs(dx, g, sum_g, sum_g_xmu, x, mean);
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_backward_affine_act", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coef = coefficients<acc_t>(m, s, w, b, at::Tensor(), at::Tensor(), 0, stream);
    AffineActOp<scalar_t> op{dy.const_data_ptr<scalar_t>(),
                             x.const_data_ptr<scalar_t>(),
                             r.defined() ? r.const_data_ptr<scalar_t>() : nullptr,
                             dx ? dx->data_ptr<scalar_t>() : nullptr,
                             residual_grad && act ? g->data_ptr<scalar_t>() : nullptr,
                             m.const_data_ptr<acc_t>(),
                             coef.const_data_ptr<acc_t>(),
                             l.C,
                             acc_t(negative_slope.value_or(0.0)),
                             act,
                             sums ? sum_g->data_ptr<acc_t>() : nullptr,
                             sums ? sum_g_xmu->data_ptr<acc_t>() : nullptr};
    const bool vectorize = can_vectorize(l, kVec<scalar_t>, {op.dy, op.x, op.residual, op.dx, op.g_out});
    if (sums) {
      launch_reduction<scalar_t>(op, l, vectorize, x.options(), stream);
    } else {
      launch_elementwise<scalar_t>(op, l, vectorize, stream);
    }
  });
  if (sums) {
    sum_g = sum_g->to(mean.scalar_type());
    sum_g_xmu = sum_g_xmu->to(mean.scalar_type());
  }
  return affine_act_outputs(dx, g, sum_g, sum_g_xmu, x, mean);
}

std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s) {
  // R-way Chan on R x C values: a few ATen ops on the device, as syncbn.functions.operators.reference
  // (tiny, and no host synchronization: the counts stay a device tensor).
  TORCH_CHECK(means.dim() == 2 && m2s.sizes() == means.sizes() && counts.dim() == 1 &&
                  counts.size(0) == means.size(0),
              "syncbn.cuda.merge_stats: expected counts (R,), means and m2s (R, C), got ", counts.sizes(), ", ",
              means.sizes(), ", ", m2s.sizes());
  c10::cuda::CUDAGuard guard(means.device());
  const auto n = counts.to(means.options()).unsqueeze(1);
  const auto total = n.sum();
  const auto mean = (n * means).sum(0) / total;
  const auto m2 = m2s.to(means.scalar_type()).sum(0) + (n * (means - mean).square()).sum(0);
  return {mean, m2 / total};
}

}  // namespace syncbn::cuda

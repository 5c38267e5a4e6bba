// Per-channel elementwise passes on CUDA, elemt_forward, backward_elemt and masked_backward_elemt
// (what they compute: src/kernels.inc, src/cpu/batch_norm_cpu.h), each one pass over memory with its per-channel coefficients computed once per
// call on the device (operands.cuh).
#include "batch_norm_cuda.h"
#include "elementwise.cuh"
#include "operands.cuh"
#include "positions.cuh"

namespace syncbn::cuda {
namespace {

template <typename scalar_t>
struct ForwardOp {
  using acc_t = at::opmath_type<scalar_t>;
  struct State {
    acc_t scale, shift;
  };

  const scalar_t* x;
  const scalar_t* residual;  // null: none
  scalar_t* y;
  const acc_t* coef;  // (4, C): scale, shift
  int64_t C;
  acc_t slope;
  bool act;

  __device__ __forceinline__ State channel(int64_t c) const { return {coef[c], coef[C + c]}; }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    const auto v = load_pack<V>(x, i);
    Pack<scalar_t, V> r{};
    if (residual != nullptr) r = load_pack<V>(residual, i);
    Pack<scalar_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      acc_t p = pre_activation(acc_t(v.val[j]), s.scale, s.shift, residual != nullptr, acc_t(r.val[j]));
      if (act && negative_side(p)) p *= slope;
      out.val[j] = scalar_t(p);
    }
    store_pack<V>(y, i, out);
  }
};

// kMasked: the correction at the mask's valid positions only (masked_backward_elemt)
template <typename scalar_t, bool kMasked = false>
struct BackwardElemtOp {
  using acc_t = at::opmath_type<scalar_t>;
  struct State {
    acc_t mean, scale, mean_dy, xmu_coef;
  };

  const scalar_t* dy;
  const scalar_t* x;
  scalar_t* dx;
  const acc_t* mean;
  const acc_t* coef;  // (4, C): scale, shift, mean_dy, xmu_coef
  int64_t C;
  Positions positions;  // read with kMasked only

  __device__ __forceinline__ State channel(int64_t c) const {
    return {mean[c], coef[c], coef[2 * C + c], coef[3 * C + c]};
  }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    const auto g = load_pack<V>(dy, i);
    const auto v = load_pack<V>(x, i);
    int64_t p = 0;
    if constexpr (kMasked) p = positions.first(i);
    Pack<scalar_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      const acc_t xmu = acc_t(v.val[j]) - s.mean;
      acc_t correction = s.mean_dy + xmu * s.xmu_coef;
      if constexpr (kMasked) correction = positions.valid(p, j) ? correction : acc_t(0);
      out.val[j] = scalar_t((acc_t(g.val[j]) - correction) * s.scale);
    }
    store_pack<V>(dx, i, out);
  }
};

// dx of backward_elemt (mask undefined) or masked_backward_elemt, coefficients made
template <typename scalar_t, bool kMasked>
void launch_backward_elemt(const Operands& o, at::Tensor& dx, const at::Tensor& m, const at::Tensor& coef,
                           const at::Tensor& mask, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  const BackwardElemtOp<scalar_t, kMasked> op{
      dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), m.const_data_ptr<acc_t>(),
      coef.const_data_ptr<acc_t>(),  l.C,
      Positions(kMasked ? mask.const_data_ptr<bool>() : nullptr, l.C, l.S, l.channels_last)};
  launch_elementwise<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.dy, op.x, op.dx}), stream);
}

}  // namespace

at::Tensor elemt_forward(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual, std::optional<double> negative_slope) {
  const Operands o("elemt_forward", input);
  const auto& [x, l] = std::tie(o.x, o.l);
  const auto m = o.channel(mean, "mean"), s = o.channel(invstd, "invstd");
  const auto w = o.channel(weight, "weight"), b = o.channel(bias, "bias");
  const auto r = o.like_x(residual, "residual");
  auto y = at::empty_like(x);
  if (l.numel() == 0) return y;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_elemt_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coef = coefficients<acc_t>(m, s, w, b, at::Tensor(), at::Tensor(), 0, stream);
    const ForwardOp<scalar_t> op{x.const_data_ptr<scalar_t>(),
                                 r.defined() ? r.const_data_ptr<scalar_t>() : nullptr,
                                 y.data_ptr<scalar_t>(),
                                 coef.const_data_ptr<acc_t>(),
                                 l.C,
                                 acc_t(negative_slope.value_or(0.0)),
                                 negative_slope.has_value()};
    launch_elementwise<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.x, op.residual, op.y}), stream);
  });
  return y;
}

at::Tensor backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                          const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                          const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, int64_t count) {
  const Operands o("backward_elemt", input, &grad_output);
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  auto dx = at::empty_like(x);
  if (l.numel() == 0) return dx;
  TORCH_CHECK(count > 0, "syncbn.cuda.backward_elemt: the batch count must be positive, got ", count);
  const auto m = o.channel(mean, "mean"), s = o.channel(invstd, "invstd"), w = o.channel(weight, "weight");
  const auto sdy = o.channel(sum_dy, "sum_dy"), sdx = o.channel(sum_dy_xmu, "sum_dy_xmu");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_backward_elemt", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coef = coefficients<acc_t>(m, s, w, at::Tensor(), sdy, sdx, count, stream);
    launch_backward_elemt<scalar_t, false>(o, dx, m, coef, at::Tensor(), stream);
  });
  return dx;
}

at::Tensor masked_backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                 const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& mean_dy, const at::Tensor& mean_dy_xmu, const at::Tensor& mask) {
  const Operands o("masked_backward_elemt", input, &grad_output);
  const auto valid = positions_mask(mask, input, "masked_backward_elemt");
  auto dx = at::empty_like(o.x);
  if (o.l.numel() == 0) return dx;
  const auto m = o.channel(mean, "mean"), s = o.channel(invstd, "invstd"), w = o.channel(weight, "weight");
  const auto mdy = o.channel(mean_dy, "mean_dy"), mdx = o.channel(mean_dy_xmu, "mean_dy_xmu");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, o.x.scalar_type(), "syncbn_cuda_masked_backward_elemt", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coef = coefficients<acc_t>(m, s, w, at::Tensor(), mdy, mdx, 1, stream);  // the sums are per value
    launch_backward_elemt<scalar_t, true>(o, dx, m, coef, valid, stream);
  });
  return dx;
}

}  // namespace syncbn::cuda

// Per-channel elementwise passes on CUDA, elemt_forward and backward_elemt (what they compute:
// src/kernels.inc), each one pass over memory with its per-channel coefficients computed once per
// call on the device (operands.cuh).
#include "batch_norm_cuda.h"
#include "elementwise.cuh"
#include "operands.cuh"

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

template <typename scalar_t>
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

  __device__ __forceinline__ State channel(int64_t c) const {
    return {mean[c], coef[c], coef[2 * C + c], coef[3 * C + c]};
  }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    const auto g = load_pack<V>(dy, i);
    const auto v = load_pack<V>(x, i);
    Pack<scalar_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      const acc_t xmu = acc_t(v.val[j]) - s.mean;
      out.val[j] = scalar_t((acc_t(g.val[j]) - s.mean_dy - xmu * s.xmu_coef) * s.scale);
    }
    store_pack<V>(dx, i, out);
  }
};

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
    const BackwardElemtOp<scalar_t> op{dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                       dx.data_ptr<scalar_t>(),        m.const_data_ptr<acc_t>(),
                                       coef.const_data_ptr<acc_t>(),   l.C};
    launch_elementwise<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.dy, op.x, op.dx}), stream);
  });
  return dx;
}

}  // namespace syncbn::cuda

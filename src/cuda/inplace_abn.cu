// In-place activated batch norm on CUDA (what it computes: src/kernels.inc, the abn_* kernels;
// the reference: syncbn.functions.operators.reference): abn_forward_ writes act(x_hat * gamma + beta) over x in
// one elementwise pass; the backward reads the output y and dy only, recovers act's input z =
// act^-1(y), dz = dy * act'(z) and x_hat = (z - beta) / gamma, and either sums dz and x_hat * dz
// per channel (abn_backward_reduce, the reduction framework of reduction.cuh: deterministic, in
// float64 across threads, blocks and splits) or writes dx (abn_backward_elemt, elementwise.cuh).
//
// gamma = |weight| + eps (1 without a weight), beta = bias (0), both computed per channel where a
// thread loads its channel's state. The activation is chosen once per call on the host and is a
// template parameter of every kernel.
#include "batch_norm_cuda.h"
#include "accumulators.cuh"
#include "elementwise.cuh"
#include "operands.cuh"
#include "reduction.cuh"

#include <ATen/MemoryOverlap.h>

#include <string>

namespace syncbn::cuda {
namespace {

enum class Activation { kLeakyRelu, kElu, kIdentity };

Activation parse_activation(c10::string_view name, const char* op) {
  if (name == "leaky_relu") return Activation::kLeakyRelu;
  if (name == "elu") return Activation::kElu;
  TORCH_CHECK(name == "identity", "syncbn.cuda.", op, ": unknown activation '", std::string(name.data(), name.size()),
              "' (expected 'leaky_relu', 'elu' or 'identity')");
  return Activation::kIdentity;
}

// f(std::integral_constant<Activation, A>{}) for the activation named.
template <typename F>
void dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::kLeakyRelu:
      f(std::integral_constant<Activation, Activation::kLeakyRelu>{});
      break;
    case Activation::kElu:
      f(std::integral_constant<Activation, Activation::kElu>{});
      break;
    case Activation::kIdentity:
      f(std::integral_constant<Activation, Activation::kIdentity>{});
      break;
  }
}

__device__ __forceinline__ float expm1_acc(float v) { return expm1f(v); }
__device__ __forceinline__ double expm1_acc(double v) { return expm1(v); }
__device__ __forceinline__ float log1p_acc(float v) { return log1pf(v); }
__device__ __forceinline__ double log1p_acc(double v) { return log1p(v); }
__device__ __forceinline__ float abs_acc(float v) { return fabsf(v); }
__device__ __forceinline__ double abs_acc(double v) { return fabs(v); }

// act(p): leaky_relu p > 0 ? p : p * slope; elu p > 0 ? p : expm1(p) * alpha; identity p (nan
// stays nan, as the reference's torch.where(p > 0, ...)).
template <Activation A, typename acc_t>
__device__ __forceinline__ acc_t activate(acc_t p, acc_t param) {
  if constexpr (A == Activation::kLeakyRelu) {
    return p > acc_t(0) ? p : p * param;
  } else if constexpr (A == Activation::kElu) {
    return p > acc_t(0) ? p : expm1_acc(p) * param;
  } else {
    return p;
  }
}

// z = act^-1(y) and d = act'(z): leaky_relu y > 0 ? (y, 1) : (y / slope, slope); elu y > 0 ? (y, 1)
// : (log1p(y / alpha), y + alpha); identity (y, 1). The division by the parameter is a product by
// its reciprocal `inv` (as torch's CUDA division by a scalar, which the reference runs).
template <typename acc_t>
struct Inverse {
  acc_t z, d;
};

template <Activation A, typename acc_t>
__device__ __forceinline__ Inverse<acc_t> invert(acc_t y, acc_t param, acc_t inv) {
  if constexpr (A == Activation::kLeakyRelu) {
    return y > acc_t(0) ? Inverse<acc_t>{y, acc_t(1)} : Inverse<acc_t>{y * inv, param};
  } else if constexpr (A == Activation::kElu) {
    return y > acc_t(0) ? Inverse<acc_t>{y, acc_t(1)} : Inverse<acc_t>{log1p_acc(y * inv), y + param};
  } else {
    return {y, acc_t(1)};
  }
}

// dz = dy * act'(z) and x_hat = (z - beta) / gamma, x_hat 0 where act'(z) is 0 (elu's flat end,
// where z is -inf: no nan).
template <Activation A, typename acc_t>
__device__ __forceinline__ void recover(acc_t y, acc_t dy, acc_t beta, acc_t gamma, acc_t param, acc_t inv,
                                        acc_t& x_hat, acc_t& dz) {
  const Inverse<acc_t> r = invert<A>(y, param, inv);
  dz = dy * r.d;
  x_hat = r.d == acc_t(0) ? acc_t(0) : (r.z - beta) / gamma;
}

// The affine parameters of the in-place layers: gamma = |weight| + eps (1 without a weight),
// beta = bias (0 without one); weight and bias are (C,) acc_t or null.
template <typename acc_t>
struct Affine {
  const acc_t* weight;
  const acc_t* bias;
  acc_t eps;

  __device__ __forceinline__ acc_t gamma(int64_t c) const {
    return weight == nullptr ? acc_t(1) : abs_acc(weight[c]) + eps;
  }
  __device__ __forceinline__ acc_t beta(int64_t c) const { return bias == nullptr ? acc_t(0) : bias[c]; }
};

// x <- act(x * scale + shift), scale = invstd * gamma, shift = beta - mean * scale, in place: each
// pack read and written by the same thread.
template <typename scalar_t, Activation A>
struct AbnForwardOp {
  using acc_t = at::opmath_type<scalar_t>;
  struct State {
    acc_t scale, shift;
  };

  scalar_t* x;
  const acc_t* mean;
  const acc_t* invstd;
  Affine<acc_t> affine;
  acc_t param;

  __device__ __forceinline__ State channel(int64_t c) const {
    const acc_t scale = invstd[c] * affine.gamma(c);
    return {scale, affine.beta(c) - mean[c] * scale};
  }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    const auto v = load_pack<V>(x, i);
    Pack<scalar_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      out.val[j] = scalar_t(activate<A>(fma_acc(acc_t(v.val[j]), s.scale, s.shift), param));
    }
    store_pack<V>(x, i, out);
  }
};

// sum(dz) and sum(x_hat * dz) per channel, from y and dy.
template <typename scalar_t, Activation A>
struct AbnReduceOp {
  using acc_t = at::opmath_type<scalar_t>;
  // unrolled chunks spill on sm_80 (ptxas' choice at 48 registers): the plain loop
  static constexpr bool kUnroll = false;
  template <typename T>
  using Kind = Sums<T>;
  using Partial = Kind<double>;
  struct State {
    acc_t beta, gamma;
  };

  const scalar_t* y;
  const scalar_t* dy;
  Affine<acc_t> affine;
  acc_t param, inv;
  acc_t* sum_dz;
  acc_t* sum_xhat_dz;

  __device__ __forceinline__ State channel(int64_t c) const { return {affine.beta(c), affine.gamma(c)}; }

  template <int V, bool kPerLane, typename Acc>
  __device__ __forceinline__ void item(int64_t i, const State* st, Acc& acc) const {
    const auto yv = load_pack<V>(y, i);
    const auto g = load_pack<V>(dy, i);
    acc_t dz[V], xhat_dz[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      acc_t x_hat;
      recover<A>(acc_t(yv.val[j]), acc_t(g.val[j]), s.beta, s.gamma, param, inv, x_hat, dz[j]);
      xhat_dz[j] = x_hat * dz[j];
    }
    add_pack<kPerLane>(acc, dz, xhat_dz);
  }

  __device__ __forceinline__ void finish(int64_t c, const Partial& t) const {
    sum_dz[c] = acc_t(t.sum_g);
    sum_xhat_dz[c] = acc_t(t.sum_g_xmu);
  }
};

// dx = (dz - sum_dz / count - x_hat * sum_xhat_dz / count) * gamma * invstd (no sums: dz * gamma *
// invstd), from y and dy.
template <typename scalar_t, Activation A>
struct AbnBackwardElemtOp {
  using acc_t = at::opmath_type<scalar_t>;
  struct State {
    acc_t beta, gamma, scale, mean_dz, mean_xhat_dz;
  };

  const scalar_t* y;
  const scalar_t* dy;
  scalar_t* dx;
  const acc_t* invstd;
  const acc_t* sum_dz;       // null: no sums (then sum_xhat_dz is null too)
  const acc_t* sum_xhat_dz;
  Affine<acc_t> affine;
  acc_t param, inv, inv_count;

  __device__ __forceinline__ State channel(int64_t c) const {
    const acc_t gamma = affine.gamma(c);
    State s{affine.beta(c), gamma, invstd[c] * gamma, acc_t(0), acc_t(0)};
    if (sum_dz != nullptr) {
      s.mean_dz = sum_dz[c] * inv_count;
      s.mean_xhat_dz = sum_xhat_dz[c] * inv_count;
    }
    return s;
  }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    const auto yv = load_pack<V>(y, i);
    const auto g = load_pack<V>(dy, i);
    const bool sums = sum_dz != nullptr;
    Pack<scalar_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      acc_t x_hat, dz;
      recover<A>(acc_t(yv.val[j]), acc_t(g.val[j]), s.beta, s.gamma, param, inv, x_hat, dz);
      if (sums) dz = dz - s.mean_dz - x_hat * s.mean_xhat_dz;
      out.val[j] = scalar_t(dz * s.scale);
    }
    store_pack<V>(dx, i, out);
  }
};

template <typename acc_t>
Affine<acc_t> affine_of(const at::Tensor& w, const at::Tensor& b, double eps) {
  return {w.defined() ? w.const_data_ptr<acc_t>() : nullptr, b.defined() ? b.const_data_ptr<acc_t>() : nullptr,
          acc_t(eps)};
}

// 1 / v in acc_t, as torch's CUDA kernels divide by a scalar (the reference's y / param, sums / count)
template <typename acc_t>
acc_t reciprocal(double v) {
  return acc_t(1) / acc_t(v);
}

}  // namespace

void abn_forward_(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                  c10::string_view activation, double activation_param) {
  const auto act = parse_activation(activation, "abn_forward_");
  const Operands o("abn_forward_", input);
  const auto& [x, l] = std::tie(o.x, o.l);  // x: input itself, or its contiguous copy (neither layout)
  const auto m = o.channel(mean, "mean"), s = o.channel(invstd, "invstd");
  const auto w = o.channel(weight, "weight"), b = o.channel(bias, "bias");
  // the dispatcher bumps no version counter for a custom operator (it has no ADInplaceOrView
  // kernel): x is written here, so its version moves here, as an in-place ATen op's would
  input.unsafeGetTensorImpl()->bump_version();
  if (l.numel() == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_abn_forward_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_activation(act, [&](auto a) {
      const AbnForwardOp<scalar_t, decltype(a)::value> op{x.data_ptr<scalar_t>(), m.const_data_ptr<acc_t>(),
                                                          s.const_data_ptr<acc_t>(), affine_of<acc_t>(w, b, eps),
                                                          acc_t(activation_param)};
      launch_elementwise<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.x}), stream);
    });
  });
  if (!x.is_same(input)) input.copy_(x);  // strides of neither layout: computed in a contiguous copy
}

std::tuple<at::Tensor, at::Tensor> abn_backward_reduce(const at::Tensor& y, const at::Tensor& grad_output,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias, double eps,
                                                       c10::string_view activation, double activation_param) {
  const auto act = parse_activation(activation, "abn_backward_reduce");
  const Operands o("abn_backward_reduce", y, &grad_output);
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  const auto w = o.channel(weight, "weight"), b = o.channel(bias, "bias");
  const auto options = x.options().dtype(o.acc);
  if (l.numel() == 0) return {at::zeros({l.C}, options), at::zeros({l.C}, options)};
  auto sum_dz = at::empty({l.C}, options), sum_xhat_dz = at::empty({l.C}, options);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_abn_backward_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_activation(act, [&](auto a) {
      const AbnReduceOp<scalar_t, decltype(a)::value> op{x.const_data_ptr<scalar_t>(),
                                                         dy.const_data_ptr<scalar_t>(),
                                                         affine_of<acc_t>(w, b, eps),
                                                         acc_t(activation_param),
                                                         reciprocal<acc_t>(activation_param),
                                                         sum_dz.data_ptr<acc_t>(),
                                                         sum_xhat_dz.data_ptr<acc_t>()};
      launch_reduction<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.y, op.dy}), x.options(), stream);
    });
  });
  return {sum_dz, sum_xhat_dz};
}

namespace {

// abn_backward_elemt's pass, its result in a new tensor (out == nullptr) or in dy itself.
at::Tensor abn_backward_elemt_into(const at::Tensor& y, const at::Tensor& grad_output, const at::Tensor& invstd,
                                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                   double eps, c10::string_view activation, double activation_param,
                                   const std::optional<at::Tensor>& sum_dz,
                                   const std::optional<at::Tensor>& sum_xhat_dz, int64_t count, const at::Tensor* out) {
  const auto act = parse_activation(activation, "abn_backward_elemt");
  const Operands o("abn_backward_elemt", y, &grad_output);
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  if (out != nullptr) {
    TORCH_CHECK(dy.is_same(*out), "syncbn.cuda.abn_backward_elemt_: dy must be laid out as y (contiguous or channels_last)");
    at::assert_no_internal_overlap(*out);
  }
  auto dx = out != nullptr ? *out : at::empty_like(x);
  const auto s = o.channel(invstd, "invstd");
  const auto w = o.channel(weight, "weight"), b = o.channel(bias, "bias");
  // the sums are used when both are given (as the reference)
  const bool sums = sum_dz.has_value() && sum_dz->defined() && sum_xhat_dz.has_value() && sum_xhat_dz->defined();
  const auto sdz = sums ? o.channel(sum_dz, "sum_dz") : at::Tensor();
  const auto sxd = sums ? o.channel(sum_xhat_dz, "sum_xhat_dz") : at::Tensor();
  if (l.numel() == 0) return dx;
  TORCH_CHECK(!sums || count > 0, "syncbn.cuda.abn_backward_elemt: the batch count must be positive, got ", count);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_abn_backward_elemt", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_activation(act, [&](auto a) {
      // each thread reads its values of y and dy before it writes them: dx may be dy
      const AbnBackwardElemtOp<scalar_t, decltype(a)::value> op{
          x.const_data_ptr<scalar_t>(),
          dy.const_data_ptr<scalar_t>(),
          dx.data_ptr<scalar_t>(),
          s.const_data_ptr<acc_t>(),
          sums ? sdz.const_data_ptr<acc_t>() : nullptr,
          sums ? sxd.const_data_ptr<acc_t>() : nullptr,
          affine_of<acc_t>(w, b, eps),
          acc_t(activation_param),
          reciprocal<acc_t>(activation_param),
          sums ? reciprocal<acc_t>(double(count)) : acc_t(0)};
      launch_elementwise<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.y, op.dy, op.dx}), stream);
    });
  });
  return dx;
}

}  // namespace

at::Tensor abn_backward_elemt(const at::Tensor& y, const at::Tensor& grad_output, const at::Tensor& invstd,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              double eps, c10::string_view activation, double activation_param,
                              const std::optional<at::Tensor>& sum_dz, const std::optional<at::Tensor>& sum_xhat_dz,
                              int64_t count) {
  return abn_backward_elemt_into(y, grad_output, invstd, weight, bias, eps, activation, activation_param, sum_dz,
                                 sum_xhat_dz, count, nullptr);
}

void abn_backward_elemt_(const at::Tensor& grad_output, const at::Tensor& y, const at::Tensor& invstd,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                         c10::string_view activation, double activation_param,
                         const std::optional<at::Tensor>& sum_dz, const std::optional<at::Tensor>& sum_xhat_dz,
                         int64_t count) {
  abn_backward_elemt_into(y, grad_output, invstd, weight, bias, eps, activation, activation_param, sum_dz, sum_xhat_dz,
                          count, &grad_output);
  grad_output.unsafeGetTensorImpl()->bump_version();  // as abn_forward_: no ADInplaceOrView kernel does it
}

}  // namespace syncbn::cuda

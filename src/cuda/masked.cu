// Batch norm over the valid positions of a padded batch on CUDA (the math:
// functions/operators/reference_masked.py): the statistics of the valid positions in two passes
// of the reduction framework (sums about 0, then about their mean, whose residue corrects it, as
// the CPU kernels do), and the input gradient whose correction applies at valid positions only,
// in the elementwise framework. One byte of mask per position, shared by every channel; the valid
// count stays on the device.
#include "batch_norm_cuda.h"
#include "accumulators.cuh"
#include "elementwise.cuh"
#include "operands.cuh"
#include "reduction.cuh"

namespace syncbn::cuda {
namespace {

// a / b for 0 <= a < 2^50 and b > 0, from b's reciprocal and one correction: a multiply, not the
// 64-bit division subroutine, whose registers made the reductions spill
__device__ __forceinline__ int64_t quotient(int64_t a, int64_t b, double inverse) {
  int64_t q = int64_t(double(a) * inverse);
  if (q * b > a) {
    --q;
  } else if ((q + 1) * b <= a) {
    ++q;
  }
  return q;
}

// The mask (N, *spatial) as the packs of either framework meet it: a pack of V values lies in one
// channel's run (contiguous: V consecutive positions) or one row (channels_last: one position).
struct Positions {
  const bool* mask;
  int64_t C, S;
  bool channels_last;
  double inverse_C, inverse_S, inverse_CS;

  Positions(const bool* mask_, int64_t C_, int64_t S_, bool channels_last_)
      : mask(mask_), C(C_), S(S_), channels_last(channels_last_), inverse_C(1.0 / double(C_)),
        inverse_S(1.0 / double(S_)), inverse_CS(1.0 / (double(C_) * double(S_))) {}

  // the position (n * S + s) of the pack's first value, which starts at element i
  __device__ __forceinline__ int64_t first(int64_t i) const {
    if (channels_last) return quotient(i, C, inverse_C);
    const int64_t n = quotient(i, C * S, inverse_CS), in_sample = i - n * C * S;  // c * S + s
    return n * S + in_sample - quotient(in_sample, S, inverse_S) * S;
  }
  __device__ __forceinline__ bool valid(int64_t first, int j) const { return mask[channels_last ? first : first + j]; }
};

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

template <typename scalar_t>
struct MaskedBackwardElemtOp {
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
  Positions positions;

  __device__ __forceinline__ State channel(int64_t c) const {
    return {mean[c], coef[c], coef[2 * C + c], coef[3 * C + c]};
  }

  template <int V, bool kPerLane>
  __device__ __forceinline__ void item(int64_t i, const State* st) const {
    const auto g = load_pack<V>(dy, i);
    const auto v = load_pack<V>(x, i);
    const int64_t p = positions.first(i);
    Pack<scalar_t, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const State& s = st[kPerLane ? j : 0];
      const acc_t correction = s.mean_dy + (acc_t(v.val[j]) - s.mean) * s.xmu_coef;
      out.val[j] = scalar_t((acc_t(g.val[j]) - (positions.valid(p, j) ? correction : acc_t(0))) * s.scale);
    }
    store_pack<V>(dx, i, out);
  }
};

// mask as the kernels read it: bool on x's device, one value per position of x.
at::Tensor positions_mask(const at::Tensor& mask, const at::Tensor& x, const char* op) {
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.device() == x.device(), "syncbn.cuda.", op,
              ": expected a bool mask on ", x.device(), ", got ", mask.scalar_type(), " on ", mask.device());
  auto expected = x.sizes().vec();
  expected.erase(expected.begin() + 1);
  TORCH_CHECK(mask.sizes() == c10::IntArrayRef(expected), "syncbn.cuda.", op, ": expected a mask of shape ", expected,
              " (the input's without its channels), got ", mask.sizes());
  return mask.contiguous();
}

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

at::Tensor masked_backward_elemt(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& mean,
                                 const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& mean_dy, const at::Tensor& mean_dy_xmu, const at::Tensor& mask) {
  const Operands o("masked_backward_elemt", input, &grad_output);
  const auto& [x, dy, l] = std::tie(o.x, o.dy, o.l);
  const auto mk = positions_mask(mask, input, "masked_backward_elemt");
  auto dx = at::empty_like(x);
  if (l.numel() == 0) return dx;
  const auto m = o.channel(mean, "mean"), s = o.channel(invstd, "invstd"), w = o.channel(weight, "weight");
  const auto mdy = o.channel(mean_dy, "mean_dy"), mdx = o.channel(mean_dy_xmu, "mean_dy_xmu");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_cuda_masked_backward_elemt", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto coef = coefficients<acc_t>(m, s, w, at::Tensor(), mdy, mdx, 1, stream);  // the sums are per value
    const MaskedBackwardElemtOp<scalar_t> op{dy.const_data_ptr<scalar_t>(),
                                             x.const_data_ptr<scalar_t>(),
                                             dx.data_ptr<scalar_t>(),
                                             m.const_data_ptr<acc_t>(),
                                             coef.const_data_ptr<acc_t>(),
                                             l.C,
                                             Positions(mk.const_data_ptr<bool>(), l.C, l.S, l.channels_last)};
    launch_elementwise<scalar_t>(op, l, can_vectorize(l, kVec<scalar_t>, {op.dy, op.x, op.dx}), stream);
  });
  return dx;
}

}  // namespace syncbn::cuda

// In-place activated batch norm on the CPU: abn_forward_, abn_backward_reduce and
// abn_backward_elemt (their reference: syncbn.functions.operators.reference_abn), one pass over
// memory each, the activation a template argument. The backward carries t = z - beta (0 where
// act'(z) is 0: elu's flat end) instead of x_hat, dividing by gamma once per channel; tails take
// the vector code (zero-padded loads), so every value takes the same math. Sums accumulate per
// lane over at most kMaxLaneUpdates values, then in double, in pieces fixed by the sizes alone:
// the same bits whatever the number of threads.
#include "batch_norm_cpu.h"
#include "activation.h"
#include "map_per_channel.h"
#include "per_channel.h"
#include "pieces.h"
#include "vectors.h"

#include <ATen/MemoryOverlap.h>

#include <cmath>

namespace syncbn::cpu {
namespace {

using Act = InvertibleActivation;

// Per-channel gamma = |weight| + eps (1 without a weight) and beta = bias (0 without one),
// computed in acc_t as the reference computes them, held as doubles.
template <typename acc_t>
std::pair<std::vector<double>, std::vector<double>> abn_affine(const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& bias, double eps,
                                                               int64_t C) {
  auto gamma = per_channel_doubles(weight, C, 1.0);
  auto beta = per_channel_doubles(bias, C, 0.0);
  const bool has_weight = weight.has_value() && weight->defined();
  for (int64_t c = 0; c < C; ++c) {
    if (has_weight) gamma[c] = double(acc_t(std::abs(acc_t(gamma[c]))) + acc_t(eps));
    beta[c] = double(acc_t(beta[c]));
  }
  return {gamma, beta};
}

// t = z - beta with z = act^-1(y), 0 where act'(z) (`grad`) is 0.
template <Act kAct, typename Vec>
inline Vec centered_input(const Vec& y, const Vec& grad, const Vec& beta, const Vec& param) {
  const Vec t = inverse_activation<kAct>(y, param) - beta;
  if constexpr (kAct == Act::kIdentity) {
    return t;
  } else {
    return Vec::blendv(t, Vec(0), grad == Vec(0));
  }
}

// x <- act(x * scale + shift), in place.
template <typename scalar_t, Act kAct>
void abn_forward_kernel(const at::Tensor& x, const Layout& l, const std::vector<double>& scale,
                        const std::vector<double>& shift, double param) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;
  const auto scale_acc = padded_params<acc_t>(scale, A::kWidth), shift_acc = padded_params<acc_t>(shift, A::kWidth);
  const Vec param_vec(static_cast<acc_t>(param));
  scalar_t* data = x.data_ptr<scalar_t>();
  map_per_channel<scalar_t, 1, 2>(l, {data}, data, {scale_acc.data(), shift_acc.data()},
                                  [&](const std::array<Vec, 1>& v, const std::array<Vec, 2>& p) {
                                    return invertible_activation<kAct>(at::vec::fmadd(v[0], p[0], p[1]), param_vec);
                                  });
}

// dx from y and dy: with kSums dz * a - b - t * c (params a, b, c, beta), else dz * a (param a);
// a = gamma * invstd, b = sum_dz / count * a, c = sum_xhat_dz / count * invstd.
template <typename scalar_t, Act kAct, bool kSums>
void abn_backward_elemt_kernel(const at::Tensor& y, const at::Tensor& dy, const Layout& l, at::Tensor& dx,
                               const std::array<std::vector<double>, 4>& coefficients, double param) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;
  constexpr size_t kParams = kSums ? 4 : 1;
  std::array<std::vector<acc_t>, kParams> acc;
  std::array<const acc_t*, kParams> params;
  for (size_t j = 0; j < kParams; ++j) {
    acc[j] = padded_params<acc_t>(coefficients[j], A::kWidth);
    params[j] = acc[j].data();
  }
  const Vec param_vec(static_cast<acc_t>(param));
  map_per_channel<scalar_t, 2, kParams>(
      l, {y.const_data_ptr<scalar_t>(), dy.const_data_ptr<scalar_t>()}, dx.data_ptr<scalar_t>(), params,
      [&](const std::array<Vec, 2>& v, const std::array<Vec, kParams>& p) {
        const Vec grad = inverse_activation_grad<kAct>(v[0], param_vec);
        const Vec dz = v[1] * grad;
        if constexpr (kSums) {
          const Vec t = centered_input<kAct>(v[0], grad, p[3], param_vec);
          return at::vec::fnmadd(t, p[2], at::vec::fmsub(dz, p[0], p[1]));
        } else {
          return dz * p[0];
        }
      });
}

// sum(dz) and sum(t * dz) of one channel (or of a part of it).
struct AbnSums {
  double dz = 0, tdz = 0;
  void merge(const AbnSums& other) {
    dz += other.dz;
    tdz += other.tdz;
  }
};

// One step of the reduction: kWidth values (kWhole) or `count` < kWidth of y and dy (the padding
// adds nothing: dy is 0 there, and t finite or masked), beta as a pack (one lane per value).
template <typename scalar_t, Act kAct>
struct AbnSumStep {
  using A = AccVec<scalar_t>;
  using Pack = typename A::Pack;
  using Vec = typename A::Vec;

  template <bool kWhole>
  static void run(const scalar_t* y, const scalar_t* dy, int64_t count, const Pack& beta, const Vec& param,
                  Pack& sum_dz, Pack& sum_tdz) {
    const Pack yv = A::template load_n<kWhole>(y, count), dyv = A::template load_n<kWhole>(dy, count);
    for (int k = 0; k < A::kVecs; ++k) {
      const Vec grad = inverse_activation_grad<kAct>(yv[k], param);
      const Vec dz = dyv[k] * grad;
      sum_dz[k] = sum_dz[k] + dz;
      sum_tdz[k] = at::vec::fmadd(centered_input<kAct>(yv[k], grad, beta[k], param), dz, sum_tdz[k]);
    }
  }
};

// Contiguous layout: the sums over one channel's runs, per vector lane.
template <typename scalar_t, Act kAct>
class ContiguousAbnSums {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ContiguousAbnSums(const scalar_t* y, const scalar_t* dy, acc_t beta, acc_t param)
      : y_(y), dy_(dy), beta_(A::broadcast(beta)), param_(param), sum_dz_(A::broadcast(0)), sum_tdz_(A::broadcast(0)) {}

  void add(int64_t offset, int64_t length) {
    using Step = AbnSumStep<scalar_t, kAct>;
    const scalar_t* y = y_ + offset;
    const scalar_t* dy = dy_ + offset;
    int64_t i = 0;
    for (; i + A::kWidth <= length; i += A::kWidth) {
      Step::template run<true>(y + i, dy + i, A::kWidth, beta_, param_, sum_dz_, sum_tdz_);
    }
    if (i < length) Step::template run<false>(y + i, dy + i, length - i, beta_, param_, sum_dz_, sum_tdz_);
  }

  AbnSums result() const {
    const auto [total_a, total_b] = A::lane_totals(sum_dz_, sum_tdz_);
    return {total_a, total_b};
  }

 private:
  const scalar_t* y_;
  const scalar_t* dy_;
  typename A::Pack beta_;
  Vec param_;
  typename A::Pack sum_dz_, sum_tdz_;
};

// Channels-last layout: the sums over rows, per channel, row by row (as ChannelsLastGradPass in
// grad_passes.h); the per-channel arrays are padded to whole vectors.
template <typename scalar_t, Act kAct>
class ChannelsLastAbnSums {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ChannelsLastAbnSums(const scalar_t* y, const scalar_t* dy, int64_t C, const acc_t* beta, acc_t param)
      : y_(y), dy_(dy), C_(C), beta_(beta), param_(param), sum_dz_(padded_params<acc_t>(C, A::kWidth)), sum_tdz_(sum_dz_) {}

  // `count` rows from `offset` on
  void add_rows(int64_t offset, int64_t count) {
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row = offset + r * C_;
      int64_t c = 0;
      for (; c + A::kWidth <= C_; c += A::kWidth) step<true>(row, c, A::kWidth);
      if (c < C_) step<false>(row, c, C_ - c);
    }
  }

  void write(AbnSums* out) const {
    for (int64_t c = 0; c < C_; ++c) out[c] = {double(sum_dz_[c]), double(sum_tdz_[c])};
  }

 private:
  // the channels [c, c + width) of the row at `row`
  template <bool kWhole>
  void step(int64_t row, int64_t c, int64_t width) {
    auto sum_dz = A::load_params(sum_dz_.data() + c), sum_tdz = A::load_params(sum_tdz_.data() + c);
    AbnSumStep<scalar_t, kAct>::template run<kWhole>(y_ + row + c, dy_ + row + c, width, A::load_params(beta_ + c),
                                                     param_, sum_dz, sum_tdz);
    for (int k = 0; k < A::kVecs; ++k) {
      sum_dz[k].store(sum_dz_.data() + c + k * Vec::size());
      sum_tdz[k].store(sum_tdz_.data() + c + k * Vec::size());
    }
  }

  const scalar_t* y_;
  const scalar_t* dy_;
  int64_t C_;
  const acc_t* beta_;
  Vec param_;
  std::vector<acc_t> sum_dz_, sum_tdz_;
};

// The sums of every channel over y and dy (either layout), in pieces cut by the sizes alone.
template <typename scalar_t, Act kAct>
std::vector<AbnSums> abn_sums(const Layout& l, const scalar_t* y, const scalar_t* dy, const std::vector<double>& beta,
                              double param) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  const auto beta_acc = padded_params<acc_t>(beta, A::kWidth);
  const auto param_acc = static_cast<acc_t>(param);
  std::vector<AbnSums> out(l.C);
  if (l.channels_last) {
    const auto pieces = Pieces::of(l.rows(), kMaxLaneUpdates, 1);
    std::vector<AbnSums> parts(pieces.count * l.C);
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(pieces.length * l.C, 1));
    at::parallel_for(0, pieces.count, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        ChannelsLastAbnSums<scalar_t, kAct> acc(y, dy, l.C, beta_acc.data(), param_acc);
        acc.add_rows(pieces.begin(p) * l.C, pieces.end(p, l.rows()) - pieces.begin(p));
        acc.write(parts.data() + p * l.C);
      }
    });
    for (int64_t p = 0; p < pieces.count; ++p) {
      for (int64_t c = 0; c < l.C; ++c) out[c].merge(parts[p * l.C + c]);
    }
    return out;
  }
  // a run shorter than a vector still takes one update of each lane
  const int64_t lanes = std::max<int64_t>(1, l.S / ceil_div(l.S, A::kWidth));
  const auto pieces = Pieces::of(l.rows(), lanes * kMaxLaneUpdates, 1);
  std::vector<AbnSums> parts(l.C * pieces.count);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / pieces.length);
  at::parallel_for(0, l.C * pieces.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / pieces.count, p = item % pieces.count;
      ContiguousAbnSums<scalar_t, kAct> acc(y, dy, beta_acc[c], param_acc);
      for_each_run(l, c, pieces.begin(p), pieces.end(p, l.rows()),
                   [&](int64_t offset, int64_t length) { acc.add(offset, length); });
      parts[item] = acc.result();
    }
  });
  for (int64_t c = 0; c < l.C; ++c) {
    for (int64_t p = 0; p < pieces.count; ++p) out[c].merge(parts[c * pieces.count + p]);
  }
  return out;
}

void check_grad_output(const at::Tensor& grad_output, const at::Tensor& y, const char* op) {
  TORCH_CHECK(grad_output.scalar_type() == y.scalar_type(), "syncbn.", op, ": grad_output is ",
              grad_output.scalar_type(), " but y is ", y.scalar_type());
}

}  // namespace

void abn_forward_(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                  c10::string_view activation, double activation_param) {
  check_input(x, "abn_forward_");
  const auto act = parse_invertible_activation(activation, "abn_forward_");
  at::assert_no_internal_overlap(x);
  // x itself where it has either layout, else a contiguous copy, computed in and copied back
  const auto [work, l] = as_layout(x);
  TORCH_CHECK(mean.numel() == l.C && invstd.numel() == l.C, "syncbn.abn_forward_: mean and invstd need ", l.C,
              " values, got ", mean.numel(), " and ", invstd.numel());
  const auto m = per_channel_doubles(mean, l.C, 0.0), s = per_channel_doubles(invstd, l.C, 1.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, work.scalar_type(), "syncbn_abn_forward_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto [scale, shift] = abn_affine<acc_t>(weight, bias, eps, l.C);  // gamma and beta, then scale and shift
    for (int64_t c = 0; c < l.C; ++c) {
      const acc_t k = acc_t(s[c]) * acc_t(scale[c]);
      scale[c] = double(k);
      shift[c] = double(acc_t(shift[c]) - acc_t(acc_t(m[c]) * k));
    }
    if (l.numel() == 0) return;
    with_activation(act, [&](auto a) {
      abn_forward_kernel<scalar_t, decltype(a)::value>(work, l, scale, shift, activation_param);
    });
  });
  if (!work.is_same(x)) x.copy_(work);
  // x was written over: no ADInplaceOrView kernel bumps its version for a custom operator
  x.unsafeGetTensorImpl()->bump_version();
}

std::tuple<at::Tensor, at::Tensor> abn_backward_reduce(const at::Tensor& y_in, const at::Tensor& grad_output,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias, double eps,
                                                       c10::string_view activation, double activation_param) {
  check_input(y_in, "abn_backward_reduce");
  check_grad_output(grad_output, y_in, "abn_backward_reduce");
  const auto act = parse_invertible_activation(activation, "abn_backward_reduce");
  const auto [y, l] = as_layout(y_in);
  const auto dy = like_layout(grad_output, y, "grad_output");
  std::vector<AbnSums> sums(l.C);
  std::vector<double> gamma;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "syncbn_abn_backward_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto affine = abn_affine<acc_t>(weight, bias, eps, l.C);
    gamma = affine.first;
    if (l.numel() == 0) return;
    with_activation(act, [&](auto a) {
      sums = abn_sums<scalar_t, decltype(a)::value>(l, y.const_data_ptr<scalar_t>(), dy.const_data_ptr<scalar_t>(),
                                                    affine.second, activation_param);
    });
  });
  auto sum_dz = at::empty({l.C}, y_in.options().dtype(at::kDouble));
  auto sum_xhat_dz = at::empty({l.C}, y_in.options().dtype(at::kDouble));
  for (int64_t c = 0; c < l.C; ++c) {
    sum_dz.data_ptr<double>()[c] = sums[c].dz;
    sum_xhat_dz.data_ptr<double>()[c] = sums[c].tdz / gamma[c];  // sum(x_hat * dz) = sum(t * dz) / gamma
  }
  const auto dtype = accumulation_type(y_in.scalar_type());
  return {sum_dz.to(dtype), sum_xhat_dz.to(dtype)};
}

namespace {

// abn_backward_elemt's pass, its result in `dx` (a new tensor, or dy itself).
void abn_backward_elemt_into(const at::Tensor& y_in, const at::Tensor& grad_output, const at::Tensor& invstd,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double eps, c10::string_view activation, double activation_param,
                             const std::optional<at::Tensor>& sum_dz, const std::optional<at::Tensor>& sum_xhat_dz,
                             int64_t count, const at::Tensor* out, at::Tensor* fresh) {
  check_input(y_in, "abn_backward_elemt");
  check_grad_output(grad_output, y_in, "abn_backward_elemt");
  const auto act = parse_invertible_activation(activation, "abn_backward_elemt");
  const bool has_sums = sum_dz.has_value() && sum_dz->defined();
  TORCH_CHECK(has_sums == (sum_xhat_dz.has_value() && sum_xhat_dz->defined()),
              "syncbn.abn_backward_elemt: give both sum_dz and sum_xhat_dz (batch statistics) or neither");
  const auto [y, l] = as_layout(y_in);
  const auto dy = like_layout(grad_output, y, "grad_output");
  TORCH_CHECK(invstd.numel() == l.C, "syncbn.abn_backward_elemt: invstd has ", invstd.numel(), " values for ", l.C,
              " channels");
  if (out != nullptr) {
    TORCH_CHECK(dy.is_same(*out), "syncbn.abn_backward_elemt_: dy must be laid out as y (contiguous or channels_last)");
    at::assert_no_internal_overlap(*out);
  }
  at::Tensor dx = out != nullptr ? *out : at::empty_like(y);
  if (fresh != nullptr) *fresh = dx;
  if (l.numel() == 0) return;
  TORCH_CHECK(!has_sums || count > 0, "syncbn.abn_backward_elemt: the batch count must be positive, got ", count);
  const auto s = per_channel_doubles(invstd, l.C, 1.0);
  const auto sums_dz = per_channel_doubles(sum_dz, l.C, 0.0), sums_xhat_dz = per_channel_doubles(sum_xhat_dz, l.C, 0.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "syncbn_abn_backward_elemt", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto [gamma, beta] = abn_affine<acc_t>(weight, bias, eps, l.C);
    // params: a, b, c, beta
    std::array<std::vector<double>, 4> k{std::vector<double>(l.C), std::vector<double>(l.C),
                                         std::vector<double>(l.C), beta};
    for (int64_t c = 0; c < l.C; ++c) {
      k[0][c] = gamma[c] * s[c];
      if (has_sums) {
        k[1][c] = sums_dz[c] / double(count) * k[0][c];
        k[2][c] = sums_xhat_dz[c] / double(count) * s[c];
      }
    }
    with_activation(act, [&](auto a) {
      constexpr Act kAct = decltype(a)::value;
      if (has_sums) {
        abn_backward_elemt_kernel<scalar_t, kAct, true>(y, dy, l, dx, k, activation_param);
      } else {
        abn_backward_elemt_kernel<scalar_t, kAct, false>(y, dy, l, dx, k, activation_param);
      }
    });
  });
}

}  // namespace

at::Tensor abn_backward_elemt(const at::Tensor& y, const at::Tensor& grad_output, const at::Tensor& invstd,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              double eps, c10::string_view activation, double activation_param,
                              const std::optional<at::Tensor>& sum_dz, const std::optional<at::Tensor>& sum_xhat_dz,
                              int64_t count) {
  at::Tensor dx;
  abn_backward_elemt_into(y, grad_output, invstd, weight, bias, eps, activation, activation_param, sum_dz, sum_xhat_dz,
                          count, nullptr, &dx);
  return dx;
}

void abn_backward_elemt_(const at::Tensor& grad_output, const at::Tensor& y, const at::Tensor& invstd,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                         c10::string_view activation, double activation_param,
                         const std::optional<at::Tensor>& sum_dz, const std::optional<at::Tensor>& sum_xhat_dz,
                         int64_t count) {
  abn_backward_elemt_into(y, grad_output, invstd, weight, bias, eps, activation, activation_param, sum_dz, sum_xhat_dz,
                          count, &grad_output, nullptr);
  grad_output.unsafeGetTensorImpl()->bump_version();  // as abn_forward_: no ADInplaceOrView kernel does it
}

}  // namespace syncbn::cpu

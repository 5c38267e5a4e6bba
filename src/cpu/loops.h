// Shared machinery of the CPU kernels (the two memory layouts are in src/layout.h): vectors in
// the accumulation type, Welford/Chan moments, and how a channel's values are cut into pieces for threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "layout.h"

namespace syncbn::cpu {

using at::vec::Vectorized;

// Elements per task below which at::parallel_for would cost more than it saves.
constexpr int64_t kGrainElements = 32768;
// Values per accumulator lane in one piece of work (a task of at::parallel_for).
constexpr int64_t kMaxLaneUpdates = 256;
// Within a piece, Welford's float lanes (running mean and M2) fold into double every
// kFoldUpdates updates: folding every 256 left the mean off by 7e-8 of the std on (24, 6, 8, 8)
// data with mean 3 and std 28, and so the weight gradient (through sum(dy * (x - mean)) with
// positive dy) 5x to 8x further from the truth than torch's double accumulation; every 16 keeps
// it within 2x. The backward sums keep kMaxLaneUpdates: measured, they were within 2x already.
constexpr int64_t kFoldUpdates = 16;

// Loads and stores of scalar_t values as vectors of the accumulation type: one vector for
// float and double, two float vectors for bfloat16 and float16.
template <typename scalar_t>
struct AccVec {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<acc_t>;
  static constexpr int kVecs = std::is_same_v<scalar_t, acc_t> ? 1 : 2;
  static constexpr int64_t kWidth = kVecs * Vec::size();
  using Pack = std::array<Vec, kVecs>;

  static Pack load(const scalar_t* p) {
    if constexpr (kVecs == 1) {
      return {Vec::loadu(p)};
    } else {
      Pack v;
      at::vec::load_to_float(p, v[0], v[1]);
      return v;
    }
  }
  // The first `count` (< kWidth) values, the rest zero.
  static Pack load_partial(const scalar_t* p, int64_t count) {
    std::array<scalar_t, kWidth> buffer{};
    std::copy(p, p + count, buffer.data());
    return load(buffer.data());
  }
  // A whole vector (kWhole, `count` unread) or the first `count` < kWidth values: decided at
  // compile time, so that loops over whole vectors carry no length test.
  template <bool kWhole>
  static Pack load_n(const scalar_t* p, int64_t count) {
    if constexpr (kWhole) {
      return load(p);
    } else {
      return load_partial(p, count);
    }
  }
  static void store(scalar_t* p, const Pack& v) {
    if constexpr (kVecs == 1) {
      v[0].store(p);
    } else {
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p);
    }
  }
  static void store_partial(scalar_t* p, const Pack& v, int64_t count) {
    std::array<scalar_t, kWidth> buffer;
    store(buffer.data(), v);
    std::copy(buffer.data(), buffer.data() + count, p);
  }
  template <bool kWhole>
  static void store_n(scalar_t* p, const Pack& v, int64_t count) {
    if constexpr (kWhole) {
      store(p, v);
    } else {
      store_partial(p, v, count);
    }
  }
  // A per-channel parameter array (padded to a multiple of kWidth) at channel c.
  static Pack load_params(const acc_t* p) {
    Pack v;
    for (int k = 0; k < kVecs; ++k) v[k] = Vec::loadu(p + k * Vec::size());
    return v;
  }
  static Pack broadcast(acc_t value) {
    Pack v;
    v.fill(Vec(value));
    return v;
  }
};

// Interleaved layout: fn(c, packs of rows at c...) for every whole vector of channels of one
// row (of each of `rows`), then for the remaining channels zero-padded to a whole vector.
template <typename scalar_t, typename Fn, typename... Rows>
inline void for_each_channel_vector(int64_t C, const Fn& fn, const Rows*... rows) {
  using A = AccVec<scalar_t>;
  int64_t c = 0;
  for (; c + A::kWidth <= C; c += A::kWidth) fn(c, A::load(rows + c)...);
  if (c < C) fn(c, A::load_partial(rows + c, C - c)...);
}

// The fused residual and activation: pre = x * scale + shift (+ z), y = act(pre) with
// act(p) = p where p > 0, else p * slope (ReLU: slope 0). The forward and the backward's
// recomputation share these, so that both take the same side of p > 0.
template <bool kResidual, typename Vec>
inline Vec pre_activation(const Vec& x, const Vec& z, const Vec& scale, const Vec& shift) {
  const Vec pre = at::vec::fmadd(x, scale, shift);
  if constexpr (kResidual) {
    return pre + z;
  } else {
    return pre;
  }
}

template <bool kActivation, typename Vec>
inline Vec activation(const Vec& pre, const Vec& slope) {
  if constexpr (kActivation) {
    return Vec::blendv(pre * slope, pre, pre > Vec(0));
  } else {
    return pre;
  }
}

// dy through the activation at its input pre.
template <bool kActivation, typename Vec>
inline Vec activation_grad(const Vec& dy, const Vec& pre, const Vec& slope) {
  if constexpr (kActivation) {
    return Vec::blendv(dy * slope, dy, pre > Vec(0));
  } else {
    return dy;
  }
}

// Calls fn(std::bool_constant<a>, std::bool_constant<b>): runtime flags as template arguments.
template <typename Fn>
inline void with_flags(bool a, bool b, const Fn& fn) {
  using T = std::true_type;
  using F = std::false_type;
  if (a) {
    b ? fn(T{}, T{}) : fn(T{}, F{});
  } else {
    b ? fn(F{}, T{}) : fn(F{}, F{});
  }
}

// Count, mean and M2 (sum of squared deviations from the mean) of a set of values.
struct Moments {
  double n = 0, mean = 0, m2 = 0;

  // Chan et al.'s pairwise merge: never squares anything but deviations from a mean.
  void merge(const Moments& other) {
    if (other.n == 0) return;
    const double total = n + other.n;
    const double delta = other.mean - mean;
    mean += delta * (other.n / total);
    m2 += other.m2 + delta * delta * (n * other.n / total);
    n = total;
  }
};

// Folds `count` running float moments (`means`, `m2s`, each of `n` values) into double ones of
// `folded_n` values each (Chan, one coefficient pair for all: they have all seen as many values).
template <typename acc_t>
void fold_moments(const acc_t* means, const acc_t* m2s, double n, int64_t count, double& folded_n,
                  double* folded_means, double* folded_m2s) {
  const double total = folded_n + n, weight = n / total, cross = folded_n * n / total;
  for (int64_t i = 0; i < count; ++i) {
    const double delta = double(means[i]) - folded_means[i];
    folded_means[i] += delta * weight;
    folded_m2s[i] += double(m2s[i]) + delta * delta * cross;
  }
  folded_n = total;
}

// How the values of one channel are cut into `count` pieces of `length` values (the last may
// be shorter): enough pieces to keep every thread busy, and no more than kMaxLaneUpdates
// values per lane in one.
struct Pieces {
  int64_t count, length;

  static Pieces of(int64_t values, int64_t max_length, int64_t min_count) {
    int64_t count = std::max(ceil_div(values, std::max<int64_t>(max_length, 1)), min_count);
    count = std::max<int64_t>(std::min(count, values), 1);
    return {count, std::max<int64_t>(ceil_div(values, count), 1)};
  }
  int64_t begin(int64_t p) const { return p * length; }
  int64_t end(int64_t p, int64_t values) const { return std::min(values, (p + 1) * length); }
};

// Planar layout: calls fn(offset, length) for each run of contiguous values of channel c
// among the channel's values [begin, end) (value i is sample i / S, position i % S).
template <typename Fn>
inline void for_each_run(const Layout& l, int64_t c, int64_t begin, int64_t end, const Fn& fn) {
  while (begin < end) {
    const int64_t n = begin / l.S, s = begin % l.S;
    const int64_t length = std::min(l.S - s, end - begin);
    fn((n * l.C + c) * l.S + s, length);
    begin += length;
  }
}

// A vector of acc_t of at least C zeros, padded to a multiple of `width` (so that interleaved
// kernels may load whole vectors of parameters or accumulators at any channel).
template <typename acc_t>
inline std::vector<acc_t> padded_params(int64_t C, int64_t width) {
  return std::vector<acc_t>(ceil_div(std::max<int64_t>(C, 1), width) * width, acc_t(0));
}

// Per-channel values rounded to acc_t, padded as above.
template <typename acc_t>
inline std::vector<acc_t> padded_params(const std::vector<double>& values, int64_t width) {
  auto out = padded_params<acc_t>(static_cast<int64_t>(values.size()), width);
  std::copy(values.begin(), values.end(), out.begin());
  return out;
}

// A (C,) tensor (or None) as doubles; `fill` where it is absent.
inline std::vector<double> per_channel_doubles(const std::optional<at::Tensor>& t, int64_t C, double fill) {
  std::vector<double> out(C, fill);
  if (t.has_value() && t->defined()) {
    TORCH_CHECK(t->numel() == C, "syncbn: expected ", C, " per-channel values, got ", t->numel());
    const auto d = t->is_cpu() ? t->contiguous() : t->to(at::kCPU).contiguous();  // no copy in the usual case
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, d.scalar_type(), "syncbn_per_channel_doubles", [&] {
      const scalar_t* p = d.const_data_ptr<scalar_t>();
      for (int64_t c = 0; c < C; ++c) out[c] = double(p[c]);
    });
  }
  return out;
}

// Per-channel scale = invstd * weight and shift = bias - mean * scale, in double.
inline std::pair<std::vector<double>, std::vector<double>> affine_coefficients(
    const at::Tensor& mean, const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, int64_t C) {
  auto scale = per_channel_doubles(invstd, C, 1.0);
  const auto m = per_channel_doubles(mean, C, 0.0);
  const auto w = per_channel_doubles(weight, C, 1.0);
  auto shift = per_channel_doubles(bias, C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    scale[c] *= w[c];
    shift[c] -= m[c] * scale[c];
  }
  return {scale, shift};
}

// An optional tensor shaped and laid out as x (the residual against the input), or None.
inline std::optional<at::Tensor> optional_like_layout(const std::optional<at::Tensor>& other, const at::Tensor& x,
                                                      const char* op, const char* name) {
  if (!other.has_value() || !other->defined()) return std::nullopt;
  TORCH_CHECK(other->scalar_type() == x.scalar_type(), "syncbn.", op, ": ", name, " is ", other->scalar_type(),
              " but the input is ", x.scalar_type());
  return like_layout(*other, x, name);
}

inline void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), "syncbn.", op, ": expected a CPU tensor, got ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) &&
                  (x.scalar_type() == at::kDouble || x.scalar_type() == at::kFloat ||
                   x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "syncbn.", op, ": expected float64, float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 2, "syncbn.", op, ": expected an input of rank >= 2, got ", x.dim());
}

}  // namespace syncbn::cpu

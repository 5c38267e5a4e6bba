// Values of scalar_t loaded and stored as vectors of the accumulation type (float for float32,
// bfloat16 and float16; double for float64), and per-channel arrays padded to whole vectors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "layout.h"

namespace syncbn::cpu {

using at::vec::Vectorized;

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
  // Two accumulator packs' lanes summed, vector by vector in order, in double.
  static std::pair<double, double> lane_totals(const Pack& a, const Pack& b) {
    double total_a = 0, total_b = 0;
    for (int k = 0; k < kVecs; ++k) {
      total_a += double(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), a[k]));
      total_b += double(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), b[k]));
    }
    return {total_a, total_b};
  }
};

// Channels-last layout: fn(c, packs of rows at c...) for every whole vector of channels of one
// row (of each of `rows`), then for the remaining channels zero-padded to a whole vector.
template <typename scalar_t, typename Fn, typename... Rows>
inline void for_each_channel_vector(int64_t C, const Fn& fn, const Rows*... rows) {
  using A = AccVec<scalar_t>;
  int64_t c = 0;
  for (; c + A::kWidth <= C; c += A::kWidth) fn(c, A::load(rows + c)...);
  if (c < C) fn(c, A::load_partial(rows + c, C - c)...);
}

// A vector of acc_t of at least C zeros, padded to a multiple of `width` (so that channels_last
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

}  // namespace syncbn::cpu

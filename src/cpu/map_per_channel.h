// map_per_channel: the one loop of the CPU's per-channel elementwise passes (elementwise.cpp,
// inplace_abn.cpp), over either layout, in vectors of the accumulation type.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "layout.h"
#include "pieces.h"
#include "vectors.h"

namespace syncbn::cpu {

// out = op(inputs, params of the value's channel) over every value of either layout, in vectors
// of the accumulation type; `out` may be in[0] (each vector is loaded before it is stored).
// `params` are per-channel arrays padded to whole vectors; op takes (std::array<Vec, kIn>,
// std::array<Vec, kParams>) and returns a Vec.
template <typename scalar_t, size_t kIn, size_t kParams, typename Op>
void map_per_channel(const Layout& l, const std::array<const scalar_t*, kIn>& in, scalar_t* out,
                     const std::array<const at::opmath_type<scalar_t>*, kParams>& params, const Op& op) {
  using A = AccVec<scalar_t>;
  using Vec = typename A::Vec;
  using ParamVecs = std::array<std::array<Vec, kParams>, A::kVecs>;

  // kWidth values (kWhole) or `count` < kWidth starting at `offset`
  const auto apply = [&](auto whole, int64_t offset, int64_t count, const ParamVecs& p) {
    std::array<typename A::Pack, kIn> v;
    constexpr bool kWhole = decltype(whole)::value;
    for (size_t j = 0; j < kIn; ++j) v[j] = A::template load_n<kWhole>(in[j] + offset, count);
    typename A::Pack y;
    for (int k = 0; k < A::kVecs; ++k) {
      std::array<Vec, kIn> args;
      for (size_t j = 0; j < kIn; ++j) args[j] = v[j][k];
      y[k] = op(args, p[k]);
    }
    A::template store_n<kWhole>(out + offset, y, count);
  };
  // `length` values from `offset` on: whole vectors in a tight loop, then the rest
  const auto apply_run = [&](int64_t offset, int64_t length, const ParamVecs& p) {
    int64_t i = 0;
    for (; i + A::kWidth <= length; i += A::kWidth) apply(std::true_type{}, offset + i, A::kWidth, p);
    if (i < length) apply(std::false_type{}, offset + i, length - i, p);
  };

  if (l.channels_last) {
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(l.C, 1));
    at::parallel_for(0, l.rows(), grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t c = 0; c < l.C; c += A::kWidth) {
          ParamVecs p;
          for (int k = 0; k < A::kVecs; ++k) {
            for (size_t j = 0; j < kParams; ++j) p[k][j] = Vec::loadu(params[j] + c + k * Vec::size());
          }
          if (c + A::kWidth <= l.C) {
            apply(std::true_type{}, r * l.C + c, A::kWidth, p);
          } else {
            apply(std::false_type{}, r * l.C + c, l.C - c, p);
          }
        }
      }
    });
    return;
  }
  at::parallel_for(0, l.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t row = begin / l.S, length = std::min(l.S - begin % l.S, end - begin);
      ParamVecs p;
      for (size_t j = 0; j < kParams; ++j) {
        const Vec value(params[j][row % l.C]);
        for (int k = 0; k < A::kVecs; ++k) p[k][j] = value;
      }
      apply_run(begin, length, p);
      begin += length;
    }
  });
}

}  // namespace syncbn::cpu

// map_per_channel: the one loop of the CPU's per-channel elementwise passes (elementwise.cpp,
// inplace_abn.cpp), over either layout, in vectors of the accumulation type, with or without the
// mask of a padded batch (masked_backward_elemt).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "layout.h"
#include "pieces.h"
#include "vectors.h"

namespace syncbn::cpu {

// The mask of a padded batch (bool per position, N * S of them) as one acc_t per position: every
// bit set where valid (a blendv selector), 0 elsewhere.
template <typename acc_t>
std::vector<acc_t> selectors(const bool* valid, int64_t positions) {
  using Bits = std::conditional_t<sizeof(acc_t) == 8, uint64_t, uint32_t>;
  const Bits ones = ~Bits(0);
  acc_t on;
  std::memcpy(&on, &ones, sizeof(on));
  std::vector<acc_t> out(positions);
  for (int64_t i = 0; i < positions; ++i) out[i] = valid[i] ? on : acc_t(0);
  return out;
}

// kWidth selectors at `select` (kWhole), or the first `count` < kWidth and zeros.
template <typename A, bool kWhole>
typename A::Pack load_selectors(const typename A::acc_t* select, int64_t count) {
  typename A::Pack out;
  for (int k = 0; k < A::kVecs; ++k) {
    const int64_t at = k * A::Vec::size();
    if constexpr (kWhole) {
      out[k] = A::Vec::loadu(select + at);
    } else {
      out[k] = A::Vec::loadu(select + at, std::clamp<int64_t>(count - at, 0, A::Vec::size()));
    }
  }
  return out;
}

// out = op(inputs, params of the value's channel) over every value of either layout, in vectors
// of the accumulation type; `out` may be in[0] (each vector is loaded before it is stored).
// `params` are per-channel arrays padded to whole vectors; op takes (std::array<Vec, kIn>,
// std::array<Vec, kParams>) and returns a Vec. With `valid` (kMasked: a bool per position of a
// padded batch), op also takes the values' selector Vec (every bit set where valid, else 0).
template <typename scalar_t, size_t kIn, size_t kParams, bool kMasked = false, typename Op>
void map_per_channel(const Layout& l, const std::array<const scalar_t*, kIn>& in, scalar_t* out,
                     const std::array<const at::opmath_type<scalar_t>*, kParams>& params, const Op& op,
                     const bool* valid = nullptr) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;
  using Pack = typename A::Pack;
  using ParamVecs = std::array<std::array<Vec, kParams>, A::kVecs>;

  // kWidth values (kWhole) or `count` < kWidth starting at `offset`, their selectors `select`
  const auto apply = [&](auto whole, int64_t offset, int64_t count, const ParamVecs& p, const Pack& select) {
    std::array<Pack, kIn> v;
    constexpr bool kWhole = decltype(whole)::value;
    for (size_t j = 0; j < kIn; ++j) v[j] = A::template load_n<kWhole>(in[j] + offset, count);
    Pack y;
    for (int k = 0; k < A::kVecs; ++k) {
      std::array<Vec, kIn> args;
      for (size_t j = 0; j < kIn; ++j) args[j] = v[j][k];
      if constexpr (kMasked) {
        y[k] = op(args, p[k], select[k]);
      } else {
        y[k] = op(args, p[k]);
      }
    }
    A::template store_n<kWhole>(out + offset, y, count);
  };
  const Pack none = A::broadcast(acc_t(0));

  if (l.channels_last) {
    const Pack all = [] {
      Pack s;
      for (int k = 0; k < A::kVecs; ++k) s[k] = Vec(1) == Vec(1);  // every bit set
      return s;
    }();
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(l.C, 1));
    at::parallel_for(0, l.rows(), grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const Pack& select = !kMasked || valid[r] ? all : none;  // a row is one position
        for (int64_t c = 0; c < l.C; c += A::kWidth) {
          ParamVecs p;
          for (int k = 0; k < A::kVecs; ++k) {
            for (size_t j = 0; j < kParams; ++j) p[k][j] = Vec::loadu(params[j] + c + k * Vec::size());
          }
          if (c + A::kWidth <= l.C) {
            apply(std::true_type{}, r * l.C + c, A::kWidth, p, select);
          } else {
            apply(std::false_type{}, r * l.C + c, l.C - c, p, select);
          }
        }
      }
    });
    return;
  }
  const auto select = kMasked ? selectors<acc_t>(valid, l.rows()) : std::vector<acc_t>();
  // the selectors of kWidth positions from `at` (kWhole), or of `count` and zeros
  const auto load_select = [&](auto whole, int64_t at, int64_t count) {
    if constexpr (kMasked) {
      return load_selectors<A, decltype(whole)::value>(select.data() + at, count);
    } else {
      return none;
    }
  };
  at::parallel_for(0, l.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t row = begin / l.S, length = std::min(l.S - begin % l.S, end - begin);
      const int64_t position = kMasked ? row / l.C * l.S + begin % l.S : 0;  // sample row / C, place begin % S
      ParamVecs p;
      for (size_t j = 0; j < kParams; ++j) {
        const Vec value(params[j][row % l.C]);
        for (int k = 0; k < A::kVecs; ++k) p[k][j] = value;
      }
      int64_t i = 0;
      for (; i + A::kWidth <= length; i += A::kWidth) {
        apply(std::true_type{}, begin + i, A::kWidth, p, load_select(std::true_type{}, position + i, A::kWidth));
      }
      if (i < length) {
        apply(std::false_type{}, begin + i, length - i, p, load_select(std::false_type{}, position + i, length - i));
      }
      begin += length;
    }
  });
}

}  // namespace syncbn::cpu

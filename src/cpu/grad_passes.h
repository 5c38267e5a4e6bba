// The backward passes' accumulators over either layout (reductions.cpp): one step over a vector
// of values (g = dy through the fused activation, dx, and the sums sum(g), sum(g * (x - mean))),
// the passes that feed it a channel's runs or rows, and the register-blocked channels_last sums
// of the plain backward.
#pragma once

#include <array>
#include <vector>

#include "activation.h"
#include "pieces.h"
#include "vectors.h"

namespace syncbn::cpu {

// sum(g) and sum(g * (x - mean)) of one channel (or of a part of it).
struct GradSums {
  double dy = 0, dy_xmu = 0;
  void merge(const GradSums& other) {
    dy += other.dy;
    dy_xmu += other.dy_xmu;
  }
};

// The tensors of one backward pass over (dy, x[, z]) with fixed per-channel coefficients;
// outputs that are not asked for are null.
template <typename scalar_t>
struct GradPassData {
  const scalar_t* dy;
  const scalar_t* x;
  const scalar_t* z;  // the residual, read with kResidual only
  scalar_t* dx;       // g * scale
  scalar_t* g;        // dy through the activation (the residual's gradient)
  bool sums;          // accumulate sum(g) and sum(g * (x - mean))
};

// One step of a backward pass: kWidth values (kWhole) or `count` < kWidth at `offset`, the
// per-channel coefficients as packs (one lane per value). g = dy * act'(x * scale + shift [+ z]).
template <typename scalar_t, bool kResidual, bool kActivation>
struct GradStep {
  using A = AccVec<scalar_t>;
  using Pack = typename A::Pack;
  using Vec = typename A::Vec;

  template <bool kWhole>
  static void run(const GradPassData<scalar_t>& d, int64_t offset, int64_t count, const Pack& mean,
                  const Pack& scale, const Pack& shift, const Vec& slope, Pack& sum_g, Pack& sum_g_xmu) {
    const Pack dy = A::template load_n<kWhole>(d.dy + offset, count), x = A::template load_n<kWhole>(d.x + offset, count);
    Pack z = dy;  // unread without kResidual
    if constexpr (kResidual) z = A::template load_n<kWhole>(d.z + offset, count);
    Pack g, dx;
    for (int k = 0; k < A::kVecs; ++k) {
      if constexpr (kActivation) {
        g[k] = activation_grad<true>(dy[k], pre_activation<kResidual>(x[k], z[k], scale[k], shift[k]), slope);
      } else {
        g[k] = dy[k];
      }
      if (d.sums) {
        sum_g[k] = sum_g[k] + g[k];
        sum_g_xmu[k] = at::vec::fmadd(g[k], x[k] - mean[k], sum_g_xmu[k]);
      }
      if (d.dx != nullptr) dx[k] = g[k] * scale[k];
    }
    if (d.dx != nullptr) A::template store_n<kWhole>(d.dx + offset, dx, count);
    if (d.g != nullptr) A::template store_n<kWhole>(d.g + offset, g, count);
  }
};

// Contiguous layout: a backward pass over one channel's runs, sums per vector lane.
template <typename scalar_t, bool kResidual, bool kActivation>
class ContiguousGradPass {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ContiguousGradPass(const GradPassData<scalar_t>& d, acc_t mean, acc_t scale, acc_t shift, acc_t slope)
      : d_(d),
        mean_(A::broadcast(mean)),
        scale_(A::broadcast(scale)),
        shift_(A::broadcast(shift)),
        slope_(slope),
        sum_g_(A::broadcast(0)),
        sum_g_xmu_(A::broadcast(0)) {}

  void add(int64_t offset, int64_t length) {
    const GradPassData<scalar_t> d = d_;  // a local copy: stores through its pointers cannot touch it
    using Step = GradStep<scalar_t, kResidual, kActivation>;
    int64_t i = 0;
    for (; i + A::kWidth <= length; i += A::kWidth) {
      Step::template run<true>(d, offset + i, A::kWidth, mean_, scale_, shift_, slope_, sum_g_, sum_g_xmu_);
    }
    if (i < length) {
      Step::template run<false>(d, offset + i, length - i, mean_, scale_, shift_, slope_, sum_g_, sum_g_xmu_);
    }
  }

  GradSums result() const {
    const auto [total_a, total_b] = A::lane_totals(sum_g_, sum_g_xmu_);
    return {total_a, total_b};
  }

 private:
  GradPassData<scalar_t> d_;
  typename A::Pack mean_, scale_, shift_;
  Vec slope_;
  typename A::Pack sum_g_, sum_g_xmu_;
};

// Channels-last layout: a backward pass over rows, sums per channel. The per-channel arrays
// are padded to whole vectors.
template <typename scalar_t, bool kResidual, bool kActivation>
class ChannelsLastGradPass {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ChannelsLastGradPass(const GradPassData<scalar_t>& d, int64_t C, const acc_t* mean, const acc_t* scale, const acc_t* shift,
              acc_t slope)
      : d_(d),
        C_(C),
        mean_(mean),
        scale_(scale),
        shift_(shift),
        slope_(slope),
        sum_g_(padded_params<acc_t>(C, A::kWidth)),
        sum_g_xmu_(sum_g_) {}

  // `count` rows from `offset` on, row by row (each cache line of the input visited once, not once
  // per vector of channels in it); within a row a vector of channels at a time, its coefficients
  // and sums loaded from (and the sums stored back to) the padded arrays, which stay in L1.
  void add_rows(int64_t offset, int64_t count) {
    using Step = GradStep<scalar_t, kResidual, kActivation>;
    const GradPassData<scalar_t> d = d_;  // a local copy: stores through its pointers cannot touch it
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row = offset + r * C_;
      int64_t c = 0;
      for (; c + A::kWidth <= C_; c += A::kWidth) step<Step, true>(d, row, c, A::kWidth);
      if (c < C_) step<Step, false>(d, row, c, C_ - c);
    }
  }

  void write(GradSums* out) const {
    for (int64_t c = 0; c < C_; ++c) out[c] = {double(sum_g_[c]), double(sum_g_xmu_[c])};
  }

 private:
  // the channels [c, c + width) of the row at `row`
  template <typename Step, bool kWhole>
  void step(const GradPassData<scalar_t>& d, int64_t row, int64_t c, int64_t width) {
    const auto mean = A::load_params(mean_ + c), scale = A::load_params(scale_ + c);
    const auto shift = A::load_params(shift_ + c);
    auto sum_g = A::load_params(sum_g_.data() + c), sum_g_xmu = A::load_params(sum_g_xmu_.data() + c);
    Step::template run<kWhole>(d, row + c, width, mean, scale, shift, slope_, sum_g, sum_g_xmu);
    if (d.sums) {
      store_params(sum_g_.data() + c, sum_g);
      store_params(sum_g_xmu_.data() + c, sum_g_xmu);
    }
  }

  static void store_params(acc_t* p, const typename A::Pack& v) {
    for (int k = 0; k < A::kVecs; ++k) v[k].store(p + k * Vec::size());
  }

  GradPassData<scalar_t> d_;
  int64_t C_;
  const acc_t *mean_, *scale_, *shift_;
  Vec slope_;
  std::vector<acc_t> sum_g_, sum_g_xmu_;
};

// Channels-last sums of the plain backward, sum(dy) and sum(dy * (x - mean)), kBlock packs of
// channels at a time with their sums in registers over the piece's rows (ChannelsLastGradPass
// loads and stores them through L1 at every row). Each channel still adds its rows in order: the
// same bits.
template <typename scalar_t>
class ChannelsLastSumsPass {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Pack = typename A::Pack;
  static constexpr int kBlock = 4;

 public:
  ChannelsLastSumsPass(const GradPassData<scalar_t>& d, int64_t C, const acc_t* mean)
      : dy_(d.dy), x_(d.x), C_(C), mean_(mean), sum_dy_(padded_params<acc_t>(C, A::kWidth)), sum_dy_xmu_(sum_dy_) {}

  void add_rows(int64_t offset, int64_t count) {
    int64_t c = 0;
    for (; c + kBlock * A::kWidth <= C_; c += kBlock * A::kWidth) block<kBlock, true>(offset, count, c);
    for (; c + A::kWidth <= C_; c += A::kWidth) block<1, true>(offset, count, c);
    if (c < C_) block<1, false>(offset, count, c);
  }

  void write(GradSums* out) const {
    for (int64_t c = 0; c < C_; ++c) out[c] = {double(sum_dy_[c]), double(sum_dy_xmu_[c])};
  }

 private:
  // channels [c, c + B * kWidth) of `count` rows from `offset`; a partial pack (B = 1) is zero-padded
  template <int B, bool kWhole>
  void block(int64_t offset, int64_t count, int64_t c) {
    const int64_t width = kWhole ? A::kWidth : C_ - c;
    std::array<Pack, B> mean, sum_dy, sum_dy_xmu;
    for (int b = 0; b < B; ++b) {
      mean[b] = A::load_params(mean_ + c + b * A::kWidth);
      sum_dy[b] = A::load_params(sum_dy_.data() + c + b * A::kWidth);
      sum_dy_xmu[b] = A::load_params(sum_dy_xmu_.data() + c + b * A::kWidth);
    }
    for (int64_t r = 0; r < count; ++r) {
      const int64_t at = offset + r * C_ + c;
      for (int b = 0; b < B; ++b) {
        const Pack g = A::template load_n<kWhole>(dy_ + at + b * A::kWidth, width);
        const Pack v = A::template load_n<kWhole>(x_ + at + b * A::kWidth, width);
        for (int k = 0; k < A::kVecs; ++k) {
          sum_dy[b][k] = sum_dy[b][k] + g[k];
          sum_dy_xmu[b][k] = at::vec::fmadd(g[k], v[k] - mean[b][k], sum_dy_xmu[b][k]);
        }
      }
    }
    for (int b = 0; b < B; ++b) {
      for (int k = 0; k < A::kVecs; ++k) {
        sum_dy[b][k].store(sum_dy_.data() + c + b * A::kWidth + k * A::Vec::size());
        sum_dy_xmu[b][k].store(sum_dy_xmu_.data() + c + b * A::kWidth + k * A::Vec::size());
      }
    }
  }

  const scalar_t* dy_;
  const scalar_t* x_;
  int64_t C_;
  const acc_t* mean_;
  std::vector<acc_t> sum_dy_, sum_dy_xmu_;
};

}  // namespace syncbn::cpu

// Welford's running (mean, M2) over either layout, in vectors of the accumulation type, folded
// into double every kFoldUpdates updates (src/cpu/pieces.h): the accumulators of local_stats
// (reductions.cpp) and of the masked statistics over valid rows (masked.cpp); and the plain sum
// that stands in for a mean Welford cannot carry.
#pragma once

#include <array>
#include <vector>

#include "pieces.h"
#include "vectors.h"

namespace syncbn::cpu {

// Welford over one channel's values, one running (mean, M2) per vector lane; the lanes of a
// vector have seen the same number of values. Values left over by whole vectors go to a
// single float vector where a whole one is left (bfloat16, float16), then to a double Welford.
template <typename scalar_t>
class ContiguousWelford {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ContiguousWelford(const scalar_t* x, acc_t pivot) : x_(x), pivot_(pivot), pivot_vec_(pivot) {
    mean_.fill(Vec(0));
    m2_.fill(Vec(0));
  }

  void add(int64_t offset, int64_t length) {
    const scalar_t* p = x_ + offset;
    int64_t i = 0;
    while (i + A::kWidth <= length) {  // whole vectors, in runs that end where the lanes fold
      const int64_t run = std::min((length - i) / A::kWidth, kFoldUpdates - lane_n_[0]);
      for (const int64_t end = i + run * A::kWidth; i < end; i += A::kWidth) {
        const auto v = A::load(p + i);
        for (int k = 0; k < A::kVecs; ++k) update(k, v[k]);
      }
      if (lane_n_[0] >= kFoldUpdates) {
        for (int k = 0; k < A::kVecs; ++k) fold(k);
      }
    }
    if constexpr (A::kVecs > 1) {
      if (i + Vec::size() <= length) {
        Vec v;
        at::vec::load_to_float(p + i, v);
        update(0, v);
        i += Vec::size();
      }
    }
    for (; i < length; ++i) {
      const double d = double(acc_t(p[i])) - double(pivot_);
      tail_.merge({1.0, d, 0.0});
    }
  }

  // Moments of the values seen, shifted by the pivot.
  Moments result() {
    Moments total = tail_;
    for (int k = 0; k < A::kVecs; ++k) {
      fold(k);
      for (int64_t lane = 0; lane < Vec::size(); ++lane) {
        total.merge({fold_n_[k], fold_mean_[k][lane], fold_m2_[k][lane]});
      }
    }
    return total;
  }

 private:
  void update(int k, const Vec& v) {
    const Vec inv(acc_t(1) / acc_t(++lane_n_[k]));
    const Vec d = v - pivot_vec_;
    const Vec delta = d - mean_[k];
    mean_[k] = at::vec::fmadd(delta, inv, mean_[k]);
    m2_[k] = at::vec::fmadd(delta, d - mean_[k], m2_[k]);
  }

  // vector k's running lanes into its double lanes, and the running lanes back to none
  void fold(int k) {
    if (lane_n_[k] == 0) return;
    std::array<acc_t, Vec::size()> means, m2s;
    mean_[k].store(means.data());
    m2_[k].store(m2s.data());
    fold_moments(means.data(), m2s.data(), double(lane_n_[k]), Vec::size(), fold_n_[k], fold_mean_[k].data(),
                 fold_m2_[k].data());
    mean_[k] = m2_[k] = Vec(0);
    lane_n_[k] = 0;
  }

  const scalar_t* x_;
  acc_t pivot_;
  Vec pivot_vec_;
  typename A::Pack mean_, m2_;
  std::array<int64_t, A::kVecs> lane_n_{};
  std::array<double, A::kVecs> fold_n_{};
  std::array<std::array<double, Vec::size()>, A::kVecs> fold_mean_{}, fold_m2_{};
  Moments tail_;
};

// Welford over rows of a channels_last layout: one running (mean, M2) per channel, all
// channels having seen the same rows. Arrays are padded to whole vectors.
template <typename scalar_t>
class ChannelsLastWelford {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ChannelsLastWelford(int64_t C, const acc_t* pivot)
      : C_(C), pivot_(pivot), mean_(padded_params<acc_t>(C, A::kWidth)), m2_(mean_) {}

  void add_row(const scalar_t* row) {
    ++n_;
    const Vec inv(acc_t(1) / acc_t(n_));
    for_each_channel_vector<scalar_t>(C_, [&](int64_t c, const auto& v) { update(v, c, inv); }, row);
    if (n_ == kFoldUpdates) fold();
  }

  void write(Moments* out) {
    fold();
    for (int64_t c = 0; c < C_; ++c) out[c] = {fold_n_, fold_mean_[c], fold_m2_[c]};
  }

 private:
  void update(const typename A::Pack& v, int64_t c, const Vec& inv) {
    for (int k = 0; k < A::kVecs; ++k) {
      const int64_t at = c + k * Vec::size();
      const Vec d = v[k] - Vec::loadu(pivot_ + at);
      Vec mean = Vec::loadu(mean_.data() + at);
      const Vec delta = d - mean;
      mean = at::vec::fmadd(delta, inv, mean);
      at::vec::fmadd(delta, d - mean, Vec::loadu(m2_.data() + at)).store(m2_.data() + at);
      mean.store(mean_.data() + at);
    }
  }

  // the running moments into the double ones, and the running ones back to none
  void fold() {
    if (n_ == 0) return;
    fold_moments(mean_.data(), m2_.data(), double(n_), C_, fold_n_, fold_mean_.data(), fold_m2_.data());
    std::fill(mean_.begin(), mean_.end(), acc_t(0));
    std::fill(m2_.begin(), m2_.end(), acc_t(0));
    n_ = 0;
  }

  int64_t C_;
  const acc_t* pivot_;
  std::vector<acc_t> mean_, m2_;
  int64_t n_ = 0;
  double fold_n_ = 0;
  std::vector<double> fold_mean_ = std::vector<double>(C_, 0.0), fold_m2_ = std::vector<double>(C_, 0.0);
};

// A channel's plain sum (with `valid`, a bool per position: of its valid values): the mean of a
// channel holding inf or nan, where Welford's running mean would turn inf into nan (torch's
// batch norm keeps inf).
template <typename scalar_t>
double plain_sum(const scalar_t* x, const Layout& l, int64_t c, const bool* valid = nullptr) {
  double sum = 0;
  if (l.channels_last) {
    for (int64_t r = 0; r < l.rows(); ++r) {
      if (valid == nullptr || valid[r]) sum += double(x[r * l.C + c]);
    }
  } else {
    for_each_run(l, c, 0, l.rows(), [&](int64_t offset, int64_t length) {
      const int64_t position = offset / (l.C * l.S) * l.S + offset % l.S;
      for (int64_t i = 0; i < length; ++i) {
        if (valid == nullptr || valid[position + i]) sum += double(x[offset + i]);
      }
    });
  }
  return sum;
}

}  // namespace syncbn::cpu

// Per-channel reductions: local statistics (count, mean, M2) and the backward sums
// (sum_dy, sum_dy_xmu), each in one pass over memory; and the merge of replicas' statistics.
//
// Values accumulate per vector lane in the accumulation type (float for float32, bfloat16 and
// float16; double for float64), at most kMaxLaneUpdates per lane; lanes and pieces merge in
// double. Welford runs on values shifted by a pivot (the channel's first value), so that a
// float32 running mean carries the data's spread, not its offset: mean 1e4 and std 1 keeps
// the variance to ~1e-7.
#include "batch_norm_cpu.h"
#include "loops.h"

#include <cmath>

namespace syncbn::cpu {
namespace {

// Welford over one channel's values, one running (mean, M2) per vector lane; the lanes of a
// vector have seen the same number of values. Values left over by whole vectors go to a
// single float vector where a whole one is left (bfloat16, float16), then to a double Welford.
template <typename scalar_t>
class LaneWelford {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  LaneWelford(const scalar_t* x, acc_t pivot) : x_(x), pivot_(pivot), pivot_vec_(pivot) {
    mean_.fill(Vec(0));
    m2_.fill(Vec(0));
  }

  void add(int64_t offset, int64_t length) {
    const scalar_t* p = x_ + offset;
    int64_t i = 0;
    for (; i + A::kWidth <= length; i += A::kWidth) {
      const auto v = A::load(p + i);
      for (int k = 0; k < A::kVecs; ++k) update(k, v[k]);
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
  Moments result() const {
    Moments total = tail_;
    std::array<acc_t, Vec::size()> means, m2s;
    for (int k = 0; k < A::kVecs; ++k) {
      if (lane_n_[k] == 0) continue;
      mean_[k].store(means.data());
      m2_[k].store(m2s.data());
      for (int64_t lane = 0; lane < Vec::size(); ++lane) {
        total.merge({double(lane_n_[k]), double(means[lane]), double(m2s[lane])});
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

  const scalar_t* x_;
  acc_t pivot_;
  Vec pivot_vec_;
  typename A::Pack mean_, m2_;
  std::array<int64_t, A::kVecs> lane_n_{};
  Moments tail_;
};

// Welford over rows of an interleaved layout: one running (mean, M2) per channel, all
// channels having seen the same rows. Arrays are padded to whole vectors.
template <typename scalar_t>
class RowWelford {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  RowWelford(int64_t C, const acc_t* pivot)
      : C_(C), pivot_(pivot), mean_(padded_params<acc_t>(C, A::kWidth)), m2_(mean_) {}

  void add_row(const scalar_t* row) {
    ++n_;
    const Vec inv(acc_t(1) / acc_t(n_));
    for_each_channel_vector<scalar_t>(C_, [&](int64_t c, const auto& v) { update(v, c, inv); }, row);
  }

  void write(Moments* out) const {
    for (int64_t c = 0; c < C_; ++c) out[c] = {double(n_), double(mean_[c]), double(m2_[c])};
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

  int64_t C_;
  const acc_t* pivot_;
  std::vector<acc_t> mean_, m2_;
  int64_t n_ = 0;
};

// sum(dy) and sum(dy * (x - mean)) of one channel, per vector lane.
struct GradSums {
  double dy = 0, dy_xmu = 0;
  void merge(const GradSums& other) {
    dy += other.dy;
    dy_xmu += other.dy_xmu;
  }
};

template <typename scalar_t>
class LaneGradSums {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  LaneGradSums(const scalar_t* dy, const scalar_t* x, acc_t mean) : dy_(dy), x_(x), mean_(mean) {
    sum_dy_.fill(Vec(0));
    sum_dy_xmu_.fill(Vec(0));
  }

  void add(int64_t offset, int64_t length) {
    const scalar_t* dy = dy_ + offset;
    const scalar_t* x = x_ + offset;
    const Vec mean(mean_);
    int64_t i = 0;
    for (; i + A::kWidth <= length; i += A::kWidth) {
      const auto g = A::load(dy + i), v = A::load(x + i);
      for (int k = 0; k < A::kVecs; ++k) update(k, g[k], v[k], mean);
    }
    if constexpr (A::kVecs > 1) {  // a whole float vector left (bfloat16, float16)
      if (i + Vec::size() <= length) {
        Vec g, v;
        at::vec::load_to_float(dy + i, g);
        at::vec::load_to_float(x + i, v);
        update(0, g, v, mean);
        i += Vec::size();
      }
    }
    for (; i < length; ++i) {
      const double g = double(acc_t(dy[i]));
      tail_.merge({g, g * (double(acc_t(x[i])) - double(mean_))});
    }
  }

  GradSums result() const {
    GradSums total = tail_;
    for (int k = 0; k < A::kVecs; ++k) {
      total.merge({double(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), sum_dy_[k])),
                   double(at::vec::vec_reduce_all<acc_t>(std::plus<Vec>(), sum_dy_xmu_[k]))});
    }
    return total;
  }

 private:
  void update(int k, const Vec& g, const Vec& v, const Vec& mean) {
    sum_dy_[k] = sum_dy_[k] + g;
    sum_dy_xmu_[k] = at::vec::fmadd(g, v - mean, sum_dy_xmu_[k]);
  }

  const scalar_t* dy_;
  const scalar_t* x_;
  acc_t mean_;
  typename A::Pack sum_dy_, sum_dy_xmu_;
  GradSums tail_;
};

template <typename scalar_t>
class RowGradSums {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  RowGradSums(int64_t C, const acc_t* mean)
      : C_(C), mean_(mean), sum_dy_(padded_params<acc_t>(C, A::kWidth)), sum_dy_xmu_(sum_dy_) {}

  void add_row(const scalar_t* dy, const scalar_t* x) {
    for_each_channel_vector<scalar_t>(C_, [&](int64_t c, const auto& g, const auto& v) { update(g, v, c); }, dy, x);
  }

  void write(GradSums* out) const {
    for (int64_t c = 0; c < C_; ++c) out[c] = {double(sum_dy_[c]), double(sum_dy_xmu_[c])};
  }

 private:
  void update(const typename A::Pack& g, const typename A::Pack& v, int64_t c) {
    for (int k = 0; k < A::kVecs; ++k) {
      const int64_t at = c + k * Vec::size();
      (Vec::loadu(sum_dy_.data() + at) + g[k]).store(sum_dy_.data() + at);
      const Vec xmu = v[k] - Vec::loadu(mean_ + at);
      at::vec::fmadd(g[k], xmu, Vec::loadu(sum_dy_xmu_.data() + at)).store(sum_dy_xmu_.data() + at);
    }
  }

  int64_t C_;
  const acc_t* mean_;
  std::vector<acc_t> sum_dy_, sum_dy_xmu_;
};

// Planar layout: each channel's values cut into pieces, each piece reduced by a fresh
// accumulator make(c) fed run by run; returns the per-channel merge of the pieces.
template <typename Result, typename MakeAcc>
std::vector<Result> reduce_planar(const Layout& l, int64_t lanes, const MakeAcc& make) {
  const auto pieces = Pieces::of(l.rows(), lanes * kMaxLaneUpdates,
                                 ceil_div(4 * at::get_num_threads(), std::max<int64_t>(l.C, 1)));
  std::vector<Result> parts(l.C * pieces.count);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / pieces.length);
  at::parallel_for(0, l.C * pieces.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / pieces.count, p = item % pieces.count;
      auto acc = make(c);
      for_each_run(l, c, pieces.begin(p), pieces.end(p, l.rows()),
                   [&](int64_t offset, int64_t length) { acc.add(offset, length); });
      parts[item] = acc.result();
    }
  });
  std::vector<Result> out(l.C);
  for (int64_t c = 0; c < l.C; ++c) {
    for (int64_t p = 0; p < pieces.count; ++p) out[c].merge(parts[c * pieces.count + p]);
  }
  return out;
}

// Interleaved layout: rows cut into pieces, each reduced by a fresh per-row accumulator
// make() fed row by row (feed(acc, row)); returns the per-channel merge of the pieces.
template <typename Result, typename MakeAcc, typename Feed>
std::vector<Result> reduce_interleaved(const Layout& l, const MakeAcc& make, const Feed& feed) {
  const int64_t threads = at::get_num_threads();
  auto pieces = Pieces::of(l.rows(), kMaxLaneUpdates, threads);
  pieces = Pieces::of(l.rows(), pieces.length, ceil_div(pieces.count, threads) * threads);
  std::vector<Result> parts(pieces.count * l.C);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(pieces.length * l.C, 1));
  at::parallel_for(0, pieces.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      auto acc = make();
      for (int64_t r = pieces.begin(p); r < pieces.end(p, l.rows()); ++r) feed(acc, r * l.C);
      acc.write(parts.data() + p * l.C);
    }
  });
  std::vector<Result> out(l.C);
  for (int64_t p = 0; p < pieces.count; ++p) {
    for (int64_t c = 0; c < l.C; ++c) out[c].merge(parts[p * l.C + c]);
  }
  return out;
}

// A channel's plain sum: the mean of a channel holding inf or nan, where Welford's running
// mean would turn inf into nan (torch's batch norm keeps inf).
template <typename scalar_t>
double plain_sum(const scalar_t* x, const Layout& l, int64_t c) {
  double sum = 0;
  if (l.interleaved) {
    for (int64_t r = 0; r < l.rows(); ++r) sum += double(x[r * l.C + c]);
  } else {
    for_each_run(l, c, 0, l.rows(), [&](int64_t offset, int64_t length) {
      for (int64_t i = 0; i < length; ++i) sum += double(x[offset + i]);
    });
  }
  return sum;
}

template <typename scalar_t>
void local_stats_kernel(const at::Tensor& x, const Layout& l, double* mean_out, double* m2_out) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  // the first row's values: offsets of a finite pivot, 0 where the first value is not finite
  auto pivot = padded_params<acc_t>(l.C, A::kWidth);
  for (int64_t c = 0; c < l.C; ++c) {
    const acc_t first = acc_t(data[l.interleaved ? c : c * l.S]);
    pivot[c] = std::isfinite(double(first)) ? first : acc_t(0);
  }
  std::vector<Moments> moments;
  if (l.interleaved) {
    moments = reduce_interleaved<Moments>(
        l, [&] { return RowWelford<scalar_t>(l.C, pivot.data()); },
        [&](RowWelford<scalar_t>& acc, int64_t offset) { acc.add_row(data + offset); });
  } else {
    moments = reduce_planar<Moments>(l, A::kWidth, [&](int64_t c) { return LaneWelford<scalar_t>(data, pivot[c]); });
  }
  for (int64_t c = 0; c < l.C; ++c) {
    mean_out[c] = double(pivot[c]) + moments[c].mean;
    if (!std::isfinite(mean_out[c])) mean_out[c] = plain_sum(data, l, c) / double(l.rows());
    m2_out[c] = moments[c].m2;
  }
}

template <typename scalar_t>
void backward_reduce_kernel(const at::Tensor& dy, const at::Tensor& x, const Layout& l,
                            const at::Tensor& mean, double* sum_dy, double* sum_dy_xmu) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  const scalar_t* g = dy.const_data_ptr<scalar_t>();
  const scalar_t* v = x.const_data_ptr<scalar_t>();
  const auto means = padded_params<acc_t>(per_channel_doubles(mean, l.C, 0.0), A::kWidth);
  std::vector<GradSums> sums;
  if (l.interleaved) {
    sums = reduce_interleaved<GradSums>(
        l, [&] { return RowGradSums<scalar_t>(l.C, means.data()); },
        [&](RowGradSums<scalar_t>& acc, int64_t offset) { acc.add_row(g + offset, v + offset); });
  } else {
    sums = reduce_planar<GradSums>(l, A::kWidth, [&](int64_t c) { return LaneGradSums<scalar_t>(g, v, means[c]); });
  }
  for (int64_t c = 0; c < l.C; ++c) {
    sum_dy[c] = sums[c].dy;
    sum_dy_xmu[c] = sums[c].dy_xmu;
  }
}

}  // namespace

std::tuple<int64_t, at::Tensor, at::Tensor> local_stats(const at::Tensor& input) {
  check_input(input, "local_stats");
  const auto [x, l] = as_layout(input);
  auto mean = at::zeros({l.C}, input.options().dtype(at::kDouble));
  auto m2 = at::zeros({l.C}, input.options().dtype(at::kDouble));
  if (l.rows() == 0 || l.C == 0) return {0, mean, m2};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_local_stats", [&] {
    local_stats_kernel<scalar_t>(x, l, mean.data_ptr<double>(), m2.data_ptr<double>());
  });
  return {l.rows(), mean, m2};
}

std::tuple<at::Tensor, at::Tensor> backward_reduce(const at::Tensor& grad_output, const at::Tensor& input,
                                                   const at::Tensor& mean) {
  check_input(input, "backward_reduce");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "syncbn.backward_reduce: grad_output is ",
              grad_output.scalar_type(), " but the input is ", input.scalar_type());
  const auto [x, l] = as_layout(input);
  const auto dy = like_layout(grad_output, x);
  TORCH_CHECK(mean.numel() == l.C, "syncbn.backward_reduce: mean has ", mean.numel(), " values for ", l.C,
              " channels");
  auto sum_dy = at::zeros({l.C}, input.options().dtype(at::kDouble));
  auto sum_dy_xmu = at::zeros({l.C}, input.options().dtype(at::kDouble));
  if (l.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_backward_reduce", [&] {
      backward_reduce_kernel<scalar_t>(dy, x, l, mean, sum_dy.data_ptr<double>(), sum_dy_xmu.data_ptr<double>());
    });
  }
  return {sum_dy.to(mean.scalar_type()), sum_dy_xmu.to(mean.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> merge_stats(const at::Tensor& counts, const at::Tensor& means,
                                               const at::Tensor& m2s) {
  TORCH_CHECK(means.dim() == 2 && m2s.sizes() == means.sizes() && counts.dim() == 1 &&
                  counts.size(0) == means.size(0),
              "syncbn.merge_stats: expected counts (R,), means and m2s (R, C), got ", counts.sizes(), ", ",
              means.sizes(), ", ", m2s.sizes());
  const auto n = counts.to(at::kDouble).contiguous();
  const auto m = means.to(at::kDouble).contiguous();
  const auto s = m2s.to(at::kDouble).contiguous();
  const int64_t R = m.size(0), C = m.size(1);
  auto mean = at::zeros({C}, m.options());
  auto var = at::zeros({C}, m.options());
  const double* pn = n.const_data_ptr<double>();
  const double* pm = m.const_data_ptr<double>();
  const double* ps = s.const_data_ptr<double>();
  double total = 0;
  for (int64_t r = 0; r < R; ++r) total += pn[r];
  TORCH_CHECK(total > 0, "syncbn.merge_stats: the total count must be positive");
  // R-way Chan: M2 = sum_r M2_r + sum_r n_r (m_r - m)^2, deviations from the global mean only
  double* out_mean = mean.data_ptr<double>();
  double* out_var = var.data_ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    double weighted = 0;
    for (int64_t r = 0; r < R; ++r) weighted += pn[r] * pm[r * C + c];
    const double mu = weighted / total;
    double m2 = 0;
    for (int64_t r = 0; r < R; ++r) {
      const double d = pm[r * C + c] - mu;
      m2 += ps[r * C + c] + pn[r] * d * d;
    }
    out_mean[c] = mu;
    out_var[c] = m2 / total;
  }
  return {mean.to(means.scalar_type()), var.to(means.scalar_type())};
}

}  // namespace syncbn::cpu

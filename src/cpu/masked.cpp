// The statistics of the valid positions of a padded batch (the math:
// syncbn.functions.operators.reference_masked): channels_last, Welford over the valid rows, one pass;
// contiguous, where a channel's valid values are no runs, two passes: the mean, then the
// deviations from it with the mean's rounding residue, as local_stats' reference does. The masked
// input gradient is backward_elemt's pass with a mask (elementwise.cpp). One byte of mask per
// position, shared by every channel.
#include <cstring>
#include <type_traits>

#include "batch_norm_cpu.h"
#include "map_per_channel.h"
#include "per_channel.h"
#include "pieces.h"
#include "vectors.h"
#include "welford.h"

namespace syncbn::cpu {
namespace {

// sum(d) and sum(d^2) of one channel's valid values (or of a part of them), d = x - center.
struct CenteredSums {
  double first = 0, second = 0;
  void merge(const CenteredSums& other) {
    first += other.first;
    second += other.second;
  }
};

// The position (sample n, spatial s) of the contiguous layout's value at `offset`: n * S + s.
inline int64_t position_of(const Layout& l, int64_t offset) { return offset / (l.C * l.S) * l.S + offset % l.S; }

// Contiguous layout: one channel's centered sums over its runs, per vector lane.
template <typename scalar_t>
class ContiguousMaskedSums {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  using Vec = typename A::Vec;

 public:
  ContiguousMaskedSums(const scalar_t* x, const acc_t* select, const Layout& l, acc_t center)
      : x_(x), select_(select), l_(l), center_(center), first_(A::broadcast(0)), second_(A::broadcast(0)) {}

  void add(int64_t offset, int64_t length) {
    const scalar_t* p = x_ + offset;
    const acc_t* m = select_ + position_of(l_, offset);
    int64_t i = 0;
    for (; i + A::kWidth <= length; i += A::kWidth) step(A::load(p + i), load_selectors<A, true>(m + i, A::kWidth));
    if (i < length) step(A::load_partial(p + i, length - i), load_selectors<A, false>(m + i, length - i));
  }

  CenteredSums result() const {
    const auto [total_a, total_b] = A::lane_totals(first_, second_);
    return {total_a, total_b};
  }

 private:
  void step(const typename A::Pack& v, const typename A::Pack& select) {
    for (int k = 0; k < A::kVecs; ++k) {
      const Vec d = Vec::blendv(Vec(0), v[k] - center_, select[k]);  // a select: padding may hold inf or nan
      first_[k] = first_[k] + d;
      second_[k] = at::vec::fmadd(d, d, second_[k]);
    }
  }

  const scalar_t* x_;
  const acc_t* select_;
  Layout l_;
  Vec center_;
  typename A::Pack first_, second_;
};

// Contiguous layout: per channel, sum(x - center) and sum((x - center)^2) over the valid values
// (`select`: the mask's selectors, map_per_channel.h).
template <typename scalar_t>
std::vector<CenteredSums> centered_sums(const scalar_t* x, const std::vector<typename AccVec<scalar_t>::acc_t>& select,
                                        const Layout& l,
                                        const std::vector<typename AccVec<scalar_t>::acc_t>& center) {
  using A = AccVec<scalar_t>;
  const int64_t lanes = std::max<int64_t>(1, l.S / ceil_div(l.S, A::kWidth));
  return reduce_contiguous<CenteredSums>(
      l, lanes, [&](int64_t c) { return ContiguousMaskedSums<scalar_t>(x, select.data(), l, center[c]); });
}


// Channels-last layout: Welford over the valid rows, in one pass (local_stats' accumulator, fed
// whole positions); a mean it cannot carry (inf or nan in the channel) is the plain sum's.
template <typename scalar_t>
void welford_over_valid_rows(const scalar_t* data, const bool* mask, const Layout& l, double count, double* mean,
                             double* m2) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  int64_t first = 0;
  while (!mask[first]) ++first;  // there is a valid row
  auto pivot = padded_params<acc_t>(l.C, A::kWidth);  // the first valid row's values, 0 where not finite
  for (int64_t c = 0; c < l.C; ++c) {
    const acc_t value = acc_t(data[first * l.C + c]);
    pivot[c] = std::isfinite(double(value)) ? value : acc_t(0);
  }
  const auto moments = reduce_channels_last<Moments>(
      l, [&] { return ChannelsLastWelford<scalar_t>(l.C, pivot.data()); },
      [&](ChannelsLastWelford<scalar_t>& acc, int64_t offset, int64_t rows) {
        const int64_t row = offset / l.C;
        for (int64_t r = 0; r < rows; ++r) {
          if (mask[row + r]) acc.add_row(data + offset + r * l.C);
        }
      });
  for (int64_t c = 0; c < l.C; ++c) {
    mean[c] = double(pivot[c]) + moments[c].mean;
    if (!std::isfinite(mean[c])) mean[c] = plain_sum(data, l, c, mask) / count;
    m2[c] = moments[c].m2;
  }
}

// Contiguous layout: two passes, about 0 and then about the first pass's mean, whose rounding
// residue corrects it (as local_stats' reference does).
template <typename scalar_t>
void masked_stats_kernel(const at::Tensor& x, const bool* mask, const Layout& l, double count, double* mean,
                         double* m2) {
  using A = AccVec<scalar_t>;
  using acc_t = typename A::acc_t;
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  if (l.channels_last) {
    welford_over_valid_rows(data, mask, l, count, mean, m2);
    return;
  }
  const auto select = selectors<acc_t>(mask, l.rows());
  auto center = padded_params<acc_t>(l.C, A::kWidth);
  const auto raw = centered_sums<scalar_t>(data, select, l, center);
  for (int64_t c = 0; c < l.C; ++c) center[c] = acc_t(raw[c].first / count);
  const auto centered = centered_sums<scalar_t>(data, select, l, center);
  for (int64_t c = 0; c < l.C; ++c) {
    const double residue = centered[c].first;
    m2[c] = centered[c].second - residue * residue / count;
    // an inf makes the residue nan; the mean stays inf, as in torch's batch norm
    mean[c] = double(center[c]) + (std::isfinite(residue) ? residue / count : 0.0);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_local_stats(const at::Tensor& input, const at::Tensor& mask) {
  check_input(input, "masked_local_stats");
  const auto [x, l] = as_layout(input);
  const auto m = positions_mask(mask, input, "masked_local_stats");
  const bool* valid = m.const_data_ptr<bool>();
  int64_t count = 0;
  for (int64_t i = 0; i < l.rows(); ++i) count += valid[i];
  auto mean = at::zeros({l.C}, input.options().dtype(at::kDouble));
  auto m2 = at::zeros({l.C}, input.options().dtype(at::kDouble));
  if (count > 0 && l.C > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "syncbn_masked_local_stats", [&] {
      masked_stats_kernel<scalar_t>(x, valid, l, double(count), mean.data_ptr<double>(), m2.data_ptr<double>());
    });
  }
  return {mean, m2, at::scalar_tensor(double(count), mean.options())};
}

}  // namespace syncbn::cpu

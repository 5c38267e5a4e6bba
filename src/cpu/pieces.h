// How the work of a pass is cut for threads (pieces of a channel's values, runs of the contiguous
// layout) and how much one accumulator lane takes before it folds into double: Welford/Chan
// moments and their folding, and the parallel reductions over either layout.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "layout.h"

namespace syncbn::cpu {

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

// Contiguous layout: calls fn(offset, length) for each run of contiguous values of channel c
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

// Contiguous layout: each channel's values cut into pieces, each piece reduced by a fresh
// accumulator make(c) fed run by run; returns the per-channel merge of the pieces.
template <typename Result, typename MakeAcc>
std::vector<Result> reduce_contiguous(const Layout& l, int64_t lanes, const MakeAcc& make) {
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

// Channels-last layout: rows cut into pieces, each reduced by a fresh per-row accumulator
// make() fed the piece's rows (feed(acc, offset of the first, count)); returns the
// per-channel merge of the pieces.
template <typename Result, typename MakeAcc, typename Feed>
std::vector<Result> reduce_channels_last(const Layout& l, const MakeAcc& make, const Feed& feed) {
  const int64_t threads = at::get_num_threads();
  auto pieces = Pieces::of(l.rows(), kMaxLaneUpdates, threads);
  pieces = Pieces::of(l.rows(), pieces.length, ceil_div(pieces.count, threads) * threads);
  std::vector<Result> parts(pieces.count * l.C);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(pieces.length * l.C, 1));
  at::parallel_for(0, pieces.count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      auto acc = make();
      feed(acc, pieces.begin(p) * l.C, pieces.end(p, l.rows()) - pieces.begin(p));
      acc.write(parts.data() + p * l.C);
    }
  });
  std::vector<Result> out(l.C);
  for (int64_t p = 0; p < pieces.count; ++p) {
    for (int64_t c = 0; c < l.C; ++c) out[c].merge(parts[p * l.C + c]);
  }
  return out;
}

}  // namespace syncbn::cpu

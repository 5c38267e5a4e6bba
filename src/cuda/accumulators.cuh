// Per-thread accumulators (Welford/Chan moments, backward sums, their folding into double, their
// channels_last lanes) and their warp and block merges.
#pragma once

#include "packs.cuh"

namespace syncbn::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// Count, mean and M2 of values (shifted by a pivot), plus their plain sum (the mean of a
// channel holding inf, where Welford's mean turns into nan). Chan's formula merges two.
template <typename T>
struct Welford {
  T n, mean, m2, sum;

  __device__ __forceinline__ void add(T d) {
    n += T(1);
    const T delta = d - mean;
    mean += delta / n;
    m2 += delta * (d - mean);
    sum += d;
  }
  // the update for a count n already advanced, given 1 / n (lanes that share n share it)
  __device__ __forceinline__ void add_with(T d, T inv_n) {
    const T delta = d - mean;
    mean += delta * inv_n;
    m2 += delta * (d - mean);
    sum += d;
  }
  __device__ __forceinline__ void merge(const Welford& o) {
    if (o.n == T(0)) return;
    if (n == T(0)) {
      *this = o;
      return;
    }
    const T total = n + o.n;
    merge_moments(o, o.n / total);
    n = total;
  }
  // Chan's update of mean, m2 and sum by o's, f = o.n / (n + o.n): lanes that share their
  // counts share f (Lanes<Welford>)
  __device__ __forceinline__ void merge_moments(const Welford& o, T f) {
    const T delta = o.mean - mean;
    mean += delta * f;
    m2 += o.m2 + delta * delta * n * f;
    sum += o.sum;
  }
  __device__ __forceinline__ Welford shfl_down(int offset) const {
    return {__shfl_down_sync(kFullMask, n, offset), __shfl_down_sync(kFullMask, mean, offset),
            __shfl_down_sync(kFullMask, m2, offset), __shfl_down_sync(kFullMask, sum, offset)};
  }
  __device__ __forceinline__ Welford<double> to_double() const {
    return {double(n), double(mean), double(m2), double(sum)};
  }
};

// The two running sums of a backward pass: sum(g) and sum(g * (x - mean)), g being dy (sum_dy,
// sum_dy_xmu) or dy through the activation.
template <typename T>
struct Sums {
  T sum_g, sum_g_xmu;

  __device__ __forceinline__ void add(T g, T g_xmu) {
    sum_g += g;
    sum_g_xmu += g_xmu;
  }
  __device__ __forceinline__ void merge(const Sums& o) {
    sum_g += o.sum_g;
    sum_g_xmu += o.sum_g_xmu;
  }
  __device__ __forceinline__ Sums shfl_down(int offset) const {
    return {__shfl_down_sync(kFullMask, sum_g, offset), __shfl_down_sync(kFullMask, sum_g_xmu, offset)};
  }
  __device__ __forceinline__ Sums<double> to_double() const { return {double(sum_g), double(sum_g_xmu)}; }
};

// Per-thread accumulation in float, folded into double every kFoldUpdates updates (the CPU
// kernels' rule, src/cpu/pieces.h): a float32 Welford mean that ran over more values left the
// weight gradient 5x-8x further from the truth than torch's double accumulation on data with a
// large mean. `Kind` is Welford or Sums (or Lanes of them); warps, blocks and splits then merge
// in double. float64 inputs accumulate in double throughout (fold does nothing).
//
// The kernels fold after every fold_items<V, kPerLane>() items, outside their inner loop
// (accumulate): a fold inside it (a counter and a branch per update) made ptxas copy the double
// accumulators on every iteration, 196 registers for 8 channels_last lanes of halves. Folding a
// partial chunk at the end gives the same bits as merging it in to_double.
constexpr int kFoldUpdates = 16;

template <template <typename> class Kind, typename acc_t>
struct ThreadAcc {
  static constexpr bool kFolds = std::is_same_v<acc_t, float>;
  Kind<acc_t> run{};
  Kind<double> folded{};  // unused for float64

  template <typename... Values>
  __device__ __forceinline__ void add(const Values&... values) {
    run.add(values...);
  }
  __device__ __forceinline__ void fold() {
    if constexpr (kFolds) {
      folded.merge(run.to_double());
      run = Kind<acc_t>{};
    }
  }
  __device__ __forceinline__ Kind<double> to_double() const {
    if constexpr (kFolds) {
      Kind<double> total = folded;
      total.merge(run.to_double());
      return total;
    } else {
      return run;
    }
  }
};

// Items between two folds: an item adds its V values one after another (contiguous: V
// updates) or one to each of V lanes (channels_last: one update of every lane).
template <int V, bool kPerLane>
constexpr int fold_items() {
  static_assert(kPerLane || kFoldUpdates % V == 0, "a fold falls between two packs");
  return kPerLane ? kFoldUpdates : kFoldUpdates / V;
}

// Items a float64 thread's loop takes unrolled, its loads issued together.
constexpr int kUnrollItems = 4;

// A thread's loop: item() while more(), acc folded after every kItems items (in chunks: no
// fold in the inner loop; a plain loop where nothing folds). ahead(k) says whether k more items
// remain: a chunk that is whole runs unrolled, with no test between items, so that its loads are
// issued before their values are used and the Welford counts are constants. kUnroll false keeps
// the plain loop (single values read one at a time, whose 16 unrolled items spill).
template <int kItems, bool kUnroll, typename Acc, typename More, typename Ahead, typename Item>
__device__ __forceinline__ void accumulate(Acc& acc, More more, Ahead ahead, Item item) {
  if constexpr (!kUnroll) {
    accumulate<kItems, true>(acc, more, [](int) { return false; }, item);
  } else if constexpr (Acc::kFolds) {
    while (more()) {
      if (ahead(kItems)) {
#pragma unroll
        for (int i = 0; i < kItems; ++i) item();
      } else {
        for (int i = 0; i < kItems && more(); ++i) item();
      }
      acc.fold();
    }
  } else {
    while (ahead(kUnrollItems)) {
#pragma unroll
      for (int i = 0; i < kUnrollItems; ++i) item();
    }
    while (more()) item();
  }
}

// V lanes of a Kind (Welford<T>, Sums<T>): a channels_last thread's V consecutive channels,
// every item adding one value to each lane (add takes arrays of V: lane j gets values[j]...).
// Each lane runs Kind's own arithmetic; the Welford lanes keep their count n once (their
// specialization below).
template <typename K, int V>
struct Lanes {
  K each[V];

  __device__ __forceinline__ K lane(int j) const { return each[j]; }
  template <typename... Values>
  __device__ __forceinline__ void add(const Values&... values) {
#pragma unroll
    for (int j = 0; j < V; ++j) each[j].add(values[j]...);
  }
  __device__ __forceinline__ void merge(const Lanes& o) {
#pragma unroll
    for (int j = 0; j < V; ++j) each[j].merge(o.each[j]);
  }
  __device__ __forceinline__ auto to_double() const {
    Lanes<decltype(K{}.to_double()), V> result;
#pragma unroll
    for (int j = 0; j < V; ++j) result.each[j] = each[j].to_double();
    return result;
  }
};

// Welford lanes share their count: n is the same in every lane (one value each per item), so it
// is kept once, and a merge divides once for all lanes (Welford's own branches and f, hoisted).
// Lane j is Welford<T>{n, mean[j], m2[j], sum[j]}, updated by Welford's own arithmetic.
template <typename T, int V>
struct Lanes<Welford<T>, V> {
  T n;
  T mean[V], m2[V], sum[V];

  __device__ __forceinline__ Welford<T> lane(int j) const { return {n, mean[j], m2[j], sum[j]}; }
  __device__ __forceinline__ void set(int j, const Welford<T>& w) {  // lane j's moments (not n)
    mean[j] = w.mean;
    m2[j] = w.m2;
    sum[j] = w.sum;
  }
  __device__ __forceinline__ void add(const T (&d)[V]) {
    n += T(1);
    const T inv_n = T(1) / n;  // one reciprocal for every lane
#pragma unroll
    for (int j = 0; j < V; ++j) {
      Welford<T> w = lane(j);
      w.add_with(d[j], inv_n);
      set(j, w);
    }
  }
  __device__ __forceinline__ void merge(const Lanes& o) {
    if (o.n == T(0)) return;
    if (n == T(0)) {
      *this = o;
      return;
    }
    const T total = n + o.n, f = o.n / total;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      Welford<T> w = lane(j);
      w.merge_moments(o.lane(j), f);
      set(j, w);
    }
    n = total;
  }
  __device__ __forceinline__ Lanes<Welford<double>, V> to_double() const {
    Lanes<Welford<double>, V> result{double(n)};
#pragma unroll
    for (int j = 0; j < V; ++j) result.set(j, lane(j).to_double());
    return result;
  }
};

// ThreadAcc for V lanes of Kind: a channels_last thread's accumulator, folding all lanes at once.
template <template <typename> class Kind, int V>
struct LanesOf {
  template <typename T>
  using Of = Lanes<Kind<T>, V>;
};
template <template <typename> class Kind, typename acc_t, int V>
using ThreadLanesAcc = ThreadAcc<LanesOf<Kind, V>::template Of, acc_t>;

// The V values of a pack (arrays of V, one per argument of Kind's add) into a thread's
// accumulator: one after another into one channel's (contiguous), or as one item of V lanes
// (channels_last).
template <bool kPerLane, typename Acc, typename T, int V, typename... More>
__device__ __forceinline__ void add_pack(Acc& acc, const T (&first)[V], const More&... more) {
  if constexpr (kPerLane) {
    acc.add(first, more...);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) acc.add(first[j], more[j]...);
  }
}

template <typename Acc>
__device__ __forceinline__ void warp_reduce(Acc& acc) {
  for (int offset = 16; offset > 0; offset /= 2) acc.merge(acc.shfl_down(offset));
}

// The merge of every thread's acc of a 1-D block (blockDim.x a multiple of 32), in thread 0.
template <typename Acc>
__device__ __forceinline__ Acc block_reduce(Acc acc, Acc* warps /* 32 entries of shared memory */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  warp_reduce(acc);
  if (lane == 0) warps[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < int(blockDim.x / 32) ? warps[lane] : Acc{};
    warp_reduce(acc);
  }
  return acc;
}

// The merge over threadIdx.y of every column x of a 2-D block, in the threads with y == 0;
// `tile` is shared memory for blockDim.x * blockDim.y entries. Every thread must call it.
template <typename Acc>
__device__ __forceinline__ Acc column_reduce(const Acc& acc, Acc* tile) {
  const int x = threadIdx.x, y = threadIdx.y, TX = blockDim.x;
  __syncthreads();  // the tile may still be read by a previous call
  tile[y * TX + x] = acc;
  __syncthreads();
  for (int active = blockDim.y; active > 1;) {
    const int half = (active + 1) / 2;
    if (y < active - half) tile[y * TX + x].merge(tile[(y + half) * TX + x]);
    __syncthreads();
    active = half;
  }
  return tile[x];
}

}  // namespace syncbn::cuda

// Per-thread accumulators (Welford/Chan moments, backward sums, their folding into double) and
// their warp and block merges.
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
  __device__ __forceinline__ void merge(const Welford& o) {
    if (o.n == T(0)) return;
    if (n == T(0)) {
      *this = o;
      return;
    }
    const T total = n + o.n, delta = o.mean - mean, f = o.n / total;
    mean += delta * f;
    m2 += o.m2 + delta * delta * n * f;
    sum += o.sum;
    n = total;
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
// large mean. `Kind` is Welford or Sums; warps, blocks and splits then merge in double.
constexpr int kFoldUpdates = 16;

template <template <typename> class Kind>
struct FoldingAcc {
  Kind<float> run{};
  Kind<double> folded{};
  int updates = 0;

  template <typename... Values>
  __device__ __forceinline__ void add(Values... values) {
    run.add(values...);
    if (++updates == kFoldUpdates) {
      folded.merge(run.to_double());
      run = Kind<float>{};
      updates = 0;
    }
  }
  __device__ __forceinline__ Kind<double> to_double() const {
    Kind<double> total = folded;
    total.merge(run.to_double());
    return total;
  }
};

// What a thread accumulates in: float that folds into double for the float accumulation type
// (float32, bfloat16, float16 inputs), double for float64.
template <template <typename> class Kind, typename acc_t>
using ThreadAcc = std::conditional_t<std::is_same_v<acc_t, float>, FoldingAcc<Kind>, Kind<acc_t>>;

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

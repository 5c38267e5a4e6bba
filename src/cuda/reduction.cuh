// The reduction launch framework: per-channel accumulators, one block per channel (contiguous)
// or per tile of channels (channels_last), with up to 65535 blocks ("splits") more along the
// reduced dimension; with more than one split, blocks write float64 partials and a second kernel
// merges them, one warp per channel, in a fixed order (deterministic).
#pragma once

#include <algorithm>
#include <type_traits>

#include "accumulators.cuh"

namespace syncbn::cuda {

// Reduction framework. Op provides acc_t, `template <typename T> using Kind` (Welford or Sums:
// a thread accumulates in ThreadAcc of it, contiguous, or ThreadLanesAcc, channels_last, and
// folds between chunks of items), Partial (Kind<double>, in which warps, blocks and splits
// merge), `State channel(int64_t c)`, `template <int V, bool kPerLane, typename Acc> void
// item(int64_t i, const State* st, Acc& acc)` (add_pack of the pack's values),
// `void finish(int64_t c, const Partial& total)`, and optionally kMaxLanes (lanes_for) and
// kUnroll (Unrolls).
// Every kernel declares its block size (host.cuh) as its __launch_bounds__, and its launch
// uses that constant.

// Op::kUnroll where Op sets it, else true: whether whole chunks run unrolled (accumulate).
template <typename Op, typename = void>
struct Unrolls {
  static constexpr bool value = true;
};
template <typename Op>
struct Unrolls<Op, std::void_t<decltype(Op::kUnroll)>> {
  static constexpr bool value = bool(Op::kUnroll);
};

template <typename Op, int V>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_contiguous_kernel(Op op, int64_t N, int64_t C, int64_t Sv, typename Op::Partial* partial) {
  const int64_t c = blockIdx.x;
  const typename Op::State st = op.channel(c);
  ThreadAcc<Op::template Kind, typename Op::acc_t> acc{};
  // pack k = n * Sv + s of channel c, at ((n * C + c) * Sv + s) * V
  const int64_t stride = int64_t(gridDim.y) * blockDim.x;
  const int64_t k = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  int64_t n = k / Sv, s = k % Sv;
  const int64_t dn = stride / Sv, ds = stride % Sv;
  const auto ahead = [&](int items) { return n * Sv + s + (items - 1) * stride < N * Sv; };
  accumulate<fold_items<V, false>(), (V > 1 && Unrolls<Op>::value)>(acc, [&] { return n < N; }, ahead, [&] {
    op.template item<V, false>(((n * C + c) * Sv + s) * V, &st, acc);
    s += ds;
    n += dn;
    if (s >= Sv) {
      s -= Sv;
      ++n;
    }
  });
  __shared__ typename Op::Partial warps[32];
  const typename Op::Partial total = block_reduce(acc.to_double(), warps);  // in double
  if (threadIdx.x == 0) {
    if (gridDim.y == 1) {
      op.finish(c, total);
    } else {
      partial[c * gridDim.y + blockIdx.y] = total;
    }
  }
}

template <typename Op, int V>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocks)
    reduce_channels_last_kernel(Op op, int64_t M, int64_t C, int64_t groups, typename Op::Partial* partial) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // channels g*V .. g*V+V-1
  const bool active = g < groups;
  ThreadLanesAcc<Op::template Kind, typename Op::acc_t, V> acc{};
  typename Op::State st[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (active) st[j] = op.channel(g * V + j);
  }
  if (active) {
    const int64_t stride = int64_t(gridDim.y) * blockDim.y;
    int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
    const auto ahead = [&](int items) { return r + (items - 1) * stride < M; };
    accumulate<fold_items<V, true>(), Unrolls<Op>::value>(acc, [&] { return r < M; }, ahead, [&] {
      op.template item<V, true>(r * C + g * V, st, acc);
      r += stride;
    });
  }
  using Partial = typename Op::Partial;
  __shared__ __align__(16) unsigned char tile_bytes[kTileThreads * sizeof(Partial)];
  static_assert(sizeof(tile_bytes) <= 48 * 1024, "static shared memory: 48 KiB at most");
  Partial* tile = reinterpret_cast<Partial*>(tile_bytes);
  const auto lanes = acc.to_double();
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const Partial total = column_reduce(lanes.lane(j), tile);  // in double
    if (threadIdx.y == 0 && active) {
      const int64_t c = g * V + j;
      if (gridDim.y == 1) {
        op.finish(c, total);
      } else {
        partial[c * gridDim.y + blockIdx.y] = total;
      }
    }
  }
}

// Second stage: one warp per channel merges its `splits` partials in a fixed order.
template <typename Op>
__global__ void __launch_bounds__(kFinishThreads)
    finish_kernel(Op op, int64_t C, int64_t splits, const typename Op::Partial* partial) {
  using Partial = typename Op::Partial;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (c >= C) return;  // whole warps: blockDim.x is a multiple of 32
  Partial acc{};
  for (int64_t i = lane; i < splits; i += 32) acc.merge(partial[c * splits + i]);
  warp_reduce(acc);
  if (lane == 0) op.finish(c, acc);
}

// Op::kMaxLanes where Op sets it, else 4: 8 lanes of Sums spilled from kTileMinBlocks' 80 registers.
// (A trait, not a C++20 requires-expression: torch before 2.12 builds extensions as C++17.)
template <typename Op, typename = void>
struct MaxLanes {
  static constexpr int value = 4;
};
template <typename Op>
struct MaxLanes<Op, std::void_t<decltype(Op::kMaxLanes)>> {
  static constexpr int value = int(Op::kMaxLanes);
};

// The channels a channels_last thread takes from a pack of V: V, or fewer where its accumulators
// for V lanes would not fit in the registers of kTileMinBlocks blocks of kTileThreads (MaxLanes).
template <typename Op, int V>
constexpr int lanes_for() {
  return std::min(V, MaxLanes<Op>::value);
}

template <typename Op, int V>
void run_reduction(const Op& op, const Layout& l, const at::TensorOptions& options, cudaStream_t stream) {
  using Partial = typename Op::Partial;
  constexpr int W = lanes_for<Op, V>();  // divides V: its packs are aligned and divide C too
  const int sms = multiprocessors();
  dim3 grid, block;
  if (l.channels_last) {
    const int64_t groups = l.C / W, tiles = ceil_div(groups, kMaxTileChannels);
    const int64_t TX = ceil_div(groups, tiles), TY = kTileThreads / TX;  // TX <= kMaxTileChannels
    block = dim3(unsigned(TX), unsigned(TY));  // TX * TY <= kTileThreads, the kernel's bound
    static PerDevice resident{};
    const int per_sm = resident_blocks(resident, reduce_channels_last_kernel<Op, W>, kTileThreads);
    grid = dim3(unsigned(tiles), unsigned(row_splits_for(l.rows(), TY, tiles, int64_t(per_sm) * sms)));
  } else {
    block = dim3(kReduceThreads);
    grid = dim3(unsigned(l.C), unsigned(splits_for(l.N * (l.S / V), kReduceThreads, l.C, sms)));
  }
  at::Tensor workspace;
  Partial* partial = nullptr;
  if (grid.y > 1) {
    const int64_t doubles = l.C * int64_t(grid.y) * int64_t(sizeof(Partial) / sizeof(double));
    workspace = at::empty({doubles}, options.dtype(at::kDouble));
    partial = reinterpret_cast<Partial*>(workspace.data_ptr<double>());
  }
  if (l.channels_last) {
    reduce_channels_last_kernel<Op, W><<<grid, block, 0, stream>>>(op, l.rows(), l.C, l.C / W, partial);
  } else {
    reduce_contiguous_kernel<Op, V><<<grid, block, 0, stream>>>(op, l.N, l.C, l.S / V, partial);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (grid.y > 1) {
    const unsigned blocks = unsigned(ceil_div(l.C * 32, kFinishThreads));  // a warp per channel
    finish_kernel<Op><<<blocks, kFinishThreads, 0, stream>>>(op, l.C, grid.y, partial);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // the workspace goes back to the caching allocator, which reuses it on this stream only
  // after the kernels above (stream order)
}

template <typename scalar_t, typename Op>
void launch_reduction(const Op& op, const Layout& l, bool vectorize, const at::TensorOptions& options,
                      cudaStream_t stream) {
  if (vectorize) {
    run_reduction<Op, kVec<scalar_t>>(op, l, options, stream);
  } else {
    run_reduction<Op, 1>(op, l, options, stream);
  }
}

}  // namespace syncbn::cuda

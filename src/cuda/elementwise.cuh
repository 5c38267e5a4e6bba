// The elementwise launch framework: a 1-D grid-stride loop over packs of V values; the channel
// of each pack is tracked incrementally (no division in the loop). Contiguous (NCHW): a pack lies
// in one channel's run (V divides S); channels_last (NHWC): a pack holds V consecutive channels
// of one row (V divides C).
#pragma once

#include "packs.cuh"

namespace syncbn::cuda {

// Elementwise framework. Op provides `State channel(int64_t c)` (its per-channel coefficients)
// and `template <int V, bool kPerLane> void item(int64_t i, const State* st)` for the V values
// at i, whose channel states are st[0] (contiguous) or st[0..V) (channels_last, kPerLane).

template <typename Op, int V, bool kChannelsLast>
__global__ void __launch_bounds__(kElementwiseThreads)
    elementwise_kernel(Op op, int64_t packs, int64_t inner, int64_t outer) {
  // pack k = (q * outer + c) * inner + s: s its place in a channel's run (contiguous; inner = 1
  // channels_last), c its channel (contiguous) or group of V channels (channels_last)
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  int64_t s = k % inner, c = (k / inner) % outer;
  const int64_t ds = stride % inner, dc = (stride / inner) % outer;
  // the channel states, loaded again only when the channel (group) changes: never where the
  // stride is a multiple of the groups (run_elementwise arranges that for channels_last layouts)
  constexpr int kStates = kChannelsLast ? V : 1;
  typename Op::State st[kStates];
  int64_t loaded = -1;
  for (; k < packs; k += stride) {
    if (c != loaded) {
#pragma unroll
      for (int j = 0; j < kStates; ++j) st[j] = op.channel(kChannelsLast ? c * V + j : c);
      loaded = c;
    }
    op.template item<V, kChannelsLast>(k * V, st);
    s += ds;
    c += dc;
    if (s >= inner) {
      s -= inner;
      ++c;
    }
    if (c >= outer) c -= outer;
  }
}

template <typename Op, int V>
void run_elementwise(const Op& op, const Layout& l, cudaStream_t stream) {
  const int64_t packs = l.numel() / V;
  if (packs == 0) return;
  const int64_t cap = int64_t(multiprocessors()) * 8 * kBlocksPerSM;
  int64_t blocks = std::min<int64_t>(ceil_div(packs, kElementwiseThreads), cap);
  if (l.channels_last) {
    // a grid stride that is a multiple of the channel groups: each thread keeps its channels
    const int64_t groups = l.C / V, period = groups / std::gcd<int64_t>(groups, kElementwiseThreads);
    if (period <= 4 * cap) blocks = ceil_div(blocks, period) * period;
    elementwise_kernel<Op, V, true><<<blocks, kElementwiseThreads, 0, stream>>>(op, packs, 1, l.C / V);
  } else {
    elementwise_kernel<Op, V, false><<<blocks, kElementwiseThreads, 0, stream>>>(op, packs, l.S / V, l.C);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// 16-byte packs where can_vectorize allows, else scalar accesses.
template <typename scalar_t, typename Op>
void launch_elementwise(const Op& op, const Layout& l, bool vectorize, cudaStream_t stream) {
  if (vectorize) {
    run_elementwise<Op, kVec<scalar_t>>(op, l, stream);
  } else {
    run_elementwise<Op, 1>(op, l, stream);
  }
}

}  // namespace syncbn::cuda

// Shared machinery of the CUDA kernels (included by every .cu file of src/cuda/, so that the
// compile check of each .cu file covers it): the two memory layouts, 16-byte packs,
// Welford/Chan and sum accumulators with their warp and block merges, and the two launch
// frameworks that every operation plugs an "op" into:
//
//  * elementwise: a 1-D grid-stride loop over packs of V values; the channel of each pack is
//    tracked incrementally (no division in the loop). Planar (NCHW): a pack lies in one
//    channel's run (V divides S); interleaved (NHWC): a pack holds V consecutive channels of
//    one row (V divides C).
//  * reduction: per-channel accumulators, one block per channel (planar) or per tile of
//    channels (interleaved), with up to 65535 blocks ("splits") more along the reduced
//    dimension; with more than one split, blocks write float64 partials and a second kernel
//    merges them, one warp per channel, in a fixed order (deterministic).
//
// Headers: only c10/cuda (stream, guard, launch check) and ATen core; ATen/cuda/CUDAContext.h
// pulls in cuBLAS/cuSPARSE headers, which a bare toolkit (the CI compile check) may not have.
// c10::cuda::getCurrentCUDAStream is the function at::cuda::getCurrentCUDAStream names.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include "layout.h"

namespace syncbn::cuda {

// ---------------------------------------------------------------------------------------------
// Host: argument checks, launch shapes (the layouts are in src/layout.h)

inline void check_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), "syncbn.cuda.", op, ": expected a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.dim() >= 2, "syncbn.cuda.", op, ": expected an input of rank >= 2, got ", x.dim());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16, "syncbn.cuda.", op,
              ": expected a float64, float32, float16 or bfloat16 input, got ", t);
}

inline void check_same_dtype(const at::Tensor& grad, const at::Tensor& x, const char* op) {
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), "syncbn.cuda.", op, ": grad_output is ", grad.scalar_type(),
              " but the input is ", x.scalar_type());
}

// A (C,) tensor as a contiguous tensor of dtype `acc` on x's device (a no-op when it is one).
inline at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x, int64_t C, at::ScalarType acc,
                              const char* what) {
  TORCH_CHECK(v.numel() == C, "syncbn.cuda: ", what, " has ", v.numel(), " values for ", C, " channels");
  TORCH_CHECK(v.device() == x.device(), "syncbn.cuda: ", what, " is on ", v.device(), " but the input is on ",
              x.device());
  return v.reshape({C}).to(acc).contiguous();
}

inline at::ScalarType accumulation_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Values per 16-byte pack.
template <typename scalar_t>
constexpr int kVec = 16 / int(sizeof(scalar_t));

// Packs of V values may be used when V divides the run along which they are read (S planar,
// C interleaved) and every pointer is 16-byte aligned; else every access is scalar.
inline bool can_vectorize(const Layout& l, int V, std::initializer_list<const void*> pointers) {
  if ((l.interleaved ? l.C : l.S) % V != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

constexpr int kThreads = 256;              // threads per block, 1-D launches
constexpr int kTileThreads = 512;          // threads per block, interleaved reductions (TX * TY)
constexpr int kMaxTileChannels = 64;       // packs of channels per interleaved tile (TX)
constexpr int64_t kMaxItemsPerThread = 64; // packs a thread takes at most in one split
constexpr int64_t kMinItemsPerThread = 4;  // below this, another split costs more than it saves
constexpr int kBlocksPerSM = 4;            // blocks wanted per multiprocessor

inline int multiprocessors() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Blocks along the reduced dimension, given `items` packs per channel (group), `threads` of a
// block along it, and `blocks` already launched across channels: enough to fill the device,
// no fewer than kMaxItemsPerThread packs per thread allow, no more than useful.
inline int64_t splits_for(int64_t items, int64_t threads, int64_t blocks, int sms) {
  const int64_t needed = ceil_div(items, threads * kMaxItemsPerThread);
  const int64_t wanted = ceil_div(int64_t(kBlocksPerSM) * sms, blocks);
  const int64_t useful = ceil_div(items, threads * kMinItemsPerThread);
  return std::clamp<int64_t>(std::max(needed, std::min(wanted, useful)), 1, 65535);
}

// ---------------------------------------------------------------------------------------------
// Device: packs and arithmetic

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T val[V];
};

template <int V, typename T>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, int64_t i) {
  return *reinterpret_cast<const Pack<T, V>*>(p + i);
}

template <int V, typename T>
__device__ __forceinline__ void store_pack(T* p, int64_t i, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p + i) = v;
}

__device__ __forceinline__ float fma_acc(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return __fma_rn(a, b, c); }

// x * scale + shift (+ residual): the activation's input, one expression for the forward and
// for the backward's recomputation, so that both take the same side of the sign test.
template <typename acc_t>
__device__ __forceinline__ acc_t pre_activation(acc_t x, acc_t scale, acc_t shift, bool has_residual, acc_t residual) {
  const acc_t p = fma_acc(x, scale, shift);
  return has_residual ? p + residual : p;
}

// act(p) = p where p > 0, else p * slope (nan stays nan, as torch.where(p > 0, p, p * slope)).
template <typename acc_t>
__device__ __forceinline__ bool negative_side(acc_t p) {
  return !(p > acc_t(0));
}

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

// Two running sums (sum_dy and sum_dy_xmu, or sum_g and sum_g_xmu).
template <typename T>
struct Sums {
  T a, b;

  __device__ __forceinline__ void add(T x, T y) {
    a += x;
    b += y;
  }
  __device__ __forceinline__ void merge(const Sums& o) {
    a += o.a;
    b += o.b;
  }
  __device__ __forceinline__ Sums shfl_down(int offset) const {
    return {__shfl_down_sync(kFullMask, a, offset), __shfl_down_sync(kFullMask, b, offset)};
  }
  __device__ __forceinline__ Sums<double> to_double() const { return {double(a), double(b)}; }
};

// Per-thread accumulation in float, folded into double every kFoldUpdates updates (the CPU
// kernels' rule, src/cpu/loops.h): a float32 Welford mean that ran over more values left the
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

// ---------------------------------------------------------------------------------------------
// Elementwise framework. Op provides `State channel(int64_t c)` (its per-channel coefficients)
// and `template <int V, bool kPerLane> void item(int64_t i, const State* st)` for the V values
// at i, whose channel states are st[0] (planar) or st[0..V) (interleaved, kPerLane).

template <typename Op, int V, bool kInterleaved>
__global__ void elementwise_kernel(Op op, int64_t packs, int64_t inner, int64_t outer) {
  // pack k = (q * outer + c) * inner + s: s its place in a channel's run (planar; inner = 1
  // interleaved), c its channel (planar) or group of V channels (interleaved)
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= packs) return;
  int64_t s = k % inner, c = (k / inner) % outer;
  const int64_t ds = stride % inner, dc = (stride / inner) % outer;
  // the channel states, loaded again only when the channel (group) changes: never where the
  // stride is a multiple of the groups (run_elementwise arranges that for interleaved layouts)
  constexpr int kStates = kInterleaved ? V : 1;
  typename Op::State st[kStates];
  int64_t loaded = -1;
  for (; k < packs; k += stride) {
    if (c != loaded) {
#pragma unroll
      for (int j = 0; j < kStates; ++j) st[j] = op.channel(kInterleaved ? c * V + j : c);
      loaded = c;
    }
    op.template item<V, kInterleaved>(k * V, st);
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
  int64_t blocks = std::min<int64_t>(ceil_div(packs, kThreads), cap);
  if (l.interleaved) {
    // a grid stride that is a multiple of the channel groups: each thread keeps its channels
    const int64_t groups = l.C / V, period = groups / std::gcd<int64_t>(groups, kThreads);
    if (period <= 4 * cap) blocks = ceil_div(blocks, period) * period;
    elementwise_kernel<Op, V, true><<<blocks, kThreads, 0, stream>>>(op, packs, 1, l.C / V);
  } else {
    elementwise_kernel<Op, V, false><<<blocks, kThreads, 0, stream>>>(op, packs, l.S / V, l.C);
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

// ---------------------------------------------------------------------------------------------
// Reduction framework. Op provides Acc (a thread's accumulator, ThreadAcc), Partial (its float64
// form, in which warps, blocks and splits merge), `State channel(int64_t c)`, `template <int V, bool kPerLane> void item(int64_t i,
// const State* st, Acc* acc)` and `void finish(int64_t c, const Partial& total)`.

template <typename Op, int V>
__global__ void reduce_planar_kernel(Op op, int64_t N, int64_t C, int64_t Sv, typename Op::Partial* partial) {
  using Acc = typename Op::Acc;
  const int64_t c = blockIdx.x;
  const typename Op::State st = op.channel(c);
  Acc acc{};
  // pack k = n * Sv + s of channel c, at ((n * C + c) * Sv + s) * V
  const int64_t stride = int64_t(gridDim.y) * blockDim.x;
  const int64_t k = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  int64_t n = k / Sv, s = k % Sv;
  const int64_t dn = stride / Sv, ds = stride % Sv;
  while (n < N) {
    op.template item<V, false>(((n * C + c) * Sv + s) * V, &st, &acc);
    s += ds;
    n += dn;
    if (s >= Sv) {
      s -= Sv;
      ++n;
    }
  }
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
__global__ void reduce_interleaved_kernel(Op op, int64_t M, int64_t C, int64_t groups,
                                          typename Op::Partial* partial) {
  using Acc = typename Op::Acc;
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // channels g*V .. g*V+V-1
  const bool active = g < groups;
  Acc acc[V];
  typename Op::State st[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    acc[j] = Acc{};
    if (active) st[j] = op.channel(g * V + j);
  }
  if (active) {
    const int64_t stride = int64_t(gridDim.y) * blockDim.y;
    for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < M; r += stride) {
      op.template item<V, true>(r * C + g * V, st, acc);
    }
  }
  using Partial = typename Op::Partial;
  __shared__ __align__(16) unsigned char tile_bytes[kTileThreads * sizeof(Partial)];
  Partial* tile = reinterpret_cast<Partial*>(tile_bytes);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const Partial total = column_reduce(acc[j].to_double(), tile);  // in double
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
__global__ void finish_kernel(Op op, int64_t C, int64_t splits, const typename Op::Partial* partial) {
  using Partial = typename Op::Partial;
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (c >= C) return;  // whole warps: blockDim.x is a multiple of 32
  Partial acc{};
  for (int64_t i = lane; i < splits; i += 32) acc.merge(partial[c * splits + i]);
  warp_reduce(acc);
  if (lane == 0) op.finish(c, acc);
}

template <typename Op, int V>
void run_reduction(const Op& op, const Layout& l, const at::TensorOptions& options, cudaStream_t stream) {
  using Partial = typename Op::Partial;
  const int sms = multiprocessors();
  dim3 grid, block;
  if (l.interleaved) {
    const int64_t groups = l.C / V, tiles = ceil_div(groups, kMaxTileChannels);
    const int64_t TX = ceil_div(groups, tiles), TY = kTileThreads / TX;
    block = dim3(unsigned(TX), unsigned(TY));
    grid = dim3(unsigned(tiles), unsigned(splits_for(l.rows(), TY, tiles, sms)));
  } else {
    block = dim3(kThreads);
    grid = dim3(unsigned(l.C), unsigned(splits_for(l.N * (l.S / V), kThreads, l.C, sms)));
  }
  at::Tensor workspace;
  Partial* partial = nullptr;
  if (grid.y > 1) {
    const int64_t doubles = l.C * int64_t(grid.y) * int64_t(sizeof(Partial) / sizeof(double));
    workspace = at::empty({doubles}, options.dtype(at::kDouble));
    partial = reinterpret_cast<Partial*>(workspace.data_ptr<double>());
  }
  if (l.interleaved) {
    reduce_interleaved_kernel<Op, V><<<grid, block, 0, stream>>>(op, l.rows(), l.C, l.C / V, partial);
  } else {
    reduce_planar_kernel<Op, V><<<grid, block, 0, stream>>>(op, l.N, l.C, l.S / V, partial);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (grid.y > 1) {
    finish_kernel<Op><<<unsigned(ceil_div(l.C * 32, kThreads)), kThreads, 0, stream>>>(op, l.C, grid.y, partial);
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

// ---------------------------------------------------------------------------------------------
// Per-channel coefficients, computed once per call on the device (no host synchronization):
// rows of a (4, C) tensor in the accumulation type:
//   0 scale = invstd * weight, 1 shift = bias - mean * scale,
//   2 mean_dy = sum_dy / count, 3 xmu_coef = invstd^2 * sum_dy_xmu / count (when sums given).

template <typename acc_t>
__global__ void coefficients_kernel(int64_t C, const acc_t* mean, const acc_t* invstd, const acc_t* weight,
                                    const acc_t* bias, const acc_t* sum_dy, const acc_t* sum_dy_xmu,
                                    double count, acc_t* out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const acc_t scale = weight == nullptr ? invstd[c] : invstd[c] * weight[c];
  acc_t shift = -(mean[c] * scale);
  if (bias != nullptr) shift += bias[c];
  out[c] = scale;
  out[C + c] = shift;
  if (sum_dy != nullptr) {
    const double inv = double(invstd[c]);
    out[2 * C + c] = acc_t(double(sum_dy[c]) / count);
    out[3 * C + c] = acc_t(inv * inv * double(sum_dy_xmu[c]) / count);
  }
}

inline const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// mean and invstd: (C,) in acc; weight, bias, sum_dy, sum_dy_xmu: (C,) in acc or undefined.
template <typename acc_t>
at::Tensor coefficients(const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                        const at::Tensor& bias, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                        int64_t count, cudaStream_t stream) {
  const int64_t C = mean.numel();
  auto out = at::empty({4, C}, mean.options());
  if (C == 0) return out;
  coefficients_kernel<acc_t><<<unsigned(ceil_div(C, kThreads)), kThreads, 0, stream>>>(
      C, mean.const_data_ptr<acc_t>(), invstd.const_data_ptr<acc_t>(),
      static_cast<const acc_t*>(data_or_null(weight)), static_cast<const acc_t*>(data_or_null(bias)),
      static_cast<const acc_t*>(data_or_null(sum_dy)), static_cast<const acc_t*>(data_or_null(sum_dy_xmu)),
      double(std::max<int64_t>(count, 1)), out.data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// What every operation starts from: its input checked, a guard for the input's device, x in
// its layout, dy (when given) laid out as x, and per-channel tensors as contiguous acc tensors.
class Operands {
 public:
  Operands(const char* op, const at::Tensor& input, const at::Tensor* grad_output = nullptr)
      : guard_((check_input(input, op), input.device())) {
    std::tie(x, l) = as_layout(input);
    acc = accumulation_type(x.scalar_type());
    if (grad_output != nullptr) {
      check_same_dtype(*grad_output, input, op);
      dy = like_layout(*grad_output, x, "grad_output");
    }
  }

  at::Tensor channel(const at::Tensor& v, const char* what) const { return per_channel(v, x, l.C, acc, what); }
  // undefined when absent
  at::Tensor channel(const std::optional<at::Tensor>& v, const char* what) const {
    return v.has_value() && v->defined() ? channel(*v, what) : at::Tensor();
  }
  // a residual in x's dtype and layout (undefined when absent)
  at::Tensor like_x(const std::optional<at::Tensor>& v, const char* what) const {
    return v.has_value() && v->defined() ? like_layout(v->to(x.scalar_type()), x, what) : at::Tensor();
  }

 private:
  c10::cuda::CUDAGuard guard_;  // first: every tensor below is made on the input's device

 public:
  at::Tensor x, dy;
  Layout l{};
  at::ScalarType acc{};
};

}  // namespace syncbn::cuda

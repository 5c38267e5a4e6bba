// Host side of the CUDA kernels: argument checks and launch shapes (the layouts are in
// src/layout.h).
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
#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include "layout.h"
#include "operators.h"  // accumulation_type

namespace syncbn::cuda {

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

// Values per 16-byte pack.
template <typename scalar_t>
constexpr int kVec = 16 / int(sizeof(scalar_t));

// Packs of V values may be used when V divides the run along which they are read (S contiguous,
// C channels_last) and every pointer is 16-byte aligned; else every access is scalar.
inline bool can_vectorize(const Layout& l, int V, std::initializer_list<const void*> pointers) {
  if ((l.channels_last ? l.C : l.S) % V != 0) return false;
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Threads per block, one constant per kernel family: each kernel declares it as its
// __launch_bounds__ (so ptxas fits its registers to that block: tools/check_cuda.sh checks
// registers x block <= 65536, no spills, on every architecture built, and 24 resident warps a
// multiprocessor on sm_80 and sm_90) and its launch uses it.
constexpr int kReduceThreads = 256;        // reduce_contiguous_kernel, 1-D
constexpr int kTileThreads = 256;          // reduce_channels_last_kernel, at most TX * TY
constexpr int kFinishThreads = 256;        // finish_kernel, a warp per channel
constexpr int kElementwiseThreads = 256;   // elementwise_kernel, 1-D
constexpr int kCoefficientThreads = 256;   // coefficients_kernel, 1-D
constexpr int kMaxTileChannels = 64;       // packs of channels per channels_last tile (TX)
constexpr int kMergeThreads = 256;         // merge_gathered_kernel, 1-D over channels
// The channels_last reduction's second bound: 3 blocks (24 warps) a multiprocessor, so 80 registers at most.
constexpr int kTileMinBlocks = 3;
static_assert(kReduceThreads % 32 == 0 && kReduceThreads <= 32 * 32, "block_reduce: whole warps, 32 at most");
static_assert(kFinishThreads % 32 == 0, "finish_kernel: whole warps");
static_assert(kMaxTileChannels <= kTileThreads, "a channels_last tile holds at least one row");
constexpr int64_t kMaxItemsPerThread = 64; // packs a thread takes at most in one split
constexpr int64_t kMinItemsPerThread = 4;  // below this, another split costs more than it saves
constexpr int kBlocksPerSM = 4;            // blocks wanted per multiprocessor

constexpr int kMaxDevices = 64;  // devices whose answers are kept (others are asked every time)
using PerDevice = std::array<std::atomic<int>, kMaxDevices>;

// ask(device) for the current device, asked once and kept in `known` (what a device is does
// not change while the process runs): no driver query per launch.
template <typename Ask>
int per_device(PerDevice& known, Ask ask) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) return ask(device);
  int value = known[device].load(std::memory_order_relaxed);
  if (value == 0) {
    value = ask(device);
    known[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int multiprocessors() {
  static PerDevice known{};
  return per_device(known, [](int device) {
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  });
}

// Blocks of `threads` threads of `kernel` resident on one multiprocessor, kept per kernel in `known`.
template <typename Kernel>
int resident_blocks(PerDevice& known, Kernel kernel, int threads) {
  return per_device(known, [&](int) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
    return std::max(blocks, 1);
  });
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

// Blocks along the rows of a channels_last reduction: one wave, the `slots` blocks the device
// holds at once shared by the `tiles` across channels (each thread streams its rows with its
// loads in flight; more blocks only add partials to merge), fewer where a thread would get
// under kMinItemsPerThread rows.
inline int64_t row_splits_for(int64_t rows, int64_t threads, int64_t tiles, int64_t slots) {
  const int64_t wave = ceil_div(slots, tiles);
  const int64_t useful = ceil_div(rows, threads * kMinItemsPerThread);
  return std::clamp<int64_t>(std::min(wave, useful), 1, 65535);
}

}  // namespace syncbn::cuda

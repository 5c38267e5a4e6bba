// Device arithmetic shared by the kernels: 16-byte packs of values, and the fused affine
// transform and activation.
#pragma once

#include "host.cuh"

namespace syncbn::cuda {

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

}  // namespace syncbn::cuda

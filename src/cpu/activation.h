// The fused residual and activation of the elementwise and backward passes, and runtime flags
// turned into template arguments.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace syncbn::cpu {

// The fused residual and activation: pre = x * scale + shift (+ z), y = act(pre) with
// act(p) = p where p > 0, else p * slope (ReLU: slope 0). The forward and the backward's
// recomputation share these, so that both take the same side of p > 0.
template <bool kResidual, typename Vec>
inline Vec pre_activation(const Vec& x, const Vec& z, const Vec& scale, const Vec& shift) {
  const Vec pre = at::vec::fmadd(x, scale, shift);
  if constexpr (kResidual) {
    return pre + z;
  } else {
    return pre;
  }
}

template <bool kActivation, typename Vec>
inline Vec activation(const Vec& pre, const Vec& slope) {
  if constexpr (kActivation) {
    return Vec::blendv(pre * slope, pre, pre > Vec(0));
  } else {
    return pre;
  }
}

// dy through the activation at its input pre.
template <bool kActivation, typename Vec>
inline Vec activation_grad(const Vec& dy, const Vec& pre, const Vec& slope) {
  if constexpr (kActivation) {
    return Vec::blendv(dy * slope, dy, pre > Vec(0));
  } else {
    return dy;
  }
}

// Calls fn(std::bool_constant<a>, std::bool_constant<b>): runtime flags as template arguments.
template <typename Fn>
inline void with_flags(bool a, bool b, const Fn& fn) {
  using T = std::true_type;
  using F = std::false_type;
  if (a) {
    b ? fn(T{}, T{}) : fn(T{}, F{});
  } else {
    b ? fn(F{}, T{}) : fn(F{}, F{});
  }
}

}  // namespace syncbn::cpu

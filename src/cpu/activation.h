// The fused residual and activation of the elementwise and backward passes, and runtime flags
// turned into template arguments.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <string>
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

// The invertible activations of the in-place activated batch norm (abn_*; math: the end of
// syncbn.functions.operators.reference), with `param` leaky_relu's slope below 0 or elu's alpha.
enum class InvertibleActivation { kLeakyRelu, kElu, kIdentity };

inline InvertibleActivation parse_invertible_activation(c10::string_view name, const char* op) {
  if (name == "leaky_relu") return InvertibleActivation::kLeakyRelu;
  if (name == "elu") return InvertibleActivation::kElu;
  if (name == "identity") return InvertibleActivation::kIdentity;
  TORCH_CHECK(false, "syncbn.", op, ": unknown activation '", std::string(name.data(), name.size()),
              "'; expected 'leaky_relu', 'elu' or 'identity'");
}

// Calls fn(std::integral_constant<InvertibleActivation, a>): the activation as a template argument.
template <typename Fn>
inline void with_activation(InvertibleActivation a, const Fn& fn) {
  using Act = InvertibleActivation;
  switch (a) {
    case Act::kLeakyRelu:
      return fn(std::integral_constant<Act, Act::kLeakyRelu>{});
    case Act::kElu:
      return fn(std::integral_constant<Act, Act::kElu>{});
    case Act::kIdentity:
      return fn(std::integral_constant<Act, Act::kIdentity>{});
  }
}

// act(pre): leaky_relu pre > 0 ? pre : pre * slope; elu pre > 0 ? pre : alpha * expm1(pre).
template <InvertibleActivation kAct, typename Vec>
inline Vec invertible_activation(const Vec& pre, const Vec& param) {
  if constexpr (kAct == InvertibleActivation::kLeakyRelu) {
    return Vec::blendv(pre * param, pre, pre > Vec(0));
  } else if constexpr (kAct == InvertibleActivation::kElu) {
    return Vec::blendv(pre.expm1() * param, pre, pre > Vec(0));
  } else {
    return pre;
  }
}

// act'(z) from y = act(z): leaky_relu y > 0 ? 1 : slope; elu y > 0 ? 1 : y + alpha.
template <InvertibleActivation kAct, typename Vec>
inline Vec inverse_activation_grad(const Vec& y, const Vec& param) {
  if constexpr (kAct == InvertibleActivation::kLeakyRelu) {
    return Vec::blendv(param, Vec(1), y > Vec(0));
  } else if constexpr (kAct == InvertibleActivation::kElu) {
    return Vec::blendv(y + param, Vec(1), y > Vec(0));
  } else {
    return Vec(1);
  }
}

// z = act^-1(y): leaky_relu y > 0 ? y : y / slope; elu y > 0 ? y : log1p(y / alpha) (-inf
// where y is -alpha, elu's flat end).
template <InvertibleActivation kAct, typename Vec>
inline Vec inverse_activation(const Vec& y, const Vec& param) {
  if constexpr (kAct == InvertibleActivation::kLeakyRelu) {
    return Vec::blendv(y / param, y, y > Vec(0));
  } else if constexpr (kAct == InvertibleActivation::kElu) {
    return Vec::blendv((y / param).log1p(), y, y > Vec(0));
  } else {
    return y;
  }
}

}  // namespace syncbn::cpu

// The two memory layouts that the CPU and CUDA kernels both walk, and how a tensor is seen as
// one of them (host code, shared by src/cpu and src/cuda).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace syncbn {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// x seen as one of two layouts (both dense in memory):
//  contiguous:    (N, C, S): each (n, c) is a run of S values (NCHW, NCDHW, (N, C, L));
//  channels_last: (M, C):    each row holds one value of every channel (channels_last 2d/3d,
//               (N, C), and anything with S == 1), M = N * S.
struct Layout {
  int64_t N, C, S;
  bool channels_last;
  int64_t rows() const { return N * S; }  // values per channel
  int64_t numel() const { return N * C * S; }
};

// The layout of x, and x made contiguous (once) where its strides are neither layout.
inline std::pair<at::Tensor, Layout> as_layout(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2, "syncbn: expected an input of rank >= 2, got ", x.dim());
  int64_t S = 1;
  for (int64_t d = 2; d < x.dim(); ++d) S *= x.size(d);
  const Layout contiguous{x.size(0), x.size(1), S, false}, channels_last{x.size(0), x.size(1), S, true};
  if (S == 1) return {x.contiguous(), channels_last};
  if (x.is_contiguous()) return {x, contiguous};
  const bool is_channels_last = (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
                                (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d));
  if (is_channels_last) return {x, channels_last};
  return {x.contiguous(), contiguous};
}

// `other` (dy, residual) with exactly x's strides, copied once where it has others.
inline at::Tensor like_layout(const at::Tensor& other, const at::Tensor& x, const char* what) {
  TORCH_CHECK(other.sizes() == x.sizes(), "syncbn: ", what, " has shape ", other.sizes(),
              " but the input has shape ", x.sizes());
  TORCH_CHECK(other.device() == x.device(), "syncbn: ", what, " is on ", other.device(), " but the input is on ",
              x.device());
  if (other.strides() == x.strides()) return other;
  auto out = at::empty_like(x, other.options());
  out.copy_(other);
  return out;
}

// The mask of a padded batch as the masked kernels of every device read it: bool on x's device,
// one value per position of x, (N, *spatial), contiguous.
inline at::Tensor positions_mask(const at::Tensor& mask, const at::Tensor& x, const char* op) {
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.device() == x.device(), "syncbn.", op,
              ": expected a bool mask on ", x.device(), ", got ", mask.scalar_type(), " on ", mask.device());
  auto expected = x.sizes().vec();
  expected.erase(expected.begin() + 1);
  TORCH_CHECK(mask.sizes() == c10::IntArrayRef(expected), "syncbn.", op, ": expected a mask of shape ", expected,
              " (the input's without its channels), got ", mask.sizes());
  return mask.contiguous();
}

}  // namespace syncbn

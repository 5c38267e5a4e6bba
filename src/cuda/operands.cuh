// What every operation starts from: its operands checked and laid out, and its per-channel
// coefficients computed once per call on the device.
#pragma once

#include "host.cuh"

namespace syncbn::cuda {

// Per-channel coefficients, computed once per call on the device (no host synchronization):
// rows of a (4, C) tensor in the accumulation type:
//   0 scale = invstd * weight, 1 shift = bias - mean * scale,
//   2 mean_dy = sum_dy / count, 3 xmu_coef = invstd^2 * sum_dy_xmu / count (when sums given).

template <typename acc_t>
__global__ void __launch_bounds__(kCoefficientThreads)
    coefficients_kernel(int64_t C, const acc_t* mean, const acc_t* invstd, const acc_t* weight, const acc_t* bias,
                        const acc_t* sum_dy, const acc_t* sum_dy_xmu, double count, acc_t* out) {
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
  coefficients_kernel<acc_t><<<unsigned(ceil_div(C, kCoefficientThreads)), kCoefficientThreads, 0, stream>>>(
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

// The positions (N, *spatial) of a padded batch's mask as the packs of the elementwise and
// reduction frameworks meet them (src/cuda/masked.cu, src/cuda/elementwise.cu).
#pragma once

#include <cstdint>

namespace syncbn::cuda {

// a / b for 0 <= a < 2^50 and b > 0, from b's reciprocal and one correction: a multiply, not the
// 64-bit division subroutine, whose registers made the reductions spill
__device__ __forceinline__ int64_t quotient(int64_t a, int64_t b, double inverse) {
  int64_t q = int64_t(double(a) * inverse);
  if (q * b > a) {
    --q;
  } else if ((q + 1) * b <= a) {
    ++q;
  }
  return q;
}

// The mask (N, *spatial) as the packs of either framework meet it: a pack of V values lies in one
// channel's run (contiguous: V consecutive positions) or one row (channels_last: one position).
struct Positions {
  const bool* mask;
  int64_t C, S;
  bool channels_last;
  double inverse_C, inverse_S, inverse_CS;

  Positions(const bool* mask_, int64_t C_, int64_t S_, bool channels_last_)
      : mask(mask_), C(C_), S(S_), channels_last(channels_last_), inverse_C(1.0 / double(C_)),
        inverse_S(1.0 / double(S_)), inverse_CS(1.0 / (double(C_) * double(S_))) {}

  // the position (n * S + s) of the pack's first value, which starts at element i
  __device__ __forceinline__ int64_t first(int64_t i) const {
    if (channels_last) return quotient(i, C, inverse_C);
    const int64_t n = quotient(i, C * S, inverse_CS), in_sample = i - n * C * S;  // c * S + s
    return n * S + in_sample - quotient(in_sample, S, inverse_S) * S;
  }
  __device__ __forceinline__ bool valid(int64_t first, int j) const { return mask[channels_last ? first : first + j]; }
};

}  // namespace syncbn::cuda

// The CUDA kernels of a synchronized batch norm (declared in src/kernels.inc; tested in
// tests/test_cuda.py). Host declarations only: this header is what src/cuda/bindings.cpp
// (compiled by the C++ compiler) sees of the kernels in src/cuda/*.cu.
#pragma once

#include <ATen/ATen.h>

#include "operators.h"

#include <optional>
#include <tuple>

namespace syncbn::cuda {

#include "kernels.inc"

}  // namespace syncbn::cuda

// The CPU kernels of a synchronized batch norm (declared in src/kernels.inc), and the
// instruction set they were built for.
#pragma once

#include <ATen/ATen.h>

#include "operators.h"

#include <optional>
#include <tuple>

namespace syncbn::cpu {

#include "kernels.inc"

// The instruction set the kernels were built for: "AVX512", "AVX2" or "DEFAULT".
const char* capability();

}  // namespace syncbn::cpu

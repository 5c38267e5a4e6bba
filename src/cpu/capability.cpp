#include "batch_norm_cpu.h"

namespace syncbn::cpu {

const char* capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "AVX512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "AVX2";
#else
  return "DEFAULT";
#endif
}

}  // namespace syncbn::cpu

#!/usr/bin/env bash
# Builds the compiled kernels in place (functions/_C_<capability>*.so), against the installed torch.
# Honours CXX (the C++ compiler), MAX_JOBS (parallel compile jobs), TORCH_CUDA_ARCH_LIST
# (CUDA architectures, once CUDA kernels are built) and SYNCBN_CPU_CAPABILITY (see setup.py).
set -euo pipefail
cd "$(dirname "$0")"
python setup.py build_ext --inplace "$@"

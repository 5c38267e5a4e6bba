#!/usr/bin/env bash
# Builds the compiled kernels in place (functions/_C_<capability>*.so, functions/_C_cuda*.so where
# CUDA allows), against the installed torch. Honours PYTHON_CMD (the Python to build with, default
# python), CXX (the C++ compiler), MAX_JOBS (parallel compile jobs), SYNCBN_CPU_CAPABILITY,
# SYNCBN_CUDA (0: skip the CUDA kernels, 1: require them), CUDA_HOME and TORCH_CUDA_ARCH_LIST
# (see setup.py).
set -euo pipefail
cd "$(dirname "$0")"
${PYTHON_CMD:-python} setup.py build_ext --inplace "$@"

#!/usr/bin/env bash
# The checks that need a GPU, as one bounded script for a lent machine (an H100 or H200 with a
# CUDA build of torch): build both extensions in place for the visible GPU, then run the CUDA
# tests through our compiled kernels and through the default route, test.py on CUDA, the CUDA
# benchmark (every case, printed only) and compute-sanitizer over a few kernel tests. Every step has
# its own time limit and writes its log to $OUT (default /tmp/gpu_check), so a slow step costs
# only its own budget; a failed build stops at once. The last file, summary.txt, has one line per
# step with its exit status and seconds.
#
#   OUT=/tmp/gpu_check tools/gpu_check.sh        # about 4 minutes on an H200 with 16 cores
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON_CMD:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME SECONDS LOG COMMAND...: run with a limit, log, and note status and time
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS
    echo "== $name: $*" >> "$OUT/$log"
    timeout --kill-after=5 "$limit" "$@" >> "$OUT/$log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - start))s" | tee -a "$SUMMARY"
    return $rc
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nproc
    $PY -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.backends.cpu.get_cpu_capability())"
    nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1

arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
step build 210 build.log env TORCH_CUDA_ARCH_LIST="$arch" SYNCBN_CUDA=1 MAX_JOBS="$(nproc)" PYTHON_CMD="$PY" ./make_ext.sh || exit 1
step resources 20 build.log $PY -c "from syncbn import backend_info; print(backend_info())"

export SYNCBN_CUDA_KERNELS=compiled
step pytest-compiled 140 pytest_compiled.log $PY -m pytest -q --maxfail 40 --timeout 90 -n 8 -rs \
    tests/test_cuda.py tests/test_cuda_route.py tests/test_kernels.py tests/test_ops.py -k cuda
step testpy-float32 35 testpy.log $PY test.py --device cuda --dtype float32 --steps 3
step testpy-bf16-cl 35 testpy.log $PY test.py --device cuda --dtype bfloat16 --channels-last --steps 3
step bench-cuda 70 bench_cuda.log $PY benchmarks/bench_cuda.py --min-run-time 0.2 --no-write
step memcheck 50 sanitizer.log compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -x tests/test_kernels.py -k "cuda and test_each_op and float32"
unset SYNCBN_CUDA_KERNELS
step pytest-default 45 pytest_default.log $PY -m pytest -q --timeout 40 -n 8 -rs tests/test_cuda.py
exit 0

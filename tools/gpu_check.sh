#!/usr/bin/env bash
# The checks that need a GPU, as one bounded script for a machine with one NVIDIA GPU and a CUDA
# build of torch, most important first, so that a cut-short run still says what matters:
#
#   build      both extensions in place for the visible GPU; skipped where $BUILDS holds a
#              build.tar.gz made from this very src/ and setup.py (its build.hash matches)
#   races      the default CUDA route (what users get): replicas handing results across
#              streams, stock DataParallel's threading on one GPU (a replica failing in forward
#              and in backward), the side-stream and host-sync tests: tests/test_cuda_layers.py
#   graphs     a lone training step captured in a CUDA graph and replayed; a synchronized one refused,
#              its forward and its backward alone
#   ranks      NCCL with one rank (made to sync), Gloo with CUDA tensors in two processes on the
#              GPU, uneven and with an empty rank: tools/gpu_ranks.py
#   sanitize   compute-sanitizer racecheck and synccheck of our CUDA kernels (only ours: torch's
#              own reductions are not ours to judge) over a few tests
#   kernels    our CUDA kernels (pytest --cuda-kernels compiled): the kernel suite and opcheck
#   compile    torch.compile(fullgraph=True) of a lone replica on CUDA, against eager
#   timing     benchmarks/bench_cuda.py, every case timed, its result written to $OUT/cuda.json
#
# Every step has its own time limit (540 s together, under the device tool's 600 s a command)
# and appends its output to $OUT/check.log; $OUT/summary.txt gets one line per step (its exit
# status, limit and seconds). The build is left in $OUT/build.tar.gz: bring it back and pass its
# folder as $BUILDS on a rerun to skip the build. How to run it with the device tool:
# docs/testing.md.
#
# Steps named as arguments run alone (the build always), for a rerun of what failed or changed:
#
#   OUT=/tmp/gpu_check BUILDS=.gpu_build tools/gpu_check.sh
#   OUT=/tmp/gpu_check tools/gpu_check.sh kernels timing
set -uo pipefail
WANTED=" $* "
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
BUILDS=${BUILDS:-.gpu_build}
PY=${PYTHON_CMD:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/check.log"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME SECONDS COMMAND...: run with a limit; note status, limit and time
    local name=$1 limit=$2
    shift 2
    if [ "$name" != build ] && [ "$WANTED" != "  " ] && [[ "$WANTED" != *" $name "* ]]; then
        echo "$name skipped" | tee -a "$SUMMARY"
        return 0
    fi
    local start=$SECONDS
    echo "== $name: $*" >> "$LOG"
    timeout --kill-after=5 "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "$name rc=$rc limit=${limit}s took=$((SECONDS - start))s" | tee -a "$SUMMARY"
    return $rc
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
    command -v nvcc > /dev/null && nvcc --version | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

source_hash=$(cat setup.py tools/cuda_toolkit.py tools/cxx_runtime.py tools/build_failure.py $(find src -type f | sort) | sha256sum | cut -c1-16)
if [ -f "$BUILDS/build.tar.gz" ] && [ "$(tar -xzOf "$BUILDS/build.tar.gz" build.hash 2>/dev/null)" = "$source_hash" ]; then
    tar -xzf "$BUILDS/build.tar.gz" -C functions --exclude build.hash
    echo "build rc=0 limit=0s took=0s (carried, $source_hash)" | tee -a "$SUMMARY"
else
    arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
    step build 135 env TORCH_CUDA_ARCH_LIST="$arch" SYNCBN_CUDA=1 MAX_JOBS="$(nproc)" PYTHON_CMD="$PY" ./make_ext.sh || exit 1
    echo "$source_hash" > functions/build.hash
    (cd functions && tar -czf "$OUT/build.tar.gz" build.hash _C_*.so) && rm functions/build.hash
fi
$PY -c "from syncbn import backend_info; print(backend_info())" | tee -a "$LOG"

PYTEST="$PY -m pytest -q -rs -p no:cacheprovider"
step races 60 $PYTEST --timeout 60 tests/test_cuda_kernels.py tests/test_cuda_layers.py tests/test_cuda_failures.py \
    tests/test_cuda_route.py -k "not abn and not opcheck and not captur"
step graphs 30 $PYTEST --timeout 25 tests/test_cuda_graphs.py -k "captur"
step ranks 55 $PY tools/gpu_ranks.py
OURS="--cuda-kernels compiled"  # our CUDA kernels serve (tests/conftest.py)
step sanitize 30 compute-sanitizer --tool racecheck --kernel-name kns=syncbn --error-exitcode 9 \
    $PY -m pytest -q -x -p no:cacheprovider $OURS tests/test_kernels_ops.py -k "cuda and test_each_op and float32 and not 0"
step synccheck 15 compute-sanitizer --tool synccheck --kernel-name kns=syncbn --error-exitcode 9 \
    $PY -m pytest -q -x -p no:cacheprovider $OURS tests/test_kernels_ops.py -k "cuda and test_each_op and float32 and not 0"
step kernels 110 $PYTEST $OURS --timeout 60 -x tests/test_kernels_*.py tests/test_ops.py tests/test_cuda_kernels.py \
    tests/test_cuda_layers.py tests/test_cuda_graphs.py tests/test_cuda_failures.py -k cuda
step compile 35 $PY - <<'EOF'
import copy, torch
from torch import nn
from syncbn import nn as NN
torch.manual_seed(0)
ours = NN.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8, momentum=None))).cuda()
eager = copy.deepcopy(ours)
compiled = torch.compile(ours, fullgraph=True)
for step in range(3):
    x = torch.randn(4, 3, 9, 9, device="cuda")
    torch.testing.assert_close(compiled(x), eager(x), atol=1e-5, rtol=1e-5)
for (name, a), b in zip(ours.named_buffers(), eager.buffers()):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
print("torch.compile(fullgraph=True), lone replica on CUDA: ok")
EOF
step timing 70 $PY benchmarks/bench_cuda.py --min-run-time 0.05 --results-dir "$OUT"
exit 0

#!/usr/bin/env bash
# Nsight Compute's reading of our CUDA kernels in one forward + backward of batch norm (the
# sequence benchmarks/bench_cuda.py times as `ours`) on (64, 256, 56, 56), NCHW and channels_last,
# float32 and bfloat16: per kernel launch its time, DRAM throughput (% of the peak), achieved
# occupancy (% of the resident-warp limit), registers, block and grid, and the long-scoreboard
# stalls per issued instruction (warps waiting on memory). Needs ncu on PATH, one NVIDIA GPU and
# the CUDA extension built (tools/gpu_check.sh builds it). Writes $OUT/ncu.csv and $OUT/ncu.log;
# stops after $LIMIT seconds (default 60).
#
#   OUT=/tmp/gpu_profile tools/gpu_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_profile}
PY=${PYTHON_CMD:-python3}
mkdir -p "$OUT"
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
METRICS+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
METRICS+=,launch__block_size,launch__grid_size
METRICS+=,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
# --profile-from-start off: only the launches between torch.cuda.profiler.start() and stop()
timeout --kill-after=5 "${LIMIT:-60}" ncu --clock-control none --profile-from-start off \
    --kernel-name-base demangled -k regex:syncbn::cuda --metrics "$METRICS" --csv --page raw \
    "$PY" - > "$OUT/ncu.csv" 2> "$OUT/ncu.log" <<'EOF'
import os, sys
import torch
sys.path.insert(0, "benchmarks")
from bench_cuda import Rotating, cases, step_functions
from syncbn.functions.operators import backend

backend.use_kernels(cuda="compiled")
for case in cases(quick=True):
    ours = step_functions(case, Rotating(case))["ours"]
    ours()  # warm up outside the profiled range
    torch.cuda.synchronize()
    print(case.fields()["case"], file=sys.stderr, flush=True)
    torch.cuda.profiler.start()
    ours()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
EOF
rc=$?
echo "gpu_profile rc=$rc ($(grep -c "_kernel" "$OUT/ncu.csv") kernel launches read)"
exit $rc

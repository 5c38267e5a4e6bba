#!/usr/bin/env bash
# CI check of the build's promises, after the kernels were built in place (pip install -e . or
# ./make_ext.sh):
#  1. A CUDA build that fails (a CUDA build of torch, as far as setup.py can tell, and a toolkit
#     whose nvcc fails to compile) leaves the CPU kernels built, copied in place and loading,
#     prints one paragraph with the first error, and the import repeats it in backend_info().
#     torch.version.cuda is set to "13.0" in the build process, the toolkit is a fake one: this
#     machine has a CPU build of torch, which cannot link CUDA kernels.
#  2. The kernels built in place use torch's shared C++ runtime, with no copy of their own
#     (tools/cxx_runtime.py).
#  3. The installed package, syncbn, imports from outside the repository, with the compiled
#     kernels, and from a directory that holds a user's own modules/ and functions.py.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON_CMD:-python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK" "$REPO/functions/_C_cuda.build-failure.txt"' EXIT

mkdir -p "$WORK/cuda/bin" "$WORK/cuda/lib64"
cat > "$WORK/cuda/bin/nvcc" <<'NVCC'
#!/bin/sh
case "$*" in
  *--version*) echo "Cuda compilation tools, release 13.0, V13.0.48" ;;
  *--list-gpu-arch*) printf 'compute_75\ncompute_80\ncompute_90\n' ;;
  *) echo "nvcc fatal   : simulated compiler failure (tools/check_build.sh)" >&2; exit 1 ;;
esac
NVCC
chmod +x "$WORK/cuda/bin/nvcc"
touch "$WORK/cuda/lib64/libcudart.so"

rm -f functions/_C_*.so                                # the copy in place must come back
CUDA_HOME="$WORK/cuda" TORCH_CUDA_ARCH_LIST=7.5 MAX_JOBS=1 "$PYTHON" - build_ext --inplace > "$WORK/build.log" 2>&1 <<'PY' || { cat "$WORK/build.log"; exit 1; }
import runpy, sys
import torch
torch.version.cuda = "13.0"   # as a CUDA wheel of torch would say
sys.argv = ["setup.py", *sys.argv[1:]]
runpy.run_path("setup.py", run_name="__main__")
PY
grep -q "syncbn: building the CUDA kernels with the CUDA toolkit $WORK/cuda" "$WORK/build.log" \
  || { cat "$WORK/build.log"; echo "check_build: FAILED: the CUDA build was not attempted" >&2; exit 1; }
paragraph=$(grep "failed to build; the CPU kernels are built" "$WORK/build.log") \
  || { cat "$WORK/build.log"; echo "check_build: FAILED: no failure paragraph" >&2; exit 1; }
echo "$paragraph" | grep -q "First error: nvcc fatal   : simulated compiler failure" \
  || { echo "$paragraph"; echo "check_build: FAILED: the paragraph lacks the first error" >&2; exit 1; }
ls functions/_C_*.so > /dev/null || { echo "check_build: FAILED: no CPU kernels in place" >&2; exit 1; }
"$PYTHON" tools/cxx_runtime.py functions/_C_*.so
"$PYTHON" - <<'PY'
import syncbn
info = syncbn.backend_info()
assert info["cpu"].startswith("compiled-cpu"), info
assert "failed to build" in info.get("cuda_reason", ""), info
print("check_build: ok     a failed CUDA build keeps the CPU kernels:", info["cpu"])
PY

cd "$WORK"                                             # outside the repository
mkdir -p modules && touch modules/__init__.py          # a user's own packages of our old names
echo "VALUE = 1" > functions.py
"$PYTHON" - <<'PY'
import os, syncbn
from syncbn import nn as NN
import modules, functions, torch
assert modules.__file__.startswith(os.getcwd()) and functions.VALUE == 1, (modules.__file__, functions.__file__)
assert syncbn.backend_info()["cpu"].startswith("compiled-cpu"), syncbn.backend_info()
y = NN.BatchNorm2d(3)(torch.randn(4, 3, 2, 2))
print("check_build: ok     imported from", os.getcwd(), "->", os.path.dirname(syncbn.nn.__file__), syncbn.backend_info()["cpu"])
PY

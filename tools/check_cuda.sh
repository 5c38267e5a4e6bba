#!/usr/bin/env bash
# CI compile check of the CUDA kernels, without a GPU: compiles every .cu file under src/ with
# this machine's nvcc for sm_75, sm_80, sm_87 and sm_90 (setup.py's default architectures; compile
# only, one nvcc call per file with four -gencode, the files in parallel), with torch's include
# dirs and the flags torch's cpp_extension passes to nvcc for an extension (COMMON_NVCC_FLAGS,
# -std=c++20, the C++ ABI of torch, -DTORCH_EXTENSION_NAME, -DTORCH_API_INCLUDE_EXTENSION_H,
# -fPIC, -O3 as setup.py). Then every kernel's resources on every architecture (ptxas -v, and the
# block size its kept PTX declares) go through tools/cuda_resources.py, which prints them with
# the resident warps per SM and fails where a kernel declares no block size (__launch_bounds__),
# its registers x block exceed 65,536, its static shared memory 48 KiB, it spills, or it keeps
# fewer than 24 resident warps per SM on sm_80 or sm_90. Last, the CUDA extension's C++ binding
# file (src/cuda/bindings.cpp) gets `g++ -fsyntax-only` against torch's and the toolkit's headers.
# Fails on any error, and when nvcc is missing.
#
#   tools/check_cuda.sh            # NVCC (default: nvcc on PATH) and CXX (default: g++) honoured
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
CXX=${CXX:-g++}
command -v "$NVCC" > /dev/null || { echo "check_cuda: $NVCC not found (the CUDA toolkit is required for this check)" >&2; exit 1; }

# torch's include dirs and C++ ABI (for nvcc and g++), and the nvcc flags of its cpp_extension
mapfile -t INCLUDES < <(python -c '
import sysconfig, torch
from torch.utils import cpp_extension as ce
for path in [*ce.include_paths(), sysconfig.get_paths()["include"]]:
    print(f"-I{path}")
print(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
')
mapfile -t NVCC_FLAGS < <(python -c 'from torch.utils import cpp_extension as ce; print("\n".join(ce.COMMON_NVCC_FLAGS))')
CUDA_INCLUDE=$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include
[ -f "$CUDA_INCLUDE/cuda_runtime_api.h" ] || CUDA_INCLUDE=/usr/local/cuda/include
# A CPU build of torch ships c10/cuda's headers but not the one CMake generates for a CUDA build
# (c10/cuda/impl/cuda_cmake_macros.h, which only matters on Windows): skip it where it is absent.
T_INC=${INCLUDES[0]#-I}
[ -f "$T_INC/c10/cuda/impl/cuda_cmake_macros.h" ] || INCLUDES+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)
DEFINES=(-DTORCH_EXTENSION_NAME=_C_cuda -DTORCH_API_INCLUDE_EXTENSION_H -std=c++20)
ARCH_NAMES="sm_75, sm_80, sm_87, sm_90"
ARCHS=(-gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=sm_80
       -gencode arch=compute_87,code=sm_87 -gencode arch=compute_90,code=sm_90)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

mapfile -t FILES < <(find src -name '*.cu' | sort)
[ "${#FILES[@]}" -gt 0 ] || { echo "check_cuda: no .cu files under src/" >&2; exit 1; }
start=$(date +%s)
pids=()
dirs=()
for f in "${FILES[@]}"; do
  dir="$OUT/kernels/$f"  # its ptxas.log (resources) and kept PTX (.maxntid)
  mkdir -p "$dir"
  log="$dir/ptxas.log"
  ( "$NVCC" -c "$f" -o "$dir/$(basename "$f").o" -Isrc "${INCLUDES[@]}" "${NVCC_FLAGS[@]}" "${DEFINES[@]}" \
      --compiler-options -fPIC -O3 "${ARCHS[@]}" -Xptxas -v --keep --keep-dir "$dir" > "$log" 2>&1 ) &
  pids+=("$!:$f:$log")
  dirs+=("$dir")
done
status=0
for entry in "${pids[@]}"; do
  IFS=: read -r pid f log <<< "$entry"
  if wait "$pid"; then
    echo "check_cuda: ok     $f ($ARCH_NAMES)"
  else
    echo "check_cuda: FAILED $f" >&2
    cat "$log" >&2
    status=1
  fi
done
# registers, block sizes, shared memory, spills and occupancy of every kernel on every architecture
if [ "$status" -eq 0 ]; then
  if python tools/cuda_resources.py "${dirs[@]}"; then
    echo "check_cuda: ok     kernel resources ($ARCH_NAMES)"
  else
    echo "check_cuda: FAILED kernel resources (see above)" >&2
    status=1
  fi
fi
# the binding file of functions._C_cuda, with the C++ compiler (no device code in it); the build
# identity that setup.py writes for it, as setup.py writes it
python -c 'import setup; setup.write_build_identity()'
if ! "$CXX" -fsyntax-only -x c++ src/cuda/bindings.cpp -Isrc -Ibuild/generated -I"$CUDA_INCLUDE" \
    "${INCLUDES[@]}" "${DEFINES[@]}" -fPIC 2> "$OUT/bindings.log"; then
  echo "check_cuda: FAILED src/cuda/bindings.cpp" >&2
  cat "$OUT/bindings.log" >&2
  status=1
else
  echo "check_cuda: ok     src/cuda/bindings.cpp (g++ -fsyntax-only)"
fi
echo "check_cuda: ${#FILES[@]} .cu files and the bindings in $(( $(date +%s) - start )) s"
exit $status

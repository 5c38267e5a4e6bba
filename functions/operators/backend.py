"""Which kernels serve the ``torch.ops.syncbn`` operators (:mod:`syncbn.functions.operators.ops`) on each device.

The dispatcher picks the kernel by the tensors' device; this module decides what is registered
(:func:`use_kernels`; :func:`backend_info` says what serves):

- CPU: the compiled kernels (``src/cpu``, built into ``functions/_C_<capability>`` by
  ``setup.py``), the best build for an instruction set that this CPU has. Where none is built,
  the pure-PyTorch reference serves (with one warning).
- CUDA: by default torch's own SyncBN CUDA ops serve the statistics, elementwise and backward
  operators, and ATen the rest (the fused residual and activation forms, the merges, the rows,
  the running-statistics update): C++ kernels built into the CPU extension
  (``src/torch_cuda_ops.cpp``; each one pass over memory where torch has an op, no host
  synchronization, no GIL); without the CPU extension the reference serves CUDA too. Our CUDA
  kernels (``src/cuda``, built into ``functions/_C_cuda`` where torch is a CUDA build and a
  toolkit is found) serve instead after ``use_kernels(cuda="compiled")`` (opt-in until they
  beat torch's ops in every layout).
- ``use_kernels(cpu="reference", cuda="reference")`` unregisters every compiled kernel: the
  reference serves every device (to debug, or to test it); the compiled module still serves the
  replicas' native meeting.
"""
from __future__ import annotations

import glob
import importlib
import importlib.machinery
import os
import warnings
from types import ModuleType

import torch

from .. import torch_internals
from . import ops  # noqa: F401  (the operators' schemas, before any kernel is registered for them)

EXTENSIONS_PACKAGE = __package__.rpartition(".")[0]
"""Where setup.py builds the extensions: ``syncbn.functions._C_*``."""
EXTENSIONS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Instruction sets the CPU kernels may be built for, weakest first (see setup.py).
CPU_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
BUILD_HINT = "build them with `pip install --no-build-isolation -e .` (or `./make_ext.sh`) in the project's folder"
CUDA_BUILD_HINT = (
    "build them where torch is a CUDA build and the CUDA toolkit (nvcc, CUDA_HOME) is installed, "
    "with `./make_ext.sh` or `pip install --no-build-isolation -e .`"
)


def usable_cpu_capabilities() -> list[str]:
    """The instruction sets this CPU runs (as torch sees it), best first."""
    runtime = torch.backends.cpu.get_cpu_capability().upper()
    known = CPU_CAPABILITIES.index(runtime) if runtime in CPU_CAPABILITIES else 0
    return list(reversed(CPU_CAPABILITIES[: known + 1]))


LOAD_PROBLEMS: dict[str, str] = {}
"""Why a device type's compiled kernels are not in use although some were looked for, by device type."""


def extension_files(name: str) -> list[str]:
    """The built files of the extension module ``functions.<name>``, if any."""
    here = EXTENSIONS_DIR
    return [path for suffix in importlib.machinery.EXTENSION_SUFFIXES for path in glob.glob(os.path.join(here, name + suffix))]


def import_extension(name: str) -> tuple[ModuleType | None, str]:
    """``functions.<name>``, or None and why: not built, or built but failing to load (an ABI
    mismatch after a torch upgrade, a missing instruction set or library). One that loads but
    was built against another torch is refused (:func:`check_built_with_this_torch`)."""
    files = extension_files(name)
    try:
        module = importlib.import_module(f"{EXTENSIONS_PACKAGE}.{name}")
    except ImportError as error:
        if not files:
            return None, f"{name} is not built"
        return None, f"{files[0]} failed to load: {error}"
    check_built_with_this_torch(module)
    return module, ""


def check_built_with_this_torch(module: ModuleType) -> None:
    """Raise where ``module`` was built against another torch than the running one: its kernels
    and its readings of torch's private state hold for the torch they were compiled with."""
    built = getattr(module, "built_with_torch", None)
    running = torch_internals.torch_build_identity()
    if built != running:
        raise ImportError(
            f"syncbn: the compiled extension {module.__name__} was built against torch {built or 'of an unknown version'}, "
            f"but this is torch {running}: rebuild it against this torch: {BUILD_HINT}"
        )


def load_extension() -> ModuleType | None:
    """The compiled extension built for the best instruction set this CPU has, or None with one
    warning that says why (not built, or built but failing to load) and how to (re)build it."""
    tried = []
    for capability in usable_cpu_capabilities():
        module, problem = import_extension(f"_C_{capability.lower()}")
        if module is not None:
            return module
        tried.append(problem)
    failed = [problem for problem in tried if "failed to load" in problem]
    LOAD_PROBLEMS["cpu"] = "; ".join(failed or tried)
    what = "compiled CPU kernels exist but failed to load" if failed else "no compiled kernels for this CPU"
    how = f"rebuild them against this torch: {BUILD_HINT}" if failed else BUILD_HINT
    warnings.warn(
        f"syncbn: {what} ({LOAD_PROBLEMS['cpu']}); the pure-PyTorch reference kernels serve every device, "
        f"which is slower, and replicas in one process cannot synchronize: {how}",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def cuda_build_failure() -> str | None:
    """The paragraph setup.py left when the CUDA kernels failed to build here, if it did."""
    path = os.path.join(EXTENSIONS_DIR, "_C_cuda.build-failure.txt")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def note_cuda_build_failure() -> None:
    """Repeat a failed CUDA build's paragraph (pip hides build output): in backend_info(), and
    as a warning where a GPU is visible (asking for our CUDA kernels raises it as an error)."""
    failure = cuda_build_failure()
    if failure is None:
        return
    LOAD_PROBLEMS["cuda"] = failure
    if torch.cuda.is_available():
        warnings.warn(failure, RuntimeWarning, stacklevel=3)


EXTENSION = load_extension()
"""The compiled module (src/bindings.cpp), or None where it is not built: the CPU kernels, the
default CUDA kernels (src/torch_cuda_ops.cpp), and the native synchronized call whose
``ReplicaRound`` and ``sync_batch_norm`` (src/sync_batch_norm.cpp) serve every synchronized call
in one native call per replica and direction, whichever kernels serve (under the reference it
calls the reference through the dispatcher). Without it, a layer synchronizes across ranks
through the autograd Function, and refuses replicas in one process."""
NATIVE_ROUNDS: ModuleType | None = EXTENSION
if NATIVE_ROUNDS is not None:
    torch_internals.check_graph_task_reading(NATIVE_ROUNDS)

SERVING = {"cpu": "reference", "cuda": "reference"}
"""What serves the operators now, per device type (set by :func:`use_kernels`)."""
CPU_KERNELS = ("compiled", "reference")
CUDA_KERNELS = ("torch", "compiled", "reference")
_compiled_cuda: ModuleType | None = None


def use_kernels(*, cpu: str | None = None, cuda: str | None = None) -> None:
    """Choose which kernels serve the ``torch.ops.syncbn`` operators from now on, process-wide.

    ``cpu``: ``'compiled'`` (our CPU kernels, the default where they are built) or
    ``'reference'`` (the pure-PyTorch reference). ``cuda``: ``'torch'`` (torch's SyncBN CUDA ops
    and ATen, the default where the compiled module is built), ``'compiled'`` (our CUDA kernels,
    ``src/cuda``, opt-in) or ``'reference'``. None leaves a device type as it is. Asking for
    kernels that are not built raises an error that says how to build them. Call it before
    tracing or compiling a model: a compiled graph keeps the kernels it was compiled with.
    """
    if cpu is not None:
        _check_choice("cpu", cpu, CPU_KERNELS)
        if cpu == "compiled":
            _require(EXTENSION, "the compiled CPU kernels", LOAD_PROBLEMS.get("cpu", "not built"), BUILD_HINT)
        if EXTENSION is not None:
            EXTENSION.set_cpu_kernels(cpu == "compiled")
        SERVING["cpu"] = cpu
    if cuda is not None:
        _check_choice("cuda", cuda, CUDA_KERNELS)
        if cuda == "torch":
            _require(EXTENSION, "torch's CUDA ops (in the compiled module)", LOAD_PROBLEMS.get("cpu", "not built"), BUILD_HINT)
        ours = _load_compiled_cuda() if cuda == "compiled" else _compiled_cuda
        # one kernel per dispatch key: the one that leaves goes before the one that comes
        if EXTENSION is not None and cuda != "torch":
            EXTENSION.set_torch_cuda_ops(False)
        if ours is not None and cuda != "compiled":
            ours.set_kernels(False)
        if cuda == "torch":
            EXTENSION.set_torch_cuda_ops(True)
        elif cuda == "compiled":
            ours.set_kernels(True)
        SERVING["cuda"] = cuda


def _check_choice(device_type: str, choice: str, choices: tuple[str, ...]) -> None:
    if choice not in choices:
        raise ValueError(f"use_kernels: {device_type} must be one of {choices}, got {choice!r}")


def _require(module: ModuleType | None, what: str, problem: str, hint: str) -> None:
    if module is None:
        raise RuntimeError(f"syncbn: {what} are not usable ({problem}): {hint}")


def _load_compiled_cuda() -> ModuleType:
    """The compiled CUDA extension ``functions._C_cuda``, imported once, or an error that says
    why it is not usable and how to build it."""
    global _compiled_cuda
    if _compiled_cuda is None:
        module, problem = import_extension("_C_cuda")
        _require(module, "our compiled CUDA kernels", cuda_build_failure() or problem, CUDA_BUILD_HINT)
        _compiled_cuda = module
    return _compiled_cuda


note_cuda_build_failure()
if EXTENSION is not None:
    use_kernels(cpu="compiled", cuda="torch")


def set_thread_intra_op_threads(threads: int) -> bool:
    """Give this thread ``threads`` intra-op threads: the OpenMP team of the parallel regions that
    torch's CPU kernels start from it (a per-thread setting in OpenMP), leaving
    ``torch.set_num_threads``' process-wide value, and so every other thread, alone. Returns
    whether this thread now has them: False without the compiled module (reference kernels) or
    where torch does not run on OpenMP (then nothing changed)."""
    if EXTENSION is None:
        return False
    return EXTENSION.set_thread_intra_op_threads(threads) == threads


def backend_name(device: torch.device) -> str:
    """Which kernels serve the operators on ``device``: ``compiled-cpu-<isa>``, ``compiled-cuda``,
    ``torch-cuda-ops`` or ``reference``."""
    serving = SERVING.get(device.type, "reference")
    if serving == "compiled":
        return f"compiled-cpu-{EXTENSION.capability.lower()}" if device.type == "cpu" else "compiled-cuda"
    return "torch-cuda-ops" if serving == "torch" else "reference"


def serves_single_device(device: torch.device) -> bool:
    """Whether our kernels may serve a lone replica on ``device`` at all: only the compiled CPU
    kernels do (cuDNN serves a lone CUDA replica). Which inputs they serve there:
    :mod:`syncbn.functions.operators.lone_replica`."""
    return backend_name(device).startswith("compiled-cpu")


def backend_info() -> dict[str, str]:
    """Which backend serves which device type, e.g. ``{'cpu': 'compiled-cpu-avx2', 'cuda':
    'torch-cuda-ops'}`` (CUDA is listed whether or not a GPU is visible); where compiled kernels
    were looked for but are not in use, ``'<device>_reason'`` next to it says why (``{'cpu':
    'reference', 'cpu_reason': '.../_C_avx2...so failed to load: undefined symbol ...'}``)."""
    info = {t: backend_name(torch.device(t)) for t in ("cpu", "cuda")}
    for device_type, problem in LOAD_PROBLEMS.items():
        info[f"{device_type}_reason"] = problem
    return info

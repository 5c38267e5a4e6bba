"""Which kernels serve: the compiled CPU kernels unless the reference is forced, ``use_kernels``
registering and unregistering them, and a missing extension falling back with one warning."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from syncbn.functions.operators import backend
from testkit.kernel_cases import COMPILED, OPS, needs_compiled


def test_cpu_backend_is_compiled_unless_the_reference_is_forced() -> None:
    if backend.SERVING["cpu"] == "reference":
        assert backend.backend_info()["cpu"] == "reference"
        assert not backend.serves_single_device(torch.device("cpu"))
        return
    assert COMPILED is not None, f"the compiled CPU kernels are not built: {backend.BUILD_HINT}"
    assert COMPILED.capability in backend.usable_cpu_capabilities()
    assert backend.backend_info()["cpu"] == f"compiled-cpu-{COMPILED.capability.lower()}"


@needs_compiled
def test_use_kernels_registers_and_unregisters_the_compiled_kernels() -> None:
    has_cpu_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("syncbn::local_stats", "CPU")  # noqa: E731
    has_cuda_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("syncbn::local_stats", "CUDA")  # noqa: E731
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    compiled = OPS.local_stats(x)
    assert has_cpu_kernel() and has_cuda_kernel()
    try:
        backend.use_kernels(cpu="reference", cuda="reference")
        assert not has_cpu_kernel() and not has_cuda_kernel()
        assert backend.backend_info()["cpu"] == backend.backend_info()["cuda"] == "reference"
        assert not backend.serves_single_device(torch.device("cpu"))
        for got, want in zip(OPS.local_stats(x), compiled):  # the reference serves: the same statistics
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="cpu must be one of"):
            backend.use_kernels(cpu="fastest")
    finally:
        backend.use_kernels(cpu="compiled", cuda="torch")
    assert has_cpu_kernel() and has_cuda_kernel()
    assert backend.backend_info()["cuda"] == "torch-cuda-ops"
    if backend.cuda_build_failure() is not None or not backend.extension_files("_C_cuda"):
        with pytest.raises(RuntimeError, match="compiled CUDA kernels are not usable"):
            backend.use_kernels(cuda="compiled")
        assert backend.backend_info()["cuda"] == "torch-cuda-ops" and has_cuda_kernel()


def test_missing_extension_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_extension(name: str, package: str | None = None):
        if name.rpartition(".")[2].startswith("_C_"):
            raise ImportError(f"no module named {name}")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", no_extension)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backend.load_extension() is None
    assert len(caught) == 1 and "make_ext.sh" in str(caught[0].message)
    assert "replicas in one process cannot synchronize" in str(caught[0].message)

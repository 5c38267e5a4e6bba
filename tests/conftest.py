"""The suite tests our kernels: a lone replica takes them (``lone_replica.forced("ours")``)
wherever they are compiled, whatever the rule of ``functions/operators/lone_replica.py`` would pick, so that
every layer test exercises them; ``tests/test_lone_replica.py`` tests the rule itself (and
torch's route).

``--exhaustive`` adds the tests marked ``exhaustive``: slow cases whose behaviour quicker ones
cover too (the other half of opcheck's dtypes, compiled draws across ranks, a process exit under
Gloo); CI runs them, ``python -m pytest -q`` leaves them out to stay within a few minutes.

``--kernels reference`` runs the suite through the pure-PyTorch reference on every device;
``--cuda-kernels compiled`` through our CUDA kernels (``syncbn.functions.use_kernels``)."""
import pytest

from syncbn.functions.operators import backend, lone_replica


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kernels", choices=("compiled", "reference"), default="compiled",
                     help="which kernels serve the operators on every device (default: compiled)")
    parser.addoption("--cuda-kernels", choices=backend.CUDA_KERNELS, default=None,
                     help="which kernels serve CUDA tensors (default: torch's CUDA ops; 'compiled': ours)")
    parser.addoption("--exhaustive", action="store_true",
                     help="also the slow tests marked exhaustive (CI runs them)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive: a slow case that quicker ones cover too; runs with --exhaustive")
    if config.getoption("--kernels") == "reference":
        backend.use_kernels(cpu="reference", cuda="reference")
    if config.getoption("--cuda-kernels"):
        backend.use_kernels(cuda=config.getoption("--cuda-kernels"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--exhaustive"):
        return
    left_out = [item for item in items if item.get_closest_marker("exhaustive")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]


@pytest.fixture(autouse=True)
def lone_replica_takes_our_kernels():
    with lone_replica.forced("ours"):
        yield

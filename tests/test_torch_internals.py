"""The private parts of torch that the library touches (functions/torch_internals.py and
src/graph_task.h): each still means, on the installed torch, what the library reads it as. A new
torch minor version fails the first test until these have been read against it. Those that find a
checkpoint's regions and recomputations: tests/test_torch_internals_checkpoint.py."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.nn.parallel.replicate import replicate

from helpers import stock_replicas
from syncbn.functions import torch_internals
from syncbn.functions.operators import backend


def test_an_unchecked_torch_gets_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_internals.warn_if_unchecked_torch()  # the installed torch is checked: silent
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    with pytest.warns(RuntimeWarning, match=r"torch 2\.99\.0\+cpu is not among .* unverified"):
        torch_internals.warn_if_unchecked_torch()


def test_the_installed_torch_is_one_the_internals_were_checked_against() -> None:
    version = torch_internals.torch_minor_version()
    assert version in torch_internals.CHECKED_TORCH_VERSIONS, (
        f"torch {version}: read functions/torch_internals.py and src/graph_task.h against it, then add it"
    )


def test_replicate_still_has_the_locals_that_round_detection_reads() -> None:
    # replicate()'s `j` (the replica index of its loop over devices) and `module_copies` (each
    # replica's modules, the root's first): a torch that renamed `j` would make every round start
    # by membership alone, one that renamed `module_copies` would leave a failed replica's mates
    # waiting for their timeout
    assert {"j", "module_copies"} <= {*replicate.__code__.co_varnames, *replicate.__code__.co_cellvars}
    calls: list = []

    class Probe(nn.Module):
        def _replicate_for_data_parallel(self):
            calls.append(torch_internals.torch_replicate_call())
            return super()._replicate_for_data_parallel()

    root = nn.Sequential(Probe(), nn.Linear(2, 2))
    replicas = stock_replicas(root, 3)
    assert [j for j, _ in calls] == [0, 1, 2]
    assert all(found is replica for (_, found), replica in zip(calls, replicas))
    calls.clear()
    stock_replicas(Probe(), 2)  # the root itself: no replica of it made before
    assert calls == [(0, None), (1, None)]
    assert torch_internals.torch_replicate_call() == (None, None)  # not called from replicate()


def test_a_replica_gets_forward_hooks_of_its_own() -> None:
    # a replica shares its original's hook dicts (a shallow copy of __dict__) until it owns them
    root = nn.Linear(2, 2)
    replica = root._replicate_for_data_parallel()
    assert replica._forward_hooks is root._forward_hooks
    torch_internals.own_forward_hooks(replica)
    replica.register_forward_hook(lambda *args: None, always_call=True)
    assert len(replica._forward_hooks) == 1 and not root._forward_hooks and not root._forward_hooks_always_called


@pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel has devices where CUDA is visible")
def test_a_device_less_data_parallel_is_found_among_the_callers() -> None:
    seen: list = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch_internals.device_less_data_parallel_call())
            return x

    nn.DataParallel(nn.Sequential(Probe()))(torch.ones(2))
    Probe()(torch.ones(2))
    assert seen == [True, False]


def test_forward_hooks_are_found() -> None:
    def hook(module, args, result):
        return None

    layer = nn.Linear(2, 2)
    assert not torch_internals.has_forward_hook(layer, hook)
    layer.register_forward_hook(hook, always_call=True)
    assert torch_internals.has_forward_hook(layer, hook)


def test_graph_task_ids_and_the_callback_at_backward_end() -> None:
    seen: list = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            task = torch_internals.current_graph_task_id()
            seen.append(task)
            torch_internals.at_backward_end(lambda: seen.append(("end", task)))
            return grad

    assert torch_internals.current_graph_task_id() == -1
    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    Probe.apply(x).sum().backward()
    first, second = seen[0], seen[2]
    assert first != -1 and second != -1 and first != second
    assert seen == [first, ("end", first), second, ("end", second)]


def test_functorch_transforms_are_seen() -> None:
    seen: list = []

    def f(x):
        seen.append(torch_internals.functorch_transforms_active())
        return x.sum()

    f(torch.ones(2))
    torch.func.vmap(f)(torch.ones(3, 2))
    torch.func.grad(f)(torch.ones(2))
    assert seen == [False, True, True]


def test_functorch_wrapped_tensors_are_seen() -> None:
    # a transform's wrapper reaches other threads as a tensor, where no transform is active
    seen: list = []

    def f(x):
        seen.append(torch_internals.is_functorch_wrapped(x))
        return x.sum()

    f(torch.ones(2))
    torch.func.vmap(f)(torch.ones(3, 2))
    torch.func.grad(f)(torch.ones(2))
    assert seen == [False, True, True]


def test_apply_without_binding_gives_what_apply_gives() -> None:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(x, factor):
            return x * factor

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.factor = inputs[1]

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.factor, None

    x = torch.randn(3, requires_grad=True)
    y = torch_internals.apply_without_binding(Scale, x, 3.0)
    torch.testing.assert_close(y, Scale.apply(x, 3.0))
    assert type(y.grad_fn).__name__ == "ScaleBackward"
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.full((3,), 3.0))
    # the signature that torch >= 2.15's C apply binds with: every argument given is taken as it
    # is, anything else bound as inspect binds it (defaults applied, errors raised)
    signature = inspect.signature(Scale.forward)
    bound = signature.bind(x, 3.0)
    bound.apply_defaults()
    assert bound.args == (x, 3.0) and bound.kwargs == {}
    assert signature.bind(x, factor=2.0).arguments == {"x": x, "factor": 2.0}
    with pytest.raises(TypeError):
        signature.bind(x)


def test_the_lazy_dynamo_disable_imports_the_compiler_only_when_called() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from syncbn.functions import torch_internals\n"
        "f = torch_internals.lazy_dynamo_disable(lambda x: x + 1)\n"
        "print('torch._dynamo' in sys.modules, f(torch.ones(1)).item(), 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "2.0", "True"], done.stderr


def test_functional_collectives_have_what_the_traced_path_calls() -> None:
    funcol = torch_internals.functional_collectives()
    assert callable(funcol.all_gather_tensor) and callable(funcol.all_reduce)


@pytest.mark.skipif(backend.NATIVE_ROUNDS is None, reason="the native meetings are not loaded")
@pytest.mark.parametrize("retain_graph", [False, True])
def test_the_native_meetings_find_the_backward_pass_they_wait_in(retain_graph: bool) -> None:
    # a backward waiter asks whether its graph task failed on another device's thread
    # (src/graph_task.h finds the task from one exported accessor of its members): what it reads
    # there agrees with what torch says of the same task, and outside a backward there is none
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen.append(backend.NATIVE_ROUNDS.current_backward_pass())
            return grad

    assert backend.NATIVE_ROUNDS.current_backward_pass() is None
    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward(retain_graph=retain_graph)
    assert seen == [(False, retain_graph)]


def test_the_graph_task_reading_is_checked_where_it_runs() -> None:
    # at import, two tiny backward passes check the native reading against torch's accessors;
    # a reading that does not hold is not used, with one warning that says what is lost
    from types import SimpleNamespace

    if backend.NATIVE_ROUNDS is None:
        pytest.skip("the compiled module is not loaded")
    assert torch_internals.check_graph_task_reading(backend.NATIVE_ROUNDS)
    used: list = []
    wrong = SimpleNamespace(graph_task_reading_holds=lambda: False, use_graph_task_reading=used.append)
    with pytest.warns(RuntimeWarning, match="its timeout frees it"):
        assert not torch_internals.check_graph_task_reading(wrong)
    assert used == [False]
    assert backend.NATIVE_ROUNDS.graph_task_reading_holds() is False  # outside a backward pass


def test_the_extension_records_the_torch_it_was_built_against() -> None:
    # the build records the torch it compiled against; the import compares it with the running one
    from types import SimpleNamespace

    from syncbn.functions.operators import backend

    if backend.EXTENSION is None:
        pytest.skip("the compiled extension is not built")
    assert backend.EXTENSION.built_with_torch == torch_internals.torch_build_identity()
    assert torch.__version__ in torch_internals.torch_build_identity()
    other = SimpleNamespace(__name__="syncbn.functions._C_fake", built_with_torch="2.0.0 (0000, cxx11abi=0)")
    with pytest.raises(ImportError, match=r"built against torch 2\.0\.0 .* but this is torch .* rebuild it"):
        backend.check_built_with_this_torch(other)
    with pytest.raises(ImportError, match="unknown version"):
        backend.check_built_with_this_torch(SimpleNamespace(__name__="old"))


def test_the_in_place_probes_read_what_torch_holds() -> None:
    # a gradient that nothing else holds may be written over; one that a hook keeps, or a view,
    # may not; an expanded tensor overlaps itself
    seen: list = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch_internals.held_by_this_backward_alone(grad))
            return grad

    torch_internals.sole_references()
    x = torch.randn(3, requires_grad=True)
    (Probe.apply(x) * 2.0).sum().backward()
    kept: list = []
    p = Probe.apply(x)
    p.register_hook(kept.append)  # the hook keeps the gradient that Probe's backward gets
    (p * 2.0).sum().backward()
    z = Probe.apply(x)
    z.sum().backward()  # sum's backward hands an expanded gradient
    # a torch without the use counts never writes over a gradient (the probe says no)
    sole_is_seen = hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")
    assert seen == [sole_is_seen, False, False]
    assert torch_internals.has_internal_overlap(torch.ones(1).expand(3))
    assert not torch_internals.has_internal_overlap(torch.ones(3))


def test_the_device_assert_and_pytree_are_torch_own() -> None:
    torch_internals.assert_on_device(torch.tensor(True), "never raised")
    with pytest.raises(RuntimeError, match="the ranks disagree"):
        torch_internals.assert_on_device(torch.tensor(False), "the ranks disagree")
    tree = {"x": [torch.ones(1), (2, torch.zeros(2))]}
    leaves, structure = torch_internals.tree_flatten(tree)
    assert len(leaves) == 3
    rebuilt = torch_internals.tree_unflatten(leaves, structure)
    assert rebuilt["x"][1][0] == 2 and rebuilt["x"][0] is leaves[0]


def test_the_engine_says_which_nodes_a_backward_pass_runs() -> None:
    # a failed recomputation is told through a collective whose node the running pass executes
    x = torch.randn(3, requires_grad=True)
    used, unused = x * 2, x * 3
    seen: dict[str, bool] = {}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen["used"] = torch_internals.will_engine_execute(used.grad_fn)
        seen["unused"] = torch_internals.will_engine_execute(unused.grad_fn)
        return grad

    used.register_hook(hook)
    used.exp().sum().backward()
    assert seen == {"used": True, "unused": False}
    if backend.NATIVE_ROUNDS is not None:  # the native weak reference gives the node while it lives
        held = backend.NATIVE_ROUNDS.weak_node(unused)
        assert held() is not None and held().name() == unused.grad_fn.name()
        del unused
        assert held() is None


def test_a_compiled_module_is_told_apart_without_loading_the_compiler() -> None:
    model = nn.Linear(2, 2)
    assert not torch_internals.is_compiled_module(model)
    assert torch_internals.is_compiled_module(torch.compile(model))
    assert torch_internals.uncompiled(torch.compile(model)) is model and torch_internals.uncompiled(model) is model


def test_ddps_reducer_takes_a_forward_pass_work_handle() -> None:
    """What divide_ddp_gradients_by calls; tests/test_join.py checks the divisor it gives, across ranks."""
    from torch._C._distributed_c10d import Reducer

    assert callable(getattr(Reducer, "_set_forward_pass_work_handle", None))

"""Every private part of torch that the library touches, in one place, each with a test
(``tests/test_torch_internals.py``) that checks it still means what we read it as on the
installed torch, for the versions in :data:`CHECKED_TORCH_VERSIONS`.

The native side reads one more (``src/graph_task.h``: a backward pass's ``GraphTask`` from the exported
``get_current_graph_task_nodes_in_graph``), checked where it runs, once, by :func:`check_graph_task_reading`,
and in ``tests/test_torch_internals.py::test_the_native_meetings_find_the_backward_pass_they_wait_in``.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, ContextManager, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.function import Function
from torch.nn.parallel.replicate import replicate as _torch_replicate

CHECKED_TORCH_VERSIONS = ("2.13", "2.14", "2.15")
"""The torch versions (major.minor) whose internals the tests were read against."""


def torch_minor_version() -> str:
    """The running torch's major.minor version."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def warn_if_unchecked_torch() -> None:
    """One warning where the running torch is not among :data:`CHECKED_TORCH_VERSIONS`."""
    if torch_minor_version() not in CHECKED_TORCH_VERSIONS:
        warnings.warn(f"syncbn: torch {torch.__version__} is not among the versions whose private state this library "
                      f"was checked against ({', '.join(CHECKED_TORCH_VERSIONS)}): finding a checkpoint's recomputation, "
                      "stock nn.DataParallel's replicas and a failed backward pass are unverified on it; "
                      "tests/test_torch_internals.py checks them", RuntimeWarning, stacklevel=2)

_REPLICATE_CODE = _torch_replicate.__code__
_BASE_APPLY = vars(torch._C._FunctionBase)["apply"]


def torch_replicate_call(max_depth: int = 8) -> tuple[int | None, nn.Module | None]:
    """``(j, root)`` of torch's ``replicate(network, ...)`` when it is the caller (a few frames
    up, through ``_replicate_for_data_parallel`` overrides): the replica index of its loop and
    replica ``j`` of the root module (made before any other module's), or None where the module
    being replicated is the root itself; else ``(None, None)``. torch says neither to the replicas."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        if frame.f_code is _REPLICATE_CODE:
            j, copies = frame.f_locals.get("j"), frame.f_locals.get("module_copies")
            if not isinstance(j, int):
                return None, None
            made = copies[j] if isinstance(copies, list) and j < len(copies) else None
            root = made[0] if isinstance(made, list) and made and isinstance(made[0], nn.Module) else None
            return j, root
        frame = frame.f_back
    return None, None


def own_forward_hooks(replica: nn.Module) -> None:
    """Give ``replica`` forward-hook dicts of its own: ``_replicate_for_data_parallel`` copies
    ``__dict__`` shallowly, and a hook registered on the replica would stay on the user's module."""
    for name in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        hooks = replica.__dict__.get(name)
        if hooks is not None:
            replica.__dict__[name] = type(hooks)(hooks)


_DATA_PARALLEL_FORWARD = nn.DataParallel.forward.__code__


def device_less_data_parallel_call(max_depth: int = 64) -> bool:
    """Whether stock ``nn.DataParallel``'s forward is a caller (a few frames up) with no devices:
    where no CUDA device is visible it calls its module directly, as its only replica."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        if frame.f_code is _DATA_PARALLEL_FORWARD:
            owner = frame.f_locals.get("self")
            return isinstance(owner, nn.DataParallel) and not owner.device_ids
        frame = frame.f_back
    return False


def has_forward_hook(module: nn.Module, hook: Callable) -> bool:
    """Whether ``hook`` is registered as a forward hook of ``module`` (torch has no public query)."""
    return any(registered is hook for registered in module._forward_hooks.values())


def torch_build_identity() -> str:
    """The running torch as a build records it (setup.py): version, git revision and C++ ABI."""
    return f"{torch.__version__} ({torch.version.git_version}, cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)})"


class _Probe(Function):
    """A node whose backward asks the compiled module whether it reads the graph task as torch does."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, native: ModuleType, seen: list) -> Tensor:
        ctx.native, ctx.seen = native, seen
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.seen.append(ctx.native.graph_task_reading_holds())
        return grad, None, None


def check_graph_task_reading(native: ModuleType) -> bool:
    """Check, in two tiny backward passes (with and without ``retain_graph``), the compiled
    module's reading of torch's ``GraphTask`` (``src/graph_task.h``), and let its backward
    waiters use it only where it holds; else one warning: a waiter whose backward pass failed on
    another device's thread is then freed by its timeout alone."""
    seen: list[bool] = []
    with torch.inference_mode(False), torch.enable_grad():
        for retain_graph in (False, True):
            _Probe.apply(torch.ones(1, requires_grad=True), native, seen).sum().backward(retain_graph=retain_graph)
    holds = seen == [True, True]
    native.use_graph_task_reading(holds)
    if not holds:
        warnings.warn(
            f"syncbn: this torch ({torch.__version__}) lays out its autograd graph task otherwise than the headers "
            "the extension was built with, so a replica waiting in a backward meeting is not told at once that its "
            "backward pass failed on another device (its timeout frees it): rebuild the extension against this torch",
            RuntimeWarning, stacklevel=2,
        )
    return holds


_SOLE_REFERENCES: list[int] = []
"""How many Python references a backward's gradient has, seen as its first statement sees them,
where nothing else holds it (measured once, :func:`sole_references`)."""


class _ReferenceProbe(Function):
    """A Function whose backward sees a gradient that nothing else holds (a multiplication's)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tensor:
        held_by_this_backward_alone(grad_output, probing=True)
        return grad_output


def sole_references() -> int:
    """A gradient's reference count that nothing else holds, as a backward's first statement sees it
    (measured once in a tiny backward pass; call it outside a backward first)."""
    if not _SOLE_REFERENCES:
        with torch.enable_grad():
            x = torch.zeros(2, requires_grad=True)
            (_ReferenceProbe.apply(x * 1.0) * 3.0).sum().backward()
    return _SOLE_REFERENCES[0]


def held_by_this_backward_alone(grad: Tensor, probing: bool = False) -> bool:
    """Whether the engine handed the calling backward (this must be its first statement) a
    gradient that nothing else holds or shares (no hook or user kept it, no ``.grad`` holds it,
    no view, its storage its own), so that the input gradient may be written over it: its Python
    reference count against :func:`sole_references`, and torch's use counts of the tensor and its
    storage. Never under torch.compile or torch.func (no eager references to count there)."""
    if torch.compiler.is_compiling() or functorch_transforms_active():
        return False
    references = sys.getrefcount(grad)  # the probe's backward calls this as ours does
    if probing:
        _SOLE_REFERENCES.append(references)
        return False
    use_count, storage_use_count = getattr(grad, "_use_count", None), getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or storage_use_count is None:  # a torch without them: never write over dy
        return False
    if grad._is_view() or use_count() != 1 or storage_use_count(grad.untyped_storage()._cdata) != 2:
        return False  # the storage's count includes the untyped_storage() just made
    return references <= sole_references()


def has_internal_overlap(tensor: Tensor) -> bool:
    """Whether elements of ``tensor`` share memory (an expanded tensor): not writable in place (torch's unexported check)."""
    return torch._debug_has_internal_overlap(tensor) == 1


def current_graph_task_id() -> int:
    """The running backward pass's id on this thread, -1 outside one."""
    return torch._C._current_graph_task_id()


def in_backward_pass() -> bool:  # whether this thread runs inside a backward pass
    return current_graph_task_id() != -1


def will_engine_execute(node: Any) -> bool:  # inside a backward pass: whether it executes ``node`` (a grad_fn)
    return torch._C._will_engine_execute_node(node)


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (on its thread)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def is_functorch_wrapped(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a torch.func transform's wrapper (a vmap batch, a grad level)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp) is running."""
    return torch._C._are_functorch_transforms_active()


def is_reentrant_checkpoint_refusal(error: BaseException) -> bool:
    """Whether ``error`` is torch.utils.checkpoint(use_reentrant=True) refusing a backward
    through ``torch.autograd.grad`` (a RuntimeError told apart by its text alone)."""
    return isinstance(error, RuntimeError) and "use_reentrant=True, torch.utils.checkpoint is incompatible" in str(error)


def is_checkpoint_stop(error: BaseException) -> bool:
    """Whether ``error`` is torch.utils.checkpoint's stop of a recomputation (control flow, its
    class private)."""
    return type(error).__name__ == "_StopRecomputationError"


_CHECKPOINT_PACK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTATION_PACK = "_recomputation_hook.__init__.<locals>.pack_hook"
FIRST_RUN = "first run"
"""The run of a checkpointed region that is not a recomputation, as the region readers name it."""


def nonreentrant_checkpoint_region() -> tuple[object, Any] | None:
    """The ``torch.utils.checkpoint(use_reentrant=False)`` region whose saved-tensor hooks are this
    thread's innermost ones, and which run of it this is: ``(frame, run)``, the region's
    ``_CheckpointFrame`` and :data:`FIRST_RUN`, or the backward pass (checkpoint's ``gid``) whose
    recomputation this is. None outside such a region, where other hooks are innermost, or where
    the hooks' closure no longer holds what it is read as."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return None
    pack = getattr(hooks[0], "__wrapped__", hooks[0])  # the recomputation's is wrapped by a dynamo disable
    if getattr(pack, "__module__", None) != "torch.utils.checkpoint":
        return None
    cells = dict(zip(pack.__code__.co_freevars, (c.cell_contents for c in pack.__closure__ or ())))
    if pack.__qualname__ == _CHECKPOINT_PACK:
        frame = cells.get("frame")
        return None if frame is None else (frame, FIRST_RUN)
    if pack.__qualname__ == _RECOMPUTATION_PACK and "target_frame_ref" in cells and "gid" in cells:
        frame = cells["target_frame_ref"]()
        return None if frame is None else (frame, cells["gid"])
    return None


def checkpoint_first_run_ended(frame: object) -> bool:
    """Whether the first run of the non-reentrant region ``frame`` (a ``_CheckpointFrame``) has
    ended (its ``forward_completed``); False where the frame has no such flag, so that a torch
    that renamed it makes callers assume the least (see :mod:`syncbn.functions.checkpointing`)."""
    return bool(getattr(frame, "forward_completed", False))


_REENTRANT_RUNS = {
    torch.utils.checkpoint.CheckpointFunction.forward.__code__: False,
    torch.utils.checkpoint.CheckpointFunction.backward.__code__: True,
}


def reentrant_checkpoint_region() -> tuple[object, Any] | None:
    """The innermost ``torch.utils.checkpoint(use_reentrant=True)`` region on this thread's stack,
    whatever the grad mode, and which run of it this is: ``(node, run)``, the region's autograd
    node (the ``ctx`` of ``CheckpointFunction.forward``, its first run, and of its ``backward``,
    the recomputation) and :data:`FIRST_RUN`, or the backward pass (its graph task id) that
    recomputes. None elsewhere."""
    frame = sys._getframe(1)
    while frame is not None:
        recomputing = _REENTRANT_RUNS.get(frame.f_code)
        if recomputing is not None:
            ctx = frame.f_locals.get("ctx")
            return None if ctx is None else (ctx, current_graph_task_id() if recomputing else FIRST_RUN)
        frame = frame.f_back
    return None


def in_selective_recomputation() -> bool:
    """Whether this thread recomputes a region of selective activation checkpointing
    (``create_selective_checkpoint_contexts``): in a backward pass, with its cached-op dispatch
    mode on the stack, which expects the ops of the first run again, one for one."""
    if not in_backward_pass():
        return False
    from torch.utils import _python_dispatch
    from torch.utils.checkpoint import _CachedTorchDispatchMode

    return any(isinstance(mode, _CachedTorchDispatchMode) for mode in _python_dispatch._get_current_dispatch_mode_stack())


def outside_dispatch_modes() -> ContextManager:
    """A context that runs its body outside the current dispatch modes (a recomputed layer whose
    ops are not the first run's: its statistics are reused, its running statistics untouched)."""
    from torch.utils import _python_dispatch

    return _python_dispatch._disable_current_modes()


class _GivenArguments(NamedTuple):
    """What ``inspect.Signature.bind`` returns, for a call that gives every argument positionally."""

    args: tuple
    kwargs: dict

    def apply_defaults(self) -> None:
        """Every argument is given: no default to apply."""


class _EveryArgumentSignature(inspect.Signature):
    """A forward's signature whose ``bind`` of a call that gives every argument positionally
    returns them as they are (what the general binding returns for it, without its cost)."""

    __slots__ = ()

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == len(self.parameters):
            return _GivenArguments(args, {})
        return super().bind(*args, **kwargs)


_CHEAPLY_BOUND: set[type] = set()


def _bind_cheaply(function: type[Function]) -> None:
    """Give ``function.forward`` an :class:`_EveryArgumentSignature`, which ``inspect.signature``
    returns as it is: torch >= 2.15's C ``apply`` binds every call's arguments with it."""
    forward = vars(function)["forward"]
    fn = forward.__func__ if isinstance(forward, staticmethod) else forward
    signature = inspect.signature(fn)
    fn.__signature__ = _EveryArgumentSignature(list(signature.parameters.values()), return_annotation=signature.return_annotation)
    _CHEAPLY_BOUND.add(function)


def apply_without_binding(function: type[Function], *args: Any) -> Any:
    """``function.apply(*args)`` with every argument given, without the general binding of its
    arguments to ``forward``'s signature that ``Function.apply`` does for Functions with
    ``setup_context`` on every call (``inspect.signature`` and ``bind``, which cost more than a
    small layer's kernels): torch < 2.15 binds in Python, which the C ``apply`` skips; torch >=
    2.15 binds in C, through the signature that :func:`_bind_cheaply` gives. Eager mode outside
    torch.func transforms only: the caller checks."""
    if function not in _CHEAPLY_BOUND:
        _bind_cheaply(function)
    unwrap = torch._C._functorch.unwrap_if_dead
    return _BASE_APPLY.__get__(None, function)(*(unwrap(a) if isinstance(a, Tensor) else a for a in args))


def lazy_dynamo_disable(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)`` that imports ``torch._dynamo`` at its first call, not now;
    torch's own, which Dynamo skips without tracing it (a disable made at the first compiling
    call would be traced, and break the graph at its making as well)."""
    return torch._disable_dynamo(fn)


def assert_on_device(condition: Tensor, message: str) -> None:
    """Raise ``message`` where the 0-dim bool ``condition`` is false, checked on its device without
    a host read (``torch._assert_async``, which torch.compile keeps in its graph)."""
    torch._assert_async(condition, message)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """torch's pytree flattening (``torch.utils._pytree``): the leaves and the structure."""
    return sys.modules["torch.utils._pytree"].tree_flatten(tree)


def tree_unflatten(leaves: list, structure: Any) -> Any:
    """The tree of ``structure`` (from :func:`tree_flatten`) with ``leaves``."""
    return sys.modules["torch.utils._pytree"].tree_unflatten(leaves, structure)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (an ``OptimizedModule``; none before the compiler loads)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module that ``torch.compile`` wrapped (its ``_orig_mod``), or ``module`` where it is not compiled."""
    return module._orig_mod if is_compiled_module(module) else module


def divide_ddp_gradients_by(ddp: nn.Module, work: Any) -> None:
    """DDP averages this step's gradients over the sum of ``work`` (an async all_reduce), as it does for itself
    as torch's first ``Joinable``: the reducer's forward-pass work handle (``divide_by_initial_world_size=False``)."""
    ddp.reducer._set_forward_pass_work_handle(work, False)


def functional_collectives() -> ModuleType:
    """torch.distributed._functional_collectives (traced by torch.compile), imported at the first call (it loads the compiler)."""
    from torch.distributed import _functional_collectives

    return _functional_collectives


warn_if_unchecked_torch()

"""ThreadedDataParallel: nn.DataParallel on any list of devices, CPU included, with a backward
thread per replica.

On the CPU, ``nn.DataParallel`` does not replicate, and the CPU autograd engine runs one backward
on one thread, so replicas of a synchronized layer could never meet in backward. This wrapper
scatters the batch along ``dim``, runs each replica's forward in a thread, gathers the outputs to
``output_device`` through an autograd Function whose backward starts one ``torch.autograd.grad``
per replica, each on its own thread, and hands the input and parameter gradients back to the
original graph. Devices may repeat: ``['cpu'] * 4``, ``['cuda:0'] * 2``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..functions.torch_internals import is_compiled_module, tree_flatten, tree_unflatten
from ..functions.synchronization.replica_backward import (
    GatherWithReplicaBackward, Piece, ReplicaInput, ReplicaRun, gather, record_in_place_writes,
)
from ..functions.synchronization.replica_threads import ThreadState, run_in_threads
from ..functions.synchronization.replicas import replica_rounds, replicas_in_order, resolve_timeout
from ..functions.synchronization.synchronizer import check_not_transformed

from .compiler import disable_when_compiling
from .conversion import name_sync_layers

__all__ = ["ThreadedDataParallel"]

def _needs_accelerator(device: Any) -> bool:
    """An int (torch's accelerator index) or a device of a type other than cpu and meta."""
    if isinstance(device, int):
        return True
    try:
        return torch.device(device).type not in ("cpu", "meta")
    except (RuntimeError, TypeError):
        return False  # not a device at all: said below


def _normalize_device(device: Any) -> torch.device:
    if _needs_accelerator(device) and not torch.accelerator.is_available():  # before torch's bare error
        raise ValueError(
            f"ThreadedDataParallel: device {device!r} is an accelerator's, and this machine has none "
            "(torch.accelerator.is_available() is False); for CPU replicas pass ['cpu'] * n"
        )
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"ThreadedDataParallel: {device!r} is not a device ({error}); pass e.g. ['cpu'] * 2 "
                         "or ['cuda:0', 'cuda:1']") from None
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


Cuts = dict[int, tuple[Tensor, int]]
"""id() of a chunk that ``_scatter`` cut off a caller's tensor -> (that tensor, the chunk's start
along ``dim``)."""


def _batch_size(obj: Any, dim: int) -> int:
    """The largest size along ``dim`` of the tensors in ``obj`` (0 where there are none)."""
    if isinstance(obj, Tensor):
        return obj.size(dim) if obj.dim() > dim else 0
    if isinstance(obj, (tuple, list)):
        return max((_batch_size(item, dim) for item in obj), default=0)
    if isinstance(obj, dict):
        return max((_batch_size(item, dim) for item in obj.values()), default=0)
    return 0


def _scatter(
    obj: Any, devices: Sequence[torch.device], dim: int, batch: int, name: str, cuts: Cuts | None = None
) -> list[Any]:
    """Split tensors of the ``batch`` size along ``dim`` into at most len(devices) chunks (as
    Tensor.chunk does: batch 10 on 4 devices is 3, 3, 3, 1), one per device; a tensor of size 1
    there (a broadcast mask) or of too few dims reaches every device whole, as it broadcasts
    against the batch; another size raises, naming the argument (``name``). Containers are split
    element by element and other objects are shared. The result has as many entries as the
    fewest chunks.

    With ``cuts``, chunks are cut off the tensors detached (outside autograd) and each is
    recorded in ``cuts``; without, the chunks stay in the caller's graph."""
    if isinstance(obj, Tensor):
        size = obj.size(dim) if obj.dim() > dim else None
        if size is None or (size == 1 and batch > 1):
            return [obj.to(device) for device in devices]
        if size != batch:
            raise ValueError(
                f"ThreadedDataParallel: {name} has size {size} along dim {dim}, but the batch has {batch}: it can be "
                f"neither split into one chunk per replica nor broadcast (size 1); give it size {batch} or 1 there"
            )
        chunks = (obj.detach() if cuts is not None else obj).chunk(len(devices), dim)
        parts = [chunk.to(device) for chunk, device in zip(chunks, devices)]
        if cuts is not None:
            start = 0
            for part in parts:
                cuts[id(part)] = (obj, start)
                start += part.size(dim)
        return parts
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        split = (_scatter(item, devices, dim, batch, f"{name}.{field}", cuts) for field, item in zip(obj._fields, obj))
        return [type(obj)(*parts) for parts in zip(*split)]
    if isinstance(obj, (tuple, list)) and len(obj) > 0:
        split = (_scatter(item, devices, dim, batch, f"{name}[{i}]", cuts) for i, item in enumerate(obj))
        return [type(obj)(parts) for parts in zip(*split)]
    if isinstance(obj, dict) and len(obj) > 0:
        keys = list(obj)
        split = (_scatter(obj[k], devices, dim, batch, f"{name}[{k!r}]", cuts) for k in keys)
        return [type(obj)(zip(keys, parts)) for parts in zip(*split)]
    return [obj for _ in devices]


def _scatter_kwargs(
    inputs: tuple, kwargs: dict, devices: Sequence[torch.device], dim: int, cuts: Cuts | None = None
) -> tuple[list[tuple], list[dict]]:
    if not inputs and not kwargs:
        inputs = ((),)
    batch = _batch_size((inputs, kwargs), dim)
    split_inputs = [
        tuple(parts) for parts in zip(*(_scatter(arg, devices, dim, batch, f"argument {i}", cuts) for i, arg in enumerate(inputs)))
    ] if inputs else []
    split_kwargs = [
        dict(zip(kwargs, parts)) for parts in zip(*(_scatter(kwargs[k], devices, dim, batch, f"{k}=", cuts) for k in kwargs))
    ] if kwargs else []
    # non-tensors are shared by every device, so the fewest tensor chunks decide the count
    count = min(len(split_inputs), len(split_kwargs)) if inputs and kwargs else max(len(split_inputs), len(split_kwargs))
    split_inputs, split_kwargs = split_inputs[:count], split_kwargs[:count]
    split_inputs += [()] * (count - len(split_inputs))
    split_kwargs += [{}] * (count - len(split_kwargs))
    return split_inputs, split_kwargs


def _replicate(module: nn.Module, devices: Sequence[torch.device]) -> tuple[list[nn.Module], list[list[Tensor]]]:
    """Replicas of ``module`` on ``devices``, made as torch's replicate() makes them (one
    ``_replicate_for_data_parallel()`` per replica, in device order, for every module).

    Replica j's parameters are fresh leaves (returned, aligned with ``module.parameters()``), so
    that its backward can run on its own. Replica 0 holds the original buffers (running stats
    updated there land on the module, as under nn.DataParallel); the others hold copies.
    """
    params = list(module.parameters())
    param_index = {p: i for i, p in enumerate(params)}
    buffers = list(module.buffers())
    buffer_index = {b: i for i, b in enumerate(buffers)}
    param_leaves = [[p.detach().to(d).requires_grad_(p.requires_grad) for p in params] for d in devices]
    buffer_copies = [buffers] + [[b.detach().to(d, copy=True) for b in buffers] for d in devices[1:]]

    modules = list(module.modules())
    module_index = {m: i for i, m in enumerate(modules)}
    copies = [replicas_in_order(m, len(devices)) for m in modules]
    for i, original in enumerate(modules):
        for j, replica in enumerate(copies[i]):
            for key, child in original._modules.items():
                replica._modules[key] = None if child is None else copies[module_index[child]][j]
            for key, param in original._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    setattr(replica, key, param_leaves[j][param_index[param]])
            for key, buffer in original._buffers.items():
                replica._buffers[key] = None if buffer is None else buffer_copies[j][buffer_index[buffer]]
    return [copies[0][j] for j in range(len(devices))], param_leaves


_LONE_TENSOR = "a lone tensor"
_TENSOR_ARGS = "positional tensors only"


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, with the common cases made without pytree's Python per node (it runs for
    every replica at every step): a lone tensor, and ``(args, {})`` with tensor ``args``."""
    if isinstance(tree, Tensor):
        return [tree], _LONE_TENSOR
    if type(tree) is tuple and len(tree) == 2 and type(tree[0]) is tuple and type(tree[1]) is dict and not tree[1]:
        if all(isinstance(arg, Tensor) for arg in tree[0]):
            return list(tree[0]), (_TENSOR_ARGS, len(tree[0]))
    return tree_flatten(tree)


def _unflatten(flat: list[Any], spec: Any) -> Any:
    """The inverse of :func:`_flatten`."""
    if spec is _LONE_TENSOR:
        return flat[0]
    if isinstance(spec, tuple) and spec[0] is _TENSOR_ARGS:
        return tuple(flat), {}
    return tree_unflatten(flat, spec)


class ThreadedDataParallel(nn.Module):
    """Data parallelism in threads, on any list of devices (CPU included; devices may repeat).

    Behaves like ``nn.DataParallel``: scatters positional and keyword tensors along ``dim`` into
    at most ``len(devices)`` chunks (a tensor of size 1 there, a broadcast mask, reaches every
    replica whole; one of another size than the batch raises, naming it; a ``torch.compile``'d
    module is refused: compile the wrapper instead), runs one replica per chunk in its own thread (under the
    caller's grad mode and autocast; CPU replicas share the caller's ``torch.get_num_threads()``
    intra-op threads, ``max(1, threads // cpu_replicas)`` each, where the compiled module is
    loaded), and gathers the outputs on ``output_device`` (default
    ``devices[0]``). Parameter gradients land on the original module; running statistics of
    replica 0 (on ``devices[0]``) are the module's own. Each replica's backward runs on its own
    thread (never on the autograd engine's device threads), so synchronized batch norm replicas
    meet in backward on the CPU too, and on one GPU repeated. When a replica raises, the others
    are released at once and the original error is re-raised. Once a replica of a step has
    ended well, the others get ten times ``timeout`` (default ``$SYNCBN_TIMEOUT``, else 60 s);
    once one has failed, three times the longest of the wrapper's and the layers' timeouts (a
    layer's own wait, which names the layer, gives up first); then a
    :class:`~syncbn.functions.ReplicaSyncError` names them, with their stacks.

    Chunks that stay on their device are views of the caller's tensors, not copies (as
    nn.DataParallel's chunk on its own device): a replica's in-place op on its input writes to
    the caller's tensor, and bumps its version as torch does. Each input's gradient is assembled
    by the replica threads, each writing its own rows as its backward ends.

    The module must live on ``devices[0]``. Double backward through the replicas is not
    supported.
    """

    def __init__(
        self, module: nn.Module, devices: Sequence[Any], output_device: Any = None, dim: int = 0, timeout: float | None = None
    ) -> None:
        super().__init__()
        if len(devices) == 0:
            raise ValueError("ThreadedDataParallel needs at least one device")
        if any(is_compiled_module(m) for m in module.modules()):
            raise TypeError(
                "ThreadedDataParallel: the module is (or holds) a torch.compile'd module, whose compiled code cannot "
                "be replicated into threads; pass the model itself, ThreadedDataParallel(model) (the replicas run "
                "eagerly, as under torch.compile(ThreadedDataParallel(model))), or compile it under DDP, one process "
                "per device (docs/toolchain.md)"
            )
        self.timeout = resolve_timeout(timeout)
        self.module = module
        self.devices = [_normalize_device(d) for d in devices]
        self.output_device = self.devices[0] if output_device is None else _normalize_device(output_device)
        self.dim = dim
        name_sync_layers(module)

    def _check_module_device(self) -> None:
        home = self.devices[0]
        for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if tensor.device != home:
                raise RuntimeError(
                    f"ThreadedDataParallel: the module must have its parameters and buffers on "
                    f"devices[0] ({home}), but {name} is on {tensor.device}"
                )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_module_device()
        if len(self.devices) == 1:
            split_inputs, split_kwargs = _scatter_kwargs(inputs, kwargs, self.devices, self.dim)
            return self.module(*split_inputs[0], **split_kwargs[0])
        return self._forward_in_threads(inputs, kwargs)

    # Dynamo cannot trace threads, and the replicas are new modules at every step (a guard on
    # them would recompile each step): the threaded step runs eagerly under torch.compile (the
    # decorator below; it also reads tensor versions), and the replicas run in
    # worker threads, which Dynamo does not compile either
    @disable_when_compiling
    def _forward_in_threads(self, inputs: tuple, kwargs: dict) -> Any:
        check_not_transformed(None, "ThreadedDataParallel")  # its replicas' threads run outside the transform
        cuts: Cuts = {}
        split_inputs, split_kwargs = _scatter_kwargs(inputs, kwargs, self.devices, self.dim, cuts)
        devices = self.devices[: len(split_inputs)]
        state = ThreadState(devices)
        replicas, param_leaves = _replicate(self.module, devices)
        rounds = replica_rounds(replicas)
        for round in rounds:
            round.seal()

        sources: list[Tensor] = []
        input_leaves: list[list[Tensor]] = []
        pieces: list[list[Piece]] = []
        jobs = []
        for replica, args, kwargs_j, device in zip(replicas, split_inputs, split_kwargs, devices):
            args_j, kw_j, leaves, replica_pieces = self._detached_inputs(args, kwargs_j, cuts, sources, state)
            input_leaves.append(leaves)
            pieces.append(replica_pieces)
            jobs.append(lambda r=replica, a=args_j, k=kw_j, d=device: self._run_replica(r, a, k, d, state))
        del replicas
        results = run_in_threads(jobs, rounds, self.timeout)
        record_in_place_writes(input_leaves, pieces, sources)

        flat_outputs, specs = zip(*(_flatten(out) for out in results))
        if any(spec != specs[0] for spec in specs):
            raise RuntimeError("ThreadedDataParallel: replicas returned outputs of different structures")
        all_params = list(self.module.parameters())
        grad_index = [i for i, p in enumerate(all_params) if p.requires_grad]
        params = [all_params[i] for i in grad_index]
        run = ReplicaRun(
            list(map(list, flat_outputs)),
            input_leaves,
            pieces,
            sources,
            [[leaves[i] for i in grad_index] for leaves in param_leaves],
            params,
            devices,
            rounds,
            self.dim,
            self.timeout,
        )
        graph_inputs = sources + params if state.grad_enabled else []
        if any(t.requires_grad for t in graph_inputs):
            gathered = GatherWithReplicaBackward.apply(run, self.output_device, *graph_inputs)
        else:
            gathered = run.gathered(self.output_device)
        flat = [
            None if isinstance(value, Tensor) else gather([out[k] for out in flat_outputs], self.output_device, self.dim)
            for k, value in enumerate(flat_outputs[0])
        ]
        for k, tensor in zip(run.tensor_positions, gathered):
            flat[k] = tensor
        return _unflatten(flat, specs[0])

    def _detached_inputs(
        self, args: tuple, kwargs: dict, cuts: Cuts, sources: list[Tensor], state: ThreadState
    ) -> tuple[tuple, dict, list[Tensor], list[Piece]]:
        """One replica's arguments, each tensor whose source requires grad replaced by a
        :class:`ReplicaInput` of a fresh leaf; the leaves, and where each came from (its source
        is added to ``sources`` the first time it is seen)."""
        flat, spec = _flatten((args, kwargs))
        leaves, pieces = [], []
        for i, value in enumerate(flat):
            if not (isinstance(value, Tensor) and state.grad_enabled):
                continue
            source, start = cuts.get(id(value), (value, None))
            if not source.requires_grad:
                continue
            index = next((k for k, seen in enumerate(sources) if seen is source), len(sources))
            if index == len(sources):
                sources.append(source)
            # .data: a version counter of the replica's own, so that in-place ops on one chunk do
            # not invalidate what the other replicas saved (see record_in_place_writes)
            leaves.append(value.data.requires_grad_())
            pieces.append(Piece(index, start, value.size(self.dim) if start is not None else 0))
            # a leaf source: the replica's own leaf, which refuses an in-place write before it is
            # made, as the caller's leaf would; else a non-leaf alias that takes it
            flat[i] = leaves[-1] if source.is_leaf else ReplicaInput.apply(leaves[-1])
        args, kwargs = _unflatten(flat, spec)
        return args, kwargs, leaves, pieces

    @staticmethod
    def _run_replica(replica: nn.Module, args: tuple, kwargs: dict, device: torch.device, state: ThreadState) -> Any:
        with state.on(device):
            return replica(*args, **kwargs)

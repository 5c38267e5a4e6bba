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

import queue
import sys
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import Tensor, nn
from torch.autograd.function import Function, once_differentiable
from torch.autograd.graph import increment_version
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..functions.backend import set_thread_intra_op_threads
from ..functions.devices import fetch
from ..functions.replicas import (
    ReplicaRound, ReplicaSyncError, abort_rounds, replica_rounds, replicas_in_order, resolve_timeout,
)

from .compiler import disable_when_compiling
from .conversion import name_sync_layers

__all__ = ["ThreadedDataParallel"]

T = TypeVar("T")


def _normalize_device(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


Cuts = dict[int, tuple[Tensor, int]]
"""id() of a chunk that ``_scatter`` cut off a caller's tensor -> (that tensor, the chunk's start
along ``dim``)."""


def _scatter(obj: Any, devices: Sequence[torch.device], dim: int, cuts: Cuts | None = None) -> list[Any]:
    """Split tensors along ``dim`` into at most len(devices) chunks (as Tensor.chunk does: batch
    10 on 4 devices is 3, 3, 3, 1), one per device; containers are split element by element
    and other objects are shared. The result has as many entries as the fewest chunks.

    With ``cuts``, chunks are cut off the tensors detached (outside autograd) and each is
    recorded in ``cuts``; without, the chunks stay in the caller's graph."""
    if isinstance(obj, Tensor):
        chunks = (obj.detach() if cuts is not None else obj).chunk(len(devices), dim)
        parts = [chunk.to(device) for chunk, device in zip(chunks, devices)]
        if cuts is not None:
            start = 0
            for part in parts:
                cuts[id(part)] = (obj, start)
                start += part.size(dim)
        return parts
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [type(obj)(*parts) for parts in zip(*(_scatter(item, devices, dim, cuts) for item in obj))]
    if isinstance(obj, (tuple, list)) and len(obj) > 0:
        return [type(obj)(parts) for parts in zip(*(_scatter(item, devices, dim, cuts) for item in obj))]
    if isinstance(obj, dict) and len(obj) > 0:
        keys = list(obj)
        return [type(obj)(zip(keys, parts)) for parts in zip(*(_scatter(obj[k], devices, dim, cuts) for k in keys))]
    return [obj for _ in devices]


def _scatter_kwargs(
    inputs: tuple, kwargs: dict, devices: Sequence[torch.device], dim: int, cuts: Cuts | None = None
) -> tuple[list[tuple], list[dict]]:
    if not inputs and not kwargs:
        inputs = ((),)
    split_inputs = _scatter(inputs, devices, dim, cuts) if inputs else []
    split_kwargs = _scatter(kwargs, devices, dim, cuts) if kwargs else []
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


class _ThreadState:
    """The caller's thread-local state (grad mode, autocast, CUDA stream) for worker threads, and
    each CPU replica's share of the caller's intra-op threads."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self.autocast = [(t, torch.get_autocast_dtype(t)) for t in types if torch.is_autocast_enabled(t)]
        self.streams = {d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"}
        # CPU replicas run at once: each starting a team of all the caller's threads would put
        # R x threads on the cores (measured: a small ResNet step under 4 CPU replicas on 2
        # vCPUs took 100 ms so, 24 ms with one thread each; benchmarks/RESULTS.md)
        self.cpu_threads = max(1, torch.get_num_threads() // max(1, sum(d.type == "cpu" for d in devices)))

    @contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        if device.type == "cpu":
            set_thread_intra_op_threads(self.cpu_threads)
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[device]))
            yield


class _Worker:
    """A daemon thread that runs the jobs it is handed, one at a time. Workers outlive the step
    (they wait in a free list between calls), so that per-thread state, such as the OpenMP
    thread team that torch's CPU kernels start from each calling thread, is made once rather
    than at every forward and backward."""

    _idle: list["_Worker"] = []
    _idle_lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="ThreadedDataParallel-worker").start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    @classmethod
    def take(cls, count: int) -> list["_Worker"]:
        """``count`` idle workers, started where there are not enough."""
        with cls._idle_lock:
            taken = cls._idle[:count]
            del cls._idle[:count]
        return taken + [cls() for _ in range(count - len(taken))]

    @classmethod
    def give_back(cls, workers: Sequence["_Worker"]) -> None:
        with cls._idle_lock:
            cls._idle.extend(workers)


TAIL_TIMEOUTS = 10
"""Once a replica of a step has ended well, the others get this many timeouts more (10 minutes by
default): replicas may end apart (uneven chunks, work after the last synchronized layer), but not
by that much, short of a hang."""

STRAGGLER_TIMEOUTS = 3
"""Once a replica of a step has failed, the others, released from the rounds at once, get this
many of the longest timeout among the wrapper's and the synchronized layers' own: a replica
exchange waits up to twice its timeout (once more when the master is combining), so that the
layer's error, which says where, comes first."""


def _run_in_threads(jobs: Sequence[Callable[[], T]], rounds: Sequence[ReplicaRound], timeout: float) -> list[T]:
    """Run one job per replica, all at once, each on its own worker thread. When one raises,
    the rounds of the synchronized layers are broken at once so that no replica waits for it;
    after all jobs ended, the first error that is not such a consequence is re-raised.

    The wait is bounded once a job has ended: ``TAIL_TIMEOUTS * timeout`` after the first ended
    well, ``STRAGGLER_TIMEOUTS`` times the longest timeout after the first failed. Past that, the
    rounds are broken and a :class:`ReplicaSyncError` names the stragglers, with their stacks;
    their workers are not reused (they may be stuck, and may still write the module's buffers
    when they wake: replica 0 holds them). Replicas that all hang outside the synchronized layers,
    where no exchange notices, are waited for."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    ended = [False] * len(jobs)
    threads: list[int | None] = [None] * len(jobs)
    ending = threading.Condition()

    def work(index: int) -> None:
        threads[index] = threading.get_ident()
        try:
            results[index] = jobs[index]()
        except BaseException as error:
            errors[index] = error
            abort_rounds(rounds, error, index)
        finally:
            with ending:
                ended[index] = True
                ending.notify()

    workers = _Worker.take(len(jobs))
    for index, worker in enumerate(workers):
        worker.submit(lambda index=index: work(index))
    after_failure = STRAGGLER_TIMEOUTS * max([timeout, *(round.timeout for round in rounds)])
    stragglers = _wait_for_jobs(ended, errors, ending, TAIL_TIMEOUTS * timeout, after_failure)
    _Worker.give_back([w for w, done in zip(workers, ended) if done])
    if stragglers:
        errors.append(_stragglers_error(stragglers, ended, [threads[i] for i in stragglers], rounds))
    failed = [e for e in errors if e is not None]
    if failed:
        raise next((e for e in failed if not isinstance(e, ReplicaSyncError)), failed[0])
    return results


def _wait_for_jobs(
    ended: list[bool], errors: list[BaseException | None], ending: threading.Condition, tail: float, after_failure: float
) -> list[int]:
    """Wait until every job has ended, at most ``tail`` seconds after the first one ended and
    ``after_failure`` seconds after the first one failed; the jobs still running then."""
    deadline = None
    with ending:
        while not all(ended):
            now = time.monotonic()
            if any(ended):
                limits = [now + tail] + ([now + after_failure] if any(e is not None for e in errors) else [])
                deadline = min([*limits, *([deadline] if deadline is not None else [])])
                if deadline <= now:
                    return [i for i, done in enumerate(ended) if not done]
            ending.wait(None if deadline is None else deadline - now)
    return []


def _stragglers_error(
    stragglers: list[int], ended: list[bool], threads: list[int | None], rounds: Sequence[ReplicaRound]
) -> ReplicaSyncError:
    """Say who hangs, and where (their stacks, taken before the rounds are broken); then break
    the rounds, so that a straggler waiting in one is released."""
    frames = sys._current_frames()
    stacks = "".join(
        f"\n--- replica {j} (thread {ident}):\n" + "".join(traceback.format_stack(frames[ident], limit=12))
        for j, ident in zip(stragglers, threads)
        if ident in frames
    )
    finished = [i for i, done in enumerate(ended) if done]
    error = ReplicaSyncError(
        f"ThreadedDataParallel: replica(s) {stragglers} did not finish in time"
        + (f" after replicas {finished} had ended" if finished else "")
        + "; their rounds are broken. The wait is set by timeout= or $SYNCBN_TIMEOUT. Where they were:"
        + stacks
    )
    abort_rounds(rounds, error)
    return error


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


def _gather(values: Sequence[Any], device: torch.device, dim: int) -> Any:
    """Tensors are concatenated along ``dim`` (scalars stacked); other values must agree."""
    first = values[0]
    if isinstance(first, Tensor):
        moved = [v.to(device) for v in values]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim)
    return first if all(v is first or v == first for v in values) else list(values)


@dataclass(frozen=True)
class _Piece:
    """Where a replica's input leaf came from: ``sources[source]`` of the gather Function, cut
    at ``start`` along ``dim`` for ``size`` rows, or the whole tensor (``start`` None) where
    the scatter shared it with every replica."""

    source: int
    start: int | None
    size: int


class _ReplicaRun:
    """One forward of the replicas: what their threaded backward needs (never the replicas).

    The replicas' outputs (and through them their graphs) are handed to the gather Function's
    ``save_for_backward``, so that the outer graph frees them when it is freed, keeps them when
    asked to retain it, and refuses a second backward through freed ones, as any graph does.

    The caller's tensors that require grad (the Function's ``sources``) reach the replicas
    detached, so no autograd op of the caller's graph splits them: the backward assembles each
    source's gradient itself, and each replica thread writes its rows into it as soon as its
    own backward ends, while the others still run.
    """

    def __init__(
        self,
        outputs: list[list[Any]],
        input_leaves: list[list[Tensor]],
        pieces: list[list[_Piece]],
        sources: list[Tensor],
        param_leaves: list[list[Tensor]],
        params: list[Tensor],
        devices: list[torch.device],
        rounds: list[ReplicaRound],
        dim: int,
        timeout: float,
    ) -> None:
        self.tensor_positions = [k for k, v in enumerate(outputs[0]) if isinstance(v, Tensor)]
        self.values: list[list[Tensor]] | None = [[out[k] for out in outputs] for k in self.tensor_positions]
        self.sizes = [[v.size(dim) if v.dim() else None for v in values] for values in self.values]
        self.requires_grad = [[v.requires_grad for v in values] for values in self.values]
        self.input_leaves = input_leaves  # per replica
        self.pieces = pieces  # per replica, aligned with input_leaves
        # aliases sharing each source's version counter (and memory, which the leaves hold anyway),
        # not the sources: the graph must not keep them. They also give the gradient buffers their
        # size, dtype, device and layout (empty_like's)
        self.source_aliases = [t.detach() for t in sources]
        self.source_versions = [t._version for t in sources]
        self.param_leaves = param_leaves  # per replica, aligned with params
        self.params, self.devices, self.rounds, self.dim, self.timeout = params, devices, rounds, dim, timeout

    def gathered(self, output_device: torch.device) -> list[Tensor]:
        return [_gather([v.detach() for v in values], output_device, self.dim) for values in self.values]

    def differentiable(self) -> list[bool]:
        """Per gathered tensor: whether any replica's value of it requires grad."""
        return [any(flags) for flags in self.requires_grad]

    def take_graph_outputs(self) -> list[Tensor]:
        """The replicas' outputs that require grad, replica by replica; forgotten here."""
        values, self.values = self.values, None
        return [values[p][j] for j in range(len(self.devices)) for p in range(len(values)) if self.requires_grad[p][j]]

    def _slice(self, grad: Tensor, p: int, j: int) -> Tensor:
        sizes = self.sizes[p]
        if sizes[j] is None:
            return grad[j]
        return grad.narrow(self.dim, sum(sizes[:j]), sizes[j])

    def _rows(self, buffer: Tensor, piece: _Piece) -> Tensor:
        return buffer.narrow(self.dim, piece.start, piece.size)  # type: ignore[arg-type]

    def _grads_of_replica(
        self, outs: list[Tensor], out_grads: list[Tensor], first_rows: list[Tensor | None], j: int, state: _ThreadState
    ) -> list[Any]:
        """Replica j's gradients for its input leaves, then its parameter leaves, from its outputs'
        gradients ``out_grads``. Where ``first_rows`` gives a leaf the rows of its source's buffer
        (see :meth:`_first_rows`), they are written there now, and the leaf's entry says
        ``_WRITTEN``."""
        leaves = self.input_leaves[j] + self.param_leaves[j]
        if not outs or not leaves:
            return [None] * len(leaves)
        # on this thread, not on the autograd engine's thread of the device: that thread may be
        # the one running the gather's backward, which waits for this one (a deadlock on CUDA)
        with state.on(self.devices[j]), torch.autograd.set_multithreading_enabled(False):
            # retained: the outer graph decides when the replicas' graphs go (see the class)
            result: list[Any] = list(torch.autograd.grad(outs, leaves, out_grads, retain_graph=True, allow_unused=True))
            for i, rows in enumerate(first_rows):
                if rows is not None and result[i] is not None:
                    rows.copy_(result[i])
                    result[i] = _WRITTEN
        return result

    def _out_grads(self, grads: Sequence[Tensor], j: int) -> list[Tensor]:
        """Replica j's rows of the gradients of the gathered outputs that its outputs require, on
        its device. Copied by the thread that runs the backward, on its current streams, which
        the replica threads run on too (stream order protects the copies)."""
        device = self.devices[j]
        rows = (self._slice(grad, p, j) for p, grad in enumerate(grads) if self.requires_grad[p][j])
        return [fetch(g, device) for g in rows]

    def _first_rows(self, buffers: list[Tensor | None], j: int) -> list[Tensor | None]:
        """Per input leaf of replica j: the rows of its source's buffer that the replica's thread
        writes its gradient into, where the buffer is on the leaf's device and the leaf is the
        first of its replica at those rows; else None. Made here, by the thread that runs the
        backward, so that the replica threads make fewer calls that hand the GIL around."""
        rows: list[Tensor | None] = []
        for i, (leaf, piece) in enumerate(zip(self.input_leaves[j], self.pieces[j])):
            buffer = buffers[piece.source]
            writes = self._writes_first(j, i) and buffer is not None and buffer.device == leaf.device
            rows.append(self._rows(buffer, piece) if writes else None)  # type: ignore[arg-type]
        return rows

    def _writes_first(self, j: int, i: int) -> bool:
        """Whether replica j's leaf i is the first of its replica cut at its rows (a tensor
        passed twice gives two leaves on the same rows: the second adds to the first)."""
        piece = self.pieces[j][i]
        return piece.start is not None and piece not in self.pieces[j][:i]

    def _source_grads(self, per_replica: list[list[Any]], buffers: list[Tensor | None]) -> list[Tensor | None]:
        """Each source's gradient: its buffer with every replica's rows (zeros where a replica's
        leaf got none), plus the gradients of the replicas it was shared with whole."""
        written: list[set[_Piece]] = [set() for _ in buffers]
        whole: list[Tensor | None] = [None] * len(buffers)
        for j, replica in enumerate(per_replica):
            for piece, grad in zip(self.pieces[j], replica):
                if grad is _WRITTEN:
                    written[piece.source].add(piece)
                elif grad is None:
                    continue
                elif piece.start is None:
                    grad = grad.to(self.source_aliases[piece.source].device)
                    whole[piece.source] = grad if whole[piece.source] is None else whole[piece.source] + grad
                elif piece in written[piece.source]:
                    self._rows(buffers[piece.source], piece).add_(grad)  # type: ignore[arg-type]
                else:
                    self._rows(buffers[piece.source], piece).copy_(grad)  # type: ignore[arg-type]
                    written[piece.source].add(piece)
        result: list[Tensor | None] = []
        for k, buffer in enumerate(buffers):
            if buffer is not None and written[k]:
                for piece in {p for pieces in self.pieces for p in pieces if p.source == k and p.start is not None}:
                    if piece not in written[k]:
                        self._rows(buffer, piece).zero_()
            rows = buffer if buffer is not None and written[k] else None
            if rows is None or whole[k] is None:
                result.append(rows if rows is not None else whole[k])
            else:
                result.append(rows + whole[k])
        return result

    def _covered(self, k: int) -> bool:
        """Whether the replicas' pieces cover every row of source k (not where a tensor with fewer
        rows cut the replicas to fewer chunks): the uncovered rows' gradient is zero."""
        starts = {(p.start, p.size) for pieces in self.pieces for p in pieces if p.source == k and p.start is not None}
        source = self.source_aliases[k]
        return sum(size for _, size in starts) == source.size(self.dim % source.dim())

    def _check_sources_unchanged(self) -> None:
        """As autograd refuses saved tensors modified in place: the replicas saw the sources'
        memory (their own version counters cannot tell), so a source written in place after the
        forward would give a wrong gradient."""
        for alias, version in zip(self.source_aliases, self.source_versions):
            if alias._version != version:
                raise RuntimeError(
                    "ThreadedDataParallel: an input of the replicas was modified by an inplace operation "
                    f"after the forward (version {alias._version}, expected {version}); its gradient would be wrong"
                )

    def backward(self, graph_outputs: Sequence[Tensor], grads: Sequence[Tensor]) -> list[Tensor | None]:
        """Gradients for the sources, then for the params."""
        it = iter(graph_outputs)  # replica by replica, as take_graph_outputs gave them
        per_replica_outs = [
            [next(it) for p in range(len(grads)) if self.requires_grad[p][j]] for j in range(len(self.devices))
        ]
        cut = {piece.source for pieces in self.pieces for piece in pieces if piece.start is not None}
        self._check_sources_unchanged()
        buffers = [
            (torch.empty_like if self._covered(k) else torch.zeros_like)(source) if k in cut else None
            for k, source in enumerate(self.source_aliases)
        ]
        state = _ThreadState(self.devices)  # the backward's own grad mode and autocast
        jobs = [
            lambda j=j, g=self._out_grads(grads, j), rows=self._first_rows(buffers, j): self._grads_of_replica(
                per_replica_outs[j], g, rows, j, state
            )
            for j in range(len(self.devices))
        ]
        per_replica = _run_in_threads(jobs, self.rounds, self.timeout)
        source_grads = self._source_grads([replica[: len(self.input_leaves[j])] for j, replica in enumerate(per_replica)], buffers)
        param_grads = []
        for i, param in enumerate(self.params):
            parts = [replica[len(self.input_leaves[j]) + i] for j, replica in enumerate(per_replica)]
            present = [g.to(param.device) for g in parts if g is not None]
            param_grads.append(torch.stack(present).sum(0) if present else None)
        return source_grads + param_grads


_WRITTEN = object()
"""A replica's entry for a leaf whose gradient it already wrote into its source's buffer."""


def _record_in_place_writes(input_leaves: list[list[Tensor]], pieces: list[list[_Piece]], sources: list[Tensor]) -> None:
    """Where a replica wrote to its input in place, it wrote to the caller's tensor: bump that
    tensor's version, so that the caller's graph refuses to use what it saved of the old values
    (as it would had the module run on it directly). Leaf sources never get here: the replicas
    hold leaves of them, which refuse in-place writes."""
    written = {piece.source for leaves, cut in zip(input_leaves, pieces) for leaf, piece in zip(leaves, cut) if leaf._version}
    for index in sorted(written):
        increment_version(sources[index])


class _ReplicaInput(Function):
    """A replica's input chunk as a fresh non-leaf on the chunk's own memory, as nn.DataParallel
    hands the chunk that stays on its device: in-place ops on it work (a leaf would refuse them)
    and, as there, write to the caller's tensor; the gradient flows to the replica's leaf."""

    @staticmethod
    def forward(ctx, leaf: Tensor) -> Tensor:  # type: ignore[override]
        return leaf.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


class _GatherWithReplicaBackward(Function):
    """Gathers the replicas' outputs; its backward runs each replica's backward on a thread."""

    @staticmethod
    def forward(ctx, run: _ReplicaRun, output_device: torch.device, *graph_inputs: Tensor):  # type: ignore[override]
        ctx.run = run
        outputs = run.gathered(output_device)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, run.differentiable()) if not d])
        ctx.save_for_backward(*run.take_graph_outputs())
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        return (None, None, *ctx.run.backward(ctx.saved_tensors, grads))


class ThreadedDataParallel(nn.Module):
    """Data parallelism in threads, on any list of devices (CPU included; devices may repeat).

    Behaves like ``nn.DataParallel``: scatters positional and keyword tensors along ``dim`` into
    at most ``len(devices)`` chunks, runs one replica per chunk in its own thread (under the
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
    :class:`~functions.ReplicaSyncError` names them, with their stacks.

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
    # them would recompile each step): the threaded step runs eagerly under torch.compile (see
    # disable_when_compiling below; it also reads tensor versions), and the replicas run in
    # worker threads, which Dynamo does not compile either
    def _forward_in_threads(self, inputs: tuple, kwargs: dict) -> Any:
        cuts: Cuts = {}
        split_inputs, split_kwargs = _scatter_kwargs(inputs, kwargs, self.devices, self.dim, cuts)
        devices = self.devices[: len(split_inputs)]
        state = _ThreadState(devices)
        replicas, param_leaves = _replicate(self.module, devices)
        rounds = replica_rounds(replicas)
        for round in rounds:
            round.seal()

        sources: list[Tensor] = []
        input_leaves: list[list[Tensor]] = []
        pieces: list[list[_Piece]] = []
        jobs = []
        for replica, args, kwargs_j, device in zip(replicas, split_inputs, split_kwargs, devices):
            args_j, kw_j, leaves, replica_pieces = self._detached_inputs(args, kwargs_j, cuts, sources, state)
            input_leaves.append(leaves)
            pieces.append(replica_pieces)
            jobs.append(lambda r=replica, a=args_j, k=kw_j, d=device: self._run_replica(r, a, k, d, state))
        del replicas
        results = _run_in_threads(jobs, rounds, self.timeout)
        _record_in_place_writes(input_leaves, pieces, sources)

        flat_outputs, specs = zip(*(_flatten(out) for out in results))
        if any(spec != specs[0] for spec in specs):
            raise RuntimeError("ThreadedDataParallel: replicas returned outputs of different structures")
        all_params = list(self.module.parameters())
        grad_index = [i for i, p in enumerate(all_params) if p.requires_grad]
        params = [all_params[i] for i in grad_index]
        run = _ReplicaRun(
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
            gathered = _GatherWithReplicaBackward.apply(run, self.output_device, *graph_inputs)
        else:
            gathered = run.gathered(self.output_device)
        flat = [
            None if isinstance(value, Tensor) else _gather([out[k] for out in flat_outputs], self.output_device, self.dim)
            for k, value in enumerate(flat_outputs[0])
        ]
        for k, tensor in zip(run.tensor_positions, gathered):
            flat[k] = tensor
        return _unflatten(flat, specs[0])

    def _detached_inputs(
        self, args: tuple, kwargs: dict, cuts: Cuts, sources: list[Tensor], state: _ThreadState
    ) -> tuple[tuple, dict, list[Tensor], list[_Piece]]:
        """One replica's arguments, each tensor whose source requires grad replaced by a
        :class:`_ReplicaInput` of a fresh leaf; the leaves, and where each came from (its source
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
            # not invalidate what the other replicas saved (see _record_in_place_writes)
            leaves.append(value.data.requires_grad_())
            pieces.append(_Piece(index, start, value.size(self.dim) if start is not None else 0))
            # a leaf source: the replica's own leaf, which refuses an in-place write before it is
            # made, as the caller's leaf would; else a non-leaf alias that takes it
            flat[i] = leaves[-1] if source.is_leaf else _ReplicaInput.apply(leaves[-1])
        args, kwargs = _unflatten(flat, spec)
        return args, kwargs, leaves, pieces

    @staticmethod
    def _run_replica(replica: nn.Module, args: tuple, kwargs: dict, device: torch.device, state: _ThreadState) -> Any:
        with state.on(device):
            return replica(*args, **kwargs)


disable_when_compiling(ThreadedDataParallel, "_forward_in_threads")
disable_when_compiling(sys.modules[__name__], "_record_in_place_writes")  # reads versions; its caller is disabled too

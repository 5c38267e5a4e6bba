"""ThreadedDataParallel's gather and threaded backward (syncbn.modules.parallel): the autograd Function
that gathers the replicas' outputs and whose backward runs each replica's backward on its own
thread (``torch.autograd.grad`` per replica), then hands the input and parameter gradients back to
the caller's graph, each input's gradient assembled from the replicas' rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.autograd.function import Function, once_differentiable
from torch.autograd.graph import increment_version

from ..devices import fetch
from ..torch_internals import is_reentrant_checkpoint_refusal
from .replica_threads import ThreadState, run_in_threads
from .replicas import ReplicaRound

REENTRANT_CHECKPOINT = (
    "ThreadedDataParallel: a replica's backward runs through torch.autograd.grad, which "
    "torch.utils.checkpoint(use_reentrant=True) refuses inside the replicas; pass use_reentrant=False "
    "(our layers recompute under it with the statistics of one forward), or checkpoint around the wrapper"
)


def gather(values: Sequence[Any], device: torch.device, dim: int) -> Any:
    """Tensors are concatenated along ``dim`` (scalars stacked); other values must agree."""
    first = values[0]
    if isinstance(first, Tensor):
        moved = [v.to(device) for v in values]
        return torch.stack(moved) if first.dim() == 0 else torch.cat(moved, dim)
    return first if all(v is first or v == first for v in values) else list(values)


@dataclass(frozen=True)
class Piece:
    """Where a replica's input leaf came from: ``sources[source]`` of the gather Function, cut
    at ``start`` along ``dim`` for ``size`` rows, or the whole tensor (``start`` None) where
    the scatter shared it with every replica."""

    source: int
    start: int | None
    size: int


class ReplicaRun:
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
        pieces: list[list[Piece]],
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
        return [gather([v.detach() for v in values], output_device, self.dim) for values in self.values]

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

    def _rows(self, buffer: Tensor, piece: Piece) -> Tensor:
        return buffer.narrow(self.dim, piece.start, piece.size)  # type: ignore[arg-type]

    def _grads_of_replica(
        self, outs: list[Tensor], out_grads: list[Tensor], first_rows: list[Tensor | None], j: int, state: ThreadState
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
            try:
                result: list[Any] = list(torch.autograd.grad(outs, leaves, out_grads, retain_graph=True, allow_unused=True))
            except RuntimeError as error:
                if is_reentrant_checkpoint_refusal(error):
                    raise RuntimeError(REENTRANT_CHECKPOINT) from error
                raise
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
        written: list[set[Piece]] = [set() for _ in buffers]
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
        state = ThreadState(self.devices)  # the backward's own grad mode and autocast
        jobs = [
            lambda j=j, g=self._out_grads(grads, j), rows=self._first_rows(buffers, j): self._grads_of_replica(
                per_replica_outs[j], g, rows, j, state
            )
            for j in range(len(self.devices))
        ]
        per_replica = run_in_threads(jobs, self.rounds, self.timeout)
        source_grads = self._source_grads([replica[: len(self.input_leaves[j])] for j, replica in enumerate(per_replica)], buffers)
        param_grads = []
        for i, param in enumerate(self.params):
            parts = [replica[len(self.input_leaves[j]) + i] for j, replica in enumerate(per_replica)]
            present = [g.to(param.device) for g in parts if g is not None]
            param_grads.append(torch.stack(present).sum(0) if present else None)
        return source_grads + param_grads


_WRITTEN = object()
"""A replica's entry for a leaf whose gradient it already wrote into its source's buffer."""


def record_in_place_writes(input_leaves: list[list[Tensor]], pieces: list[list[Piece]], sources: list[Tensor]) -> None:
    """Where a replica wrote to its input in place, it wrote to the caller's tensor: bump that
    tensor's version, so that the caller's graph refuses to use what it saved of the old values
    (as it would had the module run on it directly). Leaf sources never get here: the replicas
    hold leaves of them, which refuse in-place writes."""
    written = {piece.source for leaves, cut in zip(input_leaves, pieces) for leaf, piece in zip(leaves, cut) if leaf._version}
    for index in sorted(written):
        increment_version(sources[index])


class ReplicaInput(Function):
    """A replica's input chunk as a fresh non-leaf on the chunk's own memory, as nn.DataParallel
    hands the chunk that stays on its device: in-place ops on it work (a leaf would refuse them)
    and, as there, write to the caller's tensor; the gradient flows to the replica's leaf."""

    @staticmethod
    def forward(ctx, leaf: Tensor) -> Tensor:  # type: ignore[override]
        return leaf.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


class GatherWithReplicaBackward(Function):
    """Gathers the replicas' outputs; its backward runs each replica's backward on a thread."""

    @staticmethod
    def forward(ctx, run: ReplicaRun, output_device: torch.device, *graph_inputs: Tensor):  # type: ignore[override]
        ctx.run = run
        outputs = run.gathered(output_device)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, run.differentiable()) if not d])
        ctx.save_for_backward(*run.take_graph_outputs())
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        return (None, None, *ctx.run.backward(ctx.saved_tensors, grads))

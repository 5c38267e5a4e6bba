"""Fusing batch norm -> activation pairs of a model into one layer of ours (``fuse_bn_act``):
consecutive children of ``nn.Sequential``, and the pairs that a torch.fx trace proves adjacent."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .conversion import _TO_SYNC, _TO_TORCH, _convert, _layer_args, _move_state
from .batchnorm import SyncBatchNorm

_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu"}
_RELU_FUNCTIONS = {F.relu, torch.relu, torch.relu_, getattr(F, "relu_", F.relu)}


def _fused_layer(layer: _BatchNorm, activation: str, negative_slope: float) -> SyncBatchNorm:
    """A layer of ours holding ``layer``'s parameters and buffers, with the activation fused."""
    ours = layer if isinstance(layer, SyncBatchNorm) else _convert(layer, getattr(layer, "layer_name", "") or "", None, {})
    kind = next(cls for cls in type(ours).__mro__ if cls in _TO_TORCH)
    fused = _move_state(ours, kind(**_layer_args(ours), process_group=ours.process_group, timeout=ours.timeout))
    fused.frozen, fused.layer_name = ours.frozen, ours.layer_name
    fused.activation, fused.negative_slope = activation, float(negative_slope)
    return fused


def _fusable(layer: Any, held: dict[int, int]) -> bool:
    """A batch norm (ours or torch's) without an activation, held in one place only."""
    is_bn = type(layer) in _TO_SYNC or isinstance(layer, SyncBatchNorm)
    return is_bn and getattr(layer, "activation", None) is None and held.get(id(layer), 0) == 1


def _holdings(model: nn.Module) -> dict[int, int]:
    """How many places of ``model`` hold each module."""
    held: dict[int, int] = {}
    for _, layer in model.named_modules(remove_duplicate=False):
        held[id(layer)] = held.get(id(layer), 0) + 1
    return held


def _fuse_sequential_pairs(model: nn.Module) -> None:
    """In every ``nn.Sequential``, a batch norm followed by ReLU/LeakyReLU becomes one fused
    layer and the activation's slot ``nn.Identity``."""
    held = _holdings(model)
    for sequence in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(sequence._modules)
        for first, second in zip(names, names[1:]):
            layer, act = sequence._modules[first], sequence._modules[second]
            if type(act) in _ACTIVATION_MODULES and _fusable(layer, held):
                slope = getattr(act, "negative_slope", 0.01)
                sequence._modules[first] = _fused_layer(layer, _ACTIVATION_MODULES[type(act)], slope)
                sequence._modules[second] = nn.Identity()


class _LeafBatchNormTracer(torch.fx.Tracer):
    """torch.fx's tracer, with our layers as leaves (calls, not traced through)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, SyncBatchNorm) or super().is_leaf_module(m, module_qualified_name)


def _activation_of(node: torch.fx.Node, source: torch.fx.Node, modules: dict[str, nn.Module]) -> tuple[str, float] | None:
    """(activation, negative_slope) when ``node`` is ReLU/LeakyReLU applied to ``source``."""
    if not node.args or node.args[0] is not source:
        return None
    if node.op == "call_module" and type(modules.get(node.target)) in _ACTIVATION_MODULES:
        act = modules[node.target]
        return _ACTIVATION_MODULES[type(act)], getattr(act, "negative_slope", 0.01)
    if node.op == "call_method" and node.target in ("relu", "relu_") and len(node.args) == 1:
        return "relu", 0.0
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS:
        return "relu", 0.0
    if node.op == "call_function" and node.target is F.leaky_relu:
        slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
        return ("leaky_relu", float(slope)) if isinstance(slope, (int, float)) else None
    return None


def _fuse_traced_pairs(model: nn.Module) -> nn.Module:
    """The pairs torch.fx proves adjacent: a batch norm called once whose output only an
    activation uses. Returns a GraphModule with them fused, or ``model`` when it does not
    trace or holds no such pair."""
    try:
        graph = _LeafBatchNormTracer().trace(model)
    except Exception:  # control flow on values, unsupported calls: leave the model as it is
        return model
    modules, held = dict(model.named_modules()), _holdings(model)
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    fused: dict[str, SyncBatchNorm] = {}
    for node in list(graph.nodes):
        layer = modules.get(node.target) if node.op == "call_module" else None
        if layer is None or calls[node.target] != 1 or not _fusable(layer, held) or len(node.users) != 1:
            continue
        act = next(iter(node.users))
        found = _activation_of(act, node, modules)
        if found is None:
            continue
        fused[node.target] = _fused_layer(layer, *found)
        act.replace_all_uses_with(node)
        graph.erase_node(act)
    if not fused:
        return model
    graph.lint()
    result = torch.fx.GraphModule(model, graph, class_name=type(model).__name__)
    for target, layer in fused.items():
        result.set_submodule(target, layer)
    return result


def fuse_bn_act(model: nn.Module) -> nn.Module:
    """Fuse every batch norm -> ReLU/LeakyReLU pair of ``model`` that is provably adjacent into
    one layer of ours with ``activation`` set (one elementwise pass each way instead of three).

    First, in place, the pairs of consecutive children of an ``nn.Sequential`` (the activation's
    slot becomes ``nn.Identity``). Then, where the model traces with ``torch.fx`` (our layers
    as leaves), a batch norm called once whose output nothing but an activation uses (an
    ``nn.ReLU``/``nn.LeakyReLU`` module, ``F.relu``, ``torch.relu``, ``.relu()``,
    ``F.leaky_relu`` with a constant slope, in place or not); if there are any, a
    ``torch.fx.GraphModule`` is returned with those fused, and ``model`` keeps its own graph.
    Batch norms held in two places, already fused, or followed by anything else, are left as
    they are, as is everything else. Torch's batch norms that are fused become ours (the same
    parameters and buffers). Returns the fused model.
    """
    if type(model) in _ACTIVATION_MODULES or type(model) in _TO_SYNC or isinstance(model, SyncBatchNorm):
        return model
    _fuse_sequential_pairs(model)
    return _fuse_traced_pairs(model)

"""Fusing batch norm -> activation pairs of a model into one layer of ours: ``fuse_bn_act`` (our
fused layer), ``convert_inplace_abn`` (an in-place activated batch norm); consecutive children of
``nn.Sequential``, and the pairs that a torch.fx trace proves adjacent."""
from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .conversion import _TO_SYNC, _TO_TORCH, _convert, _layer_args, _move_state
from .batchnorm import SyncBatchNorm
from .inplace_abn import InPlaceABN
from .timm_layers import SyncBatchNormAct2d

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
    return _is_batch_norm(layer) and getattr(layer, "activation", None) is None and held.get(id(layer), 0) == 1


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


class _TracedPair(NamedTuple):
    """A batch norm's call in a torch.fx graph and the one node that uses its output."""

    node: torch.fx.Node
    layer: nn.Module
    user: torch.fx.Node
    calls: int
    """How many times the graph calls the batch norm."""


PairLayer = Callable[[_TracedPair, dict[str, nn.Module], dict[int, int]], "nn.Module | None"]


def _replace_traced_pairs(model: nn.Module, pair_layer: PairLayer) -> nn.Module:
    """For every batch norm call of ``model``'s torch.fx trace whose output one node alone uses:
    ``pair_layer(pair, modules, held)``, the layer that does both (None: leave the pair). The
    user is dropped from the graph and the batch norm replaced. Returns a GraphModule with the
    replacements, or ``model`` where it does not trace or nothing was replaced."""
    try:
        graph = _LeafBatchNormTracer().trace(model)
    except Exception:  # control flow on values, unsupported calls: leave the model as it is
        return model
    modules, held = dict(model.named_modules()), _holdings(model)
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    replaced: dict[str, nn.Module] = {}
    for node in list(graph.nodes):
        layer = modules.get(node.target) if node.op == "call_module" else None
        if layer is None or not _is_batch_norm(layer) or len(node.users) != 1:
            continue
        user = next(iter(node.users))
        new = pair_layer(_TracedPair(node, layer, user, calls[node.target]), modules, held)
        if new is None:
            continue
        replaced[node.target] = new
        user.replace_all_uses_with(node)
        graph.erase_node(user)
    if not replaced:
        return model
    graph.lint()
    result = torch.fx.GraphModule(model, graph, class_name=type(model).__name__)
    for target, layer in replaced.items():
        result.set_submodule(target, layer)
    return result


def _is_batch_norm(layer: Any) -> bool:
    """torch's batch norm or ours; not timm's batch norm + activation, whose own act comes first."""
    return type(layer) in _TO_SYNC or (isinstance(layer, SyncBatchNorm) and not isinstance(layer, SyncBatchNormAct2d))


def _fused_pair(pair: _TracedPair, modules: dict[str, nn.Module], held: dict[int, int]) -> SyncBatchNorm | None:
    """Our fused layer for a batch norm called once whose output only an activation uses."""
    found = _activation_of(pair.user, pair.node, modules)
    if pair.calls != 1 or not _fusable(pair.layer, held) or found is None:
        return None
    return _fused_layer(pair.layer, *found)  # type: ignore[arg-type]


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
    return _replace_traced_pairs(model, _fused_pair)


# --- in-place activated batch norm ---------------------------------------------------------------

_INVERTIBLE_ACTIVATIONS = {nn.LeakyReLU: ("leaky_relu", "negative_slope"), nn.ELU: ("elu", "alpha")}
_FRESH_OUTPUT_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)
"""Modules whose output is a new tensor that nothing else holds: a batch norm right after one
may write over its input."""
_FRESH_OUTPUT_FUNCTIONS = {operator.add, torch.add, torch.cat, F.conv1d, F.conv2d, F.conv3d, F.linear}


class InPlaceConversion(NamedTuple):
    """What :func:`convert_inplace_abn` did: the converted ``module``, the paths of the batch
    norms it made in-place layers (``converted``), and the pairs it left alone with why
    (``left_alone``: path -> reason)."""

    module: nn.Module
    converted: list[str]
    left_alone: dict[str, str]


def _inplace_activation(act: Any) -> tuple[str, float] | None:
    """(activation, activation_param) of an invertible activation module with a positive parameter."""
    found = _INVERTIBLE_ACTIVATIONS.get(type(act))
    if found is None:
        return None
    name, attr = found
    param = float(getattr(act, attr))
    return (name, param) if param > 0 else None


def _why_not_inplace(layer: Any, held: dict[int, int]) -> str | None:
    """Why a batch norm cannot become an exact in-place layer (None: it can)."""
    if getattr(layer, "activation", None) is not None:
        return "already has an activation"
    if held.get(id(layer), 0) != 1:
        return "held in more than one place"
    if layer.weight is not None and not bool((layer.weight >= layer.eps).all()):
        return f"a weight below eps ({layer.eps}): the in-place scale |weight| + eps cannot equal it"
    return None


def _inplace_layer(layer: _BatchNorm, activation: str, param: float) -> InPlaceABN:
    """An in-place layer holding ``layer``'s parameters and buffers: the weight shifted by -eps
    in place (the same Parameter), so that |weight| + eps is the old weight (to its rounding)."""
    ours = layer if isinstance(layer, SyncBatchNorm) else _convert(layer, getattr(layer, "layer_name", "") or "", None, {})
    result = InPlaceABN(
        ours.num_features, ours.eps, ours.momentum, ours.affine, ours.track_running_stats, activation, param,
        process_group=ours.process_group, timeout=ours.timeout, device="meta",
    )
    _move_state(ours, result)
    result.frozen, result.layer_name = ours.frozen, ours.layer_name
    if result.weight is not None:
        with torch.no_grad():
            result.weight.sub_(result.eps)
    return result


def _inplace_sequential_pairs(model: nn.Module, done: InPlaceConversion) -> None:
    """In every ``nn.Sequential``: producer -> batch norm -> invertible activation, the producer
    a module with a fresh output (convolution, linear)."""
    held = _holdings(model)
    paths = {id(m): name for name, m in model.named_modules()}
    for sequence in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        names = list(sequence._modules)
        for before, first, second in zip([None, *names], names, names[1:]):
            layer, act = sequence._modules[first], sequence._modules[second]
            found = _inplace_activation(act)
            if found is None or not _is_batch_norm(layer):
                continue
            path = f"{paths[id(sequence)]}.{first}".lstrip(".")
            why = _why_not_inplace(layer, held)
            if why is None and (before is None or not isinstance(sequence._modules[before], _FRESH_OUTPUT_MODULES)):
                why = "its input may be used elsewhere (not right after a convolution or linear layer)"
            if why is not None:
                done.left_alone[path] = why
                continue
            sequence._modules[first] = _inplace_layer(layer, *found)
            sequence._modules[second] = nn.Identity()
            done.converted.append(path)


def _fresh_and_only_for(source: Any, node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``source`` (the batch norm's input) is a fresh tensor that only ``node`` uses."""
    if not isinstance(source, torch.fx.Node) or len(source.users) != 1:
        return False
    if source.op == "call_module":
        return isinstance(modules.get(source.target), _FRESH_OUTPUT_MODULES)
    return source.op == "call_function" and source.target in _FRESH_OUTPUT_FUNCTIONS


def _inplace_pair(done: InPlaceConversion) -> PairLayer:
    """The in-place layer for a pair the trace proves adjacent, whose batch norm's input is fresh
    and used by it alone; what is left alone goes to ``done``."""

    def pair_layer(pair: _TracedPair, modules: dict[str, nn.Module], held: dict[int, int]) -> InPlaceABN | None:
        user, target = pair.user, pair.node.target
        found = _inplace_activation(modules.get(user.target)) if user.op == "call_module" and user.args[:1] == (pair.node,) else None
        if found is None:
            return None
        why = _why_not_inplace(pair.layer, held) or (None if pair.calls == 1 else "called more than once")
        if why is None and not _fresh_and_only_for(pair.node.args[0], pair.node, modules):
            why = "its input may be used elsewhere (not a fresh output used by it alone)"
        if why is not None:
            done.left_alone.setdefault(str(target), why)
            return None
        done.converted.append(str(target))
        return _inplace_layer(pair.layer, *found)  # type: ignore[arg-type]

    return pair_layer


def convert_inplace_abn(model: nn.Module) -> InPlaceConversion:
    """Turn every batch norm -> ``nn.LeakyReLU``/``nn.ELU`` pair of ``model`` that can be one
    into an :class:`~syncbn.modules.nn.InPlaceABN` with that activation, exactly: the new layer holds
    the same Parameters and buffers, its weight shifted by -eps in place, so that its scale
    |weight| + eps is the old weight (to the weight's rounding).

    First, in place, the consecutive children of an ``nn.Sequential`` (the activation's slot
    becomes ``nn.Identity``); then, where the model traces with ``torch.fx``, the pairs the
    trace proves adjacent (a GraphModule is returned where there are any). A pair is left alone,
    and said so in the result's ``left_alone``, where the batch norm's input might be used
    elsewhere (the in-place layer writes over it: it must come fresh from a convolution or
    linear layer, or an add, and feed the batch norm alone), where a weight is below eps (a
    negative weight cannot be expressed), where the activation's slope or alpha is not positive
    (``nn.ReLU`` is not invertible: such pairs are not listed), or where the batch norm is held
    in two places. Returns an :class:`InPlaceConversion`.
    """
    done = InPlaceConversion(model, [], {})
    if isinstance(model, (SyncBatchNorm, *_TO_SYNC)):
        return done
    _inplace_sequential_pairs(model, done)
    return done._replace(module=_replace_traced_pairs(model, _inplace_pair(done)))

"""Pure-PyTorch reference kernels of the in-place activated batch norm (In-Place ABN, Rota Bulo
et al. 2018; the layers in syncbn.modules.inplace_abn): the ``torch.ops.syncbn.abn_*`` operators,
registered by :mod:`syncbn.functions.operators.ops` as :mod:`syncbn.functions.operators.reference`'s are, and the oracle of their
compiled kernels. Shapes and layouts as in :mod:`syncbn.functions.operators.reference`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .reference import accumulation_dtype, memory_format_of, per_channel, reduction_dims


# In-place activated batch norm (In-Place ABN, Rota Bulo et al. 2018; the layers in
# syncbn.modules.inplace_abn): y = act(x_hat * gamma + beta) with gamma = |weight| + eps, written over
# x; the backward recovers act's input z from y (act is invertible), x_hat = (z - beta) / gamma,
# and reads nothing else full-size but dy.
ABN_ACTIVATIONS = ("leaky_relu", "elu", "identity")
"""The invertible activations of the in-place layers; ``activation_param`` is leaky_relu's slope
below 0 or elu's alpha (both positive), unused by identity."""


def abn_affine(weight: Tensor | None, bias: Tensor | None, eps: float, like: Tensor) -> tuple[Tensor, Tensor]:
    """(gamma, beta) in ``like``'s dtype: gamma = |weight| + eps (1 without a weight), beta = bias (0)."""
    gamma = torch.ones_like(like) if weight is None else weight.to(like.dtype).abs() + eps
    beta = torch.zeros_like(like) if bias is None else bias.to(like.dtype)
    return gamma, beta


def abn_activation(pre: Tensor, activation: str, activation_param: float) -> Tensor:
    """act(pre): leaky_relu ``pre > 0 ? pre : pre * slope``, elu ``pre > 0 ? pre : alpha * expm1(pre)``, identity."""
    if activation == "leaky_relu":
        return torch.where(pre > 0, pre, pre * activation_param)
    if activation == "elu":
        return torch.where(pre > 0, pre, torch.expm1(pre) * activation_param)
    return pre


def abn_inverse(y: Tensor, activation: str, activation_param: float) -> tuple[Tensor, Tensor]:
    """(z, act'(z)) from y = act(z): leaky_relu ``y > 0 ? (y, 1) : (y / slope, slope)``, elu
    ``y > 0 ? (y, 1) : (log1p(y / alpha), y + alpha)``, identity ``(y, 1)``. Where elu is flat
    (y rounds to -alpha) z is -inf and act'(z) is 0."""
    one = torch.ones_like(y)
    if activation == "leaky_relu":
        return torch.where(y > 0, y, y / activation_param), torch.where(y > 0, one, one * activation_param)
    if activation == "elu":
        return torch.where(y > 0, y, torch.log1p(y / activation_param)), torch.where(y > 0, one, y + activation_param)
    return y, one


def abn_forward_(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    activation: str,
    activation_param: float,
) -> None:
    """x <- act((x - mean) * invstd * gamma + beta), in place, gamma = |weight| + eps, beta =
    bias; computed in invstd's dtype (the accumulation dtype), rounded once to x's. (This
    reference holds a full-size temporary; the compiled kernels do not.)"""
    gamma, beta = abn_affine(weight, bias, eps, invstd)
    scale = invstd * gamma
    pre = torch.addcmul(per_channel(beta - mean * scale, x), x.to(invstd.dtype), per_channel(scale, x))
    x.copy_(abn_activation(pre, activation, activation_param))


def _abn_recovered(
    y: Tensor, dy: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, activation: str, activation_param: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(x_hat, dz, gamma) in the accumulation dtype: act inverted at y, dz = dy * act'(z), x_hat =
    (z - beta) / gamma (0 where dz is 0: elu's flat end, where z is -inf)."""
    acc = accumulation_dtype(y.dtype)
    like = y.new_empty(y.size(1), dtype=acc)
    gamma, beta = abn_affine(weight, bias, eps, like)
    z, slope = abn_inverse(y.to(acc), activation, activation_param)
    dz = dy.to(acc) * slope
    x_hat = (z - per_channel(beta, y)) / per_channel(gamma, y)
    return torch.where(slope == 0, 0.0, x_hat), dz, gamma


def abn_backward_reduce(
    y: Tensor, dy: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, activation: str, activation_param: float
) -> tuple[Tensor, Tensor]:
    """sum(dz) and sum(x_hat * dz) per channel, in the accumulation dtype, from the output y
    and its gradient dy: dz = dy * act'(z), z = act^-1(y), x_hat = (z - beta) / gamma."""
    x_hat, dz, _ = _abn_recovered(y, dy, weight, bias, eps, activation, activation_param)
    dims = reduction_dims(y)
    return dz.sum(dims), (x_hat * dz).sum(dims)


def abn_backward_elemt(
    y: Tensor,
    dy: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    activation: str,
    activation_param: float,
    sum_dz: Tensor | None,
    sum_xhat_dz: Tensor | None,
    count: int,
) -> Tensor:
    """dx = (dz - sum_dz / N - x_hat * sum_xhat_dz / N) * gamma * invstd with the sums over the
    whole batch of N (= ``count``) values per channel (batch statistics), or dx = dz * gamma *
    invstd without sums (fixed statistics). Shaped, typed and laid out as y."""
    x_hat, dz, gamma = _abn_recovered(y, dy, weight, bias, eps, activation, activation_param)
    if sum_dz is not None and sum_xhat_dz is not None:
        dz = dz - per_channel(sum_dz / count, y) - x_hat * per_channel(sum_xhat_dz / count, y)
    dx = dz * per_channel(invstd * gamma, y)
    return dx.to(y.dtype).contiguous(memory_format=memory_format_of(y))


def abn_backward_elemt_(
    dy: Tensor,
    y: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    activation: str,
    activation_param: float,
    sum_dz: Tensor | None,
    sum_xhat_dz: Tensor | None,
    count: int,
) -> None:
    """:func:`abn_backward_elemt` written over ``dy`` (laid out as y): the backward's input
    gradient where the output's gradient is the backward's alone."""
    dy.copy_(abn_backward_elemt(y, dy, invstd, weight, bias, eps, activation, activation_param, sum_dz, sum_xhat_dz, count))

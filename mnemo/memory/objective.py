"""The memory function ``M_W`` and its inner objective (the attentional bias): the forward pass,
the objective's value and gradient, and the per-token gradient factors of the chunk form (a
hand-written backward of the memory, with the fused GELU value and slope)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .spec import MemorySpec

__all__ = ["memory_apply", "objective_grad", "objective_value"]


def _act(name: str, z: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(z)
    if name == "silu":
        return F.silu(z)
    if name == "relu":
        return F.relu(z)
    return torch.tanh(z)


def _act_grad(name: str, z: torch.Tensor) -> torch.Tensor:
    """``act'(z)`` for the activations other than GELU (see :class:`_GeluWithGrad`)."""
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "relu":
        return (z > 0).to(z.dtype)
    return 1 - torch.tanh(z) ** 2


_LN_EPS = 1e-5


def _ln(z: torch.Tensor, affine=None) -> torch.Tensor:
    """The inner layer norm over the last dim; with ``affine = (γ, β)`` (shaped to broadcast against
    ``z``, e.g. ``[*lead, 1, V]``) the learned per-head scale and shift ``γ ⊙ LN(z) + β`` of TTT."""
    y = F.layer_norm(z, (z.shape[-1],), eps=_LN_EPS)
    return y if affine is None else torch.addcmul(affine[1], y, affine[0])


def _pre_activation(h: torch.Tensor, W: torch.Tensor, rho: torch.Tensor | None, ndim: int, matmul):
    """One layer's ``z = matmul(h, W)`` with the decay ``rho`` applied to the weights: on the input
    channels (``rho`` per key channel, ``ndim`` dims like the input) or on the output (per token)."""
    hin = h * rho if (rho is not None and rho.ndim == ndim) else h
    z = matmul(hin, W)
    if rho is not None and rho.ndim == ndim - 1:
        z = z * rho[..., None]
    return z


def _per_token_matmul(h: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``h @ W`` with weights shared over tokens (``W: [*lead, in, out]``) or one per token
    (``W: [*lead, L, in, out]``)."""
    if W.ndim == h.ndim + 1:
        return torch.einsum("...ti,...tio->...to", h, W)
    return h @ W


def memory_apply(spec: MemorySpec, weights, x: torch.Tensor, rho: torch.Tensor | None = None, affine=None):
    """``M_W(x)`` for ``x: [*lead, L, in]`` and weights ``[*lead, in, out]`` (shared over tokens) or
    ``[*lead, L, in, out]`` (one per token), ``lead`` being ``[B, H]`` or the flat ``[B·H]`` of the
    chunk form. ``rho`` scales the weights per token (``[*lead, L]``) or per key channel
    (``[*lead, L, K]``, one-layer memories). ``affine``: ``None`` (the parameter-free norm) or the
    norm's ``(γ, β)`` broadcasting against ``[*lead, L, out]`` (used only with ``spec.norm``).
    Returns ``(y, layer_inputs, pre_acts)``.
    """
    h = x
    inputs, zs = [], []
    last = len(weights) - 1
    for i, W in enumerate(weights):
        inputs.append(h)
        z = _pre_activation(h, W, rho, x.ndim, _per_token_matmul)
        zs.append(z)
        h = _act(spec.activation, z) if i < last else z
    y = _ln(h, affine) if spec.norm else h
    if spec.residual:
        y = x + y
    return y, inputs, zs


def objective_grad(spec: MemorySpec, y, v, delta):
    """``∂ℓ/∂y`` of the attentional bias at the memory output ``y``."""
    if spec.objective == "dot":
        return -v
    e = y - v
    if spec.objective == "l2":
        return e
    if spec.objective == "lp":
        return e * (e * e + spec.lp_eps**2).pow(0.5 * spec.p - 1.0)
    d = delta[..., None]
    if spec.huber_mode == "token":  # Miras Eq. 16: ∇ℓ₂ if ‖e‖₂ ≤ δ, else δ ∇ℓ₁ (one switch per token)
        small = torch.linalg.vector_norm(e, dim=-1, keepdim=True) <= d
        return torch.where(small, e, d * torch.sign(e))
    return torch.minimum(torch.maximum(e, -d), d)  # coordinate-wise Huber (Miras Eq. 14)


def objective_value(spec: MemorySpec, y, v, delta):
    """``ℓ(y, v)`` summed over the value dim (the reference differentiates this with autograd)."""
    if spec.objective == "dot":
        return -(y * v).sum(-1)
    e = y - v
    if spec.objective == "l2":
        return 0.5 * (e * e).sum(-1)
    if spec.objective == "lp":
        return ((e * e + spec.lp_eps**2).pow(0.5 * spec.p) / spec.p).sum(-1)
    d = delta[..., None]
    a = e.abs()
    if spec.huber_mode == "token":
        # ½‖e‖² if ‖e‖₂ ≤ δ else δ‖e‖₁: the piecewise objective whose gradient is Miras Eq. 16's step
        small = torch.linalg.vector_norm(e, dim=-1) <= d[..., 0]
        return torch.where(small, 0.5 * (e * e).sum(-1), d[..., 0] * a.sum(-1))
    return torch.where(a <= d, 0.5 * e * e, d * (a - 0.5 * d)).sum(-1)


class _GeluWithGrad(torch.autograd.Function):
    """``(gelu(z), gelu'(z))`` from one ``erf`` and one ``exp`` (exact, erf-based GELU). The chunk
    form needs both (the memory's forward and its inner backward); autograd of the separate ops
    would evaluate ``erf``/``exp`` four more times. Backward:
    ``∂/∂z = g_h · gelu'(z) + g_d · gelu''(z)`` with ``gelu''(z) = φ(z)(2 − z²)``."""

    @staticmethod
    def forward(ctx, z):
        cdf = torch.erf(z * 0.5**0.5).add_(1.0).mul_(0.5)
        pdf = torch.exp(-0.5 * z * z).mul_(1.0 / math.sqrt(2.0 * math.pi))
        h = z * cdf
        d1 = torch.addcmul(cdf, z, pdf)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(d1, pdf.mul_(2.0 - z * z))
        return h, d1

    @staticmethod
    @once_differentiable
    def backward(ctx, g_h, g_d):
        d1, d2 = ctx.saved_tensors
        out = None
        if g_h is not None:
            out = g_h * d1
        if g_d is not None:
            out = g_d * d2 if out is None else out.addcmul_(g_d, d2)
        return out


def _act_with_grad(name: str, z: torch.Tensor):
    """``(act(z), act'(z))``."""
    if name == "gelu":
        return _GeluWithGrad.apply(z)
    return _act(name, z), _act_grad(name, z)


def _grad_factors(spec: MemorySpec, W0, k, v, rho, delta, affine=None):
    """Per-token, per-layer gradient factors at ``W0``: ``G_s = x_s ⊗ δ_s`` for every layer.

    The same function as :func:`memory_apply` followed by the backward of the objective, written
    for the chunk form's flat ``[B·H, L, ·]`` layout (``torch.bmm``, fused activation value and
    slope, the fused layer-norm backward); the token-loop reference differentiates
    :func:`memory_apply` with autograd instead. With the norm's ``affine = (γ, β)``
    (``[B·H, 1, V]``) the output is ``γ ⊙ LN(h) + β`` and the objective's gradient reaches the
    parameter-free norm's backward as ``γ ⊙ ∂ℓ/∂y``."""
    h = k
    inputs, slopes = [], []
    last = len(W0) - 1
    for i, W in enumerate(W0):
        inputs.append(h)
        z = _pre_activation(h, W, rho, k.ndim, torch.bmm)
        if i < last:
            h, slope = _act_with_grad(spec.activation, z)
            slopes.append(slope)
        else:
            h = z
    shape = [h.shape[-1]]
    if spec.norm:
        y, mean, rstd = torch.ops.aten.native_layer_norm(h, shape, None, None, _LN_EPS)
        if affine is not None:
            y = torch.addcmul(affine[1], y, affine[0])
    else:
        y = h
    if spec.residual:
        y = k + y
    dz = objective_grad(spec, y, v, delta)
    if spec.norm:
        if affine is not None:
            dz = dz * affine[0]
        dz = torch.ops.aten.native_layer_norm_backward(
            dz, h, shape, mean, rstd, None, None, [True, False, False]
        )[0]
    deltas = [dz]
    for i in range(last, 0, -1):
        dh = torch.bmm(dz, W0[i].transpose(-1, -2))
        if rho is not None and rho.ndim == k.ndim - 1:
            dh = dh * rho[..., None]
        dz = dh * slopes[i - 1]
        deltas.append(dz)
    return inputs, deltas[::-1]

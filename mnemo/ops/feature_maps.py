"""Kernel feature maps φ for linear attention: ``sim(q, k) = φ(q)ᵀ φ(k)``.

Every map acts on the last dimension and keeps the leading ones. Names accepted by
:func:`resolve_feature_map`: ``"identity"``, ``"elu"`` (``elu + 1``, Katharopoulos et al. 2020),
``"relu"``, ``"taylor"`` (2nd-order Taylor expansion of ``exp``, Based: Arora et al. 2024), or any
callable, e.g. a :class:`FavorPlus` instance (positive random features, Performer: Choromanski et
al. 2021, Lemma 1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["identity", "elu_plus_one", "relu", "taylor", "FavorPlus", "resolve_feature_map", "FEATURE_MAPS"]


def identity(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = x."""
    return x


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020, Eq. 7)."""
    return F.elu(x) + 1.0


def relu(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = max(x, 0)."""
    return F.relu(x)


def taylor(x: torch.Tensor) -> torch.Tensor:
    """Second-order Taylor features ``φ(x) = [1, x, vec(x xᵀ) / √2]`` of size ``1 + K + K²``.

    ``φ(q)ᵀ φ(k) = 1 + qᵀk + (qᵀk)² / 2``, the 2nd-order expansion of ``exp(qᵀk)`` (Based,
    Arora et al. 2024, §3.2). Linear attention applies ``scale`` to ``q`` before the map, so the
    pair estimates ``exp(scale · qᵀk)``, the softmax kernel with the usual temperature.
    """
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) * (0.5**0.5)
    return torch.cat([torch.ones_like(x[..., :1]), x, outer], dim=-1)


def _autocast_off(t: torch.Tensor):
    """A context with autocast off on ``t``'s device type where it is on (else a no-op; a device
    type autocast does not know, e.g. ``meta``, counts as off)."""
    try:
        on = torch.is_autocast_enabled(t.device.type)
    except RuntimeError:
        on = False
    return torch.autocast(t.device.type, enabled=False) if on else contextlib.nullcontext()


class FavorPlus(nn.Module):
    """Positive orthogonal random features (FAVOR+, Choromanski et al. 2021, Lemma 1).

        φ(x) = exp(W x − ‖x‖² / 2) / √m,     E[φ(q)ᵀ φ(k)] = exp(qᵀk)

    ``W: [m, K]`` has rows ``~ N(0, I_K)``, drawn once from ``seed``; with ``orthogonal=True`` the
    rows come in orthogonal blocks of ``K`` with chi-distributed norms (unbiased, lower variance).
    Used by linear attention (which scales ``q`` first), the normalised estimate converges to
    softmax attention as ``num_features`` grows.

    Args:
        head_dim: ``K``, the size of the last dimension of the inputs.
        num_features: ``m``, the number of random features (output size).
        seed: seed of the projection draw (a private ``torch.Generator``; global RNG untouched;
            default ``0``).
        orthogonal: draw orthogonal blocks (default ``True``) or i.i.d. Gaussian rows.
    Raises:
        ValueError: ``head_dim`` or ``num_features`` is not positive, or an input's last dim is
            not ``head_dim``.

    A call maps ``x [..., K]`` to ``[..., m]`` in ``x``'s dtype, computed in float32 (float64 for a
    float64 ``x``) with autocast off and rounded once: a bf16 / fp16 input gets its ``exp`` in
    float32, not of a half-precision exponent.

    ``projection`` (``W``, float64) is a non-persistent buffer: it moves with the module
    (``layer.to(device)``; a layer's feature map is its submodule), so a call on a GPU does not copy
    it from the host each time; it is not saved (the seed redraws it), and a dtype cast of the
    module (``model.to(torch.bfloat16)``) leaves it in float64: each call casts it to the compute
    dtype. Drawn on the CPU (the private generator), then placed on the default device
    (``with torch.device("meta"):`` builds it on ``meta``).
    """

    def __init__(self, head_dim: int, num_features: int, *, seed: int = 0, orthogonal: bool = True):
        if head_dim < 1 or num_features < 1:
            raise ValueError(
                f"head_dim and num_features must be positive, got head_dim={head_dim}, "
                f"num_features={num_features}"
            )
        super().__init__()
        self.head_dim, self.num_features = head_dim, num_features
        self.seed, self.orthogonal = seed, orthogonal
        self.register_buffer("projection", self._draw().to(torch.get_default_device()), persistent=False)

    def _draw(self) -> torch.Tensor:
        """``W [m, K]`` float64 on the CPU, drawn from ``self.seed`` (see the class docstring)."""
        head_dim, num_features = self.head_dim, self.num_features
        cpu = torch.device("cpu")
        gen = torch.Generator().manual_seed(self.seed)
        if self.orthogonal:
            blocks = []
            for _ in range(-(-num_features // head_dim)):
                g = torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64, device=cpu)
                qmat, rmat = torch.linalg.qr(g)
                qmat = qmat * torch.sign(torch.diagonal(rmat))[None, :]  # Haar-distributed (Mezzadri 2007)
                blocks.append(qmat.T)
            w = torch.cat(blocks, 0)[:num_features]
            norms = torch.randn(num_features, head_dim, generator=gen, dtype=torch.float64, device=cpu)
            w = w * norms.norm(dim=-1)[:, None]
        else:
            w = torch.randn(num_features, head_dim, generator=gen, dtype=torch.float64, device=cpu)
        return w

    def _apply(self, fn, recurse=True):
        # move ``projection`` with the module but keep its float64 values through a dtype cast
        # (and off the meta device, ``to_empty`` after a ``with torch.device("meta")`` build, the new
        # buffer is uninitialised memory that ``load_state_dict`` does not fill: redrawn from the seed)
        kept = self.projection
        super()._apply(fn, recurse)
        if kept.is_meta and not self.projection.is_meta:
            self.projection = self._draw().to(self.projection.device)
        elif self.projection.dtype != kept.dtype:
            self.projection = kept.to(self.projection.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"FavorPlus expects inputs with last dim {self.head_dim}, got {x.shape[-1]}")
        # computed in float32 (float64 for float64 input) and rounded once to x's dtype: a bf16 exp
        # of a bf16 exponent was off by up to |W x − ‖x‖²/2| · 2⁻⁸ relative (autocast, which would
        # run the projection in bf16, is off here)
        xc = x if x.dtype in (torch.float32, torch.float64) else x.float()
        w = self.projection.to(device=x.device, dtype=xc.dtype)
        with _autocast_off(x):
            proj = xc @ w.T - 0.5 * (xc * xc).sum(-1, keepdim=True)
            return (proj.exp() / math.sqrt(self.num_features)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_features={self.num_features}"


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": identity,
    "elu": elu_plus_one,
    "elu+1": elu_plus_one,
    "relu": relu,
    "taylor": taylor,
}


def resolve_feature_map(feature_map) -> Callable[[torch.Tensor], torch.Tensor]:
    """``None`` -> identity; a name from :data:`FEATURE_MAPS`; or a callable, returned as is."""
    if feature_map is None:
        return identity
    if callable(feature_map):
        return feature_map
    if isinstance(feature_map, str) and feature_map in FEATURE_MAPS:
        return FEATURE_MAPS[feature_map]
    raise ValueError(
        f"feature_map must be None, a callable or one of {sorted(FEATURE_MAPS)}, got {feature_map!r}"
    )

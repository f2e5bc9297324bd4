"""Delta-rule token mixers: DeltaNet and Gated DeltaNet (memories that overwrite)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops.delta_rule import delta_rule, delta_rule_map, gated_delta_rule
from .base import Mixer, Mixing, check_input, upcast
from .conv import ShortConvolution
from .hooks import HookPoint
from .linear_attention import MatrixState, state_dtypes
from .norm import RMSNorm
from .registry import register_mixer
from .state import spec


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """``y`` with ``softplus(y) = x`` (for ``x > 0``)."""
    return x + torch.log(-torch.expm1(-x))


def init_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, generator=None) -> torch.Tensor:
    """Mamba's Δ bias init: ``Δ ~ LogUniform[dt_min, dt_max]``, bias = softplus⁻¹(Δ)."""
    u = torch.rand(n, generator=generator)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
    return inverse_softplus(dt)


@register_mixer("deltanet")
@register_mixer("gated_deltanet", gated=True)
class DeltaNet(Mixer):
    """DeltaNet layer (Schlag et al. 2021; chunked training: Yang et al. 2024, "Parallelizing Linear
    Transformers with the Delta Rule over Sequence Length") over :func:`mnemo.ops.delta_rule`.

        q, k, v = silu(conv(W x))      q, k ← q/‖q‖, k/‖k‖ per head      β = sigmoid(W_β x)
        S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        y = W_o · gate(RMSNorm(S_tᵀ q_t))

    With ``gated=True`` this is **Gated DeltaNet** (Yang et al. 2024, "Gated Delta Networks"):
    ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`` with the Mamba-2-style decay
    ``log α_t = −exp(A_log) · softplus(W_a x + dt_bias)`` per head.

    Args:
        d_model, n_heads; head_dim: per-head key/value size (default ``d_model // n_heads``).
        short_conv: causal depthwise conv (``conv_size`` taps) + SiLU on q, k, v (default on).
        output_gate: ``RMSNorm(o) ⊙ silu(W_g x)`` before the output projection (default on).
        gated: Gated DeltaNet's decay. mode / chunk_size: op form for ``T > 1``.

    Hook points, as the op gets them: ``hook_q, hook_k`` ``[B, T, H, K]`` (after the conv and the
    L2 normalisation), ``hook_v`` ``[B, T, H, V]``, ``hook_beta`` ``[B, T, H]`` (write strength,
    float32 / float64), ``hook_g`` ``[B, T, H]`` (log decay ``log α``; Gated DeltaNet only),
    ``hook_o`` ``[B, T, H, V]`` (the memory read-out, before the norm and the output gate) and
    ``hook_state`` ``[B, H, K, V]`` (the memory after the call).

    State: :class:`~mnemo.layers.linear_attention.MatrixState` (memory ``[B, H, K, V]`` float32,
    conv tail ``[B, 3 H K, conv_size − 1]``, offset).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        head_dim: int | None = None,
        short_conv: bool = True,
        conv_size: int = 4,
        output_gate: bool = True,
        gated: bool = False,
        mode: str = "chunk",
        chunk_size: int = 64,
    ):
        super().__init__(mode)
        head_dim = head_dim or d_model // n_heads
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.chunk_size, self.gated = chunk_size, gated
        width = 3 * n_heads * head_dim
        self.qkv_proj = nn.Linear(d_model, width, bias=False)
        self.conv = ShortConvolution(width, conv_size) if short_conv else None
        self.beta_proj = nn.Linear(d_model, n_heads, bias=True)
        if gated:
            self.a_proj = nn.Linear(d_model, n_heads, bias=False)
            self.A_log = nn.Parameter(torch.zeros(n_heads))
            self.dt_bias = nn.Parameter(torch.zeros(n_heads))
        self.g_proj = nn.Linear(d_model, n_heads * head_dim, bias=False) if output_gate else None
        self.norm = RMSNorm(head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_beta, self.hook_o, self.hook_state = HookPoint(), HookPoint(), HookPoint()
        if gated:
            self.hook_g = HookPoint()
        self._init_special()

    @property
    def mixing_hooks(self) -> tuple[str, ...]:  # type: ignore[override]
        base = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_o")
        return base + ("hook_g",) if self.gated else base

    def _init_special(self) -> None:
        if self.gated:
            with torch.no_grad():
                self.A_log.copy_(torch.empty(self.n_heads).uniform_(1.0, 16.0).log())
                self.dt_bias.copy_(init_dt_bias(self.n_heads))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """``g = −exp(A_log) · softplus(W_a x + dt_bias)``: ``[B, T, H]`` (Gated DeltaNet only)."""
        return -upcast(self.A_log).exp() * F.softplus(upcast(self.a_proj(x)) + upcast(self.dt_bias))

    def forward(self, x: torch.Tensor, state: MatrixState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        H = self.n_heads
        qkv = self.qkv_proj(x)
        conv_state = None
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, state.conv if state is not None else None)
        else:
            qkv = F.silu(qkv)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b t h d", three=3, h=H)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        beta = self.hook_beta(torch.sigmoid(upcast(self.beta_proj(x))))
        kwargs = dict(
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
            chunk_size=self.chunk_size,
        )
        if self.gated:
            g = self.hook_g(self.log_decay(x))
            o, S = gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
        else:
            o, S = delta_rule(q, k, v, beta, **kwargs)
        o, S = self.hook_o(o), self.hook_state(S)
        o = self.norm(o)
        if self.g_proj is not None:
            o = o * F.silu(rearrange(self.g_proj(x), "b t (h d) -> b t h d", h=H))
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MatrixState(memory=S, conv=conv_state, offset=(state.offset if state else 0) + T)

    def mixing(self, acts: dict) -> Mixing:
        """``M = P A⁻¹ diag(β)`` of the (gated) delta rule's parallel form
        (:func:`~mnemo.ops.delta_rule_map`)."""
        names = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_o")
        q, k, v, beta, o = (acts[n] for n in names)
        g = acts["hook_g"] if self.gated else None
        cd = torch.promote_types(q.dtype, beta.dtype)
        M = delta_rule_map(q.to(cd), k.to(cd), beta.to(cd), None if g is None else g.to(cd))
        return Mixing(M, v.to(cd), o.to(cd))

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> MatrixState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'): the memory ``[B, H, K, V]`` and the conv tail."""
        act, mem = state_dtypes(self, dtype)
        B = batch_size
        return MatrixState(
            memory=spec((B, self.n_heads, self.head_dim, self.head_dim), mem),
            conv=None if self.conv is None else self.conv.state_spec(B, act),
            offset=seq_len,
        )

"""Selective state-space token mixers: Mamba (S6) and Mamba-2 (SSD)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..ops.selective_scan import selective_scan
from ..ops.ssd import ssd
from .base import Mixer, MixerState, check_input, upcast
from .conv import ShortConvolution
from .delta import init_dt_bias
from .norm import RMSNorm


class Mamba(Mixer):
    """Mamba block (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
    Spaces", §3.4 and Alg. 2) over :func:`mnemo.ops.selective_scan`.

        x, z = W_in u                    x ← silu(conv(x))         (dt, B, C) = W_x x
        Δ = softplus(W_dt dt + b_dt)     h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t x_t
        y_t = C_t h_t + D x_t            out = W_out (y ⊙ silu(z))

    ``A = −exp(A_log)`` with the S4D-real init ``A_log[d, n] = log(n + 1)``; ``b_dt`` is the inverse
    softplus of ``Δ ~ LogUniform[1e-3, 1e-1]``; ``W_dt`` uniform in ``±dt_rank^{-1/2}``; ``D = 1``.

    Args:
        d_model; d_state: ``N`` (16); expand: ``d_inner = expand · d_model`` (2); conv_size (4);
        dt_rank: rank of the Δ projection (default ``ceil(d_model / 16)``).
        selective: ``False`` makes Δ, B, C input-independent learned parameters (an LTI SSM, the
            ablation of Mamba §4.1); default ``True``.
        mode / chunk_size: op form for ``T > 1``.

    State: ``MixerState(memory=h [B, d_inner, N] float32, conv=[B, d_inner, conv_size − 1])``.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        expand: int = 2,
        conv_size: int = 4,
        dt_rank: int | None = None,
        selective: bool = True,
        mode: str = "chunk",
        chunk_size: int | None = None,
    ):
        super().__init__(mode)
        self.d_model, self.d_state, self.selective = d_model, d_state, selective
        self.d_inner = expand * d_model
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        self.chunk_size = chunk_size
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=False)
        self.conv = ShortConvolution(self.d_inner, conv_size)
        if selective:
            self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        else:
            self.dt_lti = nn.Parameter(torch.zeros(self.dt_rank))
            self.B_lti = nn.Parameter(torch.zeros(d_state))
            self.C_lti = nn.Parameter(torch.zeros(d_state))
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.d_inner, d_state))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.o_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self._init_special()

    def _init_special(self) -> None:
        with torch.no_grad():
            std = self.dt_rank**-0.5
            self.dt_proj.weight.uniform_(-std, std)
            self.dt_proj.bias.copy_(init_dt_bias(self.d_inner))
            self.A_log.copy_(
                torch.log(torch.arange(1, self.d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1)
            )
            self.D.fill_(1.0)
            if not self.selective:
                self.dt_lti.normal_(0, 1.0)
                self.B_lti.normal_(0, 1.0)
                self.C_lti.normal_(0, 1.0)

    def _kw(self):
        return {} if self.chunk_size is None else {"chunk_size": self.chunk_size}

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *, mode: str | None = None):
        Bsz, T = check_input(x, self.d_model)
        xz = self.in_proj(x)
        u, z = xz.chunk(2, dim=-1)
        u, conv_state = self.conv(u, state.conv if state is not None else None)
        if self.selective:
            dt, Bm, Cm = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        else:
            dt = self.dt_lti.expand(Bsz, T, -1)
            Bm, Cm = self.B_lti.expand(Bsz, T, -1), self.C_lti.expand(Bsz, T, -1)
        delta = F.linear(dt, self.dt_proj.weight)  # the bias is added inside the op (delta_bias)
        y, h = selective_scan(
            u,
            delta,
            -upcast(self.A_log).exp(),
            Bm,
            Cm,
            D=upcast(self.D),
            z=z,
            delta_bias=upcast(self.dt_proj.bias),
            delta_softplus=True,
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
            **self._kw(),
        )
        return self.o_proj(y), MixerState(
            memory=h, conv=conv_state, offset=(state.offset if state else 0) + T
        )

    def state_size_bytes(self, batch_size: int = 1, seq_len: int = 0, dtype_bytes: int = 4) -> int:
        return batch_size * self.d_inner * (self.d_state * 4 + (self.conv.kernel_size - 1) * dtype_bytes)


class Mamba2(Mixer):
    """Mamba-2 block (Dao & Gu 2024, "Transformers are SSMs", §7 and Fig. 6) over
    :func:`mnemo.ops.ssd` (itself gated linear attention with one decay per head).

        z, xBC, dt = W_in u              x, B, C = silu(conv(xBC))
        h_t = exp(Δ_t A_h) h_{t−1} + B_t (Δ_t x_t)ᵀ        y_t = h_tᵀ C_t + D_h x_t
        out = W_out RMSNorm(y ⊙ silu(z))          with Δ = softplus(dt + dt_bias), A_h = −exp(A_log_h)

    Args:
        d_model; d_state: ``N`` (64); head_dim: ``P`` (64, clipped to ``d_inner``); expand (2);
        n_groups: B/C groups shared by heads (1); conv_size (4). ``A ~ U[1, 16]``,
        ``Δ ~ LogUniform[1e-3, 1e-1]`` at init; ``D = 1``.

    State: ``MixerState(memory=h [B, H, N, P] float32, conv=[B, d_inner + 2 G N, conv_size − 1])``.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        head_dim: int = 64,
        expand: int = 2,
        n_groups: int = 1,
        conv_size: int = 4,
        mode: str = "chunk",
        chunk_size: int = 64,
    ):
        super().__init__(mode)
        self.d_model, self.d_state, self.n_groups = d_model, d_state, n_groups
        self.d_inner = expand * d_model
        self.head_dim = min(head_dim, self.d_inner)
        if self.d_inner % self.head_dim:
            raise ValueError(
                f"d_inner = expand * d_model = {self.d_inner} must be a multiple of head_dim {head_dim}"
            )
        self.n_heads = self.d_inner // self.head_dim
        if self.n_heads % n_groups:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_groups ({n_groups})")
        self.chunk_size = chunk_size
        conv_dim = self.d_inner + 2 * n_groups * d_state
        self.in_proj = nn.Linear(d_model, self.d_inner + conv_dim + self.n_heads, bias=False)
        self.conv = ShortConvolution(conv_dim, conv_size)
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.n_heads))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(self.d_inner)
        self.o_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self._init_special()

    def _init_special(self) -> None:
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.n_heads).uniform_(1.0, 16.0).log())
            self.dt_bias.copy_(init_dt_bias(self.n_heads))
            self.D.fill_(1.0)

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *, mode: str | None = None):
        Bsz, T = check_input(x, self.d_model)
        G, N = self.n_groups, self.d_state
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * G * N, self.n_heads], dim=-1)
        xBC, conv_state = self.conv(xBC, state.conv if state is not None else None)
        xs, Bm, Cm = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        y, h = ssd(
            rearrange(xs, "b t (h p) -> b t h p", p=self.head_dim),
            upcast(dt),
            -upcast(self.A_log).exp(),
            rearrange(Bm, "b t (g n) -> b t g n", g=G),
            rearrange(Cm, "b t (g n) -> b t g n", g=G),
            D=upcast(self.D),
            dt_bias=upcast(self.dt_bias),
            dt_softplus=True,
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
            chunk_size=self.chunk_size,
        )
        y = rearrange(y, "b t h p -> b t (h p)")
        y = self.norm(y * F.silu(z))
        return self.o_proj(y), MixerState(
            memory=h, conv=conv_state, offset=(state.offset if state else 0) + T
        )

    def state_size_bytes(self, batch_size: int = 1, seq_len: int = 0, dtype_bytes: int = 4) -> int:
        mem = batch_size * self.n_heads * self.d_state * self.head_dim * 4
        return mem + batch_size * self.conv.channels * (self.conv.kernel_size - 1) * dtype_bytes

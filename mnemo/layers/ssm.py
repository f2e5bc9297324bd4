"""Selective state-space token mixers: Mamba (S6) and Mamba-2 (SSD)."""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common import MODES, check_chunk_size, check_mode, compute_dtype
from ..ops._ssd_chunk import run_ssd_chunk
from ..ops.gated_linear_attention import gated_linear_attention
from ..ops.selective_scan import selective_scan, selective_scan_map
from ..ops.ssd import ssd, ssd_map
from .base import Mixer, Mixing, check_input, check_state_dtype, input_dtype, upcast
from .conv import ShortConvolution
from .delta import init_dt_bias
from .hooks import add_hook_points, before_hook, left_unchanged
from .linear_attention import check_bool, check_int, state_dtypes
from .norm import RMSNorm, check_eps
from .registry import register_mixer
from .state import spec, state_dataclass


@state_dataclass
class MambaState:
    """The state of :class:`Mamba`.

    Attributes:
        ssm: ``h [B, d_inner, N]`` in the compute dtype (float32; float64 for a float64 model);
            ``None`` before the first call.
        conv: the short-convolution tail ``[B, d_inner, conv_size − 1]`` (activation dtype).
        offset: tokens consumed so far (default ``0``).
    """

    ssm: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    offset: int = 0


@state_dataclass
class Mamba2State:
    """The state of :class:`Mamba2`.

    Attributes:
        ssm: ``h [B, H, N, P]`` in the compute dtype (float32; float64 for a float64 model);
            ``None`` before the first call.
        conv: the short-convolution tail ``[B, d_inner + 2 G N, conv_size − 1]`` (activation dtype).
        offset: tokens consumed so far (default ``0``).
    """

    ssm: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    offset: int = 0


def _weightless_rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    """``t / sqrt(mean(t²) + eps)`` over the last dimension, no weight (FalconMamba's norm of dt, B,
    C): computed in at least float32, returned in ``t``'s dtype."""
    return F.rms_norm(upcast(t), (t.shape[-1],), None, eps).to(t.dtype)


@register_mixer("mamba")
class Mamba(Mixer):
    """Mamba block (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
    Spaces", §3.4 and Alg. 2) over :func:`mnemo.ops.selective_scan`.

        x, z = W_in u                    x ← silu(conv(x))         (dt, B, C) = W_x x
        Δ = softplus(W_dt dt + b_dt)     h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t x_t
        y_t = C_t h_t + D x_t            out = W_out (y ⊙ silu(z))

    ``A = −exp(A_log)`` with the S4D-real init ``A_log[d, n] = log(n + 1)``; ``b_dt`` is the inverse
    softplus of ``Δ ~ LogUniform[1e-3, 1e-1]``; ``W_dt`` uniform in ``±dt_rank^{-1/2}``; ``D = 1``.
    ``A_log`` and ``D`` are kept out of weight decay (``no_weight_decay``, as mamba-ssm marks them).

    Args:
        d_model; d_state: ``N`` (default ``d_state=16``); expand: ``d_inner = expand · d_model``
            (default ``expand=2``); conv_size (default ``conv_size=4``);
        dt_rank: rank of the Δ projection (default ``ceil(d_model / 16)``).
        selective: ``False`` makes Δ, B, C input-independent learned parameters (an LTI SSM, the
            ablation of Mamba §4.1; the Δ input, B and C start ``~ N(0, 1)``); default ``True``.
        bias: biases on the input and output projections ``W_in``, ``W_out`` (default ``False``;
            mamba-ssm's ``bias``, transformers' ``use_bias``).
        conv_bias: a bias in the short convolution (default ``True``; mamba-ssm's ``conv_bias``,
            transformers' ``use_conv_bias``).
        bcdt_rms_eps: ``None`` (default: off) or ``ε >= 0``: FalconMamba's weightless RMS
            normalisation of the selective parameters before the scan (Zuo et al. 2024, "Falcon
            Mamba: The First Competitive Attention-free 7B Language Model"; ``transformers``'
            ``FalconMambaMixer``, its config's ``mixer_rms_eps``, 1e-6 there). Each of the Δ input
            ``dt [B, T, dt_rank]`` (before ``W_dt``, so ``Δ = softplus(W_dt dt̂ + b_dt)``), ``B`` and
            ``C`` ``[B, T, N]`` is divided by its root mean square over its last dimension,
            ``t̂ = t / sqrt(mean(t²) + ε)``, with no weight (computed in at least float32, returned in
            the projection's dtype). The normalised values are what every form of the scan, the
            token steps and the hooks ``hook_B`` / ``hook_C`` / ``hook_dt`` see.
        bcdt_norm: ``True`` puts Jamba's RMSNorms *with weights* on the same three (Lieber et al. 2024,
            "Jamba: A Hybrid Transformer-Mamba Language Model", §2: added for training stability at
            scale; ``transformers``' ``JambaMambaMixer``'s ``dt_layernorm``, ``b_layernorm``,
            ``c_layernorm``): ``dt_norm`` over the ``dt_rank`` channels of the Δ input (before
            ``W_dt``), ``b_norm`` and ``c_norm`` over the ``N`` channels of ``B`` and ``C``, each
            ``t̂ = t / sqrt(mean(t²) + norm_eps) · w`` (:class:`~mnemo.layers.norm.RMSNorm`, weights
            initialised to 1; computed in at least float32, returned in the projection's dtype), in
            every form, in the token steps and in what the hooks see, as ``bcdt_rms_eps``. Default
            ``False`` (no such weights: the layer and its state dict are those of a plain Mamba); at
            most one of ``bcdt_norm`` and ``bcdt_rms_eps``.
        norm_eps: the epsilon of those three norms (default ``1e-6``, Jamba's ``rms_norm_eps``); not
            read without ``bcdt_norm``.
        mode / chunk_size: op form for ``T > 1``.

    Hook points, as the scan gets them (``D = d_inner``):

    * ``hook_v`` ``[B, T, D]``: the scanned input ``u = silu(conv(x))`` (the Δ, B, C projections
      read ``u`` before the hook; the ``D`` skip reads it after);
    * ``hook_dt`` ``[B, T, D]``: the step ``Δ = softplus(W_dt dt + b_dt)`` (float32 / float64);
    * ``hook_B``, ``hook_C`` ``[B, T, N]``;
    * ``hook_g`` ``[B, T, D, N]``: the log decay ``Δ A``, built only while a hook is attached; a
      replacement (returned, or made in place on the value passed) is scanned as given (the scan
      then runs as per-channel gated linear attention);
    * ``hook_o`` ``[B, T, D]``: the scan's read-out ``C_t h_t``, before the ``D`` skip and the gate;
    * ``hook_state`` ``[B, D, N]``: ``h`` after the call.

    State: :class:`MambaState` (``ssm``: ``h [B, d_inner, N]`` float32, ``conv``:
    ``[B, d_inner, conv_size − 1]``, ``offset``).

    Raises:
        ValueError: ``d_model``, ``d_state``, ``expand``, ``conv_size`` or ``dt_rank`` is not a
            positive int, ``selective``, ``bias``, ``conv_bias``, ``bcdt_norm`` is not a bool, or
            ``bcdt_rms_eps`` is neither ``None`` nor a finite number ``>= 0``, or ``norm_eps`` is not a
            finite number ``>= 0``, or both ``bcdt_norm`` and ``bcdt_rms_eps`` are set (the message
            names the argument, expected vs received).
    """

    mixing_hooks = ("hook_v", "hook_dt", "hook_B", "hook_C", "hook_o")
    offset_free = True  # no positions: the state alone decides the output
    no_weight_decay = ("A_log", "D")  # (as mamba-ssm: make_optimizer reads it)

    @property
    def map_heads(self) -> int:
        """The map's heads are the ``d_inner`` channels (``hook_o [B, T, D]``)."""
        return self.d_inner

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        expand: int = 2,
        conv_size: int = 4,
        dt_rank: int | None = None,
        selective: bool = True,
        bias: bool = False,
        conv_bias: bool = True,
        mode: str = "chunk",
        chunk_size: int | None = None,
        bcdt_rms_eps: float | None = None,
        bcdt_norm: bool = False,
        norm_eps: float = 1e-6,
    ):
        super().__init__(mode)
        for name, value in (("d_model", d_model), ("d_state", d_state), ("expand", expand)):
            check_int(name, value)
        check_int("dt_rank", dt_rank, optional=True)
        check_int("conv_size", conv_size)
        for name, value in (
            ("selective", selective), ("bias", bias), ("conv_bias", conv_bias), ("bcdt_norm", bcdt_norm),
        ):  # fmt: skip
            check_bool(name, value)  # (a config's "False" string switched by truthiness)
        check_eps("norm_eps", norm_eps, "mean(t²) of dt, B and C in bcdt_norm's RMSNorms")
        if bcdt_norm and bcdt_rms_eps is not None:
            raise ValueError(
                f"bcdt_norm: expected False with bcdt_rms_eps = {bcdt_rms_eps!r} (FalconMamba's weightless "
                "norm; Jamba's norms with weights are bcdt_norm: at most one of the two), got True"
            )
        check_mode(mode, MODES)
        if chunk_size is not None:
            check_chunk_size(chunk_size)
        if bcdt_rms_eps is not None:
            check_eps("bcdt_rms_eps", bcdt_rms_eps, "mean(t²) of dt, B and C; None: no normalisation")
            bcdt_rms_eps = float(bcdt_rms_eps)
        self.bcdt_rms_eps = bcdt_rms_eps
        self.d_model, self.d_state, self.selective = d_model, d_state, selective
        self.d_inner = expand * d_model
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        self.chunk_size = chunk_size
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias)
        self.conv = ShortConvolution(self.d_inner, conv_size, bias=conv_bias)
        if selective:
            self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        else:
            self.dt_lti = nn.Parameter(torch.zeros(self.dt_rank))
            self.B_lti = nn.Parameter(torch.zeros(d_state))
            self.C_lti = nn.Parameter(torch.zeros(d_state))
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.bcdt_norm, self.norm_eps = bcdt_norm, float(norm_eps)
        if bcdt_norm:  # Jamba's weighted RMSNorms on the Δ input, B, C (only then: old state dicts load)
            self.dt_norm = RMSNorm(self.dt_rank, self.norm_eps)
            self.b_norm = RMSNorm(d_state, self.norm_eps)
            self.c_norm = RMSNorm(d_state, self.norm_eps)
        self.A_log = nn.Parameter(torch.zeros(self.d_inner, d_state))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.o_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        add_hook_points(self, "v", "dt", "B", "C", "g", "o", "state")
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

    def extra_repr(self) -> str:
        if self.bcdt_norm:
            return f"bcdt_norm=True, norm_eps={self.norm_eps}"
        return "" if self.bcdt_rms_eps is None else f"bcdt_rms_eps={self.bcdt_rms_eps}"

    def forward(self, x: torch.Tensor, state: MambaState | None = None, *, mode: str | None = None):
        Bsz, T = check_input(x, self.d_model, dtype=input_dtype(self.in_proj))
        check_state_dtype(state, self, fast_weights=True)  # (a float64 one came back float64)
        u, z = self.in_proj(x).chunk(2, dim=-1)
        u, conv_state = self.conv(u, state.conv if state is not None else None)
        if self.selective:
            dt, Bm, Cm = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        else:
            dt = self.dt_lti.expand(Bsz, T, -1)
            Bm, Cm = self.B_lti.expand(Bsz, T, -1), self.C_lti.expand(Bsz, T, -1)
        if self.bcdt_rms_eps is not None:  # FalconMamba: before W_dt and the scan, in every form
            dt, Bm, Cm = (_weightless_rms(t, self.bcdt_rms_eps) for t in (dt, Bm, Cm))
        elif self.bcdt_norm:  # Jamba: the same place, RMSNorms with weights
            dt, Bm, Cm = self.dt_norm(dt), self.b_norm(Bm), self.c_norm(Cm)
        delta = F.softplus(upcast(F.linear(dt, self.dt_proj.weight)) + upcast(self.dt_proj.bias))
        u, delta = self.hook_v(u), self.hook_dt(delta)
        Bm, Cm = self.hook_B(Bm), self.hook_C(Cm)
        A = -upcast(self.A_log).exp()
        h0 = state.ssm if state is not None else None
        g = None
        if self.hook_g.active:  # any hook of its own: forward, pre-forward, backward (gradients flow via g)
            g0 = delta[..., None] * A  # [B, T, D, N]
            mark = before_hook(g0)
            g = self.hook_g(g0)
            # only read (the same tensor, unchanged): the scan forms Δ A itself; a hook that edited
            # it in place (its version counter moved) replaced it, as one that returned a new tensor
            # (under torch.inference_mode, where there is no counter, a copy tells)
            g = None if left_unchanged(g0, g, mark) else g
        if g is None:
            o, h = selective_scan(
                u,
                delta,
                A,
                Bm,
                Cm,
                initial_state=h0,
                output_final_state=True,
                mode=self._mode(T, mode),
                **self._kw(),
            )
        else:
            o, h = self._scan_with_log_decay(u, delta, g, Bm, Cm, h0, self._mode(T, mode))
        o, h = self.hook_o(o), self.hook_state(h)
        y = (upcast(o) + upcast(u) * upcast(self.D)) * F.silu(upcast(z))
        return self.o_proj(y.to(z.dtype)), MambaState(
            ssm=h, conv=conv_state, offset=(state.offset if state else 0) + T
        )

    def _scan_with_log_decay(self, u, delta, g, Bm, Cm, h0, mode: str):
        """The scan with a given log decay ``g [B, T, D, N]`` (a replaced ``hook_g``): gated linear
        attention with one head per channel, ``q = C``, ``k = B``, ``v = Δ u``, scale 1."""
        cd = compute_dtype(u, delta, g, Bm, Cm)
        Dm = self.d_inner
        q = Cm.to(cd)[:, :, None, :].expand(-1, -1, Dm, -1)
        k = Bm.to(cd)[:, :, None, :].expand(-1, -1, Dm, -1)
        v = (delta.to(cd) * u.to(cd))[..., None]
        o, S = gated_linear_attention(
            q,
            k,
            v,
            g.to(cd),
            scale=1.0,
            initial_state=None if h0 is None else h0[..., None],
            output_final_state=True,
            mode=mode,
        )
        return o[..., 0].to(u.dtype), S[..., 0]

    def mixing(self, acts: dict) -> Mixing:
        """Heads are the ``d_inner`` channels (``V = 1``); the ``D`` skip is left out
        (:func:`~mnemo.ops.selective_scan_map`)."""
        u, dt, Bm, Cm, o = (acts[n] for n in self.mixing_hooks)
        cd = torch.promote_types(u.dtype, dt.dtype)
        A = -self.A_log.to(cd).exp()
        M = selective_scan_map(dt.to(cd), A, Bm.to(cd), Cm.to(cd))
        return Mixing(M, u.to(cd)[..., None], o.to(cd)[..., None])

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> MambaState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'); independent of ``seq_len``. Defaults: ``batch_size=1``,
        ``seq_len=0``."""
        act, mem = state_dtypes(self, dtype)
        return MambaState(
            ssm=spec((batch_size, self.d_inner, self.d_state), mem),
            conv=self.conv.state_spec(batch_size, act),
            offset=seq_len,
        )


class GroupRMSNorm(RMSNorm):
    """:class:`~mnemo.layers.norm.RMSNorm` over each of ``groups`` contiguous groups of the last
    dimension on its own (one weight over all of it): ``y_g = x_g / sqrt(mean(x_g²) + eps)``, then
    ``y · weight``. ``groups = 1`` is the plain RMSNorm. Computed in at least float32, returned in
    ``x``'s dtype. Defaults: ``eps=1e-5``, ``groups=1``."""

    def __init__(self, dim: int, eps: float = 1e-5, groups: int = 1):
        super().__init__(dim, eps)
        if not isinstance(groups, numbers.Integral) or isinstance(groups, bool) or groups < 1 or dim % groups:
            raise ValueError(f"groups: expected an int >= 1 dividing dim ({dim}), got {groups!r}")
        self.groups = groups

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, groups={self.groups}"


@register_mixer("mamba2")
class Mamba2(Mixer):
    """Mamba-2 block (Dao & Gu 2024, "Transformers are SSMs", §7 and Fig. 6) over
    :func:`mnemo.ops.ssd` (itself gated linear attention with one decay per head).

        z, xBC, dt = W_in u              x, B, C = silu(conv(xBC))
        h_t = exp(Δ_t A_h) h_{t−1} + B_t (Δ_t x_t)ᵀ        y_t = h_tᵀ C_t + D_h x_t
        out = W_out GroupRMSNorm(y ⊙ silu(z))     with Δ = clamp(softplus(dt + dt_bias), dt_limit),
                                                       A_h = −exp(A_log_h)

    ``GroupRMSNorm`` normalises each of ``n_groups`` contiguous groups of ``d_inner / n_groups``
    channels on its own (as mamba-ssm's ``RMSNormGated(group_size=d_inner / ngroups)`` and
    transformers' ``MambaRMSNormGated``), then scales by one weight over ``d_inner``.

    Args:
        d_model; d_state: ``N`` (default ``d_state=64``); head_dim: ``P`` (default ``head_dim=64``,
            clipped to ``d_inner``); expand (default ``expand=2``);
        n_groups: B/C groups shared by heads (default ``1``); conv_size (default ``conv_size=4``).
            ``A ~ U[1, 16]``, ``Δ ~ LogUniform[1e-3, 1e-1]`` at init; ``D = 1``.
        bias: biases on the input and output projections (default ``False``; mamba-ssm's ``bias``,
            transformers' ``use_bias``).
        conv_bias: a bias in the short convolution (default ``True``; ``conv_bias`` /
            ``use_conv_bias``).
        dt_limit: ``(min, max)``: Δ is clamped to this range after the softplus, in every form and in
            token steps alike (mamba-ssm's ``dt_limit``, transformers' ``time_step_limit``); default
            ``(0, inf)``, no clamp.
        D_has_hdim: ``D`` per channel, shape ``[d_inner]`` (``y_t = h_tᵀ C_t + D ⊙ x_t`` per head
            channel) instead of one per head ``[n_heads]`` (default ``False``; mamba-ssm's
            ``D_has_hdim``).
        norm_before_gate: ``True`` computes ``GroupRMSNorm(y) ⊙ silu(z)`` instead of
            ``GroupRMSNorm(y ⊙ silu(z))`` (default ``False``, mamba-ssm's Mamba2 default).
        norm_eps: epsilon of the gated norm (default ``1e-5``).
        norm_groups: groups of the gated norm (default ``None``: ``n_groups``, the original model);
            ``1`` normalises over all of ``d_inner``, which is what mnemo did for ``n_groups > 1``
            before it followed the original (kept to load such checkpoints).
        mode / chunk_size: op form for ``T > 1`` and its chunk length (default ``chunk_size=64``).

    The recurrence is gated linear attention with ``q = C``, ``k = B``, ``v = Δ x``, ``g = Δ A`` and
    scale 1 (what :func:`~mnemo.ops.ssd` computes), so that each hook below is what the recurrence
    consumes. The chunk form calls :func:`~mnemo.ops.ssd` (its backend table: mamba-ssm's kernel
    on CUDA where installed, else SSD's grouped kernel :mod:`mnemo.ops._ssd_chunk`: ``B``, ``C``
    once per group, safe for any decay; while a hook on ``hook_g`` replaces the log decay, the
    grouped kernel with it); while a hook on ``hook_B`` / ``hook_C`` replaces its
    value, and in the other forms, :func:`~mnemo.ops.gated_linear_attention` runs on the per-head
    values. Hook points (``H`` heads of size ``P``):

    * ``hook_v`` ``[B, T, H, P]``: ``x`` per head (after conv + SiLU);
    * ``hook_dt`` ``[B, T, H]``: ``Δ = clamp(softplus(dt + dt_bias), dt_limit)`` (float32 / float64);
    * ``hook_B``, ``hook_C`` ``[B, T, H, N]``: per head (groups repeated);
    * ``hook_g`` ``[B, T, H]``: the log decay ``Δ A``;
    * ``hook_o`` ``[B, T, H, P]``: ``h_tᵀ C_t``, before the ``D`` skip, the gate and the norm;
    * ``hook_state`` ``[B, H, N, P]``: ``h`` after the call.

    State: :class:`Mamba2State` (``ssm``: ``h [B, H, N, P]`` float32, ``conv``:
    ``[B, d_inner + 2 G N, conv_size − 1]``, ``offset``).

    Raises:
        ValueError: a size argument (``d_model``, ``d_state``, ``head_dim``, ``expand``,
            ``n_groups``, ``conv_size``) is not a positive int, or the sizes do not divide (``head_dim`` into
            ``d_inner``, ``n_groups`` into the heads, ``norm_groups`` into ``d_inner``), or a bad
            ``dt_limit`` (not two numbers ``min <= max``) or ``norm_eps`` (negative, not finite), or a
            flag (``bias``, ``conv_bias``, ``D_has_hdim``, ``norm_before_gate``) that is not a bool; the
            message names the argument.
    """

    mixing_hooks = ("hook_v", "hook_dt", "hook_B", "hook_C", "hook_o")
    offset_free = True  # no positions: the state alone decides the output
    no_weight_decay = ("A_log", "dt_bias", "D")  # (as mamba-ssm: make_optimizer reads it)

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        head_dim: int = 64,
        expand: int = 2,
        n_groups: int = 1,
        conv_size: int = 4,
        bias: bool = False,
        conv_bias: bool = True,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        D_has_hdim: bool = False,
        norm_before_gate: bool = False,
        norm_eps: float = 1e-5,
        norm_groups: int | None = None,
        mode: str = "chunk",
        chunk_size: int = 64,
    ):
        super().__init__(mode)
        for name, value in (("d_model", d_model), ("d_state", d_state), ("head_dim", head_dim)):
            check_int(name, value)
        for name, value in (("expand", expand), ("n_groups", n_groups), ("conv_size", conv_size)):
            check_int(name, value)
        check_mode(mode, MODES)
        check_chunk_size(chunk_size)
        self.d_model, self.d_state, self.n_groups = d_model, d_state, n_groups
        try:
            lo, hi = (float(v) for v in dt_limit)
        except (TypeError, ValueError):
            lo = hi = math.nan
        if not lo <= hi:
            raise ValueError(f"dt_limit: expected (min, max) with min <= max, got {dt_limit!r}")
        check_eps("norm_eps", norm_eps)
        for name, value in (
            ("bias", bias),
            ("conv_bias", conv_bias),
            ("D_has_hdim", D_has_hdim),
            ("norm_before_gate", norm_before_gate),
        ):
            check_bool(name, value)  # (bool("False") is True: a config's string flipped the option)
        self.dt_limit = (lo, hi)
        self.D_has_hdim, self.norm_before_gate = D_has_hdim, norm_before_gate
        self.norm_groups = n_groups if norm_groups is None else norm_groups
        self.d_inner = expand * d_model
        self.head_dim = min(head_dim, self.d_inner)
        if self.d_inner % self.head_dim:
            raise ValueError(
                f"d_inner = expand * d_model = {self.d_inner} must be a multiple of head_dim {head_dim}"
            )
        self.n_heads = self.d_inner // self.head_dim
        if self.n_heads % n_groups:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_groups ({n_groups})")
        if isinstance(self.norm_groups, bool) or not isinstance(self.norm_groups, numbers.Integral):
            raise ValueError(f"norm_groups: expected an int >= 1 or None, got {norm_groups!r}")
        if self.norm_groups < 1 or self.d_inner % self.norm_groups:
            raise ValueError(f"norm_groups ({self.norm_groups}) must divide d_inner ({self.d_inner})")
        self.chunk_size = chunk_size
        conv_dim = self.d_inner + 2 * n_groups * d_state
        self.in_proj = nn.Linear(d_model, self.d_inner + conv_dim + self.n_heads, bias=bias)
        self.conv = ShortConvolution(conv_dim, conv_size, bias=conv_bias)
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.n_heads))
        self.D = nn.Parameter(torch.ones(self.d_inner if self.D_has_hdim else self.n_heads))
        self.norm = GroupRMSNorm(self.d_inner, norm_eps, groups=self.norm_groups)
        self.o_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        add_hook_points(self, "v", "dt", "B", "C", "g", "o", "state")
        self._init_special()

    def _init_special(self) -> None:
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.n_heads).uniform_(1.0, 16.0).log())
            self.dt_bias.copy_(init_dt_bias(self.n_heads))
            self.D.fill_(1.0)

    def forward(self, x: torch.Tensor, state: Mamba2State | None = None, *, mode: str | None = None):
        Bsz, T = check_input(x, self.d_model, dtype=input_dtype(self.in_proj))
        check_state_dtype(state, self, fast_weights=True)  # (a float64 one came back float64)
        G, N, H = self.n_groups, self.d_state, self.n_heads
        z, xBC, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * G * N, H], dim=-1)
        xBC, conv_state = self.conv(xBC, state.conv if state is not None else None)
        xs, Bm, Cm = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        xs = xs.unflatten(-1, (H, self.head_dim))  # [B, T, H, P]
        Bg, Cg = Bm.unflatten(-1, (G, N)), Cm.unflatten(-1, (G, N))  # [B, T, G, N]
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias))
        if self.dt_limit != (0.0, math.inf):
            dt = dt.clamp(self.dt_limit[0], self.dt_limit[1])
        xs, dt = self.hook_v(xs), self.hook_dt(dt)
        # B, C go to the grouped chunk form as they are (one per group); per head (repeated) only for
        # the hooks and the other forms. A hook that replaces B or C per head sends the call to gated
        # linear attention with the replacements.
        # (a hook that returns its value after changing it in place also replaces it: the tensor's
        # version counter says so)
        grouped, Bm, Cm = True, None, None
        if self.hook_B.hooked or self.hook_C.hooked:
            Bh, Ch = (t.repeat_interleave(H // G, dim=2) for t in (Bg, Cg))  # head h: group h // (H/G)
            marks = (before_hook(Bh), before_hook(Ch))
            Bm, Cm = self.hook_B(Bh), self.hook_C(Ch)
            grouped = left_unchanged(Bh, Bm, marks[0]) and left_unchanged(Ch, Cm, marks[1])
        A = -upcast(self.A_log).exp()
        g_raw = dt * A
        g_mark = before_hook(g_raw) if self.hook_g.hooked else None
        g = self.hook_g(g_raw)
        g_given = not self.hook_g.hooked or left_unchanged(g_raw, g, g_mark)
        mode = self._mode(T, mode)
        h0 = state.ssm if state is not None else None
        if grouped and mode == "chunk" and xs.numel() and Bg.numel():
            cd = compute_dtype(xs, dt, g, Bg, Cg)
            if g_given:  # the op's backend table (mamba-ssm's kernel on CUDA, fed x in its dtype)
                o, h = ssd(
                    xs, dt, A, Bg, Cg, initial_state=h0, output_final_state=True, chunk_size=self.chunk_size
                )
            else:  # a hook replaced the log decay: the grouped chunk form with it
                o, h = run_ssd_chunk(Cg, Bg, xs.to(cd) * dt.to(cd)[..., None], g, h0, self.chunk_size)
        else:
            if Bm is None:
                Bm, Cm = (t.repeat_interleave(H // G, dim=2) for t in (Bg, Cg))
            cd = compute_dtype(xs, dt, g, Bm, Cm)
            o, h = gated_linear_attention(
                Cm.to(cd),
                Bm.to(cd),
                xs.to(cd) * dt.to(cd)[..., None],
                g.to(cd),
                scale=1.0,
                initial_state=h0,
                output_final_state=True,
                mode=mode,
                chunk_size=self.chunk_size,
            )
        o, h = self.hook_o(o), self.hook_state(h)
        D = upcast(self.D).to(cd)
        D = D.view(H, self.head_dim) if self.D_has_hdim else D[:, None]
        # y stays in the compute dtype into the norm (which computes in it), rounded once after it: bf16
        # rounded y and then the norm's output (up to 2 unit roundoffs off, one when rounded once)
        y = o.to(cd) + xs.to(cd) * D
        y = self._gated_norm(y.flatten(-2), z).to(z.dtype)
        return self.o_proj(y), Mamba2State(ssm=h, conv=conv_state, offset=(state.offset if state else 0) + T)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``GroupRMSNorm(y ⊙ silu(z))``, or ``GroupRMSNorm(y) ⊙ silu(z)`` with ``norm_before_gate``
        (one fused kernel: :func:`~mnemo.layers.norm.gated_rms_norm`)."""
        return self.norm.gated(y, z, gate_first=not self.norm_before_gate)

    def mixing(self, acts: dict) -> Mixing:
        """Per head: ``M_ts = (C_t · B_s) exp(Σ_{r=s+1..t} Δ_r A) Δ_s`` (:func:`~mnemo.ops.ssd_map`),
        values ``x``; the ``D`` skip is left out."""
        xs, dt, Bm, Cm, o = (acts[n] for n in self.mixing_hooks)
        cd = torch.promote_types(xs.dtype, dt.dtype)
        M = ssd_map(dt.to(cd), -self.A_log.to(cd).exp(), Bm.to(cd), Cm.to(cd))
        return Mixing(M, xs.to(cd), o.to(cd))

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> Mamba2State:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'); independent of ``seq_len``. Defaults: ``batch_size=1``,
        ``seq_len=0``."""
        act, mem = state_dtypes(self, dtype)
        return Mamba2State(
            ssm=spec((batch_size, self.n_heads, self.d_state, self.head_dim), mem),
            conv=self.conv.state_spec(batch_size, act),
            offset=seq_len,
        )

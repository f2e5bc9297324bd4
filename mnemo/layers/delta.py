"""Delta-rule token mixers: DeltaNet, Gated DeltaNet, Kimi Delta Attention (memories that overwrite)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common import MODES, check_chunk_size, check_mode
from ..ops._layout import rearrange
from ..ops.delta_rule import delta_rule, delta_rule_map, gated_delta_rule
from .base import Mixer, Mixing, check_input, check_state_dtype, input_dtype, upcast
from .conv import ShortConvolution
from .hooks import HookPoint
from .linear_attention import MatrixState, check_bool, check_heads, check_int, state_dtypes
from .norm import RMSNorm, check_eps
from .registry import register_mixer
from .state import spec


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """``y`` with ``softplus(y) = x`` (for ``x > 0``)."""
    return x + torch.log(-torch.expm1(-x))


def init_dt_bias(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, generator=None) -> torch.Tensor:
    """Mamba's Δ bias init: ``Δ ~ LogUniform[dt_min, dt_max]``, bias = softplus⁻¹(Δ). Defaults:
    ``dt_min=1e-3``, ``dt_max=0.1`` (Mamba's)."""
    u = torch.rand(n, generator=generator)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
    return inverse_softplus(dt)


def l2_normalize(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """``x / ‖x‖`` over the last dimension: ``F.normalize`` (``x / max(‖x‖, 1e-12)``) when ``eps``
    is ``None`` or ``0`` (``x / sqrt(Σ x²)`` itself would turn a zero vector, e.g. a padded token,
    into NaN), else ``x / sqrt(Σ x² + eps)`` (the form of the Gated DeltaNet reference code and of
    Qwen3-Next, ``eps = 1e-6``). Computed in at least float32 and rounded once to ``x``'s dtype (as
    fla's ``l2norm``): bf16 rounded each square, the sum and the inverse norm on their own, which left
    the unit keys of the delta rule up to 0.5% off length one (0.16% rounded once)."""
    xc = upcast(x)
    if eps is None or eps == 0:
        return F.normalize(xc, dim=-1).to(x.dtype)
    return (xc * torch.rsqrt(xc.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


@register_mixer("deltanet")
@register_mixer("gated_deltanet", gated=True)
class DeltaNet(Mixer):
    """DeltaNet layer (Schlag et al. 2021; chunked training: Yang et al. 2024, "Parallelizing Linear
    Transformers with the Delta Rule over Sequence Length") over :func:`mnemo.ops.delta_rule`.

        q, k, v = silu(conv(W x))      q, k ← q/‖q‖, k/‖k‖ per head      β = sigmoid(W_β x)
        S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        y = W_o · gate(RMSNorm(S_tᵀ q_t K^{-1/2}))

    The read-out scales ``q`` by ``K^{-1/2}`` (the ops' default ``scale``, as fla's layers; the
    papers write ``S_tᵀ q_t``): the RMSNorm after it takes the factor away but for its ``eps``.

    With ``gated=True`` this is **Gated DeltaNet** (Yang et al. 2024, "Gated Delta Networks"):
    ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`` with the Mamba-2-style decay
    ``log α_t = −exp(A_log) · softplus(W_a x + dt_bias)`` per (value) head. Initialisation:
    ``exp(A_log) ~ U[1, 16]`` (Mamba-2's range; a deviation: the reference code, fla's
    ``GatedDeltaNet`` and Qwen3-Next draw ``U[0, 16]``, the paper does not say) and ``dt_bias`` the
    inverse softplus of ``Δ ~ LogUniform[1e-3, 1e-1]`` (as the reference code).

    Args:
        d_model, n_heads: model width; query/key heads ``H_k`` (default ``n_heads=4``).
        head_dim: per-head key size ``K`` and, unless ``value_head_dim`` is given, value size
            (default ``d_model // n_heads``).
        value_head_dim: per-head value size ``V`` (default ``head_dim``). The reference code
            (fla's ``expand_v = 2``) and Qwen3-Next use other widths than the keys'; the default
            keeps ``V = K`` (the paper's equations do not fix it).
        n_v_heads: value heads ``H_v`` (default ``n_heads``), a multiple of ``n_heads``: grouped
            value heads, as in Qwen3-Next — key/query head ``h`` serves the ``H_v / H_k``
            consecutive value heads ``h·G … h·G + G − 1``; β, the decay, the memory, the output
            norm and gate are per value head.
        short_conv: causal depthwise conv (``conv_size`` taps) + SiLU on q, k, v (default ``True``;
            default ``conv_size=4``).
        conv_bias: a bias in that conv (default ``True``, as before; neither the paper's reference code
            nor Qwen3-Next has one).
        beta_bias: a bias in ``W_β`` (default ``True``, as before; neither the reference nor Qwen3-Next
            has one).
        allow_neg_eigval: ``β = 2 · sigmoid(W_β x) ∈ (0, 2)``, so the transition
            ``I − β k kᵀ`` may have a negative eigenvalue (Grazzi et al. 2024); default ``False``
            (``β ∈ (0, 1)``, the paper's).
        qk_norm_eps: ``None`` (default, as before) or ``0``: ``F.normalize``
            (``x / max(‖x‖, 1e-12)``, so a zero vector stays zero); a float ``> 0``:
            ``x / sqrt(Σx² + eps)`` (the reference code and Qwen3-Next use ``1e-6``; the paper writes
            the exact L2 normalisation).
        output_gate: ``RMSNorm(o) ⊙ silu(W_g x)`` per value head before the output projection
            (default ``True``; with grouped heads this is Qwen3-Next's gated norm, ``W_g`` = its ``z``).
        norm_eps: the output RMSNorm's epsilon (default ``1e-5``, as before; Qwen3-Next: its
            ``rms_norm_eps``, ``1e-6``). Its weight multiplies directly (not zero-centred).
        gated: Gated DeltaNet's decay (default ``False``). mode / chunk_size: op form for ``T > 1``
            (default ``chunk_size=64``).

    Hook points, as the op gets them (with grouped heads q and k are already repeated to the
    ``H = H_v`` value heads): ``hook_q, hook_k`` ``[B, T, H, K]`` (after the conv and the L2
    normalisation), ``hook_v`` ``[B, T, H, V]``, ``hook_beta`` ``[B, T, H]`` (write strength,
    float32 / float64), ``hook_g`` ``[B, T, H]`` (log decay ``log α``; Gated DeltaNet only),
    ``hook_o`` ``[B, T, H, V]`` (the memory read-out, before the norm and the output gate) and
    ``hook_state`` ``[B, H, K, V]`` (the memory after the call).

    State: :class:`~mnemo.layers.linear_attention.MatrixState` (memory ``[B, H_v, K, V]`` float32,
    conv tail ``[B, 2 H_k K + H_v V, conv_size − 1]`` — channels ``[q | k | v]``, offset).
    Raises:
        ValueError: a head count or size that is not a positive int (or ``d_model < n_heads``
            without a ``head_dim``), ``n_v_heads`` not a multiple of ``n_heads``, or a bad
            ``qk_norm_eps`` or ``norm_eps`` (negative, not finite), or a flag (``short_conv``,
            ``output_gate``, ``gated``, ``conv_bias``, ``beta_bias``, ``allow_neg_eigval``) that is not
            a bool; the message names the argument.
    """

    offset_free = True  # no positions: the state alone decides the output
    no_weight_decay = ("A_log", "dt_bias")  # (as fla: make_optimizer reads it)

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
        *,
        value_head_dim: int | None = None,
        n_v_heads: int | None = None,
        conv_bias: bool = True,
        beta_bias: bool = True,
        allow_neg_eigval: bool = False,
        qk_norm_eps: float | None = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__(mode)
        check_heads(d_model, n_heads, head_dim)
        check_int("value_head_dim", value_head_dim, optional=True)
        check_int("n_v_heads", n_v_heads, optional=True)
        check_mode(mode, MODES)
        check_chunk_size(chunk_size)
        head_dim = head_dim or d_model // n_heads
        value_head_dim = value_head_dim or head_dim
        n_v_heads = n_v_heads or n_heads
        if n_v_heads % n_heads:
            raise ValueError(f"n_v_heads ({n_v_heads}) must be a multiple of n_heads ({n_heads})")
        if qk_norm_eps is not None:
            check_eps("qk_norm_eps", qk_norm_eps, "Σx²")  # (inf made every q and k zero; True passed)
        check_eps("norm_eps", norm_eps)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.n_v_heads, self.value_head_dim = n_v_heads, value_head_dim
        self.chunk_size, self.gated = chunk_size, gated
        self.allow_neg_eigval, self.qk_norm_eps = allow_neg_eigval, qk_norm_eps
        key_width, value_width = n_heads * head_dim, n_v_heads * value_head_dim
        self.key_width, self.value_width = key_width, value_width
        width = 2 * key_width + value_width
        self.qkv_proj = nn.Linear(d_model, width, bias=False)
        for name, value in (
            ("short_conv", short_conv),
            ("output_gate", output_gate),
            ("gated", gated),
            ("conv_bias", conv_bias),
            ("beta_bias", beta_bias),
            ("allow_neg_eigval", allow_neg_eigval),
        ):
            check_bool(name, value)
        if short_conv:
            check_int("conv_size", conv_size)
        self.conv = ShortConvolution(width, conv_size, bias=conv_bias) if short_conv else None
        self.beta_proj = nn.Linear(d_model, n_v_heads, bias=beta_bias)
        if gated:
            self.a_proj = nn.Linear(d_model, n_v_heads, bias=False)
            self.A_log = nn.Parameter(torch.zeros(n_v_heads))
            self.dt_bias = nn.Parameter(torch.zeros(n_v_heads))
        self.g_proj = nn.Linear(d_model, value_width, bias=False) if output_gate else None
        self.norm = RMSNorm(value_head_dim, norm_eps)
        self.o_proj = nn.Linear(value_width, d_model, bias=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_beta, self.hook_o, self.hook_state = HookPoint(), HookPoint(), HookPoint()
        if gated:
            self.hook_g = HookPoint()
        self._init_special()

    @property
    def map_heads(self) -> int:
        """The map's heads are the value heads ``H_v`` (``n_v_heads``; a key head serves
        ``H_v / H`` of them): what ``hook_v``, ``hook_beta``, ``hook_o`` carry on axis 2."""
        return self.n_v_heads

    @property
    def mixing_hooks(self) -> tuple[str, ...]:  # type: ignore[override]
        base = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_o")
        return base + ("hook_g",) if self.gated else base

    def _init_special(self) -> None:
        if self.gated:
            with torch.no_grad():
                self.A_log.copy_(torch.empty(self.n_v_heads).uniform_(1.0, 16.0).log())
                self.dt_bias.copy_(init_dt_bias(self.n_v_heads))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """``g = −exp(A_log) · softplus(W_a x + dt_bias)``: ``[B, T, H_v]`` (Gated DeltaNet only)."""
        return -upcast(self.A_log).exp() * F.softplus(upcast(self.a_proj(x)) + upcast(self.dt_bias))

    def write_strength(self, x: torch.Tensor) -> torch.Tensor:
        """``β = sigmoid(W_β x)`` (``2 · sigmoid`` with ``allow_neg_eigval``): ``[B, T, H_v]``."""
        beta = torch.sigmoid(upcast(self.beta_proj(x)))
        return 2 * beta if self.allow_neg_eigval else beta

    def forward(self, x: torch.Tensor, state: MatrixState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.qkv_proj))
        check_state_dtype(state, self, fast_weights=True)
        qkv = self.qkv_proj(x)
        conv_state = None
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, state.conv if state is not None else None)
        else:
            qkv = F.silu(qkv)
        q, k, v = qkv.split((self.key_width, self.key_width, self.value_width), dim=-1)
        q = rearrange(q, "b t (h d) -> b t h d", h=self.n_heads)
        k = rearrange(k, "b t (h d) -> b t h d", h=self.n_heads)
        v = rearrange(v, "b t (h d) -> b t h d", h=self.n_v_heads)
        q, k = l2_normalize(q, self.qk_norm_eps), l2_normalize(k, self.qk_norm_eps)
        G = self.n_v_heads // self.n_heads
        if G > 1:
            q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        beta = self.hook_beta(self.write_strength(x))
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
        if self.g_proj is not None:
            o = self.norm.gated(o, rearrange(self.g_proj(x), "b t (h d) -> b t h d", h=self.n_v_heads))
        else:
            o = self.norm(o)
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MatrixState(memory=S, conv=conv_state, offset=(state.offset if state else 0) + T)

    def mixing(self, acts: dict) -> Mixing:
        """``M = P A⁻¹ diag(β)`` of the (gated) delta rule's parallel form
        (:func:`~mnemo.ops.delta_rule_map`), per value head."""
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
        default the parameters'): the memory ``[B, H_v, K, V]`` and the conv tail. Defaults:
        ``batch_size=1``, ``seq_len=0``."""
        act, mem = state_dtypes(self, dtype)
        B = batch_size
        return MatrixState(
            memory=spec((B, self.n_v_heads, self.head_dim, self.value_head_dim), mem),
            conv=None if self.conv is None else self.conv.state_spec(B, act),
            offset=seq_len,
        )


@register_mixer("kda")
class KimiDeltaAttention(Mixer):
    """Kimi Delta Attention (KDA; Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
    Architecture", arXiv 2510.26692, §3: the recurrence, its per-channel forget gate and output gate;
    ``transformers``' ``KimiLinearDeltaAttention``, fla's ``KimiDeltaAttention``) over
    :func:`mnemo.ops.gated_delta_rule` with a per-channel decay ``g [B, T, H, K]``.

    For a token ``x`` (``[d_model]``), per head ``h`` (``H = n_heads`` heads of ``K = head_dim``
    channels; keys and values have the same width):

        q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))    (one causal depthwise
                                                     conv per channel of [q | k | v], no bias)
        q ← q / ‖q‖, k ← k / ‖k‖ per head        β_t = sigmoid(W_β x)                 ([H], no bias)
        g_t = log α_t = −exp(A_log) · softplus(W_f↑ W_f↓ x + dt_bias)     ([H, K]: one decay per key
                                                     channel, low rank ``gate_rank``; A_log per head)
        S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (K^{-1/2} q_t)
        y = W_o [sigmoid(W_g↑ W_g↓ x) ⊙ RMSNorm(o_t)]                    (RMSNorm per head, weight [K])

    The read-out scales ``q`` by ``K^{-1/2}`` (the ops' default ``scale``; ``transformers`` and fla
    do the same, the paper writes ``S_tᵀ q_t``). The decay comes first, then the prediction error, as
    in Gated DeltaNet: with ``S' = Diag(α_t) S_{t−1}``, ``S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ``. The
    L2 normalisation is ``x / sqrt(Σx² + qk_norm_eps)`` (``transformers``' ``l2norm`` and fla's
    kernel: ``1e-6``). The softplus is PyTorch's (``x`` itself above 20, as ``transformers``').

    Initialisation (with :meth:`mnemo.models.LanguageModel.reset_parameters`): every projection
    Normal(0, ``init_std``) (fla's and ``transformers``' Normal(0, ``initializer_range``); ``W_o``'s
    std divided by ``sqrt(2 · n_layers)`` is mnemo's rule for every mixer); ``exp(A_log) ~ U[1, 16]``
    and ``dt_bias`` = softplus⁻¹ of ``Δ ~ LogUniform[1e-3, 1e-1]`` per channel (fla's
    ``KDAPreTrainedModel._init_weights`` and ``transformers``' ``KimiLinearForgetGate`` init); the
    output norm's weight ones. Ours: the conv taps keep :class:`~mnemo.layers.ShortConvolution`'s
    Kaiming-uniform init (PyTorch's ``Conv1d`` default, as every mnemo mixer's conv; fla and
    ``transformers`` redraw them Normal(0, ``initializer_range``)).

    Args:
        d_model, n_heads: model width; heads ``H`` (default ``n_heads=4``).
        head_dim: ``K``, the key and value size per head (default ``d_model // n_heads``; Kimi
            Linear: 128).
        gate_rank: the inner width of the low-rank decay ``W_f↑ W_f↓`` and output gate
            ``W_g↑ W_g↓`` (default ``head_dim``, as Kimi Linear and fla).
        conv_size: taps of the short convolution (default ``4``).
        output_gate_bias: a bias on ``W_g↑`` (default ``False``: Kimi Linear's checkpoints and
            ``transformers``; fla's layer has one).
        qk_norm_eps: the L2 normalisation's epsilon (default ``1e-6``); ``0`` or ``None`` is
            ``F.normalize`` (``x / max(‖x‖, 1e-12)``).
        norm_eps: the output RMSNorm's epsilon (default ``1e-5``: fla's; ``transformers`` reads
            ``rms_norm_eps``).
        mode: ``"chunk"`` (default, training) | ``"parallel"`` | ``"recurrent"`` for ``T > 1``
            (one token always runs the recurrent step); chunk_size: the chunk form's chunk
            (default ``chunk_size=64``).

    Parameters (``transformers`` ``KimiLinearDeltaAttention`` name in brackets): ``q_proj``,
    ``k_proj``, ``v_proj`` (same), ``conv.weight [3 H K, 1, W]`` (``conv1d.weight``, channels
    ``[q | k | v]``), ``f_a_proj``, ``f_b_proj``, ``A_log [H]``, ``dt_bias [H K]``
    (``forget_gate.f_a_proj``, ``forget_gate.f_b_proj``, ``forget_gate.A_log [1, 1, H, 1]``,
    ``forget_gate.dt_bias``), ``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm.weight [K]``,
    ``o_proj`` (same). ``f_a_proj`` / ``g_a_proj`` are ``W_f↓`` / ``W_g↓`` (``d_model → gate_rank``),
    ``f_b_proj`` / ``g_b_proj`` are ``W_f↑`` / ``W_g↑`` (``gate_rank → H K``), ``b_proj`` is ``W_β``.

    Hook points: ``hook_q, hook_k`` ``[B, T, H, K]`` (after the conv and the L2 normalisation),
    ``hook_v`` ``[B, T, H, K]``, ``hook_beta`` ``[B, T, H]`` and ``hook_g`` ``[B, T, H, K]`` (the log
    decay per key channel; both in at least float32), ``hook_o`` ``[B, T, H, K]`` (the read-out
    before the norm and the gate), ``hook_state`` ``[B, H, K, K]`` (the memory after the call).

    State: :class:`~mnemo.layers.linear_attention.MatrixState` (memory ``[B, H, K, K]`` float32,
    float64 for a float64 layer; conv tail ``[B, 3 H K, conv_size − 1]``; offset).

    Raises:
        ValueError: a head count or size (``head_dim``, ``gate_rank``, ``conv_size``) that is not a
            positive int (or ``d_model < n_heads`` without a ``head_dim``), a bad ``mode`` or
            ``chunk_size``, ``qk_norm_eps`` / ``norm_eps`` negative or not finite, or
            ``output_gate_bias`` not a bool; the message names the argument. At call time: ``x``
            not ``[B, T, d_model]`` or of another dtype than the weights, a state of another dtype.
    """

    offset_free = True  # no positions: the state alone decides the output
    no_weight_decay = ("A_log", "dt_bias")  # (as fla: make_optimizer reads it)
    mixing_hooks = ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_g", "hook_o")

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        head_dim: int | None = None,
        conv_size: int = 4,
        mode: str = "chunk",
        chunk_size: int = 64,
        *,
        gate_rank: int | None = None,
        output_gate_bias: bool = False,
        qk_norm_eps: float | None = 1e-6,
        norm_eps: float = 1e-5,
    ):
        super().__init__(mode)
        check_heads(d_model, n_heads, head_dim)
        check_int("gate_rank", gate_rank, optional=True)
        check_int("conv_size", conv_size)
        check_mode(mode, MODES)
        check_chunk_size(chunk_size)
        check_bool("output_gate_bias", output_gate_bias)
        if qk_norm_eps is not None:
            check_eps("qk_norm_eps", qk_norm_eps, "Σx²")
        check_eps("norm_eps", norm_eps)
        H = n_heads
        K = head_dim or d_model // n_heads
        rank = gate_rank or K
        self.d_model, self.n_heads, self.head_dim, self.gate_rank = d_model, H, K, rank
        self.chunk_size, self.qk_norm_eps = chunk_size, qk_norm_eps
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, H * K, bias=False)
        self.v_proj = nn.Linear(d_model, H * K, bias=False)
        self.conv = ShortConvolution(3 * H * K, conv_size, bias=False)
        self.f_a_proj = nn.Linear(d_model, rank, bias=False)
        self.f_b_proj = nn.Linear(rank, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.g_a_proj = nn.Linear(d_model, rank, bias=False)
        self.g_b_proj = nn.Linear(rank, H * K, bias=output_gate_bias)
        self.o_norm = RMSNorm(K, norm_eps)
        self.o_proj = nn.Linear(H * K, d_model, bias=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_beta, self.hook_g = HookPoint(), HookPoint()
        self.hook_o, self.hook_state = HookPoint(), HookPoint()
        self._init_special()

    def _init_special(self) -> None:
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.n_heads).uniform_(1.0, 16.0).log())
            self.dt_bias.copy_(init_dt_bias(self.n_heads * self.head_dim))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """``g = log α = −exp(A_log) · softplus(W_f↑ W_f↓ x + dt_bias)``: ``[B, T, H, K]`` (at least
        float32)."""
        f = upcast(self.f_b_proj(self.f_a_proj(x))) + upcast(self.dt_bias)
        f = rearrange(f, "b t (h d) -> b t h d", h=self.n_heads)
        return -upcast(self.A_log).exp()[:, None] * F.softplus(f)

    def forward(self, x: torch.Tensor, state: MatrixState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.q_proj))
        check_state_dtype(state, self, fast_weights=True)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv, conv_state = self.conv(qkv, state.conv if state is not None else None)
        q, k, v = (rearrange(t, "b t (h d) -> b t h d", h=self.n_heads) for t in qkv.chunk(3, dim=-1))
        q, k = l2_normalize(q, self.qk_norm_eps), l2_normalize(k, self.qk_norm_eps)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        beta = self.hook_beta(torch.sigmoid(upcast(self.b_proj(x))))
        g = self.hook_g(self.log_decay(x))
        o, S = gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
            chunk_size=self.chunk_size,
        )
        o, S = self.hook_o(o), self.hook_state(S)
        gate = rearrange(self.g_b_proj(self.g_a_proj(x)), "b t (h d) -> b t h d", h=self.n_heads)
        # the norm and the gate in at least float32, rounded once (as transformers' KimiLinearRMSNormGated)
        o = (self.o_norm(upcast(o)) * torch.sigmoid(upcast(gate))).to(x.dtype)
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MatrixState(memory=S, conv=conv_state, offset=(state.offset if state else 0) + T)

    def mixing(self, acts: dict) -> Mixing:
        """``M = P A⁻¹ diag(β)`` of the gated delta rule's parallel form with the per-channel decays
        (:func:`~mnemo.ops.delta_rule_map`), per head."""
        q, k, v, beta, g, o = (acts[n] for n in self.mixing_hooks)
        cd = torch.promote_types(q.dtype, beta.dtype)
        M = delta_rule_map(q.to(cd), k.to(cd), beta.to(cd), g.to(cd))
        return Mixing(M, v.to(cd), o.to(cd))

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> MatrixState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'): the memory ``[B, H, K, K]`` and the conv tail. Defaults:
        ``batch_size=1``, ``seq_len=0``."""
        act, mem = state_dtypes(self, dtype)
        K = self.head_dim
        return MatrixState(
            memory=spec((batch_size, self.n_heads, K, K), mem),
            conv=self.conv.state_spec(batch_size, act),
            offset=seq_len,
        )

"""Linear-attention token mixers: plain (kernelised) and gated (RetNet, GLA)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._common import MODES, check_chunk_size, check_mode
from ..ops._layout import rearrange
from ..ops.feature_maps import FavorPlus, resolve_feature_map
from ..ops.gated_linear_attention import gated_linear_attention, gated_linear_attention_map
from ..ops.linear_attention import linear_attention, linear_attention_map
from .base import Mixer, Mixing, buffer_dtype, check_input, check_state_dtype, input_dtype, off_meta, upcast
from .conv import ShortConvolution
from .hooks import HookPoint
from .norm import RMSNorm, check_eps
from .registry import register_mixer
from .rotary import RotaryEmbedding
from .state import spec, state_dataclass


@state_dataclass
class MatrixState:
    """The state of a matrix-memory mixer (linear attention, GLA / RetNet, DeltaNet).

    Attributes:
        memory: the matrix memory ``[B, H, K, V]`` in the compute dtype (float32; float64 for a
            float64 model); ``None`` before the first call.
        conv: the short-convolution tail ``[B, C, W − 1]`` (activation dtype), or ``None`` when the
            mixer has no short convolution.
        offset: tokens consumed so far (positions for rotary embeddings; default ``0``).

    A mixer given a state whose floating entries are float64 against its non-float64 weights, or
    not float64 against float64 weights, raises ``ValueError`` naming the entry
    (:func:`~mnemo.layers.base.check_state_dtype`; the op would compute in float64 and return a
    float64 state); a float32 memory in a bf16 mixer is what the mixer makes itself, and passes.
    """

    memory: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    offset: int = 0


def retnet_log_gamma(n_heads: int) -> torch.Tensor:
    """RetNet's fixed per-head log decays ``log γ_h = log(1 − 2^{−5−h})``, ``h < n_heads`` (Sun et al.
    2023, §2.2), ``[n_heads]`` float64."""
    return torch.log1p(-(2.0 ** (-5.0 - torch.arange(n_heads, dtype=torch.float64))))


def check_bool(name: str, value) -> None:
    """Raise ``ValueError`` naming the constructor argument ``name`` unless ``value`` is a bool (a
    config's ``"False"`` string, or ``0``/``1`` from a file, would otherwise switch by truthiness)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_int(name: str, value, minimum: int = 1, *, optional: bool = False) -> None:
    """Raise ``ValueError`` naming the constructor argument ``name`` with the expected and the received
    value unless ``value`` is an int ``>= minimum`` (or ``None`` with ``optional=True``). Defaults:
    ``minimum=1``, ``optional=False``."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        expected = f"{'None or ' if optional else ''}an int >= {minimum}"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def check_heads(d_model: int, n_heads: int, head_dim: int | None) -> None:
    """The head arguments of a multi-head mixer: ``n_heads >= 1``, ``head_dim`` ``None`` or ``>= 1``,
    and without a ``head_dim`` at least one channel per head (``d_model // n_heads >= 1``)."""
    check_int("d_model", d_model)
    check_int("n_heads", n_heads)
    check_int("head_dim", head_dim, optional=True)
    if head_dim is None and d_model < n_heads:
        raise ValueError(
            f"d_model: {d_model} is smaller than n_heads = {n_heads}, so each head would have "
            f"head_dim = d_model // n_heads = 0 dimensions; give d_model >= n_heads (or fewer heads)"
        )


def state_dtypes(module: nn.Module, dtype: torch.dtype | None = None) -> tuple[torch.dtype, torch.dtype]:
    """``(activation dtype, memory dtype)`` of ``module``'s state: ``dtype`` (default: its
    parameters') for caches and conv tails, and the ops' compute dtype for recurrent memories
    (float64 for float64 activations, else float32)."""
    if dtype is None:
        p = next(module.parameters(), None)
        dtype = p.dtype if p is not None else torch.get_default_dtype()
    return dtype, (torch.float64 if dtype == torch.float64 else torch.float32)


class _QKVMixer(Mixer):
    """Shared q/k/v projection (+ optional short causal conv) of the matrix-memory mixers, and
    their hook points ``hook_q, hook_k: [B, T, H, K]``, ``hook_v, hook_o: [B, T, H, V]``,
    ``hook_state: [B, H, K', V']`` (float32). State: :class:`MatrixState`."""

    mixing_hooks = ("hook_q", "hook_k", "hook_v", "hook_o")

    def __init__(self, d_model, n_heads, key_dim, value_dim, short_conv, conv_size, mode, chunk_size):
        super().__init__(mode)
        check_mode(mode, MODES)
        check_chunk_size(chunk_size)
        self.d_model, self.n_heads, self.key_dim, self.value_dim = d_model, n_heads, key_dim, value_dim
        self.chunk_size = chunk_size
        width = n_heads * (2 * key_dim + value_dim)
        self.qkv_proj = nn.Linear(d_model, width, bias=False)
        check_bool("short_conv", short_conv)
        if short_conv:
            check_int("conv_size", conv_size)
        self.conv = ShortConvolution(width, conv_size) if short_conv else None
        self.o_proj = nn.Linear(n_heads * value_dim, d_model, bias=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_o, self.hook_state = HookPoint(), HookPoint()

    def _qkv(self, x, state):
        qkv = self.qkv_proj(x)
        conv_state = None
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, state.conv if state is not None else None)
        H, K = self.n_heads, self.key_dim
        q, k, v = qkv.split([H * K, H * K, H * self.value_dim], dim=-1)
        q = rearrange(q, "b t (h d) -> b t h d", h=H)
        k = rearrange(k, "b t (h d) -> b t h d", h=H)
        v = rearrange(v, "b t (h d) -> b t h d", h=H)
        return q, k, v, conv_state

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> MatrixState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'): the matrix memory and the conv tail; independent of ``seq_len``."""
        act, mem = state_dtypes(self, dtype)
        B, H = batch_size, self.n_heads
        return MatrixState(
            memory=spec((B, H, self._state_key_dim(), self._state_value_dim()), mem),
            conv=None if self.conv is None else self.conv.state_spec(B, act),
            offset=seq_len,
        )

    def _state_key_dim(self) -> int:
        return self.key_dim

    def _state_value_dim(self) -> int:
        return self.value_dim


@register_mixer("linear_attention")
class LinearAttention(_QKVMixer):
    """Linear attention layer (Katharopoulos et al. 2020) over :func:`mnemo.ops.linear_attention`.

    Args:
        d_model, n_heads; head_dim: key and value size per head (default ``d_model // n_heads``;
            default ``n_heads=4``). ``n_heads=None`` with a ``head_dim`` takes ``d_model // head_dim``
            heads (a fixed head size at every width, e.g. Based's feature size 16).
        feature_map: ``"identity"``, ``"elu"`` (default), ``"relu"``, ``"taylor"`` or ``"favor"``
            (FAVOR+ with ``num_features`` random features, default ``2 · head_dim``, fixed by
            ``seed``, default ``seed=0``).
        normalize: divide by ``φ(q)ᵀ Σ φ(k)`` (the original formula; default ``True``). As in the
            op, ``q`` is scaled by ``head_dim ** -0.5`` *before* ``φ`` (the paper has no scale: with
            ``"elu"`` and ``normalize`` this is ``φ(q / √K)``, not a constant factor on ``φ(q)``).
        short_conv: causal depthwise conv (``conv_size`` taps) + SiLU on q, k, v (default ``False``;
            default ``conv_size=4``).
        output_norm: per-head RMSNorm of the read-out before the output projection (default
            ``True``).
        mode: ``"chunk"`` | ``"parallel"`` | ``"recurrent"`` for ``T > 1``; chunk_size for chunk
            (default ``chunk_size=64``).

    Hook points: ``hook_q, hook_k`` ``[B, T, H, K]`` (before the feature map), ``hook_v, hook_o``
    ``[B, T, H, V]``, ``hook_state`` ``[B, H, F, V + normalize]`` (feature size ``F``).

    State: :class:`MatrixState` (memory ``[B, H, F, V + normalize]``, conv tail, offset).

    Raises ``ValueError`` naming the argument for a size (``num_features`` too) that is not a
    positive int, a ``seed`` that is not an int, or a flag (``normalize``, ``short_conv``,
    ``output_norm``) that is not a bool.
    """

    offset_free = True  # no positions: the state alone decides the output

    def __init__(
        self,
        d_model: int,
        n_heads: int | None = 4,
        head_dim: int | None = None,
        feature_map: str = "elu",
        normalize: bool = True,
        short_conv: bool = False,
        conv_size: int = 4,
        output_norm: bool = True,
        num_features: int | None = None,
        seed: int = 0,
        mode: str = "chunk",
        chunk_size: int = 64,
    ):
        check_bool("normalize", normalize)
        check_bool("output_norm", output_norm)
        # (num_features=0 was read as "not given" and became 2 · head_dim; a float or a string seed
        # failed inside torch without the argument's name)
        check_int("num_features", num_features, optional=True)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed: expected an int (the seed of FAVOR+'s projection), got {seed!r}")
        if n_heads is None:
            check_int("d_model", d_model)
            check_int("head_dim", head_dim)  # (a negative one gave n_heads < 0, named as n_heads)
            if d_model % head_dim:
                raise ValueError(f"n_heads=None needs a head_dim dividing d_model {d_model}, got {head_dim}")
            n_heads = d_model // head_dim
        check_heads(d_model, n_heads, head_dim)
        head_dim = head_dim or d_model // n_heads
        super().__init__(d_model, n_heads, head_dim, head_dim, short_conv, conv_size, mode, chunk_size)
        self.normalize = normalize
        self.feature_map_name = feature_map
        if feature_map == "favor":
            self.feature_map = FavorPlus(head_dim, num_features or 2 * head_dim, seed=seed)
        else:
            self.feature_map = resolve_feature_map(feature_map)
        self.norm = RMSNorm(head_dim) if output_norm else None

    def _state_key_dim(self) -> int:
        if isinstance(self.feature_map, FavorPlus):  # (its projection may live on another device)
            return self.feature_map.num_features
        return self.feature_map(torch.zeros(1, self.key_dim)).shape[-1]

    def _state_value_dim(self) -> int:
        return self.value_dim + int(self.normalize)

    def forward(self, x: torch.Tensor, state: MatrixState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.qkv_proj))
        check_state_dtype(state, self, fast_weights=True)
        q, k, v, conv_state = self._qkv(x, state)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)  # before the feature map
        o, S = linear_attention(
            q,
            k,
            v,
            feature_map=self.feature_map,
            normalize=self.normalize,
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
            chunk_size=self.chunk_size,
        )
        o, S = self.hook_o(o), self.hook_state(S)
        if self.norm is not None:
            o = self.norm(o)
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MatrixState(memory=S, conv=conv_state, offset=(state.offset if state else 0) + T)

    def mixing(self, acts: dict) -> Mixing:
        """``M_ts = φ(q_t / √K)ᵀ φ(k_s)`` (normalised by its row sum with ``normalize``;
        :func:`~mnemo.ops.linear_attention_map`), in at least float32 as the op computes it (a bf16
        ``φ``, e.g. FAVOR+'s ``exp``, and a bf16 map were up to 6x one rounding off)."""
        q, k, v, o = (upcast(acts[n]) for n in self.mixing_hooks)
        return Mixing(linear_attention_map(q, k, self.feature_map, self.normalize), v, o)


@register_mixer("gla", gate="gla")
@register_mixer("retnet", gate="retnet", expand_k=1.0, expand_v=2.0)
@register_mixer("gated_linear_attention")
class GatedLinearAttention(_QKVMixer):
    """Gated linear attention layer over :func:`mnemo.ops.gated_linear_attention`.

    ``gate`` selects where the log decay ``g`` comes from:

    * ``"retnet"``: fixed per-head decays ``γ_h = 1 − 2^{−5−h}`` (RetNet, Sun et al. 2023, §2.2),
      ``g = log γ_h`` for every token (a float32 buffer; float64 after ``.double()`` or when built
      under ``torch.set_default_dtype(torch.float64)``); rotary positions on q/k (``rope``, on by
      default here; the key size per head must then be even): RoPE's frequencies ``10000^{−2i/K}``
      (the paper's ``e^{inθ}`` leaves ``θ`` open; the authors' code spaces the exponents as
      ``linspace(0, 1, K/2)`` instead).
    * ``"gla"``: data-dependent per-channel gates ``g = logsigmoid(W₂ W₁ x + b) / τ`` with a
      low-rank (``gate_rank``) projection and ``τ = gate_normalizer`` (GLA, Yang et al. 2023, §4.4).
    * ``"scalar"``: data-dependent per-head gates ``g = logsigmoid(W x + b) / τ`` (Mamba-2-style
      scalar decay).

    The read-out is ``o_proj(RMSNorm(o) ⊙ silu(W_r x))`` (output gate, as in RetNet and GLA), with
    ``o_t = S_tᵀ q_t K^{-1/2}``, ``S_t = exp(g_t) ⊙ S_{t−1} + k_t v_tᵀ`` (``g_t`` per key row or per
    head; the op's default ``scale`` ``K^{-1/2}``, as fla's layers; the GLA paper writes
    ``S_tᵀ q_t``): the RMSNorm takes the factor away but for its ``eps``.
    Key/value sizes per head are ``expand_k · d_model / H`` and ``expand_v · d_model / H``. The
    registered ``"retnet"`` preset takes the paper's sizes (Sun et al. 2023, §3.1: ``W_Q, W_K`` are
    ``d × d``, ``W_V, W_G`` are ``d × 2d``, ``W_O`` is ``2d × d``): ``expand_k=1.0``,
    ``expand_v=2.0``, so ``8 d²`` projection weights (the paper halves the FFN to ``2d`` to match a
    Transformer's ``12 d²`` per block; the FFN is the model's choice here). Its RMSNorm per head
    stands where the paper has a GroupNorm (which also subtracts the mean). The preset had
    ``expand_v=1.0`` before: a checkpoint of that width is rebuilt with ``mixer_options={"retnet":
    {"expand_v": 1.0}}`` (``LanguageModel.from_pretrained`` adds it when the saved config names no
    ``expand_v`` and the weights have the old width; a training run resumed is not rebuilt so).

    Defaults: ``n_heads=4``, ``expand_k=0.5``, ``expand_v=1.0``, ``short_conv=False``,
    ``conv_size=4``, ``gate_rank=16``, ``gate_normalizer=16.0``, ``chunk_size=64``,
    ``norm_eps=1e-5`` (and ``gate="gla"``, ``mode="chunk"``; ``short_conv``, ``conv_size``, ``mode``,
    ``chunk_size`` as in :class:`LinearAttention`). ``norm_eps`` is the epsilon of the read-out's
    RMSNorm (``1e-5`` as before; flash-linear-attention's ``GLAForCausalLM`` and
    ``RetNetForCausalLM`` pass their config's ``norm_eps``, ``1e-6`` by default, to their
    ``FusedRMSNormGated``: :mod:`mnemo.hf.fla_hub`).

    Hook points: ``hook_q, hook_k`` ``[B, T, H, K]`` (after rotary positions, as the op gets them),
    ``hook_v, hook_o`` ``[B, T, H, V]``, ``hook_g`` (log decay, ``[B, T, H]`` for ``retnet`` and
    ``scalar``, ``[B, T, H, K]`` for ``gla``), ``hook_state`` ``[B, H, K, V]``.

    State: :class:`MatrixState` (memory ``[B, H, K, V]``, conv tail, offset).

    Raises ``ValueError`` naming the argument for a bad size, ``gate``, ``expand_k`` / ``expand_v`` /
    ``gate_normalizer`` (not a finite number > 0), a ``norm_eps`` that is not a finite number
    ``>= 0``, or a ``short_conv`` / ``rope`` that is not a bool (``rope`` may be ``None``: on for
    ``retnet``).
    """

    mixing_hooks = ("hook_q", "hook_k", "hook_v", "hook_g", "hook_o")

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        gate: str = "gla",
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        short_conv: bool = False,
        conv_size: int = 4,
        gate_rank: int = 16,
        gate_normalizer: float = 16.0,
        rope: bool | None = None,
        mode: str = "chunk",
        chunk_size: int = 64,
        *,
        norm_eps: float = 1e-5,
    ):
        if gate not in ("gla", "retnet", "scalar"):
            raise ValueError(f"gate must be one of ('gla', 'retnet', 'scalar'), got {gate!r}")
        check_int("d_model", d_model)
        check_int("n_heads", n_heads)
        check_int("gate_rank", gate_rank)
        for name, value in (
            ("expand_k", expand_k),
            ("expand_v", expand_v),
            ("gate_normalizer", gate_normalizer),
        ):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value <= 0:
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        key_dim = max(1, int(d_model * expand_k) // n_heads)
        value_dim = max(1, int(d_model * expand_v) // n_heads)
        super().__init__(d_model, n_heads, key_dim, value_dim, short_conv, conv_size, mode, chunk_size)
        self.gate, self.gate_normalizer = gate, gate_normalizer
        if gate == "gla":
            self.gate_proj = nn.Sequential(
                nn.Linear(d_model, gate_rank, bias=False), nn.Linear(gate_rank, n_heads * key_dim, bias=True)
            )
        elif gate == "scalar":
            self.gate_proj = nn.Linear(d_model, n_heads, bias=True)
        else:
            self.register_buffer("log_gamma", retnet_log_gamma(n_heads).to(buffer_dtype()), persistent=False)
        if rope is not None:
            check_bool("rope", rope)  # (the string "False" turned rotary positions on)
        rope = (gate == "retnet") if rope is None else rope
        if rope and key_dim % 2:
            raise ValueError(
                f"expand_k: rotary positions need an even key size per head, got max(1, int(d_model · "
                f"expand_k) // n_heads) = max(1, int({d_model} · {expand_k}) // {n_heads}) = {key_dim}"
            )
        self.rotary = RotaryEmbedding(key_dim) if rope else None
        self.out_gate = nn.Linear(d_model, n_heads * value_dim, bias=False)
        check_eps("norm_eps", norm_eps)
        self.norm = RMSNorm(value_dim, norm_eps)
        self.hook_g = HookPoint()

    def _apply(self, fn, recurse=True):
        # move RetNet's fixed log decays with the module, but keep them in float32 through
        # a cast to half precision (bf16 would round log γ by up to 0.4%; the learned gates are
        # computed in float32 too); a float64 module gets log γ computed in float64, not the
        # float32-rounded value cast up (off by up to 1e-9 per token), and a cast back float32's
        # (as RotaryEmbedding's frequencies: a cast to half precision keeps the values as they are)
        # (and off the meta device, ``to_empty`` after a ``with torch.device("meta")`` build, the new
        # buffer is uninitialised memory that ``load_state_dict`` does not fill: recomputed)
        kept = getattr(self, "log_gamma", None)
        super()._apply(fn, recurse)
        if kept is not None:
            new = self.log_gamma
            materialised = kept.is_meta and not new.is_meta
            with off_meta():  # (on the CPU inside a ``with torch.device("meta")`` block)
                fresh = retnet_log_gamma(self.n_heads)
            if new.dtype not in (torch.float32, torch.float64):
                src = fresh if materialised else kept
                self.log_gamma = src.to(new.device, torch.float32)
            elif new.dtype != kept.dtype or materialised:
                self.log_gamma = fresh.to(new.device, new.dtype)
        return self

    @property
    def offset_free(self) -> bool:  # type: ignore[override]
        """Without rotary positions the state alone decides the output."""
        return self.rotary is None

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """The log gates ``g`` for input ``x [B, T, d_model]``: ``[B, T, H]`` or ``[B, T, H, K]``."""
        B, T, _ = x.shape
        if self.gate == "retnet":
            return self.log_gamma.to(x.device)[None, None, :].expand(B, T, -1)
        if self.gate == "gla":
            g = F.logsigmoid(upcast(self.gate_proj(x))) / self.gate_normalizer
            return rearrange(g, "b t (h k) -> b t h k", h=self.n_heads)
        return F.logsigmoid(upcast(self.gate_proj(x))) / self.gate_normalizer

    def forward(self, x: torch.Tensor, state: MatrixState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.qkv_proj))
        check_state_dtype(state, self, fast_weights=True)
        offset = state.offset if state is not None else 0
        q, k, v, conv_state = self._qkv(x, state)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        q, k, v, g = self.hook_q(q), self.hook_k(k), self.hook_v(v), self.hook_g(self.log_decay(x))
        o, S = gated_linear_attention(
            q,
            k,
            v,
            g,
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
            chunk_size=self.chunk_size,
        )
        o, S = self.hook_o(o), self.hook_state(S)
        o = self.norm.gated(o, rearrange(self.out_gate(x), "b t (h d) -> b t h d", h=self.n_heads))
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MatrixState(memory=S, conv=conv_state, offset=offset + T)

    def forward_packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor, *, mode: str | None = None):
        """Packed documents in one call of the op (``cu_seqlens``) and a packed short conv; with
        rotary positions (RetNet), one call per document (positions restart per document)."""
        if self.rotary is not None or (mode or self.mode) == "recurrent":
            return super().forward_packed(x, cu_seqlens, mode=mode)
        check_input(x, self.d_model, dtype=input_dtype(self.qkv_proj))
        qkv = self.qkv_proj(x)
        qkv = self.conv.forward_packed(qkv, cu_seqlens) if self.conv is not None else qkv
        H, K = self.n_heads, self.key_dim
        q, k, v = (
            rearrange(t, "b t (h d) -> b t h d", h=H)
            for t in qkv.split([H * K, H * K, H * self.value_dim], dim=-1)
        )
        q, k, v, g = self.hook_q(q), self.hook_k(k), self.hook_v(v), self.hook_g(self.log_decay(x))
        o, _ = gated_linear_attention(
            q, k, v, g, cu_seqlens=cu_seqlens, mode=mode or self.mode, chunk_size=self.chunk_size
        )
        o = self.hook_o(o)
        o = self.norm.gated(o, rearrange(self.out_gate(x), "b t (h d) -> b t h d", h=self.n_heads))
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))

    def mixing(self, acts: dict) -> Mixing:
        """``M_ts = K^{-1/2} Σ_k q_tk k_sk exp(Σ_{s<r≤t} g_rk)`` for ``s ≤ t``
        (:func:`~mnemo.ops.gated_linear_attention_map`), in at least float32 as the op computes it
        (from a bf16 layer's hook values the map was bf16)."""
        q, k, v, g, o = (upcast(acts[n]) for n in self.mixing_hooks)
        return Mixing(gated_linear_attention_map(q, k, g), v, o)

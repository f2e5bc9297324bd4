"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, §2.1.2–2.1.3, eq. 9–19): softmax
attention whose memory is one low-rank latent per token instead of every head's key and value."""

from __future__ import annotations

import torch
from torch import nn

from ..ops._common import check_mode, compute_dtype
from ..ops._layout import rearrange
from ..ops.ring_attention import current_ring
from ..ops.softmax_attention import KVCache, softmax_attention, softmax_attention_map
from .attention import check_softmax_scale, refuse_scale_with_yarn
from .base import Mixer, Mixing, check_input, input_dtype
from .hooks import HookPoint
from .linear_attention import check_heads, check_int, state_dtypes
from .norm import RMSNorm, check_eps
from .registry import register_mixer
from .rotary import RotaryEmbedding
from .state import spec, state_dataclass


@state_dataclass
class MLAState:
    """The state of multi-head latent attention: the paper's cache (DeepSeek-V2 §2.1.2, eq. 9–10).

    Attributes:
        latent: ``[B, P, kv_lora_rank + qk_rope_head_dim]``, for each of the ``P`` past tokens its
            normalised compressed latent ``c^KV`` followed by its decoupled key ``k^R`` (already
            rotated at the token's position; as computed with ``rope=False``), in the activation
            dtype; ``None`` before the first call. Per token and layer ``d_c + d_h^R`` numbers,
            whatever the number of heads.
        offset: tokens consumed so far (the rotary positions). Default ``0``.
    """

    latent: torch.Tensor | None = None
    offset: int = 0


@register_mixer("mla")
class MultiHeadLatentAttention(Mixer):
    """Multi-head latent attention (DeepSeek-V2 §2.1.2–2.1.3, eq. 9–19; DeepSeek-V3 uses the same layer).

    For a token ``x`` (``[d_model]``), with ``H`` heads, ``d_c = kv_lora_rank``,
    ``d_h^R = qk_rope_head_dim``, ``d_n = qk_nope_head_dim``, ``d_v = v_head_dim``:

    * keys and values come from one compressed latent (eq. 9–11): ``c^KV = RMSNorm(W^DKV x)``
      (``[d_c]``), ``k^C_h = W^UK_h c^KV`` (``[d_n]``), ``v_h = W^UV_h c^KV`` (``[d_v]``); the
      RMSNorm after the latent is stated in the paper's text (§3.1.2), not in eq. 9, and is the
      released models' ``kv_a_layernorm``;
    * rotary positions ride on a decoupled key shared by all heads (eq. 15, 17):
      ``k^R = RoPE(W^KR x)`` (``[d_h^R]``), ``k_h = [k^C_h; k^R]``;
    * queries (eq. 12–14, 16): ``q_h = [q^C_h; RoPE(q^R_h)]`` from ``W^Q x`` (``q_lora_rank=None``,
      DeepSeek-V2-Lite) or from a compressed ``c^Q = RMSNorm(W^DQ x)`` (``[q_lora_rank]``,
      ``W^UQ c^Q``, ``W^QR c^Q``; the norm as for ``c^KV``);
    * ``o_h = Σ_j softmax_j(scale · q_hᵀ k_{j,h}) v_{j,h}`` over the causal keys, ``y = W^O [o_1; …;
      o_H]`` (eq. 18–19), ``scale = (d_n + d_h^R) ** -0.5`` unless ``softmax_scale`` is given.

    With ``rope=False`` (Kimi Linear's MLA layers, Kimi Team 2025, arXiv 2510.26692: no
    positional encoding in its attention layers; ``transformers``' ``KimiLinearAttention``) the
    decoupled parts keep their width and projections but are never rotated: ``k_h = [k^C_h; W^KR
    x]``, ``q_h = [q^C_h; q^R_h]`` in every form, and the logits depend on the positions only
    through the causal mask.

    Only ``[c^KV; k^R]`` is cached (:class:`MLAState`): ``d_c + d_h^R`` numbers per token and layer,
    against ``2 H d_h`` for multi-head attention. The cache is read in the paper's absorbed form
    (§2.1.2: ``W^UK`` absorbed into the query, ``W^UV`` into the output): ``q̃_h = [W^UK_hᵀ q^C_h;
    q^R_h]`` scores the latents directly, ``q̃_hᵀ [c^KV_j; k^R_j] = q_hᵀ k_{j,h}`` (the same logits),
    and ``o_h = W^UV_h Σ_j p_{hj} c^KV_j`` — a multi-query attention over ``d_c + d_h^R``-wide keys
    and ``d_c``-wide values with one key head. Forms (``mode``): ``"parallel"`` expands this call's
    and the cached latents into per-head keys and values and runs the fused attention
    (:func:`~mnemo.ops.softmax_attention`; cheaper at training lengths: ``d_n + d_h^R < d_c +
    d_h^R``); ``"recurrent"`` is the absorbed form as a token loop with an explicit softmax (the
    reference); one-token decoding (``T = 1``) always runs the absorbed form on the cache: two
    products of the ``H`` absorbed queries with the ``[S, d_c + d_h^R]`` latents, no per-head copy
    of the cache (the paper's inference path). The forms agree to rounding.

    Args:
        d_model: model width. n_heads: the heads ``H`` (default ``n_heads=4``).
        head_dim: the default of ``qk_nope_head_dim`` and ``v_head_dim`` (default ``d_model //
            n_heads``).
        kv_lora_rank: ``d_c`` (default ``4 · head_dim``, DeepSeek-V2's ``512 = 4 · 128``).
        q_lora_rank: ``d_c'``, the query's compression (default ``None``: no compression, a
            full ``W^Q`` as in DeepSeek-V2-Lite; DeepSeek-V2 and V3 use 1536).
        qk_nope_head_dim: ``d_n`` (default ``head_dim``). qk_rope_head_dim: ``d_h^R``, even with
            ``rope`` (default ``2 · (head_dim // 4)``: half the head rounded down to an even width,
            DeepSeek-V2's ``64 = 128 / 2``). v_head_dim: ``d_v``
            (default ``head_dim``).
        rope: rotate the decoupled ``q^R`` / ``k^R`` (default ``True``); ``False``: used as they
            are (no positions; ``rope_theta`` unused, ``rope_scaling`` refused).
        rope_theta: the rotary base (default ``10000.0``). rope_scaling: as
            :class:`~mnemo.layers.Attention`'s (YaRN, linear, NTK, ``yarn_hf``, ``llama3``; ``"yarn"``
            multiplies the logits by the YaRN paper's ``(0.1 ln s + 1)²``; DeepSeek-V2 (§3.1.4)
            scales them by ``(0.0707 ln s + 1)²`` instead, and ``transformers``' DeepSeek-V3 by
            ``yarn_get_mscale(s, mscale_all_dim)²``: those are ``"yarn_hf"`` with that
            ``softmax_scale``); the
            rotary positions are ``rotate_half`` pairs of the ``d_h^R`` channels (DeepSeek's
            released weights pair channels ``(2i, 2i + 1)``: a permutation of the ``W^QR`` /
            ``W^KR`` rows maps one onto the other exactly).
        mode: ``"parallel"`` (default) or ``"recurrent"``.
        softmax_scale: the logit scale (default ``None``: ``(d_n + d_h^R) ** -0.5``, times YaRN's
            ``(0.1 ln s + 1)²`` under ``rope_type`` ``"yarn"``); a number replaces it, and is refused
            with ``"yarn"`` as :class:`~mnemo.layers.Attention`'s (``"yarn_hf"``, which scales the
            rotated channels instead, goes with it).
        bias: biases on ``W^DQ``, ``W^DKV``/``W^KR`` and ``W^O``, never on a full ``W^Q`` (DeepSeek's
            ``attention_bias``, as its code and ``transformers`` apply it; default ``False``).
        norm_eps: the latents' RMSNorm epsilon (default ``1e-6``, DeepSeek's).

    Hook points (``S`` = cached + new tokens):

    * ``hook_q`` ``[B, T, H, d_n + d_h^R]``: the queries ``[q^C_h; RoPE(q^R_h)]``;
    * ``hook_c_kv`` ``[B, T, d_c]``: this call's normalised latents ``c^KV``;
    * ``hook_k_rope`` ``[B, T, d_h^R]``: its decoupled keys after the rotary positions (as
      projected with ``rope=False``);
    * ``hook_pattern`` ``[B, H, T, S]``: the softmax probabilities (float32, float64 for a float64
      model), built only while a hook is attached; the output is then ``pattern @ v``, so a
      replaced pattern takes effect;
    * ``hook_o`` ``[B, T, H, d_v]``: the attention output before ``W^O``;
    * ``hook_state``: the cached ``latent`` after the call.

    Every form consumes the hooked ``q``, ``c^KV`` and ``k^R``, so a replacement takes effect in
    each. :meth:`mixing` rebuilds the per-head keys and values from them.

    Not supported: sliding windows, attention sinks and context parallelism (ring attention).

    Raises:
        ValueError: a size that is not a positive int (``qk_rope_head_dim`` odd with ``rope``),
            ``mode``, ``softmax_scale`` (not a finite number > 0), ``norm_eps``, ``rope_theta``,
            ``rope`` (not a bool) or ``rope_scaling`` (also: given with ``rope=False``); the message
            names the argument. At call time: ``x`` (width, dtype), a state of another batch size or
            width, or a ring (context parallelism).
    """

    mixing_hooks = ("hook_q", "hook_c_kv", "hook_k_rope", "hook_o")

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        head_dim: int | None = None,
        kv_lora_rank: int | None = None,
        q_lora_rank: int | None = None,
        rope_theta: float = 10000.0,
        mode: str = "parallel",
        *,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        rope_scaling: dict | None = None,
        softmax_scale: float | None = None,
        bias: bool = False,
        norm_eps: float = 1e-6,
        rope: bool = True,
    ):
        super().__init__(mode)
        check_heads(d_model, n_heads, head_dim)
        check_mode(mode, ("parallel", "recurrent"))
        check_eps("norm_eps", norm_eps)
        for name, value in (
            ("kv_lora_rank", kv_lora_rank),
            ("q_lora_rank", q_lora_rank),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("qk_rope_head_dim", qk_rope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            check_int(name, value, optional=True)
        if not isinstance(bias, bool):
            raise ValueError(f"bias: expected true or false, got {bias!r}")
        if not isinstance(rope, bool):
            raise ValueError(f"rope: expected true or false, got {rope!r}")
        if rope_scaling is not None and not rope:
            raise ValueError(
                f"rope_scaling: needs rope=True, got rope_scaling = {rope_scaling!r} with rope=False"
            )
        head_dim = head_dim or d_model // n_heads
        dr = qk_rope_head_dim if qk_rope_head_dim is not None else 2 * (head_dim // 4)
        if dr < 1 or rope and dr % 2:
            raise ValueError(
                f"qk_rope_head_dim: {'rotary positions need an even width' if rope else 'expected'} >= "
                f"{2 if rope else 1}, got {dr}"
                + (
                    ""
                    if qk_rope_head_dim is not None
                    else f" (2 · (head_dim // 4) with head_dim = {head_dim})"
                )
            )
        self.d_model, self.n_heads = d_model, n_heads
        self.kv_lora_rank = kv_lora_rank or 4 * head_dim
        self.q_lora_rank = q_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim or head_dim
        self.qk_rope_head_dim = dr
        self.v_head_dim = v_head_dim or head_dim
        self.softmax_scale = check_softmax_scale(softmax_scale)
        H, dn, dv, r = n_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        dq = dn + dr
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, H * dq, bias=False)  # (DeepSeek's: never biased)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * dq, bias=False)
        self.kv_a_proj = nn.Linear(d_model, r + dr, bias=bias)  # [W^DKV; W^KR]
        self.kv_a_norm = RMSNorm(r, norm_eps)
        self.kv_b_proj = nn.Linear(r, H * (dn + dv), bias=False)  # per head [W^UK_h; W^UV_h]
        self.o_proj = nn.Linear(H * dv, d_model, bias=bias)
        self.rotary = RotaryEmbedding(dr, rope_theta, scaling=rope_scaling) if rope else None
        refuse_scale_with_yarn(self.softmax_scale, self.rotary)
        self.hook_q, self.hook_c_kv, self.hook_k_rope = HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern = HookPoint(time_dim=2, key_dim=3)
        self.hook_o, self.hook_state = HookPoint(), HookPoint()

    def _mode(self, T: int, mode: str | None) -> str:
        return mode or self.mode

    @property
    def scale(self) -> float:
        """The logit scale: ``softmax_scale``, or ``(d_n + d_h^R) ** -0.5`` times YaRN's
        ``(0.1 ln s + 1)²`` when scaled."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        af = self.rotary.attention_factor if self.rotary is not None else 1.0
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * af * af

    def set_rope_scaling(self, scaling: dict | None) -> None:
        """Set (or with ``None`` remove) the rotary scaling of a built layer (see ``rope_scaling``).
        Raises ``ValueError`` for a bad mapping, ``rope_type`` ``"yarn"`` with ``softmax_scale``, or
        without rotary positions (``rope=False``)."""
        if self.rotary is None:
            raise ValueError("rope_scaling: this attention layer has no rotary positions (rope=False)")
        refuse_scale_with_yarn(self.softmax_scale, scaling=scaling)
        self.rotary.set_scaling(scaling)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W^UK [H, d_n, d_c], W^UV [H, d_v, d_c])`` from ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``[B, S, H, d_n + d_h^R]`` and values ``[B, S, H, d_v]`` of latents
        ``[B, S, d_c + d_h^R]``."""
        r, H = self.kv_lora_rank, self.n_heads
        kv = rearrange(self.kv_b_proj(latent[..., :r]), "b s (h d) -> b s h d", h=H)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = latent[..., None, r:].expand(-1, -1, H, -1)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _absorbed_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q̃_h = [W^UK_hᵀ q^C_h; q^R_h]``: ``[B, T, H, d_c + d_h^R]`` from ``q [B, T, H, d_n + d_h^R]``."""
        w_uk, _ = self._up()
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w_uk.to(q.dtype)), q_rope], dim=-1)

    def forward(self, x: torch.Tensor, state: MLAState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.kv_a_proj))
        if current_ring() is not None:
            raise ValueError(
                "mla: context parallelism (ring attention) is not supported by multi-head latent "
                "attention; train it without a context-parallel ring"
            )
        offset = state.offset if state is not None else 0
        cache = state.latent if state is not None else None
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if cache is not None and (cache.dim() != 3 or cache.shape[0] != B or cache.shape[2] != width):
            raise ValueError(
                f"state.latent: expected [B = {B}, P, kv_lora_rank + qk_rope_head_dim = {width}], "
                f"got {list(cache.shape)}"
            )
        H, r = self.n_heads, self.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = rearrange(q, "b t (h d) -> b t h d", h=H)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split([r, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_norm(c_kv)
        if self.rotary is not None:
            q = torch.cat([q_nope, self.rotary(q_rope, offset)], dim=-1)
            k_rope = self.rotary(k_rope[:, :, None], offset)[:, :, 0]
        q, c_kv, k_rope = self.hook_q(q), self.hook_c_kv(c_kv), self.hook_k_rope(k_rope)
        new = torch.cat([c_kv, k_rope], dim=-1)
        latent = new if cache is None else torch.cat([cache.to(new.dtype), new], dim=1)
        form = self._mode(T, mode)
        if self.hook_pattern.active:  # any hook of its own sees the pattern; o = pattern @ v
            k, v = self._expand(latent)
            cd = compute_dtype(q, k, v)
            pattern = self.hook_pattern(softmax_attention_map(q.to(cd), k.to(cd), scale=self.scale))
            o = torch.einsum("bhts,bshd->bthd", pattern.to(cd), v.to(cd)).to(q.dtype)
        elif form == "parallel" and T > 1:
            k, v = self._expand(new)
            past = None if cache is None else KVCache(*self._expand(cache.to(new.dtype)))
            o, _ = softmax_attention(q, k, v, scale=self.scale, initial_state=past, mode="parallel")
        elif T == 1:  # one-token decoding, absorbed: both products on the latents shared by all heads
            qa = self._absorbed_queries(q)  # [B, 1, H, d_c + d_h^R]
            cd = compute_dtype(qa, latent)
            lat = latent.to(cd)
            scores = torch.matmul(qa[:, 0].to(cd), lat.transpose(1, 2)) * self.scale  # [B, H, S]
            o_lat = torch.matmul(scores.softmax(-1), lat[..., :r])[:, None].to(q.dtype)  # [B, 1, H, d_c]
            _, w_uv = self._up()
            o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv.to(o_lat.dtype))
        else:  # the absorbed form's token loop: one key head [c^KV; k^R], values c^KV (a view)
            qa = self._absorbed_queries(q)
            keys, values = new[:, :, None], new[:, :, None, :r]
            past = None if cache is None else KVCache(cache[:, :, None].to(new.dtype), cache[:, :, None, :r])
            o_lat, _ = softmax_attention(
                qa, keys, values, scale=self.scale, initial_state=past, mode="recurrent"
            )
            _, w_uv = self._up()
            o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv.to(o_lat.dtype))
        o, latent = self.hook_o(o), self.hook_state(latent)
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MLAState(latent=latent, offset=offset + T)

    def mixing(self, acts: dict) -> Mixing:
        """Softmax probabilities (``acts["hook_pattern"]`` when recorded, else from the queries and
        the keys rebuilt from ``hook_c_kv`` / ``hook_k_rope``), the per-head values ``W^UV_h c^KV``
        and the attention output."""
        q, c_kv, k_rope, o = (acts[n] for n in self.mixing_hooks)
        k, v = self._expand(torch.cat([c_kv, k_rope], dim=-1).to(self.kv_b_proj.weight.dtype))
        M = acts.get("hook_pattern")
        if M is None:
            M = softmax_attention_map(q, k.to(q.dtype), scale=self.scale)
        return Mixing(M, v, o)

    def state_spec(self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None) -> MLAState:
        """The state after ``seq_len`` tokens as ``meta`` tensors: ``seq_len`` latents of
        ``kv_lora_rank + qk_rope_head_dim`` numbers in the activation ``dtype`` (default the
        parameters'). Defaults: ``batch_size=1``, ``seq_len=0``."""
        act, _ = state_dtypes(self, dtype)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return MLAState(latent=spec((batch_size, seq_len, width), act), offset=seq_len)

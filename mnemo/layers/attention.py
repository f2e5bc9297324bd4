"""Softmax attention layer: RoPE (full or partial, optionally YaRN-scaled), grouped-query heads,
optional sliding window with attention sinks, per-head q/k norms, an output gate, KV cache."""

from __future__ import annotations

import torch
from torch import nn

from ..ops._common import check_mode, compute_dtype
from ..ops._layout import rearrange, repeat
from ..ops.ring_attention import current_ring, ring_attention
from ..ops.softmax_attention import KVCache, keep_cache, kept_keys, softmax_attention, softmax_attention_map
from .base import Mixer, Mixing, check_input, input_dtype, version_of
from .hooks import HookPoint, before_hook, left_unchanged
from .linear_attention import check_heads, check_int, state_dtypes
from .norm import RMSNorm, check_eps
from .registry import register_mixer
from .rotary import RotaryEmbedding, check_rope_scaling
from .state import spec, state_dataclass


@state_dataclass
class AttentionState:
    """The state of softmax attention.

    Attributes:
        kv: the :class:`~mnemo.ops.KVCache` of past keys and values ``[B, P, H_kv, K]`` (with a
            window, only the last ``window − 1``; with ``n_sink`` attention sinks also the first
            ``n_sink``, and the keys are then stored *before* the rotary positions), in the
            activation dtype; ``None`` before the first call.
        offset: tokens consumed so far (rotary positions, except with sinks: there a key's
            position is its index in the cache). Default ``0``.
    """

    kv: KVCache | None = None
    offset: int = 0


def _same_values(before: torch.Tensor, after, mark: tuple) -> bool:
    """Whether a hook point gave back ``before``'s values untouched (``mark``:
    :func:`~mnemo.layers.hooks.before_hook` before the call): ``before`` itself, unchanged
    (:func:`~mnemo.layers.hooks.left_unchanged`; under ``torch.inference_mode``, equal to the copy
    taken before the hook), or a view of it with the same layout — what a backward hook's wrapping
    (``BackwardHookFunction``) hands back — unchanged since (a view shares the counter). A
    detached copy or a new tensor counts as replaced where gradients are tracked."""
    if left_unchanged(before, after, mark):
        return True
    version = mark[0]
    if not isinstance(after, torch.Tensor) or version is None or after.is_inference():
        return False
    root = before if before._base is None else before._base
    return (
        after._base is root
        and after.requires_grad == before.requires_grad
        and (after.dtype, after.shape, after.stride()) == (before.dtype, before.shape, before.stride())
        and after.storage_offset() == before.storage_offset()
        and version_of(before) == version
    )


def check_softmax_scale(value) -> float | None:
    """A mixer's ``softmax_scale`` argument: ``None`` or a finite number > 0, returned as a float;
    ``ValueError`` naming it otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"softmax_scale: expected a finite number > 0 or None, got {value!r}")
    return float(value)


def refuse_scale_with_yarn(softmax_scale: float | None, rotary=None, scaling: dict | None = None) -> None:
    """Refuse a ``softmax_scale`` next to a rotary scaling whose factor multiplies the logits
    (``rope_type`` ``"yarn"``: both would set the logit scale): a built ``rotary``
    (:class:`~mnemo.layers.rotary.RotaryEmbedding`) whose ``attention_factor`` is not 1, or a
    ``scaling`` about to be set (``set_rope_scaling``). ``"yarn_hf"`` scales q and k instead and
    goes with a ``softmax_scale``."""
    if softmax_scale is None:
        return
    af = rotary.attention_factor if rotary is not None else 1.0
    if af != 1.0:
        raise ValueError(
            f"softmax_scale: {softmax_scale!r} is not supported with rope_scaling of rope_type 'yarn', "
            f"whose factor ({af:g}², on the logits) would also set the logit scale; give one of the two "
            "(or rope_type 'yarn_hf', which scales q and k instead)"
        )
    if (check_rope_scaling(scaling) or {}).get("rope_type") == "yarn":
        raise ValueError(
            f"rope_scaling: rope_type 'yarn' multiplies the logits, and this layer's softmax_scale = "
            f"{softmax_scale!r} sets their scale; give one of the two (or rope_type 'yarn_hf')"
        )


@register_mixer("attention")
class Attention(Mixer):
    """Multi-head causal softmax attention (Vaswani et al. 2017) with rotary positions.

    Args:
        d_model: model width. n_heads: query heads ``H`` (default ``n_heads=4``). n_kv_heads:
            key/value heads (``H`` by default; fewer = grouped-query attention,
            ``H % n_kv_heads == 0``).
        head_dim: default ``d_model // n_heads``.
        window: sliding-window size (keys visible to a query, itself included); ``None`` = full.
        rope: apply rotary embeddings (``rope_theta`` base) to q and k (defaults ``rope=True``,
            ``rope_theta=10000.0``).
        mode: ``"parallel"`` (SDPA) or ``"recurrent"`` (reference token loop).
        rotary_dim: rotate only the first ``rotary_dim`` channels of each head (partial rotary,
            :class:`~mnemo.layers.rotary.RotaryEmbedding`); default the whole head.
        qk_norm: a per-head RMSNorm (width ``head_dim``, epsilon ``norm_eps``) on q and k before
            the rotary positions (Qwen3, Qwen3-Next). Default ``False``.
        output_gate: ``o ⊙ sigmoid(W_gate x)`` per head and channel before the output projection
            (gated attention, as in Qwen3-Next; ``W_gate``: ``gate_proj``). Default ``False``.
        bias: which projections have a bias: ``False`` (none; default ``False``), ``True`` (q, k, v, the
            output gate and the output projection: Llama's and Qwen3's ``attention_bias``), or
            ``"qkv"`` (q, k and v only, neither the gate nor the output projection: Qwen2's and
            Qwen2.5's attention, ``q_proj`` / ``k_proj`` / ``v_proj`` biased and ``o_proj`` not,
            ``transformers``' ``modeling_qwen2.py``).
        norm_eps: the q/k norms' epsilon (default ``1e-5``).
        rope_scaling: ``None`` or YaRN (Peng et al. 2023): ``{"rope_type": "yarn", "factor": s,
            "original_max_position_embeddings": L, "beta_fast": 32, "beta_slow": 1}`` (the names of
            ``transformers``' ``rope_scaling``; see :func:`~mnemo.layers.rotary.check_rope_scaling`):
            NTK-by-parts frequencies, and the logits multiplied by ``(0.1 ln s + 1)²`` (the
            temperature ``√(1/t)`` on both q and k; ``scale`` = that / ``√head_dim``).
            :meth:`set_rope_scaling` sets it on a trained model (evaluation beyond ``L``). Also
            Position Interpolation ``{"rope_type": "linear", "factor": s}`` and static NTK-aware
            scaling ``{"rope_type": "ntk", "factor": s}`` (no logit factor for either), and
            ``transformers``' YaRN ``{"rope_type": "yarn_hf", ...}`` (its frequencies, and its factor
            on the rotated channels of q and k rather than on the logits), and Llama 3.1's
            ``{"rope_type": "llama3", ...}`` (:func:`~mnemo.layers.rotary.llama3_inv_freq`).
        n_sink: attention sinks (StreamingLLM, Xiao et al. 2023; needs ``window``): the first
            ``n_sink`` tokens stay visible to every query besides the ``window`` most recent, and
            the cache keeps them: decoding streams indefinitely with at most ``n_sink + window − 1``
            cached keys. Positions are assigned *in the cache*, as the paper does: a query at
            stream index ``i`` sees its window keys at their usual distance ``i − j`` and the sink
            ``j`` at distance ``min(i, n_sink + window − 1) − j``. The cache therefore stores keys
            *before* rotary and rotates them at their cache positions ``0 … P−1`` on every call
            (the paper's choice, rather than re-rotating stored keys on eviction, which would
            accumulate rounding in low precision); the sinks are scored by the queries rotated
            at the capped position (``sink_q`` of :func:`~mnemo.ops.softmax_attention`). The
            parallel form over a long sequence and token-by-token decoding are the same function.
            Default ``0`` (a window alone evicts the first tokens too).
        softmax_scale: the factor of the logits ``q · k`` (a finite number > 0) in place of
            ``head_dim ** -0.5``: IBM Granite's ``attention_multiplier`` (``transformers``'
            ``GraniteAttention`` / ``GraniteMoeHybridAttention``, ``scaling``). Default ``None``:
            ``head_dim ** -0.5`` (times YaRN's factor with ``rope_type`` ``"yarn"``). Refused
            together with ``rope_type`` ``"yarn"``, whose factor multiplies the logits (which of the
            two would the number mean?); ``"yarn_hf"`` scales the rotated channels of q and k instead
            and goes with it.

    Hook points (``S`` = cached + new keys):

    * ``hook_q`` ``[B, T, H, K]``, ``hook_k`` ``[B, T, H_kv, K]`` (after rotary positions),
      ``hook_v`` ``[B, T, H_kv, V]``: this call's queries, keys and values as the op gets them
      (with sinks the cache keeps a replaced ``hook_k`` value rotated back to no position; a hook
      that only reads it changes nothing);
    * ``hook_pattern`` ``[B, H, T, S]``: the softmax probabilities over the cached and new keys,
      sink columns first (float32, float64 for a
      float64 model). Built only while a hook is attached; the output is then computed as
      ``pattern @ v``, so a replaced pattern takes effect (otherwise the fused kernel runs and no
      ``T × S`` matrix is formed);
    * ``hook_o`` ``[B, T, H, V]``: the attention output, before the output gate and projection;
    * ``hook_state``: the :class:`~mnemo.ops.KVCache` after the call.

    State: :class:`AttentionState` (``kv``, ``offset``); with a window, the cache keeps only the
    last ``window − 1`` keys (and the ``n_sink`` first), so decoding memory stays bounded.

    Raises:
        ValueError: bad head counts or sizes, ``bias`` (not true, false or ``"qkv"``), ``window`` (not
            ``None`` or an int ``>= 1``), ``n_sink`` (negative, or without ``window``), ``rope_theta``
            (not a positive number), ``rope_scaling`` (without ``rope``, or a bad value) or
            ``softmax_scale`` (not a finite number > 0, or with ``rope_type`` ``"yarn"``); the
            message names the argument.
    """

    mixing_hooks = ("hook_q", "hook_k", "hook_v", "hook_o")
    #: the text values each option of a union annotation takes (``ModelConfig.validate`` checks them)
    text_options = {"bias": ("qkv",)}

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        window: int | None = None,
        rope: bool = True,
        rope_theta: float = 10000.0,
        mode: str = "parallel",
        *,
        rotary_dim: int | None = None,
        qk_norm: bool = False,
        output_gate: bool = False,
        bias: bool | str = False,
        norm_eps: float = 1e-5,
        rope_scaling: dict | None = None,
        n_sink: int = 0,
        softmax_scale: float | None = None,
    ):
        super().__init__(mode)
        self.softmax_scale = check_softmax_scale(softmax_scale)
        if not isinstance(n_sink, int) or isinstance(n_sink, bool) or n_sink < 0:
            raise ValueError(f"n_sink: expected an int >= 0, got {n_sink!r}")
        if n_sink and window is None:
            raise ValueError(
                f"n_sink: attention sinks need a window (window=W), got n_sink = {n_sink} and window = None"
            )
        if rope_scaling is not None and not rope:
            raise ValueError(
                f"rope_scaling: needs rope=True, got rope_scaling = {rope_scaling!r} with rope=False"
            )
        check_heads(d_model, n_heads, head_dim)
        check_int("n_kv_heads", n_kv_heads, optional=True)
        check_int("window", window, optional=True)
        check_mode(mode, ("parallel", "recurrent"))
        check_eps("norm_eps", norm_eps)  # (the q/k norms named it ``eps``, not the argument given)
        if not (isinstance(bias, bool) or bias == "qkv"):
            raise ValueError(
                "bias: expected True (q, k, v, gate and output projections), False (none) or 'qkv' "
                f"(q, k and v only, as Qwen2), got {bias!r}"
            )
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if rope and head_dim is None and rotary_dim is None and (d_model // n_heads) % 2:
            raise ValueError(
                f"n_heads: rotary positions need an even head size, and without head_dim it is d_model // "
                f"n_heads = {d_model} // {n_heads} = {d_model // n_heads}; choose n_heads so that it is "
                "even, or give head_dim (or rotary_dim)"
            )
        head_dim = head_dim or d_model // n_heads
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window, self.n_sink = window, n_sink
        qkv_bias, o_bias = bias is True or bias == "qkv", bias is True  # ("qkv": Qwen2's biases)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * head_dim, bias=qkv_bias)
        self.gate_proj = nn.Linear(d_model, n_heads * head_dim, bias=o_bias) if output_gate else None
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.rotary = (
            RotaryEmbedding(head_dim, rope_theta, rotary_dim, scaling=rope_scaling) if rope else None
        )
        refuse_scale_with_yarn(self.softmax_scale, self.rotary)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        # the pattern's keys end at the call's last token (joined over pieces by column position,
        # :func:`~mnemo.layers.hooks.join_pieces`); sink columns come first, so with sinks it is not
        self.hook_pattern = HookPoint(time_dim=2, key_dim=3) if not n_sink else HookPoint(time_dim=None)
        self.hook_o, self.hook_state = HookPoint(), HookPoint()

    def _mode(self, T: int, mode: str | None) -> str:
        return mode or self.mode

    @property
    def scale(self) -> float:
        """The logit scale: ``softmax_scale`` when given, else ``head_dim ** -0.5``, times YaRN's
        ``(0.1 ln s + 1)²`` when scaled."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        af = self.rotary.attention_factor if self.rotary is not None else 1.0
        return self.head_dim**-0.5 * af * af

    def set_rope_scaling(self, scaling: dict | None) -> None:
        """Set (or with ``None`` remove) the rotary scaling of a built layer, e.g. YaRN on a model
        trained at a shorter context (no parameter changes; see ``rope_scaling``). Raises
        ``ValueError`` without rotary positions or for a bad mapping."""
        if self.rotary is None:
            raise ValueError("rope_scaling: this attention layer has no rotary positions (rope=False)")
        refuse_scale_with_yarn(self.softmax_scale, scaling=scaling)
        self.rotary.set_scaling(scaling)

    def _sink_queries(self, q: torch.Tensor, pos0: int) -> torch.Tensor | None:
        """The queries ``[B, T, H, K]`` (rotated at ``pos0 + t``) rotated back to the position that
        scores the sinks, ``min(i, n_sink + window − 1)``; ``None`` when no rotation is needed."""
        if self.rotary is None or not self.n_sink:
            return None
        last = self.n_sink + self.window - 1
        if pos0 + q.shape[1] - 1 <= last:  # every position scores the sinks where it stands
            return None
        i = torch.arange(pos0, pos0 + q.shape[1], device=q.device)
        return self.rotary.rotate(q, i.clamp(max=last) - i)

    def ov_matrices(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per query head ``h``: ``(W_V [d_model, D], W_O [D, d_model])``; with grouped-query
        attention head ``h`` reads the values of key/value head ``h // (H / H_kv)``. ``None`` with
        the output gate (the token-dependent gate between them leaves no fixed OV matrix); biases
        are not part of the matrices."""
        if self.gate_proj is not None:
            return None
        D, G = self.head_dim, self.n_heads // self.n_kv_heads
        W_v = self.kv_proj.weight.detach()[self.n_kv_heads * D :].T  # [d, H_kv·D]
        W_o = self.o_proj.weight.detach().T  # [H·D, d]
        return [
            (W_v[:, (h // G) * D : (h // G + 1) * D], W_o[h * D : (h + 1) * D]) for h in range(self.n_heads)
        ]

    def forward(self, x: torch.Tensor, state: AttentionState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.q_proj))
        offset = state.offset if state is not None else 0
        cache = state.kv if state is not None else None
        q = rearrange(self.q_proj(x), "b t (h d) -> b t h d", h=self.n_heads)
        k, v = rearrange(self.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # with sinks, positions count in the cache (StreamingLLM): the first new token sits at P
        pos0 = offset if not self.n_sink else (cache.k.shape[1] if cache is not None else 0)
        k_raw = k
        if self.rotary is not None:
            q, k = self.rotary(q, pos0), self.rotary(k, pos0)
        k_rot, k_mark = k, (before_hook(k) if self.n_sink and self.hook_k.hooked else None)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        sink_q, raw_cache = None, cache
        if self.n_sink:
            # keep a replaced key (returned, or edited in place: its version moved), unrotated; a hook
            # that only reads it leaves the key before rotary as it was (rotating back would round it)
            replaced = self.hook_k.hooked and not _same_values(k_rot, k, k_mark)
            if replaced and self.rotary is not None:
                k_raw = self.rotary.undo(k, pos0)
            elif self.rotary is None:
                k_raw = k
            sink_q = self._sink_queries(q, pos0)
            if cache is not None and self.rotary is not None:
                cache = KVCache(self.rotary(cache.k, 0), cache.v)  # at their cache positions 0 … P−1
        ring = current_ring()  # context parallelism (mnemo.train.distributed): the whole ring's keys
        if ring is not None:
            o, cache = self._attend_ring(q, k, v, ring, cache), None
        elif self.hook_pattern.active:  # any hook of its own (a backward one too) sees the pattern
            o, cache = self._attend_through_pattern(q, k, v, cache, sink_q)
        else:
            o, cache = softmax_attention(
                q,
                k,
                v,
                window=self.window,
                n_sink=self.n_sink,
                sink_q=sink_q,
                scale=self.scale,
                initial_state=cache,
                output_final_state=True,
                mode=self._mode(T, mode),
            )
        if self.n_sink:  # the cache keeps the keys before rotary
            k_all = k_raw if raw_cache is None else torch.cat([raw_cache.k.to(k_raw.dtype), k_raw], 1)
            cache = KVCache(keep_cache(k_all, self.window, self.n_sink), cache.v)
        o, cache = self.hook_o(o), self.hook_state(cache)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(rearrange(self.gate_proj(x), "b t (h d) -> b t h d", h=self.n_heads))
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, AttentionState(kv=cache, offset=offset + T)

    def _attend_ring(self, q, k, v, ring, cache):
        """Ring attention (:func:`~mnemo.ops.ring_attention.ring_attention`) of this member's
        block over every member's keys; rotary positions come from the state's ``offset`` (the
        block's global start). Raises ``ValueError`` for what the ring does not carry: a KV cache,
        attention sinks, or a hooked pattern (no ``T × T`` matrix is formed)."""
        if cache is not None:
            raise ValueError("state: ring attention starts every block from an empty KV cache, got a cache")
        if self.n_sink:
            raise ValueError(
                f"n_sink: attention sinks are not supported by ring attention (context parallelism), "
                f"got n_sink = {self.n_sink}"
            )
        if self.hook_pattern.active:
            raise ValueError("hook_pattern: ring attention forms no attention pattern; detach the hook")
        return ring_attention(q, k, v, ring=ring, window=self.window, scale=self.scale)

    def _attend_through_pattern(self, q, k, v, cache: KVCache | None, sink_q=None):
        """``o = pattern @ v`` with the probabilities passing ``hook_pattern`` (and the new cache)."""
        if cache is not None:
            k_all = torch.cat([cache.k.to(k.dtype), k], dim=1)
            v_all = torch.cat([cache.v.to(v.dtype), v], dim=1)
        else:
            k_all, v_all = k, v
        cd = compute_dtype(q, k, v)
        sq = None if sink_q is None else sink_q.to(cd)
        pattern = self.hook_pattern(
            softmax_attention_map(
                q.to(cd), k_all.to(cd), self.window, self.scale, n_sink=self.n_sink, sink_q=sq
            )
        )
        vh = repeat(v_all.to(cd), "b s h d -> b s (h g) d", g=self.n_heads // self.n_kv_heads)
        o = torch.einsum("bhts,bshd->bthd", pattern.to(cd), vh).to(q.dtype)
        return o, KVCache(
            keep_cache(k_all, self.window, self.n_sink), keep_cache(v_all, self.window, self.n_sink)
        )

    def mixing(self, acts: dict) -> Mixing:
        """Softmax probabilities (``acts["hook_pattern"]`` when recorded, else from q and k), the
        values repeated to the ``H`` query heads, and the attention output."""
        q, k, v, o = (acts[n] for n in self.mixing_hooks)
        M = acts.get("hook_pattern")
        if M is None:  # one call from the start of the stream: positions 0 … T−1, sink columns first
            sink_q = self._sink_queries(q, k.shape[1] - q.shape[1])
            M = softmax_attention_map(
                q, k, window=self.window, scale=self.scale, n_sink=self.n_sink, sink_q=sink_q
            )
        v = repeat(v, "b t h d -> b t (h g) d", g=self.n_heads // self.n_kv_heads)
        return Mixing(M, v, o)

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> AttentionState:
        """The state after ``seq_len`` tokens as ``meta`` tensors: a KV cache of ``seq_len`` entries
        (at most ``window − 1``, plus ``n_sink`` with sinks) in the activation ``dtype`` (default
        the parameters'). Defaults: ``batch_size=1``, ``seq_len=0``."""
        act, _ = state_dtypes(self, dtype)
        kept = sum(kept_keys(seq_len, self.window, self.n_sink))
        shape = (batch_size, kept, self.n_kv_heads, self.head_dim)
        return AttentionState(kv=KVCache(spec(shape, act), spec(shape, act)), offset=seq_len)

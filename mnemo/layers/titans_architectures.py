"""The three Titans architectures around the long-term memory (Behrouz et al. 2024, "Titans:
Learning to Memorize at Test Time", §4): MAC (memory as context: each segment attends to the
memory's read-out of it, the persistent tokens and itself), MAG (memory as gate: a sliding-window
attention branch gated with the memory branch) and MAL (memory as layer: the memory, then a
sliding-window attention on its output). The memory itself, its read/write semantics and maps are
in :mod:`mnemo.layers.titans`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..memory import MemoryState
from ..memory.attribution import ValueAttribution
from ..memory.engine import memory_apply, retention_map
from ..ops._common import inference_involved
from ..ops._layout import rearrange
from ..ops.softmax_attention import WINDOW_BLOCK, KVCache, attention_mask, sliding_window_attention
from .attention import Attention
from .base import Mixer, Mixing, check_input, check_state_dtype, input_dtype
from .hooks import HookPoint, enter_piece, join_pieces, leave_pieces, show_state
from .linear_attention import check_int
from .norm import RMSNorm
from .registry import register_mixer
from .state import spec, state_dataclass
from .titans import NeuralMemory, NeuralMemoryState, _conv_spec, check_state_type, state_dtypes


@state_dataclass
class TitansMAGState:
    """The state of :class:`TitansMAG`.

    Attributes:
        memory: the long-term memory's :class:`NeuralMemoryState`.
        attn_k, attn_v: the sliding-window KV cache ``[B, P, H_kv, D]`` of the attention branch
            (the last ``P ≤ window − 1`` tokens, activation dtype; persistent keys are parameters,
            not state).
        offset: tokens consumed so far (rotary positions; default ``0``).
    """

    memory: NeuralMemoryState | None = None
    attn_k: torch.Tensor | None = None
    attn_v: torch.Tensor | None = None
    offset: int = 0


@state_dataclass
class TitansMALState:
    """The state of :class:`TitansMAL` (fields as :class:`TitansMAGState`: the memory layer's state
    and the sliding-window KV cache of the attention on its output; default ``offset=0``)."""

    memory: NeuralMemoryState | None = None
    attn_k: torch.Tensor | None = None
    attn_v: torch.Tensor | None = None
    offset: int = 0


@state_dataclass
class TitansMACState:
    """The state of :class:`TitansMAC`.

    Attributes:
        memory: the long-term memory's :class:`NeuralMemoryState` (written with the attention
            outputs; its ``conv`` is the tail of the write projections).
        read_conv: the conv tail ``[B, 3 H D, W − 1]`` of the read-before queries (the memory's
            projections applied to the segment input), or ``None``.
        attn_k, attn_v: the segment-local KV cache ``[B, n, H_kv, D]`` of the current segment's
            ``n`` tokens so far (``None`` at a segment start before any token).
        read_k, read_v: the segment-local keys/values ``[B, n, H_kv, D]`` of the memory read-outs
            ``h`` (the context the segment's tokens attend to).
        offset: tokens consumed so far (segment boundaries are absolute; default ``0``).
    """

    memory: NeuralMemoryState
    read_conv: torch.Tensor | None = None
    attn_k: torch.Tensor | None = None
    attn_v: torch.Tensor | None = None
    read_k: torch.Tensor | None = None
    read_v: torch.Tensor | None = None
    offset: int = 0


def _kv(k, v) -> KVCache | None:
    return None if k is None else KVCache(k, v)


# ------------------------------------------------------------------------------------------------
# attention with a persistent prefix (always visible) for the Titans architectures
# ------------------------------------------------------------------------------------------------


class _PrefixAttention(nn.Module):
    """Causal softmax attention whose keys are ``[persistent ‖ extra ‖ sequence]``.

    ``extra`` (MAC's memory read-outs) is visible causally: query ``j`` sees extra token ``i``
    iff ``i ≤ j`` in the segment. ``window`` limits the sequence keys (sliding window).
    ``persistent``: the ``persistent_tokens`` learned inputs ``[P, d_model]`` of the persistent
    keys and values, initialised ``N(0, 0.02²)`` (as :class:`NeuralMemory`'s persistent prefix).

    Hook points: ``hook_q`` ``[B, T, H, D]``, ``hook_k`` and ``hook_v`` ``[B, T, H_kv, D]`` (this
    call's sequence queries, keys and values, after rotary positions, as attention receives them;
    the persistent and ``extra`` keys are not included), ``hook_o`` ``[B, T, H, D]`` (the attention
    output before the output projection).
    """

    def __init__(self, d_model, n_heads, persistent_tokens, window=None, rope=True):
        super().__init__()
        check_int("persistent_tokens", persistent_tokens, 0)
        self.inner = Attention(d_model, n_heads, window=window, rope=rope)
        # ``inner`` only holds the projections and rotary table (its forward never runs here): its
        # hook points would never fire, so the ones of this module replace them
        for name in [n for n, m in self.inner.named_children() if isinstance(m, HookPoint)]:
            delattr(self.inner, name)
        self.persistent = (
            nn.Parameter(torch.randn(persistent_tokens, d_model) * 0.02) if persistent_tokens else None
        )
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_o = HookPoint()

    def kv(self, x, offset):
        att = self.inner
        k, v = rearrange(att.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=att.n_kv_heads)
        if att.rotary is not None:
            k = att.rotary(k, offset)
        return k, v

    def forward(
        self,
        x,
        cache: KVCache | None,
        offset: int,
        extra: torch.Tensor | None = None,
        extra_cache: KVCache | None = None,
    ):
        """``x: [B, T, d]`` at positions ``offset …``; ``cache`` holds earlier sequence keys (already
        truncated to the window); ``extra``: MAC read-outs aligned with ``x``, ``extra_cache`` the
        earlier ones of the same segment. Returns ``(y, cache, extra_cache)``."""
        att = self.inner
        B, T, _ = x.shape
        q = rearrange(att.q_proj(x), "b t (h d) -> b t h d", h=att.n_heads)
        if att.rotary is not None:
            q = att.rotary(q, offset)
        k, v = self.kv(x, offset)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if cache is not None:
            if cache.k.shape[0] != B:
                raise ValueError(
                    f"state: the attention's KV cache holds batch size {cache.k.shape[0]}, the input has {B}"
                )
            k_all, v_all = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        else:
            k_all, v_all = k, v
        S = k_all.shape[1]
        G = att.n_heads // att.n_kv_heads
        pk = pv = None
        if self.persistent is not None:
            pk, pv = self.kv(self.persistent.to(x.dtype).expand(B, -1, -1), 0)
        new_extra = None
        if extra is None and att.window is not None and T > WINDOW_BLOCK:

            def heads(t):
                return None if t is None else t.repeat_interleave(G, dim=2).transpose(1, 2)

            o = sliding_window_attention(
                q.transpose(1, 2),
                heads(k_all),
                heads(v_all),
                att.window,
                att.head_dim**-0.5,
                heads(pk),
                heads(pv),
            ).transpose(1, 2)
        else:
            mask = attention_mask(T, S, causal=True, window=att.window, device=x.device)
            keys, vals, masks = [k_all], [v_all], [mask]
            if extra is not None:
                ek, ev = self.kv(extra, offset)  # read-out h_i sits at its token's position i
                if extra_cache is not None:
                    ek, ev = torch.cat([extra_cache.k, ek], 1), torch.cat([extra_cache.v, ev], 1)
                new_extra = KVCache(ek, ev)
                keys.insert(0, ek)
                vals.insert(0, ev)
                masks.insert(0, attention_mask(T, ek.shape[1], causal=True, device=x.device))
            if pk is not None:
                keys.insert(0, pk)
                vals.insert(0, pv)
                masks.insert(0, torch.ones(T, pk.shape[1], dtype=torch.bool, device=x.device))
            kk = torch.cat(keys, 1).repeat_interleave(G, dim=2)
            vv = torch.cat(vals, 1).repeat_interleave(G, dim=2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=torch.cat(masks, 1)
            ).transpose(1, 2)
        o = self.hook_o(o)
        y = att.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        keep = S if att.window is None else min(S, att.window - 1)
        return y, KVCache(k_all[:, S - keep :], v_all[:, S - keep :]), new_extra

    def cache_spec(self, batch_size: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """One cached key (or value) tensor ``[B, tokens, H_kv, D]`` as a ``meta`` tensor."""
        a = self.inner
        return spec((batch_size, tokens, a.n_kv_heads, a.head_dim), dtype)


# ------------------------------------------------------------------------------------------------
# MAC, MAG, MAL
# ------------------------------------------------------------------------------------------------


class _MemoryAndWindow(Mixer):
    """The parts MAG and MAL share: a long-term memory and sliding-window attention with
    persistent keys; the decoding state is the memory's state and the window's KV cache."""

    _State: type = TitansMAGState

    def __init__(self, d_model, n_heads, window, persistent_tokens, spec, mode, spec_overrides):
        super().__init__(mode)
        self.d_model = d_model
        self.memory = NeuralMemory(
            d_model, n_heads, spec=spec, persistent_tokens=persistent_tokens, mode=mode, **spec_overrides
        )
        self.attn = _PrefixAttention(d_model, n_heads, persistent_tokens, window=window)
        self.hook_attn_out, self.hook_mem_out, self.hook_state = HookPoint(), HookPoint(), HookPoint()

    @property
    def mixing_hooks(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"memory.{h}" for h in self.memory.mixing_hooks)

    @property
    def map_heads(self) -> int:
        """The long-term memory's heads (its map is the mixer's; ``memory.hook_o [B, T', H, D]``)."""
        return self.memory.n_heads

    @property
    def mixing_exact(self) -> bool:
        return self.memory.mixing_exact

    def attribution(
        self, acts: dict, steps: int | None = None, method: str = "auto", *, rule: str | None = None
    ) -> ValueAttribution:
        """The long-term memory's :meth:`NeuralMemory.attribution` (from the ``memory.hook_*`` values;
        maps ``[B, H, T, T]`` over the stream's own ``T`` tokens). ``steps``, ``method`` and ``rule``
        (keyword-only: the quadrature rule of the integration steps, ``"midpoint"`` or
        ``"gauss_legendre"``; :func:`~mnemo.memory.attribution.attribute_read`) as there;
        ``steps`` and ``rule`` default to the memory's :attr:`~NeuralMemory.attribution_steps` and
        :attr:`~NeuralMemory.attribution_rule` (``4``, ``"midpoint"``).

        Raises:
            ValueError: ``rule`` not one of :data:`~mnemo.memory.attribution.RULES`, ``steps`` not
                an int ``>= 1``, ``method`` unknown
                (:func:`~mnemo.memory.attribution.value_attribution`)."""
        mem = {h.removeprefix("memory."): a for h, a in acts.items()}
        return self.memory.attribution(mem, steps, method, rule=rule)

    def mixing(self, acts: dict) -> Mixing:
        """The long-term memory's map (:meth:`NeuralMemory.mixing`, from the ``memory.hook_*``
        values): the read of the memory branch attributed to the memory's writes. The attention
        branch's own softmax map is not part of it."""
        return self.memory.mixing({h.removeprefix("memory."): a for h, a in acts.items()})

    def state_spec(self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None):
        """The state after ``seq_len`` tokens as ``meta`` tensors: the memory's
        (:meth:`NeuralMemory.state_spec`) and the window's KV cache (activation ``dtype``)."""
        act, _ = state_dtypes(self, dtype)
        a = self.attn.inner
        kept = min(seq_len, a.window - 1) if a.window else seq_len
        return self._State(
            memory=self.memory.state_spec(batch_size, seq_len, dtype),
            attn_k=self.attn.cache_spec(batch_size, kept, act),
            attn_v=self.attn.cache_spec(batch_size, kept, act),
            offset=seq_len,
        )


@register_mixer("titans_mag")
class TitansMAG(_MemoryAndWindow):
    """Memory as a Gate (Titans §4.2): sliding-window attention and the memory branch, combined by a
    gate. ``o = W_o (RMSNorm(y_attn) ⊙ sigmoid(RMSNorm(y_mem)))`` with both branches over the same
    input; persistent tokens are keys every query sees (attention) and a prefix the memory writes.
    (The paper prepends one set ``p`` to both branches' input ``[p ‖ x]``; here each branch learns its
    own ``persistent_tokens`` vectors, ``attn.persistent`` and ``memory.persistent``.)
    Defaults: ``n_heads=4``, ``window=64``, ``persistent_tokens=4``.

    Hook points (all ``[B, T, d_model]`` unless named): ``hook_attn_out`` (``y_attn``, the attention
    branch), ``hook_mem_out`` (``y_mem``, the memory branch), ``hook_gate`` (``sigmoid(RMSNorm(y_mem))``),
    ``hook_state`` (the :class:`TitansMAGState` after the call); the memory branch's own hooks are
    ``memory.hook_q`` … (see :class:`NeuralMemory`), the attention branch's ``attn.hook_q``,
    ``attn.hook_k``, ``attn.hook_v``, ``attn.hook_o`` (``[B, T, H(_kv), D]``).

    State: :class:`TitansMAGState`.
    """

    _State = TitansMAGState

    def __init__(
        self,
        d_model,
        n_heads=4,
        window=64,
        persistent_tokens=4,
        spec="titans",
        mode="chunk",
        **spec_overrides,
    ):
        super().__init__(d_model, n_heads, window, persistent_tokens, spec, mode, spec_overrides)
        self.norm_attn, self.norm_mem = RMSNorm(d_model), RMSNorm(d_model)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.hook_gate = HookPoint()

    def forward(self, x, state: TitansMAGState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.attn.inner.q_proj))
        check_state_type(state, TitansMAGState, "TitansMAG")
        check_state_dtype(state, self, fast_weights=True)
        offset = state.offset if state is not None else 0
        cache = _kv(state.attn_k, state.attn_v) if state is not None else None
        mem_state = state.memory if state is not None else None
        y_attn, cache, _ = self.attn(x, cache, offset)
        y_attn = self.hook_attn_out(y_attn)
        y_mem, mem_state = self.memory(x, mem_state, mode=mode)
        y_mem = self.hook_mem_out(y_mem)
        gate = self.hook_gate(torch.sigmoid(self.norm_mem(y_mem)))
        y = self.o_proj(self.norm_attn(y_attn) * gate)
        new = TitansMAGState(memory=mem_state, attn_k=cache.k, attn_v=cache.v, offset=offset + T)
        return y, show_state(self.hook_state, new)


@register_mixer("titans_mal")
class TitansMAL(_MemoryAndWindow):
    """Memory as a Layer (Titans §4.3): the memory layer, then sliding-window attention on its output
    (with persistent keys). ``o = SWA(RMSNorm(M(x)))``. Defaults: ``n_heads=4``, ``window=64``,
    ``persistent_tokens=4``.

    Deviations from the paper (Eq. 29-31: ``y = M([p ‖ x])``, ``o = SW-Attn(y)``): the memory's
    output is RMS-normalised before the attention, and the attention has persistent keys of its own
    (learned vectors, always visible) besides the prefix the memory writes; in the paper the
    attention sees the persistent tokens only as the memory's outputs at the start of the stream,
    inside its window.

    Hook points: ``hook_mem_out`` ``[B, T, d_model]`` (the memory layer's output, before the norm
    and the attention), ``hook_attn_out`` ``[B, T, d_model]`` (the attention's output, the mixer's
    output), ``hook_state`` (the :class:`TitansMALState` after the call); the memory layer's own
    hooks are ``memory.hook_q`` … (see :class:`NeuralMemory`), the attention's ``attn.hook_q``,
    ``attn.hook_k``, ``attn.hook_v``, ``attn.hook_o``.

    State: :class:`TitansMALState`.
    """

    _State = TitansMALState

    def __init__(
        self,
        d_model,
        n_heads=4,
        window=64,
        persistent_tokens=4,
        spec="titans",
        mode="chunk",
        **spec_overrides,
    ):
        super().__init__(d_model, n_heads, window, persistent_tokens, spec, mode, spec_overrides)
        self.mid_norm = RMSNorm(d_model)

    def forward(self, x, state: TitansMALState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.memory.in_proj))
        check_state_type(state, TitansMALState, "TitansMAL")
        check_state_dtype(state, self, fast_weights=True)
        offset = state.offset if state is not None else 0
        cache = _kv(state.attn_k, state.attn_v) if state is not None else None
        mem_state = state.memory if state is not None else None
        h, mem_state = self.memory(x, mem_state, mode=mode)
        h = self.hook_mem_out(h)
        y, cache, _ = self.attn(self.mid_norm(h), cache, offset)
        y = self.hook_attn_out(y)
        new = TitansMALState(memory=mem_state, attn_k=cache.k, attn_v=cache.v, offset=offset + T)
        return y, show_state(self.hook_state, new)


@register_mixer("titans_mac")
class TitansMAC(Mixer):
    """Memory as a Context (Titans §4.1). The sequence is cut into segments of ``segment`` tokens
    (= the memory's inner chunk). Defaults: ``n_heads=4``, ``segment=64``, ``persistent_tokens=4``
    (the persistent keys of the attention). For each segment ``S``:

    1. ``h = M*(q(S))``: read the memory with the weights it had *before* the segment (no write);
    2. ``y = Attn([persistent ‖ h ‖ S])`` for the segment's tokens: persistent keys always visible,
       read-out ``h_i`` and token ``x_i`` visible to token ``j`` iff ``i ≤ j`` (causal);
    3. write the memory with ``y`` (its own q/k/v projections) and read it back *after* each
       token's write: ``m_t = M_t(q(y_t))``;
    4. ``o = W_o (y ⊙ sigmoid(m))``.

    Attention is thus segment-local (its cache resets at each segment boundary); everything older
    reaches a token only through the memory.

    Deviation from the paper (Titans Eq. 21-25): there ``o_t = y_t ⊗ M*_t(y_t)`` reads the memory
    after the *whole* segment has been written, so a token's output would depend on the later tokens
    of its segment; here each token reads the weights after its own write (step 3), which keeps the
    mixer causal and makes decoding inside a segment equal to the full pass. The read-outs ``h_i``
    are visible causally (step 2) for the same reason.

    Hook points (``[B, L, d_model]``; each fires once per segment piece of ``L`` tokens, in stream
    order, since a segment's memory read depends on the previous segment's write; each piece is
    placed in the call (:func:`~mnemo.layers.hooks.span`), so a recording joins the pieces and an
    intervention's positions are the call's tokens): ``hook_mem_read`` (``h``, the read-before
    context of step 1), ``hook_attn_out`` (``y``, step 2, which the memory then writes),
    ``hook_mem_out`` (``m``, the read after the write, step 3), ``hook_gate`` (``sigmoid(m)``,
    step 4); ``hook_state`` (the :class:`TitansMACState` after the call, once). The memory's own
    hooks (``memory.hook_q`` …, the write of step 3) and the attention's (``attn.hook_q``,
    ``attn.hook_k``, ``attn.hook_v``, ``attn.hook_o``) fire once per piece too.

    State: :class:`TitansMACState`.
    """

    def __init__(
        self,
        d_model,
        n_heads=4,
        segment=64,
        persistent_tokens=4,
        spec="titans",
        mode="chunk",
        **spec_overrides,
    ):
        super().__init__(mode)
        if isinstance(segment, bool) or not isinstance(segment, int) or segment < 1:
            raise ValueError(f"TitansMAC: segment must be an int >= 1 (tokens per segment), got {segment!r}")
        if "chunk_size" in spec_overrides:
            raise ValueError(
                "TitansMAC: the memory's inner chunk is the segment; pass segment=, not chunk_size="
            )
        self.d_model, self.segment = d_model, segment
        self.memory = NeuralMemory(
            d_model, n_heads, spec=spec, chunk_size=segment, mode=mode, **spec_overrides
        )
        self.attn = _PrefixAttention(d_model, n_heads, persistent_tokens, window=None)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.hook_mem_read, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_mem_out, self.hook_gate, self.hook_state = HookPoint(), HookPoint(), HookPoint()

    @property
    def mixing_hooks(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(f"memory.{h}" for h in self.memory.mixing_hooks) + ("hook_state",)

    @property
    def map_heads(self) -> int:
        """The long-term memory's heads (its map is the mixer's; ``memory.hook_o [B, L, H, D]``)."""
        return self.memory.n_heads

    @property
    def mixing_exact(self) -> bool:
        return self.memory.mixing_exact

    @torch.no_grad()  # as Mixer.mixing_acts: the recorded values carry no autograd graph
    def mixing_acts(self, x: torch.Tensor) -> dict:
        """The values of :attr:`mixing_hooks` on one fresh-stream call on ``x [B, T, d_model]``, each
        joined over the call's segment pieces (:func:`~mnemo.layers.hooks.join_pieces`: the memory's
        values concatenated along time, ``hook_state`` the state after the call), as
        :meth:`~mnemo.models.LanguageModel.run_with_cache` records them."""
        acts = {}
        for h, values in self._mixing_firings(x).items():
            if not values:  # (a 0-token call runs no segment: the memory's hooks never fire)
                continue
            point = self.get_submodule(h)
            td = point.time_dim
            lengths = [v.shape[td] if isinstance(v, torch.Tensor) and td is not None else 0 for v in values]
            acts[h] = join_pieces(point, values, lengths)
        return acts

    def _memory_acts(self, acts: dict) -> dict:
        """The ``memory.hook_*`` values of ``acts`` (names relative to the memory), after checking
        that they cover the whole stream (``NotImplementedError`` otherwise: a map of the last
        segment alone would be read as a fresh stream from the learned initial weights)."""
        mem = {h.removeprefix("memory."): a for h, a in acts.items() if h.startswith("memory.")}
        state = acts.get("hook_state")
        if "hook_q" not in mem and state is not None and state.offset == 0:
            # a 0-token call runs no segment, so the memory's hooks never fired: their values on no
            # tokens, from the memory's own 0-token call (its map is then [B, H, 0, 0])
            B = state.memory.weights[0].shape[0]
            w = self.memory.in_proj.weight
            return self.memory.mixing_acts(
                w.new_zeros(B, 0, self.d_model, dtype=input_dtype(self.memory.in_proj))
            )
        if state is not None and mem["hook_q"].shape[1] != state.offset:
            raise NotImplementedError(
                f"TitansMAC: the memory hooks recorded {mem['hook_q'].shape[1]} of the stream's "
                f"{state.offset} tokens (one segment of {self.segment}?); a map needs them all "
                "(record with mixing_acts or LanguageModel.run_with_cache, which join the segments)"
            )
        return mem

    def attribution(
        self, acts: dict, steps: int | None = None, method: str = "auto", *, rule: str | None = None
    ) -> ValueAttribution:
        """The long-term memory's :meth:`NeuralMemory.attribution` (from the ``memory.hook_*`` values,
        covering the whole stream: see :meth:`mixing`; maps ``[B, H, T, T]``). ``steps``, ``method``
        and ``rule`` (keyword-only: the quadrature rule of the integration steps, ``"midpoint"`` or
        ``"gauss_legendre"``; :func:`~mnemo.memory.attribution.attribute_read`) as there; ``steps``
        and ``rule`` default to the memory's :attr:`~NeuralMemory.attribution_steps` and
        :attr:`~NeuralMemory.attribution_rule` (``4``, ``"midpoint"``).

        Raises:
            NotImplementedError: the memory hooks hold fewer tokens than the stream.
            ValueError: ``rule`` not one of :data:`~mnemo.memory.attribution.RULES`, ``steps`` not
                an int ``>= 1``, ``method`` unknown
                (:func:`~mnemo.memory.attribution.value_attribution`)."""
        return self.memory.attribution(self._memory_acts(acts), steps, method, rule=rule)

    def mixing(self, acts: dict) -> Mixing:
        """The long-term memory's map (:meth:`NeuralMemory.mixing`): its read after each write
        (``m``, step 3) attributed to the values it wrote (from the attention outputs ``y``), over
        the whole stream (the segments' recorded values joined by :meth:`mixing_acts` or
        ``run_with_cache``; the memory's chunks are the segments, so this is the memory's own map
        of one call over them).

        Raises ``NotImplementedError`` when the memory hooks hold fewer tokens than the stream
        (a recording of the last segment only, made without joining the pieces)."""
        return self.memory.mixing(self._memory_acts(acts))

    def read_before(self, x, mem: NeuralMemoryState | MemoryState, conv_state):
        """``h = M*(q(x))`` with the segment-start weights (``N(anchor)``), no write. A state made
        under ``torch.inference_mode`` and read outside it (with autograd) is read from copies:
        autograd cannot save inference tensors."""
        m = self.memory
        q, _, _, gate, conv_state = m.qkv(x, conv_state)
        anchor = mem.anchor
        inference, involved = inference_involved(anchor)
        if involved and not inference:
            anchor = [a.clone() for a in anchor]
        W = [retention_map(m.spec, a).to(q.dtype) for a in anchor]
        gamma, beta = m.inner_norm_affine()  # [H, D] -> [H, 1, D] against [B, H, T, D]
        affine = None if gamma is None else (gamma[:, None].to(q.dtype), beta[:, None].to(q.dtype))
        o, _, _ = memory_apply(m.spec, W, q.transpose(1, 2), affine=affine)
        return m.read_out(o.transpose(1, 2), gate), conv_state

    def forward(self, x, state: TitansMACState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.memory.in_proj))
        check_state_type(state, TitansMACState, "TitansMAC")
        check_state_dtype(state, self, fast_weights=True)
        if state is not None:
            offset, mem_state, read_conv = state.offset, state.memory, state.read_conv
            att_cache, extra_cache = _kv(state.attn_k, state.attn_v), _kv(state.read_k, state.read_v)
        else:
            offset, mem_state = 0, self.memory.initial_state(B)
            read_conv = att_cache = extra_cache = None
        outs, t, pos = [], 0, offset
        while t < T:
            if pos % self.segment == 0:
                att_cache = extra_cache = None
            L = min(self.segment - pos % self.segment, T - t)
            xs = x[:, t : t + L]
            piece = enter_piece(t, L, T)  # the hooks' values of this segment: tokens t … t + L − 1
            try:
                h, read_conv = self.read_before(xs, mem_state, read_conv)
                h = self.hook_mem_read(h)
                y, att_cache, extra_cache = self.attn(
                    xs, att_cache, pos % self.segment, extra=h, extra_cache=extra_cache
                )
                y = self.hook_attn_out(y)
                m, mem_state = self.memory(y, mem_state, mode=mode)
                m = self.hook_mem_out(m)
                outs.append(self.o_proj(y * self.hook_gate(torch.sigmoid(m))))
            finally:
                leave_pieces(piece)
            t += L
            pos += L
        if T == 0:  # as state_spec(B, 0) and NeuralMemory's 0-token call: zero conv tails, empty caches
            q, *_, read_conv = self.memory.qkv(x, read_conv)
            cd = torch.float64 if q.dtype == torch.float64 else torch.float32  # the memory's (neural_memory)

            def cast(ts):  # the memory's tensors in its compute dtype (a bf16 module's in float32)
                return None if ts is None else tuple(t.to(cd) for t in ts)

            mem_state = replace(
                mem_state,
                weights=cast(mem_state.weights),
                momentum=cast(mem_state.momentum),
                anchor=cast(mem_state.anchor),
                anchor_decay=None if mem_state.anchor_decay is None else mem_state.anchor_decay.to(cd),
                conv=self.memory.qkv(x, mem_state.conv)[4],
            )
            if att_cache is None:
                att_cache = KVCache(*self.attn.kv(x, pos))
            if extra_cache is None:
                extra_cache = KVCache(*self.attn.kv(x, pos))
        new = TitansMACState(
            memory=mem_state,
            read_conv=read_conv,
            attn_k=None if att_cache is None else att_cache.k,
            attn_v=None if att_cache is None else att_cache.v,
            read_k=None if extra_cache is None else extra_cache.k,
            read_v=None if extra_cache is None else extra_cache.v,
            offset=pos,
        )
        y = torch.cat(outs, 1) if outs else x.new_zeros(B, 0, self.d_model)
        return y, show_state(self.hook_state, new)

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> TitansMACState:
        """The state after ``seq_len`` tokens as ``meta`` tensors: the memory's, the read-before
        conv tail and the segment-local KV caches (sequence and memory read-outs) of the tokens
        seen so far in the current segment (activation ``dtype``). Defaults: ``batch_size=1``,
        ``seq_len=0``."""
        act, _ = state_dtypes(self, dtype)
        B = batch_size
        seg = 0 if seq_len <= 0 else (seq_len - 1) % self.segment + 1  # tokens in the last segment

        def cache():
            return self.attn.cache_spec(B, seg, act)

        return TitansMACState(
            memory=self.memory.state_spec(B, seq_len, dtype),
            read_conv=_conv_spec(self.memory.conv, B, act),
            attn_k=cache(),
            attn_v=cache(),
            read_k=cache(),
            read_v=cache(),
            offset=seq_len,
        )

"""Test-time-trained memory mixers: the Titans long-term memory (LMM) for any ``MemorySpec``, and the
three Titans architectures MAC, MAG and MAL (Behrouz et al. 2024, "Titans: Learning to Memorize at
Test Time", §3–4).

Read/write semantics (identical in training, streaming and one-token decoding): the memory engine
(:mod:`mnemo.memory.engine`) writes token ``t`` with a gradient taken at its inner chunk's start
weights, and token ``t`` reads the weights *after* its own write. MAC additionally reads the memory
*before* each segment (the weights at the segment start, one segment = one inner chunk).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..memory import MemorySpec, MemoryState, init_state, neural_memory, preset
from ..memory.engine import memory_apply, retention_map
from ..ops.softmax_attention import WINDOW_BLOCK, KVCache, attention_mask, sliding_window_attention
from .attention import Attention
from .base import Mixer, MixerState, check_input, upcast
from .conv import ShortConvolution
from .norm import RMSNorm


def _spec(spec: MemorySpec | str, overrides: dict) -> MemorySpec:
    if isinstance(spec, str):
        return preset(spec, **overrides)
    return spec.replace(**overrides) if overrides else spec.validate()


class NeuralMemory(Mixer):
    """The long-term memory module (Titans §3.1 / LMM), for any point of the Miras design space.

        q, k, v = silu(conv(W x))           q, k ← q/‖q‖, k/‖k‖ per head
        θ_t = max_lr · sigmoid(W_θ x)       exp(g_t) = 1 − α_t = sigmoid(W_α x)
        η_t = sigmoid(W_η x)                δ_t = softplus(W_δ x)        (as the spec needs them)
        o_t = M_{W_t}(q_t)  (the memory engine)          y = W_o (RMSNorm(o) ⊙ silu(W_g x))

    ``persistent_tokens`` learned vectors are prepended to the stream once, at its start (Titans'
    persistent memory); their outputs are dropped. The memory's initial weights are learned
    parameters (one set per head); a matrix memory starts at zero.

    Args:
        d_model, n_heads, head_dim (default ``d_model // n_heads``).
        spec: a :class:`~mnemo.memory.MemorySpec` or a preset name (``"titans"``, ``"moneta"``, …);
            ``spec_overrides`` replace fields (e.g. ``chunk_size=32``).
        short_conv / conv_size: causal depthwise conv + SiLU on q, k, v.
        max_lr: upper bound of ``θ`` (default: the spec's ``max_lr`` or 1).
        mode: ``"chunk"`` or ``"recurrent"`` (reference) for ``T > 1``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        head_dim: int | None = None,
        spec: MemorySpec | str = "titans",
        short_conv: bool = True,
        conv_size: int = 4,
        persistent_tokens: int = 0,
        max_lr: float | None = None,
        mode: str = "chunk",
        **spec_overrides,
    ):
        super().__init__(mode)
        self.spec = _spec(spec, spec_overrides)
        head_dim = head_dim or d_model // n_heads
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.max_lr = max_lr if max_lr is not None else (self.spec.max_lr or 1.0)
        width = 3 * n_heads * head_dim
        # one projection for q, k, v and the output gate; one for all per-head gates
        self.in_proj = nn.Linear(d_model, width + n_heads * head_dim, bias=False)
        self.conv = ShortConvolution(width, conv_size) if short_conv else None
        s = self.spec
        self.gate_sizes = {"theta": n_heads}
        if s.decays:
            self.gate_sizes["alpha"] = n_heads * (head_dim if s.decay_per_channel else 1)
        if s.optimizer == "momentum":
            self.gate_sizes["eta"] = n_heads
        if s.objective == "huber":
            self.gate_sizes["delta"] = n_heads
        self.gate_proj = nn.Linear(d_model, sum(self.gate_sizes.values()), bias=True)
        self.init_weights = nn.ParameterList(
            [nn.Parameter(torch.zeros(n_heads, i, o)) for i, o in s.layer_dims(head_dim, head_dim)]
        )
        self.persistent = nn.Parameter(torch.zeros(persistent_tokens, d_model)) if persistent_tokens else None
        self.norm = RMSNorm(head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self._init_special()

    #: gate bias at init: θ ≈ 0.1 · max_lr, 1 − α ≈ 0.993 (slow forgetting), η ≈ 0.73, δ ≈ 0.97
    _GATE_BIAS = {"theta": math.log(0.1 / 0.9), "alpha": 5.0, "eta": 1.0, "delta": 0.5}

    def _init_special(self) -> None:
        with torch.no_grad():
            for bias, name in zip(self.gate_proj.bias.split(list(self.gate_sizes.values())), self.gate_sizes):
                bias.fill_(self._GATE_BIAS[name])
            if self.persistent is not None:
                nn.init.normal_(self.persistent, std=0.02)
            arch_is_matrix = self.spec.architecture == "matrix"
            for w in self.init_weights:
                if arch_is_matrix:
                    w.zero_()
                else:
                    nn.init.normal_(w, std=w.shape[-2] ** -0.5)

    def _gates(self, x):
        """``θ, g, η, δ`` for input ``x [B, T, d_model]`` (``None`` where the spec needs none)."""
        s, H = self.spec, self.n_heads
        raw = dict(zip(self.gate_sizes, upcast(self.gate_proj(x)).split(list(self.gate_sizes.values()), -1)))
        theta = self.max_lr * torch.sigmoid(raw["theta"])
        g = eta = delta = None
        if s.decays:
            g = F.logsigmoid(raw["alpha"])
            if s.decay_per_channel:
                g = rearrange(g, "b t (h k) -> b t h k", h=H)
        if "eta" in raw:
            eta = torch.sigmoid(raw["eta"])
        if "delta" in raw:
            delta = F.softplus(raw["delta"])
        return theta, g, eta, delta

    def qkv(self, x, conv_state):
        """``(q, k, v, out_gate, conv_state)`` for ``x [B, T, d_model]``; q and k L2-normalised."""
        qkv, gate = self.in_proj(x).split(
            [3 * self.n_heads * self.head_dim, self.n_heads * self.head_dim], -1
        )
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, conv_state)
        else:
            qkv = F.silu(qkv)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b t h d", three=3, h=self.n_heads)
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, gate, conv_state

    def initial_state(self, batch_size: int) -> MemoryState:
        return init_state(self.spec, [w for w in self.init_weights], batch_size)

    def read_out(self, o, gate):
        """``W_o (RMSNorm(o) ⊙ silu(gate))`` for memory reads ``o [B, T, H, D]``."""
        o = self.norm(o) * F.silu(rearrange(gate, "b t (h d) -> b t h d", h=self.n_heads))
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        offset = state.offset if state is not None else 0
        n_prefix = 0
        if self.persistent is not None and offset == 0:
            n_prefix = self.persistent.shape[0]
            x = torch.cat([self.persistent.to(x.dtype).expand(B, -1, -1), x], dim=1)
        q, k, v, gate, conv_state = self.qkv(x, state.conv if state is not None else None)
        theta, g, eta, delta = self._gates(x)
        mem = state.memory if state is not None and state.memory is not None else self.initial_state(B)
        o, mem = neural_memory(
            self.spec,
            q,
            k,
            v,
            theta,
            g=g,
            eta=eta,
            delta=delta,
            initial_state=mem,
            output_final_state=True,
            mode=self._mode(x.shape[1], mode),
        )
        y = self.read_out(o, gate)[:, n_prefix:]
        return y, MixerState(memory=mem, conv=conv_state, offset=offset + T)

    def state_size_bytes(self, batch_size: int = 1, seq_len: int = 0, dtype_bytes: int = 4) -> int:
        """Fast weights (and momentum, and the chunk anchor) in fp32 plus the conv tail."""
        n = sum(i * o for i, o in self.spec.layer_dims(self.head_dim, self.head_dim)) * self.n_heads
        copies = 2 + (self.spec.optimizer == "momentum")
        conv = 0 if self.conv is None else self.conv.channels * (self.conv.kernel_size - 1) * dtype_bytes
        return batch_size * (n * copies * 4 + conv)


# ------------------------------------------------------------------------------------------------
# attention with a persistent prefix (always visible) for the Titans architectures
# ------------------------------------------------------------------------------------------------


class _PrefixAttention(nn.Module):
    """Causal softmax attention whose keys are ``[persistent ‖ extra ‖ sequence]``.

    ``extra`` (MAC's memory read-outs) is visible causally: query ``j`` sees extra token ``i``
    iff ``i ≤ j`` in the segment. ``window`` limits the sequence keys (sliding window).
    """

    def __init__(self, d_model, n_heads, persistent_tokens, window=None, rope=True):
        super().__init__()
        self.inner = Attention(d_model, n_heads, window=window, rope=rope)
        self.persistent = (
            nn.Parameter(torch.randn(persistent_tokens, d_model) * 0.02) if persistent_tokens else None
        )

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
        if cache is not None:
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
        y = att.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        keep = S if att.window is None else min(S, att.window - 1)
        return y, KVCache(k_all[:, S - keep :], v_all[:, S - keep :]), new_extra


# ------------------------------------------------------------------------------------------------
# MAC, MAG, MAL
# ------------------------------------------------------------------------------------------------


class _MemoryAndWindow(Mixer):
    """The parts MAG and MAL share: a long-term memory and sliding-window attention with
    persistent keys; the decoding state is ``(KV cache of the window, memory state)``."""

    def __init__(self, d_model, n_heads, window, persistent_tokens, spec, mode, spec_overrides):
        super().__init__(mode)
        self.d_model = d_model
        self.memory = NeuralMemory(
            d_model, n_heads, spec=spec, persistent_tokens=persistent_tokens, mode=mode, **spec_overrides
        )
        self.attn = _PrefixAttention(d_model, n_heads, persistent_tokens, window=window)

    def state_size_bytes(self, batch_size=1, seq_len=0, dtype_bytes=4):
        a = self.attn.inner
        kept = min(seq_len, a.window - 1) if a.window else seq_len
        return (
            self.memory.state_size_bytes(batch_size)
            + 2 * batch_size * kept * a.n_kv_heads * a.head_dim * dtype_bytes
        )


class TitansMAG(_MemoryAndWindow):
    """Memory as a Gate (Titans §4.2): sliding-window attention and the memory branch, combined by a
    gate. ``o = W_o (RMSNorm(y_attn) ⊙ sigmoid(RMSNorm(y_mem)))`` with both branches over the same
    input; persistent tokens are keys every query sees (attention) and a prefix the memory writes."""

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

    def forward(self, x, state: MixerState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        offset = state.offset if state is not None else 0
        cache, mem_state = state.memory if state is not None else (None, None)
        y_attn, cache, _ = self.attn(x, cache, offset)
        y_mem, mem_state = self.memory(x, mem_state, mode=mode)
        y = self.o_proj(self.norm_attn(y_attn) * torch.sigmoid(self.norm_mem(y_mem)))
        return y, MixerState(memory=(cache, mem_state), offset=offset + T)


class TitansMAL(_MemoryAndWindow):
    """Memory as a Layer (Titans §4.3): the memory layer, then sliding-window attention on its output
    (with persistent keys). ``o = SWA(M(x))``."""

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

    def forward(self, x, state: MixerState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        offset = state.offset if state is not None else 0
        cache, mem_state = state.memory if state is not None else (None, None)
        h, mem_state = self.memory(x, mem_state, mode=mode)
        y, cache, _ = self.attn(self.mid_norm(h), cache, offset)
        return y, MixerState(memory=(cache, mem_state), offset=offset + T)


class TitansMAC(Mixer):
    """Memory as a Context (Titans §4.1). The sequence is cut into segments of ``segment`` tokens
    (= the memory's inner chunk). For each segment ``S``:

    1. ``h = M*(q(S))``: read the memory with the weights it had *before* the segment (no write);
    2. ``y = Attn([persistent ‖ h ‖ S])`` for the segment's tokens: persistent keys always visible,
       read-out ``h_i`` and token ``x_i`` visible to token ``j`` iff ``i ≤ j`` (causal);
    3. write the memory with ``y`` (its own q/k/v projections) and read it back *after* each
       token's write: ``m_t = M_t(q(y_t))``;
    4. ``o = W_o (y ⊙ sigmoid(m))``.

    Attention is thus segment-local (its cache resets at each segment boundary); everything older
    reaches a token only through the memory.
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
        self.d_model, self.segment = d_model, segment
        self.memory = NeuralMemory(
            d_model, n_heads, spec=spec, chunk_size=segment, mode=mode, **spec_overrides
        )
        self.attn = _PrefixAttention(d_model, n_heads, persistent_tokens, window=None)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def read_before(self, x, mem: MemoryState, conv_state):
        """``h = M*(q(x))`` with the segment-start weights (``N(anchor)``), no write."""
        m = self.memory
        q, _, _, gate, conv_state = m.qkv(x, conv_state)
        W = [retention_map(m.spec, a).to(q.dtype) for a in mem.anchor]
        o, _, _ = memory_apply(m.spec, W, q.transpose(1, 2))
        return m.read_out(o.transpose(1, 2), gate), conv_state

    def forward(self, x, state: MixerState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        offset = state.offset if state is not None else 0
        if state is not None:
            mem_state, read_conv, att_cache, extra_cache = state.memory
        else:
            mem_state = MixerState(memory=self.memory.initial_state(B))
            read_conv = att_cache = extra_cache = None
        outs, t, pos = [], 0, offset
        while t < T:
            if pos % self.segment == 0:
                att_cache = extra_cache = None
            L = min(self.segment - pos % self.segment, T - t)
            xs = x[:, t : t + L]
            h, read_conv = self.read_before(xs, mem_state.memory, read_conv)
            y, att_cache, extra_cache = self.attn(
                xs, att_cache, pos % self.segment, extra=h, extra_cache=extra_cache
            )
            m, mem_state = self.memory(y, mem_state, mode=mode)
            outs.append(self.o_proj(y * torch.sigmoid(m)))
            t += L
            pos += L
        return torch.cat(outs, 1), MixerState(
            memory=(mem_state, read_conv, att_cache, extra_cache), offset=pos
        )

    def state_size_bytes(self, batch_size=1, seq_len=0, dtype_bytes=4):
        """Memory state + the read-before conv tail + the segment-local KV caches (sequence and
        memory read-outs) of the tokens seen so far in the current segment."""
        a = self.attn.inner
        seg = 0 if seq_len <= 0 else (seq_len - 1) % self.segment + 1  # tokens in the last segment
        conv = self.memory.conv
        read_conv = 0 if conv is None else batch_size * conv.channels * (conv.kernel_size - 1) * dtype_bytes
        return (
            self.memory.state_size_bytes(batch_size)
            + read_conv
            + 4 * batch_size * seg * a.n_kv_heads * a.head_dim * dtype_bytes
        )

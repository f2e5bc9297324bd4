"""Softmax attention layer: RoPE (full or partial), grouped-query heads, optional sliding window,
per-head q/k norms, an output gate, KV cache."""

from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import nn

from ..ops._common import compute_dtype
from ..ops.softmax_attention import KVCache, softmax_attention, softmax_attention_map
from .base import Mixer, Mixing, check_input
from .hooks import HookPoint
from .linear_attention import state_dtypes
from .norm import RMSNorm
from .registry import register_mixer
from .rotary import RotaryEmbedding
from .state import spec, state_dataclass


@state_dataclass
class AttentionState:
    """The state of softmax attention.

    Attributes:
        kv: the :class:`~mnemo.ops.KVCache` of past keys and values ``[B, P, H_kv, K]`` (with a
            window, only the last ``window − 1``), in the activation dtype; ``None`` before the
            first call.
        offset: tokens consumed so far (rotary positions).
    """

    kv: KVCache | None = None
    offset: int = 0


@register_mixer("attention")
class Attention(Mixer):
    """Multi-head causal softmax attention (Vaswani et al. 2017) with rotary positions.

    Args:
        d_model: model width. n_heads: query heads ``H`` (4). n_kv_heads: key/value heads (``H`` by
            default; fewer = grouped-query attention, ``H % n_kv_heads == 0``).
        head_dim: default ``d_model // n_heads``.
        window: sliding-window size (keys visible to a query, itself included); ``None`` = full.
        rope: apply rotary embeddings (``rope_theta`` base) to q and k.
        mode: ``"parallel"`` (SDPA) or ``"recurrent"`` (reference token loop).
        rotary_dim: rotate only the first ``rotary_dim`` channels of each head (partial rotary,
            :class:`~mnemo.layers.rotary.RotaryEmbedding`); default the whole head.
        qk_norm: a per-head RMSNorm (width ``head_dim``, epsilon ``norm_eps``) on q and k before
            the rotary positions (Qwen3, Qwen3-Next). Default off.
        output_gate: ``o ⊙ sigmoid(W_gate x)`` per head and channel before the output projection
            (gated attention, as in Qwen3-Next; ``W_gate``: ``gate_proj``). Default off.
        bias: biases on the q, k, v, gate and output projections. Default off.
        norm_eps: the q/k norms' epsilon (default ``1e-5``).

    Hook points (``S`` = cached + new keys):

    * ``hook_q`` ``[B, T, H, K]``, ``hook_k`` ``[B, T, H_kv, K]`` (after rotary positions),
      ``hook_v`` ``[B, T, H_kv, V]``: this call's queries, keys and values as the op gets them;
    * ``hook_pattern`` ``[B, H, T, S]``: the softmax probabilities (float32, float64 for a
      float64 model). Built only while a hook is attached; the output is then computed as
      ``pattern @ v``, so a replaced pattern takes effect (otherwise the fused kernel runs and no
      ``T × S`` matrix is formed);
    * ``hook_o`` ``[B, T, H, V]``: the attention output, before the output gate and projection;
    * ``hook_state``: the :class:`~mnemo.ops.KVCache` after the call.

    State: :class:`AttentionState` (``kv``, ``offset``); with a window, the cache keeps only the
    last ``window − 1`` keys, so decoding memory stays bounded.
    """

    mixing_hooks = ("hook_q", "hook_k", "hook_v", "hook_o")

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
        bias: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__(mode)
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        head_dim = head_dim or d_model // n_heads
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window = window
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * head_dim, bias=bias)
        self.gate_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias) if output_gate else None
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(head_dim, rope_theta, rotary_dim) if rope else None
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern, self.hook_o, self.hook_state = HookPoint(), HookPoint(), HookPoint()

    def _mode(self, T: int, mode: str | None) -> str:
        return mode or self.mode

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
        B, T = check_input(x, self.d_model)
        offset = state.offset if state is not None else 0
        cache = state.kv if state is not None else None
        q = rearrange(self.q_proj(x), "b t (h d) -> b t h d", h=self.n_heads)
        k, v = rearrange(self.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if self.hook_pattern.active:
            o, cache = self._attend_through_pattern(q, k, v, cache)
        else:
            o, cache = softmax_attention(
                q,
                k,
                v,
                window=self.window,
                initial_state=cache,
                output_final_state=True,
                mode=self._mode(T, mode),
            )
        o, cache = self.hook_o(o), self.hook_state(cache)
        if self.gate_proj is not None:
            o = o * torch.sigmoid(rearrange(self.gate_proj(x), "b t (h d) -> b t h d", h=self.n_heads))
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, AttentionState(kv=cache, offset=offset + T)

    def _attend_through_pattern(self, q, k, v, cache: KVCache | None):
        """``o = pattern @ v`` with the probabilities passing ``hook_pattern`` (and the new cache)."""
        if cache is not None:
            k_all = torch.cat([cache.k.to(k.dtype), k], dim=1)
            v_all = torch.cat([cache.v.to(v.dtype), v], dim=1)
        else:
            k_all, v_all = k, v
        S = k_all.shape[1]
        cd = compute_dtype(q, k, v)
        pattern = self.hook_pattern(softmax_attention_map(q.to(cd), k_all.to(cd), self.window))
        vh = repeat(v_all.to(cd), "b s h d -> b s (h g) d", g=self.n_heads // self.n_kv_heads)
        o = torch.einsum("bhts,bshd->bthd", pattern.to(cd), vh).to(q.dtype)
        keep = S if self.window is None else min(S, self.window - 1)
        return o, KVCache(k_all[:, S - keep :], v_all[:, S - keep :])

    def mixing(self, acts: dict) -> Mixing:
        """Softmax probabilities (``acts["hook_pattern"]`` when recorded, else from q and k), the
        values repeated to the ``H`` query heads, and the attention output."""
        q, k, v, o = (acts[n] for n in self.mixing_hooks)
        M = acts.get("hook_pattern")
        if M is None:
            M = softmax_attention_map(q, k, window=self.window)
        v = repeat(v, "b t h d -> b t (h g) d", g=self.n_heads // self.n_kv_heads)
        return Mixing(M, v, o)

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> AttentionState:
        """The state after ``seq_len`` tokens as ``meta`` tensors: a KV cache of ``seq_len`` entries
        (at most ``window − 1``) in the activation ``dtype`` (default the parameters')."""
        act, _ = state_dtypes(self, dtype)
        kept = seq_len if self.window is None else min(seq_len, self.window - 1)
        shape = (batch_size, kept, self.n_kv_heads, self.head_dim)
        return AttentionState(kv=KVCache(spec(shape, act), spec(shape, act)), offset=seq_len)

"""Softmax attention layer: RoPE, grouped-query heads, optional sliding window, KV cache."""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from ..ops.softmax_attention import softmax_attention
from .base import Mixer, MixerState, check_input
from .rotary import RotaryEmbedding


class Attention(Mixer):
    """Multi-head causal softmax attention (Vaswani et al. 2017) with rotary positions.

    Args:
        d_model: model width. n_heads: query heads ``H``. n_kv_heads: key/value heads (``H`` by
            default; fewer = grouped-query attention, ``H % n_kv_heads == 0``).
        head_dim: default ``d_model // n_heads``.
        window: sliding-window size (keys visible to a query, itself included); ``None`` = full.
        rope: apply rotary embeddings (``rope_theta`` base) to q and k.
        mode: ``"parallel"`` (SDPA) or ``"recurrent"`` (reference token loop).

    State: ``MixerState(memory=KVCache, offset=tokens seen)``; with a window, the cache keeps only
    the last ``window − 1`` keys, so decoding memory stays bounded.
    """

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
    ):
        super().__init__(mode)
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        head_dim = head_dim or d_model // n_heads
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window = window
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta) if rope else None

    def _mode(self, T: int, mode: str | None) -> str:
        return mode or self.mode

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        offset = state.offset if state is not None else 0
        q = rearrange(self.q_proj(x), "b t (h d) -> b t h d", h=self.n_heads)
        k, v = rearrange(self.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=self.n_kv_heads)
        if self.rotary is not None:
            q, k = self.rotary(q, offset), self.rotary(k, offset)
        o, cache = softmax_attention(
            q,
            k,
            v,
            window=self.window,
            initial_state=state.memory if state is not None else None,
            output_final_state=True,
            mode=self._mode(T, mode),
        )
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MixerState(memory=cache, offset=offset + T)

    def state_size_bytes(self, batch_size: int = 1, seq_len: int = 0, dtype_bytes: int = 4) -> int:
        """Bytes of the KV cache after ``seq_len`` tokens (bounded by the window)."""
        kept = seq_len if self.window is None else min(seq_len, self.window - 1)
        return 2 * batch_size * kept * self.n_kv_heads * self.head_dim * dtype_bytes

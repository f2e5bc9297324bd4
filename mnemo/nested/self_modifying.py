"""Self-modifying Titans (Nested Learning, Behrouz et al. 2025, §5): a Titans-style memory whose
key, value, learning-rate and retention projections are themselves fast memories, rewritten in
context.

Per chunk of ``C`` tokens (absolute positions, like the memory's mini-batches):

1. read the projections with the weights they had at the chunk start::

       k, v = x M_k, x M_v        β = sigmoid(x M_β)        g = logsigmoid(x M_α + b_α)

   (with ``q`` from a slow projection; q, k, v through a short causal conv, q and k L2-normalised);
2. run the main memory over the chunk (any :class:`~mnemo.memory.MemorySpec`; by default the
   gated delta rule) and read it: ``o``;
3. rewrite every projection memory ``M_□`` with one delta-rule step on the chunk, toward targets it
   generates itself from the memory's output, ``ŷ_□ = o M_□`` (self-referential values)::

       M_□ ← M_□ (α_□ I − η_□ X̂ᵀX̂ / C) + η_□ X̂ᵀ Ŷ_□ / C       (x̂ = x / ‖x‖)

   i.e. ``M ← α M − η ∇_M ½ mean_t ‖x̂_tᵀ M − ŷ_t‖²``, with learned scalars ``α_□, η_□``. Because
   ``Ŷ_□ = O M_□``, the step is ``α M − η R M / C`` with one ``R = X̂ᵀ (X̂ − O)`` shared by all
   four projection memories.

A stream cut inside a chunk keeps the chunk's partial sum ``R`` in the state and applies the step
when the chunk completes, so any split equals one pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..layers.base import Mixer, MixerState, check_input, upcast
from ..layers.conv import ShortConvolution
from ..layers.norm import RMSNorm
from ..memory import MemorySpec, init_state, neural_memory, preset

PROJECTIONS = ("k", "v", "beta", "alpha")


class SelfModState(NamedTuple):
    """Fast projection weights ``{name: [B, d, out]}``, the chunk's partial sum ``R = X̂ᵀ(X̂ − O)``,
    the main memory's state, the conv tail and the stream position."""

    proj: dict
    r: torch.Tensor | None
    memory: object
    conv: torch.Tensor | None
    position: int


class SelfModifyingTitans(Mixer):
    """Self-modifying Titans mixer (see the module docstring).

    Args:
        d_model, n_heads; head size is ``d_model // n_heads`` (the targets ``o M_□`` need
            ``H · head_dim == d_model``).
        chunk_size: tokens between two rewrites of the projection memories.
        spec: the main memory (:class:`~mnemo.memory.MemorySpec` or preset name; default
            ``"gated_deltanet"``: matrix memory, l2, decay applied first, online updates).
        self_lr: upper bound of the projection memories' inner rate ``η_□``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        chunk_size: int = 64,
        spec: MemorySpec | str = "gated_deltanet",
        short_conv: bool = True,
        conv_size: int = 4,
        self_lr: float = 0.1,
        mode: str = "chunk",
    ):
        super().__init__(mode)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.spec = preset(spec) if isinstance(spec, str) else spec.validate()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.chunk_size, self.self_lr = chunk_size, self_lr
        D, H = d_model, n_heads
        self.out_sizes = {"k": D, "v": D, "beta": H, "alpha": H}
        self.init = nn.ParameterDict(
            {n: nn.Parameter(torch.randn(D, o) * D**-0.5) for n, o in self.out_sizes.items()}
        )
        self.alpha_bias = nn.Parameter(torch.full((H,), 5.0))  # slow forgetting at init
        self.self_alpha = nn.Parameter(torch.full((len(PROJECTIONS),), 4.0))  # α_□ = sigmoid(·) ≈ 0.98
        self.self_eta = nn.Parameter(torch.zeros(len(PROJECTIONS)))  # η_□ = self_lr · sigmoid(·)
        self.q_proj = nn.Linear(D, D, bias=False)
        self.g_proj = nn.Linear(D, D, bias=False)
        self.conv = ShortConvolution(3 * D, conv_size) if short_conv else None
        self.memory_init = nn.ParameterList(
            [
                nn.Parameter(torch.zeros(H, i, o))
                for i, o in self.spec.layer_dims(self.head_dim, self.head_dim)
            ]
        )
        self.norm = RMSNorm(self.head_dim)
        self.o_proj = nn.Linear(D, D, bias=False)

    def initial_state(self, B: int) -> SelfModState:
        proj = dict(self.init.items())  # shared [d, out] until the first rewrite makes them per sample
        mem = init_state(self.spec, list(self.memory_init), B)
        return SelfModState(proj, None, mem, None, 0)

    def _chunk(self, x, st: SelfModState, mode):
        """Tokens ``x [B, L, d]`` inside one chunk."""
        H, P = self.n_heads, st.proj
        k, v = x @ P["k"], x @ P["v"]
        beta = torch.sigmoid(upcast(x @ P["beta"]))
        g = F.logsigmoid(upcast(x @ P["alpha"]) + self.alpha_bias)
        qkv = torch.cat([self.q_proj(x), k, v], -1)
        conv = st.conv
        if self.conv is not None:
            qkv, conv = self.conv(qkv, conv)
        else:
            qkv = F.silu(qkv)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b t h d", three=3, h=H)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        o, mem = neural_memory(
            self.spec,
            q,
            k,
            v,
            beta,
            g=g if self.spec.decays else None,
            initial_state=st.memory,
            output_final_state=True,
            mode=mode,
        )
        # partial sum of the projection memories' delta-rule step (applied at the chunk end)
        xh = F.normalize(upcast(x), dim=-1)
        o_flat = rearrange(o, "b t h d -> b t (h d)").to(xh.dtype)
        r = xh.transpose(1, 2) @ (xh - o_flat)
        if st.r is not None:
            r = st.r + r
        pos = st.position + x.shape[1]
        st = SelfModState(P, r, mem, conv, pos)
        if pos % self.chunk_size == 0:
            st = self._rewrite(st)
        return o, st

    def _rewrite(self, st: SelfModState) -> SelfModState:
        C = self.chunk_size
        alpha = torch.sigmoid(self.self_alpha)
        eta = self.self_lr * torch.sigmoid(self.self_eta)
        proj = {}
        for i, n in enumerate(PROJECTIONS):
            M = st.proj[n]
            proj[n] = (alpha[i] * M - (eta[i] / C) * (st.r @ M.to(st.r.dtype))).to(M.dtype)
        return SelfModState(proj, None, st.memory, st.conv, st.position)

    def forward(self, x: torch.Tensor, state: MixerState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model)
        st = state.memory if state is not None and state.memory is not None else self.initial_state(B)
        mode = self._mode(T, mode)
        outs, t = [], 0
        while t < T:
            L = min(self.chunk_size - st.position % self.chunk_size, T - t)
            o, st = self._chunk(x[:, t : t + L], st, mode)
            outs.append(o)
            t += L
        o = torch.cat(outs, 1)
        o = self.norm(o) * F.silu(rearrange(self.g_proj(x), "b t (h d) -> b t h d", h=self.n_heads))
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        return y, MixerState(memory=st, offset=(state.offset if state else 0) + T)

    def state_size_bytes(self, batch_size: int = 1, seq_len: int = 0, dtype_bytes: int = 4) -> int:
        proj = sum(p.numel() for p in self.init.values())
        mem = sum(i * o for i, o in self.spec.layer_dims(self.head_dim, self.head_dim)) * self.n_heads
        sums = self.d_model * self.d_model + proj
        conv = 0 if self.conv is None else self.conv.channels * (self.conv.kernel_size - 1)
        return batch_size * 4 * (proj + sums + 2 * mem + conv)

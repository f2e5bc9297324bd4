"""Attention maps for every mixer: softmax probabilities, and the *implicit* ``T × T`` mixing matrix
of the linear, gated, delta-rule and state-space mixers — the matrix their parallel form multiplies
the values by (Ali et al. 2024, "The Hidden Attention of Mamba Models"; Zimerman et al. 2024).

``mixing(mixer, x)`` recomputes a mixer's internals from its (normalised) input ``x [B, T, d]``
with its own sub-modules and returns ``Mixing(maps [B, H, T, T], values [B, T, H, V], output)``
with ``output == maps @ values`` (per head), the op's result before the mixer's read-out. For
Mamba, heads are the ``d_inner`` channels (``V = 1``) and the ``D`` skip term is left out.
The test-time-trained memories (Titans, Moneta, …) are nonlinear in the values and have no such
matrix; ``mixing`` raises ``NotImplementedError`` for them.

``capture_maps(model, input_ids)`` records every layer's map with forward pre-hooks that only read
the mixer inputs (model outputs are unchanged).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ..layers import Attention, DeltaNet, GatedLinearAttention, LinearAttention, Mamba, Mamba2
from ..ops import (
    delta_rule,
    gated_delta_rule,
    gated_linear_attention,
    linear_attention,
    selective_scan,
    softmax_attention,
    ssd,
)
from ..ops._common import clamp_log_gate
from ..ops.softmax_attention import attention_mask


class Mixing(NamedTuple):
    maps: torch.Tensor  # [B, H, T, T]
    values: torch.Tensor  # [B, T, H, V]
    output: torch.Tensor  # [B, T, H, V]


def _causal(T, device):
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def decay_matrix(g: torch.Tensor) -> torch.Tensor:
    """``Γ_ts = exp(Σ_{r=s+1..t} g_r)`` for ``s ≤ t`` (0 above the diagonal): ``g [B, T, H]`` ->
    ``[B, H, T, T]``; per-channel ``g [B, T, H, K]`` -> ``[B, H, T, T, K]``."""
    T = g.shape[1]
    mask = _causal(T, g.device)
    if g.ndim == 3:
        b = rearrange(clamp_log_gate(g), "b t h -> b h t").cumsum(-1)
        return (b[..., :, None] - b[..., None, :]).masked_fill(~mask, float("-inf")).exp()
    b = rearrange(clamp_log_gate(g), "b t h k -> b h t k").cumsum(-2)
    return (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~mask[..., None], float("-inf")).exp()


def gla_map(q, k, g=None, scale=None) -> torch.Tensor:
    """Implicit map of (gated) linear attention: ``M_ts = Σ_k s q_tk k_sk Γ_ts(k)``, ``s ≤ t``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh = rearrange(q * scale, "b t h d -> b h t d"), rearrange(k, "b t h d -> b h t d")
    if g is None:
        return (qh @ kh.transpose(-1, -2)).masked_fill(~_causal(q.shape[1], q.device), 0.0)
    D = decay_matrix(g)
    if g.ndim == 3:
        return (qh @ kh.transpose(-1, -2)) * D
    return (qh[..., :, None, :] * kh[..., None, :, :] * D).sum(-1)


def delta_map(q, k, beta, g=None, scale=None) -> torch.Tensor:
    """Implicit map of the (gated) delta rule from its parallel (WY) form:
    ``o = P A⁻¹ diag(β) V`` with ``P = (s Q Kᵀ) ⊙ Γ`` (causal) and
    ``A = I + strict_tril(diag(β) (K Kᵀ) ⊙ Γ)``, so ``M = P A⁻¹ diag(β)``."""
    T = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh = rearrange(q * scale, "b t h d -> b h t d"), rearrange(k, "b t h d -> b h t d")
    bh = rearrange(beta, "b t h -> b h t")
    Gam = decay_matrix(g) if g is not None else _causal(T, q.device).to(q.dtype)
    strict = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1)
    A = torch.eye(T, dtype=q.dtype, device=q.device) + (
        (bh[..., :, None] * (kh @ kh.transpose(-1, -2))) * Gam
    ).masked_fill(~strict, 0.0)
    P = (qh @ kh.transpose(-1, -2)) * Gam
    Ainv_beta = torch.linalg.solve_triangular(A, torch.diag_embed(bh), upper=False, unitriangular=True)
    return P @ Ainv_beta


def scan_map(delta, A, B, C) -> torch.Tensor:
    """Implicit map of the selective scan per channel (Mamba): ``delta [Bt, T, Dm]`` (already
    softplus-ed / biased), ``A [Dm, N]``, ``B, C [Bt, T, N]`` ->
    ``M^(d)_ts = Σ_n C_tn exp(Σ_{r=s+1..t} Δ_rd A_dn) B_sn Δ_sd``: ``[Bt, Dm, T, T]``."""
    T = delta.shape[1]
    L = torch.einsum("btd,dn->bdnt", delta, A).clamp(min=-60.0).cumsum(-1)  # [Bt, Dm, N, T]
    mask = _causal(T, delta.device)
    Dmat = (L[..., :, None] - L[..., None, :]).masked_fill(~mask, float("-inf")).exp()  # [Bt,Dm,N,T,T]
    M = torch.einsum("btn,bdnts,bsn->bdts", C, Dmat, B)
    return M * rearrange(delta, "b s d -> b d 1 s")


# ------------------------------------------------------------------------------------------------


def mixing(mixer, x: torch.Tensor) -> Mixing:
    """The mixer's ``T × T`` map(s), values and op output for input ``x [B, T, d]`` (fresh stream)."""
    if isinstance(mixer, Attention):
        a = mixer
        q = rearrange(a.q_proj(x), "b t (h d) -> b t h d", h=a.n_heads)
        k, v = rearrange(a.kv_proj(x), "b t (two h d) -> two b t h d", two=2, h=a.n_kv_heads)
        if a.rotary is not None:
            q, k = a.rotary(q, 0), a.rotary(k, 0)
        out, _ = softmax_attention(q, k, v, window=a.window)
        G = a.n_heads // a.n_kv_heads
        k, v = (repeat(t, "b t h d -> b t (h g) d", g=G) for t in (k, v))
        T = x.shape[1]
        scores = torch.einsum("bthd,bshd->bhts", q, k) * a.head_dim**-0.5
        mask = attention_mask(T, T, window=a.window, device=x.device)
        return Mixing(scores.masked_fill(~mask, float("-inf")).softmax(-1), v, out)
    if isinstance(mixer, LinearAttention):
        q, k, v, _ = mixer._qkv(x, None)
        out, _ = linear_attention(q, k, v, feature_map=mixer.feature_map, normalize=mixer.normalize)
        phi = mixer.feature_map
        M = gla_map(phi(q * q.shape[-1] ** -0.5), phi(k), scale=1.0)
        if mixer.normalize:
            M = M / (M.sum(-1, keepdim=True) + 1e-6)
        return Mixing(M, v, out)
    if isinstance(mixer, GatedLinearAttention):
        q, k, v, _ = mixer._qkv(x, None)
        if mixer.rotary is not None:
            q, k = mixer.rotary(q, 0), mixer.rotary(k, 0)
        g = mixer.log_decay(x)
        out, _ = gated_linear_attention(q, k, v, g)
        return Mixing(gla_map(q, k, g), v, out)
    if isinstance(mixer, DeltaNet):
        qkv = mixer.qkv_proj(x)
        qkv = mixer.conv(qkv)[0] if mixer.conv is not None else F.silu(qkv)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b t h d", three=3, h=mixer.n_heads)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = torch.sigmoid(mixer.beta_proj(x))
        if mixer.gated:
            g = mixer.log_decay(x)
            out, _ = gated_delta_rule(q, k, v, g, beta)
        else:
            g = None
            out, _ = delta_rule(q, k, v, beta)
        return Mixing(delta_map(q, k, beta, g), v, out)
    if isinstance(mixer, Mamba):
        u, _ = mixer.conv(mixer.in_proj(x).chunk(2, dim=-1)[0])
        if mixer.selective:
            dt, Bm, Cm = mixer.x_proj(u).split([mixer.dt_rank, mixer.d_state, mixer.d_state], dim=-1)
        else:
            Bsz, T = x.shape[:2]
            dt = mixer.dt_lti.expand(Bsz, T, -1)
            Bm, Cm = mixer.B_lti.expand(Bsz, T, -1), mixer.C_lti.expand(Bsz, T, -1)
        delta = F.softplus(F.linear(dt, mixer.dt_proj.weight) + mixer.dt_proj.bias)
        A = -mixer.A_log.exp()
        out, _ = selective_scan(u, delta, A, Bm, Cm)
        return Mixing(scan_map(delta, A, Bm, Cm), u[..., None], out[..., None])
    if isinstance(mixer, Mamba2):
        G, N = mixer.n_groups, mixer.d_state
        _, xBC, dt = mixer.in_proj(x).split([mixer.d_inner, mixer.d_inner + 2 * G * N, mixer.n_heads], dim=-1)
        xBC, _ = mixer.conv(xBC)
        xs, Bm, Cm = xBC.split([mixer.d_inner, G * N, G * N], dim=-1)
        xs = rearrange(xs, "b t (h p) -> b t h p", p=mixer.head_dim)
        Bm, Cm = (
            repeat(rearrange(t, "b t (g n) -> b t g n", g=G), "b t g n -> b t (g r) n", r=mixer.n_heads // G)
            for t in (Bm, Cm)
        )
        dt = F.softplus(dt + mixer.dt_bias)
        A = -mixer.A_log.exp()
        out, _ = ssd(xs, dt, A, Bm, Cm)
        M = gla_map(Cm, Bm, dt * A, scale=1.0) * rearrange(dt, "b s h -> b h 1 s")
        return Mixing(M, xs, out)
    raise NotImplementedError(
        f"{type(mixer).__name__} has no implicit attention map (test-time-trained memories are nonlinear in "
        "their values); maps exist for attention, linear/gated linear attention, the delta rules, Mamba and "
        "Mamba-2"
    )


def capture_maps(model, input_ids: torch.Tensor, layers=None) -> dict[int, torch.Tensor]:
    """``{layer: [B, H, T, T]}`` for every mixing layer of ``model`` on ``input_ids`` (layers without
    a map are skipped). The hooks only read each mixer's input; the forward pass is unchanged.
    ``input_ids`` are moved to the model's device."""
    param = next(model.parameters(), None)
    if param is not None:
        input_ids = input_ids.to(param.device)
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    for i, block in enumerate(model.blocks):
        if layers is not None and i not in layers:
            continue
        handles.append(
            block.mixer.register_forward_pre_hook(
                lambda mod, args, kwargs=None, i=i: inputs.__setitem__(i, args[0].detach())
            )
        )
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    maps = {}
    with torch.no_grad():
        for i, x in inputs.items():
            try:
                maps[i] = mixing(model.blocks[i].mixer, x).maps
            except NotImplementedError:
                continue
    return maps

"""Self-modifying Titans as published (Nested Learning, Behrouz, Razaviyayn, Zhong & Mirrokni,
arXiv 2512.24695, §8.1–8.2, Eq. 83–93; HOPE = this mixer followed by a CMS, §8.3, Eq. 94–97).

Every projection except the query is itself a fast memory, rewritten in context by delta gradient
descent (DGD) toward values it generates itself. Per token ``t`` (chunk size 1; the general form
Eq. 83, the DGD step Eq. 88)::

    q_t = x_t W_q                                                   (slow projection)
    k_t = M_k,t−1(x_t)   v_t = M_v,t−1(x_t)   η_t ← M_η,t−1(x_t)   α_t ← M_α,t−1(x_t)
                         (q_t, k_t and v_t L2-normalised: §8.3 for q, k; v a choice, below)
    o_t = M_memory,t−1(q_t)                                         (read before the write)
    v̂_□,t = M_□,t−1(v_t)       □ ∈ {k, v, η, α, memory}             (self-generated values, Eq. 84)
    M_□,t = M_□,t−1 (α_t I − η_t k_t k_tᵀ) − η_t ∇L(M_□,t−1; k_t, v̂_□,t)          (DGD, Eq. 88)

Every memory, the main one included, is written toward the value it generates itself from ``v_t``
(Eq. 84–85: ``v̂_□,t`` and the per-memory objective ``min L(M_□; k_t, v̂_□,t)``; HOPE's Eq. 94
lists ``M_memory`` among the self-modified memories). The paper's set in Eq. 84–85 is
``□ ∈ {k, v, q, η, α, memory}``: it names ``q`` although Eq. 83 reads ``q_t = x_t W_q`` through
a slow projection, so there is no ``M_q`` to rewrite; with that slow ``W_q`` (the default) mnemo's
set is the one above, without ``q``, and ``adaptive_q=True`` adds ``M_q`` (below).
``memory_target="value"`` writes the main memory toward ``v_t`` itself instead (Titans' ``k → v``
association; mnemo's default before issue 37 — a named variant, not the paper's).

(Equation numbers follow arXiv 2512.24695 as transcribed by public reimplementations — the NL
context notes of aryateja2106/neural-memory-reproduction and kmccleary3301/nested_learning; the
per-line numbering inside Eq. 83 was not checked against the PDF. The transcriptions differ there:
the first writes the reads, ``v̂`` and the update line all under Eq. 83; the specs of
toddwbucy/NL_Hecate number §8.1's build-up as Eq. 76–78 (slow projections), Eq. 79–82 (adaptive
projections, ``q_t = M_q,t−1(x_t)`` included), Eq. 83 (the reads, ``q_t = x_t W_q``), Eq. 84
(``v̂``), Eq. 85 (the objectives), Eq. 88 (the DGD step), Eq. 89 (the residual MLP). Both give
Eq. 90 as the chunk-wise form, Eq. 91 as the MLP memory in it, Eq. 92/93 as the matrix-memory
recurrences for the dot-product and L2 objectives. The numbers cited here agree with both where
they agree.)

with ``L(M; k, v) = ½‖M(k) − v‖²`` (the L2 attentional bias, Eq. 93; ``v̂`` is a constant of the
inner gradient, as in Eq. 93's ``(M k − v̂) kᵀ``) and every memory a 2-layer residual MLP (Eq. 89/91)::

    M(x) = x + W_1 σ(W_2 x)        (here, rows as inputs: M(x) = x + σ(x W_a) W_b, W_a = W_2ᵀ, W_b = W_1ᵀ)

**Chunks** (Eq. 90, the chunk-wise form; Titans' mini-batch GD): with chunk size ``C`` every token
of a chunk reads, generates its values and takes its gradient at the weights its memory had at the
chunk start ``M_□,c`` (``c`` = the last multiple of ``C`` at or before the token's position), while
the DGD recursion runs token by token on the running weights. (Eq. 90 writes the index as
``C × ⌈t/C⌉``; read literally with ``t`` counted from 1 that is the state after the chunk's *last*
token, so a token would read weights written by the tokens after it. mnemo takes the chunk-start
state ``C × (⌈t/C⌉ − 1)``, the causal reading and the one Titans' mini-batch GD defines.)::

    k_t = M_k,c(x_t) …     o_t = M_memory,c(q_t)     v̂_□,t = M_□,c(v_t)   (□ = memory too)
    M_□,t = M_□,t−1 (α_t I − η_t k_t k_tᵀ) − η_t ∇L(M_□,c; k_t, v̂_□,t)

The projection memories (``M_k, M_v, M_η, M_α``) use ``proj_chunk_size`` and the main memory
``chunk_size`` (§8.2: the two are updated on different chunk sizes). ``C = 1`` is Eq. 83–88 exactly.
Chunk boundaries are absolute stream positions, so any split of a stream (also inside a chunk)
equals one pass: the state holds each memory's running weights, its chunk-start weights and the
stream position.

**The evaluated HOPE's options** (issue 37: the paper's Table 6 ablates "w/o momentum" and
"w/o inner-projection q" from HOPE, so the evaluated model had both; §8's equations give neither):

- ``adaptive_q=True``: the query is produced by its own adaptive memory, ``q_t = M_q,c(x̃_t)``
  (L2-normalised), a fifth projection memory in the group of ``M_k, M_v, M_η, M_α`` — same
  residual-MLP architecture, same chunk size ``proj_chunk_size``, written by the same DGD step
  toward its self-generated value ``M_q,c(v_t)``. The read ``q_t = M_q(x_t)`` is the query of
  §8.1's adaptive-projection step (Eq. 79 as one transcription numbers it), and the write is
  Eq. 84–85 with ``q`` in the paper's own set ``□ ∈ {k, v, q, η, α, memory}``; Eq. 83's reads keep
  ``q_t = x_t W_q``, the default ``adaptive_q=False``. The slow ``W_q`` is then absent.
- ``momentum=μ`` (``0 ≤ μ < 1``): DGD with momentum. The paper's Table 6 names the ablation but §8
  writes no equation for it; mnemo's choice, Titans' momentum with forgetting (Behrouz et al. 2024,
  §3.1: ``S_t = η_t S_{t−1} − θ_t ∇ℓ``, ``M_t = (1 − α_t) M_{t−1} + S_t``) placed on the gradient
  term of Eq. 88, the delta term staying on the weights, dampened (the gradient enters with weight
  ``1 − μ``, as an exponential moving average, so a steady gradient moves the weights at the rate
  ``η_t`` whatever ``μ``; choice, paper silent — see "Stability")::

      G_□,t = μ G_□,t−1 − (1 − μ) η_t ∇L(M_□,c; k_t, v̂_□,t)    M_□,t = M_□,t−1 (α_t I − η_t k_t k_tᵀ) + G_□,t

  (``W_b``'s part of ``G`` with its rate ``η_b,t``, below) for every memory (the projection
  memories and the main one), one constant ``μ`` (Titans' rate is data-dependent; here it is a
  hyperparameter), ``G_□,0 = 0`` at the start of a stream and carried in the state. ``μ = 0`` is
  Eq. 88 exactly. In the chunk form the momentum's decayed sums
  are products of two triangular ``L × L`` factors (:func:`_momentum_weights`) and the ``W_a``
  recursion one triangular solve (:func:`_wa_chunk_momentum`).

**DGD on an MLP memory** (choice, paper silent; the paper writes ``M(αI − η k kᵀ)`` and one rate
``η_t`` for the memory as a whole): the rank-one delta term acts on the layer whose input is ``k``
(``W_a``, input dim ``d``); the hidden layer, whose input ``h_t = σ(k_t W_a,c)`` is not normalised,
gets the retention ``α_t`` and a normalised-LMS rate (``hidden_step="nlms"``, the default)::

    W_a ← (α_t I − η_t k_t k_tᵀ) W_a − η_t k_t δ_tᵀ        δ_t = ∂L/∂(k_t W_a) at M_□,c
    W_b ← α_t W_b − η_b,t h_tᵀ e_t                          e_t = M_□,c(k_t) − v̂_□,t
    η_b,t = η_t / max(1, ‖h_t‖²)                           h_t = σ(k_t W_a,c)

so the effective step of the ``W_b`` update, ``η_b,t ‖h_t‖² ≤ η_t``, is bounded as unit keys bound
``W_a``'s (a hidden input of norm ≤ 1 keeps Eq. 88's ``η_t``). ``hidden_step="plain"``:
``η_b,t = η_t`` (mnemo before the fix; unbounded effective step ``η_t ‖h_t‖²``).

**Stability: why ``v_t`` is normalised, ``W_b``'s rate is NLMS and the momentum dampened**
(choices, paper silent; measured on tinyshakespeare with the ``hope`` presets at their default
width ``d_model=128``, 4 layers). Before these choices every preset gave NaN logits at
initialisation. With ``v_t = M_v(x_t)`` unnormalised (``‖v_t‖`` 2–5, against ``‖k_t‖ = 1``) and the
self-generated target ``v̂ = M_c(v_t)``, a step toward ``v̂`` raises the target more than the
prediction (``h_vᵀh_k > ‖h_k‖²`` for ``h_v = σ(v W_a)``): from the first token the error
``‖M(k) − M(v)‖`` after a step is larger than before it (layer 2 of ``hope``, chunk size 1:
0.88 → 0.90, where the same step with the target held fixed gives 0.86). ``W_b``'s spectral norm
grows (0.19 → 1.3 in 14 tokens) while the plain step is far inside its LMS bound
(``η‖h‖² ≈ 0.02``); once ``η σ_max(W_b)² ≈ 0.8`` (the gain of the ``W_a`` gradient step) the step
is expansive even for a fixed target and the weights overflow within two tokens (NaN logits from
token 19; with the default chunks 16/64 from token 112, ``‖W_b‖_F`` 1.1 → 3.3 over the first 88
tokens first). Normalising
``v_t`` (``v_norm=True``) removes the scale mismatch: every preset finite over 2,048 tokens; NLMS
alone does not (NaN from tokens 96–177). The two further choices guard trained weights: after 40
training steps at ``d_model=64`` (undampened momentum), ``hope_paper`` (``μ = 0.9``) with
normalised ``v`` alone overflowed at token 720 (``η‖h‖²`` grew past 0.07, then ``‖h‖ > 1``), with
NLMS too it stayed finite; on 256-token windows it still overflowed after 3 steps (NaN from token
192), as the undampened momentum multiplies a chunk's gradient steps, all taken at the chunk-start
weights, by up to ``1/(1 − μ) = 10``; dampened, it trained 20 steps (loss 3.99 → 2.59) and stayed
finite over 2,048 tokens. Normalised ``v`` and NLMS did not change the training loss of ``hope`` at
``d_model=64`` (no momentum; 40 steps, mean of the last five 2.366 before, 2.365 after).

**Forms.** ``mode="recurrent"``: the token loop above (gradients by autograd, the rank-one term as
written). ``mode="chunk"``: per chunk, all reads and all gradient factors in batched matmuls at the
chunk-start weights; the ``W_a`` recursion is a gated delta rule (``exp(g) = α_t``, ``β = η_t/α_t``,
value ``−α_t δ_t``), of which only the chunk's final state is formed (:func:`_wa_chunk`: one
``L × L`` triangular inverse shared by the memories of a group, no per-token output); the ``W_b``
recursion is a decayed sum in one product (``η_b,t`` a per-token, per-memory factor in it). The
gradient factors are written out by hand (``e``, ``δ`` of Eq. 93); weights still shared over the
batch are read in one product (:func:`_wmul`).

**Choices where the paper is silent** (all documented here, none hidden in the code):

- ``η_t, α_t``: ``M_η, M_α`` are ``d → d`` memories like the others (their self-generated values
  ``M_□(v_t)`` and keys ``k_t`` need ``d``-dim inputs and outputs); the scalars are a slow linear
  read-out: ``α_t = sigmoid(w_αᵀ M_α(x_t) + b_α)``, ``η_t = α_t · β_max · sigmoid(w_ηᵀ M_η(x_t) + b_η)``.
  Writing ``η_t = α_t β_t`` with ``β_t ≤ 1`` keeps ``α_t I − η_t k kᵀ = α_t (I − β_t k kᵀ)`` a
  contraction for unit ``k`` (the stability DGD's ``η' = η/(1+η)`` gives in Eq. 57).
- one memory per ``□`` over the whole ``d_model`` (no heads inside the memories); ``n_heads``
  only groups the output norm and gate.
- ``k_t`` and ``q_t`` are L2-normalised (§8.3 "L2 normalisation on q and k"); ``v_t`` too
  (``v_norm=True``, the default; the paper names q and k only — see "Stability" above;
  ``v_norm=False``: the unnormalised ``v_t = M_v(x_t)``, mnemo before the fix, which overflows at
  the default width).
- a short causal convolution (+SiLU) on ``x`` feeds ``W_q`` (or ``M_q``) and the projection memories
  (§8.3 "local convolutions, window 4"); output ``y = W_o(RMSNorm(o) ⊙ silu(W_g x))`` per head
  (Titans' output gate).
- σ = GELU; hidden width ``expansion · d`` (default ``d``).
- the main memory's self-generated target ``M_memory,c(v_t)`` is read at its chunk-start weights,
  like the projection memories' (Eq. 90 applied to Eq. 84's ``v̂``).
- a consequence of Eq. 90 kept as written: inside a memory chunk the read ``o_t`` uses the chunk-start
  weights, so tokens of the same chunk reach ``o_t`` only through ``q_t`` (and the short conv).
- initial weights (all memories, learned, one set shared over the batch) get outer gradients
  through every fast-weight step (no stop-gradient anywhere); fast weights are per sample.

Shapes: ``x, y: [B, T, d_model]``; state weights ``[B, G, d, h]`` / ``[B, G, h, d]`` with ``G = 4``
projection memories (k, v, η, α; ``G = 5`` with q) or ``G = 1`` (main memory), float32 (float64 for
float64 input); the momentum buffers (``momentum > 0``) shaped and typed like the weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .._compile_marks import eager_under_compile
from ..memory import MemorySpec
from ..memory.attribution import ValueAttribution, attribution_of_read
from ..memory.engine import _act_with_grad, memory_apply
from ..ops._common import clamp_log_gate, inference_involved
from ..ops._layout import rearrange
from .base import Mixer, Mixing, check_input, upcast
from .cms import check_dtype, check_state_dtype
from .conv import ShortConvolution
from .hooks import HookPoint, show_state
from .linear_attention import check_bool, check_heads
from .norm import RMSNorm
from .registry import register_mixer
from .state import spec, state_dataclass
from .titans import state_dtypes

PROJECTIONS = ("k", "v", "eta", "alpha")
#: with ``adaptive_q=True`` the query is a fifth projection memory, ``q_t = M_q(x_t)``
PROJECTIONS_Q = (*PROJECTIONS, "q")
#: the main memory's write target: its self-generated ``M_memory(v_t)`` (Eq. 84/94) or ``v_t``
MEMORY_TARGETS = ("self", "value")
#: the rate of a memory's hidden layer ``W_b``: normalised by its input's norm (NLMS) or Eq. 88's ``η_t``
HIDDEN_STEPS = ("nlms", "plain")


@state_dataclass
class SelfModifyingTitansState:
    """The stream state of :class:`SelfModifyingTitans` (weights float32, float64 for a float64
    model; a fresh state holds the learned initial weights expanded over the batch, no copies).

    Attributes:
        proj: running weights ``(W_a [B, 4, d, h], W_b [B, 4, h, d])`` of ``M_k, M_v, M_η, M_α``.
        proj_anchor: their weights at the current projection chunk's start.
        memory: running weights ``(W_a [B, 1, d, h], W_b [B, 1, h, d])`` of ``M_memory``.
        memory_anchor: its weights at the current memory chunk's start.
        conv: the short-conv tail ``[B, d, W − 1]`` (activation dtype) or ``None``.
        offset: tokens consumed (chunk boundaries are absolute stream positions; default ``0``).
        proj_momentum, memory_momentum: (``momentum > 0``) the DGD momentum ``(m_a, m_b)`` of each
            group, shaped like its weights; ``None`` without momentum (default).
        proj_pending, memory_pending: ``None`` (default) outside a task-signal model's segment loop.
            Inside it (:meth:`SelfModifyingTitans.deferring`) the DGD steps of a chunk's tokens read
            so far are kept as their inputs ``(k [B, n, d], v̂ [B, G, n, d], log α [B, n], β [B, n])``
            and ``proj``/``memory`` (and the momentum) are the weights *before* those ``n`` tokens;
            :meth:`SelfModifyingTitans.settle` applies them. A state a model returns never has them.

    With ``adaptive_q=True`` the projection group holds five memories (``G = 5``: k, v, η, α, q).
    """

    proj: tuple
    proj_anchor: tuple
    memory: tuple
    memory_anchor: tuple
    conv: torch.Tensor | None = None
    offset: int = 0
    proj_momentum: tuple | None = None
    memory_momentum: tuple | None = None
    proj_pending: tuple | None = None
    memory_pending: tuple | None = None


# eager under torch.compile (a graph break): dynamo (torch 2.13) traces the fresh alias and the
# autograd.grad below into a graph whose loss is not connected to the alias, and the gradient call
# fails ("appears to not have been used in the graph"); the token path is decoding's and the
# reference's, the training chunks use dgd_chunk
@eager_under_compile
def dgd_token(
    spec: MemorySpec, W, A, k, vhat, log_alpha, beta, mom=None, mu: float = 0.0, nlms: bool = False
):
    """One DGD step of a group of ``G`` residual-MLP memories (the reference; autograd gradient).

    ``W``/``A``: running / chunk-start weights ``(W_a [B, G, d, h], W_b [B, G, h, d])``; ``k [B, d]``
    (unit norm); ``vhat [B, G, d]`` targets; ``log_alpha, beta: [B]``; ``η = α β``. ``mom``: the
    momentum ``(m_a, m_b)`` shaped like ``W`` (``None``: no momentum, ``mu`` must be 0). Returns the
    new running weights and momentum::

        m_a ← μ m_a − (1 − μ) η ∇_{W_a} L(A; k, v̂)     m_b ← μ m_b − (1 − μ) η_b ∇_{W_b} L(A; k, v̂)
        W_a ← α W_a − η k (kᵀ W_a) + m_a                 W_b ← α W_b + m_b

    with ``η_b = η / max(1, ‖h‖²)``, ``h = σ(k A_a)`` per memory (``nlms=True``) or ``η_b = η``
    (with ``μ = 0`` and ``η_b = η`` this is Eq. 88's step, ``W_a ← α W_a − η k kᵀ W_a − η ∇``).
    Defaults: ``mu=0.0``, ``nlms=False``. Under ``torch.inference_mode`` (which switches off the
    autograd the gradient needs), or given tensors made under it, the step runs outside inference
    mode on copies (detached under inference mode).
    """
    inference, involved = inference_involved((*W, *A, *(mom or ()), k, vhat, log_alpha, beta))
    if involved:
        grad = torch.is_grad_enabled() and not inference
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            W, A = tuple(w.clone() for w in W), tuple(a.clone() for a in A)
            mom = None if mom is None else tuple(m.clone() for m in mom)
            k, vhat, log_alpha, beta = k.clone(), vhat.clone(), log_alpha.clone(), beta.clone()
            return dgd_token(spec, W, A, k, vhat, log_alpha, beta, mom, mu, nlms)
    need_graph = torch.is_grad_enabled()
    alpha = log_alpha.exp()
    eta = alpha * beta
    with torch.enable_grad():
        # a fresh alias: the gradient counts only this use of the weights (v̂ is a constant of it)
        A_eff = [a.view_as(a) if a.requires_grad else a.detach().requires_grad_(True) for a in A]
        G = A[0].shape[1]
        y = memory_apply(spec, A_eff, k[:, None, None, :].expand(-1, G, 1, -1))[0][:, :, 0]
        loss = 0.5 * (y - vhat).square().sum()
        ga, gb = torch.autograd.grad(loss, A_eff, create_graph=need_graph)
    Wa, Wb = W
    a4, e4 = alpha[:, None, None, None], eta[:, None, None, None]
    eb = e4
    if nlms:  # W_b's rate η_t / max(1, ‖h_t‖²), h_t = σ(k_t W_a,c) the hidden layer's input (σ = GELU)
        h = F.gelu(torch.einsum("bd,bgdh->bgh", k, A[0]))
        eb = e4 / h.square().sum(-1).clamp_min(1.0)[:, :, None, None]
    ma, mb = -e4 * ga, -eb * gb
    if mom is not None:  # dampened: the gradient enters the momentum with weight 1 − μ
        ma, mb = mu * mom[0] + (1 - mu) * ma, mu * mom[1] + (1 - mu) * mb
    kW = torch.einsum("bd,bgdh->bgh", k, Wa)
    Wa = a4 * Wa - e4 * torch.einsum("bd,bgh->bgdh", k, kW) + ma
    Wb = a4 * Wb + mb
    if not need_graph:
        Wa, Wb, ma, mb = Wa.detach(), Wb.detach(), ma.detach(), mb.detach()
    return (Wa, Wb), ((ma, mb) if mom is not None else None)


def _wmul(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``x [B, G, L, i] @ W [B, G, i, o]``. Weights still shared over the batch (the initial state is
    the slow weights expanded with batch stride 0) take one ``[G, B·L, i] @ [G, i, o]`` product:
    no ``B`` copies of the weights, and their gradient is summed over the batch inside the product."""
    if W.shape[0] > 1 and W.stride(0) == 0:
        B, G, L, i = x.shape
        y = x.transpose(0, 1).reshape(G, B * L, i) @ W[0]
        return y.reshape(G, B, L, -1).transpose(0, 1)
    return x @ W


def _mlp(A, x: torch.Tensor) -> torch.Tensor:
    """``M(x) = x + gelu(x W_a) W_b`` for ``x [B, G, L, d]`` (this module's fixed memory spec: a
    2-layer residual GELU MLP, no norm; the same function as :func:`memory_apply`)."""
    return x + _wmul(F.gelu(_wmul(x, A[0])), A[1])


def _wa_chunk(k, Wa, u, log_alpha, beta):
    """Final state of the gated delta rule ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t u_tᵀ``
    over one chunk, without its per-token output (only ``S_L`` is needed here).

    ``k [B, L, d]`` (shared by the ``G`` memories), ``Wa = S_0 [B, G, d, h]``, ``u [B, G, L, h]``,
    ``log_alpha, beta [B, L]``. With ``γ_t = Π_{r≤t} α_r`` and the corrected values
    ``ũ_t = u_t − α_t S_{t−1}ᵀ k_t``, unrolling gives the unit lower-triangular system
    ``ũ_t + Σ_{s<t} β_s (γ_t/γ_s) (k_tᵀ k_s) ũ_s = u_t − γ_t S_0ᵀ k_t`` and
    ``S_L = γ_L S_0 + Σ_s β_s (γ_L/γ_s) k_s ũ_sᵀ`` (the WY / UT form of the op's chunk form).
    """
    B, L = log_alpha.shape
    G, h = Wa.shape[1], Wa.shape[3]
    gc = clamp_log_gate(log_alpha).cumsum(-1)  # log γ_t (the op's clamp of log α)
    lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    # γ_t/γ_s for s < t, 0 elsewhere (masking before exp keeps every factor ≤ 1, no overflow)
    decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, float("-inf")).exp()
    A = (k @ k.transpose(-1, -2)) * decay * beta[:, None, :]  # A_ts = β_s (γ_t/γ_s) k_tᵀ k_s
    rhs = u - gc.exp()[:, None, :, None] * (k[:, None] @ Wa)  # u_t − γ_t S_0ᵀ k_t   [B, G, L, h]
    # one solve for all G memories: they share k, β, α, so G is folded into the right-hand columns
    rhs = rhs.transpose(1, 2).reshape(B, L, G * h)
    # (I + A)⁻¹ (unit diagonal implied), then a matmul: much faster on CPU than solving the G·h columns
    if A.dtype in (torch.bfloat16, torch.float16):  # (under autocast: the triangular solve takes neither)
        A = A.float()
    eye = torch.eye(L, dtype=A.dtype, device=A.device).expand(B, L, L)
    ut = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True) @ rhs  # ũ = (I + A)⁻¹ rhs
    w = beta * torch.exp(gc[:, -1:] - gc)  # β_s γ_L/γ_s
    kw = (k * w[..., None]).transpose(-1, -2)  # [B, d, L]
    upd = (kw @ ut).reshape(B, k.shape[-1], G, h).transpose(1, 2)  # Σ_s β_s (γ_L/γ_s) k_s ũ_sᵀ   [B, G, d, h]
    return gc[:, -1].exp()[:, None, None, None] * Wa + upd


def _momentum_weights(log_alpha, mu: float, L: int):
    """``(F [B, L, L], E [B, L])`` of the momentum's decayed sums over a chunk (tokens ``1 … L``,
    ``γ_t = Π_{r≤t} α_r``): ``F_ts = Σ_{j=s}^{t} (γ_t/γ_j) μ^{j−s}`` (``s ≤ t``, else 0) and
    ``E_t = Σ_{j≤t} (γ_t/γ_j) μ^j``, so that ``Σ_{j≤t} (γ_t/γ_j) m_j = E_t m_0 + Σ_{s≤t} F_ts k_s u_sᵀ``
    for ``m_j = μ m_{j−1} + k_j u_jᵀ``. Built as products of lower-triangular factors whose entries
    are ``≤ 1`` (masked in log space before ``exp``)."""
    gc = clamp_log_gate(log_alpha).cumsum(-1)
    idx = torch.arange(L, device=log_alpha.device)
    incl = idx[:, None] >= idx[None, :]
    G = (gc[:, :, None] - gc[:, None, :]).masked_fill(~incl, float("-inf")).exp()  # γ_t/γ_j, j ≤ t
    lag = (idx[:, None] - idx[None, :]).clamp_min(0).to(log_alpha.dtype)
    Mu = torch.where(incl, torch.as_tensor(mu, dtype=log_alpha.dtype) ** lag, 0.0)  # μ^{j−s}, s ≤ j
    F = G @ Mu
    E = G @ (torch.as_tensor(mu, dtype=log_alpha.dtype) ** (idx + 1).to(log_alpha.dtype))
    return F, E


def _wa_chunk_momentum(k, Wa, ma, u, log_alpha, beta, mu: float, weights=None):
    """Final ``(S_L, m_L)`` over one chunk of the DGD recursion with momentum on its gradient term::

        m_t = μ m_{t−1} + k_t u_tᵀ          S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + m_t

    ``k [B, L, d]`` (shared by the ``G`` memories), ``Wa = S_0, ma = m_0 [B, G, d, h]``,
    ``u [B, G, L, h]`` (here ``−(1 − μ) η_t δ_t``, dampened), ``log_alpha, beta [B, L]``. With
    ``r_t = k_tᵀ S_{t−1}`` the recursion is ``S_t = α_t S_{t−1} + m_t − α_t β_t k_t r_t``; unrolled
    (``F, E`` of :func:`_momentum_weights`)::

        S_t = γ_t S_0 + E_t m_0 + Σ_{s≤t} k_s (F_ts u_s − (γ_t/γ_s) α_s β_s r_s)ᵀ

    so the ``r_t`` solve the unit lower-triangular system
    ``r_t + Σ_{s<t} (k_tᵀk_s)(γ_{t−1}/γ_{s−1}) β_s r_s = γ_{t−1} k_tᵀS_0 + E_{t−1} k_tᵀm_0 +
    Σ_{s<t} (k_tᵀk_s) F_{t−1,s} u_s``, and ``S_L`` follows from the line above at ``t = L``;
    ``m_L = μ^L m_0 + Σ_s μ^{L−s} k_s u_sᵀ``. With ``μ = 0`` this is :func:`_wa_chunk`.
    ``weights``: ``(F, E)`` of :func:`_momentum_weights` when the caller has them (default: built here).
    """
    B, L = log_alpha.shape
    G, h = Wa.shape[1], Wa.shape[3]
    dt = log_alpha.dtype
    gc = clamp_log_gate(log_alpha).cumsum(-1)  # log γ_t
    gprev = torch.cat([gc.new_zeros(B, 1), gc[:, :-1]], 1)  # log γ_{t−1}
    Fm, E = _momentum_weights(log_alpha, mu, L) if weights is None else weights
    Fprev = torch.cat([Fm.new_zeros(B, 1, L), Fm[:, :-1]], 1)  # F_{t−1, s} (row t = 1: none)
    Eprev = torch.cat([E.new_zeros(B, 1), E[:, :-1]], 1)
    lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
    kk = k @ k.transpose(-1, -2)  # k_tᵀ k_s
    # (γ_{t−1}/γ_{s−1}) β_s for s < t (masked before exp: every factor ≤ 1)
    decay = (gprev[:, :, None] - gprev[:, None, :]).masked_fill(~lower, float("-inf")).exp()
    A = kk * decay * beta[:, None, :]
    Wk = k[:, None] @ Wa  # k_tᵀ S_0   [B, G, L, h]
    mk = k[:, None] @ ma  # k_tᵀ m_0
    rhs = gprev.exp()[:, None, :, None] * Wk + Eprev[:, None, :, None] * mk
    rhs = rhs + ((kk * lower) * Fprev)[:, None] @ u  # Σ_{s<t} (k_tᵀk_s) F_{t−1,s} u_s
    rhs = rhs.transpose(1, 2).reshape(B, L, G * h)
    if A.dtype in (torch.bfloat16, torch.float16):  # (under autocast: the triangular solve takes neither)
        A = A.float()
    eye = torch.eye(L, dtype=A.dtype, device=A.device).expand(B, L, L)
    r = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True) @ rhs
    r = r.reshape(B, L, G, h).transpose(1, 2)  # [B, G, L, h]
    # S_L = γ_L S_0 + E_L m_0 + Σ_s k_s (F_Ls u_s − (γ_L/γ_s) α_s β_s r_s)ᵀ
    wr = (torch.exp(gc[:, -1:] - gc) * log_alpha.exp() * beta)[:, None, :, None]
    inner = Fm[:, -1][:, None, :, None] * u - wr * r  # [B, G, L, h]
    S = gc[:, -1].exp()[:, None, None, None] * Wa + E[:, -1][:, None, None, None] * ma
    S = S + k[:, None].transpose(-1, -2) @ inner
    idx = torch.arange(L, device=k.device)
    pw = (torch.as_tensor(mu, dtype=dt) ** (L - 1 - idx).to(dt))[None, None, :, None]  # μ^{L−s}
    m = (mu**L) * ma + k[:, None].transpose(-1, -2) @ (pw * u)
    return S, m


def dgd_chunk(
    spec: MemorySpec, W, A, k, vhat, log_alpha, beta, mom=None, mu: float = 0.0, nlms: bool = False
):
    """``L`` DGD steps inside one chunk (all gradients at the chunk-start weights ``A``), batched.

    ``W, A`` as in :func:`dgd_token`; ``k [B, L, d]``; ``vhat [B, G, L, d]``; ``log_alpha, beta:
    [B, L]``. Without momentum (``mom=None``) ``W_a`` follows the gated delta rule
    ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t (−α_t δ_t)ᵀ`` (final state only,
    :func:`_wa_chunk`; the same recursion as :func:`mnemo.ops.gated_delta_rule`) and ``W_b`` the
    decayed sum ``W_b,L = (Π α) W_b − Σ_s η_b,s (Π_{r>s} α_r) a_sᵀ e_s`` (``a_s = σ(k_s A_a)``;
    ``η_b,s = η_s / max(1, ‖a_s‖²)`` per memory with ``nlms=True``, else ``η_s``). With momentum
    ``(m_a, m_b)`` (coefficient ``mu``, dampened: the gradient's weight ``1 − μ``):
    :func:`_wa_chunk_momentum` for ``W_a`` and the same decayed sums (:func:`_momentum_weights`)
    for ``W_b``, with ``η_b,s``. Returns ``(W, mom)`` as
    :func:`dgd_token`. Defaults: ``mu=0.0``, ``nlms=False``.
    """
    Wa, Wb = W
    B, G = Wa.shape[:2]
    L, d = k.shape[1], k.shape[2]
    # the gradient factors of ½‖M_A(k) − v̂‖² at the chunk-start weights A, by hand (Eq. 93):
    # e = M_A(k) − v̂ (layer W_b, input a = gelu(k W_a)), δ = (e W_bᵀ) ⊙ gelu'(k W_a) (layer W_a, input k)
    kg = k[:, None].expand(B, G, L, d)
    a, slope = _act_with_grad(spec.activation, _wmul(kg, A[0]))
    e = kg + _wmul(a, A[1]) - vhat
    delta = _wmul(e, A[1].transpose(-1, -2)) * slope
    alpha = log_alpha.exp()
    # W_b's per-token rate factor: 1, or 1 / max(1, ‖a_t‖²) (nlms)   [B, G, L, 1]
    nb = 1.0 / a.square().sum(-1, keepdim=True).clamp_min(1.0) if nlms else None
    if mom is not None:
        eta = (alpha * beta)[:, None, :, None]
        etb = eta if nb is None else eta * nb
        eta, etb = (1 - mu) * eta, (1 - mu) * etb  # dampened momentum: the gradient's weight 1 − μ
        Fm, E = _momentum_weights(log_alpha, mu, L)  # shared by the W_a and W_b recursions
        Wa_new, ma = _wa_chunk_momentum(k, Wa, mom[0], -eta * delta, log_alpha, beta, mu, (Fm, E))
        gcum = clamp_log_gate(log_alpha).cumsum(-1)
        # W_b,L = γ_L W_b + E_L m_b + Σ_s F_Ls a_s (−η_s e_s)ᵀ;  m_b,L = μ^L m_b + Σ_s μ^{L−s} a_s (−η_s e_s)ᵀ
        idx = torch.arange(L, device=k.device)
        pw = torch.as_tensor(mu, dtype=log_alpha.dtype) ** (L - 1 - idx).to(log_alpha.dtype)
        ae = a.transpose(-1, -2)
        Wb_new = (
            gcum[:, -1].exp()[:, None, None, None] * Wb
            + E[:, -1][:, None, None, None] * mom[1]
            - ae @ (Fm[:, -1][:, None, :, None] * etb * e)
        )
        mb = (mu**L) * mom[1] - ae @ (pw[None, None, :, None] * etb * e)
        return (Wa_new.to(Wa.dtype), Wb_new), (ma, mb)
    Wa_new = _wa_chunk(k, Wa, -alpha[:, None, :, None] * delta, log_alpha, beta)
    gcum = log_alpha.cumsum(-1)
    w = (alpha * beta * torch.exp(gcum[:, -1:] - gcum))[:, None, :, None]  # η_s Π_{r>s} α_r
    if nb is not None:
        w = w * nb
    Wb_new = gcum[:, -1].exp()[:, None, None, None] * Wb - (a * w).transpose(-1, -2) @ e
    return (Wa_new.to(Wa.dtype), Wb_new), None


@register_mixer("self_modifying_titans")
class SelfModifyingTitans(Mixer):
    """Self-modifying Titans (see the module docstring for the equations and every choice).

    Args:
        d_model: width of ``x`` and of every memory (keys, values, queries).
        n_heads: groups of the output RMSNorm and gate (``d_model % n_heads == 0``; default ``4``).
        chunk_size: the main memory's chunk ``C_memory`` (gradients and reads at chunk-start weights;
            default ``16``).
        proj_chunk_size: the projection memories' chunk ``C_proj`` (default ``chunk_size``).
        expansion: hidden width of every memory MLP is ``round(expansion · d_model)`` (default
            ``1.0``).
        beta_max: upper bound of ``β_t = η_t / α_t`` (in ``(0, 1]``; default ``1.0``).
        short_conv / conv_size: causal depthwise conv + SiLU on ``x`` before ``W_q`` and the memories
            (defaults ``short_conv=True``, ``conv_size=4``).
        mode: ``"chunk"`` (default for ``T > 1``) or ``"recurrent"`` (token loop).
        memory_target: ``"self"`` (default; Eq. 84/94: the main memory is written toward its own
            ``M_memory(v_t)``) or ``"value"`` (toward ``v_t``, Titans' association; a variant).
        adaptive_q: the query from its own adaptive memory, ``q_t = M_q,c(x̃_t)`` (L2-normalised),
            a fifth projection memory rewritten by DGD like ``M_k`` (see the module docstring);
            default ``False``: the slow projection ``q_t = x̃_t W_q`` of Eq. 83's first line.
        momentum: ``μ ∈ [0, 1)``, the (dampened) DGD momentum of every memory (see the module
            docstring; default ``0.0``: Eq. 88's plain step, no momentum state).
        hidden_step: the rate of each memory's hidden layer ``W_b``: ``"nlms"`` (default,
            ``η_t / max(1, ‖σ(k_t W_a,c)‖²)``) or ``"plain"`` (``η_t``; the step before the fix,
            which diverges at the default width; see the module docstring, "Stability").
        v_norm: L2-normalise ``v_t = M_v(x_t)`` (default ``True``; ``False``: unnormalised, the
            value before the fix; see "Stability").

    Hook points (float32, float64 for a float64 model): the main memory's inputs, as ``M_memory``'s
    reads and DGD steps consume them —

    * ``hook_q`` ``[B, T, d]``: ``q_t = x̃_t W_q``, L2-normalised;
    * ``hook_k`` ``[B, T, d]``: ``k_t = M_k(x_t)``, L2-normalised; ``hook_v`` ``[B, T, d]``:
      ``v_t = M_v(x_t)``, L2-normalised with ``v_norm`` (the value every memory generates its
      target from);
    * ``hook_g`` ``[B, T]``: the log retention ``log α_t`` (from ``M_α``);
    * ``hook_beta`` ``[B, T]``: ``β_t`` (from ``M_η``; the DGD rate is ``η_t = α_t β_t``);

    (they are generated by the projection memories chunk by chunk; the projection memories' own
    DGD steps use them as generated, a replacement reaches the main memory and the output) —
    ``hook_o`` ``[B, T, d]``: the main memory's read ``M_memory(q_t)`` before the norm, the output
    gate and the output projection; ``hook_state``: the :class:`SelfModifyingTitansState` after
    the call.

    State: :class:`SelfModifyingTitansState`.

    Raises:
        ValueError: ``d_model`` or ``n_heads`` not an int ``≥ 1``, ``d_model`` not a multiple of
            ``n_heads``, a chunk size < 1, ``beta_max`` outside
            ``(0, 1]``, ``momentum`` outside ``[0, 1)``, a bad ``mode``, ``memory_target``,
            ``hidden_step`` or ``v_norm``;
            ``forward`` on ``x`` not ``[B, T, d_model]``, a state that is not a
            :class:`SelfModifyingTitansState`, a state from another batch size, a state
            whose memories have other shapes (another ``expansion`` or ``adaptive_q``), or a
            state without the momentum this mixer needs (or with momentum it does not have).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        chunk_size: int = 16,
        proj_chunk_size: int | None = None,
        expansion: float = 1.0,
        beta_max: float = 1.0,
        short_conv: bool = True,
        conv_size: int = 4,
        mode: str = "chunk",
        memory_target: str = "self",
        adaptive_q: bool = False,
        momentum: float = 0.0,
        hidden_step: str = "nlms",
        v_norm: bool = True,
    ):
        super().__init__(mode)
        if hidden_step not in HIDDEN_STEPS:
            raise ValueError(f"hidden_step must be one of {HIDDEN_STEPS}, got {hidden_step!r}")
        if not isinstance(v_norm, bool):
            raise ValueError(f"v_norm must be a bool, got {v_norm!r}")
        self.hidden_step, self.v_norm = hidden_step, v_norm
        if memory_target not in MEMORY_TARGETS:
            raise ValueError(f"memory_target must be one of {MEMORY_TARGETS}, got {memory_target!r}")
        self.memory_target = memory_target
        if not isinstance(adaptive_q, bool):
            raise ValueError(f"adaptive_q must be a bool, got {adaptive_q!r}")
        if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0 <= momentum < 1:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        self.adaptive_q, self.momentum = adaptive_q, float(momentum)
        self.projections = PROJECTIONS_Q if adaptive_q else PROJECTIONS
        check_heads(d_model, n_heads, None)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        proj_chunk_size = chunk_size if proj_chunk_size is None else proj_chunk_size
        for name, c in (("chunk_size", chunk_size), ("proj_chunk_size", proj_chunk_size)):
            if not isinstance(c, int) or isinstance(c, bool) or c < 1:
                raise ValueError(f"{name} must be a positive int, got {c!r}")
        if not isinstance(beta_max, (int, float)) or isinstance(beta_max, bool) or not 0 < beta_max <= 1:
            raise ValueError(f"beta_max must be a number in (0, 1], got {beta_max!r}")
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        self.d_model, self.n_heads = d_model, n_heads
        self.chunk_size, self.proj_chunk_size, self.beta_max = chunk_size, proj_chunk_size, beta_max
        self.spec = MemorySpec(
            architecture="mlp",
            depth=2,
            expansion=expansion,
            activation="gelu",
            residual=True,
            objective="l2",
            chunk_size=chunk_size,
        ).validate()
        D = d_model
        (_, h), _ = self.spec.layer_dims(D, D)
        self.hidden = h
        # initial (slow, meta-learned) weights: M(x) = x + gelu(x W_a) W_b, near the identity
        G = len(self.projections)
        self.proj_wa = nn.Parameter(torch.randn(G, D, h) * D**-0.5)
        self.proj_wb = nn.Parameter(torch.randn(G, h, D) * (0.1 * h**-0.5))
        self.memory_wa = nn.Parameter(torch.randn(1, D, h) * D**-0.5)
        self.memory_wb = nn.Parameter(torch.randn(1, h, D) * (0.1 * h**-0.5))
        # slow read-outs of the scalar gates: α ≈ sigmoid(5) ≈ 0.993, β ≈ 0.1 · beta_max at init
        self.alpha_readout = nn.Parameter(torch.zeros(D))
        self.alpha_bias = nn.Parameter(torch.tensor(5.0))
        self.eta_readout = nn.Parameter(torch.zeros(D))
        self.eta_bias = nn.Parameter(torch.tensor(-2.2))
        # the slow query projection (adaptive_q: the query comes from M_q instead)
        self.q_proj = None if adaptive_q else nn.Linear(D, D, bias=False)
        self.g_proj = nn.Linear(D, D, bias=False)
        check_bool("short_conv", short_conv)
        self.conv = ShortConvolution(D, conv_size) if short_conv else None
        self.norm = RMSNorm(D // n_heads)
        self.o_proj = nn.Linear(D, D, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.alpha_readout, std=0.02)
            nn.init.normal_(self.eta_readout, std=0.02)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_g, self.hook_beta = HookPoint(), HookPoint()
        self.hook_o, self.hook_state = HookPoint(), HookPoint()

    @property
    def map_heads(self) -> int:
        """One: the main memory spans the whole ``d_model`` (its map is ``[B, 1, T, T]``; ``n_heads``
        only groups the output norm), so a head of the map is every channel of ``hook_o``."""
        return 1

    # ------------------------------------------------------------------------------------------
    def initial_state(self, B: int) -> SelfModifyingTitansState:
        """A fresh stream: the learned initial weights, expanded over the batch (no copies)."""

        def ex(w):
            return w.unsqueeze(0).expand(B, *w.shape)

        proj = (ex(self.proj_wa), ex(self.proj_wb))
        mem = (ex(self.memory_wa), ex(self.memory_wb))
        pm = mm = None
        if self.momentum:  # zero momentum, per sample, in the compute dtype (float32; float64)
            cd = torch.float64 if self.proj_wa.dtype == torch.float64 else torch.float32
            pm = tuple(w.new_zeros(B, *w.shape, dtype=cd) for w in (self.proj_wa, self.proj_wb))
            mm = tuple(w.new_zeros(B, *w.shape, dtype=cd) for w in (self.memory_wa, self.memory_wb))
        return SelfModifyingTitansState(
            proj=proj, proj_anchor=proj, memory=mem, memory_anchor=mem, proj_momentum=pm, memory_momentum=mm
        )

    def gates(self, raw_eta: torch.Tensor, raw_alpha: torch.Tensor):
        """``(log α_t, β_t)`` from the outputs of ``M_η, M_α`` (``[..., d]``); ``η_t = α_t β_t``."""
        dt = raw_alpha.dtype
        log_alpha = F.logsigmoid(raw_alpha @ self.alpha_readout.to(dt) + self.alpha_bias.to(dt))
        beta = self.beta_max * torch.sigmoid(raw_eta @ self.eta_readout.to(dt) + self.eta_bias.to(dt))
        return log_alpha, beta

    @staticmethod
    def _pieces(pos: int, T: int, C: int, token: bool):
        """``(start, length)`` of the pieces of ``[0, T)`` cut at absolute multiples of ``C``."""
        out, t = [], 0
        while t < T:
            L = 1 if token else min(C - (pos + t) % C, T - t)
            out.append((t, L))
            t += L
        return out

    #: set by :meth:`deferring`: keep a chunk's DGD steps as their inputs until the chunk ends
    _defer_steps: bool = False

    @contextmanager
    def deferring(self):
        """Within ``with``: a call that ends inside a memory chunk keeps the steps of that chunk's
        tokens as their inputs in the state (``proj_pending``/``memory_pending``) and takes them,
        in one :func:`dgd_chunk` over the whole chunk, when the chunk completes in a later call.
        The result is the same recursion (any split of a chunk gives the same weights up to float
        rounding), but a stream read in pieces shorter than a chunk — a task-signal model's
        segments, :mod:`mnemo.models.task_signal` — moves the per-sample weights once per chunk
        instead of once per piece. States made inside must be passed through :meth:`settle`
        before they leave (the task-signal loop does)."""
        prev, self._defer_steps = self._defer_steps, True
        try:
            yield self
        finally:
            self._defer_steps = prev

    def _take_kept(self, W, A, mom, pend):
        """Take the kept steps ``pend`` (or none) from ``(W, mom)``, gradients at ``A``."""
        if pend is None:
            return W, mom
        k, vhat, la, be = pend
        return dgd_chunk(self.spec, W, A, k, vhat, la, be, mom, self.momentum, self.hidden_step == "nlms")

    def settle(self, state: SelfModifyingTitansState) -> SelfModifyingTitansState:
        """The state with any kept steps taken (see :meth:`deferring`); unchanged without them."""
        if state is None or (state.proj_pending is None and state.memory_pending is None):
            return state
        proj, pm = self._take_kept(state.proj, state.proj_anchor, state.proj_momentum, state.proj_pending)
        mem, mm = self._take_kept(
            state.memory, state.memory_anchor, state.memory_momentum, state.memory_pending
        )
        return replace(
            state,
            proj=proj,
            proj_momentum=pm,
            proj_pending=None,
            memory=mem,
            memory_momentum=mm,
            memory_pending=None,
        )

    def _run(self, W, A, mom, pend, pos, T, C, token, read_in):
        """Advance one memory group over ``T`` tokens: ``read_in(t, L, A)`` reads at the chunk-start
        weights and returns the update inputs ``(k, vhat, log_alpha, beta)`` and the read; the step is
        :func:`dgd_token` (``token``) or :func:`dgd_chunk` (``mom``: the group's momentum or
        ``None``; ``hidden_step="nlms"``: ``W_b``'s normalised rate). ``pend``: steps kept from
        earlier calls of this chunk (:meth:`deferring`), taken together with this call's.
        Returns ``(W, A, mom, pend, reads)``."""
        reads = []
        mu = self.momentum
        nlms = self.hidden_step == "nlms"
        defer = self._defer_steps and not token
        for t, L in self._pieces(pos, T, C, token):
            if (pos + t) % C == 0:
                A = W
            (k, vhat, la, be), r = read_in(t, L, A)
            reads.append(r)
            if token:
                W, mom = dgd_token(self.spec, W, A, k[:, 0], vhat[:, :, 0], la[:, 0], be[:, 0], mom, mu, nlms)
                continue
            if pend is not None:  # this chunk's kept steps come first
                cat = (torch.cat([p, n], d) for p, n, d in zip(pend, (k, vhat, la, be), (1, 2, 1, 1)))
                k, vhat, la, be = cat
                pend = None
            if defer and (pos + t + L) % C:  # the chunk goes on after this call: keep its steps
                pend = (k, vhat, la, be)
            else:
                W, mom = dgd_chunk(self.spec, W, A, k, vhat, la, be, mom, mu, nlms)
        if (pos + T) % C == 0:
            A = W
        return W, A, mom, pend, reads

    def _target(self, A, v: torch.Tensor) -> torch.Tensor:
        """The main memory's write target for values ``v [B, 1, L, d]`` at its chunk-start weights
        ``A``: ``M_memory,c(v)`` (``memory_target="self"``) or ``v``."""
        return _mlp(A, v) if self.memory_target == "self" else v

    def _projections(self, xc: torch.Tensor, st: SelfModifyingTitansState, cd, token: bool):
        """Stage 1: run ``M_k, M_v, M_η, M_α`` over ``xc [B, T, d]`` (they do not depend on
        ``M_memory``). Returns their new running and chunk-start weights, their momentum and, per
        token, ``(k [B, T, d], v [B, T, d], log α [B, T], β [B, T])`` and (``adaptive_q``)
        ``q [B, T, d]`` (``q_t = M_q(x_t)``, L2-normalised)."""
        B, T = xc.shape[:2]
        G = len(self.projections)
        proj = tuple(w.to(cd) for w in st.proj)
        proj_a = tuple(w.to(cd) for w in st.proj_anchor)
        pm = None if st.proj_momentum is None else tuple(w.to(cd) for w in st.proj_momentum)

        def proj_in(t, L, A):
            xs = xc[:, t : t + L]
            raw = _mlp(A, xs[:, None].expand(B, G, L, -1))
            k = F.normalize(raw[:, 0], dim=-1)  # k_t = M_k(x_t), L2-normalised
            v = F.normalize(raw[:, 1], dim=-1) if self.v_norm else raw[:, 1]  # v_t = M_v(x_t)
            la, be = self.gates(raw[:, 2], raw[:, 3])  # η_t ← M_η(x_t), α_t ← M_α(x_t)
            vhat = _mlp(A, v[:, None].expand(B, G, L, -1))  # v̂_□ = M_□(v_t)
            if self.adaptive_q:  # q_t = M_q(x_t), L2-normalised
                return (k, vhat, la, be), (k, v, la, be, F.normalize(raw[:, 4], dim=-1))
            return (k, vhat, la, be), (k, v, la, be)

        proj, proj_a, pm, pend, pieces = self._run(
            proj, proj_a, pm, st.proj_pending, st.offset, T, self.proj_chunk_size, token, proj_in
        )
        return proj, proj_a, pm, pend, tuple(torch.cat(z, 1) for z in zip(*pieces))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """``log α_t [B, T]``: the retention this mixer applies to every memory on ``x [B, T, d]``
        from a fresh state (generated in context by ``M_α``)."""
        B, T = check_input(x, self.d_model)
        check_dtype(x, self)
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        xin = self.conv(x)[0] if self.conv is not None else x
        token = T == 1 or self.mode == "recurrent"
        return self._projections(xin.to(cd), self.initial_state(B), cd, token)[4][2]

    def forward(
        self, x: torch.Tensor, state: SelfModifyingTitansState | None = None, *, mode: str | None = None
    ):
        B, T = check_input(x, self.d_model)
        check_dtype(x, self)
        mode = self._mode(T, mode)
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        if state is not None and not isinstance(state, SelfModifyingTitansState):
            raise ValueError(
                f"state: expected a SelfModifyingTitansState (the state this mixer returned) or None, got "
                f"{type(state).__name__}"
            )
        if state is not None:  # weights in the compute dtype (float32; float64), conv tails in the model's
            check_state_dtype(state, self, fast_weights=True)
        st = state if state is not None else self.initial_state(B)
        if st.proj[0].shape[0] != B:
            raise ValueError(f"state has batch size {st.proj[0].shape[0]}, x has {B}")
        if (st.memory_momentum is None) != (self.momentum == 0):
            raise ValueError(
                f"state: momentum={self.momentum} needs a state "
                f"{'with' if self.momentum else 'without'} momentum buffers, got one "
                f"{'without' if st.memory_momentum is None else 'with'} (pass the state this mixer returned)"
            )
        D, h, G = self.d_model, self.hidden, len(self.projections)
        for name, pair, g in (("proj", st.proj, G), ("memory", st.memory, 1)):
            want = [[B, g, D, h], [B, g, h, D]]
            if [list(w.shape) for w in pair] != want:
                raise ValueError(
                    f"state.{name}: expected weights of shapes {want} (batch, memories, d_model, hidden), "
                    f"got {[list(w.shape) for w in pair]} (a state from another configuration: "
                    f"adaptive_q={self.adaptive_q}, expansion gives hidden = {h})"
                )
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        if T == 0:  # an empty call passes the state through; its hooks pass values of no tokens
            for point in (self.hook_q, self.hook_k, self.hook_v):
                point(x.new_zeros(B, 0, D, dtype=cd))
            self.hook_g(x.new_zeros(B, 0, dtype=cd))
            self.hook_beta(x.new_zeros(B, 0, dtype=cd))
            self.hook_o(x.new_zeros(B, 0, D, dtype=cd))
            shown = self.settle(st) if self.hook_state.active else st
            return x.new_zeros(B, 0, self.d_model), show_state(self.hook_state, st, shown)
        token = mode == "recurrent"
        conv = st.conv
        xin = x
        if self.conv is not None:
            xin, conv = self.conv(x, conv)
        xc = xin.to(cd)
        if token:  # the token loop steps the running weights: take any kept steps first
            st = self.settle(st)
        proj, proj_a, pm, proj_pend, gen = self._projections(xc, st, cd, token)
        k, v, la, be = gen[:4]
        if self.adaptive_q:
            q = gen[4]  # q_t = M_q(x̃_t), L2-normalised
        else:
            q = F.normalize(upcast(self.q_proj(xin)).to(cd), dim=-1)  # q_t = x̃_t W_q, L2-normalised
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        la, be = self.hook_g(la), self.hook_beta(be)
        mem = tuple(w.to(cd) for w in st.memory)
        mem_a = tuple(w.to(cd) for w in st.memory_anchor)
        mm = None if st.memory_momentum is None else tuple(w.to(cd) for w in st.memory_momentum)

        # 2) the main memory: read o_t at the chunk-start weights, write toward M_memory(v_t)
        def mem_in(t, L, A):
            o = _mlp(A, q[:, None, t : t + L])[:, 0]
            sl = slice(t, t + L)
            return (k[:, sl], self._target(A, v[:, None, sl]), la[:, sl], be[:, sl]), o

        mem, mem_a, mm, mem_pend, outs = self._run(
            mem, mem_a, mm, st.memory_pending, st.offset, T, self.chunk_size, token, mem_in
        )
        o = self.hook_o(torch.cat(outs, 1)).to(x.dtype)
        H = self.n_heads
        o = self.norm(  # RMSNorm(o) ⊙ silu(W_g x), fused
            rearrange(o, "b t (h d) -> b t h d", h=H), rearrange(self.g_proj(x), "b t (h d) -> b t h d", h=H)
        )
        y = self.o_proj(rearrange(o, "b t h d -> b t (h d)"))
        new = SelfModifyingTitansState(
            proj=proj,
            proj_anchor=proj_a,
            memory=mem,
            memory_anchor=mem_a,
            conv=conv,
            offset=st.offset + T,
            proj_momentum=pm,
            memory_momentum=mm,
            proj_pending=proj_pend,
            memory_pending=mem_pend,
        )
        # kept steps: a hook sees the state with every step taken (a copy); unless it replaces
        # or edits that state, the stream goes on from the deferred one (the same weights; the same
        # rounding as without hooks)
        return y, show_state(self.hook_state, new, self.settle(new) if self.hook_state.active else new)

    # ------------------------------------------------------------------------------------------
    # maps: the main memory's read attributed to its writes
    # ------------------------------------------------------------------------------------------

    mixing_hooks = ("hook_q", "hook_k", "hook_v", "hook_g", "hook_beta")
    #: the main memory is a residual MLP: :meth:`mixing` is an attribution, not a mixing matrix
    mixing_exact = False
    #: integration steps of the attribution (see :attr:`mnemo.layers.NeuralMemory.attribution_steps`)
    attribution_steps: int = 4
    #: their quadrature rule, ``"midpoint"`` (the default) or ``"gauss_legendre"`` (see
    #: :attr:`mnemo.layers.NeuralMemory.attribution_rule`)
    attribution_rule: str = "midpoint"

    def attribution(
        self, acts: dict, steps: int | None = None, *, rule: str | None = None
    ) -> ValueAttribution:
        """The main memory's read ``o_t = M_memory(q_t)`` attributed to each value ``v_s`` its write
        targets were made from (``M_memory,c(v_s)``, or ``v_s`` itself with
        ``memory_target="value"``; gradient × input through the target and the unrolled DGD steps,
        integrated from the zero-value baseline, whose target is ``M(0) = 0``;
        :mod:`mnemo.memory.attribution`), from the hook values of one fresh-stream call. The
        projection memories' outputs (``q, k, log α, β``) are held at their recorded values: the
        map reads the main memory, not how its keys and rates were made.
        One head (``H = 1``, the memory spans ``d_model``): maps ``[B, 1, T, T]``. ``steps`` and
        ``rule`` (keyword-only; :func:`~mnemo.memory.attribution.attribute_read`) default to
        :attr:`attribution_steps` and :attr:`attribution_rule` (``"midpoint"``; ``steps = 1`` is
        gradient × input under either rule)."""
        q, k, v, la, be = (acts[n].detach() for n in self.mixing_hooks)
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        q, k, v, la, be = (x.to(cd) for x in (q, k, v, la, be))
        B, T = q.shape[:2]

        def read(vr: torch.Tensor) -> torch.Tensor:  # [R·B, T, 1, d] -> [R·B, T, 1, d]
            R = vr.shape[0] // B
            qr, kr, lr, br = (x.repeat(R, *([1] * (x.ndim - 1))) for x in (q, k, la, be))
            vr = vr[:, :, 0]
            W0 = tuple(
                w.detach().to(cd).unsqueeze(0).expand(R * B, *w.shape)
                for w in (self.memory_wa, self.memory_wb)
            )

            def mem_in(t, L, A):
                sl = slice(t, t + L)
                tgt = self._target(A, vr[:, None, sl])
                return (kr[:, sl], tgt, lr[:, sl], br[:, sl]), _mlp(A, qr[:, None, sl])[:, 0]

            # the token-loop form (the chunk form's batched gradients carry no forward-mode rule)
            m0 = tuple(torch.zeros_like(w) for w in W0) if self.momentum else None
            outs = self._run(W0, W0, m0, None, 0, T, self.chunk_size, True, mem_in)[4]
            if not outs:  # 0 tokens: no read (the map is then [B, 1, 0, 0])
                return vr.new_zeros(vr.shape[0], 0, 1, self.d_model)
            return torch.cat(outs, 1)[:, :, None]

        return attribution_of_read(
            read,
            v[:, :, None],
            steps=self.attribution_steps if steps is None else steps,
            rule=self.attribution_rule if rule is None else rule,
        )

    def mixing(self, acts: dict) -> Mixing:
        """The main memory's map ``[B, 1, T, T]``: an *attribution*, not a mixing matrix (the memory
        is a residual MLP trained by DGD). ``maps[t, s] = ⟨c_ts, v_s⟩ / ‖v_s‖²`` with ``c_ts`` the
        integrated-gradient contribution of ``v_s`` to ``o_t``; ``output`` is the writes' part of
        the read (``o`` minus the read of the memory written with zero values), which the
        contributions add up to (to first order; exactly as :attr:`attribution_steps` grows) and
        ``maps @ values`` does not reproduce (:meth:`attribution` returns both errors). Inside a
        memory chunk the read uses the chunk-start weights (Eq. 90), so the map is zero from a
        token to the writes of its own chunk."""
        a = self.attribution(acts)
        return Mixing(a.maps, a.values, a.output)

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> SelfModifyingTitansState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'): running and chunk-start weights of the five memories (six with
        ``adaptive_q``: ``M_q`` too) and, with ``momentum > 0``, their momentum buffers (float32,
        float64 for float64) plus the conv tail; independent of ``seq_len``. Defaults:
        ``batch_size=1``, ``seq_len=0``."""
        act, cd = state_dtypes(self, dtype)
        B, D, h = batch_size, self.d_model, self.hidden

        def group(G):
            return (spec((B, G, D, h), cd), spec((B, G, h, D), cd))

        conv = self.conv
        G = len(self.projections)
        return SelfModifyingTitansState(
            proj=group(G),
            proj_anchor=group(G),
            memory=group(1),
            memory_anchor=group(1),
            conv=None if conv is None else spec((B, conv.channels, conv.kernel_size - 1), act),
            offset=seq_len,
            proj_momentum=group(G) if self.momentum else None,
            memory_momentum=group(1) if self.momentum else None,
        )

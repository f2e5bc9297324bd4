"""The test-time-trained memory: one engine for every :class:`~mnemo.memory.MemorySpec`.

Semantics (the same in the token-loop reference, the chunked form, streaming and decoding)::

    at a chunk start (position % chunk_size == 0):  anchor ← A
    for token t:
        W⁰    = N(anchor)                                  weights the gradient is taken at
        G_t   = ∇_W ℓ(M_W(k_t), v_t) at W = ρ_t ⊙ W⁰         ρ_t = decay since the anchor if
                                                            decay_first, else 1
        G_t  ← G_t · min(1, grad_clip / ‖G_t‖)            (optional)
        step  = −θ_t G_t                 or   S_t = η_t S_{t−1} − θ_t G_t, step = S_t   (momentum)
        A_t   = exp(g_t) ⊙ A_{t−1} + step                 (g = 0 without retention decay)
        A_t  ← S_{γ_t}(A_t),  γ_t = l1 · θ_t               (elastic_net only; Miras Eq. 22)
        o_t   = M_{W_t}(q_t)   with  W_t = N(A_t)          token t reads *after* its own write

``N`` is the identity, Moneta's ℓq normalisation or Memora's scaled softmax (see ``MemorySpec``);
``S_γ`` is the soft-thresholding of elastic-net retention (its chunk form advances the weights
token by token inside the chunk, from gradients all taken at once at the chunk-start weights).
With ``chunk_size = 1`` this is plain online learning (exact delta rule, …); with larger chunks it
is mini-batch GD inside each chunk (Titans §3.2, TTT). Because every gradient of a chunk is taken at
the same weights, the chunk form computes all of them in one batched forward/backward of the memory
and expresses ``A_t`` for every token of the chunk as
``A_t = e^{Σg} A + b_t S − Σ_s c_ts x_s ⊗ δ_s`` (per layer: input ``x_s`` and output-gradient
``δ_s`` of token ``s``), with ``[C, C]`` coefficient matrices from the decay and momentum scans.
Reads then use the dual form (matmuls with ``[C, C]`` scores, no per-token weights) when ``N`` is the
identity with a scalar decay, and materialise the per-token weights of the chunk otherwise. The only
loop over time is over chunks.

The implementation is split by concern: :mod:`.state` (the stream state), :mod:`.objective` (the
memory function and its inner objective), :mod:`.retention` (``N`` and ``S_γ``), :mod:`.chunk` (the
chunk form), :mod:`.recurrent` (the token-loop reference) and :mod:`.closed_form` (the dedicated
ops); this module is the entry point and keeps the public import path.
"""

from __future__ import annotations

import contextlib

import torch

from ..ops._chunked import autocast_disabled
from ..ops._common import LOG_GATE_MIN, check_finite, check_floating, inference_involved
from .chunk import memory_chunk
from .closed_form import _run_closed_form, closed_form_op
from .objective import _act_with_grad as _act_with_grad  # (used by mnemo.nested)
from .objective import memory_apply, objective_grad, objective_value
from .recurrent import memory_recurrent
from .retention import retention_map, soft_threshold
from .spec import MemorySpec
from .state import MemoryState, _detach_state, _map_state, init_state

__all__ = [
    "MemoryState",
    "neural_memory",
    "init_state",
    "closed_form_op",
    # the building blocks, importable from here as before the split
    "memory_apply",
    "objective_grad",
    "objective_value",
    "retention_map",
    "soft_threshold",
    "memory_chunk",
    "memory_recurrent",
]


def _check(spec, q, k, v, theta, g, eta, delta, state):
    for name, t in (("q", q), ("k", k), ("v", v), ("theta", theta)):
        check_floating(name, t)
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must have shape [B, T, H, K], got {list(q.shape)} and {list(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {list(v.shape)}")
    if theta.shape != (B, T, H):
        raise ValueError(f"theta must have shape [B, T, H] = [{B}, {T}, {H}], got {list(theta.shape)}")
    if spec.retention != "none":
        if g is None:
            raise ValueError(
                f"retention {spec.retention!r} needs the log decay g ([B, T, H] or [B, T, H, K])"
            )
        want = (B, T, H, K) if spec.decay_per_channel else (B, T, H)
        if tuple(g.shape) != want:
            raise ValueError(f"g must have shape {list(want)}, got {list(g.shape)}")
    elif g is not None:
        raise ValueError("g was given but the retention is 'none'")
    if spec.optimizer == "momentum":
        if eta is None or eta.shape != (B, T, H):
            got = None if eta is None else list(eta.shape)
            raise ValueError(
                f"optimizer 'momentum' needs eta of shape [B, T, H] = [{B}, {T}, {H}], got {got}"
            )
    elif eta is not None:
        raise ValueError(
            f"eta was given but the optimizer is {spec.optimizer!r} (eta is the momentum of 'momentum')"
        )
    if spec.objective == "huber" and (delta is None or delta.shape != (B, T, H)):
        got = None if delta is None else list(delta.shape)
        raise ValueError(f"objective 'huber' needs delta of shape [B, T, H] = [{B}, {T}, {H}], got {got}")
    if spec.objective != "huber" and delta is not None:
        raise ValueError(f"delta was given but the objective is {spec.objective!r} (not 'huber')")
    dims = spec.layer_dims(K, v.shape[-1])
    if spec.residual and K != v.shape[-1]:
        raise ValueError(f"a residual memory needs K == V, got K = {K}, V = {v.shape[-1]}")
    if state is None:
        return
    if len(state.weights) != len(dims):
        raise ValueError(f"initial_state has {len(state.weights)} layers, the spec has {len(dims)}")
    if (state.momentum is None) != (spec.optimizer != "momentum"):
        raise ValueError(
            f"initial_state.momentum must be {'buffers' if spec.optimizer == 'momentum' else 'None'} for "
            f"optimizer {spec.optimizer!r}, got {'None' if state.momentum is None else 'buffers'} "
            "(build the state for this spec with init_state)"
        )
    for field in ("weights", "momentum", "anchor"):
        layers = getattr(state, field)
        if layers is None:
            continue
        if len(layers) != len(dims):
            raise ValueError(f"initial_state.{field} has {len(layers)} layers, the spec has {len(dims)}")
        for i, (w, (din, dout)) in enumerate(zip(layers, dims)):
            if tuple(w.shape) != (B, H, din, dout):
                raise ValueError(
                    f"initial_state.{field}[{i}] must have shape [B, H, in, out] = "
                    f"[{B}, {H}, {din}, {dout}], got {list(w.shape)}"
                )
    if state.position < 0:
        raise ValueError(f"initial_state.position must be >= 0, got {state.position!r}")
    d0 = state.anchor_decay
    if d0 is not None:
        want = (B, H, K) if spec.decay_per_channel else (B, H)
        if not (spec.decay_first and spec.decays) or tuple(d0.shape) != want:
            expected = f"shape {list(want)}" if spec.decay_first and spec.decays else "None (no decay_first)"
            raise ValueError(f"initial_state.anchor_decay must be {expected}, got {list(d0.shape)}")


def _check_affine(spec, norm_weight, norm_bias, H: int, V: int) -> None:
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is None:
            continue
        if not spec.norm:
            raise ValueError(f"{name} was given but the spec has no inner norm (norm=False)")
        check_floating(name, t)
        if tuple(t.shape) != (H, V):
            raise ValueError(f"{name} must have shape [H, V] = [{H}, {V}], got {list(t.shape)}")


def _state_tensors(st: MemoryState) -> list:
    held = (*st.weights, *(st.momentum or ()), *st.anchor, st.anchor_decay)
    return [x for x in held if x is not None]


def _run_recurrent(spec, args, st: MemoryState, device_type: str, affine=None):
    """The token-loop reference, in float32 under a bf16 autocast too. It takes its inner gradients
    with autograd, which ``torch.inference_mode`` switches off for every tensor made under it: under
    it, or given such tensors (a state carried out of it), it runs outside inference mode on copies
    of the inputs (the results come back detached)."""
    held = (*args, *st.weights, *(st.momentum or ()), *st.anchor, st.anchor_decay, *(affine or ()))
    inference, copy = inference_involved(held)
    grad = torch.is_grad_enabled() and not inference
    with torch.inference_mode(False) if inference else contextlib.nullcontext():
        if copy:
            args = [None if x is None else x.clone() for x in args]
            st = _map_state(st, torch.clone)
            affine = None if affine is None else tuple(a.clone() for a in affine)
        with autocast_disabled(device_type):
            o, st_out = memory_recurrent(spec, *args, st, affine=affine)
        if not grad:
            o, st_out = o.detach(), _detach_state(st_out)
    return o, st_out


def neural_memory(
    spec: MemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    eta: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    initial_state: MemoryState | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    use_closed_form: bool = True,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MemoryState | None]:
    """Run a test-time-trained memory over a sequence (Titans / Miras / TTT; see module docstring).

    Args:
        spec: the :class:`MemorySpec`.
        q, k: ``[B, T, H, K]`` reads and keys. v: ``[B, T, H, V]`` values.
        theta: ``[B, T, H]`` inner learning rate ``θ_t`` (> 0; clamped to ``spec.max_lr``).
        g: log retention ``[B, T, H]`` (``[B, T, H, K]`` with ``decay_per_channel``), ``≤ 0``; needed
            unless the retention is ``"none"`` (``exp(g) = 1 − α`` in Titans' notation).
        eta: ``[B, T, H]`` momentum ``η_t ∈ [0, 1)`` (optimizer ``"momentum"`` only).
        delta: ``[B, T, H]`` Huber threshold ``δ_t > 0`` (objective ``"huber"`` only; compared with the
            error norm ``‖M(k_t) − v_t‖₂`` with ``huber_mode="token"``, with each coordinate otherwise).
        initial_state: a :class:`MemoryState` for this spec (see :func:`init_state`: momentum
            buffers exactly with optimizer ``"momentum"``); zeros when ``None``. Zero weights are a
            stationary point of an MLP memory (``depth ≥ 2``; every retention but ``"kl"``, whose zero
            accumulators are uniform weights): every layer's gradient vanishes there, so from ``None``
            such a memory never moves (``o = q`` with ``residual``, else ``0``); give it non-zero
            initial weights (:class:`~mnemo.layers.NeuralMemory` passes its learned
            ones, ``N(0, 1/in)`` at init, ``N(0, 0.02²)`` for TTT-MLP as the TTT authors' code).
        output_final_state: also return the state after the last token (default ``False``).
        mode: ``"chunk"`` (training; the closed-form op when one exists and ``use_closed_form``)
            or ``"recurrent"`` (the token-loop reference).
        use_closed_form: let ``"chunk"`` use the closed-form op when one exists (default
            ``True``); ``False`` runs the engine's own chunk form.
        norm_weight, norm_bias: ``[H, V]`` learned scale ``γ`` and shift ``β`` of the inner layer
            norm (``spec.norm`` only; TTT's ``x + γ ⊙ LN(f(x)) + β``, Sun et al. 2024, whose inner
            loss is taken through them too); default ``norm_weight=None`` (``γ = 1``) and
            ``norm_bias=None`` (``β = 0``), the parameter-free norm.

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype and the :class:`MemoryState` (``None`` unless
        ``output_final_state``). Computation runs in float32 (float64 for float64 inputs), also
        under a bf16 ``torch.autocast`` (the memory's updates and state stay float32). Both forms run
        under ``torch.inference_mode`` (the reference's inner autograd on copies made outside it).

    Raises:
        ValueError: shapes or missing per-token inputs for the spec; the message names the argument.
    """
    spec.validate()
    if mode not in ("chunk", "recurrent"):
        raise ValueError(f"mode must be one of ('chunk', 'recurrent'), got {mode!r}")
    _check(spec, q, k, v, theta, g, eta, delta, initial_state)
    _check_affine(spec, norm_weight, norm_bias, q.shape[2], v.shape[-1])
    check_finite(
        {"q": q, "k": k, "v": v, "theta": theta, "eta": eta, "delta": delta}
        | {"norm_weight": norm_weight, "norm_bias": norm_bias},
        {"g": g},
    )
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        zeros = [q.new_zeros(B, H, i, o, dtype=cd) for i, o in spec.layer_dims(K, V)]
        initial_state = init_state(spec, zeros)
    st = MemoryState(
        tuple(w.to(cd) for w in initial_state.weights),
        None if initial_state.momentum is None else tuple(s.to(cd) for s in initial_state.momentum),
        tuple(w.to(cd) for w in initial_state.anchor),
        None if initial_state.anchor_decay is None else initial_state.anchor_decay.to(cd),
        initial_state.position,
    )
    inference, involved = inference_involved(_state_tensors(st))
    if involved and not inference:
        # a state carried out of torch.inference_mode: autograd (the chunk form's backward too)
        # cannot save its tensors, copies made here can
        st = _map_state(st, torch.clone)
    args = [None if x is None else x.to(cd) for x in (q, k, v, theta, g, eta, delta)]
    if args[4] is not None:
        args[4] = args[4].clamp(min=LOG_GATE_MIN)
    affine = None
    if norm_weight is not None or norm_bias is not None:
        w = q.new_ones(H, V, dtype=cd) if norm_weight is None else norm_weight.to(cd)
        affine = (w, torch.zeros_like(w) if norm_bias is None else norm_bias.to(cd))
    if T == 0:
        o, st_out = v.new_zeros(B, 0, H, V), st
    elif mode == "recurrent":
        o, st_out = _run_recurrent(spec, args, st, q.device.type, affine)
    else:
        op = closed_form_op(spec) if use_closed_form else None  # (None for every spec with a norm)
        if op is not None:
            o, st_out = _run_closed_form(op, spec, args[0], args[1], args[2], args[3], args[4], st)
        else:
            with autocast_disabled(q.device.type):  # float32 under a bf16 autocast too
                o, st_out = memory_chunk(spec, *args, st, affine=affine)
    return o.to(q.dtype), (st_out if output_final_state else None)

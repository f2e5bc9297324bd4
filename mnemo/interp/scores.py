"""Circuit scores on attention maps (Olsson et al. 2022, "In-context Learning and Induction Heads";
Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits").

Maps are ``[B, H, T, T]``. Softmax maps are probabilities; implicit maps of the other mixers are
normalised first, ``p_ts = |M_ts| / Σ_s |M_ts|`` (the share of a query's mixing weight on each
key), so the same detectors read every memory.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from .maps import _index


def normalise(maps: torch.Tensor) -> torch.Tensor:
    """Row-normalised absolute weights (identity on softmax probabilities), in float32 at least (a
    bf16 map's rows are summed and its scores averaged in float32, not rounded to bf16)."""
    a = maps.abs().to(torch.promote_types(maps.dtype, torch.float32))
    return a / a.sum(-1, keepdim=True).clamp_min(1e-12)


def _check_maps(maps) -> None:
    """``maps`` must be ``[B, H, T, T]`` (a floating tensor, square over queries and keys)."""
    if not isinstance(maps, torch.Tensor) or maps.ndim != 4 or maps.shape[-1] != maps.shape[-2]:
        got = list(maps.shape) if isinstance(maps, torch.Tensor) else type(maps).__name__
        raise ValueError(f"maps: expected a tensor [B, H, T, T] (queries × keys), got {got}")


def _check_int(what: str, value, low: int) -> int:
    """``value`` as an int ``>= low`` (a numpy or 0-d tensor integer too), else ``ValueError``."""
    v = _index(value)
    if v is None or v < low:
        raise ValueError(f"{what}: expected an int >= {low}, got {value!r}")
    return v


def _skipped(maps: torch.Tensor, skip: int) -> torch.Tensor:
    """The normalised maps without their first ``skip`` positions as queries and as keys. The rows
    are normalised over every key first: weight a query puts on a skipped position (a BOS sink) is
    dropped from its scores, not shared out over the others."""
    _check_maps(maps)
    given, skip = skip, _index(skip)  # (a numpy or 0-d tensor integer too)
    if skip is None:
        raise ValueError(f"skip: expected an int number of leading positions, got {given!r}")
    T = maps.shape[-1]
    if T < 2:
        raise ValueError(
            f"maps: expected at least 2 positions (queries × keys) to score, got {list(maps.shape)}"
        )
    if skip < 0 or skip > T - 2:
        raise ValueError(
            f"skip: expected a number of leading positions in [0, {T - 2}] (two positions must remain), "
            f"got {skip}"
        )
    return normalise(maps)[..., skip:, skip:]


def previous_token_score(maps: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """Mean weight from position ``t`` to ``t − 1`` (``t ≥ 1``), per head: ``[H]``, from ``maps
    [B, H, T, T]``. ``skip`` (default ``skip=0``): leading positions left out as queries and keys,
    e.g. 1 for a run's fixed BOS (rows normalised before they are left out). Raises ``ValueError``
    for maps of another shape or a ``skip`` that leaves fewer than two positions."""
    p = _skipped(maps, skip)
    return torch.diagonal(p, offset=-1, dim1=-2, dim2=-1).mean((0, -1))


def duplicate_token_score(maps: torch.Tensor, ids: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """Mean weight from ``t`` onto earlier positions holding the same token (over ``t`` that have
    one), per head: ``[H]``. ``maps [B, H, T, T]``, ``ids: [B, T]`` (the tokens the maps were
    taken on). ``skip`` (default ``skip=0``): as in :func:`previous_token_score`. Raises
    ``ValueError`` for maps of another shape or of fewer than two positions, or ``ids`` that are
    not ``[B, T]``."""
    _check_maps(maps)
    B, _, T, _ = maps.shape
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or tuple(ids.shape) != (B, T):
        got = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"ids: expected the maps' tokens [B, T] = [{B}, {T}], got {got}")
    p = _skipped(maps, skip)
    ids = ids[:, skip:]
    T = ids.shape[1]
    same = (ids[:, :, None] == ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(
        -1
    )
    has = same.any(-1)  # [B, T]
    mass = (p * same[:, None]).sum(-1)  # [B, H, T]
    return (mass * has[:, None]).sum((0, -1)) / has.sum().clamp_min(1)


def repeated_random_tokens(
    batch: int, length: int, vocab: int, generator=None, offset: int = 0, bos: int | None = None
) -> torch.Tensor:
    """A random sequence of ``length`` tokens (ids ``offset … vocab − 1``) repeated twice: ``[B, 2L]``
    (default ``offset=0``). ``bos``: the id of a run's fixed first token (``TrainConfig.bos``), put
    before the two copies (``[B, 2L + 1]``, as the run saw its windows); the random tokens then
    never hold it (drawn from one id fewer and shifted over it when it lies in their range;
    ``offset`` is then lowered as far as needed for two ids other than the BOS to remain, where the
    vocabulary has them). Raises ``ValueError`` for a ``bos`` outside ``[0, vocab)``, a
    vocabulary of fewer than 2 ids, or an ``offset`` that is not an integer (a numpy or 0-d tensor
    one is taken), negative, or (without ``bos``) not below ``vocab``."""
    given = offset
    try:  # (a numpy or 0-d tensor integer too, as torch.randint takes it)
        offset = None if isinstance(offset, bool) else operator.index(offset)
    except TypeError:
        offset = None
    if offset is None or offset < 0 or (bos is None and offset >= vocab):
        top = f"[0, {vocab})" if bos is None else ">= 0"
        raise ValueError(f"offset: expected the first token id drawn, an int in {top}, got {given!r}")
    if bos is None:
        seq = torch.randint(offset, vocab, (batch, length), generator=generator)
        return torch.cat([seq, seq], 1)
    if not 0 <= bos < vocab or vocab < 2:
        raise ValueError(f"bos: expected a token id in [0, {vocab}) of a vocabulary of >= 2 ids, got {bos}")
    offset = min(offset, vocab - 2)
    while offset > 0 and vocab - offset - (bos >= offset) < 2:  # two ids besides the BOS
        offset -= 1
    if bos >= offset:  # draw one id fewer and skip over the BOS
        seq = torch.randint(offset, vocab - 1, (batch, length), generator=generator)
        seq = seq + (seq >= bos).long()
    else:
        seq = torch.randint(offset, vocab, (batch, length), generator=generator)
    return torch.cat([torch.full((batch, 1), bos, dtype=seq.dtype), seq, seq], 1)


def sink_score(maps: torch.Tensor, start: int | None = None) -> tuple[torch.Tensor, float]:
    """Attention-sink score (Xiao et al. 2023, StreamingLLM §3.1): the mean weight that queries at
    positions ``t ≥ start`` (default ``T // 2``) put on position 0, per head: ``[H]``, and the same
    mean under uniform causal attention, ``mean_t 1 / (t + 1)`` — a head with a sink puts many times
    that on the first token (a score near 1: almost all of its weight). ``maps [B, H, T, T]``;
    raises ``ValueError`` for maps of another shape or a ``start`` that is not an int (a numpy or
    0-d tensor one is taken; not a bool or a float) in ``[0, T)``."""
    _check_maps(maps)
    p = normalise(maps)
    T = p.shape[-1]
    given = start
    try:
        start = T // 2 if start is None else None if isinstance(start, bool) else operator.index(start)
    except TypeError:
        start = None
    if start is None or not 0 <= start < T:
        kind = "" if start is not None else f" (a {type(given).__name__}, not an int)"
        raise ValueError(f"start: expected a query position in [0, {T}), got {given!r}{kind}")
    uniform = sum(1 / (t + 1) for t in range(start, T)) / (T - start)
    return p[..., start:, 0].mean((0, -1)), uniform


def induction_score(maps: torch.Tensor, length: int, skip: int = 0) -> torch.Tensor:
    """On a random sequence of length ``L`` repeated twice (``maps [B, H, T, T]`` with ``T ≥ 2L``
    after ``skip``): mean weight from **every** position ``i`` of the second copy (``L … 2L − 1``)
    to ``i − L + 1``, the token after the previous occurrence of token ``i`` (Olsson et al. 2022's
    prefix matching): per head, ``[H]``. The last query, ``2L − 1``, counts too: its earlier
    occurrence is the first copy's last token, followed by the second copy's first (``L``), a key
    it sees. ``skip`` (default ``skip=0``): leading positions before the first copy (e.g. 1 for a
    BOS), as in :func:`previous_token_score`. Raises ``ValueError`` for maps of another shape, a
    ``length`` that is not an int ``≥ 2`` (with ``L = 1`` the target is the query itself), or maps
    shorter than ``2L``."""
    length = _check_int("length", length, 2)
    p = _skipped(maps, skip)
    T = p.shape[-1]
    if T < 2 * length:
        raise ValueError(
            f"induction_score: maps cover {T} positions after skip = {skip}, need 2 * length = {2 * length}"
        )
    i = torch.arange(length, 2 * length, device=p.device)
    return p[..., i, i - length + 1].mean((0, -1))


def copying_score(model, layer: int) -> torch.Tensor:
    """OV-circuit copying score of each softmax head of ``layer``: the eigenvalues ``λ`` of
    ``W_E W_V^h W_O^h W_U`` give ``Σλ / Σ|λ|`` (1: the head copies the attended token into the
    logits). The ``V × V`` matrix has the eigenvalues of the ``D × D`` product ``W_O^h W_U W_E W_V^h``
    (``D`` the head size) plus zeros, which is what is computed (``W_V^h [d_model, D]``,
    ``W_O^h [D, d_model]``, ``W_E [V, d_model]``, ``W_U [d_model, V]``). Norms are ignored (the usual
    approximation), and so are Granite's ``embedding_multiplier``, ``residual_multiplier`` and
    ``logits_scaling`` (:class:`~mnemo.models.ModelConfig`): they multiply the circuit by one positive
    number, which leaves the ratio unchanged. Computed in float32 at least (a bf16 model's weights
    are promoted; float64 kept). Raises ``ValueError`` for a layer out of range, ``TypeError`` for a layer
    without fixed OV matrices (:meth:`~mnemo.layers.Attention.ov_matrices`: a mixer other than
    softmax attention, or attention with an output gate between ``W_V`` and ``W_O``)."""
    n = len(model.blocks)
    given, layer = layer, _index(layer)  # (a numpy or 0-d tensor integer too)
    if layer is None or not 0 <= layer < n:
        raise ValueError(f"layer: expected an int in [0, {n}) (the model has {n} layers), got {given!r}")
    mixer = model.blocks[layer].mixer
    heads = mixer.ov_matrices()
    if heads is None:
        raise TypeError(
            f"copying_score needs a layer with fixed OV matrices (softmax attention without an output "
            f"gate); layer {layer} is {type(mixer).__name__} without them"
        )
    # in float32 at least (float64 kept): no eigensolver takes bf16 / fp16 weights
    cd = torch.promote_types(model.embed.weight.dtype, torch.float32)
    W_E = model.embed.weight.detach().to(cd)  # [V, d]
    W_U = model.lm_head.weight.detach().T.to(cd)  # [d, V]
    scores = []
    for Wv, Wo in heads:  # [d, D], [D, d]
        lam = torch.linalg.eigvals(Wo.to(cd) @ W_U @ W_E @ Wv.to(cd))  # the D × D cycle of the OV circuit
        scores.append((lam.sum() / lam.abs().sum().clamp_min(1e-12)).real)
    return torch.stack(scores)


@torch.no_grad()
def icl_score(model, input_ids: torch.Tensor, early=(0.05, 0.15), late=(0.8, 1.0), skip: int = 0) -> float:
    """In-context-learning score: mean next-token loss at late positions minus at early positions
    (fractions of the context length; negative when later tokens are predicted better). ``skip``:
    leading positions whose prediction counts for neither span (1 for a run's BOS: the prediction
    of the first token from it), the fractions then taken of the rest (default ``skip=0``).
    Raises ``ValueError`` naming ``skip`` when it leaves no prediction to score (the spans would
    be means of nothing: NaN), naming ``early`` or ``late`` for a span that is not ``(a, b)`` with
    ``0 ≤ a < b ≤ 1`` (a reversed or empty span would score one position, or none), and naming
    ``input_ids`` when they are not ``[B, T]`` with ``T ≥ 2``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 2:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected [B, T] token ids with T >= 2, got {got}")
    for what, sp in (("early", early), ("late", late)):
        try:
            a, b = (float(x) for x in sp)
        except (TypeError, ValueError):
            a = b = math.nan
        if not 0 <= a < b <= 1:
            raise ValueError(
                f"{what}: expected a span (a, b) of fractions of the context with 0 <= a < b <= 1, got {sp!r}"
            )
    n_pred = input_ids.shape[-1] - 1
    given, skip = skip, _index(skip)  # (a numpy or 0-d tensor integer too, as the other scores take)
    if skip is None or not 0 <= skip < n_pred:
        raise ValueError(
            f"skip: expected an int in [0, {n_pred}) (the {n_pred} predictions of {n_pred + 1} tokens), "
            f"got {given!r}"
        )
    logits, _ = model(input_ids[:, :-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (float64 stays float64)
    loss = F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none").mean(0)  # [T]
    loss = loss[skip:]
    T = loss.shape[0]

    def span(a, b):
        return loss[int(math.floor(a * T)) : max(int(math.floor(a * T)) + 1, int(math.ceil(b * T)))].mean()

    return float(span(*late) - span(*early))

"""Circuit scores of a model, the training callback that records them, and their figures.

- :func:`circuit_scores`: per layer and head, previous-token, duplicate-token, induction (and, for
  softmax heads, copying) scores on random tokens repeated twice.
- :class:`CircuitTracker`: a :class:`~mnemo.train.Trainer` callback adding those scores to every
  evaluation record (``mnemo train --track-circuits``); :func:`circuit_callbacks` builds the
  callbacks a :class:`~mnemo.train.TrainConfig` asks for (``track_circuits``).
- :func:`circuits_figure`, :func:`training_figure`: the heatmaps and the training-curve figure.

This module depends on ``models`` only (never on ``train``): the ``mnemo probe`` command, which
loads checkpoints and runs, lives in :mod:`mnemo.commands.probe`.
"""

from __future__ import annotations

import math
import operator

import torch

from ..plotting import legend
from .figure_text import fit_text  # noqa: F401  (also mnemo.interp.probe.fit_text)
from .maps import capture_maps
from .scores import (
    copying_score,
    duplicate_token_score,
    induction_score,
    previous_token_score,
    repeated_random_tokens,
)


def circuit_scores(
    model, length: int = 32, batch: int = 8, seed: int = 0, vocab_offset: int = 0, bos: int | None = None
) -> dict:
    """Per layer and head: previous-token, duplicate-token and induction scores on random tokens
    repeated twice (``length`` each), and the copying score of softmax heads, keyed by the layer's
    index as a str (``scores["0"]``, as in ``circuits.json`` and as
    :func:`~mnemo.interp.spectrum.memory_spectrum`, whose sub-layers are ``"0.cms0"`` …;
    :func:`~mnemo.interp.maps.capture_maps` keys by int). The ``batch``
    sequences are drawn with ``seed`` from the ids ``vocab_offset … vocab − 1``. ``bos``: the id
    of a run's fixed first token (``TrainConfig.bos``), put before the sequences as in training
    (which then never hold it); the scores leave position 0 out as query and key, without
    renormalising the rows (a head's weight on the BOS sink counts for no circuit). Defaults:
    ``length=32``, ``batch=8``, ``seed=0``, ``vocab_offset=0``, ``bos=None``.

    A layer whose map is exactly zero on these tokens (a memory read at its chunk-start weights,
    HOPE's self-modifying Titans, when all ``2 · length`` tokens lie in its first chunk) scores 0
    everywhere; its entry then carries a ``"note"`` saying so (and which ``length`` would leave
    the first chunk). Raises ``ValueError`` for a ``length`` that is not an int ``≥ 2``, a
    ``batch`` that is not an int ``≥ 1``, a ``seed`` that is not an int, a ``vocab_offset`` that is
    not an int ``≥ 0`` (an offset past the vocabulary draws its last id), or a ``bos`` outside the
    vocabulary."""
    seed, vocab_offset = _check_circuit_settings(length, batch, seed, vocab_offset)
    gen = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    offset = min(vocab_offset, V - 1) if bos is None else vocab_offset
    ids = repeated_random_tokens(batch, length, V, gen, offset=offset, bos=bos)
    skip = 0 if bos is None else 1
    param = next(model.parameters(), None)
    if param is not None:
        ids = ids.to(param.device)  # the generator draws on CPU (same tokens on every device)
    maps = capture_maps(model, ids)
    out = {}
    for layer, m in maps.items():
        entry = {
            "mixer": type(model.blocks[layer].mixer).__name__,
            "previous_token": previous_token_score(m, skip).tolist(),
            "duplicate_token": duplicate_token_score(m, ids, skip).tolist(),
            "induction": induction_score(m, length, skip).tolist(),
        }
        if model.blocks[layer].mixer.ov_matrices() is not None:  # softmax heads
            entry["copying"] = copying_score(model, layer).tolist()
        if not bool(m.ne(0).any()):
            entry["note"] = _zero_map_note(model.blocks[layer].mixer, ids.shape[1], skip)
        out[str(layer)] = entry
    return out


def _check_circuit_settings(length, batch, seed, vocab_offset) -> tuple[int, int]:
    """``(seed, vocab_offset)`` as ints, after checking the settings of :func:`circuit_scores`
    (``ValueError`` naming the one that is wrong)."""
    for what, value, low in (("length", length, 2), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what}: expected an int >= {low}, got {value!r}")
    try:
        seed, vocab_offset = operator.index(seed), operator.index(vocab_offset)
    except TypeError:
        raise ValueError(f"seed, vocab_offset: expected ints, got {seed!r} and {vocab_offset!r}") from None
    if vocab_offset < 0:
        raise ValueError(f"vocab_offset: expected an int >= 0 (the first token id drawn), got {vocab_offset}")
    return seed, vocab_offset


def _zero_map_note(mixer, T: int, skip: int) -> str:
    """Why a layer scored 0 everywhere: its map is exactly zero on the ``T`` tokens scored."""
    note = f"the map of {type(mixer).__name__} is exactly zero on these {T} tokens, so every score is 0"
    chunk = getattr(mixer, "chunk_size", None)
    if isinstance(chunk, int) and T <= chunk:
        note += (
            f": it reads each memory chunk ({chunk} tokens) with the weights of the chunk's start, and all "
            f"{T} tokens lie in the first chunk; a length > {(chunk - skip) // 2} reaches the next one"
        )
    return note


class CircuitTracker:
    """Training callback: every evaluation, add the circuit scores (max over heads per layer, and the
    overall max of the induction and previous-token scores) to the metrics record.

    Uses its own random generator (the trainer's batch order is untouched). The trainer accepts a
    run with ``TrainConfig.track_circuits`` only when a callback says it tracks the circuits
    (``tracks_circuits = True``, as this class does). ``length, batch, seed, vocab_offset``: as in
    :func:`circuit_scores` (the same tokens at every evaluation). Defaults: ``length=32``,
    ``batch=8``, ``seed=1234``, ``vocab_offset=0``, ``spectrum=False``, ``spectrum_tokens=256``,
    ``spectrum_directions=8``, ``spectrum_burn_in=0``. A run with a fixed first token
    (``TrainConfig.bos``) is scored on sequences that start with it, as it trained (``bos`` of
    :func:`circuit_scores`; the spectrum's tokens start with it as ``mnemo probe spectrum``'s do).

    ``spectrum=True`` also records the memory spectrum (:func:`mnemo.interp.spectrum.memory_spectrum`
    on ``spectrum_tokens`` seeded random tokens, ``spectrum_directions`` exponents per head of a
    test-time-trained memory; ``spectrum_burn_in``: its ``burn_in``, the first tokens left out of
    every average, as ``mnemo probe spectrum --burn-in``): per layer whose mixer has a spectrum,
    ``spectrum_{irrelevant, intermediate, marginal, relevant}_by_layer`` (shares) and
    ``spectrum_median_half_life_by_layer`` (tokens; ``inf`` for a median that never halves, NaN
    where undefined: ``metrics.jsonl`` holds them as ``null`` named in the record's ``"nonfinite"``
    field, :func:`mnemo.train.sinks.dumps_record`, which ``loads_record`` reads back); and
    ``spectrum_by_memory``: ``{key: {shares…, median_half_life}}`` for every memory with a spectrum,
    the mixers' (``"0"``, ``"1"``, …) and the CMS levels' (``"0.cms1"``: layer 0, level 1).

    Raises ``ValueError`` when built (not at the first evaluation), naming a setting that
    :func:`circuit_scores` would refuse, a ``spectrum_tokens`` or ``spectrum_directions`` that is
    not an int ``>= 1``, or a ``spectrum_burn_in`` that is not an int in ``[0, spectrum_tokens)``;
    and, once the model is known (:meth:`check_model`, which the ``Trainer`` calls before the first
    step; else at the first spectrum), a ``spectrum_burn_in`` that leaves a memory of the model no
    whole step (inner chunk, period) to average, naming the largest value the model accepts (e.g.
    240 of 256 tokens with chunks of 16), where the memory's spectrum would be recorded as
    "unsupported" at every evaluation."""

    tracks_circuits = True

    def __init__(
        self,
        length: int = 32,
        batch: int = 8,
        seed: int = 1234,
        vocab_offset: int = 0,
        *,
        spectrum: bool = False,
        spectrum_tokens: int = 256,
        spectrum_directions: int = 8,
        spectrum_burn_in: int = 0,
    ):
        seed, vocab_offset = _check_circuit_settings(length, batch, seed, vocab_offset)
        for what, value in (
            ("spectrum_tokens", spectrum_tokens),
            ("spectrum_directions", spectrum_directions),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what}: expected an int >= 1, got {value!r}")
        b = spectrum_burn_in
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < spectrum_tokens:
            raise ValueError(
                f"spectrum_burn_in: expected an int number of tokens in [0, {spectrum_tokens}) (of "
                f"spectrum_tokens = {spectrum_tokens}), got {b!r}"
            )
        self.spectrum_burn_in = b
        self.length, self.batch, self.seed, self.vocab_offset = length, batch, seed, vocab_offset
        self.spectrum, self.spectrum_tokens, self.spectrum_directions = (
            spectrum,
            spectrum_tokens,
            spectrum_directions,
        )

    @property
    def tracks_spectrum(self) -> bool:
        """Whether this tracker records the memory spectrum (what ``TrainConfig.track_spectrum``
        asks the trainer's callbacks for)."""
        return self.spectrum

    def check_model(self, model) -> None:
        """Before the first step (the ``Trainer`` calls it once the model is built, so a setting that
        the first spectrum would refuse fails at once, not after ``eval_interval`` steps): raise
        ``ValueError`` when ``spectrum_burn_in`` leaves a memory of ``model`` no whole chunk or period
        to average, naming the largest value it accepts (``_largest_burn_in``)."""
        if not self.spectrum:
            return
        largest = _largest_burn_in(model, self.spectrum_tokens)
        if self.spectrum_burn_in > largest:  # memory_spectrum would report the memory "unsupported"
            raise ValueError(
                f"spectrum_burn_in: {self.spectrum_burn_in} of the spectrum's {self.spectrum_tokens} "
                f"tokens (spectrum_tokens) leaves a memory of this model no whole chunk or period to "
                f"average; the largest value it accepts is {largest}"
            )

    def _spectrum(self, model, bos: int | None = None) -> dict:
        from ..train.batches import with_bos
        from .spectrum import CLASSES, memory_spectrum, summary_line

        self.check_model(model)  # (a tracker called without a Trainer is checked here)
        gen = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, model.config.vocab_size, (1, self.spectrum_tokens), generator=gen)
        ids = with_bos(ids, bos)  # a run's fixed first token at position 0, as its windows read
        result = memory_spectrum(
            model, ids, directions=self.spectrum_directions, burn_in=self.spectrum_burn_in
        )
        rows = summary_line(result)
        if not rows:
            return {}

        # non-finite half-lives stay floats (inf: never halves; NaN: undefined): metrics.jsonl's
        # writer maps them (mnemo.train.sinks.dumps_record) and loads_record restores them
        layers = [r for key, r in rows.items() if key.isdigit()]  # the mixers' memories
        extra = {}
        if layers:
            extra = {f"spectrum_{c}_by_layer": [r[c] for r in layers] for c in CLASSES}
            extra["spectrum_median_half_life_by_layer"] = [r["median_half_life"] for r in layers]
        extra["spectrum_by_memory"] = {key: dict(r) for key, r in rows.items()}
        return extra

    def __call__(self, trainer, record: dict) -> dict:
        model = trainer.model
        was = model.training
        model.eval()
        try:
            bos = getattr(getattr(trainer, "data", None), "bos_id", None)  # the run's fixed BOS
            scores = circuit_scores(model, self.length, self.batch, self.seed, self.vocab_offset, bos)
            extra = self._spectrum(model, bos) if self.spectrum else {}
        finally:
            model.train(was)
        for name in ("induction", "previous_token", "duplicate_token"):
            per_layer = [max(v[name]) for v in scores.values()]
            if per_layer:
                extra[f"{name}_max"] = max(per_layer)
                extra[f"{name}_by_layer"] = per_layer
        return extra


def _largest_burn_in(model, T: int) -> int:
    """The largest ``burn_in`` for which :func:`~mnemo.interp.spectrum.memory_spectrum` on ``T``
    tokens leaves every memory of ``model`` a whole step to average (its own rule): ``T − 1`` for a
    per-token transition; ``C · (⌈T'/C⌉ − 1)`` for a test-time memory of inner chunk ``C`` (``T'``:
    ``T`` and its persistent prefix); ``P · (⌊T/P⌋ − 1)`` for a self-modifying mixer or a CMS whose
    steps span ``P`` tokens (a memory that ``T`` tokens cannot step at all is left out: it is
    unsupported at any ``burn_in``)."""
    from .spectrum import _self_modifying_transition, _test_time_memory

    limits = [T - 1]
    for block in model.blocks:
        mixer, cms = block.mixer, block.mlp
        ttm = _test_time_memory(mixer)
        if ttm is not None:
            mem = ttm[1]
            C = int(mem.spec.chunk_size)
            persistent = getattr(mem, "persistent", None)
            Tq = T + (int(persistent.shape[0]) if persistent is not None else 0)
            limits.append(C * (-(-Tq // C) - 1))
        elif hasattr(mixer, "spec"):
            found = _self_modifying_transition(mixer, mixer.initial_state(1))
            if found is not None and T >= found[0]:
                limits.append(found[0] * (T // found[0] - 1))
        if getattr(cms, "periods", None) is not None:
            if any(lv.level.objective != "task" for lv in cms.levels):
                P = math.lcm(*(int(lv.level.period) for lv in cms.levels))
                if T >= P:
                    limits.append(P * (T // P - 1))
    return min(limits)


def circuit_callbacks(cfg) -> list:
    """The training callbacks ``cfg`` (a :class:`~mnemo.train.TrainConfig`) asks for from this
    module: ``[CircuitTracker(length=cfg.circuit_length, spectrum=cfg.track_spectrum,
    spectrum_burn_in=cfg.spectrum_burn_in)]`` when ``cfg.track_circuits`` or ``cfg.track_spectrum``,
    else ``[]`` (a configuration without ``spectrum_burn_in``: ``0``). A callbacks factory for
    :class:`~mnemo.train.Trainer` — ``Trainer(cfg, out, callbacks=circuit_callbacks)`` — called
    with the run's resolved configuration (for a resumed run: the saved one with its changes)."""
    spectrum = bool(getattr(cfg, "track_spectrum", False))
    if not (cfg.track_circuits or spectrum):
        return []
    burn_in = getattr(cfg, "spectrum_burn_in", 0)
    return [CircuitTracker(length=cfg.circuit_length, spectrum=spectrum, spectrum_burn_in=burn_in)]


CIRCUIT_PANELS = ("previous_token", "duplicate_token", "induction", "copying")


def circuits_figure(scores: dict, title: str | None = None):
    """One heatmap (layer × head) per score; a panel, or a layer's row, without a score (the copying
    score exists for softmax heads only) reads "n/a"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(scores, key=int)
    H = max(len(scores[layer]["induction"]) for layer in layers)
    width = 3.2 * len(CIRCUIT_PANELS)
    fig, axes = plt.subplots(
        1, len(CIRCUIT_PANELS), figsize=(width, 0.5 * len(layers) + 2.2), layout="constrained"
    )
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.92")  # missing cells: light grey
    for ax, name in zip(axes, CIRCUIT_PANELS):
        grid = torch.full((len(layers), H), float("nan"))
        missing = []
        for r, layer in enumerate(layers):
            vals = scores[layer].get(name)
            if vals is not None:
                grid[r, : len(vals)] = torch.tensor(vals)
            else:
                missing.append(r)
        im = ax.imshow(grid.numpy(), vmin=-1 if name == "copying" else 0, vmax=1, cmap=cmap, aspect="auto")
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), layers)
        if len(missing) == len(layers):
            why = "\n(softmax heads only)" if name == "copying" else ""
            ax.text(0.5, 0.5, "n/a" + why, transform=ax.transAxes, ha="center", va="center", color="0.3")
        else:
            for r in missing:
                ax.text((H - 1) / 2, r, "n/a", ha="center", va="center", fontsize=8, color="0.3")
        fig.colorbar(im, ax=ax, fraction=0.046)
    if title:
        fig.suptitle(fit_text(title, width, 11), fontsize=11)
    return fig


SCORE_KEYS = (
    ("induction_max", "tab:red"),
    ("previous_token_max", "tab:orange"),
    ("duplicate_token_max", "tab:green"),
    ("val_acc", "tab:purple"),
)


def training_figure(rows: list[dict], title: str | None = None):
    """Loss against steps; the tracked circuit scores and accuracy, when the run recorded any, on a
    labelled right axis (no right axis otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    width = 7.0
    fig, ax = plt.subplots(figsize=(width, 4), layout="constrained")
    ax.plot(steps, [r.get("train_loss", math.nan) for r in rows], label="train loss", color="tab:blue")
    ax.plot(steps, [r.get("val_loss", math.nan) for r in rows], label="val loss", color="tab:cyan")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    handles, labels = ax.get_legend_handles_labels()
    present = [(key, color) for key, color in SCORE_KEYS if any(key in r for r in rows)]
    if present:
        ax2 = ax.twinx()
        for key, color in present:
            ax2.plot(
                steps, [r.get(key, math.nan) for r in rows], label=key.replace("_", " "), color=color, ls="--"
            )
        scores = [k for k, _ in present if k != "val_acc"]
        ax2.set_ylabel(
            " / ".join(
                (["circuit score (max over heads)"] if scores else [])
                + (["accuracy"] if len(scores) < len(present) else [])
            )
        )
        ax2.set_ylim(0, 1.05)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="center right")
    if title:
        ax.set_title(fit_text(title, width, 10), fontsize=10)
    return fig


def spectrum_flow_figure(rows: list[dict], title: str | None = None):
    """How each memory's spectrum moves during training (records with ``spectrum_by_memory``, from
    ``TrainConfig.track_spectrum``): left, the median half-life of every memory against the step
    (log scale; a median that never halves, ``inf``, or a ``None`` of records written before the
    writer kept ``inf``, is drawn at the top; a NaN is a gap); right, the share of its
    directions kept longer than the irrelevant threshold (intermediate + marginal + relevant).
    Returns ``None`` when no record carries a spectrum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("spectrum_by_memory")]
    if not rows:
        return None
    keys = list(dict.fromkeys(k for r in rows for k in r["spectrum_by_memory"]))
    steps = [r["step"] for r in rows]
    width = 10.0
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(width, 4), layout="constrained")
    finite = [
        v["median_half_life"]
        for r in rows
        for v in r["spectrum_by_memory"].values()
        if isinstance(v.get("median_half_life"), (int, float)) and math.isfinite(v["median_half_life"])
    ]
    top = max(finite + [1.0]) * 4

    def half_life(g):
        if g is None:  # no spectrum of this memory at this step
            return math.nan
        v = g.get("median_half_life")
        return top if v is None or v == math.inf else v  # None: an older record's "never halves"

    for key in keys:
        got = [r["spectrum_by_memory"].get(key) for r in rows]
        hl = [half_life(g) for g in got]
        # the classes kept beyond the threshold (not 1 − irrelevant: that would count the
        # unresolved directions of a memory whose exponents were computed only in part)
        kept = [math.nan if g is None else g["intermediate"] + g["marginal"] + g["relevant"] for g in got]
        label = f"L{key.replace('.cms', ' CMS level ')}"
        ax.plot(steps, hl, ".-", label=label)
        bx.plot(steps, kept, ".-", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("median half-life (tokens, log; top = never halves)")
    ax.set_title("median half-life per memory", fontsize=9)
    bx.set_xlabel("step")
    bx.set_ylabel("share kept (intermediate + marginal + relevant)")
    bx.set_ylim(0, 1.05)
    bx.set_title("directions kept beyond a few tokens", fontsize=9)
    legend(bx, fontsize=7, loc="best")
    fig.suptitle(
        fit_text("Memory spectrum during training" + (f" · {title}" if title else ""), width, 11), fontsize=11
    )
    return fig

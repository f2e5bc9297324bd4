"""Second review of the recall tasks and the circuit / memory probes: each test pins a defect found
by checking a value against a hand computation or a documented promise."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from mnemo.interp.probe import CircuitTracker, spectrum_flow_figure
from mnemo.interp.scores import duplicate_token_score, previous_token_score, repeated_random_tokens
from mnemo.interp.timescales import summarize

ROOT = Path(__file__).resolve().parents[2]


def test_half_life_summary_of_more_than_2_24_half_lives_is_exact():
    """A Mamba layer's gates are per (channel, state): d_inner 1536 × N 16 × 2048 tokens is 50M
    half-lives, past ``torch.quantile``'s limit of 2**24 values, which crashed ``probe timescales``.
    On 1 … N the linear-interpolated quantiles are known in closed form."""
    n = 2**24 + 1
    h = torch.arange(1, n + 1, dtype=torch.float64)
    s = summarize(h)
    assert s["count"] == n and s["never_decays"] == 0
    assert s["min"] == 1.0 and s["max"] == float(n)
    assert s["median"] == pytest.approx((n + 1) / 2, abs=1e-9)
    assert s["p10"] == pytest.approx(1 + 0.1 * (n - 1), abs=1e-6)
    assert s["p90"] == pytest.approx(1 + 0.9 * (n - 1), abs=1e-6)
    assert sum(s["histogram"]["counts"]) == n


def test_half_life_quantiles_match_torch_quantile_on_a_small_sample():
    g = torch.Generator().manual_seed(0)
    h = torch.rand(1001, generator=g, dtype=torch.float64) * 50
    h[::7] = math.inf  # never decays: left out of the quantiles
    finite = h[torch.isfinite(h)]
    want = torch.quantile(finite, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    s = summarize(h)
    assert [s["p10"], s["median"], s["p90"]] == pytest.approx(want, rel=1e-12)
    assert s["never_decays"] == int((~torch.isfinite(h)).sum())


def test_scores_of_a_one_position_map_are_refused_not_nan():
    """The docstring promises a ValueError for maps that leave fewer than two positions; a map of one
    position gave a NaN previous-token score."""
    maps = torch.ones(1, 2, 1, 1)
    with pytest.raises(ValueError, match="maps"):
        previous_token_score(maps)
    with pytest.raises(ValueError, match="maps"):
        duplicate_token_score(maps, torch.zeros(1, 1, dtype=torch.long))
    # two positions are enough: a perfect previous-token head scores exactly 1
    two = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).expand(1, 2, 2, 2)
    assert previous_token_score(two).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("vocab, bos, offset", [(8, 7, 7), (8, 7, 6), (8, 6, 6), (5, 4, 100), (8, 0, 7)])
def test_repeated_random_tokens_keep_two_ids_beside_the_bos(vocab, bos, offset):
    """With the BOS inside the drawn range and ``offset = vocab − 2`` only one id was left (every
    token the same: no induction to score), though the docstring promises two."""
    ids = repeated_random_tokens(64, 16, vocab, torch.Generator().manual_seed(0), offset=offset, bos=bos)
    body = ids[:, 1:]
    assert (ids[:, 0] == bos).all() and not (body == bos).any()
    assert torch.equal(body[:, :16], body[:, 16:])
    assert len(body.unique()) == 2
    assert body.min() >= min(offset, vocab - 3) and body.max() < vocab


def test_spectrum_flow_share_kept_leaves_out_unresolved_directions():
    """The right panel is documented as intermediate + marginal + relevant; it plotted
    1 − irrelevant, which also counts the unresolved directions of a memory whose leading exponents
    alone were computed (the tracker computes 8 per head)."""
    import matplotlib.pyplot as plt

    shares = {"irrelevant": 0.25, "intermediate": 0.125, "marginal": 0.0625, "relevant": 0.0}
    rows = [
        {"step": 10, "spectrum_by_memory": {"0": {**shares, "median_half_life": 3.0}}},
        {"step": 20, "spectrum_by_memory": {"0": {**shares, "relevant": 0.5, "median_half_life": None}}},
    ]
    fig = spectrum_flow_figure(rows)
    try:
        right = fig.axes[1]
        (line,) = right.get_lines()
        assert list(line.get_ydata()) == pytest.approx([0.1875, 0.6875], abs=1e-15)
    finally:
        plt.close(fig)


def test_circuits_guide_names_the_scores_the_tracker_records():
    """The guide said ``--track-circuits`` records "them" — the list that ends with the copying and
    the in-context-learning scores — but the tracker records the previous-token, duplicate-token and
    induction scores only."""
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("transformer", vocab_size=16, d_model=16, n_layers=1)).eval()

    class _Trainer:
        pass

    trainer = _Trainer()
    trainer.model = model
    record = CircuitTracker(length=4, batch=2)(trainer, {})
    names = {re.sub(r"_(max|by_layer)$", "", k) for k in record}
    assert names == {"induction", "previous_token", "duplicate_token"}
    text = " ".join((ROOT / "docs/guides/circuits.md").read_text().split())
    sentence = text[text.index("`--track-circuits` records") :].split(" at every evaluation")[0]
    assert "them" not in sentence.split()
    for name in ("previous-token", "duplicate-token", "induction"):
        assert name in sentence


def test_a_spectrum_of_no_transition_is_refused_not_zero():
    """With no step (``T = 0``) the QR iteration averaged nothing and returned exponents of 0 — every
    direction "marginal" — though its docstring refuses a ``burn_in`` outside ``[0, T)``."""
    from mnemo.interp.lyapunov import delta_rule_spectrum, matrix_spectrum

    with pytest.raises(ValueError, match="T: expected at least one step"):
        matrix_spectrum(torch.zeros(0, 3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="T: expected at least one step"):
        delta_rule_spectrum(torch.zeros(1, 0, 2, 4), torch.zeros(1, 0, 2))
    # one step is enough: diag(0.5, 2) gives log 2 and log 0.5 exactly
    lam = matrix_spectrum(torch.diag(torch.tensor([0.5, 2.0], dtype=torch.float64))[None])
    assert lam.tolist() == pytest.approx([math.log(2.0), math.log(0.5)], abs=1e-15)


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True])
def test_task_metrics_names_a_bad_batch_size(batch_size):
    """A negative batch size ran no pass and was reported as "the test set has no supervised
    positions" (a wrong diagnosis); 0 gave range()'s message, 1.5 a TypeError naming nothing."""
    from mnemo.train.task_eval import task_metrics

    x = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch_size: expected an int >= 1"):
        task_metrics(torch.nn.Linear(1, 1), x, x, batch_size=batch_size)


@pytest.mark.parametrize("offset, bos", [(-2, None), (-2, 1), (8, None), (1.0, None)])
def test_repeated_random_tokens_name_an_offset_outside_the_vocabulary(offset, bos):
    """A negative offset drew negative token ids without a word; an offset at the vocabulary's end
    (without a BOS) gave torch's "random_ expects 'from' to be less than 'to'"."""
    with pytest.raises(ValueError, match=r"offset: expected the first token id drawn"):
        repeated_random_tokens(1, 4, 8, torch.Generator().manual_seed(0), offset=offset, bos=bos)


@pytest.mark.parametrize("directions", [0, -1, 2.0])
def test_the_jvp_and_state_spectra_name_a_bad_number_of_directions(directions):
    """Called directly (``memory_spectrum`` checks it for them), both crashed in a reshape or on a
    negative dimension without naming ``directions``."""
    from mnemo.interp.lyapunov import memory_jvp_spectrum, state_spectrum
    from mnemo.memory.spec import MemorySpec
    from mnemo.memory.state import init_state

    f64 = torch.float64
    spec = MemorySpec(retention="decay", chunk_size=1).validate()
    st = init_state(spec, [torch.zeros(1, 1, 3, 2, dtype=f64)])
    k = torch.zeros(1, 4, 1, 3, dtype=f64)
    k[..., 0] = 1
    theta, g = torch.full((1, 4, 1), 0.5, dtype=f64), torch.full((1, 4, 1), -0.1, dtype=f64)
    with pytest.raises(ValueError, match="directions: expected an int >= 1"):
        memory_jvp_spectrum(
            spec, st, k, k, torch.zeros(1, 4, 1, 2, dtype=f64), theta, g, directions=directions
        )
    with pytest.raises(ValueError, match="directions: expected an int >= 1"):
        state_spectrum(
            lambda s, xs: s * 0.5,
            torch.ones(1, 2, dtype=f64),
            torch.zeros(1, 4, 1, dtype=f64),
            period=1,
            get=lambda s: [s],
            put=lambda s, ts: ts[0],
            directions=directions,
        )


def test_the_jvp_spectrum_of_a_decayed_delta_memory_is_its_closed_form():
    """Held before and kept: a matrix memory with the l2 objective, decay and plain GD on a constant
    unit key ``e0`` has the transition ``exp(g) I − θ e0 e0ᵀ`` per token (chunk 1), so its exponents
    are ``log|exp(g) − θ|`` for the V columns of row 0 and ``g`` for the rest."""
    from mnemo.interp.lyapunov import memory_jvp_spectrum
    from mnemo.memory.spec import MemorySpec
    from mnemo.memory.state import init_state

    f64 = torch.float64
    spec = MemorySpec(retention="decay", chunk_size=1).validate()
    st = init_state(spec, [torch.zeros(1, 1, 3, 2, dtype=f64)])
    k = torch.zeros(1, 16, 1, 3, dtype=f64)
    k[..., 0] = 1
    v = torch.randn(1, 16, 1, 2, generator=torch.Generator().manual_seed(0), dtype=f64)
    theta, g = torch.full((1, 16, 1), 0.5, dtype=f64), torch.full((1, 16, 1), -0.1, dtype=f64)
    lam, n = memory_jvp_spectrum(spec, st, k, k, v, theta, g, directions=6, method="forward")
    want = [-0.1] * 4 + [math.log(abs(math.exp(-0.1) - 0.5))] * 2
    assert n == 6 and lam[0].tolist() == pytest.approx(want, abs=1e-12)


def test_recall_guide_says_niah_scores_its_answers_only():
    """The guide said ``val_acc`` is the accuracy on the supervised positions; ``niah`` trains on its
    haystack text too but scores the answers only (``Task.scored``), as the evaluation counts."""
    from mnemo.data.tasks import IGNORE_INDEX, build_task
    from mnemo.train.task_eval import evaluate_task

    task = build_task("niah", haystack="noise", value_len=3, num_needles=2, num_queries=2)

    class Constant(torch.nn.Module):
        def forward(self, x, state=None):
            return torch.zeros(*x.shape, task.vocab_size), state

    x, y = task.sample(4, 40, seed=0, split="test")
    assert int((y != IGNORE_INDEX).sum()) > 4 * 2 * 3  # the haystack is supervised too
    res = evaluate_task(Constant(), task, [40], num_samples=4, batch_size=2, train_len=40, seed=0)[40]
    assert res["n"] == 4 * 2 * 3 and res["answers"] == 4 * 2
    text = " ".join((ROOT / "docs/guides/recall_tasks.md").read_text().split())
    assert "token accuracy on the supervised positions)" not in text
    assert "`niah` scores its answers only" in text

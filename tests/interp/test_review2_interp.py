"""Second break-it review of ``mnemo.interp``: arguments that cannot mean anything are refused by
name (``sink_score``'s ``start``, ``icl_score``'s spans, ``classify``'s ``context``, the
``CircuitTracker``'s settings at construction), scores of bf16 maps are computed in float32, a
clean value recorded on another length is refused also where a piece is its call's last, and the
capacity probe's recall and error keep their precision in bf16 (and run there)."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.interp.capacity import (
    capacity_variants,
    initial_weights,
    random_pairs,
    recall_accuracy,
    write_and_recall,
)
from mnemo.interp.interventions import patch
from mnemo.interp.lyapunov import classify
from mnemo.interp.probe import CircuitTracker
from mnemo.interp.scores import (
    duplicate_token_score,
    icl_score,
    induction_score,
    previous_token_score,
    sink_score,
)
from tests.helpers import tiny_titans_mac

V = 17


def _causal_maps(B=2, H=3, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, H, T, T, generator=g, dtype=torch.float64).tril()
    return m / m.sum(-1, keepdim=True)


# ------------------------------------------------------------------------ arguments refused by name


@pytest.mark.parametrize("start", [True, False, 2.0, 1.5, "3"])
def test_sink_score_refuses_a_start_that_is_not_an_int_position(start):
    """``start`` is a query position: ``True`` silently meant position 1, a float raised a bare
    torch ``TypeError`` from the slice."""
    with pytest.raises(
        ValueError, match=r"start: expected a query position in \[0, 8\), got .* \(a \w+, not an int\)"
    ):
        sink_score(_causal_maps(T=8), start=start)


def test_sink_score_takes_a_numpy_or_0d_tensor_integer_start():
    np = pytest.importorskip("numpy")
    maps = _causal_maps(T=8)
    want = sink_score(maps, start=3)
    for s in (np.int64(3), torch.tensor(3)):
        got = sink_score(maps, start=s)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1] == want[1]


class _Uniform(torch.nn.Module):
    def forward(self, ids):
        return torch.zeros(*ids.shape, V, dtype=torch.float64), None


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"early": (0.15, 0.05)}, "early"),  # reversed: was read as the single position floor(0.15 T)
        ({"late": (1.0, 0.8)}, "late"),  # reversed: was loss[T:], the mean of nothing (nan)
        ({"late": (0.9, 0.9)}, "late"),  # empty
        ({"early": (-0.1, 0.1)}, "early"),
        ({"late": (0.8, 1.5)}, "late"),
        ({"early": (0.1,)}, "early"),
        ({"late": "end"}, "late"),
        ({"early": (0.0, float("nan"))}, "early"),
    ],
)
def test_icl_score_refuses_spans_that_are_not_ranges_of_fractions(kwargs, named):
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"^{named}: expected a span \(a, b\) of fractions"):
        icl_score(_Uniform(), ids, **kwargs)


def test_icl_score_refuses_input_ids_that_are_not_a_batch_of_sequences():
    with pytest.raises(ValueError, match=r"input_ids: expected \[B, T\] token ids with T >= 2, got \[30\]"):
        icl_score(_Uniform(), torch.randint(0, V, (30,)))


def test_icl_score_spans_still_work_inside_the_unit_interval():
    """A valid span that reaches 1.0 and one starting at 0 (the boundaries are allowed)."""
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(0))
    assert icl_score(_Uniform(), ids, early=(0.0, 0.1), late=(0.9, 1.0)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("context", [0, 0.0, -5, float("nan"), float("inf"), True, "64"])
def test_classify_refuses_a_context_that_is_not_a_positive_number_of_tokens(context):
    """``context = 0`` raised a bare ``ZeroDivisionError``; a negative or NaN context silently put
    every direction outside the marginal band (as ``memory_spectrum`` refuses them)."""
    with pytest.raises(ValueError, match=r"context: expected a finite number of tokens > 0, got"):
        classify(torch.tensor([-0.01, -1.0]), context)


def test_classify_by_a_context_still_places_the_marginal_band_at_ln2_over_it():
    lam = torch.tensor([-math.log(2) / 100 * 0.99, -math.log(2) / 100 * 1.01, 0.5])
    out = classify(lam, 100)
    assert (out["marginal"], out["intermediate"], out["relevant"]) == (1 / 3, 1 / 3, 1 / 3)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"length": 1}, "length"),
        ({"length": True}, "length"),
        ({"batch": 0}, "batch"),
        ({"batch": 2.0}, "batch"),
        ({"seed": 1.5}, "seed, vocab_offset"),
        ({"vocab_offset": -1}, "vocab_offset"),
        ({"spectrum_tokens": 0}, "spectrum_tokens"),
        ({"spectrum_directions": 0}, "spectrum_directions"),
        ({"spectrum_directions": 2.5}, "spectrum_directions"),
    ],
)
def test_circuit_tracker_refuses_bad_settings_when_built_not_at_its_first_evaluation(kwargs, named):
    """Before, a bad setting surfaced only at the first evaluation of a training run (after the
    first ``eval_every`` steps)."""
    with pytest.raises(ValueError, match=rf"{named}: expected"):
        CircuitTracker(**kwargs)


def test_circuit_tracker_takes_numpy_integers():
    np = pytest.importorskip("numpy")
    t = CircuitTracker(seed=np.int64(7), vocab_offset=np.int64(2))
    assert (t.seed, t.vocab_offset) == (7, 2)


# --------------------------------------------------------------------------------- bf16 precision


def test_scores_of_bf16_maps_are_computed_in_float32():
    """The scores of a bf16 map equal those of the same (bf16-rounded) map in float64 to float32
    precision; before, normalising and averaging in bf16 moved them by up to 0.2%."""
    maps = _causal_maps().bfloat16()
    exact = maps.double()
    ids = torch.randint(0, 5, (2, 40), generator=torch.Generator().manual_seed(1))
    pairs = [
        (previous_token_score(maps), previous_token_score(exact)),
        (duplicate_token_score(maps, ids), duplicate_token_score(exact, ids)),
        (induction_score(maps, 20), induction_score(exact, 20)),
        (sink_score(maps)[0], sink_score(exact)[0]),
    ]
    for got, want in pairs:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)


# ------------------------------------------------------------------ a clean value of another length


@torch.no_grad()
def test_a_clean_value_of_another_length_is_refused_on_the_calls_last_piece_too():
    """Titans MAC (segments of 4) reads an 8-token call in two pieces. A clean ``hook_v`` recorded
    on a 4-token input has the last piece's length; patching position 6 only (the first piece
    selects nothing and is left alone) took that 4-token value whole as tokens 4 … 7 — another
    input's tokens 0 … 3 — instead of refusing it."""
    m = tiny_titans_mac(V, 4)
    name = "blocks.0.mixer.attn.hook_v"
    short = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(3))
    _, cache = m.run_with_cache(short, names=name)
    with pytest.raises(ValueError, match=r"the clean value \[1, 4, 2, 8\] does not match the value"):
        m.run_with_hooks(ids, patch(m, cache, name, positions=[6]))
    # a clean value of the call's own length still patches that piece's row
    _, clean = m.run_with_cache(ids.flip(1), names=name)
    seen = []
    hooks = patch(m, clean, name, positions=[6]) + [(name, lambda v, n: seen.append(v.clone()))]
    m.run_with_hooks(ids, hooks)
    torch.testing.assert_close(seen[-1][:, 2], clean[name][:, 6], rtol=0, atol=0)


# ----------------------------------------------------------------------------- capacity in bf16


def test_recall_of_a_bf16_read_is_not_rounded_to_bf16():
    """999 of 1000 reads recalled: bf16 has no number between 0.996 and 1, so the share came back
    as a perfect 1.0."""
    v = torch.randn(1, 1000, 1, 8, generator=torch.Generator().manual_seed(0))
    y = v.clone()
    y[0, 0] = -v[0, 0]  # the one miss: its nearest value is not its own
    assert float(recall_accuracy(y, v)) == pytest.approx(0.999, abs=1e-7)
    assert float(recall_accuracy(y.bfloat16(), v.bfloat16())) == pytest.approx(0.999, abs=1e-7)


def test_write_and_recall_runs_in_bf16_and_matches_a_hand_delta_rule():
    """One pair written into the plain matrix memory from zero: ``W = θ v kᵀ`` and the read is
    ``θ v`` (a unit key), so recall is 1 and the error ``(1 − θ)²`` exactly. bf16 pairs raised a
    dtype error (float32 weights read with bf16 keys)."""
    spec = capacity_variants(chunk_size=1)["matrix_plain"][0]
    for dtype in (torch.float64, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        k, v = random_pairs(1, 16, 3, g, dtype)
        w = initial_weights(spec, 16, 3, g, dtype)
        r = write_and_recall(spec, k, v, 0.25, w)
        torch.testing.assert_close(r["recall"].double(), torch.ones(3, dtype=torch.float64))
        tol = 1e-12 if dtype == torch.float64 else 2e-2  # bf16 keys are not exactly unit
        torch.testing.assert_close(
            r["nmse"].double(), torch.full((3,), 0.75**2, dtype=torch.float64), rtol=tol, atol=0
        )


# ------------------------------------------------------------------------------- the QR iteration


def test_the_qr_iteration_of_a_fixed_decay_is_its_log_and_its_half_life():
    """``A_t = diag(0.9, 0.5)`` for every ``t``: exponents ``ln 0.9``, ``ln 0.5`` (time scales
    ``−1 / ln 0.9`` and ``−1 / ln 0.5``), to rounding; through ``tokens`` a step of 4 tokens
    divides them by 4."""
    from mnemo.interp.lyapunov import half_lives, matrix_spectrum

    A = torch.diag(torch.tensor([0.9, 0.5], dtype=torch.float64)).expand(7, 2, 2)
    lam = matrix_spectrum(A)
    want = torch.tensor([math.log(0.9), math.log(0.5)], dtype=torch.float64)
    torch.testing.assert_close(lam, want, rtol=1e-14, atol=0)
    torch.testing.assert_close(-1 / lam, -1 / want, rtol=1e-14, atol=0)
    torch.testing.assert_close(half_lives(lam), math.log(2) / -want, rtol=1e-14, atol=0)
    torch.testing.assert_close(matrix_spectrum(A, tokens=28), want / 4, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"k": 0}, "k"),  # returned no exponent
        ({"k": -1}, "k"),  # a bare torch error
        ({"k": True}, "k"),  # one exponent
        ({"tokens": 0}, "tokens"),  # -inf
        ({"tokens": -5}, "tokens"),  # every exponent's sign flipped: decays read as amplified
        ({"tokens": float("nan")}, "tokens"),
    ],
)
def test_the_qr_iteration_refuses_a_bad_k_or_token_count_by_name(kwargs, named):
    from mnemo.interp.lyapunov import matrix_spectrum

    A = torch.diag(torch.tensor([0.9, 0.5], dtype=torch.float64)).expand(5, 2, 2)
    with pytest.raises(ValueError, match=rf"^{named}: expected"):
        matrix_spectrum(A, **kwargs)


# ------------------------------------------------------------------------ metrics of float64 models


def test_metrics_of_float64_logits_are_not_rounded_to_float32():
    """A logit difference of 1e-6 between logits near 10 (float32 spacing there: 1e-6): the
    metrics cast float64 logits to float32 and came back up to ~50% off; the float64 hand values
    hold to 1e-12."""
    from mnemo.interp.interventions import logit_difference, next_token_loss

    g = torch.Generator().manual_seed(0)
    logits = 10 + torch.randn(2, 5, V, generator=g, dtype=torch.float64) * 1e-6
    ids = torch.randint(0, V, (2, 5), generator=g)
    want = (logits[:, -1, 3] - logits[:, -1, 4]).mean()
    got = logit_difference(3, 4)(logits)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(next_token_loss(ids)(logits), ce, rtol=1e-14, atol=0)


class _Fixed(torch.nn.Module):
    """Fixed float64 logits (a model of the tokens' positions only)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, ids):
        return self.logits[: ids.shape[0], : ids.shape[1]], None


def test_icl_score_of_float64_logits_is_the_float64_difference_of_the_span_means():
    g = torch.Generator().manual_seed(1)
    logits = 10 + torch.randn(2, 20, V, generator=g, dtype=torch.float64) * 1e-6
    ids = torch.randint(0, V, (2, 21), generator=g)
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(0)
    want = float(loss[16:20].mean() - loss[1:3].mean())  # T = 20: late 16…19, early floor(1) … ceil(3)
    assert icl_score(_Fixed(logits), ids) == pytest.approx(want, rel=1e-12, abs=1e-15)


@torch.no_grad()
def test_activation_patching_keeps_a_float64_models_metric_unrounded():
    from mnemo.interp.interventions import activation_patching, logit_difference, patch
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("gla", vocab_size=V, d_model=32, n_layers=2)).double().eval()
    clean = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    corrupted = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(2))
    metric = logit_difference(3, 4)
    res = activation_patching(m, clean, corrupted, metric, "hook_o", per="layer")
    assert res.values.dtype == torch.float64
    _, cache = m.run_with_cache(clean, names="hook_o")
    for i, name in enumerate(res.names):
        by_hand = metric(m.run_with_hooks(corrupted, patch(m, cache, name))[0])
        assert float(res.values[i]) == float(by_hand)

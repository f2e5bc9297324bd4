"""Second break-it review of the utility modules (``mnemo.argtypes``, ``mnemo.runtime``,
``mnemo.plotting``, ``mnemo.testing``) and of the documented examples: each test pins a defect
that was found, against an independent hand computation or the documented promise."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest
import torch

from mnemo import argtypes as kinds
from mnemo.ops import gated_linear_attention
from mnemo.testing import check_float32_realistic, claim, compare, get_spec, rel_rms
from mnemo.testing.contract import _Worst

ROOT = Path(__file__).resolve().parents[1]


# --- mnemo.testing.compare: the relative RMS at any magnitude --------------------------------------


@pytest.mark.parametrize("scale", [1e-170, 1e-5, 1.0, 1e200])
def test_rel_rms_is_the_same_ratio_at_any_magnitude(scale):
    # by hand: actual = 2x, expected = 3x (elementwise), so rms(a - e) / rms(e) = 1/3 exactly,
    # whatever x's scale; the squares of 1e200 overflowed (nan) and those of 1e-170 underflowed (0)
    x = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64) * scale
    assert rel_rms(2 * x, 3 * x) == pytest.approx(1 / 3, rel=1e-12)
    err, problem = compare(2 * x, 3 * x, floor=0.0)
    assert problem == "" and err == pytest.approx(1 / 3, rel=1e-12)


def test_rel_rms_floor_still_applies_to_the_unscaled_reference():
    # rms(expected) = 1e-8 is below the floor 1e-6: the error 1e-8 is divided by the floor
    e = torch.full((3,), 1e-8, dtype=torch.float64)
    assert rel_rms(torch.zeros(3, dtype=torch.float64), e, floor=1e-6) == pytest.approx(1e-2, rel=1e-12)
    assert rel_rms(torch.ones(2), torch.ones(2)) == 0.0
    assert rel_rms(torch.empty(0), torch.empty(0)) == 0.0


def test_a_check_does_not_pass_when_a_later_comparison_is_huge():
    # values near 1e200 made the error NaN, and a NaN after a good comparison was dropped (NaN > 0
    # is False): the check passed with a relative error of 2/3 in it
    w = _Worst(get_spec("gla_scalar"), "forms", 1e-10)
    w.close(torch.ones(3), torch.ones(3), "good")
    big = torch.full((3,), 1e200, dtype=torch.float64)
    w.close(big, 3 * big, "huge")
    r = w.result()
    assert not r.passed and r.error == pytest.approx(2 / 3, rel=1e-12) and r.message == "huge", r


def test_a_nan_error_fails_the_check(monkeypatch):
    import mnemo.testing.contract as C

    w = _Worst(get_spec("gla_scalar"), "forms", 1e-10)
    w.close(torch.ones(3), torch.ones(3), "good")
    monkeypatch.setattr(C, "compare", lambda a, e: (float("nan"), ""))
    w.close(torch.ones(3), torch.ones(3), "unmeasurable")
    r = w.result()
    assert not r.passed and r.error == math.inf and "unmeasurable" in r.message, r


# --- mnemo.testing.contract: the float32 check requires float32 results ----------------------------


def _gla_float64_state(q, k, v, g, **kw):
    """A float32 op whose final state comes back in float64 (twice the bytes of the state)."""
    o, s = gated_linear_attention(q, k, v, g, **kw)
    return o, None if s is None else s.double()


def test_float32_check_requires_a_float32_final_state():
    bad = claim(_gla_float64_state, "gla_scalar", modes=("chunk",))
    r = check_float32_realistic(bad, "chunk")
    assert not r.passed and "state dtype torch.float64" in r.message, r
    assert check_float32_realistic(claim(gated_linear_attention, "gla_scalar", modes=("chunk",)), "chunk")


# --- mnemo.argtypes -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["-0", "-0.0", "-0e5", " -0 "])
def test_negative_zero_is_read_as_zero(text):
    for kind in (kinds.nonneg_float, kinds.probability, kinds.finite_float):
        v = kind(text)
        assert v == 0.0 and math.copysign(1.0, v) == 1.0, (kind, text, v)


def test_an_existing_output_file_in_a_folder_that_takes_no_new_entries_is_refused(tmp_path, monkeypatch):
    # outputs are written through a temporary file beside them and a rename (atomic_write_text, and
    # SQLite's journal): an existing writable file in a read-only folder passed the check and the
    # write failed after the work. (Simulated: the tests may run as root, whom chmod does not stop.)
    folder = tmp_path / "ro"
    folder.mkdir()
    out = folder / "rows.json"
    out.write_text("[]")
    real = os.access
    monkeypatch.setattr(
        kinds.os, "access", lambda p, mode: False if Path(p) == folder and mode & os.W_OK else real(p, mode)
    )
    kind = kinds.OutFile(suffix=".json")
    with pytest.raises(argparse.ArgumentTypeError, match=r"got '.*rows\.json'.*not writable"):
        kind(str(out))
    # through OutPath too, and a writable folder is fine
    with pytest.raises(argparse.ArgumentTypeError, match="not writable"):
        kinds.OutPath(".json")(str(out))
    ok = tmp_path / "rows.json"
    ok.write_text("[]")
    assert kind(str(ok)) == str(ok)


# --- documentation ------------------------------------------------------------------------------


def _gla_reads_with_2q(q, k, v, g, **kw):
    """Wrong in every form alike (the token loop too): the query is doubled."""
    return gated_linear_attention(2 * q, k, v, g, **kw)


def test_with_op_is_documented_as_a_consistency_check_and_claim_catches_the_op():
    # specs.py said ``spec.with_op(other)`` "tests any op with the same signature": an op wrong in
    # every form passes all its rows there, since its own token loop is the reference
    from mnemo.testing import OpSpec, run_contract, verify
    from mnemo.testing import specs as specs_module

    assert run_contract(
        get_spec("gla_scalar").with_op(_gla_reads_with_2q), quick=True, checks="forms*"
    ).passed
    doc = " ".join((OpSpec.with_op.__doc__ + specs_module.__doc__).split())
    assert "own recurrent mode is the reference" in doc and "checked against each other only" in doc
    assert "claim" in OpSpec.with_op.__doc__
    report = verify(_gla_reads_with_2q, claims="gla_scalar", quick=True, checks="forms")
    assert not report.passed and report[0].error > 0.1, report.table()


def test_the_guides_point_at_modules_that_hold_what_they_say():
    # correctness.md said the contract is stated in tests/ops/contract.py, a shim "Moved to
    # mnemo.testing"; a page naming a .py file must name one that is not such a leftover
    import ast
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
    for page in pages:
        for name in set(re.findall(r"`([\w./-]+\.py)`", page.read_text())):
            path = ROOT / name
            assert path.is_file(), f"{page.name}: {name} does not exist"
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert not doc.startswith("Moved to"), f"{page.name} points at {name}: {doc.splitlines()[0]}"
    text = (ROOT / "docs" / "guides" / "correctness.md").read_text()
    assert "`mnemo/testing/contract.py`" in text


def _guide_windows(n_tokens: int, W: int) -> list[int]:
    """The window starts of nested_learning.md's Python loop (its ``for s in range(...)`` line,
    evaluated as written) over ``n_tokens`` token ids."""
    import re

    page = (ROOT / "docs" / "guides" / "nested_learning.md").read_text()
    (header,) = re.findall(r"^for s in (range\(.*\)):", page, re.M)
    ids = torch.zeros(1, n_tokens, dtype=torch.long)
    return list(eval(header, {"ids": ids, "W": W}))


@pytest.mark.parametrize("n_tokens", [400, 257, 385, 129, 200])
def test_the_guides_carry_state_loop_reads_the_trainers_windows(n_tokens):
    # "the same loop ... is what a test checks the trainer against": with N − 1 a multiple of W
    # (N = 257, W = 128) the loop stopped one window early, where the trainer reads 2 windows
    from mnemo.train.batches import CarriedStreams

    W = 128
    streams = CarriedStreams(torch.arange(n_tokens), batch_size=1, seq_len=W)
    trainer = [int(streams.batch(k)[0][0, 0]) for k in range(streams.windows)]
    assert _guide_windows(n_tokens, W) == trainer
    for s in trainer:  # each window has its W targets, one token later
        assert s + W + 1 <= n_tokens


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--n", "-1_000", "an int >= 1"),
        ("--lr", "-1_000.5", "a finite number > 0"),
        ("--lr", "-1e1_0", "a finite number > 0"),
        ("--lr", "-.5", "a finite number > 0"),
    ],
)
def test_a_negative_number_with_digit_groups_reaches_the_kind(flag, value, expected, capsys):
    # float("-1_000") reads it, so the parser must take it as the option's value (it said
    # "expected one argument", naming neither the expected nor the received value)
    p = kinds.Parser(prog="x")
    p.add_argument("--lr", type=kinds.positive_float)
    p.add_argument("--n", type=kinds.positive_int)
    with pytest.raises(SystemExit) as e:
        p.parse_args([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected {expected}, got {value!r}" in err, err


def test_option_like_words_are_still_options():
    p = kinds.Parser(prog="x")
    p.add_argument("--n", type=kinds.positive_int)
    p.add_argument("-_", dest="u", action="store_true")
    assert p.parse_args(["--n", "3", "-_"]) == argparse.Namespace(n=3, u=True)
    for text in ("-_1", "-1__0", "-1_", "-_.5"):
        assert not p._negative_number_matcher.match(text), text

"""``mnemo verify`` and :mod:`mnemo.testing` as a tool: correct ops pass, planted bugs are caught
with a large error, a missing third-party package is a one-line note."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

import mnemo.testing.specs as specs_mod
from mnemo.commands import verify as V
from mnemo.ops import gated_delta_rule, gated_linear_attention
from mnemo.testing import (
    ContractError,
    check_forms_agree,
    claim,
    get_spec,
    require,
    third_party,
    verify,
)


def _gla_one_minus_g(q, k, v, g, **kw):
    """Planted bug: the chunk form decays by ``1 − exp(g)`` instead of ``exp(g)``."""
    if kw.get("mode") == "chunk" and g is not None:
        g = torch.log1p(-g.exp())
    return gated_linear_attention(q, k, v, g, **kw)


def _gla_decay_one_token_late(q, k, v, g, **kw):
    """Planted bug: the chunk form applies each token's decay one token late."""
    if kw.get("mode") == "chunk" and g is not None:
        g = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1)
    return gated_linear_attention(q, k, v, g, **kw)


def _gdr_raises(q, k, v, g, beta, **kw):
    raise RuntimeError("kernel exploded")


def test_verify_table_for_mnemo_ops_passes(capsys):
    rc = V.main(["--ops", "gla_scalar,delta_rule", "--quick", "--third-party", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gla_scalar" in out and "delta_rule" in out and " FAIL " not in out
    for check in ("forms[chunk]", "split[parallel]", "decode[chunk]", "grad[chunk]", "gradcheck"):
        assert check in out
    assert "varlen+S0[recurrent]" in out and "float32[chunk]" in out and "empty[chunk]" in out
    assert "mnemo: 2 ops" in out and "0 failed" in out


def test_add_parser_wires_a_verify_subcommand(capsys):
    p = argparse.ArgumentParser(prog="mnemo")
    V.add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["verify", "--ops", "ssd", "--checks", "forms*", "--quick", "--third-party", "none"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "ssd_grouped" in out and "forms+S0[parallel]" in out and "grad[" not in out


def test_unmatched_ops_pattern_is_a_usage_error(capsys):
    assert V.main(["--ops", "no_such_op", "--third-party", "none"]) == 2
    assert "matches no spec" in capsys.readouterr().err


@pytest.mark.parametrize("bug", [_gla_one_minus_g, _gla_decay_one_token_late])
def test_planted_chunk_bug_is_reported_with_a_large_error(bug):
    report = verify(bug, claims="gla_scalar", modes=("recurrent", "chunk"), quick=True, checks="forms*")
    rows = {r.check: r for r in report}
    assert rows["forms[recurrent]"].passed  # the correct form still agrees with mnemo's reference
    bad = rows["forms[chunk]"]
    assert not bad.passed and bad.error > 1e-3, bad
    assert "chunk" in bad.message
    assert not report.passed and "FAIL" in report.table()
    with pytest.raises(ContractError, match="forms"):
        report.raise_if_failed()


def test_planted_bug_fails_the_cli_with_exit_code_1(monkeypatch, capsys):
    bad = get_spec("gla_scalar").with_op(_gla_one_minus_g, name="gla_one_minus_g")
    monkeypatch.setattr(specs_mod, "SPECS", [bad])
    rc = V.main(["--quick", "--third-party", "none", "--checks", "forms*,grad*,split*"])
    out = capsys.readouterr().out
    assert rc == 1
    fails = [line for line in out.splitlines() if " FAIL " in line]
    assert any("forms[chunk]" in line for line in fails)
    assert any("grad[chunk]" in line for line in fails)
    assert not any("[parallel]" in line for line in fails)  # the parallel form is untouched


def test_an_op_that_raises_is_a_failed_row_not_a_crash():
    r = check_forms_agree(claim(_gdr_raises, "gated_delta_rule", modes=("chunk",)), 5, True)
    assert not r.passed and r.error == float("inf")
    assert "RuntimeError: kernel exploded" in r.message
    with pytest.raises(ContractError) as info:
        require(r)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_mnemo_op_claiming_its_own_recurrence_passes():
    report = verify(
        gated_delta_rule, claims="gated_delta_rule", quick=True, checks=["forms*", "split*", "grad*"]
    )
    assert report.passed, report.table()
    # with mnemo's recurrent form as an independent reference, every mode is compared, "recurrent" too
    assert {r.check for r in report} >= {"forms[recurrent]", "forms[chunk]", "forms+S0[parallel]"}


def test_unknown_claim_names_the_known_specs():
    with pytest.raises(KeyError, match="gated_delta_rule"):
        claim(gated_delta_rule, "no_such_recurrence")


# --- third party ---------------------------------------------------------------------------------


@pytest.fixture
def fla_missing(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "fla" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_third_party_is_skipped_with_a_note(fla_missing, capsys):
    assert not third_party.available("fla")
    rc = V.main(["--ops", "gla_nogate", "--checks", "forms", "--quick"])  # --third-party auto
    out = capsys.readouterr().out
    assert rc == 0
    assert "third-party checks skipped: fla-core is not installed" in out
    assert "Traceback" not in out


def test_requested_missing_third_party_is_one_line_exit_2(fla_missing, capsys):
    rc = V.main(["--third-party", "fla", "--ops", "gla_nogate"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and "fla-core is not installed" in err


needs_fla = pytest.mark.skipif(not third_party.available("fla"), reason="fla-core not installed")


@needs_fla
def test_fla_references_agree_with_mnemo(capsys):
    rc = V.main(["--third-party", "fla", "--ops", "fla.*gated_delta_rule", "--quick"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fla.naive_recurrent_gated_delta_rule" in out and "fla.naive_chunk_gated_delta_rule" in out
    assert "forms+S0[chunk]" in out and "split[chunk]" in out and "grad[recurrent]" in out


@needs_fla
def test_a_wrong_third_party_mapping_is_caught():
    """fla's recurrent gated delta rule takes ``beta`` before ``g``; passing them in mnemo's order
    is the kind of slip the contract exists to catch."""
    f = third_party.fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule

    def swapped(x, *, initial_state=None, **_):
        return f(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=initial_state, output_final_state=True
        )

    spec = claim(
        swapped,
        "gated_delta_rule",
        calling="inputs",
        modes=("recurrent",),
        supports={"initial_state", "final_state", "grad"},
        f64_tol=2e-5,
    )
    report = verify(spec, quick=True, checks="forms*")
    assert report and not report.passed
    assert min(r.error for r in report) > 1e-2


def test_mnemo_verify_is_a_cli_command(capsys):
    from mnemo.cli import main

    assert main(["verify", "--quick", "--ops", "gla_scalar", "--third-party", "none"]) == 0
    out = capsys.readouterr().out
    assert "gla_scalar" in out and "FAIL" not in out and "0 failed" in out

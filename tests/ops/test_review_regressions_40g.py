"""Regression review 40g: what the fixes of review 5-F / 5-K (commits 0ef6745, 97694c7, 0559c1c)
broke or missed."""

from __future__ import annotations

import json


def _verify_native(monkeypatch, tmp_path, *extra):
    from mnemo.commands import verify

    monkeypatch.setenv("MNEMO_BACKEND", "native")
    out = tmp_path / "rows.json"
    argv = ["--ops", "delta_rule", "--checks", "forms", "--quick", "--third-party", "none"]
    rc = verify.main([*argv, "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_verify_json_keeps_the_na_rows_of_a_forced_backend(monkeypatch, tmp_path, capsys):
    """0559c1c listed the forms a forced backend cannot serve as n/a in the printed table but
    dropped them from ``--json`` (before it they were there, as failures): the JSON said
    ``forms[parallel]`` was never checked. They are rows with ``status = "n/a"``, ``passed = None``."""
    rc, rows = _verify_native(monkeypatch, tmp_path)
    assert rc == 0, capsys.readouterr().out
    by_check = {r["check"]: r for r in rows}
    assert by_check["forms[chunk]"]["status"] == "pass" and by_check["forms[chunk]"]["passed"] is True
    na = by_check["forms[parallel]"]
    assert na["status"] == "n/a" and na["passed"] is None
    assert "backend 'native' cannot serve" in na["message"]


def test_verify_verbose_says_na_not_fail_for_an_unserved_form(monkeypatch, tmp_path, capsys):
    """With ``-v`` each row printed as it finished said ``FAIL … BackendError`` for a form the
    forced backend cannot serve, while the summary below it said n/a and 0 failed."""
    rc, _ = _verify_native(monkeypatch, tmp_path, "-v")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out, out
    assert "forms[parallel]  n/a on 'native'" in out

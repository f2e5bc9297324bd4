"""Regression review 37d: what c2d9c06 / d445756 / f2733b5 / ebbf4f2 broke or missed."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.testing import assert_close, rel_rms


@pytest.mark.parametrize("big", [1e24, 1e100, 1e300])
def test_rel_rms_of_a_large_error_against_a_zero_reference_is_inf_not_zero_division(big):
    # c2d9c06 scaled by the largest magnitude s and kept the 1e-300 guard as 1e-300 / s, which
    # underflows to 0 for s > ~2e23: with floor=0 (rel_rms's default, the mixer checks') and an
    # all-zero reference the ratio became 1.0 / 0.0 -> ZeroDivisionError (inf before)
    a = torch.tensor([big, -big], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    assert rel_rms(a, zero) == math.inf
    assert rel_rms(zero, zero) == 0.0
    # a reference far below the error (its squares underflow once scaled) likewise
    assert rel_rms(a, torch.full((2,), 1e-300, dtype=torch.float64)) == math.inf
    with pytest.raises(AssertionError, match="relative RMS error inf"):
        assert_close(a, zero, tol=1e-10, floor=0.0, what="x")


def test_rel_rms_scaled_keeps_the_ratio_and_nan():
    x = torch.tensor([3.0, -4.0], dtype=torch.float64)
    for m in (1e-200, 1.0, 1e200):
        assert rel_rms(2 * m * x, m * x) == pytest.approx(1.0, rel=1e-12)
        assert rel_rms(m * x, torch.zeros(2, dtype=torch.float64), floor=10.0 * m) == pytest.approx(
            math.sqrt(12.5) / 10.0, rel=1e-12
        )
    assert math.isnan(rel_rms(torch.tensor([float("nan")]), torch.tensor([1.0])))


def test_probe_of_a_bf16_folder_computes_in_float32_as_eval_and_generate_do(tmp_path, capsys):
    # 3712255 made from_pretrained keep the stored dtype; ebbf4f2 cast back to float32 in eval and
    # generate only: `mnemo probe` (circuits, timescales, spectrum, ablate) ran a bf16 folder in
    # bf16, its scores ~1e-4 off those of the same weights in float32 (which it gave before)
    import json

    from mnemo.cli import main
    from mnemo.data.tokenizer import CharTokenizer, save_tokenizer
    from mnemo.models import LanguageModel, ModelConfig

    tok = CharTokenizer.from_text("the quick brown fox jumps over the lazy dog. " * 4)
    torch.manual_seed(0)
    lm = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=1, mixer="gla")).eval()
    for name, dtype in (("b", torch.bfloat16), ("f", torch.float32)):
        lm.to(dtype).save_pretrained(tmp_path / name)  # f: the bf16 values, stored in float32
        save_tokenizer(tok, tmp_path / name)
    got = {}
    for name in ("b", "f"):
        capsys.readouterr()
        argv = [
            "probe",
            "circuits",
            "--checkpoint",
            str(tmp_path / name),
            "--out",
            str(tmp_path / f"o{name}"),
        ]
        assert main([*argv, "--length", "16"]) == 0
        got[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["layers"]
    assert got["b"] == got["f"]

"""YaRN (Peng et al. 2023): NTK-by-parts frequencies, attention temperature, forms, config, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mnemo.layers import Attention
from mnemo.layers.rotary import (
    RotaryEmbedding,
    check_rope_scaling,
    ntk_inv_freq,
    yarn_attention_factor,
    yarn_inv_freq,
    yarn_ramp,
)
from mnemo.testing.mixers import check_mixer

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def test_frequencies_follow_the_papers_formula_by_hand():
    """θ_d = 10000^{-2d/8} = 1, 0.1, 0.01, 0.001; L = 100 gives r = L θ / 2π = 15.9, 1.59, 0.159,
    0.0159 rotations; with α = 1, β = 8: the first keeps θ, the last two are divided by s, the
    second is on the ramp γ = (r − 1) / 7."""
    s, L = 4.0, 100
    rot = RotaryEmbedding(
        8, scaling={**YARN, "factor": s, "original_max_position_embeddings": L, "beta_fast": 8}
    )
    theta = [1.0, 0.1, 0.01, 0.001]
    r1 = L * 0.1 / (2 * math.pi)
    g1 = (r1 - 1) / (8 - 1)
    expected = [1.0, (1 - g1) * 0.1 / s + g1 * 0.1, 0.01 / s, 0.001 / s]
    assert torch.allclose(rot.base_inv_freq.double(), torch.tensor(theta, dtype=torch.float64), rtol=1e-6)
    assert torch.allclose(rot.inv_freq.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6)
    assert rot.inv_freq[0] == rot.base_inv_freq[0]  # high frequency: exactly unchanged
    assert 0 < g1 < 1
    # the ramp itself: 0 below α, 1 above β, linear between
    r = torch.tensor([0.5, 1.0, 4.5, 8.0, 20.0])
    assert torch.allclose(yarn_ramp(r, 1.0, 8.0), torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))
    # as a function: same numbers
    again = yarn_inv_freq(rot.base_inv_freq, s, L, beta_fast=8, beta_slow=1)
    assert torch.equal(again, rot.inv_freq)


def test_temperature_and_the_logit_scale():
    assert yarn_attention_factor(1.0) == 1.0
    assert yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4.0) + 1)
    att = Attention(32, n_heads=2, rope_scaling=YARN)
    af = 0.1 * math.log(4.0) + 1
    assert att.rotary.attention_factor == pytest.approx(af)
    assert att.scale == pytest.approx(16**-0.5 * af**2)
    # an explicit attention_factor overrides the formula
    assert Attention(32, n_heads=2, rope_scaling={**YARN, "attention_factor": 1.5}).scale == pytest.approx(
        16**-0.5 * 2.25
    )


def test_attention_with_yarn_equals_a_hand_written_reference():
    torch.manual_seed(0)
    att = Attention(16, n_heads=2, rope_scaling=YARN).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    y, _ = att(x)
    rot = att.rotary
    q = att.q_proj(x).view(2, 9, 2, 8)
    k, v = att.kv_proj(x).view(2, 9, 2, 2, 8).unbind(2)
    pos = torch.arange(9, dtype=torch.float64)
    ang = pos[:, None] * yarn_inv_freq(rot.base_inv_freq.double(), 4.0, 16)[None]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    def rope(t):
        a, b = t.chunk(2, -1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    af = 0.1 * math.log(4) + 1
    q, k = rope(q) * af, rope(k) * af  # the temperature on both q and k
    logits = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8)
    logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", logits.softmax(-1), v).reshape(2, 9, 16)
    assert torch.allclose(y, att.o_proj(o), atol=1e-12)


def test_factor_one_is_plain_rope_exactly():
    torch.manual_seed(0)
    plain = Attention(32, n_heads=2)
    scaled = Attention(32, n_heads=2, rope_scaling={**YARN, "factor": 1})
    scaled.load_state_dict(plain.state_dict())
    x = torch.randn(2, 12, 32)
    assert torch.equal(scaled.rotary.inv_freq, plain.rotary.inv_freq) and scaled.scale == plain.scale
    assert torch.equal(scaled(x)[0], plain(x)[0])
    # set_rope_scaling on a built layer, and back
    plain.set_rope_scaling(YARN)
    assert not torch.equal(plain(x)[0], scaled(x)[0])
    plain.set_rope_scaling(None)
    assert torch.equal(plain(x)[0], scaled(x)[0])


@pytest.mark.parametrize(
    "options",
    [
        {"rope_scaling": YARN},
        {"rope_scaling": {**YARN, "beta_fast": 4, "beta_slow": 0.5}, "rotary_dim": 8, "n_kv_heads": 1},
        {"rope_scaling": YARN, "window": 4, "mode": "recurrent"},
    ],
)
def test_yarn_forms_agree(options):
    """Splits, token steps, cached decoding in a model, hooks and maps (float64, 1e-10)."""
    failed = [r for r in check_mixer("attention", options=options) if not r.passed]
    assert not failed, failed


def test_parallel_equals_recurrent_with_yarn():
    torch.manual_seed(0)
    att = Attention(16, n_heads=2, rope_scaling=YARN).double()
    x = torch.randn(1, 21, 16, dtype=torch.float64)
    assert torch.allclose(att(x)[0], att(x, mode="recurrent")[0], atol=1e-12)


def test_config_round_trip_json_and_yaml(tmp_path):
    from mnemo.models import LanguageModel, ModelConfig, build_config
    from mnemo.train import TrainConfig, load_config_file

    opts = {
        "attention": {
            "n_heads": 2,
            "rope_scaling": {"type": "yarn", "factor": 2, "original_max_position_embeddings": 8},
        }
    }
    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=1, mixer_options=opts)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    torch.manual_seed(0)
    a = LanguageModel(cfg)
    b = LanguageModel(again)
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 11, (1, 10))
    assert torch.equal(a(ids)[0], b(ids)[0])
    assert b.blocks[0].mixer.rotary.scaling["factor"] == 2.0
    (tmp_path / "c.yaml").write_text(
        "model: transformer\nmodel_overrides:\n  mixer_options:\n    attention:\n      rope_scaling:\n"
        "        rope_type: yarn\n        factor: 4\n        original_max_position_embeddings: 64\n"
    )
    tc = TrainConfig.from_dict(load_config_file(tmp_path / "c.yaml"))
    m = LanguageModel(build_config(tc.model, vocab_size=11, d_model=16, n_layers=1, **tc.model_overrides))
    assert m.blocks[0].mixer.rotary.scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize(
    "scaling, error, match",
    [
        (
            {**YARN, "factor": 0.5},
            ValueError,
            r"rope_scaling\['factor'\]: expected a finite number >= 1.0, got 0.5",
        ),
        ({"rope_type": "yarn", "factor": 2}, ValueError, "YaRN needs 'original_max_position_embeddings'"),
        (
            {**YARN, "original_max_position_embeddings": 0},
            ValueError,
            "original_max_position_embeddings'\\]: expected a positive int",
        ),
        ({**YARN, "beta_slow": 40}, ValueError, "expected beta_slow < beta_fast, got beta_slow = 40.0"),
        ({**YARN, "beta_fast": -1}, ValueError, r"rope_scaling\['beta_fast'\]"),
        (
            {**YARN, "rope_type": "linear", "beta_fast": 8},
            ValueError,
            r"rope_type 'linear' takes 'factor' only, got also \['beta",
        ),
        ({"rope_type": "ntk"}, ValueError, "rope_type 'ntk' needs 'factor'"),
        ({"rope_type": "ntk", "factor": 0.5}, ValueError, r"rope_scaling\['factor'\]: expected a finite"),
        (
            {**YARN, "rope_type": "dynamic"},
            ValueError,
            r"rope_scaling\['rope_type'\]: expected 'yarn', 'linear'",
        ),
        ({**YARN, "mscale": 1}, ValueError, r"unknown key\(s\) \['mscale'\]"),
        (
            {**YARN, "type": "dynamic"},
            ValueError,
            "'type' \\('dynamic'\\) and 'rope_type' \\('yarn'\\) disagree",
        ),
        ("yarn", TypeError, "rope_scaling: expected a dict"),
    ],
)
def test_bad_scaling_names_the_argument(scaling, error, match):
    with pytest.raises(error, match=match):
        Attention(16, n_heads=2, rope_scaling=scaling)


def test_scaling_without_rope_and_defaults():
    with pytest.raises(ValueError, match="rope_scaling: needs rope=True"):
        Attention(16, n_heads=2, rope=False, rope_scaling=YARN)
    with pytest.raises(ValueError, match="has no rotary positions"):
        Attention(16, n_heads=2, rope=False).set_rope_scaling(YARN)
    assert check_rope_scaling({"rope_type": "default"}) is None
    with pytest.raises(
        ValueError, match=r"rope_type 'default' \(plain RoPE\) takes no other keys, got \['factor'\]"
    ):
        check_rope_scaling({"rope_type": "default", "factor": 2.0})
    full = check_rope_scaling(YARN)
    assert full["beta_fast"] == 32 and full["beta_slow"] == 1 and full["attention_factor"] is None


def test_mnemo_eval_yarn_per_length(tmp_path, capsys):
    from mnemo.cli import main

    out = tmp_path / "run"
    fast = [
        "--steps",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--eval-interval",
        "2",
        "--eval-batches",
        "1",
    ]
    fast += ["--d-model", "16", "--n-layers", "1", "--sample-tokens", "0", "--no-progress"]
    assert main(["train", "--model", "transformer", "--out", str(out), *fast]) == 0
    capsys.readouterr()
    assert (
        main(["eval", "--checkpoint", str(out), "--length", "16,32,64", "--yarn", "--max-batches", "1"]) == 0
    )
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["seq_len"] for r in rows] == [16, 32, 64]
    assert rows[0]["rope_scaling"] is None  # 1x: plain RoPE
    assert [r["rope_scaling"]["factor"] for r in rows[1:]] == [2.0, 4.0]
    # a rescaled model is not the training log's measurement, even at the training length
    assert [r["as_in_training"] for r in rows] == [True, False, False]  # 1x: plain RoPE
    assert main(["eval", "--checkpoint", str(out), "--yarn", "4", "--max-batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["as_in_training"] is False
    assert all(r["rope_scaling"]["original_max_position_embeddings"] == 16 for r in rows[1:])
    assert main(["eval", "--checkpoint", str(out), "--length", "32", "--max-batches", "1"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "rope_scaling" not in plain and plain["val_loss"] != rows[1]["val_loss"]
    assert main(["eval", "--checkpoint", str(out), "--yarn", "0.5"]) == 2
    assert "argument --yarn: expected a finite number >= 1 or 'auto', got '0.5'" in capsys.readouterr().err


def test_a_beta_fast_no_dimension_reaches_is_said():
    """(issue 39, YaRN) β_fast counts rotations over the training context; at L = 64 the fastest
    dimension (θ = 1) turns 64 / 2π = 10.2 times, so the paper's β_fast = 32 leaves no dimension
    unscaled: said, with the bound. β_fast = 8 (< 10.2) is quiet, and the frequencies mean what the
    warning says: with β_fast = 32 even θ = 1 is blended (changed), with 8 it is kept."""
    import math
    import warnings

    from mnemo.layers.rotary import check_rope_scaling, yarn_inv_freq

    with pytest.warns(UserWarning, match=r"turns only 10.2 times.*beta_fast <= L / 2π = 10.2"):
        check_rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_rope_scaling(
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8}
        )
    inv = torch.tensor([1.0, 0.1], dtype=torch.float64)
    assert yarn_inv_freq(inv, 4.0, 64, beta_fast=32)[0] < 1.0  # blended toward 1/4
    assert yarn_inv_freq(inv, 4.0, 64, beta_fast=8)[0] == 1.0  # 10.2 turns > 8: kept
    assert 64 / (2 * math.pi) == pytest.approx(10.19, abs=0.01)


def test_position_interpolation_and_ntk_frequencies_by_hand():
    """PI (Chen et al. 2023) divides every θ_d by s. NTK-aware (YaRN paper eq. 16) raises the base
    to θ s^{R/(R−2)}: with R = 8, θ = 10⁴ and s = 4 the base is 10⁴ · 4^{4/3}, so the fastest
    frequency stays 1 and the slowest, 10⁴^{-6/8} · 4^{-1}, is divided by exactly s."""
    s = 4.0
    pi = RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": s})
    theta = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    assert torch.allclose(pi.inv_freq.double(), theta / s, rtol=1e-6)
    assert pi.attention_factor == 1.0
    ntk = RotaryEmbedding(8, scaling={"rope_type": "ntk", "factor": s})
    base = 1e4 * s ** (8 / 6)
    by_hand = torch.tensor([base ** (-i / 8) for i in (0, 2, 4, 6)], dtype=torch.float64)
    assert torch.allclose(ntk.inv_freq.double(), by_hand, rtol=1e-6)
    assert ntk.inv_freq[0] == 1.0
    assert ntk.inv_freq[-1].item() == pytest.approx(0.001 / s, rel=1e-6)
    assert ntk.attention_factor == 1.0
    assert torch.equal(ntk_inv_freq(1e4, 8, s).float(), ntk.inv_freq)
    # a PI model at position s·p rotates exactly as plain RoPE at p
    x = torch.randn(1, 3, 2, 8)
    plain = RotaryEmbedding(8)
    p = torch.tensor([0.0, 1.0, 5.0])
    assert torch.allclose(pi.rotate(x, p * s), plain.rotate(x, p), atol=1e-5)
    # set_scaling back to None restores plain RoPE; the logit scale of an Attention is untouched
    pi.set_scaling(None)
    assert torch.equal(pi.inv_freq, plain.inv_freq)
    att = Attention(32, n_heads=2, rope_scaling={"rope_type": "ntk", "factor": 8})
    assert att.scale == pytest.approx(16**-0.5)


def test_position_interpolation_matches_transformers_linear():
    """``transformers``' ``"linear"`` rope type is PI: the same frequencies (an independent
    implementation)."""
    modeling_rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
    )
    inv, attention_scaling = modeling_rope_utils.ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    ours = RotaryEmbedding(32, theta=500.0, scaling={"rope_type": "linear", "factor": 4.0})
    assert torch.allclose(ours.inv_freq, inv.float(), rtol=1e-6)
    assert attention_scaling == 1.0


@pytest.mark.parametrize("kind", ["linear", "ntk"])
def test_pi_and_ntk_forms_agree(kind):
    """Splits, token steps, cached decoding, hooks and maps with the frequencies scaled."""
    failed = [
        r
        for r in check_mixer("attention", options={"rope_scaling": {"rope_type": kind, "factor": 3}})
        if not r.passed
    ]
    assert not failed, failed

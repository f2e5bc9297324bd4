"""The memory spectrum: known answers of the QR iteration (float64), each memory kind against its
exact transitions, tiny models of each mixer family, and the ``mnemo probe spectrum`` command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mnemo.interp.spectrum import (
    LN2,
    classify,
    delta_rule_spectrum,
    diagonal_spectrum,
    half_lives,
    lyapunov_spectrum,
    matrix_spectrum,
    memory_jvp_spectrum,
    memory_spectrum,
    summary_line,
    to_json,
)
from mnemo.interp.timescales import summarize, timescales
from mnemo.memory import init_state, preset
from mnemo.models import LanguageModel, build_config

F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# known answers
# ------------------------------------------------------------------------------------------------


def test_fixed_diagonal_decay_gives_its_log_decays():
    logd = torch.tensor([-0.01, -0.3, -1.2, -2.5], dtype=F64)
    A = torch.diag(logd.exp()).expand(50, 4, 4)
    lam = matrix_spectrum(A)
    assert torch.allclose(lam, logd.sort(descending=True).values, atol=1e-13)
    # time-varying diagonal gates: the time average of the log decays, through QR and directly
    g = -torch.rand(1, 60, 4, generator=_gen(), dtype=F64) * 3
    lam = matrix_spectrum(torch.diag_embed(g[0].exp()))
    assert torch.allclose(lam, diagonal_spectrum(g).sort(descending=True).values, atol=1e-13)
    # half-lives: ln 2 / −λ
    assert torch.allclose(half_lives(logd), LN2 / -logd)


def test_delta_rule_projections_cycling_through_a_basis_annihilate_everything():
    K, T = 4, 4 * 10
    k = torch.eye(K, dtype=F64)[torch.arange(T) % K][None, :, None, :]  # [1, T, 1, K]
    lam = delta_rule_spectrum(k, torch.ones(1, T, 1, dtype=F64), q0="identity")
    # each step projects out one basis direction: the product over a cycle is the zero matrix
    assert torch.isneginf(lam).all()


@pytest.mark.parametrize("K", [2, 3, 5])
def test_delta_rule_half_strength_halves_each_direction_once_per_cycle(K):
    T = K * 12
    k = torch.eye(K, dtype=F64)[torch.arange(T) % K][None, :, None, :]
    beta = torch.full((1, T, 1), 0.5, dtype=F64)
    lam = delta_rule_spectrum(k, beta, q0="identity")
    assert torch.allclose(lam, torch.full((1, K), math.log(0.5) / K, dtype=F64), atol=1e-14)
    # a rotated orthonormal basis and a random start: the same spectrum (to the transient's 1/T)
    Rot = torch.linalg.qr(torch.randn(K, K, generator=_gen(1), dtype=F64))[0]
    lam = delta_rule_spectrum(k @ Rot, beta, q0="random")
    assert torch.allclose(lam, torch.full((1, K), math.log(0.5) / K, dtype=F64), atol=1e-12)
    # a gate adds its mean log decay to every exponent
    g = torch.full((1, T, 1), -0.1, dtype=F64)
    lam = delta_rule_spectrum(k, beta, g, q0="identity")
    assert torch.allclose(lam, torch.full((1, K), math.log(0.5) / K - 0.1, dtype=F64), atol=1e-14)


def test_delta_rule_matches_explicit_transitions():
    B, T, H, K = 2, 30, 3, 5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=_gen(), dtype=F64), dim=-1)
    beta = torch.rand(B, T, H, generator=_gen(1), dtype=F64)
    g = -torch.rand(B, T, H, generator=_gen(2), dtype=F64)
    A = g.exp()[..., None, None] * (
        torch.eye(K, dtype=F64) - beta[..., None, None] * k[..., :, None] * k[..., None, :]
    )
    ref = matrix_spectrum(A.transpose(1, 2)).mean(0)  # [B, H, T, K, K] -> [H, K]
    assert torch.allclose(delta_rule_spectrum(k, beta, g), ref, atol=1e-12)


def test_random_orthogonal_transitions_have_zero_exponents():
    T, n = 40, 6
    Qs = torch.linalg.qr(torch.randn(T, n, n, generator=_gen(), dtype=F64))[0]
    lam = matrix_spectrum(Qs)
    assert lam.abs().max() < 1e-13
    lam = matrix_spectrum(Qs, k=3)  # the leading exponents from a random start
    assert lam.shape == (3,) and lam.abs().max() < 1e-13


def test_fixed_symmetric_matrix_gives_log_abs_eigenvalues():
    n, T = 5, 3000
    eig = torch.tensor([1.3, -0.9, 0.6, -0.35, 0.1], dtype=F64)
    V = torch.linalg.qr(torch.randn(n, n, generator=_gen(3), dtype=F64))[0]
    A = V @ torch.diag(eig) @ V.T
    expected = eig.abs().log().sort(descending=True).values
    lam = lyapunov_spectrum(lambda t, Q: A @ Q, T, n, q0="random")
    assert torch.allclose(lam, expected, atol=5e-3)  # the transient's O(1/T)
    lam = lyapunov_spectrum(lambda t, Q: A @ Q, T, n, q0="random", burn_in=200)
    assert torch.allclose(lam, expected, atol=1e-10)  # converged after the burn-in
    top2 = lyapunov_spectrum(lambda t, Q: A @ Q, T, n, k=2, burn_in=200)
    assert torch.allclose(top2, expected[:2], atol=1e-10)


def test_classify_shares_and_thresholds():
    T = 100
    lam = torch.tensor(
        [[-math.inf, -1.0, -LN2 / 10, -LN2 / 1000], [LN2 / 10, 0.0, -LN2 / 3, -LN2 / 50]], dtype=F64
    )
    c = classify(lam, context=T)
    assert c["irrelevant"] == 3 / 8  # −inf, −1 (half-life 0.69), half-life 3
    assert c["intermediate"] == 2 / 8  # half-lives 10 and 50
    assert c["marginal"] == 2 / 8  # half-life 1000 > context, and 0
    assert c["relevant"] == 1 / 8  # doubles every 10 tokens
    assert c["unresolved"] == 0 and c["directions"] == 8
    # leading exponents of a bigger space: the tail is irrelevant when the last computed one is
    c = classify(torch.tensor([[-0.01, -1.0]], dtype=F64), context=T, n=10)
    assert c["irrelevant"] == 9 / 10 and c["intermediate"] == 1 / 10
    c = classify(torch.tensor([[-0.01, -0.02]], dtype=F64), context=T, n=10)
    assert c["unresolved"] == 8 / 10 and c["intermediate"] == 2 / 10
    assert to_json({"a": [math.inf, -math.inf, 1.0]}) == {
        "a": [None, None, 1.0],
        "nonfinite": {"a/0": "Infinity", "a/1": "-Infinity"},
    }
    for bad in (0.0, -1.0, math.nan, math.inf, "4"):
        with pytest.raises(ValueError, match="irrelevant_half_life"):
            classify(lam, context=T, irrelevant_half_life=bad)
    c = classify(lam, context=T, irrelevant_half_life=99)
    assert c["irrelevant"] == 5 / 8 and c["intermediate"] == 0  # half-lives 10 and 50 now < 99
    # bands that meet (an irrelevant half-life past the context): irrelevant wins, no share is
    # negative (1e20 once counted half-life 1000 as both irrelevant and marginal: -1/8 intermediate)
    c = classify(lam, context=T, irrelevant_half_life=1e20)
    classes = ("irrelevant", "intermediate", "marginal", "relevant")
    assert [c[k] for k in classes] == [6 / 8, 0, 1 / 8, 1 / 8]  # only λ = 0 is left marginal


# ------------------------------------------------------------------------------------------------
# test-time-trained memories (JVP of the update)
# ------------------------------------------------------------------------------------------------


def _memory_inputs(B=2, T=20, H=2, D=4, seed=0):
    gen = _gen(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen, dtype=F64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen, dtype=F64)
    theta = torch.rand(B, T, H, generator=gen, dtype=F64) * 0.9
    g = -torch.rand(B, T, H, generator=gen, dtype=F64) * 0.2
    eta = torch.rand(B, T, H, generator=gen, dtype=F64)
    return q, k, v, theta, g, eta


def test_jvp_of_matrix_presets_reproduces_the_exact_spectra():
    q, k, v, theta, g, _ = _memory_inputs()
    B, T, H, D = q.shape
    zero = [torch.zeros(H, D, D, dtype=F64)]
    # l2 matrix memory, online, decay first: the gated delta rule with β = θ (each exponent × D)
    spec = preset("gated_deltanet")
    lam, n = memory_jvp_spectrum(spec, init_state(spec, zero, B), q, k, v, theta, g, directions=D * D)
    assert n == D * D
    assert torch.allclose(lam, delta_rule_spectrum(k, theta, g).repeat_interleave(D, -1), atol=1e-8)
    # dot matrix memory with a per-head decay (Mamba-2 / RetNet form): every exponent is mean g
    spec = preset("mamba2", chunk_size=8)
    lam, _ = memory_jvp_spectrum(spec, init_state(spec, zero, B), q, k, v, theta, g, directions=6)
    assert torch.allclose(lam, diagonal_spectrum(g)[:, None].expand(H, 6), atol=1e-8)


def test_jvp_forward_mode_agrees_with_central_differences():
    q, k, v, theta, g, eta = _memory_inputs(B=1, T=6, H=1, D=2)
    spec = preset("titans", chunk_size=3)
    gen = _gen(5)
    W = [torch.randn(1, i, o, generator=gen, dtype=F64) * 0.3 for i, o in spec.layer_dims(2, 2)]
    st = init_state(spec, W, q.shape[0])
    exact, n = memory_jvp_spectrum(spec, st, q, k, v, theta, g, eta, directions=2, method="forward")
    approx, _ = memory_jvp_spectrum(spec, st, q, k, v, theta, g, eta, directions=2)
    assert n == 2 * sum(i * o for i, o in spec.layer_dims(2, 2))  # accumulators and momentum
    assert torch.allclose(exact, approx, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# tiny models of each family
# ------------------------------------------------------------------------------------------------


def _model(name, n_layers=2):
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=20, d_model=16, n_layers=n_layers)).double().eval()


def _ids(T=24, seed=0):
    return torch.randint(0, 20, (1, T), generator=_gen(seed))


@pytest.mark.parametrize(
    "name, gate", [("gla", "per-channel"), ("mamba", "per-channel"), ("mamba2", "per-head")]
)
def test_diagonal_mixers_are_their_mean_log_decays_as_timescales_reads_them(name, gate):
    model, ids = _model(name), _ids()
    result = memory_spectrum(model, ids)
    _, cache = model.run_with_cache(ids, names="hook_g")
    for layer, e in result.items():
        assert e["kind"] == "diagonal" and e["gate"] == gate
        g = cache[f"blocks.{layer}.mixer.hook_g"]
        want = diagonal_spectrum(g)
        want = want[:, None] if want.ndim == 1 else want
        assert torch.allclose(torch.tensor(e["exponents"], dtype=F64), want.sort(-1, descending=True).values)
        assert e["summary"]["context"] == ids.shape[1]
    # on one token, the spectrum's half-lives are exactly the ones timescales summarises
    one = ids[:, :1]
    ts, sp = timescales(model, one), memory_spectrum(model, one)
    for layer in sp:
        mine = summarize(torch.tensor(sp[layer]["half_lives"], dtype=F64))
        for key in ("count", "never_decays", "min", "p10", "median", "p90", "max"):
            assert mine[key] == pytest.approx(ts[layer]["half_life"][key], rel=1e-5), key


@pytest.mark.parametrize("name", ["retnet", "mamba2"])
def test_per_head_gates_keep_row_h_for_head_h(name):
    """One scalar gate per head (RetNet's fixed γ_h = 1 − 2^(−5−h), Mamba-2's Δ A): row ``h`` of the
    exponents, half-lives and per-head shares is head ``h`` — by hand, ``−ln 2 / mean_t g_h``
    (RetNet's half-lives grow with ``h``: 21.8, 44.0, 88.4, 177.1 tokens), never sorted across
    heads."""
    model, ids = _model(name), _ids(T=40)
    e = memory_spectrum(model, ids)["0"]
    _, cache = model.run_with_cache(ids, names="hook_g")
    g = cache["blocks.0.mixer.hook_g"].double()  # [B, T, H]
    H = g.shape[-1]
    hand_lam = [g[..., h].mean().item() for h in range(H)]
    hand_hl = [math.log(2) / -lam for lam in hand_lam]
    assert e["gate"] == "per-head" and e["heads"] == H
    assert [row[0] for row in e["exponents"]] == pytest.approx(hand_lam, rel=1e-9)
    assert [row[0] for row in e["half_lives"]] == pytest.approx(hand_hl, rel=1e-9)
    assert [p["median_half_life"] for p in e["per_head"]] == pytest.approx(hand_hl, rel=1e-9)
    if name == "retnet":
        gammas = [1 - 2 ** (-5 - h) for h in range(H)]
        assert hand_hl == pytest.approx([math.log(2) / -math.log(c) for c in gammas], rel=1e-5)
        assert hand_hl == sorted(hand_hl)  # head 0 forgets fastest


def test_fixed_gates_reproduce_timescales_on_any_length():
    model, ids = _model("retnet"), _ids(T=40)
    ts, sp = timescales(model, ids), memory_spectrum(model, ids)
    for layer, e in sp.items():
        hl = torch.tensor(e["half_lives"], dtype=F64)
        for key in ("min", "median", "max"):
            assert summarize(hl)[key] == pytest.approx(ts[layer]["half_life"][key], rel=1e-5)


@pytest.mark.parametrize("name", ["gated_deltanet", "deltanet"])
def test_delta_mixers_run_on_their_hooks(name):
    model, ids = _model(name), _ids()
    result = memory_spectrum(model, ids)
    _, cache = model.run_with_cache(
        ids, names=["hook_k", "hook_beta"] + (["hook_g"] if "gated" in name else [])
    )
    for layer, e in result.items():
        assert e["kind"] == "delta"
        K = cache[f"blocks.{layer}.mixer.hook_k"].shape[-1]
        assert e["dim"] == K and len(e["exponents"][0]) == K and e["multiplicity"] == K  # V = K here
        lam = torch.tensor(e["exponents"], dtype=F64)
        assert (lam <= 1e-12).all()  # β ∈ (0, 1), |decay| ≤ 1: a delta rule never amplifies
        g = cache.get(f"blocks.{layer}.mixer.hook_g")
        if g is not None:  # the top exponent is at most the gate's mean log decay
            assert (lam[:, 0] <= diagonal_spectrum(g) + 1e-12).all()
        s = e["summary"]
        assert sum(s[c] for c in ("irrelevant", "intermediate", "marginal", "relevant")) == pytest.approx(1.0)


def test_other_mixers_are_labelled():
    ids = _ids(T=12)
    assert memory_spectrum(_model("transformer"), ids)["0"]["kind"] == "attention"
    e = memory_spectrum(_model("linear_attention"), ids)["0"]
    assert e["kind"] == "identity" and e["summary"]["marginal"] == 1.0


def test_test_time_memory_model_runs():
    model, ids = _model("titans_lmm", n_layers=1), _ids(T=12)
    e = memory_spectrum(model, ids, directions=4)["0"]
    assert e["kind"] == "test-time (JVP)" and e["chunk_size"] == model.blocks[0].mixer.spec.chunk_size
    assert len(e["exponents"][0]) == 4 and e["dim"] > 4
    assert torch.isfinite(torch.tensor(e["exponents"])).all()
    assert set(summary_line({"0": e})["0"]) >= {"irrelevant", "marginal", "relevant", "median_half_life"}


# ------------------------------------------------------------------------------------------------
# the command and the figure
# ------------------------------------------------------------------------------------------------


def test_probe_spectrum_command(tmp_path, capsys, saved_figures):
    from mnemo.cli import main
    from mnemo.data import build_tokenizer, save_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    tok = build_tokenizer("char", text.read_text())
    ckpt = tmp_path / "ckpt"
    cfg = build_config("gated_deltanet", vocab_size=tok.vocab_size, d_model=16, n_layers=2)
    LanguageModel(cfg).save_pretrained(ckpt)
    save_tokenizer(tok, ckpt)
    out = tmp_path / "out"
    argv = ["probe", "spectrum", "--checkpoint", str(ckpt), "--data", str(text), "--tokens", "64"]
    assert main([*argv, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["tokens"] == 64 and set(record["layers"]) == {"0", "1"}
    assert record["layers"]["0"]["kind"] == "delta"
    assert json.loads((out / "spectrum.json").read_text()) == record
    assert (out / "spectrum.png").is_file() and f"{out / 'spectrum.png'}" in captured.err
    (fig,) = saved_figures
    assert "gated_deltanet (2 layers)" in fig._suptitle.get_text()
    # a checkpoint without a tokenizer: random tokens
    bare = tmp_path / "bare"
    LanguageModel(build_config("gla", vocab_size=20, d_model=16, n_layers=1)).save_pretrained(bare)
    assert main(["probe", "spectrum", "--checkpoint", str(bare), "--tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "random tokens" in captured.err and (bare / "probes" / "spectrum.png").is_file()
    assert json.loads(captured.out)["layers"]["0"]["kind"] == "diagonal"


@pytest.fixture
def saved_figures(monkeypatch):
    from matplotlib.figure import Figure

    saved, original = [], Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_circuit_tracker_records_the_spectrum_behind_a_flag():
    from types import SimpleNamespace

    from mnemo.interp import CircuitTracker

    trainer = SimpleNamespace(model=_model("gated_deltanet").train())
    extra = CircuitTracker(length=4, batch=1, spectrum=True, spectrum_tokens=16)(trainer, {})
    assert trainer.model.training  # restored
    shares = [extra[f"spectrum_{c}_by_layer"] for c in ("irrelevant", "intermediate", "marginal", "relevant")]
    assert all(len(s) == 2 for s in shares) and len(extra["spectrum_median_half_life_by_layer"]) == 2
    assert [sum(col) for col in zip(*shares)] == pytest.approx([1.0, 1.0])
    assert "induction_max" in extra
    plain = CircuitTracker(length=4, batch=1)(trainer, {})
    assert not any(k.startswith("spectrum_") for k in plain)


def test_classify_half_life_quantiles_are_ordered():
    lam = -torch.tensor([0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0], dtype=F64)
    c = classify(lam, context=1000)
    assert c["p10_half_life"] < c["median_half_life"] < c["p90_half_life"]
    assert c["median_half_life"] == pytest.approx(LN2 / 0.15)  # median λ = −(0.1 + 0.2) / 2

"""The spectrum of memories known only as code (:func:`mnemo.interp.spectrum.state_spectrum`):
HOPE's self-modifying Titans, the self-modifying projections and the levels of a Continuum Memory
System, each against an independent computation (the delta rule's exact transitions, Jacobians
taken by autograd, a closed form when the levels cannot learn)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mnemo.interp.spectrum import (  # the adapters under test
    _cms_levels,
    _self_modifying_transition,
    delta_rule_spectrum,
    lyapunov_spectrum,
    matrix_spectrum,
    memory_spectrum,
    state_spectrum,
)
from mnemo.models import LanguageModel, ModelConfig, build_config

F64 = torch.float64


def _x(B, T, d, seed=0):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("preset", ["gated_deltanet", "kda"])
def test_a_gated_delta_rule_state_has_the_delta_rule_spectrum(preset):
    """Run through the layer itself, the finite-difference Jacobian of the memory ``S [H, K, V]``
    must give the exact spectrum of ``A_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t))`` on the layer's own
    keys (a scalar decay per head for Gated DeltaNet, one per key channel for Kimi Delta Attention),
    each exponent once per value column (all ``H·K·V`` of them, from the identity basis)."""
    torch.manual_seed(0)
    cfg = build_config(preset, vocab_size=16, d_model=8, n_layers=1)
    model = LanguageModel(cfg).double().eval()
    mixer = model.blocks[0].mixer
    x = _x(1, 9, 8)
    _, st = mixer(x[:, :1])  # a state with its tensors (the first token's write)
    H, K, V = st.memory.shape[1:]
    acts = {}
    hooks = [
        getattr(mixer, n).add(lambda t, name: acts.__setitem__(name.rsplit(".", 1)[-1], t))
        for n in ("hook_k", "hook_beta", "hook_g")
    ]
    try:
        mixer(x[:, 1:], st)
    finally:
        for h in hooks:
            h.remove()
    exact = delta_rule_spectrum(acts["hook_k"], acts["hook_beta"], acts["hook_g"])  # [H, K]
    lam, n = state_spectrum(
        lambda s, xs: mixer(xs, s)[1],
        st,
        x[:, 1:],
        period=2,  # two tokens per step: the product is the same
        get=lambda s: [s.memory],
        put=lambda s, ts: replace(s, memory=ts[0]),
        directions=H * K * V,
    )
    assert n == H * K * V
    want = exact.flatten().repeat_interleave(V).sort(descending=True).values
    torch.testing.assert_close(lam, want, rtol=0, atol=1e-7)


def _cms(optimizer="gd", lr=1.0, transfer="sequential"):
    levels = [
        {"period": 2, "optimizer": optimizer, "lr": lr},
        {"period": 4, "optimizer": optimizer, "lr": lr},
    ]
    cfg = build_config(
        "hope_attention",
        vocab_size=16,
        d_model=8,
        n_layers=1,
        mlp_options={"levels": levels, "transfer": transfer},
    )
    torch.manual_seed(1)
    return LanguageModel(cfg).double().eval().blocks[0].mlp


@pytest.mark.parametrize("transfer", ["sequential", "independent"])
def test_cms_levels_match_autograd_jacobians(transfer):
    """Each level's exponents are those of the product of its own period-step Jacobians taken by
    autograd (the other levels on their trajectories), all ``n`` of them from the identity basis."""
    cms = _cms(transfer=transfer)
    x = _x(1, 12, 8, seed=2)
    fresh = cms(x[:, :0])[1]
    levels = _cms_levels(cms, x, lambda: fresh, directions=10_000, context=12.0, irr=4.0, seed=0)
    period = 4
    for li, entry in enumerate(levels):
        assert entry["kind"] == "test-time (state JVP)" and entry["period"] == 2 * (li + 1)
        st, jacs = fresh, []
        for c in range(3):
            xs = x[:, c * period : (c + 1) * period]
            w = torch.cat([t.reshape(-1) for t in st.levels[li].weights])
            shapes = [t.shape for t in st.levels[li].weights]
            sizes = [t[0].numel() for t in st.levels[li].weights]

            def f(flat, st=st, xs=xs, shapes=shapes, sizes=sizes, li=li):
                ws = tuple(p.reshape(s) for p, s in zip(flat.split(sizes), shapes))
                levels_ = list(st.levels)
                levels_[li] = replace(st.levels[li], weights=ws)
                new = cms(xs, replace(st, levels=tuple(levels_)))[1]
                return torch.cat([t.reshape(-1) for t in new.levels[li].weights])

            jacs.append(torch.autograd.functional.jacobian(f, w))
            st = cms(xs, st)[1]
        want = matrix_spectrum(torch.stack(jacs)[None], tokens=12)[0]
        got = torch.tensor(entry["exponents"][0], dtype=F64)
        assert entry["dim"] == want.numel()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # the sum of all exponents is the mean log-volume change: Σ log|det J| / T
        logdet = sum(torch.linalg.slogdet(J)[1] for J in jacs) / 12
        assert float(got.sum()) == pytest.approx(float(logdet), abs=1e-6)


def test_cms_levels_that_cannot_learn_keep_everything_and_momentum_decays_by_beta():
    """``lr = 0``: no gradient ever moves a level, so its weights are carried unchanged (every
    exponent 0) and, with momentum ``m ← β m − g``, ``w ← w + m``, the momentum directions decay
    by ``β`` per step: ``log β / period`` per token, one per weight."""
    cms = _cms(optimizer="momentum", lr=0.0)
    x = _x(1, 8, 8, seed=3)
    fresh = cms(x[:, :0])[1]
    levels = _cms_levels(cms, x, lambda: fresh, directions=10_000, context=8.0, irr=4.0, seed=0)
    for li, entry in enumerate(levels):
        lam = torch.tensor(entry["exponents"][0], dtype=F64)
        half = lam.numel() // 2
        beta, period = cms.levels[li].level.beta, cms.levels[li].level.period
        torch.testing.assert_close(lam[:half], torch.zeros(half, dtype=F64), rtol=0, atol=1e-8)
        torch.testing.assert_close(
            lam[half:], torch.full((half,), math.log(beta) / period, dtype=F64), rtol=0, atol=1e-8
        )


@pytest.mark.parametrize("name", ["hope", "self_modifying_projections"])
def test_self_modifying_state_at_a_step_boundary_is_its_running_weights(name):
    """At a common multiple of the chunks, the chunk-start copies equal the running weights, so
    tying them to the perturbed tensors leaves the trajectory exact: the primal step through
    ``put(state, get(state))`` is the uninterrupted run."""
    torch.manual_seed(0)
    if name == "hope":
        opts = {"self_modifying_titans": {"chunk_size": 2, "proj_chunk_size": 4}}
        cfg = build_config(name, vocab_size=16, d_model=8, n_layers=1, mixer_options=opts)
    else:
        cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=1, mixer=name, mlp="none")
    mixer = LanguageModel(cfg).double().eval().blocks[0].mixer
    st0 = mixer.initial_state(1)
    period, get, put, _ = _self_modifying_transition(mixer, st0)
    x = _x(1, 2 * period, 8, seed=4)
    _, mid = mixer(x[:, :period], st0)
    y_whole, end = mixer(x, st0)
    y_split, end_split = mixer(x[:, period:], put(mid, get(mid)))
    torch.testing.assert_close(y_split, y_whole[:, period:], rtol=0, atol=1e-12)
    for a, b in zip(get(end_split), get(end)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "extra",
    [{}, {"momentum": 0.6}, {"momentum": 0.6, "adaptive_q": True}],
    ids=["plain", "momentum", "momentum+adaptive_q"],
)
def test_self_modifying_titans_matches_autograd_jacobians(extra):
    """The leading exponents of HOPE's mixer from central differences equal those of the same QR
    iteration on the step Jacobians taken by autograd (same seeded start). With DGD momentum
    (hope_paper's options) the momentum buffers are state too: the transition covers weights and
    momentum of every memory (8 tensors), and a fifth projection memory with adaptive q."""
    torch.manual_seed(0)
    opts = {"self_modifying_titans": {"chunk_size": 2, "proj_chunk_size": 4, "n_heads": 2, **extra}}
    mixer = LanguageModel(build_config("hope", vocab_size=16, d_model=4, n_layers=1, mixer_options=opts))
    mixer = mixer.double().eval().blocks[0].mixer
    st0 = mixer.initial_state(1)
    period, get, put, what = _self_modifying_transition(mixer, st0)
    momentum = "momentum" in extra
    assert len(get(st0)) == (8 if momentum else 4) and what.endswith("(weights and momentum)") == momentum
    assert get(st0)[0].shape[1] == (5 if extra.get("adaptive_q") else 4)
    if momentum:  # put places every tensor where get found it (a round trip on distinct values)
        ts = [torch.full_like(t, float(i)) for i, t in enumerate(get(st0))]
        assert all(torch.equal(a, b) for a, b in zip(get(put(st0, ts)), ts))
    x = _x(1, 2 * period, 4, seed=5)
    k = 6
    got, n = state_spectrum(
        lambda s, xs: mixer(xs, s)[1], st0, x, period=period, get=get, put=put, directions=k
    )
    shapes = [t.shape for t in get(st0)]
    sizes = [t[0].numel() for t in get(st0)]
    cur = [st0]

    def step(c, Q):
        xs = x[:, c * period : (c + 1) * period]
        st = cur[0]
        base = torch.cat([t.expand(s).reshape(-1) for t, s in zip(get(st), shapes)])

        def f(flat):
            ts = [p.reshape(s) for p, s in zip(flat.split(sizes), shapes)]
            return torch.cat([t.reshape(-1) for t in get(mixer(xs, put(st, ts))[1])])

        # reverse mode (the layer's training path); forward-over-reverse double backward through
        # the chunk form's inner gradient is not what is tested here; vectorize: the rows' backward
        # passes batched in one (vmap), ~10x quicker than one backward per row
        J = torch.autograd.functional.jacobian(f, base, vectorize=True)
        cur[0] = mixer(xs, st)[1]
        return (J @ Q[0])[None]

    want = lyapunov_spectrum(step, 2, n, k, batch_shape=(1,), tokens=2 * period, seed=0)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["hope", "hope_reconstruction"])
def test_hope_model_reports_its_mixer_and_every_cms_level(name):
    # hope reads in task-signal segments: the mixer's spectrum needs the whole call's hook values
    # (run_with_cache joins the segments); its task levels step on the loss's error signal, not on
    # their input, so they are reported as unsupported with that reason
    torch.manual_seed(0)
    model = LanguageModel(build_config(name, vocab_size=16, d_model=8, n_layers=2)).eval()
    ids = torch.randint(0, 16, (1, 64), generator=torch.Generator().manual_seed(0))
    result = memory_spectrum(model, ids, directions=4)
    assert set(result) == {"0", "1", "0.cms0", "0.cms1", "0.cms2", "1.cms0", "1.cms1", "1.cms2"}
    for key, e in result.items():
        if name == "hope" and "cms" in key:
            assert e["kind"] == "unsupported" and "error signal" in e["reason"], (key, e)
            continue
        assert e["kind"] == "test-time (state JVP)", (key, e)
        assert len(e["exponents"][0]) == 4 and torch.isfinite(torch.tensor(e["exponents"])).all()
    if name == "hope":
        return
    assert result["0.cms2"]["period"] == 32
    # too short for the levels' common multiple (32 tokens): labelled, not guessed
    short = memory_spectrum(model, ids[:, :16], directions=4)
    assert short["0.cms0"]["kind"] == "unsupported" and "32 tokens" in short["0.cms0"]["reason"]


def test_track_spectrum_flag_records_every_memory_and_plot_training_draws_its_flow(tmp_path, capsys):
    """`mnemo train --track-spectrum` records the spectrum of the mixer and of every CMS level at
    each evaluation; `mnemo probe plot-training` then also writes the flow figure; a trainer given
    a tracker without the spectrum refuses the setting."""
    import json

    from mnemo.cli import main
    from mnemo.interp import CircuitTracker
    from mnemo.train import TrainConfig, Trainer

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    model = "hope_attention_reconstruction"  # CMS levels with an input-driven spectrum
    argv = ["train", "--model", model, "--data", str(text), "--steps", "2", "--seq-len", "64"]
    argv += ["--d-model", "16", "--n-layers", "1", "--batch-size", "2", "--eval-interval", "1"]
    argv += [
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--track-spectrum",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["spectrum_by_memory"]) == {"0.cms0", "0.cms1", "0.cms2"}  # attention: no transition
        for v in r["spectrum_by_memory"].values():  # 8 leading exponents of 512: the rest unresolved
            shares = [v[c] for c in ("irrelevant", "intermediate", "marginal", "relevant")]
            assert all(0 <= x <= 1 for x in shares) and 0 < sum(shares) <= 1
            assert v["median_half_life"] is None or v["median_half_life"] > 0
        assert "induction_max" in r and "spectrum_marginal_by_layer" not in r  # the same tracker
    capsys.readouterr()
    assert main(["probe", "plot-training", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "training_spectrum.png").is_file() and "training_spectrum.png" in printed
    cfg = TrainConfig(model="transformer", data=str(text), steps=1, track_spectrum=True, sample_tokens=0)
    with pytest.raises(ValueError, match="TrainConfig.track_spectrum"):
        Trainer(cfg, tmp_path / "no", progress=False, callbacks=[CircuitTracker()])


def test_per_channel_decay_without_writes_has_the_decays_as_exponents():
    """A known answer: with ``β = 0`` the per-channel transitions are ``Diag(exp(g_t))``, whose
    exponents are the channels' mean log decays (sorted per head and sequence), and a per-head decay adds its
    mean to the ungated delta rule's exponents; a ``g`` of another shape is refused by name."""
    g = -torch.rand(2, 7, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(3))
    k = torch.randn(2, 7, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(4))
    k = k / k.norm(dim=-1, keepdim=True)
    lam = delta_rule_spectrum(k, torch.zeros(2, 7, 3, dtype=F64), g)
    want = g.mean(1).sort(-1, descending=True).values.mean(0)  # (sorted per sequence, then averaged)
    torch.testing.assert_close(lam, want, rtol=0, atol=1e-12)
    beta = torch.full((2, 7, 3), 0.5, dtype=F64)
    scalar = delta_rule_spectrum(k, beta, g[..., 0])
    as_channels = delta_rule_spectrum(k, beta, g[..., :1].expand_as(g))  # the same decay in every channel
    torch.testing.assert_close(as_channels, scalar, rtol=0, atol=1e-10)
    reset = g.clone()
    reset[:, 3, :, 0] = -float("inf")  # a hard reset of one channel: the op's clamp, -60
    clamped = reset.clamp(min=-60.0)
    torch.testing.assert_close(delta_rule_spectrum(k, beta, reset), delta_rule_spectrum(k, beta, clamped))
    assert torch.isfinite(delta_rule_spectrum(k, beta, reset)).all()
    with pytest.raises(ValueError, match=r"g: expected log decays \[B, T, H\]"):
        delta_rule_spectrum(k, beta, g[..., :2])

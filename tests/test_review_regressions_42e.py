"""Regressions of the TTT inner norm's learned scale and shift (``NeuralMemory(inner_norm_affine=...)``,
commit 13809dd): the readers of a NeuralMemory outside its forward that the commit left on the
parameter-free norm, and a run checkpointed before the parameters existed."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.interp.spectrum import memory_spectrum
from mnemo.models import LanguageModel, build_config

D64 = torch.float64


def _ttt_model(d_model=8, heads=2, chunk=4, **opts):
    options = {"n_heads": heads, "spec": "ttt_linear", "chunk_size": chunk, **opts}
    opts = {"neural_memory": options}
    return LanguageModel(
        build_config("ttt_linear", vocab_size=12, d_model=d_model, n_layers=1, mixer_options=opts)
    )


def _hand_f(W, x, gamma, beta):
    """TTT-Linear's ``f(x) = x + γ ⊙ LN(x W) + β`` for one head, ``x [K]``, ``W [K, V]`` (eps 1e-5)."""
    h = x @ W
    mu = h.mean()
    ln = (h - mu) / torch.sqrt(((h - mu) ** 2).mean() + 1e-5)
    return x + gamma * ln + beta


def _hand_chunk(W0, k, v, theta, gamma, beta):
    """One mini-batch of TTT's GD from ``W0``: every gradient of ``½‖f_W(k_t) − v_t‖²`` at ``W0``."""
    W = W0
    for t in range(k.shape[0]):
        e = _hand_f(W0, k[t], gamma, beta) - v[t]
        # ∂/∂W ½‖e‖² through the layer norm, by autograd on the hand function (create_graph: the
        # chunk map is differentiated again below)
        (G,) = torch.autograd.grad(0.5 * (e * e).sum(), W0, create_graph=True)
        W = W - theta[t] * G
    return W


def _hand_log_volume(W0, k, v, theta, gamma, beta, C):
    """``Σ_c log|det J_c|`` along the trajectory from ``W0`` (``J_c`` the chunk map's Jacobian)."""
    total, W = 0.0, W0
    for t0 in range(0, k.shape[0], C):
        sl = slice(t0, t0 + C)

        def step(w, sl=sl):
            return _hand_chunk(w, k[sl], v[sl], theta[sl], gamma, beta).reshape(-1)

        J = torch.autograd.functional.jacobian(step, W)
        total += torch.linalg.slogdet(J.reshape(W.numel(), W.numel()))[1].item()
        W = step(W.detach().requires_grad_(True)).detach().reshape(W.shape).requires_grad_(True)
    return total


def test_memory_spectrum_reads_a_ttt_memorys_learned_inner_norm_scale_and_shift():
    """``memory_spectrum`` ran the memory's chunks through ``memory_recurrent`` without the learned
    ``γ, β`` (``inner_norm_weight``/``inner_norm_bias``): a trained TTT model's exponents were those
    of another map. With every direction (``directions = n``) the exponents of a head sum to
    ``Σ_c log|det J_c| / T`` whatever the random basis: checked against the hand chunk map with
    non-trivial ``γ, β`` (which moves that sum by far more than the tolerance)."""
    torch.manual_seed(0)
    model = _ttt_model().double().eval()
    mem = model.blocks[0].mixer
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        mem.inner_norm_weight.copy_(1.0 + 0.5 * torch.randn(8, generator=g, dtype=D64))
        mem.inner_norm_bias.copy_(0.4 * torch.randn(8, generator=g, dtype=D64))
    ids = torch.randint(0, 12, (1, 8), generator=g)
    T, H, D = 8, 2, 4
    e = memory_spectrum(model, ids, directions=D * D)["0"]
    assert e["kind"] == "test-time (JVP)" and e["dim"] == D * D
    cache = model.run_with_cache(
        ids, names=[f"blocks.0.mixer.hook_{h}" for h in "kv"] + ["blocks.0.mixer.hook_theta"]
    )[1]
    k, v, th = (cache[f"blocks.0.mixer.hook_{h}"][0] for h in ("k", "v", "theta"))
    gamma, beta = (p.detach().view(H, D) for p in (mem.inner_norm_weight, mem.inner_norm_bias))
    for h in range(H):
        W0 = mem.init_weights[0][h].detach().clone().requires_grad_(True)
        want = _hand_log_volume(W0, k[:, h], v[:, h], th[:, h], gamma[h], beta[h], 4) / T
        plain = (
            _hand_log_volume(
                W0, k[:, h], v[:, h], th[:, h], torch.ones(D, dtype=D64), torch.zeros(D, dtype=D64), 4
            )
            / T
        )
        assert abs(want - plain) > 0.05  # γ, β matter here
        assert math.fsum(e["exponents"][h]) == pytest.approx(want, abs=1e-6)


def test_memory_jvp_spectrum_takes_the_norm_affine_as_the_engine_does():
    """``memory_jvp_spectrum(norm_weight=, norm_bias=)``: γ = 1, β = 0 is the parameter-free norm
    (the same exponents bit for bit), a shape other than ``[H, V]`` is refused naming it."""
    from mnemo.interp.lyapunov import memory_jvp_spectrum
    from mnemo.memory import preset
    from mnemo.memory.state import init_state

    spec = preset("ttt_linear", chunk_size=2)
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, 4, 2, 3, generator=g, dtype=D64), dim=-1) for _ in range(2))
    v, th = torch.randn(1, 4, 2, 3, generator=g, dtype=D64), torch.full((1, 4, 2), 0.3, dtype=D64)
    st = init_state(spec, [0.3 * torch.randn(2, 3, 3, generator=g, dtype=D64)], 1)
    plain = memory_jvp_spectrum(spec, st, q, k, v, th, directions=3)[0]
    unit = memory_jvp_spectrum(spec, st, q, k, v, th, directions=3, norm_weight=torch.ones(2, 3, dtype=D64))[
        0
    ]
    assert torch.equal(plain, unit)
    with pytest.raises(ValueError, match="norm_bias must have shape"):
        memory_jvp_spectrum(spec, st, q, k, v, th, directions=3, norm_bias=torch.zeros(3, dtype=D64))


# ---- resuming a run checkpointed before the parameters existed -------------------------------------

TINY = dict(
    model="ttt_linear",
    seq_len=8,
    batch_size=2,
    eval_batches=1,
    sample_tokens=0,
    warmup_steps=0,
    steps=1,
    eval_interval=1,
)


def _text(out):
    data = out.parent / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    return str(data)


def _old_ttt_run(out):
    """A ttt_linear run as mnemo wrote it before 13809dd: a memory without γ, β (built with
    ``inner_norm_affine: false``, then the option removed from the saved configs, as they were)."""
    from mnemo.train import TrainConfig, Trainer
    from mnemo.train.checkpoint import write_manifest

    opts = {"neural_memory": {"n_heads": 2, "spec": "ttt_linear", "inner_norm_affine": False}}
    cfg = TrainConfig.from_dict(
        {**TINY, "data": _text(out), "model_overrides": {"d_model": 8, "n_layers": 1, "mixer_options": opts}}
    )
    t = Trainer(cfg, out, resume=False, progress=False, log=lambda *a: None)
    t.fit()
    ckpt = out / "ckpt-000001"

    def strip(o):
        if isinstance(o, dict):
            o.pop("inner_norm_affine", None)
            for x in o.values():
                strip(x)

    for name in ("config.json", "train_config.json"):
        saved = json.loads((ckpt / name).read_text())
        strip(saved)
        (ckpt / name).write_text(json.dumps(saved, indent=2))
    write_manifest(ckpt)
    return t


def test_resuming_a_ttt_run_from_before_the_inner_norm_affine_trains_on(tmp_path):
    """``mnemo train --resume`` of a ttt run checkpointed before γ, β existed: the weights loaded
    (γ = 1, β = 0) but the optimizer state has two fewer parameters in its no-decay group and torch
    refused it ("a parameter group that doesn't match the size"). Now the saved state goes to the
    parameters it belongs to, γ, β start with fresh optimizer state, and a one-line warning says
    so and names the option."""
    from mnemo.train import Trainer

    out = tmp_path / "run"
    old = _old_ttt_run(out)
    with pytest.warns(
        UserWarning, match=r"inner_norm_bias, blocks\.0\.mixer\.inner_norm_weight existed.*fresh"
    ) as rec:
        t = Trainer({"steps": 2}, out, resume=True, reschedule="hold", progress=False, log=lambda *a: None)
    assert any("inner_norm_affine: false" in str(w.message) for w in rec)
    mem = t.model.blocks[0].mixer
    assert mem.inner_norm_weight is not None and torch.equal(mem.inner_norm_weight, torch.ones(8))
    was = {n: p for n, p in old.model.named_parameters()}
    for n, p in t.model.named_parameters():  # every saved parameter's state where it was
        s = t.optimizer.state.get(p, {})
        if "inner_norm" in n:
            assert not s
        else:
            torch.testing.assert_close(s["exp_avg"], old.optimizer.state[was[n]]["exp_avg"], rtol=0, atol=0)
    t.train_step()  # AdamW steps the saved and the fresh states together
    assert t.optimizer.state[mem.inner_norm_weight]["step"] == 1


def test_an_old_state_dict_assigned_into_a_meta_build_fills_gamma_beta_off_meta():
    """``load_state_dict(old, assign=True)`` into a model built on ``meta`` (the pre-hook's
    ``full_like`` of the meta parameter left ``γ, β`` on meta: every forward failed, and
    ``refill_meta_constants`` skipped the module). Now they are real, in the state dict's dtype,
    trainable, and the outputs are the old model's bit for bit."""
    old = _ttt_model(inner_norm_affine=False).double()
    with torch.device("meta"):
        new = _ttt_model()
    new.load_state_dict(old.state_dict(), assign=True)
    mem = new.blocks[0].mixer
    for p, fill in ((mem.inner_norm_weight, 1.0), (mem.inner_norm_bias, 0.0)):
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype == D64
        assert torch.equal(p, torch.full((8,), fill, dtype=D64))
    ids = torch.randint(0, 12, (2, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(new(ids)[0], old(ids)[0])

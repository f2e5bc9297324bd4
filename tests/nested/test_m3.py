"""M3 (Multi-scale Momentum Muon, Nested Learning Algorithm 1) and its Newton–Schulz step.

The main check is against a plain, step-by-step transcription of Algorithm 1 written here (lists
of tensors, the explicit block loop of the pseudo-code, its own Newton–Schulz loop), in float64.
"""

from __future__ import annotations

import io

import pytest
import torch

from mnemo.train.m3 import M3, newton_schulz
from tests.helpers import assert_close

QUINTIC = (3.4445, -4.7750, 2.0315)


# --------------------------------------------------------------------------- reference Algorithm 1
def ref_ns(M, steps, coefficients="quintic"):
    """Newton–Schulz of the [shape[0], -1] matrix; ndim < 2 tensors are returned unchanged (O = M)."""
    if M.ndim < 2:
        return M.clone()
    X = M.reshape(M.shape[0], -1)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.t()
    nrm = X.pow(2).sum().sqrt()
    if nrm == 0:
        return torch.zeros_like(M)
    X = X / nrm
    for _ in range(steps):
        if coefficients == "quintic":
            a, b, c = QUINTIC
            A = X @ X.t()
            X = a * X + (b * A + c * A @ A) @ X
        else:
            X = 1.5 * X - 0.5 * (X @ X.t() @ X)
    if tall:
        X = X.t()
    return X.reshape(M.shape)


def ref_algorithm1(theta0, grad_fn, n_steps, lr, betas, alpha, eps, T, f, weight_decay=0.0, ema=False):
    """Algorithm 1 as printed: for k = 0, 1, ...: slow memory from block k-1, then f inner steps."""
    b1, b2, b3 = betas
    theta = [p.clone() for p in theta0]
    M1 = [torch.zeros_like(p) for p in theta]
    M2 = [torch.zeros_like(p) for p in theta]
    V = [torch.zeros_like(p) for p in theta]
    previous_block = []  # the gradients g_i of block k-1 (empty for k = 0)
    k = 0
    while k * f < n_steps:
        for i in range(len(theta)):
            block_sum = sum((gs[i] for gs in previous_block), torch.zeros_like(theta[i]))
            if ema:
                M2[i] = b3 * M2[i] + (1 - b3) * block_sum / f
            else:
                M2[i] = M2[i] + b3 * block_sum
        O2 = [ref_ns(m, T) for m in M2]
        this_block = []
        for t in range(k * f + 1, (k + 1) * f + 1):
            if t > n_steps:
                break
            g = grad_fn(theta, t)
            this_block.append(g)
            for i in range(len(theta)):
                if ema:
                    M1[i] = b1 * M1[i] + (1 - b1) * g[i]
                    V[i] = b2 * V[i] + (1 - b2) * g[i] ** 2
                else:
                    M1[i] = M1[i] + b1 * g[i]
                    V[i] = V[i] + b2 * g[i] ** 2
                O1 = ref_ns(M1[i], T)
                theta[i] = theta[i] * (1 - lr * weight_decay)
                theta[i] = theta[i] - lr * (O1 + alpha * O2[i]) / (V[i].sqrt() + eps)
        previous_block = this_block
        k += 1
    return theta


# --------------------------------------------------------------------------- a tiny model
SHAPES = [(6, 4), (6,), (3, 6), (3,), (3, 2, 2), ()]  # matrices, biases, a 3-D tensor, a scalar


def tiny_loss(params, x, y):
    W1, b1, W2, b2, K, s = params
    h = torch.tanh(x @ W1.t() + b1)
    out = h @ W2.t() + b2 + x @ K.reshape(3, 4).t() * s
    return ((out - y) ** 2).mean()


def tiny_problem(n_steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta0 = [0.5 * torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    f64 = dict(generator=g, dtype=torch.float64)
    data = [(torch.randn(8, 4, **f64), torch.randn(8, 3, **f64)) for _ in range(n_steps)]

    def grad_fn(theta, t):  # gradient at the current weights on batch t (1-based)
        ps = [p.detach().clone().requires_grad_(True) for p in theta]
        tiny_loss(ps, *data[t - 1]).backward()
        return [p.grad for p in ps]

    return theta0, data, grad_fn


def run_m3(theta0, data, n_steps, **kw):
    params = [torch.nn.Parameter(p.clone()) for p in theta0]
    opt = M3(params, **kw)
    for t in range(1, n_steps + 1):
        opt.zero_grad()
        tiny_loss(params, *data[t - 1]).backward()
        opt.step()
    return params, opt


@pytest.mark.parametrize("ema, weight_decay", [(False, 0.0), (True, 0.1)])
def test_m3_equals_a_plain_transcription_of_algorithm_1_in_float64(ema, weight_decay):
    """20 steps with f = 3: blocks k = 0..6, the first with O2 = 0; float64; rel. error <= 1e-12."""
    n, hp = 20, dict(lr=1e-3, betas=(0.9, 0.99, 0.8), alpha=0.7, eps=1e-6, ns_steps=5, slow_every=3)
    theta0, data, grad_fn = tiny_problem(n)
    ref = ref_algorithm1(
        theta0,
        grad_fn,
        n,
        hp["lr"],
        hp["betas"],
        hp["alpha"],
        hp["eps"],
        hp["ns_steps"],
        hp["slow_every"],
        weight_decay=weight_decay,
        ema=ema,
    )
    got, opt = run_m3(theta0, data, n, weight_decay=weight_decay, ema=ema, **hp)
    worst = 0.0
    for p, r, p0 in zip(got, ref, theta0):
        assert not torch.equal(r, p0), "every parameter moved"
        err = ((p.detach() - r).abs().max() / r.abs().max()).item()
        worst = max(worst, err)
    print(f"max relative error vs the Algorithm 1 transcription (ema={ema}): {worst:.2e}")
    assert worst <= 1e-12
    assert all(opt.state[p]["step"] == n for p in got)


# --------------------------------------------------------------------------- Newton–Schulz
def test_newton_schulz_cubic_gives_the_polar_factor():
    g = torch.Generator().manual_seed(1)
    for shape in [(8, 16), (16, 8), (12, 12), (3, 5, 9)]:
        G = torch.randn(shape, generator=g, dtype=torch.float64)
        X = newton_schulz(G, steps=60, coefficients="cubic")
        U, S, Vh = torch.linalg.svd(G, full_matrices=False)
        assert (torch.linalg.svdvals(X) - 1).abs().max() < 1e-6
        assert (X - U @ Vh).abs().max() < 1e-6, shape  # same singular vectors: U Vᵀ


def test_newton_schulz_quintic_lands_in_muons_band_and_keeps_singular_vectors():
    """Muon's quintic iteration does not converge to 1; after 5-10 steps the singular values sit
    in about [0.68, 1.13] (we assert [0.6, 1.2]); its singular vectors are G's."""
    g = torch.Generator().manual_seed(2)
    for steps in (5, 10):
        for shape in [(32, 64), (64, 32), (48, 48), (4, 16, 24)]:
            G = torch.randn(shape, generator=g, dtype=torch.float64)
            X = newton_schulz(G, steps=steps)
            s = torch.linalg.svdvals(X)
            assert s.min() > 0.6 and s.max() < 1.2, (shape, steps, s.min(), s.max())
            U, _, Vh = torch.linalg.svd(G, full_matrices=False)
            # X = U diag(p(σ)) Vᵀ: Uᵀ X V is diagonal
            D = U.mT @ X @ Vh.mT
            off = D - torch.diag_embed(torch.diagonal(D, dim1=-2, dim2=-1))
            assert off.abs().max() < 1e-10


def test_newton_schulz_batch_dtypes_and_zero():
    g = torch.Generator().manual_seed(3)
    G = torch.randn(3, 6, 10, generator=g)
    batched = newton_schulz(G, 5)
    for i in range(3):
        assert torch.allclose(batched[i], newton_schulz(G[i], 5), atol=1e-6)
    assert batched.dtype == torch.float32
    assert newton_schulz(G.double(), 5).dtype == torch.float64
    hb = newton_schulz(G.bfloat16(), 5)
    assert hb.dtype == torch.bfloat16
    assert (hb.float() - newton_schulz(G.bfloat16().float(), 5)).abs().max() < 1e-2
    for shape in [(4, 3), (2, 3, 5)]:
        z = newton_schulz(torch.zeros(shape), 5)
        assert torch.equal(z, torch.zeros(shape))
    assert newton_schulz(torch.zeros(0, 4), 5).shape == (0, 4)
    with pytest.raises(ValueError, match="G: expected shape"):
        newton_schulz(torch.randn(5), 5)
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(G, -1)
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(G, 5, coefficients="septic")
    with pytest.raises(TypeError, match="floating"):
        newton_schulz(torch.ones(3, 3, dtype=torch.int64), 5)


# --------------------------------------------------------------------------- M2 timing
def test_slow_momentum_is_first_used_one_step_after_its_block():
    """f = 3, hand-made gradients with diagonal structure, so NS (cubic, converged) = E exactly.
    Steps 1..3 use O2 = 0; step 4 uses O2 = NS(β3 (g1 + g2 + g3)) = E; g4 is not in M2 yet."""
    lr, (b1, b2, b3), alpha, eps, f = 0.1, (0.9, 0.5, 0.7), 2.0, 1e-8, 3
    Ga = torch.tensor([[2.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)
    Gb = torch.tensor([[1.0, 0, 0], [0, 3.0, 0]], dtype=torch.float64)
    E = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)  # polar factor of both
    w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
    opt = M3(
        [w],
        lr=lr,
        betas=(b1, b2, b3),
        alpha=alpha,
        eps=eps,
        ns_steps=60,
        ns_coefficients="cubic",
        slow_every=f,
    )
    grads = [Ga, Ga, Ga, Gb, Gb, Gb, Gb]
    V = torch.zeros_like(Ga)
    for t, G in enumerate(grads, start=1):
        before = w.detach().clone()
        w.grad = G.clone()
        opt.step()
        V = V + b2 * G**2
        slow = 0.0 if t <= f else 1.0  # O2 = 0 in block 0, = E afterwards
        expected = -lr * (E + alpha * slow * E) / (V.sqrt() + eps)
        assert torch.allclose(w.detach() - before, expected, rtol=1e-12, atol=1e-15), t
        st = opt.state[w]
        if t <= f:
            assert torch.count_nonzero(st["m2"]) == 0 and torch.count_nonzero(st["o2"]) == 0
        elif t <= 2 * f:
            assert torch.equal(st["m2"], b3 * (Ga + Ga + Ga)), "M2 holds g1..g3 only"
        else:
            assert torch.allclose(st["m2"], b3 * 3 * (Ga + Gb), rtol=1e-15), "M2 += β3 (g4 + g5 + g6)"
        assert torch.allclose(st["o2"], slow * E, atol=1e-12)


# --------------------------------------------------------------------------- state_dict
def test_state_dict_round_trip_resumes_exactly():
    n = 10
    theta0, data, _ = tiny_problem(n, seed=4)
    hp = dict(lr=1e-3, betas=(0.9, 0.99, 0.8), alpha=0.5, eps=1e-6, slow_every=3, weight_decay=0.01)
    full, _ = run_m3(theta0, data, n, **hp)

    params, opt = run_m3(theta0, data, 5, **hp)  # 5 steps: stops inside block k = 1
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    fresh = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = M3(fresh, **hp)
    opt2.load_state_dict(saved["opt"])
    for t in range(6, n + 1):
        opt2.zero_grad()
        tiny_loss(fresh, *data[t - 1]).backward()
        opt2.step()
    for a, b in zip(fresh, full):
        assert torch.equal(a, b)
    assert set(opt2.state[fresh[0]]) == {"step", "m1", "v", "m2", "g_sum", "o2"}


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(lr=0.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(betas=(0.9, 1.0, 0.5)), "betas"),
        (dict(betas=(0.9, 0.99)), "betas"),
        (dict(alpha=-0.1), "alpha"),
        (dict(eps=0.0), "eps"),
        (dict(ns_steps=-1), "ns_steps"),
        (dict(ns_steps=2.5), "ns_steps"),
        (dict(slow_every=0), "slow_every"),
        (dict(slow_every=True), "slow_every"),
        (dict(weight_decay=-1e-3), "weight_decay"),
        (dict(ns_coefficients="septic"), "ns_coefficients"),
        (dict(ema="yes"), "ema"),
    ],
)
def test_bad_hyper_parameters_raise_naming_the_argument(kw, name):
    w = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=rf"M3: {name}: expected .*, got"):
        M3([w], **kw)


def test_bad_param_group_value_is_named():
    w = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"M3 \(param group 1\): slow_every: expected an int >= 1, got 0"):
        M3([{"params": [w]}, {"params": [torch.nn.Parameter(torch.zeros(2))], "slow_every": 0}])


# --------------------------------------------------------------------------- ndim < 2 and decay
def test_vectors_and_scalars_are_not_orthogonalised():
    """ndim < 2: O = M, so the update is lr (M1 + α M2) / (√V + ε) with the raw momenta."""
    lr, (b1, b2, b3), alpha, eps, f = 0.01, (0.9, 0.99, 0.5), 0.3, 1e-8, 2
    bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    scalar = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = M3([bias, scalar], lr=lr, betas=(b1, b2, b3), alpha=alpha, eps=eps, slow_every=f)
    gs = [torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64) * (t + 1) for t in range(3)]
    M1 = torch.zeros(4, dtype=torch.float64)
    V = torch.zeros(4, dtype=torch.float64)
    scalar_want = 0.0
    for t, g in enumerate(gs, start=1):
        before = bias.detach().clone()
        bias.grad, scalar.grad = g.clone(), g[1].clone()
        opt.step()
        M1, V = M1 + b1 * g, V + b2 * g**2
        M2 = b3 * (gs[0] + gs[1]) if t > f else torch.zeros(4, dtype=torch.float64)
        expected = -lr * (M1 + alpha * M2) / (V.sqrt() + eps)
        assert torch.allclose(bias.detach() - before, expected, rtol=1e-13, atol=0)
        scalar_want += expected[1].item()  # the scalar gets the gradients of the bias's entry 1
    # the raw momentum (norm ≠ 1) was used, not a normalised one
    assert not torch.allclose(opt.state[bias]["o2"], opt.state[bias]["o2"] / opt.state[bias]["o2"].norm())
    assert scalar.item() == pytest.approx(scalar_want, rel=1e-13, abs=0)
    assert scalar_want > 0.02  # three steps against negative gradients: a clear move upwards


def test_decoupled_weight_decay_shrinks_before_the_update():
    w = torch.nn.Parameter(torch.full((3, 3), 2.0, dtype=torch.float64))
    opt = M3([w], lr=0.1, weight_decay=0.5)
    w.grad = torch.zeros(3, 3, dtype=torch.float64)  # zero gradient: O = 0, only the decay acts
    opt.step()
    assert torch.allclose(w.detach(), torch.full((3, 3), 2.0 * (1 - 0.1 * 0.5), dtype=torch.float64))


def test_bfloat16_parameters_step():
    """bf16 parameters (and states) follow the float32 run on the same gradients to bf16 precision:
    the parameter's displacement within 2% (measured 0.3%), ``v = β₂ Σ g²`` within 1% (measured
    0.2%). The learning rate is large enough for the steps to show in bf16."""
    torch.manual_seed(0)
    w0 = torch.randn(8, 6).bfloat16()
    w, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.float())
    opt, opt_ref = M3([w], lr=0.05, slow_every=2), M3([ref], lr=0.05, slow_every=2)
    sq = torch.zeros(8, 6)
    for _ in range(4):
        g = torch.randn(8, 6).bfloat16()
        w.grad, ref.grad = g, g.float()
        sq += g.float() ** 2
        opt.step()
        opt_ref.step()
    assert w.dtype == torch.bfloat16 and opt.state[w]["v"].dtype == torch.bfloat16
    moved = (ref.detach() - w0.float()).norm()
    assert moved > 1.0
    assert (w.detach().float() - ref.detach()).norm() < 0.02 * moved
    assert_close(opt.state[w]["v"].float(), 0.999 * sq, 1e-2, what="v")
    assert_close(opt_ref.state[ref]["v"], 0.999 * sq, 1e-6, what="v (float32)")


# --------------------------------------------------------------------------- the trainer's m3_paper
def test_the_trainers_m3_paper_is_algorithm_1_alone(tmp_path):
    """``mnemo train --optimizer m3_paper`` on a tiny model: replaying the gradients the optimizer
    saw through the hand transcription of Algorithm 1 (constant lr, no weight decay, no clipping)
    gives the trained weights — although the config asks for weight decay 0.1, clipping at a norm
    1e-6 would have bound, and warm-up + cosine would have moved the lr. ``"m3"`` keeps them."""
    from mnemo.train import TrainConfig, Trainer
    from mnemo.train.optim import describe_optimizer

    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, m3_beta3=0.8, m3_alpha=0.5, m3_eps=1e-3, m3_slow_every=2)
    cfg = TrainConfig(
        model="gla",
        model_overrides={"d_model": 16, "n_layers": 1, "mlp": "none"},
        task="mqar",
        task_options={"num_pairs": 2, "vocab_size": 16},
        seq_len=16,
        batch_size=2,
        steps=5,
        eval_interval=5,
        eval_batches=1,
        sample_tokens=0,
        weight_decay=0.1,
        grad_clip=1e-6,
        warmup_steps=2,
        optimizer="m3_paper",
        **hp,
    )
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    theta0 = [p.detach().clone() for p in params]
    seen, norms = [], []

    def record(opt, args, kwargs):  # the gradients the optimizer is about to use
        seen.append([p.grad.detach().clone() for p in params])
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in seen[-1]]))))

    trainer.optimizer.register_step_pre_hook(record)
    trainer.fit()
    assert len(seen) == 5 and min(norms) > 1e-3  # clipping at 1e-6 would have scaled them down
    lrs = {round(g["lr"], 12) for g in trainer.optimizer.param_groups}
    assert lrs == {1e-3}  # constant: no warm-up, no cosine
    ref = ref_algorithm1(
        theta0,
        lambda theta, t: seen[t - 1],
        5,
        hp["lr"],
        (hp["beta1"], hp["beta2"], hp["m3_beta3"]),
        hp["m3_alpha"],
        hp["m3_eps"],
        5,
        hp["m3_slow_every"],
    )
    worst = max(((p.detach() - r).abs().max() / r.abs().max()).item() for p, r in zip(params, ref))
    assert worst <= 1e-5, worst  # float32 weights
    assert "alone: constant lr 0.001, no weight decay, clipping or EMA" in describe_optimizer(cfg)
    m3 = describe_optimizer(TrainConfig(optimizer="m3"))
    assert "decoupled weight decay 0.1" in m3 and "gradient clipping at norm 1" in m3 and "cosine" in m3


def test_m3_paper_has_no_schedule_to_resume():
    """A constant lr: more steps on resume need no --reschedule, and one given is refused."""
    from mnemo.train import TrainConfig
    from mnemo.train.run_folder import resume_config

    saved = TrainConfig(optimizer="m3_paper", steps=10).validate()
    cfg, notes = resume_config(saved, {"steps": 20})
    assert cfg.steps == 20 and cfg.schedule_steps is None and notes == ["steps 10 -> 20"]
    with pytest.raises(ValueError, match="'m3_paper' keeps a constant learning rate"):
        resume_config(saved, {"steps": 20}, reschedule="hold")
    with pytest.raises(ValueError, match="m3_ema: expected false with optimizer 'm3_paper'"):
        TrainConfig(optimizer="m3_paper", m3_ema=True).validate()

"""Mixture of experts (mnemo.layers.moe): the fast dispatches equal the dense reference (outputs and
gradients, float64; "fixed" is the no-host-read path that "sorted" and "padded" take off the
CPU); the routing, the losses, bias balancing and capacity drops against values
computed by hand; the config; training through the Trainer; decoding and packing unchanged.

Tolerances: float64 relative RMS ≤ 1e-12 between dispatch forms (measured ~1e-16)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MoE
from mnemo.layers.moe import expert_load, moe_reference
from mnemo.models import LanguageModel, ModelConfig, build_config
from mnemo.train import TrainConfig, Trainer
from tests.helpers import rel_rms

TOL = 1e-12


def _moe(seed=0, d=12, **kw) -> MoE:
    torch.manual_seed(seed)
    m = MoE(d, **{"n_experts": 4, "expert_hidden": 6, **kw}).double()
    with torch.no_grad():  # larger router logits: decisive, varied routing
        m.router.weight.mul_(40)
    return m


def _grads(m, x, y):
    return torch.autograd.grad(
        (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum(), [x, *m.parameters()]
    )


@pytest.mark.parametrize("dispatch", ["sorted", "padded", "fixed"])
@pytest.mark.parametrize(
    "variant",
    ["top1", "top2", "top2_shared", "top2_gated_shared_unnorm", "top2_capacity", "top1_capacity_shared"],
)
def test_fast_dispatch_equals_dense_reference(dispatch, variant):
    kw = {"top_k": 1 if variant.startswith("top1") else 2, "dispatch": dispatch}
    if "shared" in variant:
        kw["shared_expert_hidden"] = 5
    if "gated" in variant:
        kw["shared_expert_gate"] = True
    if "unnorm" in variant or variant.startswith("top1"):  # top-1 normalised: weight 1, no router grad
        kw["norm_topk_prob"] = False
    if "capacity" in variant:
        kw["capacity_factor"] = 0.7
    m = _moe(**kw)
    for shape in [(3, 7), (1, 1), (2, 0)]:  # 21 tokens (odd), one token, none
        x = torch.randn(*shape, 12, dtype=torch.float64, requires_grad=True)
        y = m(x)
        loads, dropped = m.last_load.clone(), int(m.last_dropped)
        if x.numel() == 0:
            assert y.shape == x.shape
            continue
        g = _grads(m, x, y)
        yr = moe_reference(m, x)
        gr = _grads(m, x, yr)
        assert rel_rms(y, yr) <= TOL, f"output {rel_rms(y, yr):.1e}"
        for a, b in zip(g, gr):
            assert rel_rms(a, b, floor=1e-6) <= TOL
        assert torch.equal(loads, m.last_load) and dropped == int(m.last_dropped)
        if "capacity" in variant and shape == (3, 7):
            assert dropped > 0  # the capacity really bites in this case


def _force_logits(m: MoE, logits: torch.Tensor):
    """Replace the router logits through ``hook_router_logits`` (an intervention)."""
    return m.hook_router_logits.add(lambda value, name: logits.to(value.dtype).reshape(value.shape))


def _silu(a: float) -> float:
    return a / (1 + math.exp(-a))


def test_routing_meaning_by_hand():
    """E = 3 experts, d = 3, hidden 1; token n is the basis vector e_n, so the router logits of token
    n are column n of the router weight. Expert e computes ``u_e · silu(a_e x) · (b_e x)``."""
    m = MoE(3, n_experts=3, top_k=2, expert_hidden=1, norm_topk_prob=True).double()
    L = [[2.0, 1.0, -1.0], [0.0, -3.0, 0.5], [1.0, 4.0, 2.0]]  # L[n] = logits of token n
    a = [[1.0, 2.0, 0.5], [-1.0, 1.0, 1.5], [0.3, -0.7, 2.0]]  # gate rows
    b = [[0.5, -1.0, 1.0], [2.0, 1.0, 0.0], [1.0, 1.0, -2.0]]  # up rows
    u = [[1.0, 0.0, -1.0], [0.5, 2.0, 1.0], [-1.0, 1.0, 3.0]]  # down columns
    with torch.no_grad():
        m.router.weight.copy_(torch.tensor(L, dtype=torch.float64).t())
        for e in range(3):
            m.w_in[e].copy_(torch.tensor([a[e], b[e]], dtype=torch.float64))
            m.w_out[e].copy_(torch.tensor(u[e], dtype=torch.float64)[:, None])
    x = torch.eye(3, dtype=torch.float64)[None]  # [1, 3, 3]
    chosen = {0: (0, 1), 1: (2, 0), 2: (1, 2)}  # read off L: the two largest logits, best first
    want = []
    for n in range(3):
        z = [math.exp(v) for v in L[n]]
        s = [v / sum(z) for v in z]
        e1, e2 = chosen[n]
        w1, w2 = s[e1] / (s[e1] + s[e2]), s[e2] / (s[e1] + s[e2])
        out = [0.0, 0.0, 0.0]
        for e, w in ((e1, w1), (e2, w2)):
            h = _silu(a[e][n]) * b[e][n]  # a_e · e_n = a[e][n]
            out = [o + w * h * u[e][i] for i, o in enumerate(out)]
        want.append(out)
    logits_cache = {}
    hooks = [
        m.hook_topk_indices.add(lambda v, name: logits_cache.__setitem__("idx", v)),
        m.hook_topk_weights.add(lambda v, name: logits_cache.__setitem__("w", v)),
    ]
    y = m(x)
    for h in hooks:
        h.remove()
    assert torch.allclose(y[0], torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=1e-15)
    assert logits_cache["idx"][0].tolist() == [list(chosen[n]) for n in range(3)]
    assert torch.allclose(logits_cache["w"].sum(-1), torch.ones(1, 3, dtype=torch.float64))
    # forcing the routing through hook_topk_indices: token 0 to experts (2, 1); weights follow
    h = m.hook_topk_indices.add(lambda v, name: torch.tensor([[[2, 1], [2, 0], [1, 2]]]))
    y2 = m(x)
    h.remove()
    z = [math.exp(v) for v in L[0]]
    w2, w1 = z[2] / (z[1] + z[2]), z[1] / (z[1] + z[2])
    want0 = [
        w2 * _silu(a[2][0]) * b[2][0] * u[2][i] + w1 * _silu(a[1][0]) * b[1][0] * u[1][i] for i in range(3)
    ]
    assert torch.allclose(y2[0, 0], torch.tensor(want0, dtype=torch.float64), rtol=1e-13)
    assert torch.equal(y2[0, 1:], y[0, 1:])


def test_aux_loss_and_z_loss_by_hand():
    m = _moe(n_experts=2, top_k=1)
    x = torch.randn(1, 4, 12, dtype=torch.float64)
    L = torch.tensor([[2.0, 0.0], [1.0, 0.5], [0.0, 3.0], [4.0, 1.0]], dtype=torch.float64)
    h = _force_logits(m, L)
    m(x)
    h.remove()
    p = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in L.tolist()]
    f = [3 / 4, 1 / 4]  # argmax: 0, 0, 1, 0
    P = [sum(r[e] for r in p) / 4 for e in range(2)]
    assert m.last_aux_loss.item() == pytest.approx(2 * (f[0] * P[0] + f[1] * P[1]), rel=1e-13)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in L.tolist()) / 4
    assert m.last_z_loss.item() == pytest.approx(z, rel=1e-13)
    assert m.last_load.tolist() == f and m.last_counts.tolist() == [3, 1]
    assert m.loss().item() == pytest.approx(0.01 * m.last_aux_loss.item())  # z_loss_coef 0 by default
    # uniform routing: P = 1/E gives exactly 1 (Switch), whatever the choice; top-k counts k per token
    for k in (1, 3):
        u = _moe(n_experts=4, top_k=k)
        h = _force_logits(u, torch.zeros(1, 5, 4))
        u(torch.randn(1, 5, 12, dtype=torch.float64))
        h.remove()
        assert u.last_aux_loss.item() == pytest.approx(1.0, rel=1e-14)
        assert int(u.last_counts.sum()) == 5 * k
    # perfectly balanced confident routing: f = P = 1/E -> 1; collapsed routing -> E
    big = torch.tensor([[30.0, 0, 0, 0], [0, 30.0, 0, 0], [0, 0, 30.0, 0], [0, 0, 0, 30.0]])
    for logits, want in [(big, 1.0), (big[[0, 0, 0, 0]], 4.0)]:
        u = _moe(n_experts=4, top_k=1)
        h = _force_logits(u, logits)
        u(torch.randn(1, 4, 12, dtype=torch.float64))
        h.remove()
        assert u.last_aux_loss.item() == pytest.approx(want, rel=1e-9)
    assert expert_load(torch.tensor([[0, 1], [1, 3]]), 4).tolist() == [0.25, 0.5, 0.0, 0.25]


def test_bias_balancing_moves_toward_underloaded_and_changes_selection_not_weights():
    m = _moe(n_experts=3, top_k=1, bias_balancing=True, bias_update_rate=0.1, norm_topk_prob=False)
    L = torch.tensor([[3.0, 2.0, 0.0]] * 5 + [[0.0, 2.0, 3.0]])  # expert 0 overloaded, 1 unused
    x = torch.randn(1, 6, 12, dtype=torch.float64)
    h = _force_logits(m, L)
    seen = {}
    hw = m.hook_topk_weights.add(lambda v, name: seen.__setitem__("w", v.clone()))
    hi = m.hook_topk_indices.add(lambda v, name: seen.__setitem__("i", v.clone()))
    m(x)
    assert seen["i"][0, :, 0].tolist() == [0] * 5 + [2]
    scores = torch.softmax(L.double(), -1)
    m.update_bias()  # counts [5, 0, 1], mean 2: expert 0 down, experts 1 and 2 up
    assert m.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1])
    for _ in range(4):
        m.update_bias(torch.tensor([5, 0, 1]))
    # s_0 + b_0 = 0.6285 - 0.5 < s_1 + b_1 = 0.2312 + 0.5: tokens 0-4 now choose expert 1 ...
    m(x)
    assert seen["i"][0, :, 0].tolist() == [1] * 5 + [2]
    # ... weighted by their unbiased scores
    assert torch.equal(seen["w"][0, :, 0], scores[torch.arange(6), seen["i"][0, :, 0]])
    h.remove(), hw.remove(), hi.remove()
    assert "expert_bias" in m.state_dict()  # checkpointed with the weights
    with pytest.raises(RuntimeError, match="bias_balancing=False"):
        _moe().update_bias()


def test_capacity_drops_are_counted_and_output_zero():
    m = _moe(n_experts=2, top_k=1, capacity_factor=1.0)
    x = torch.randn(1, 6, 12, dtype=torch.float64)
    h = _force_logits(m, torch.tensor([[5.0, 0.0]] * 6))  # every token wants expert 0
    m.train()
    y = m(x)
    # capacity ceil(1.0 · 6 · 1 / 2) = 3: tokens 0-2 are served (token order), 3-5 dropped
    assert int(m.last_dropped) == 3 and m.last_counts.tolist() == [6, 0]
    assert torch.equal(y[0, 3:], torch.zeros(3, 12, dtype=torch.float64))
    assert (y[0, :3].abs().sum(-1) > 0).all()
    m.eval()  # evaluation and decoding never drop
    y_eval = m(x)
    assert int(m.last_dropped) == 0 and (y_eval[0].abs().sum(-1) > 0).all()
    assert rel_rms(y_eval[0, :3], y[0, :3]) < 1e-12
    h.remove()
    # top-2: first choices are served before any second choice
    m2 = _moe(n_experts=2, top_k=2, capacity_factor=0.5)
    h = _force_logits(m2, torch.tensor([[5.0, 0.0]] * 4))
    m2.train()
    m2(torch.randn(1, 4, 12, dtype=torch.float64))  # capacity 2 per expert; 4 first choices on 0
    h.remove()
    assert int(m2.last_dropped) == 4  # 2 first choices on expert 0 and 2 second choices on expert 1


def test_config_validation_names_the_field():
    for opts, match in [
        ({"n_experts": 4, "top_k": 5}, r"ModelConfig.mlp_options: top_k: expected an int in \[1, 4\], got 5"),
        ({"n_expert": 4}, "ModelConfig.mlp_options: n_expert: unknown MoE option"),
        ({"capacity_factor": -1.0}, "capacity_factor: expected a finite number > 0, got -1.0"),
        ({"aux_loss_coef": "0.1"}, "aux_loss_coef: expected a finite number >= 0"),
        ({"shared_expert_gate": True}, "shared_expert_gate: expected False without a shared expert"),
        ({"dispatch": "loop"}, "dispatch: expected one of"),
        ({"bias_balancing": 1}, "bias_balancing: expected True or False, got 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(mlp="moe", mlp_options=opts).validate()
    with pytest.raises(ValueError, match="ModelConfig.mlp: expected 'swiglu', 'none', 'cms' or 'moe'"):
        ModelConfig(mlp="moes").validate()
    with pytest.raises(ValueError, match=r"x: expected \[..., d_model = 12\]"):
        _moe()(torch.zeros(2, 5, dtype=torch.float64))


def _tiny_moe_config(**opts) -> dict:
    return dict(
        model="gated_deltanet_attention_moe",
        model_overrides={
            "d_model": 16,
            "n_layers": 2,
            "pattern": ["gated_deltanet", "attention"],
            "mixer_options": {"gated_deltanet": {"n_heads": 2}, "attention": {"n_heads": 2}},
            "mlp_options": {"n_experts": 4, "top_k": 2, "expert_hidden": 8, "aux_loss_coef": 0.5, **opts},
        },
        seq_len=16,
        batch_size=4,
        steps=4,
        eval_interval=2,
        eval_batches=1,
        warmup_steps=1,
        sample_tokens=0,
    )


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_trainer_loss_includes_aux_losses(grad_accum, tmp_path):
    """A train step's gradient is that of mean CE + the mean over micro-batches of Σ_layers coef · L."""
    cfg = TrainConfig(**_tiny_moe_config(z_loss_coef=0.1), grad_accum=grad_accum, grad_clip=0.0)
    tr = Trainer(cfg, tmp_path, progress=False)
    tr.optimizer.step = lambda *a, **k: None  # keep the weights: p.grad is the step's gradient
    state = tr.generator.get_state()
    tr.train_step()
    got = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    tr.generator.set_state(state)
    x, y = tr.train_data.sample(cfg.batch_size, tr.generator)
    tr.model.zero_grad(set_to_none=True)
    micro = cfg.batch_size // grad_accum
    for i in range(grad_accum):
        logits, _ = tr.model(x[i * micro : (i + 1) * micro])
        ce = F.cross_entropy(logits.flatten(0, 1), y[i * micro : (i + 1) * micro].flatten(), reduction="sum")
        (ce / y.numel() + tr.model.aux_loss() / grad_accum).backward()
    router = [n for n in got if n.endswith("router.weight")]
    assert router
    for n, p in tr.model.named_parameters():
        assert rel_rms(got[n], p.grad) < 1e-5, n
    # the aux term matters for the router: without it the gradient differs
    logits, _ = tr.model(x)
    g_ce = torch.autograd.grad(
        F.cross_entropy(logits.flatten(0, 1), y.flatten()), tr.model.blocks[0].mlp.router.weight
    )
    assert rel_rms(g_ce[0], got[router[0]]) > 1e-3


def test_trainer_logs_loads_and_balances_bias(tmp_path):
    cfg = TrainConfig(**_tiny_moe_config(bias_balancing=True, capacity_factor=1.0), lr=1e-2)
    tr = Trainer(cfg, tmp_path, progress=False)
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert len(r["moe_load"]) == 2 and all(len(row) == 4 for row in r["moe_load"])
        assert all(sum(row) == pytest.approx(1.0, abs=1e-4) for row in r["moe_load"])
        assert r["moe_load_min"] <= 0.25 <= r["moe_load_max"]
        assert isinstance(r["moe_dropped"], int) and 0 <= r["moe_dropped_frac"] < 1
        assert r["moe_aux_loss"] >= 1.0 - 1e-6 and r["moe_z_loss"] > 0
    assert sum(r["moe_dropped"] for r in rows) > 0  # capacity 1.0 drops some at random init
    for _, m in tr.model.moe_layers():  # 4 steps of ±u on every expert (no expert exactly at the mean)
        b = m.expert_bias
        assert b.abs().max() <= 4 * 1e-3 + 1e-9 and b.abs().sum() > 0


def test_decoding_and_packing_unchanged():
    torch.manual_seed(0)
    cfg = build_config(
        "gated_deltanet_attention_moe",
        vocab_size=40,
        d_model=16,
        n_layers=2,
        pattern=["gated_deltanet", "attention"],
        mlp_options={
            "n_experts": 4,
            "top_k": 2,
            "expert_hidden": 8,
            "shared_expert_hidden": 8,
            "shared_expert_gate": True,
            "bias_balancing": True,
            "capacity_factor": 0.5,
        },
    )
    m = LanguageModel(cfg).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
        for _, moe in m.moe_layers():
            moe.expert_bias.copy_(torch.tensor([0.05, -0.02, 0.0, 0.01]))
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(1))
    full, state = m(ids)
    assert all(s.mlp is None for s in state)  # MoE is stateless: the cache is the mixers' alone
    a, s = m(ids[:, :4])
    steps = [a]
    for t in range(4, 11):
        o, s = m(ids[:, t : t + 1], s)
        steps.append(o)
    assert rel_rms(torch.cat(steps, 1), full) < 1e-12
    out = m.generate(ids[:1, :3], 5, temperature=0)
    assert out.shape == (1, 8)
    docs = [ids[:1, :3], ids[1:, :6]]
    packed, _ = m(torch.cat(docs, 1), cu_seqlens=torch.tensor([0, 3, 9]))
    assert rel_rms(packed, torch.cat([m(d)[0] for d in docs], 1)) < 1e-12
    # router decisions through run_with_cache
    _, cache = m.run_with_cache(ids, names=["hook_router_logits", "hook_topk_indices", "hook_topk_weights"])
    assert cache["blocks.0.mlp.hook_router_logits"].shape == (2, 11, 4)
    assert cache["blocks.1.mlp.hook_topk_indices"].shape == (2, 11, 2)
    assert torch.equal(expert_load(cache["blocks.1.mlp.hook_topk_indices"], 4), m.blocks[1].mlp.last_load)


def test_activation_checkpointing_keeps_aux_gradients():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=30,
        d_model=16,
        n_layers=2,
        mixer="gla",
        mixer_options={"gla": {"n_heads": 2}},
        mlp="moe",
        mlp_options={"n_experts": 4, "top_k": 2, "expert_hidden": 8, "z_loss_coef": 0.1},
    )
    m = LanguageModel(cfg).double().train()
    ids = torch.randint(0, 30, (2, 9))
    grads = []
    for ckpt in (False, True):
        m.activation_checkpointing = ckpt
        m.zero_grad()
        logits, _ = m(ids)
        (logits.square().mean() + m.aux_loss()).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert rel_rms(a, b) < 1e-12


def test_mlp_options_are_refused_for_mlps_without_options():
    """``mlp_options`` given with ``mlp="swiglu"`` (or ``"none"``) would be ignored: refused."""
    from mnemo.models import ModelConfig

    with pytest.raises(ValueError, match=r"ModelConfig.mlp_options: expected empty for mlp 'swiglu'"):
        ModelConfig(mlp="swiglu", mlp_options={"n_experts": 4}).validate()
    assert ModelConfig(mlp="none", mlp_options={}).validate().mlp == "none"


def test_fixed_dispatch_never_sums_dropped_tokens_into_a_value():
    """``"fixed"`` parks every dropped assignment in one spare row of the expert buffer. Summing
    them there would overflow in half precision (here 1000 tokens of 60 each: 6e4 per channel, then
    SwiGLU far past float16's 65504), and weight 0 · inf is NaN: the row must hold zeros."""
    torch.manual_seed(0)
    m = MoE(8, n_experts=2, top_k=1, capacity_factor=0.5, expert_hidden=8, dispatch="fixed").train()
    m.router.weight.data.zero_()
    m.router.weight.data[0] += 1.0  # every token prefers expert 0: half of them are dropped
    x = torch.full((1, 1000, 8), 60.0, dtype=torch.float32)
    ref = MoE(8, n_experts=2, top_k=1, capacity_factor=0.5, expert_hidden=8, dispatch="sorted").train()
    ref.load_state_dict(m.state_dict())
    y, yr = m.half()(x.half()), ref.half()(x.half())
    assert int(m.last_dropped) > 0 and torch.isfinite(y).all()
    assert torch.equal(y, yr)  # the dropped tokens get exactly the sorted path's zeros

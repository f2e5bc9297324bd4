"""The optimizer and schedule a run is built with, checked against their documented values: the
warm-up + cosine in closed form, weight decay on matrices only, per-module learning-rate scales,
and M3's hyper-parameters taken from the config (``m3_eps`` defaults to 1e-2, not Adam's 1e-8)."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.train import TrainConfig
from mnemo.train.trainer import lr_factor, make_optimizer


def test_lr_factor_is_linear_warmup_then_cosine_to_the_floor():
    warm, total, floor = 4, 14, 0.1
    assert [lr_factor(s, warm, total, floor) for s in range(warm)] == [0.25, 0.5, 0.75, 1.0]
    for s in range(warm, total + 3):
        p = min(1.0, (s - warm) / (total - warm))
        assert lr_factor(s, warm, total, floor) == pytest.approx(
            floor + (1 - floor) * (1 + math.cos(math.pi * p)) / 2
        )
    assert lr_factor(warm + 5, warm, total, floor) == pytest.approx(0.55)  # half-way: the mean
    assert lr_factor(0, 0, 10, 0.0) == 1.0 and lr_factor(10, 0, 10, 0.0) == pytest.approx(0.0)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)  # weight decays, bias does not
        self.b = torch.nn.Linear(4, 2)
        self.b.outer_lr_scale = 0.25


def test_weight_decay_on_matrices_only_and_scaled_modules_get_their_own_groups():
    net = _Net()
    cfg = TrainConfig(lr=0.02, weight_decay=0.3, beta1=0.8, beta2=0.9)
    opt = make_optimizer(net, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    got = [({id(p) for p in g["params"]}, g["weight_decay"], g["lr"]) for g in opt.param_groups]
    assert got == [
        ({id(net.a.weight)}, 0.3, 0.02),
        ({id(net.a.bias)}, 0.0, 0.02),
        ({id(net.b.weight)}, 0.3, 0.02 * 0.25),
        ({id(net.b.bias)}, 0.0, 0.02 * 0.25),
    ]
    assert opt.defaults["betas"] == (0.8, 0.9)


def test_m3_takes_every_hyper_parameter_from_the_config():
    from mnemo.nested import M3

    cfg = TrainConfig(optimizer="m3", lr=0.05, beta1=0.7, beta2=0.8, m3_beta3=0.6, m3_alpha=0.4)
    cfg.m3_ns_steps, cfg.m3_slow_every, cfg.m3_ema = 3, 7, True
    opt = make_optimizer(_Net(), cfg)
    assert isinstance(opt, M3)
    d = opt.defaults
    assert d["lr"] == 0.05 and tuple(d["betas"]) == (0.7, 0.8, 0.6) and d["alpha"] == 0.4
    assert (d["ns_steps"], d["slow_every"], d["ema"], d["eps"]) == (3, 7, True, 1e-2)
    assert TrainConfig().m3_eps == 1e-2  # the documented default


def test_the_m3_settings_default_to_m3s_own_defaults_except_eps():
    import inspect

    from mnemo.nested import M3

    p = inspect.signature(M3).parameters
    cfg = TrainConfig()
    assert (cfg.beta1, cfg.beta2) == (0.9, 0.95)  # AdamW's (shared with M3's β1, β2)
    assert cfg.m3_beta3 == p["betas"].default[2]
    assert (cfg.m3_alpha, cfg.m3_ns_steps, cfg.m3_slow_every, cfg.m3_ema) == (
        p["alpha"].default,
        p["ns_steps"].default,
        p["slow_every"].default,
        p["ema"].default,
    )
    assert cfg.m3_eps == 1e-2 != p["eps"].default  # the documented departure


def test_adamw_is_torchs_fused_kernel_on_the_cpu_with_the_for_loop_update():
    """make_optimizer picks fused AdamW for plain CPU parameters; three steps of it equal torch's
    for-loop AdamW with the same groups (to float rounding)."""
    torch.manual_seed(0)
    net, ref = _Net(), _Net()
    ref.load_state_dict(net.state_dict())
    cfg = TrainConfig(lr=0.02, weight_decay=0.3, beta1=0.8, beta2=0.9)
    opt = make_optimizer(net, cfg)
    assert opt.defaults["fused"] is True
    twin = dict(zip([id(p) for p in net.parameters()], ref.parameters()))
    groups = [
        {"params": [twin[id(p)] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"]}
        for g in opt.param_groups
    ]
    ref_opt = torch.optim.AdamW(groups, betas=(0.8, 0.9), foreach=False, fused=False)
    assert all(not g["fused"] for g in ref_opt.param_groups)
    x = torch.randn(5, 3)
    for _ in range(3):
        for m, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            m.b(torch.tanh(m.a(x))).square().sum().backward()
            o.step()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name


def test_adamw_falls_back_to_torchs_default_where_the_fused_kernel_does_not_apply():
    """The fallback path of adamw_implementation: a parameter off the CPU/CUDA (``meta``, as a
    stand-in for FSDP's DTensors and other devices), a tensor subclass, or no trainable parameter at
    all gives ``{}`` (torch's default implementation); plain CPU parameters give fused."""
    from mnemo.train.optim import adamw_implementation

    assert adamw_implementation(_Net()) == {"fused": True}
    meta = torch.nn.Linear(3, 3, device="meta")
    assert adamw_implementation(meta) == {}

    class Sub(torch.Tensor):
        pass

    sub = torch.nn.Linear(3, 3)
    sub.weight = torch.nn.Parameter(sub.weight.detach().as_subclass(Sub))
    assert adamw_implementation(sub) == {}
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    assert adamw_implementation(frozen) == {}
    net = _Net()
    net.a = torch.nn.Linear(net.a.in_features, net.a.out_features, device="meta").requires_grad_(False)
    assert adamw_implementation(net) == {"fused": True}  # frozen parameters do not decide

"""Kimi Delta Attention (``kda``, :class:`mnemo.layers.KimiDeltaAttention`) and the ``kda`` /
``kimi_linear`` presets.

* the layer equals a hand loop written here from the equations (projections → short conv → L2
  norms → per-channel gate → the KDA recurrence → gated RMSNorm → W_o), in every form (float64);
* it equals ``transformers``' ``KimiLinearDeltaAttention`` given the same weights, over 70 tokens
  (two of transformers' 64-token chunks; outputs up to ~1.5): max |Δy| 3.1e-15 in float64 (its
  float32 casts lifted; bound 1e-12), 1.7e-6 in float32 (4.7e-6 at 300 tokens; bound 2e-5);
* a prefill followed by one-token steps equals one full call (float64);
* the ``kimi_linear`` preset (3 KDA : 1 MLA) trains: every parameter gets a gradient and the loss
  falls on a fixed batch; bad options are refused by name.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MIXERS, KimiDeltaAttention
from tests.helpers import assert_close, prefill_then_tokens

D, H, K = 24, 2, 8


def _layer(seed=0, **options) -> KimiDeltaAttention:
    """A float64 layer with every weight moved off its init (so each path matters numerically)."""
    torch.manual_seed(seed)
    m = KimiDeltaAttention(D, n_heads=H, head_dim=K, **options).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _x(T, B=2, seed=1, dtype=torch.float64):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _hand_loop(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's KDA layer token by token, from the equations (no mnemo op, norm or conv)."""
    B, T, _ = x.shape
    W = m.conv.kernel_size
    lin = lambda layer, a: a @ layer.weight.T + (0 if layer.bias is None else layer.bias)  # noqa: E731
    pre = torch.cat([lin(m.q_proj, x), lin(m.k_proj, x), lin(m.v_proj, x)], -1)  # [B, T, 3 H K]
    taps = m.conv.weight[:, 0, :]  # [3 H K, W]: tap i reads the input W − 1 − i tokens back
    conv = torch.zeros_like(pre)
    for t in range(T):
        for i in range(W):
            if t - (W - 1 - i) >= 0:
                conv[:, t] += taps[:, i] * pre[:, t - (W - 1 - i)]
    q, k, v = F.silu(conv).view(B, T, 3, H, K).unbind(2)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    beta = torch.sigmoid(lin(m.b_proj, x))  # [B, T, H]
    f = (lin(m.f_b_proj, lin(m.f_a_proj, x)) + m.dt_bias).view(B, T, H, K)
    alpha = torch.exp(-m.A_log.exp()[:, None] * torch.log1p(f.exp()))  # per key channel, in (0, 1)
    S = x.new_zeros(B, H, K, K)
    outs = []
    for t in range(T):
        S = alpha[:, t, :, :, None] * S  # Diag(α_t) S_{t−1}
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * err[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) / K**0.5)
    o = torch.stack(outs, 1)  # [B, T, H, K]
    o = o / (o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps).sqrt() * m.o_norm.weight
    gate = torch.sigmoid(lin(m.g_b_proj, lin(m.g_a_proj, x))).view(B, T, H, K)
    return lin(m.o_proj, (gate * o).reshape(B, T, H * K))


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
def test_every_form_equals_the_hand_loop(mode):
    # a gate rank other than head_dim, the output gate's bias, chunks of 4 over 11 tokens
    m = _layer(gate_rank=3, output_gate_bias=True, chunk_size=4)
    x = _x(11)
    assert_close(m(x, mode=mode)[0], _hand_loop(m, x), 1e-10, what=mode)


def test_prefill_then_token_steps_equal_one_call():
    m = _layer(chunk_size=4)
    x = _x(10)
    full = m(x)[0]
    for prefill in (2, 6):  # shorter than the conv's taps, and over a chunk
        assert_close(prefill_then_tokens(m, x, prefill), full, 1e-10, what=f"prefill {prefill}")


def test_equals_transformers_kimi_linear_delta_attention(monkeypatch):
    if "fla" not in sys.modules:  # transformers' PyTorch forms (what it runs on the CPU anyway), without
        monkeypatch.setitem(sys.modules, "fla", None)  # importing fla for its kernels (~3 s)
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    from tests.hf.test_mamba_interop import transformers_in_float64

    cfg = KimiLinearConfig(
        vocab_size=32, hidden_size=D, num_hidden_layers=1, linear_num_heads=H, linear_head_dim=K,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-5, layer_types=["linear_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    hf = KimiLinearDeltaAttention(cfg, layer_idx=0).double()
    m = _layer(norm_eps=1e-5)
    ours = m.state_dict()
    theirs = {
        "forget_gate.A_log": ours.pop("A_log").view(1, 1, H, 1),
        "forget_gate.dt_bias": ours.pop("dt_bias"),
        "forget_gate.f_a_proj.weight": ours.pop("f_a_proj.weight"),
        "forget_gate.f_b_proj.weight": ours.pop("f_b_proj.weight"),
        "conv1d.weight": ours.pop("conv.weight"),
        **ours,
    }
    hf.load_state_dict(theirs, strict=True)
    x = _x(70)  # two of transformers' 64-token chunks
    # float64 with transformers' float32 casts lifted: measured 3.1e-15 (outputs up to ~1.5)
    with torch.no_grad(), transformers_in_float64():
        want = hf(x)
    with torch.no_grad():
        for mode in ("chunk", "recurrent"):
            err = (m(x, mode=mode)[0] - want).abs().max().item()
            assert err < 1e-12, f"float64 {mode}: max |Δy| {err:.2e}"
        # float32 as both are: measured 1.7e-6 (at 300 tokens 4.7e-6)
        hf.float(), m.float()
        want = hf(x.float())
        for mode in ("chunk", "recurrent"):
            err = (m(x.float(), mode=mode)[0] - want).abs().max().item()
            assert err < 2e-5, f"float32 {mode}: max |Δy| {err:.2e}"


def test_kimi_linear_preset_trains_and_every_parameter_learns():
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config("kimi_linear", vocab_size=17, d_model=32))
    assert [type(b.mixer).__name__ for b in model.blocks] == ["KimiDeltaAttention"] * 3 + [
        "MultiHeadLatentAttention"
    ]
    ids = torch.randint(0, 17, (2, 17), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        logits, _ = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        if step == 0:
            dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not dead, dead
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_presets_and_registry():
    from mnemo.models import build_config

    assert MIXERS["kda"] is KimiDeltaAttention
    assert build_config("kda").mixer == "kda"
    cfg = build_config("kimi_linear")
    assert cfg.pattern == ["kda", "kda", "kda", "mla"]


@pytest.mark.parametrize(
    "options, named",
    [
        ({"gate_rank": 0}, "gate_rank"),
        ({"conv_size": 0}, "conv_size"),
        ({"output_gate_bias": "no"}, "output_gate_bias"),
        ({"qk_norm_eps": -1.0}, "qk_norm_eps"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"mode": "fused"}, "mode"),
    ],
)
def test_bad_options_are_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named):
        KimiDeltaAttention(D, **options)

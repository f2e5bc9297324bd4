"""Implicit maps against independent references: closed-form decays, a hand loop of the scan, and
the activations the layers themselves compute (read by hooks on their read-out modules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from mnemo.interp import decay_matrix, mixing, scan_map
from mnemo.layers import Attention, Mamba, Mamba2
from tests.helpers import assert_close


def test_decay_matrix_of_constant_gates_is_exp_of_the_distance():
    T = 5
    g = torch.full((1, T, 2), -0.5, dtype=torch.float64)
    g[..., 1] = -0.1
    t = torch.arange(T, dtype=torch.float64)
    dist = (t[:, None] - t[None, :]).clamp(min=0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for h, rate in enumerate((0.5, 0.1)):
        expected = torch.where(causal, torch.exp(-rate * dist), torch.zeros(()))
        assert torch.allclose(decay_matrix(g)[0, h], expected)
    gk = torch.stack([torch.full((1, T, 1), -0.5), torch.full((1, T, 1), -2.0)], -1).double()  # [1,T,1,2]
    D = decay_matrix(gk)  # [1, 1, T, T, K]
    assert torch.allclose(D[0, 0, ..., 1], torch.where(causal, torch.exp(-2.0 * dist), torch.zeros(())))


def test_scan_map_reproduces_a_hand_loop_of_the_selective_scan():
    torch.manual_seed(0)
    Bt, T, Dm, N = 1, 6, 3, 2
    delta = torch.rand(Bt, T, Dm, dtype=torch.float64) + 0.1
    A = -torch.rand(Dm, N, dtype=torch.float64) - 0.2
    Bm, Cm = torch.randn(Bt, T, N, dtype=torch.float64), torch.randn(Bt, T, N, dtype=torch.float64)
    u = torch.randn(Bt, T, Dm, dtype=torch.float64)
    # h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,  y_t = C_t · h_t  (Mamba, S6), per channel d
    h = torch.zeros(Bt, Dm, N, dtype=torch.float64)
    ys = []
    for t in range(T):
        h = (
            torch.exp(delta[:, t, :, None] * A) * h
            + (delta[:, t, :, None] * Bm[:, t, None, :]) * u[:, t, :, None]
        )
        ys.append((h * Cm[:, t, None, :]).sum(-1))
    y = torch.stack(ys, 1)  # [Bt, T, Dm]
    M = scan_map(delta, A, Bm, Cm)  # [Bt, Dm, T, T]
    assert_close(torch.einsum("bdts,bsd->btd", M, u), y, 1e-12)


def _perturbed(m):
    torch.manual_seed(1)
    m = m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _input_of(module, run):
    got = {}
    h = module.register_forward_pre_hook(lambda mod, args: got.__setitem__("x", args[0].detach()))
    try:
        run()
    finally:
        h.remove()
    return got["x"]


def test_attention_map_output_is_what_the_layer_projects_out():
    m = _perturbed(Attention(16, n_heads=4, n_kv_heads=2))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    seen = _input_of(m.o_proj, lambda: m(x))
    mx = mixing(m, x)
    assert_close(rearrange(mx.output, "b t h d -> b t (h d)"), seen, 1e-10)
    assert torch.allclose(mx.maps.sum(-1), torch.ones(()).double())  # softmax rows


def test_mamba_map_output_is_the_layers_scan_before_skip_and_gate():
    m = _perturbed(Mamba(16, d_state=4))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    seen = _input_of(m.o_proj, lambda: m(x))  # (scan + D u) ⊙ silu(z)
    mx = mixing(m, x)
    u = mx.values[..., 0]  # [B, T, d_inner]
    z = m.in_proj(x).chunk(2, dim=-1)[1]
    assert_close((mx.output[..., 0] + m.D * u) * F.silu(z), seen, 1e-10)


def test_mamba2_map_output_is_the_layers_ssd_output_before_skip_and_gate():
    m = _perturbed(Mamba2(16, d_state=8, head_dim=8, n_groups=2))
    assert m.dt_bias.abs().min() > 0.5  # softplus(dt + dt_bias) differs from softplus(dt − dt_bias)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    got = {}  # the gated norm's inputs: ssd + D x, and the gate z (it normalises (ssd + D x) ⊙ silu(z))
    h = m.norm.register_forward_pre_hook(lambda mod, args: got.update(y=args[0].detach(), z=args[1].detach()))
    try:
        m(x)
    finally:
        h.remove()
    mx = mixing(m, x)  # the map's output leaves the skip D x out
    z = m.in_proj(x)[..., : m.d_inner]
    y = mx.output + m.D[:, None] * mx.values
    assert_close(got["z"], z, 1e-12)
    assert_close(rearrange(y, "b t h p -> b t (h p)") * F.silu(z), got["y"] * F.silu(got["z"]), 1e-10)


def test_capture_maps_of_chosen_layers_are_those_layers_maps():
    """``layers`` picks the layers: exactly those keys, each the map of that layer's mixer on its
    own input (recorded here by a pre-hook of the test's own)."""
    from mnemo.interp import capture_maps
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("transformer", vocab_size=30, d_model=16, n_layers=3))
    ids = torch.randint(0, 30, (2, 6))
    inputs = {}
    hooks = [
        b.mixer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, b in enumerate(m.blocks)
    ]
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    for chosen in ([1], {0, 2}):
        maps = capture_maps(m, ids, layers=chosen)
        assert sorted(maps) == sorted(chosen)
        for i, mp in maps.items():
            assert torch.equal(mp, mixing(m.blocks[i].mixer, inputs[i]).maps), f"layer {i}"

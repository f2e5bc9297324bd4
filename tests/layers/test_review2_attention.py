"""Second review of softmax attention and its toolbox (rotary/YaRN, GQA, windows and sinks, MoE,
ring attention): values against hand computations from the papers' equations and against
``transformers``' own modules built locally (tiny random weights, nothing downloaded)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from mnemo.layers.attention import Attention
from mnemo.layers.mlp import SwiGLU
from mnemo.layers.moe import MoE
from mnemo.layers.rotary import RotaryEmbedding
from mnemo.ops.ring_attention import ThreadRing, ring_attention
from mnemo.ops.softmax_attention import softmax_attention

F64 = torch.float64


def _force(point, value):
    return point.add(lambda v, name: value.to(v.dtype) if value.is_floating_point() else value)


# ------------------------------------------------------------------------------------------------
# defects (each test failed before its fix)
# ------------------------------------------------------------------------------------------------


def test_moe_bias_stays_float32_through_a_half_precision_cast():
    """The auxiliary-loss-free bias is documented as a float32 buffer; ``model.to(bfloat16)`` made
    it bf16, where a step ``u = 1e-3`` on a bias near 0.5 rounds away (spacing 2^-8): balancing
    silently stopped (one expert's step lost, another's doubled)."""
    m = MoE(8, n_experts=4, top_k=2, bias_balancing=True).to(torch.bfloat16)
    assert m.expert_bias.dtype == torch.float32
    m.expert_bias.fill_(0.5)
    m.update_bias(torch.tensor([10, 0, 5, 5]))  # mean 5: expert 0 over, 1 under, 2 and 3 even
    assert m.expert_bias.tolist() == pytest.approx([0.499, 0.501, 0.5, 0.5], abs=1e-7)
    y = m(torch.randn(2, 3, 8, dtype=torch.bfloat16))  # still runs in bf16
    assert y.dtype == torch.bfloat16
    assert m.double().expert_bias.dtype == F64  # a float64 model keeps a float64 bias


def test_fixed_dispatch_with_a_forced_routing_that_repeats_an_expert():
    """``hook_topk_indices`` may send a token twice to one expert (both weights count, as in the
    dense reference); the ``"fixed"`` dispatch (the one every non-CPU device runs) sized its buffer
    for at most ``N`` assignments per expert and overwrote rows: a silently wrong output."""
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8, dtype=F64)
    out = {}
    for dispatch in ("reference", "sorted", "padded", "fixed"):
        torch.manual_seed(1)
        m = MoE(8, n_experts=4, top_k=2, dispatch=dispatch).double()
        h = m.hook_topk_indices.add(lambda v, name: torch.full_like(v, 3))
        out[dispatch] = m(x).detach()
        h.remove()
    for dispatch in ("sorted", "padded", "fixed"):
        torch.testing.assert_close(out[dispatch], out["reference"], rtol=1e-12, atol=1e-15)


def test_capacity_is_the_documented_ceiling_for_decimal_factors():
    """``C = ceil(c · N k / E)``: with ``c = 1.1``, ``N = 100``, ``k = 1``, ``E = 2`` that is 55,
    but ``1.1 * 100 / 2`` is ``55.000000000000007`` in binary floating point and the code took 56."""
    m = MoE(4, n_experts=2, top_k=1, capacity_factor=1.1).double().train()
    logits = torch.tensor([5.0, 0.0], dtype=F64).expand(1, 100, 2)  # every token to expert 0
    h = _force(m.hook_router_logits, logits)
    m(torch.randn(1, 100, 4, dtype=F64))
    h.remove()
    assert int(m.last_dropped) == 100 - 55
    # and an exactly representable factor is unchanged: 1.25 · 8 · 2 / 4 = 5
    m = MoE(4, n_experts=4, top_k=2, capacity_factor=1.25).double().train()
    h = _force(m.hook_router_logits, torch.tensor([5.0, 4.0, 0.0, 0.0], dtype=F64).expand(1, 8, 4))
    m(torch.randn(1, 8, 4, dtype=F64))
    h.remove()
    assert int(m.last_dropped) == 2 * (8 - 5)


def test_ring_attention_of_empty_blocks():
    """``blockwise_attention`` accepts ``n = 0`` tokens per block; the ring crashed on it
    (``AttributeError: 'NoneType' object has no attribute 'reshape'``)."""
    q = torch.randn(2, 0, 4, 3, dtype=F64, requires_grad=True)
    k = torch.randn(2, 0, 2, 3, dtype=F64, requires_grad=True)
    v = torch.randn(2, 0, 2, 5, dtype=F64, requires_grad=True)
    rings, outs = ThreadRing.make(2), [None, None]

    def run(r):
        o = ring_attention(q, k, v, ring=rings[r])
        o.sum().backward()
        outs[r] = o

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        assert o is not None and o.shape == (2, 0, 4, 5) and o.dtype == F64
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_float64_rotary_uses_float64_frequencies():
    """RoPE (Su et al.): pair ``(x_i, x_{i+R/2})`` rotated by ``p · θ^{−2i/R}``. A float64 model
    rotated with the float32-rounded frequencies (``10000^{-1/4} = 0.1`` off by ``1.5e-9``): at
    position 1000 angles off by ``1e-6``, far above float64 rounding."""
    R, p = 8, 1000
    att = Attention(16, n_heads=2, head_dim=R).double()
    want = 10000.0 ** (-torch.arange(0, R, 2, dtype=F64) / R)
    torch.testing.assert_close(att.rotary.inv_freq, want, rtol=1e-15, atol=0)
    x = torch.zeros(1, 1, 1, R, dtype=F64)
    x[..., : R // 2] = 1.0  # x_i = 1, x_{i+R/2} = 0: rotated to (cos a_i, sin a_i)
    y = att.rotary.rotate(x, torch.tensor([p]))
    a = p * want
    torch.testing.assert_close(y[0, 0, 0], torch.cat([a.cos(), a.sin()]), rtol=0, atol=1e-12)
    # a scaling set before or after the cast is computed from the float64 frequencies
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8}
    before = RotaryEmbedding(R, scaling=yarn).double()
    after = RotaryEmbedding(R).double()
    after.set_scaling(yarn)
    r = 64 * want / (2 * math.pi)
    g = ((r - 1) / (8 - 1)).clamp(0, 1)
    h = (1 - g) * want / 4 + g * want
    for rot in (before, after):
        torch.testing.assert_close(rot.inv_freq, h, rtol=1e-14, atol=0)
    # back to float32: the correctly rounded float32 frequencies
    assert RotaryEmbedding(R).double().float().inv_freq.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# checks that held (kept as regression tests)
# ------------------------------------------------------------------------------------------------


def test_rotary_equals_transformers_rotate_half():
    tr = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    D = 16
    cfg = tr.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=D)
    hf = LlamaRotaryEmbedding(cfg)
    x = torch.randn(2, 7, 3, D)
    cos, sin = hf(x, torch.arange(5, 12)[None].expand(2, -1))
    want, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(RotaryEmbedding(D)(x, 5), want.transpose(1, 2), rtol=0, atol=2e-6)


@pytest.mark.parametrize("window", [None, 1, 4])
def test_attention_equals_transformers_qwen3_attention(window):
    """GQA head grouping, q/k RMSNorm, rotary positions, the sliding window's boundary (Mistral's
    ``kv > q − W``: ``W`` keys, itself included) and streaming in pieces, against
    ``Qwen3Attention`` with a mask built by ``transformers``' own mask functions."""
    tr = pytest.importorskip("transformers")
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    d, H, Hkv, D, T = 32, 4, 2, 8, 11
    cfg = tr.Qwen3Config(
        hidden_size=d,
        num_attention_heads=H,
        num_key_value_heads=Hkv,
        head_dim=D,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        sliding_window=window,
        use_sliding_window=window is not None,
        max_window_layers=0,
        layer_types=["sliding_attention" if window else "full_attention"],
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3Attention(cfg, 0).double()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m = Attention(d, H, Hkv, D, window=window, qk_norm=True, norm_eps=1e-6).double()
    with torch.no_grad():
        m.q_proj.weight.copy_(hf.q_proj.weight)
        m.kv_proj.weight.copy_(torch.cat([hf.k_proj.weight, hf.v_proj.weight]))
        m.o_proj.weight.copy_(hf.o_proj.weight)
        m.q_norm.weight.copy_(hf.q_norm.weight)
        m.k_norm.weight.copy_(hf.k_norm.weight)
    x = torch.randn(2, T, d, dtype=F64)
    cos, sin = Qwen3RotaryEmbedding(cfg)(x, torch.arange(T)[None].expand(2, -1))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    allow = causal_mask_function(0, 0, i, j)
    if window:
        allow = allow & sliding_window_overlay(window)(0, 0, i, j)
    mask = torch.zeros(T, T, dtype=F64).masked_fill(~allow, float("-inf"))[None, None]
    with torch.no_grad():
        want, _ = hf(x, (cos.double(), sin.double()), mask)
        tol = dict(rtol=0, atol=2e-6)  # transformers' cos/sin are float32
        torch.testing.assert_close(m(x)[0], want, **tol)
        torch.testing.assert_close(m(x, mode="recurrent")[0], want, **tol)
        state, pieces = None, []
        for a, b in [(0, 3), (3, 4), (4, 9), (9, 11)]:
            y, state = m(x[:, a:b], state)
            pieces.append(y)
        torch.testing.assert_close(torch.cat(pieces, 1), want, **tol)


def test_window_and_sink_masks_at_their_boundaries_by_hand():
    """Query at key position ``i`` (after a cache of ``P``) sees ``i − W < j ≤ i`` and the sinks
    ``j < n``: with ``P = 4``, ``T = 2``, ``W = 3``, ``n = 1``: query 0 (``i = 4``) sees keys
    ``{0, 2, 3, 4}``, query 1 (``i = 5``) ``{0, 3, 4, 5}``; equal scores average those values."""
    q = torch.zeros(1, 2, 1, 2, dtype=F64)
    k = torch.zeros(1, 2, 1, 2, dtype=F64)
    v = torch.tensor([4.0, 5.0], dtype=F64).view(1, 2, 1, 1)
    cache = (torch.zeros(1, 4, 1, 2, dtype=F64), torch.arange(4.0, dtype=F64).view(1, 4, 1, 1))
    for mode in ("parallel", "recurrent"):
        o, final = softmax_attention(
            q, k, v, window=3, n_sink=1, initial_state=cache, output_final_state=True, mode=mode
        )
        assert o[0, :, 0, 0].tolist() == pytest.approx([(0 + 2 + 3 + 4) / 4, (0 + 3 + 4 + 5) / 4], abs=1e-15)
        assert final.v[0, :, 0, 0].tolist() == [0.0, 4.0, 5.0]  # the sink + the last W − 1


def test_moe_equals_transformers_qwen2_moe_block_and_its_aux_loss():
    """Routing (softmax, top-k, optional renormalisation), SwiGLU experts, gated shared expert;
    ``transformers``' ``load_balancing_loss_func`` is ``k`` times ``L_aux`` (module docstring)."""
    tr = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import (
        Qwen2MoeSparseMoeBlock,
        load_balancing_loss_func,
    )

    d, E, k, Hh, Hs = 16, 6, 2, 12, 10
    for norm in (False, True):
        cfg = tr.Qwen2MoeConfig(
            hidden_size=d,
            num_experts=E,
            num_experts_per_tok=k,
            moe_intermediate_size=Hh,
            shared_expert_intermediate_size=Hs,
            norm_topk_prob=norm,
        )
        torch.manual_seed(0)
        hf = Qwen2MoeSparseMoeBlock(cfg).double()
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.5)
        m = MoE(d, E, k, expert_hidden=Hh, shared_expert_hidden=Hs, shared_expert_gate=True)
        m = m.double()
        m.norm_topk_prob = norm
        with torch.no_grad():
            m.router.weight.copy_(hf.gate.weight)
            m.w_in.copy_(hf.experts.gate_up_proj)
            m.w_out.copy_(hf.experts.down_proj)
            se = hf.shared_expert
            m.shared_expert.w_in.weight.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
            m.shared_expert.w_out.weight.copy_(se.down_proj.weight)
            m.shared_gate.weight.copy_(hf.shared_expert_gate.weight)
            x = torch.randn(2, 5, d, dtype=F64)
            want = hf(x)  # its router's softmax runs in float32
            torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-5)
            lb = load_balancing_loss_func((x.reshape(-1, d) @ hf.gate.weight.T,), E, k)
            assert float(lb) == pytest.approx(k * float(m.last_aux_loss), rel=1e-6)


def test_aux_loss_can_fall_below_one():
    """``L_aux = E Σ f_e P_e`` is 1 when ``f`` or ``P`` is uniform, but not bounded below by 1
    (the docstring said "its minimum value 1"): ``f`` counts choices, ``P`` averages scores. Three
    tokens with scores (0.51, 0.49), (0.51, 0.49), (0, 1): ``f = (2/3, 1/3)``,
    ``P = (0.34, 0.66)``, ``L = 2 (0.34 · 2/3 + 0.66 / 3) ≈ 0.893``."""
    m = MoE(4, n_experts=2, top_k=1).double()
    p = torch.tensor([[0.51, 0.49], [0.51, 0.49], [1e-12, 1 - 1e-12]], dtype=F64)
    h = _force(m.hook_router_logits, p.log()[None])
    m(torch.randn(1, 3, 4, dtype=F64))
    h.remove()
    P = p.mean(0)
    want = 2 * (2 / 3 * P[0] + 1 / 3 * P[1])
    assert float(m.last_aux_loss) == pytest.approx(float(want), rel=1e-12)
    assert float(m.last_aux_loss) < 0.9


def test_yarn_temperature_equals_transformers_and_the_ramp_differs_as_documented():
    """``attention_factor = 0.1 ln s + 1`` equals ``transformers``'; the frequencies equal it
    outside the ramp (``r > β``: kept; ``r < α``: divided by ``s``) and, inside, mnemo follows the
    paper's ramp linear in ``r`` while ``transformers`` is linear in the dimension index (the
    documented deviation; ``h`` between ``θ/s`` and ``θ`` in both)."""
    tr = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    L, s, D = 4096, 4.0, 128
    rp = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L, "rope_theta": 10000.0}
    cfg = tr.LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, rope_parameters=rp)
    hf = LlamaRotaryEmbedding(cfg)
    m = RotaryEmbedding(D, scaling={k: v for k, v in rp.items() if k != "rope_theta"})
    assert m.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-15)
    theta = m.base_inv_freq.double()
    r = L * theta / (2 * math.pi)
    outside = (r > 32) | (r < 1)
    # transformers' ramp spans whole dimensions (floor/ceil): compare where both are at an end
    hf_ratio = hf.inv_freq.double() / theta
    hf_ends = ((hf_ratio - 1).abs() < 1e-6) | ((hf_ratio * s - 1).abs() < 1e-6)
    ends = outside & hf_ends
    assert int(ends.sum()) >= 35
    torch.testing.assert_close(m.inv_freq[ends], hf.inv_freq[ends], rtol=1e-6, atol=0)
    inside = ~outside
    assert (m.inv_freq[inside] >= theta[inside].float() / s * (1 - 1e-6)).all()
    assert (m.inv_freq[inside] <= theta[inside].float() * (1 + 1e-6)).all()
    assert ((m.inv_freq - hf.inv_freq).abs() / hf.inv_freq).max() > 0.2  # not interchangeable


@pytest.mark.parametrize("hidden", [0, -3, 2.5, True])
def test_swiglu_refuses_a_bad_hidden_width(hidden):
    """``hidden=0`` silently became the default width (``0 or swiglu_hidden(d)``) and a negative one
    failed inside ``nn.Linear`` without naming the argument."""
    with pytest.raises(ValueError, match=rf"hidden: expected None or an int >= 1, got {hidden!r}"):
        SwiGLU(8, hidden)

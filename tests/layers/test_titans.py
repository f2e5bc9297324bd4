"""Titans layers: the LMM for several specs, MAC / MAG / MAL — forms, streaming, decoding, MAC order."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import NeuralMemory, TitansMAC, TitansMAG, TitansMAL
from mnemo.memory import neural_memory
from mnemo.memory.engine import memory_apply
from tests.helpers import assert_close, assert_directional_derivatives, prefill_then_tokens

D = 32
TOL = 1e-10
SMALL = dict(n_heads=2, expansion=2.0)

CASES = [
    ("lmm_titans", lambda: NeuralMemory(D, **SMALL, chunk_size=4, persistent_tokens=2)),
    ("lmm_moneta", lambda: NeuralMemory(D, **SMALL, spec="moneta", chunk_size=4)),
    ("lmm_yaad", lambda: NeuralMemory(D, **SMALL, spec="yaad", chunk_size=4)),
    ("lmm_memora", lambda: NeuralMemory(D, **SMALL, spec="memora", chunk_size=4)),
    ("lmm_ttt_linear", lambda: NeuralMemory(D, n_heads=2, spec="ttt_linear", chunk_size=4)),
    ("lmm_gated_deltanet", lambda: NeuralMemory(D, n_heads=2, spec="gated_deltanet")),
    ("mag", lambda: TitansMAG(D, **SMALL, window=5, persistent_tokens=2, chunk_size=4)),
    ("mal", lambda: TitansMAL(D, **SMALL, window=5, persistent_tokens=2, chunk_size=4)),
    ("mac", lambda: TitansMAC(D, **SMALL, segment=4, persistent_tokens=2)),
]
IDS = [c[0] for c in CASES]


def _make(ctor):
    torch.manual_seed(0)
    m = ctor().double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _x(T, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name, ctor", CASES, ids=IDS)
def test_chunk_equals_recurrent_reference(name, ctor):
    m = _make(ctor)
    x = _x(14)
    assert_close(m(x)[0], m(x, mode="recurrent")[0], TOL, what=name)


@pytest.mark.parametrize("name, ctor", CASES, ids=IDS)
@pytest.mark.parametrize("cuts", [(1,), (3,), (5, 6), (3, 4, 9)])
def test_streaming_equals_full(name, ctor, cuts):
    m = _make(ctor)
    x = _x(14)
    full, _ = m(x)
    outs, s, a = [], None, 0
    for b in (*cuts, 14):
        y, s = m(x[:, a:b], s)
        outs.append(y)
        a = b
    assert_close(torch.cat(outs, 1), full, TOL, what=f"{name} cuts {cuts}")


@pytest.mark.parametrize("name, ctor", CASES, ids=IDS)
def test_token_by_token_decoding_equals_full(name, ctor):
    m = _make(ctor)
    x = _x(10)
    full, _ = m(x)
    assert_close(prefill_then_tokens(m, x, 2), full, TOL, what=name)


@pytest.mark.parametrize("name, ctor", CASES, ids=IDS)
def test_gradients_reach_every_parameter(name, ctor):
    m = _make(ctor)
    x = _x(10)
    y, _ = m(x)
    y.square().sum().backward()
    for pname, p in m.named_parameters():
        assert p.grad is not None, pname
        assert p.grad.abs().sum() > 0, f"{name}: no gradient reaches {pname}"
    assert_directional_derivatives(m, x, name)


def test_mac_order_on_one_segment():
    """One segment of 3 tokens, recomputed by hand from the module's parts with explicit formulas:
    read before (initial weights) -> attention over [persistent | h | x] with an explicit causal
    mask -> memory written with y -> output y * sigmoid(read after write)."""
    torch.manual_seed(0)
    m = TitansMAC(8, n_heads=1, segment=4, persistent_tokens=2, expansion=1.0).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    out, _ = m(x)

    mem, att = m.memory, m.attn.inner
    # 1. read before: the learned initial weights, queries of x, no write
    q, _, _, gate, _ = mem.qkv(x, None)
    W0 = [w[None] for w in mem.init_weights]
    r, _, _ = memory_apply(mem.spec, W0, q.transpose(1, 2))
    h = mem.read_out(r.transpose(1, 2), gate)
    # 2. attention with explicit scores; positions: x and h at 0..2, persistent at 0..1
    rope = att.rotary

    def keys(z, n):
        k, v = att.kv_proj(z).chunk(2, -1)
        return rope(k.view(1, n, 1, 8), 0)[:, :, 0], v

    qa = rope(att.q_proj(x).view(1, 3, 1, 8), 0)[:, :, 0]
    kp, vp = keys(m.attn.persistent[None], 2)
    kh, vh = keys(h, 3)
    kx, vx = keys(x, 3)
    K_all, V_all = torch.cat([kp, kh, kx], 1), torch.cat([vp, vh, vx], 1)
    causal = torch.ones(3, 3).tril().bool()
    allowed = torch.cat([torch.ones(3, 2).bool(), causal, causal], 1)
    scores = (qa @ K_all.transpose(-1, -2)) / 8**0.5
    y = att.o_proj(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ V_all)
    # 3. memory written with y, read after each write (the engine's reference loop)
    qy, ky, vy, gy, _ = mem.qkv(y, None)
    theta, g, eta, _ = mem._gates(y)
    o, _ = neural_memory(
        mem.spec,
        qy,
        ky,
        vy,
        theta,
        g=g,
        eta=eta,
        initial_state=mem.initial_state(1).memory_state(),
        mode="recurrent",
    )
    mread = mem.read_out(o, gy)
    # 4. gate
    assert_close(out, m.o_proj(y * torch.sigmoid(mread)), 1e-12)


def test_mac_attention_is_segment_local_and_memory_carries_the_past():
    m = _make(lambda: TitansMAC(D, **SMALL, segment=4, persistent_tokens=2, retention="none"))
    x = _x(12)
    full, _ = m(x)
    x2 = x.clone()
    x2[:, 0] += 1.0  # change the first token
    changed, _ = m(x2)
    assert not torch.allclose(full[:, 8:], changed[:, 8:])  # still visible two segments later (memory)
    m.memory.spec = m.memory.spec.replace(max_lr=1e-30)
    m.memory.max_lr = 1e-30  # no writes (and no decay): the past beyond the segment is gone
    a, _ = m(x)
    b, _ = m(x2)
    assert_close(a[:, 8:], b[:, 8:], 1e-12)  # (the short conv reaches 3 tokens into the next segment)


def test_persistent_tokens_are_a_prefix_of_the_stream():
    m = _make(lambda: NeuralMemory(D, **SMALL, chunk_size=4, persistent_tokens=3))
    x = _x(6)
    y, s = m(x)
    assert y.shape == (2, 6, D) and s.offset == 6 and s.position == 9
    m.persistent.data.zero_()
    y0, _ = m(x)
    assert not torch.allclose(y, y0)


def test_state_size_counts_fast_weights():
    m = NeuralMemory(D, n_heads=2, expansion=2.0)
    per_head = 16 * 32 + 32 * 16  # two layers of the MLP memory, head_dim 16, hidden 32
    assert m.state_size_bytes(1) == 2 * per_head * 3 * 4 + 3 * D * 3 * 4
    _, s = m(torch.randn(1, 5, D))
    assert len(s.weights) == 2 and s.momentum is not None


@pytest.mark.parametrize("name, ctor", [c for c in CASES if c[0] in ("mag", "mal")], ids=["mag", "mal"])
def test_blockwise_window_path_equals_dense(name, ctor, monkeypatch):
    import mnemo.layers.titans_architectures as titans

    m = _make(ctor)
    x = _x(14)
    dense, _ = m(x)
    monkeypatch.setattr(titans, "WINDOW_BLOCK", 3)
    blocked, _ = m(x)
    assert_close(blocked, dense, TOL)

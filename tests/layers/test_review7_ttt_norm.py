"""TTT's inner layer norm with a learned per-head scale γ and shift β (Sun et al. 2024, §2.7:
``f(x) = x + LN(f_res(x))``; the authors' code, ttt-lm-pytorch / ttt-lm-jax, gives the LN a
``ttt_norm_weight`` / ``ttt_norm_bias`` of shape ``[H, D]``, init 1 / 0, and takes the inner loss
through it). ``NeuralMemory(inner_norm_affine=...)``, on by default for the TTT family."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.titans import NeuralMemory
from mnemo.layers.titans_architectures import TitansMAC
from mnemo.memory import neural_memory, preset
from mnemo.memory.state import init_state

D64 = torch.float64


def _inputs(B, T, H, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=D64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=D64), dim=-1)
    v = torch.randn(B, T, H, K, generator=g, dtype=D64)
    theta = 0.2 + 0.6 * torch.rand(B, T, H, generator=g, dtype=D64)
    return q, k, v, theta, g


def _weights(spec, B, H, K, g):
    return [0.3 * torch.randn(B, H, i, o, generator=g, dtype=D64) for i, o in spec.layer_dims(K, K)]


def _affine(H, K, g):
    return 1.0 + 0.5 * torch.randn(H, K, generator=g, dtype=D64), 0.3 * torch.randn(
        H, K, generator=g, dtype=D64
    )


# ---- the hand loop, written from the equations -------------------------------------------------


def _hand_f(spec, W, x, gamma, beta):
    """``f(x) = x + γ ⊙ LN(f_res(x)) + β`` for one token ``x [B, H, K]``, weights ``[B, H, in, out]``;
    LN with the biased variance and eps = 1e-5."""
    h = x
    for i, w in enumerate(W):
        h = torch.einsum("bhi,bhio->bho", h, w)
        if i < len(W) - 1:
            h = F.gelu(h)
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    ln = (h - mu) / torch.sqrt(var + 1e-5)
    return x + gamma * ln + beta


def _hand_loop(spec, W, q, k, v, theta, gamma, beta):
    """Mini-batch GD of TTT: at each chunk start the anchor is the current weights; token t steps
    with ``−θ_t ∇_W ½‖f_{W}(k_t) − v_t‖²`` at the anchor (torch.autograd), then reads
    ``f_{W_t}(q_t)``."""
    C = spec.chunk_size
    W = [w.clone() for w in W]
    outs = []
    anchor = None
    for t in range(q.shape[1]):
        if t % C == 0:
            anchor = [w.clone() for w in W]
        Wa = [a.detach().requires_grad_(True) for a in anchor]
        with torch.enable_grad():
            e = _hand_f(spec, Wa, k[:, t], gamma, beta) - v[:, t]
            loss = 0.5 * (e * e).sum()  # heads and batch rows are independent: one sum
            G = torch.autograd.grad(loss, Wa)
        W = [w - theta[:, t, :, None, None] * gi for w, gi in zip(W, G)]
        outs.append(_hand_f(spec, W, q[:, t], gamma, beta))
    return torch.stack(outs, 1), W


SPECS = [
    preset("ttt_linear", chunk_size=4),
    preset("ttt_mlp", chunk_size=3, expansion=2.0),
]


# ---- (1) γ = 1, β = 0 is the parameter-free norm -----------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=["linear", "mlp"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_unit_affine_equals_parameter_free_norm(spec, mode):
    B, T, H, K = 2, 7, 2, 4
    q, k, v, theta, g = _inputs(B, T, H, K)
    st = init_state(spec, _weights(spec, B, H, K, g))
    ones, zeros = torch.ones(H, K, dtype=D64), torch.zeros(H, K, dtype=D64)
    o0, s0 = neural_memory(spec, q, k, v, theta, initial_state=st, output_final_state=True, mode=mode)
    o1, s1 = neural_memory(
        spec, q, k, v, theta, initial_state=st, output_final_state=True, mode=mode,
        norm_weight=ones, norm_bias=zeros,
    )  # fmt: skip
    torch.testing.assert_close(o1, o0, atol=1e-12, rtol=0)
    for a, b in zip(s1.weights, s0.weights):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_layer_with_unit_affine_equals_layer_without():
    torch.manual_seed(0)
    new = NeuralMemory(16, n_heads=2, spec="ttt_mlp", chunk_size=3).double()
    old = NeuralMemory(16, n_heads=2, spec="ttt_mlp", chunk_size=3, inner_norm_affine=False).double()
    assert old.inner_norm_weight is None and new.inner_norm_weight is not None
    new.load_state_dict(old.state_dict())  # (old dict: γ, β filled with 1, 0)
    x = torch.randn(2, 8, 16, dtype=D64)
    torch.testing.assert_close(new(x)[0], old(x)[0], atol=1e-12, rtol=0)


# ---- (2) random γ, β: chunk == recurrent == the hand loop, across a split ----------------------


@pytest.mark.parametrize("spec", SPECS, ids=["linear", "mlp"])
def test_random_affine_chunk_recurrent_and_hand_loop_across_split(spec):
    B, T, H, K = 2, 11, 2, 4  # T not a multiple of the chunk; the split at 5 is mid-chunk
    q, k, v, theta, g = _inputs(B, T, H, K, seed=1)
    W0 = _weights(spec, B, H, K, g)
    gamma, beta = _affine(H, K, g)
    want, W_end = _hand_loop(spec, W0, q, k, v, theta, gamma, beta)
    for mode in ("chunk", "recurrent"):
        st = init_state(spec, W0)
        outs = []
        for a, b in ((0, 5), (5, T)):
            o, st = neural_memory(
                spec, q[:, a:b], k[:, a:b], v[:, a:b], theta[:, a:b], initial_state=st,
                output_final_state=True, mode=mode, norm_weight=gamma, norm_bias=beta,
            )  # fmt: skip
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, 1), want, atol=1e-10, rtol=0, msg=mode)
        for a, b in zip(st.weights, W_end):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=mode)
    # γ, β matter: the parameter-free norm gives another read
    o_plain, _ = neural_memory(spec, q, k, v, theta, initial_state=init_state(spec, W0))
    assert (o_plain - want).abs().max() > 1e-2


def test_affine_with_elastic_net_and_momentum_chunk_equals_recurrent():
    """The other paths of the chunk form (materialised read, the elastic-net scan) take γ, β too."""
    B, T, H, K = 1, 5, 2, 3
    q, k, v, theta, g = _inputs(B, T, H, K, seed=2)
    gamma, beta = _affine(H, K, g)
    gate = -0.1 * torch.rand(B, T, H, generator=g, dtype=D64)
    eta = 0.5 * torch.rand(B, T, H, generator=g, dtype=D64)
    for spec, kw in (
        (preset("ttt_linear", chunk_size=3, retention="elastic_net", l1=0.05), dict(g=gate)),
        (preset("ttt_linear", chunk_size=3, retention="lq", q=3.0), dict(g=gate)),
        (preset("titans", chunk_size=3, expansion=2.0), dict(g=gate, eta=eta)),
    ):
        st = init_state(spec, _weights(spec, B, H, K, g))
        oc, _ = neural_memory(spec, q, k, v, theta, initial_state=st, norm_weight=gamma, norm_bias=beta, **kw)
        orf, _ = neural_memory(
            spec, q, k, v, theta, initial_state=st, mode="recurrent", norm_weight=gamma, norm_bias=beta, **kw
        )
        o0, _ = neural_memory(spec, q, k, v, theta, initial_state=st, **kw)
        torch.testing.assert_close(oc, orf, atol=1e-10, rtol=0, msg=spec.retention)
        assert (oc - o0).abs().max() > 1e-3


# ---- (3) gradcheck w.r.t. γ and β --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gradcheck_gamma_beta(mode):
    spec = preset("ttt_mlp", chunk_size=2, expansion=1.0)
    B, T, H, K = 1, 5, 1, 3
    q, k, v, theta, g = _inputs(B, T, H, K, seed=3)
    st = init_state(spec, _weights(spec, B, H, K, g))
    gamma, beta = _affine(H, K, g)

    def f(gm, bt):
        return neural_memory(spec, q, k, v, theta, initial_state=st, mode=mode, norm_weight=gm, norm_bias=bt)[
            0
        ]

    assert torch.autograd.gradcheck(
        f, (gamma.requires_grad_(), beta.requires_grad_()), atol=1e-7, fast_mode=True
    )


# ---- (4) old state dicts ------------------------------------------------------------------------


def test_old_state_dict_loads_strict_with_identical_outputs_and_partial_load_keeps_affine():
    torch.manual_seed(1)
    old = NeuralMemory(16, n_heads=2, spec="ttt_linear", chunk_size=4, inner_norm_affine=False).double()
    sd = old.state_dict()
    assert not any("inner_norm" in name for name in sd)
    new = NeuralMemory(16, n_heads=2, spec="ttt_linear", chunk_size=4).double()
    with torch.no_grad():  # not the init: the loaded dict must set them
        new.inner_norm_weight.fill_(3.0)
        new.inner_norm_bias.fill_(-1.0)
    res = new.load_state_dict(sd, strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    assert torch.equal(new.inner_norm_weight, torch.ones(16, dtype=D64))
    assert torch.equal(new.inner_norm_bias, torch.zeros(16, dtype=D64))
    x = torch.randn(1, 9, 16, dtype=D64)
    torch.testing.assert_close(new(x)[0], old(x)[0], atol=1e-12, rtol=0)
    # a partial load (strict=False) without the memory's weights leaves γ, β as they are
    with torch.no_grad():
        new.inner_norm_weight.fill_(2.0)
    new.load_state_dict({"o_proj.weight": sd["o_proj.weight"]}, strict=False)
    assert torch.equal(new.inner_norm_weight, torch.full((16,), 2.0, dtype=D64))


def test_old_nested_mac_state_dict_loads():
    torch.manual_seed(2)
    kw = dict(n_heads=2, segment=4, persistent_tokens=1, spec="ttt_linear")
    old = TitansMAC(16, inner_norm_affine=False, **kw).double()
    new = TitansMAC(16, **kw).double()
    new.load_state_dict(old.state_dict(), strict=True)
    x = torch.randn(1, 10, 16, dtype=D64)
    torch.testing.assert_close(new(x)[0], old(x)[0], atol=1e-12, rtol=0)


# ---- MAC's read-before and the maps take γ, β --------------------------------------------------


def test_mac_read_before_uses_affine():
    torch.manual_seed(3)
    mac = TitansMAC(16, n_heads=2, segment=4, persistent_tokens=0, spec="ttt_linear").double()
    m = mac.memory
    with torch.no_grad():
        m.inner_norm_weight.normal_(1.0, 0.5)
        m.inner_norm_bias.normal_(0.0, 0.3)
    x = torch.randn(2, 3, 16, dtype=D64)
    st = m.initial_state(2)
    h, _ = mac.read_before(x, st, None)
    q, _, _, gate, _ = m.qkv(x, None)
    gamma, beta = m.inner_norm_affine()
    W = st.anchor[0]  # [B, H, D, D]
    z = torch.einsum("bthi,bhio->btho", q, W)
    want = q + gamma * F.layer_norm(z, (16 // 2,), eps=1e-5) + beta
    torch.testing.assert_close(h, m.read_out(want, gate), atol=1e-12, rtol=0)


def test_attribution_reads_with_affine():
    """The map's output + baseline is the layer's own read (hook_o) with learned γ, β."""
    torch.manual_seed(4)
    m = NeuralMemory(8, n_heads=2, spec="ttt_linear", chunk_size=2).double()
    with torch.no_grad():
        m.inner_norm_weight.normal_(1.0, 0.5)
        m.inner_norm_bias.normal_(0.0, 0.3)
    acts = {}
    hooks = [
        getattr(m, n).register_forward_hook(lambda mod, i, o, n=n: acts.__setitem__(n, o.detach()))
        for n in ("hook_q", "hook_k", "hook_v", "hook_theta", "hook_o")
    ]
    m(torch.randn(1, 5, 8, dtype=D64))
    for h in hooks:
        h.remove()
    a = m.attribution(acts, steps=1)
    torch.testing.assert_close(a.output + a.baseline, acts["hook_o"], atol=1e-12, rtol=0)


# ---- (5) options, defaults, training -----------------------------------------------------------


def test_defaults_and_argument_errors():
    assert NeuralMemory(16, n_heads=2, spec="ttt_linear").inner_norm_weight.shape == (16,)
    assert NeuralMemory(16, n_heads=2, spec="ttt_mlp").inner_norm_bias.shape == (16,)
    for other in ("titans", "moneta", "deltanet"):  # (titans has a norm, but is not TTT)
        assert NeuralMemory(16, n_heads=2, spec=other).inner_norm_weight is None
    assert NeuralMemory(16, n_heads=2, spec="titans", inner_norm_affine=True).inner_norm_weight is not None
    with pytest.raises(ValueError, match="inner_norm_affine.*norm=False"):
        NeuralMemory(16, n_heads=2, spec="deltanet", inner_norm_affine=True)
    with pytest.raises(ValueError, match="inner_norm_affine: expected None or a bool, got 'False'"):
        NeuralMemory(16, n_heads=2, spec="ttt_linear", inner_norm_affine="False")
    q, k, v, theta, _ = _inputs(1, 3, 2, 4)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[H, V\] = \[2, 4\], got \[4\]"):
        neural_memory(preset("ttt_linear"), q, k, v, theta, norm_weight=torch.ones(4, dtype=D64))
    with pytest.raises(ValueError, match="norm_bias was given but the spec has no inner norm"):
        neural_memory(preset("deltanet"), q, k, v, theta, norm_bias=torch.zeros(2, 4, dtype=D64))


@pytest.mark.parametrize("name", ["ttt_linear", "ttt_mlp"])
def test_every_parameter_gets_a_gradient_in_one_training_step(name):
    from mnemo.models import LanguageModel
    from mnemo.models.registry import build_config

    torch.manual_seed(5)
    model = LanguageModel(build_config(name, vocab_size=11, d_model=16, n_layers=1)).double()
    ids = torch.randint(0, 11, (2, 9))
    logits = model(ids)
    logits = logits[0] if isinstance(logits, tuple) else logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("inner_norm_weight") for n in names)
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n

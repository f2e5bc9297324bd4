"""Each mixer layer against a token loop written from its paper's equations with the layer's own
weights (float64, tiny sizes): projections, short conv, RoPE, feature maps, gates, the memory
recurrence, norms and read-out. Run in two calls with the returned state, so offsets and conv
tails count too. Plus the documented defaults and initialisations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import (
    MIXERS,
    Attention,
    DeltaNet,
    GatedLinearAttention,
    LinearAttention,
    Mamba,
    Mamba2,
    RMSNorm,
    RotaryEmbedding,
    ShortConvolution,
    SwiGLU,
)
from mnemo.layers.mlp import swiglu_hidden
from tests.helpers import assert_close

D = 8
T = 7
SPLIT = 3  # first call: tokens 0..2, second call: 3..6 with the returned state


# --------------------------------------------------------------------------- hand references
def lin(x, layer):
    """A projection the paper writes with a bias (β, gates, Δ): ``W x + b``."""
    return x @ layer.weight.T + layer.bias


def mm(x, layer):
    """A bias-free projection (q/k/v, in/out projections, MLP weights): ``W x``."""
    return x @ layer.weight.T


def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def conv_silu(x, conv):
    """y_t = silu(Σ_i w_i x_{t−W+1+i} + b), zeros before the first token."""
    W = conv.kernel_size
    w = conv.weight[:, 0, :]  # [C, W]
    xp = torch.cat([x.new_zeros(x.shape[0], W - 1, x.shape[2]), x], 1)
    ys = []
    for t in range(x.shape[1]):
        acc = sum(w[:, i] * xp[:, t + i] for i in range(W))
        ys.append(acc + (conv.bias if conv.bias is not None else 0.0))
    return F.silu(torch.stack(ys, 1))


def rope(x, theta=10000.0):
    """Rotate pair (x_i, x_{i+d/2}) by pos · theta^(−2i/d); x: [B, T, H, d]."""
    d = x.shape[-1]
    out = x.clone()
    for t in range(x.shape[1]):
        for i in range(d // 2):
            a = t * theta ** (-2 * i / d)
            x1, x2 = x[:, t, :, i], x[:, t, :, i + d // 2]
            out[:, t, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[:, t, :, i + d // 2] = x1 * math.sin(a) + x2 * math.cos(a)
    return out


def heads(x, H):
    return x.reshape(*x.shape[:2], H, -1)


def merge(x):
    return x.reshape(*x.shape[:2], -1)


# --------------------------------------------------------------------------- helpers
def _perturbed(m, seed=0):
    torch.manual_seed(seed)
    m = m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def _x(seed=1, B=2):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _two_calls(m, x):
    with torch.no_grad():
        y1, s = m(x[:, :SPLIT])
        y2, _ = m(x[:, SPLIT:], s)
    return torch.cat([y1, y2], 1)


# --------------------------------------------------------------------------- components
def test_rmsnorm_rotary_conv_and_swiglu_match_their_formulas():
    x = _x()
    n = _perturbed(RMSNorm(D, eps=1e-3))
    assert_close(n(x), rms(x, n.weight, 1e-3), 1e-12)
    q = torch.randn(2, T, 3, 6, dtype=torch.float64)
    # (the module keeps its frequencies in float32: agreement to ~1e-8)
    assert_close(RotaryEmbedding(6)(q), rope(q), 1e-7)
    shifted = torch.cat([q.new_zeros(2, 2, 3, 6), q], 1)  # positions 2.. of a longer sequence
    assert_close(RotaryEmbedding(6, theta=100.0)(q, offset=2), rope(shifted, 100.0)[:, 2:], 1e-7)
    c = _perturbed(ShortConvolution(D, 3))
    y, tail = c(x)
    assert_close(y, conv_silu(x, c), 1e-12)
    assert torch.equal(tail, x[:, -2:].transpose(1, 2))  # the last W − 1 inputs, [B, C, W − 1]
    y1, s = c(x[:, :2])
    y2, _ = c(x[:, 2:], s)
    assert_close(torch.cat([y1, y2], 1), conv_silu(x, c), 1e-12)
    mlp = _perturbed(SwiGLU(D, hidden=12))
    gate, up = mm(x, mlp.w_in).chunk(2, -1)
    assert_close(mlp(x), (F.silu(gate) * up) @ mlp.w_out.weight.T, 1e-12)
    assert swiglu_hidden(48) == 128 and swiglu_hidden(64) == 192  # 8/3 d rounded up to 32


def test_swiglu_and_projections_have_no_bias():
    mlp = SwiGLU(D)
    assert mlp(torch.zeros(3, D)).abs().max() == 0
    assert sum(p.numel() for p in mlp.parameters()) == 3 * D * swiglu_hidden(D)


# --------------------------------------------------------------------------- mixers
def ref_attention(m: Attention, x):
    H, Hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    q = heads(mm(x, m.q_proj), H)
    kv = mm(x, m.kv_proj)
    k, v = heads(kv[..., : Hkv * hd], Hkv), heads(kv[..., Hkv * hd :], Hkv)
    q, k = rope(q), rope(k)
    o = torch.zeros_like(q)
    for h in range(H):
        g = h // (H // Hkv)
        for i in range(x.shape[1]):
            lo = 0 if m.window is None else max(0, i - m.window + 1)
            s = torch.einsum("bd,bjd->bj", q[:, i, h], k[:, lo : i + 1, g]) / math.sqrt(hd)
            o[:, i, h] = torch.einsum("bj,bjd->bd", s.softmax(-1), v[:, lo : i + 1, g])
    return mm(merge(o), m.o_proj)


def ref_linear_attention(m: LinearAttention, x, eps=1e-6):
    H, K = m.n_heads, m.key_dim
    q, k, v = mm(x, m.qkv_proj).split([H * K, H * K, H * m.value_dim], -1)
    q, k, v = heads(q, H), heads(k, H), heads(v, H)
    phi = m.feature_map
    fq, fk = phi(q * K**-0.5), phi(k)
    S = x.new_zeros(x.shape[0], H, fq.shape[-1], m.value_dim)
    z = x.new_zeros(x.shape[0], H, fq.shape[-1])
    outs = []
    for t in range(x.shape[1]):
        S = S + fk[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + fk[:, t]
        num = torch.einsum("bhf,bhfv->bhv", fq[:, t], S)
        outs.append(num / ((fq[:, t] * z).sum(-1, keepdim=True) + eps) if m.normalize else num)
    o = torch.stack(outs, 1)
    if m.norm is not None:
        o = rms(o, m.norm.weight, m.norm.eps)
    return mm(merge(o), m.o_proj)


def ref_gla(m: GatedLinearAttention, x):
    H, K, V = m.n_heads, m.key_dim, m.value_dim
    qkv = mm(x, m.qkv_proj)
    if m.conv is not None:
        qkv = conv_silu(qkv, m.conv)
    q, k, v = qkv.split([H * K, H * K, H * V], -1)
    q, k, v = heads(q, H), heads(k, H), heads(v, H)
    if m.rotary is not None:
        q, k = rope(q), rope(k)
    if m.gate == "retnet":
        gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=x.dtype)
        g = gamma.log()[None, None, :, None].expand(*x.shape[:2], H, K)
    elif m.gate == "gla":  # per channel: logsigmoid(W2 W1 x + b) / τ
        g = heads(F.logsigmoid(lin(mm(x, m.gate_proj[0]), m.gate_proj[1])) / m.gate_normalizer, H)
    else:  # one per head
        g = (F.logsigmoid(lin(x, m.gate_proj)) / m.gate_normalizer)[..., None].expand(*x.shape[:2], H, K)
    S = x.new_zeros(x.shape[0], H, K, V)
    outs = []
    for t in range(x.shape[1]):
        S = g[:, t, :, :, None].exp() * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S))
    o = rms(torch.stack(outs, 1), m.norm.weight, m.norm.eps) * F.silu(heads(mm(x, m.out_gate), H))
    return mm(merge(o), m.o_proj)


def ref_deltanet(m: DeltaNet, x):
    H, d = m.n_heads, m.head_dim
    qkv = mm(x, m.qkv_proj)
    qkv = conv_silu(qkv, m.conv) if m.conv is not None else F.silu(qkv)
    q, k, v = (heads(t, H) for t in qkv.split([H * d] * 3, -1))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(lin(x, m.beta_proj))
    if m.gated:  # log α = −exp(A_log) · softplus(W_a x + dt_bias)
        alpha = torch.exp(-m.A_log.exp() * F.softplus(mm(x, m.a_proj) + m.dt_bias))
    else:
        alpha = torch.ones_like(beta)
    S = x.new_zeros(x.shape[0], H, d, d)
    eye = torch.eye(d, dtype=x.dtype)
    outs = []
    for t in range(x.shape[1]):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        S = alpha[:, t, :, None, None] * ((eye - bt * kt[..., :, None] * kt[..., None, :]) @ S)
        S = S + bt * kt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * d**-0.5, S))
    o = rms(torch.stack(outs, 1), m.norm.weight, m.norm.eps)
    if m.g_proj is not None:
        o = o * F.silu(heads(mm(x, m.g_proj), H))
    return mm(merge(o), m.o_proj)


def ref_mamba(m: Mamba, x):
    """Gu & Dao 2023, Alg. 2."""
    u, z = mm(x, m.in_proj).chunk(2, -1)
    u = conv_silu(u, m.conv)
    if m.selective:
        dt, Bm, Cm = mm(u, m.x_proj).split([m.dt_rank, m.d_state, m.d_state], -1)
    else:
        dt = m.dt_lti.expand(*x.shape[:2], -1)
        Bm, Cm = m.B_lti.expand(*x.shape[:2], -1), m.C_lti.expand(*x.shape[:2], -1)
    delta = F.softplus(lin(dt, m.dt_proj))  # [B, T, Di]
    A = -m.A_log.exp()  # [Di, N]
    h = x.new_zeros(x.shape[0], m.d_inner, m.d_state)
    ys = []
    for t in range(x.shape[1]):
        h = (
            torch.exp(delta[:, t, :, None] * A) * h
            + delta[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]
        )
        ys.append((h * Cm[:, t, None, :]).sum(-1) + m.D * u[:, t])
    return mm(torch.stack(ys, 1) * F.silu(z), m.o_proj)


def ref_mamba2(m: Mamba2, x):
    """Dao & Gu 2024, §7: scalar-times-identity A per head, B/C shared by groups of heads."""
    G, N, H, P = m.n_groups, m.d_state, m.n_heads, m.head_dim
    z, xBC, dt = mm(x, m.in_proj).split([m.d_inner, m.d_inner + 2 * G * N, H], -1)
    xBC = conv_silu(xBC, m.conv)
    xs, Bm, Cm = xBC.split([m.d_inner, G * N, G * N], -1)
    xs, Bm, Cm = heads(xs, H), heads(Bm, G), heads(Cm, G)
    delta = F.softplus(dt + m.dt_bias)  # [B, T, H]
    A = -m.A_log.exp()
    h = x.new_zeros(x.shape[0], H, N, P)
    ys = []
    for t in range(x.shape[1]):
        grp = torch.arange(H) // (H // G)
        Bt, Ct = Bm[:, t, grp], Cm[:, t, grp]  # [B, H, N]
        h = torch.exp(delta[:, t] * A)[..., None, None] * h
        h = h + Bt[..., :, None] * (delta[:, t, :, None] * xs[:, t])[..., None, :]
        ys.append(torch.einsum("bhnp,bhn->bhp", h, Ct) + m.D[:, None] * xs[:, t])
    y = merge(torch.stack(ys, 1)) * F.silu(z)
    # the gated RMSNorm normalises each group of d_inner / n_groups channels (mamba-ssm's
    # RMSNormGated with group_size = d_inner / ngroups)
    yg = y.unflatten(-1, (G, -1))
    y = (yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + m.norm.eps)).flatten(-2) * m.norm.weight
    return mm(y, m.o_proj)


CASES = {
    "attention_gqa": (lambda: Attention(D, n_heads=4, n_kv_heads=2), ref_attention),
    "attention_window": (lambda: Attention(D, n_heads=2, window=3), ref_attention),
    "linear_attention_elu": (lambda: LinearAttention(D, n_heads=2, chunk_size=2), ref_linear_attention),
    "linear_attention_plain": (
        lambda: LinearAttention(D, n_heads=2, feature_map="relu", normalize=False, output_norm=False),
        ref_linear_attention,
    ),
    "retnet": (lambda: MIXERS["retnet"](D, n_heads=2, chunk_size=2), ref_gla),
    "gla": (lambda: GatedLinearAttention(D, n_heads=2, gate="gla", gate_rank=3, chunk_size=4), ref_gla),
    "gla_conv": (
        lambda: GatedLinearAttention(D, n_heads=2, gate="gla", short_conv=True, conv_size=3),
        ref_gla,
    ),
    "scalar_gate": (lambda: GatedLinearAttention(D, n_heads=2, gate="scalar", chunk_size=4), ref_gla),
    "deltanet": (lambda: DeltaNet(D, n_heads=2, chunk_size=4), ref_deltanet),
    "deltanet_plain": (lambda: DeltaNet(D, n_heads=2, short_conv=False, output_gate=False), ref_deltanet),
    "gated_deltanet": (lambda: DeltaNet(D, n_heads=2, gated=True, chunk_size=2), ref_deltanet),
    "mamba": (lambda: Mamba(D, d_state=3, chunk_size=4), ref_mamba),
    "mamba_lti": (lambda: Mamba(D, d_state=3, selective=False), ref_mamba),
    "mamba2": (lambda: Mamba2(D, d_state=3, head_dim=4, n_groups=2, chunk_size=4), ref_mamba2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mixer_matches_a_hand_loop_of_its_equations(name):
    ctor, ref = CASES[name]
    m = _perturbed(ctor())
    x = _x()
    tol = 1e-7 if getattr(m, "rotary", None) is not None else 1e-10  # RoPE frequencies are float32
    with torch.no_grad():
        expected = ref(m, x)
        assert_close(m(x)[0], expected, tol, what=name)
    assert_close(_two_calls(m, x), expected, tol, what=f"{name} in two calls")


# --------------------------------------------------------------------------- defaults and init
def test_mamba_defaults_and_initialisation():
    m = Mamba(40)
    assert (m.d_state, m.d_inner, m.dt_rank, m.conv.kernel_size) == (16, 80, 3, 4)  # N, 2d, ⌈d/16⌉
    n = torch.arange(1, 17, dtype=torch.float32)
    assert torch.allclose(m.A_log, n.log().expand(80, 16))  # S4D-real: A = −(n + 1)
    assert torch.equal(m.D.data, torch.ones(80))
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    std = m.dt_rank**-0.5
    assert m.dt_proj.weight.abs().max() <= std


def test_mamba2_and_gated_deltanet_defaults_and_initialisation():
    m = Mamba2(64)
    assert (m.d_state, m.d_inner, m.head_dim, m.n_heads, m.n_groups) == (64, 128, 64, 2, 1)
    assert Mamba2(16).head_dim == 32  # clipped to d_inner = 2 · 16
    for mod in (m, DeltaNet(16, n_heads=4, gated=True)):
        A = mod.A_log.exp()
        assert A.min() >= 1.0 and A.max() <= 16.0  # A ~ U[1, 16]
        dt = F.softplus(mod.dt_bias)
        assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert torch.equal(m.D.data, torch.ones(m.n_heads))


def test_attention_defaults_to_four_heads_like_the_other_mixers():
    """``n_heads`` (documented: 4) is the same default in every head-based mixer; at d = 16 the
    default attention has four query and key/value heads of 16 / 4 = 4 channels."""
    import inspect

    for cls in (Attention, LinearAttention, GatedLinearAttention, DeltaNet):
        assert inspect.signature(cls).parameters["n_heads"].default == 4, cls.__name__
    m = Attention(16)
    assert (m.n_heads, m.n_kv_heads, m.head_dim) == (4, 4, 4)
    assert (m.q_proj.out_features, m.kv_proj.out_features) == (16, 2 * 16)


def test_dt_bias_init_is_log_uniform_between_dt_min_and_dt_max():
    """Mamba's Δ init, ``Δ ~ LogUniform[dt_min, dt_max]``: ``u = log(Δ / dt_min) / log(dt_max /
    dt_min)`` is U[0, 1], so its quantiles are their own levels (20 000 draws: a quantile's
    standard error is below 0.004)."""
    from mnemo.layers.delta import init_dt_bias

    dt = F.softplus(init_dt_bias(20000, 1e-3, 0.1, generator=torch.Generator().manual_seed(0)).double())
    u = (dt.log() - math.log(1e-3)) / math.log(0.1 / 1e-3)
    assert u.min() >= -1e-4 and u.max() <= 1 + 1e-4
    for q in (0.05, 0.25, 0.5, 0.75, 0.95):
        assert abs(torch.quantile(u, q).item() - q) < 0.02, q


def test_lti_mamba_starts_its_parameters_standard_normal():
    """``selective=False``: the Δ input, B and C are learned vectors, documented to start
    ``~ N(0, 1)``: mean 0 and standard deviation 1 over 4096 draws (standard error 0.016)."""
    torch.manual_seed(0)
    m = Mamba(4, d_state=4096, selective=False)
    for name in ("B_lti", "C_lti"):
        w = getattr(m, name).detach()
        assert abs(w.mean().item()) < 0.06 and abs(w.std().item() - 1.0) < 0.05, name
    big = Mamba(64, d_state=4, dt_rank=4096, selective=False)  # the Δ input: dt_rank draws
    assert abs(big.dt_lti.mean().item()) < 0.06 and abs(big.dt_lti.std().item() - 1.0) < 0.05


def test_retnet_decays_and_gla_key_value_sizes():
    m = MIXERS["retnet"](16, n_heads=4)
    gamma = torch.tensor([1 - 2.0**-5, 1 - 2.0**-6, 1 - 2.0**-7, 1 - 2.0**-8])
    assert torch.allclose(m.log_decay(torch.zeros(1, 2, 16))[0, 0], gamma.log())
    assert m.rotary is not None and GatedLinearAttention(16, gate="gla").rotary is None
    g = GatedLinearAttention(16, n_heads=2)  # expand_k 0.5, expand_v 1
    assert (g.key_dim, g.value_dim) == (4, 8)


@pytest.mark.parametrize("native", ["1", "0"])
def test_conv_input_gradient_with_frozen_weights(native, monkeypatch):
    """∂/∂x of a frozen short conv (the weights need no gradient) equals the hand formula's, also
    when a graph of the gradient is asked for (the PyTorch backward)."""
    monkeypatch.setenv("MNEMO_NATIVE", native)
    c = _perturbed(ShortConvolution(D, 3)).requires_grad_(False)
    x = _x().requires_grad_(True)
    w = torch.randn(2, T, D, dtype=torch.float64)
    for create_graph in (False, True):
        (g,) = torch.autograd.grad((c(x)[0] * w).sum(), x, create_graph=create_graph)
        (g_ref,) = torch.autograd.grad((conv_silu(x, c) * w).sum(), x)
        assert_close(g, g_ref, 1e-12)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_size_is_the_bytes_of_one_sequences_state(name):
    """``state_size_bytes(seq_len=T)`` (default: one sequence, 4-byte conv tail) is what a float32
    stream of ``T`` tokens leaves in the state (a window keeps its last ``window − 1`` keys)."""
    m = CASES[name][0]()
    with torch.no_grad():
        _, st = m(torch.randn(1, T, D))
    assert m.state_size_bytes(seq_len=T) == _nbytes(st) > 0  # an independent walk over the state
    assert m.state_size_bytes(3, T) == 3 * m.state_size_bytes(seq_len=T)


@pytest.mark.parametrize("name", ["neural_memory", "titans_mac", "titans_mag", "titans_mal"])
def test_titans_state_sizes_default_to_one_sequence(name):
    m = MIXERS[name](D, n_heads=2)
    one = m.state_size_bytes(seq_len=T)
    assert one > 0 and m.state_size_bytes(1, T) == one


def test_titans_mag_gates_attention_with_the_memory():
    """Titans §4.2: o = W_o (RMSNorm(y_attn) ⊙ sigmoid(RMSNorm(y_mem))), both branches on x."""
    from mnemo.layers import TitansMAG

    m = _perturbed(TitansMAG(D, n_heads=2, window=4, persistent_tokens=2))
    x = _x()
    seen = {}
    m.attn.register_forward_hook(lambda mod, args, out: seen.__setitem__("attn", out[0]))
    m.memory.register_forward_hook(lambda mod, args, out: seen.__setitem__("mem", out[0]))
    with torch.no_grad():
        y, _ = m(x)
    gate = torch.sigmoid(rms(seen["mem"], m.norm_mem.weight, m.norm_mem.eps))
    assert_close(y, mm(rms(seen["attn"], m.norm_attn.weight, m.norm_attn.eps) * gate, m.o_proj), 1e-12)


def test_titans_defaults():
    from mnemo.layers import TitansMAC, TitansMAG, TitansMAL

    for cls in (TitansMAC, TitansMAG, TitansMAL):
        assert MIXERS[cls.__name__.lower().replace("titans", "titans_")] is cls
        assert cls(16).attn.persistent.shape == (4, 16)  # four persistent tokens


def test_gla_heads_wider_than_the_value_width_keep_one_value_channel():
    """d_model · expand_v = 2 < n_heads = 4: the per-head sizes are floored at 1 (never 0), so the
    layer still reads its values out; against the hand loop with 1-channel keys and values."""
    m = _perturbed(
        GatedLinearAttention(D, n_heads=4, gate="scalar", expand_k=0.25, expand_v=0.25, chunk_size=4)
    )
    assert (m.key_dim, m.value_dim) == (1, 1)  # ⌊8 · 0.25 / 4⌋ = 0 → 1
    assert m.o_proj.in_features == 4  # one value channel per head
    x = _x()
    with torch.no_grad():
        y, st = m(x)
        expected = ref_gla(m, x)
    assert_close(y, expected, 1e-10)
    assert y.abs().max() > 0.01  # a 0-wide value would read nothing out (y ≡ 0)
    assert st.memory.shape == (2, 4, 1, 1)


def test_registering_another_mixer_under_a_taken_name_is_refused():
    from mnemo.layers.registry import register_mixer

    class First(GatedLinearAttention):
        pass

    class Second(GatedLinearAttention):
        pass

    name = "test_only_taken_name"
    try:
        register_mixer(name, gate="scalar")(First)
        register_mixer(name, gate="scalar")(First)  # the same constructor again: allowed
        assert MIXERS[name].func is First and MIXERS[name].keywords == {"gate": "scalar"}
        with pytest.raises(ValueError, match="already registered"):
            register_mixer(name)(Second)  # another class
        with pytest.raises(ValueError, match="already registered"):
            register_mixer(name, gate="gla")(First)  # the same class with other presets
        assert MIXERS[name].func is First and MIXERS[name].keywords == {"gate": "scalar"}  # kept
        register_mixer(name + "_plain")(Second)
        register_mixer(name + "_plain", Second)  # the direct form, same constructor
        assert MIXERS[name + "_plain"] is Second
    finally:
        MIXERS.pop(name, None)
        MIXERS.pop(name + "_plain", None)


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_a_default_state_has_read_no_tokens(name):
    """A default-constructed state is the state before any token: decoding from it gives the
    stateless call's output, and its offset then counts exactly the tokens read."""
    from mnemo.layers.ssm import Mamba2State, MambaState

    m = _perturbed(Mamba(D, d_state=3) if name == "mamba" else Mamba2(D, d_state=3, head_dim=4))
    fresh = MambaState() if name == "mamba" else Mamba2State()
    assert fresh.offset == 0 and fresh.ssm is None and fresh.conv is None
    x = _x()
    with torch.no_grad():
        y0, s0 = m(x)
        y1, s1 = m(x, fresh)
    assert_close(y1, y0, 1e-12)
    assert s0.offset == s1.offset == T
    assert m.state_spec(2).offset == fresh.offset  # the documented state after 0 tokens


def test_state_spec_defaults_to_one_sequence_before_any_token():
    """The protocol's documented defaults (``Mixer.state_spec``): ``batch_size=1`` (one sequence),
    ``seq_len=0`` (before any token), ``dtype=None`` (the parameters'); every registered mixer's
    override keeps them, so ``state_spec()`` means the same thing on any mixer."""
    import inspect

    from mnemo.layers.base import Mixer

    def defaults(fn):
        params = list(inspect.signature(fn).parameters.values())[1:]  # after self
        return {p.name: p.default for p in params}

    documented = {"batch_size": 1, "seq_len": 0, "dtype": None}
    assert defaults(Mixer.state_spec) == documented
    for name, factory in MIXERS.items():
        cls = getattr(factory, "func", factory)  # a preset is a functools.partial of its class
        assert defaults(cls.state_spec) == documented, name


@pytest.mark.parametrize("name", ["linear_attention", "retnet", "deltanet"])
def test_a_default_matrix_state_has_read_no_tokens(name):
    """``MatrixState()`` is the state before any token (``offset``: tokens consumed so far, 0):
    continuing from it gives the stateless call's output, and the offset then counts exactly the
    tokens read, as ``state_spec`` declares for ``seq_len`` tokens."""
    from mnemo.layers.linear_attention import MatrixState

    m = _perturbed(MIXERS[name](D, n_heads=2))
    fresh = MatrixState()
    assert fresh.offset == 0 and fresh.memory is None and fresh.conv is None
    x = _x()
    with torch.no_grad():
        y0, s0 = m(x)
        y1, s1 = m(x, fresh)
    assert_close(y1, y0, 1e-12)
    assert s0.offset == s1.offset == T
    assert m.state_spec(2).offset == fresh.offset == 0 and m.state_spec(2, T).offset == T


@pytest.mark.parametrize("name", ["titans_mag", "titans_mal", "titans_mac"])
def test_titans_persistent_tokens_start_normal_with_std_0_02(name):
    """The persistent keys' inputs (``_PrefixAttention.persistent``) and the memory's persistent
    prefix (MAG, MAL; MAC's memory has none) are initialised N(0, 0.02²) (documented). 16 × 64 =
    1024 draws per tensor with a fixed seed: the sample std's standard error is 0.02 / √2048 ≈
    4.4e-4 and the mean's 6.3e-4, so the bounds below sit more than 6 standard errors away."""
    torch.manual_seed(0)
    m = MIXERS[name](64, n_heads=4, persistent_tokens=16)
    tensors = [("attention", m.attn.persistent)]
    if name != "titans_mac":
        tensors.append(("memory", m.memory.persistent))
    for what, p in tensors:
        assert p.shape == (16, 64), what
        assert 0.017 < p.std().item() < 0.023, what
        assert abs(p.mean().item()) < 0.004, what


def test_titans_mlp_memory_starts_at_fan_in_scaled_normal_weights():
    """Each ``[in, out]`` layer of an MLP memory's learned initial weights is drawn ``N(0, 1/in)``
    (documented; a matrix memory starts at zero). Per head a 16 → 64 → 16 MLP (the default
    expansion over head_dim 16): at least 1024 draws per layer over the 4 heads, so the sample
    std's standard error is at most 2.2 % of the std and ±15 % is more than 6 standard errors."""
    from mnemo.layers import NeuralMemory

    torch.manual_seed(0)
    m = NeuralMemory(64, n_heads=4, spec="titans")
    assert len(m.init_weights) >= 2  # an MLP memory
    for w in m.init_weights:
        fan_in = w.shape[-2]
        assert w.numel() >= 1024 and abs(w.std().item() * fan_in**0.5 - 1.0) < 0.15, tuple(w.shape)
        assert abs(w.mean().item()) < 6 * fan_in**-0.5 / w.numel() ** 0.5
    matrix = NeuralMemory(64, n_heads=4, spec="deltanet")
    assert all((w == 0).all() for w in matrix.init_weights)

"""Second break-it review: every named memory preset against its paper's update rule written out by
hand (one head, one token at a time, float64, plain tensors, no engine code), in both forms, from an
arbitrary mid-chunk initial state (weights, chunk anchor, momentum, accumulated decay), at odd
lengths; gradients of the hand loop (autograd through the written-out updates) against the engine's.

The papers' own normalisations are used where they differ from the engine's ``½‖e‖²``: Titans
(Behrouz et al. 2024, Eq. 12-14) and TTT write ``ℓ = ‖M(k) − v‖²`` (so ``θ_paper = θ / 2``), Moneta
(Miras Eq. 11) ``ℓ = ‖M(k) − v‖_p^p`` (``θ_paper = θ / p``); Memora is written literally as
``W_t = c · softmax(α_t log W_{t−1} − θ_t ∇ℓ)`` on the weights themselves (not the accumulator).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.memory import PRESETS, MemorySpec, MemoryState, neural_memory, preset
from tests.helpers import assert_close

B, H, K, T = 1, 2, 3, 7
POS0 = 4  # the initial state's position: inside a chunk of 3 (4 % 3 = 1)
TOL = 1e-10
DT = torch.float64
LN_EPS = 1e-5  # the memory's parameter-free layer norm (TTT's x + LN(f(x)))
LQ_EPS = 1e-6  # Moneta's ‖A‖_q is offset by this in the engine (finite gradient at A = 0)


# ------------------------------------------------------------------------------------------------
# the papers' updates, written out for one (batch, head)
# ------------------------------------------------------------------------------------------------


def _mem(spec, Ws, x):
    """``M_W(x)`` for one token: ``x W`` (matrix), ``gelu(x W1) W2`` (MLP), then ``x + LN(·)``."""
    h = x
    for i, W in enumerate(Ws):
        h = h @ W
        if i < len(Ws) - 1:
            h = F.gelu(h)
    if spec.norm:
        h = (h - h.mean()) / torch.sqrt(h.var(unbiased=False) + LN_EPS)
    return x + h if spec.residual else h


def _grad(name, spec, Ws, k, v, d):
    """The gradient term ``θ_t`` multiplies in the paper (``θ`` already in the engine's units)."""
    if spec.architecture == "matrix" and not spec.residual:
        e = k @ Ws[0] - v
        if spec.objective == "dot":  # linear attention / RetNet / GLA / Mamba-2: S += θ k vᵀ
            return [-torch.outer(k, v)]
        return [torch.outer(k, e)]  # delta rule: ∇ ½‖Wᵀk − v‖²
    e = _mem(spec, Ws, k) - v
    if name in ("titans", "ttt_linear", "ttt_mlp"):  # θ_paper ∇‖e‖², θ_paper = θ / 2
        G = torch.autograd.grad((e * e).sum(), Ws, create_graph=True)
        return [gi / 2 for gi in G]
    if name == "moneta":  # θ_paper ∇‖e‖_p^p, θ_paper = θ / p
        G = torch.autograd.grad((e.abs() ** spec.p).sum(), Ws, create_graph=True)
        return [gi / spec.p for gi in G]
    if name == "yaad":  # Miras Eq. 16: ℓ2 step if ‖e‖ ≤ δ, δ·ℓ1 step otherwise
        loss = 0.5 * (e * e).sum() if e.detach().norm() <= d else d * e.abs().sum()
    elif name == "yaad_coordinate":  # Eq. 14, coordinate-wise Huber
        a = e.abs()
        loss = torch.where(a <= d, 0.5 * e * e, d * (a - 0.5 * d)).sum()
    else:  # memora: ℓ2
        loss = 0.5 * (e * e).sum()
    return list(torch.autograd.grad(loss, Ws, create_graph=True))


def _lq(spec, A):
    return A / ((A.abs() ** spec.q).sum() ** (1.0 / spec.q) + LQ_EPS) ** (spec.q - 2)


def _softmax_in(spec, A):
    """``c · softmax`` over the input axis (each output unit's weights sum to ``c``)."""
    return spec.kl_scale * A.exp() / A.exp().sum(-2, keepdim=True)


def _paper_loop(name, spec, x, st, b, h):
    """One (batch, head) of the stream from the state ``st``: returns ``(o [T, V], A, S, anchor)``
    where ``A`` are the weights the engine stores (accumulators for ``lq``; for ``kl`` the engine's
    accumulators are compared through their softmax)."""
    C = spec.chunk_size
    kl = spec.retention == "kl"
    # the state: for Memora the weights themselves (the paper's recursion is on W, not on A)
    A = [_softmax_in(spec, a[b, h]) if kl else a[b, h] for a in st.weights]
    anchor = [_softmax_in(spec, a[b, h]) if kl else a[b, h] for a in st.anchor]
    S = None if st.momentum is None else [s[b, h] for s in st.momentum]
    acc = None if st.anchor_decay is None else st.anchor_decay[b, h]
    pos = st.position
    outs = []
    for t in range(x["q"].shape[1]):
        if pos % C == 0:
            anchor, acc = A, None
        g = x["g"][b, t, h] if "g" in x else None
        if spec.decay_first:  # Gated DeltaNet: the error is taken at the decayed weights
            acc = g if acc is None else acc + g
            W0 = [w * (acc.exp()[:, None] if acc.ndim == 1 else acc.exp()) for w in anchor]
        else:  # Titans' order: the gradient at the chunk-start weights M_{t'} (Titans §3.2)
            W0 = list(anchor) if spec.retention != "lq" else [_lq(spec, a) for a in anchor]
        W0 = [w if w.requires_grad else w.detach().requires_grad_(True) for w in W0]
        # a fresh alias per token so the gradient counts only this use of the weights
        W0 = [w.view_as(w) for w in W0]
        d = x["delta"][b, t, h] if "delta" in x else None
        G = _grad(name, spec, W0, x["k"][b, t, h], x["v"][b, t, h], d)
        th = x["theta"][b, t, h]
        if spec.max_lr is not None:
            th = th.clamp(max=spec.max_lr)
        if kl:  # Memora (Miras): W_t = c softmax(α log W_{t−1} − θ ∇ℓ), literally
            A = [_softmax_in(spec, g.exp() * w.log() - th * gi) for w, gi in zip(A, G)]
        else:
            step = [-th * gi for gi in G]
            if S is not None:  # Titans' surprise: S_t = η_t S_{t−1} − θ_t ∇ℓ
                S = [x["eta"][b, t, h] * s + st_ for s, st_ in zip(S, step)]
                step = S
            lam = 1.0 if g is None else g.exp()  # 1 − α_t (GLA: one per key channel = row)
            lam = lam[:, None] if g is not None and g.ndim == 1 else lam
            A = [lam * a + s for a, s in zip(A, step)]  # M_t = (1 − α_t) M_{t−1} + S_t
        W = [_lq(spec, a) for a in A] if spec.retention == "lq" else A
        outs.append(_mem(spec, W, x["q"][b, t, h]))
        pos += 1
    if pos % C == 0:
        anchor = A
    return torch.stack(outs), A, S, anchor


# ------------------------------------------------------------------------------------------------
# inputs and an arbitrary mid-chunk state
# ------------------------------------------------------------------------------------------------


def _inputs(spec, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=g_, dtype=DT),
        "k": F.normalize(torch.randn(B, T, H, K, generator=g_, dtype=DT), dim=-1),
        "v": torch.randn(B, T, H, K, generator=g_, dtype=DT),
        "theta": torch.rand(B, T, H, generator=g_, dtype=DT) * 0.5 + 0.1,
    }
    if spec.decays:
        shape = (B, T, H, K) if spec.decay_per_channel else (B, T, H)
        x["g"] = F.logsigmoid(torch.randn(shape, generator=g_, dtype=DT) + 2)
    if spec.optimizer == "momentum":
        x["eta"] = torch.rand(B, T, H, generator=g_, dtype=DT) * 0.9
    if spec.objective == "huber":
        x["delta"] = torch.rand(B, T, H, generator=g_, dtype=DT) * 0.5 + 0.05
    return x


def _state(spec, seed=1):
    """Weights, anchor and momentum all different; position inside a chunk (of 3)."""
    g_ = torch.Generator().manual_seed(seed)
    dims = spec.layer_dims(K, K)

    def layers(scale):
        return tuple(scale * torch.randn(B, H, i, o, generator=g_, dtype=DT) for i, o in dims)

    W, anchor = layers(0.4), layers(0.4)
    S = layers(0.1) if spec.optimizer == "momentum" else None
    acc = None
    if spec.decay_first and POS0 % spec.chunk_size:
        shape = (B, H, K) if spec.decay_per_channel else (B, H)
        acc = -0.3 * torch.rand(shape, generator=g_, dtype=DT)
    return MemoryState(W, S, anchor, acc, POS0)


def _leaves(spec, x, st):
    """Fresh leaf copies of the inputs and the state (for gradients)."""
    xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}

    def each(ts):
        return None if ts is None else tuple(t.clone().requires_grad_(True) for t in ts)

    acc = None if st.anchor_decay is None else st.anchor_decay.clone().requires_grad_(True)
    s = MemoryState(each(st.weights), each(st.momentum), each(st.anchor), acc, st.position)
    leaves = (
        list(xs.values()) + [*s.weights, *(s.momentum or ()), *s.anchor] + ([acc] if acc is not None else [])
    )
    return xs, s, leaves


def _scalar(o, weights, mom):
    """A loss that reaches every output and every part of the final state."""
    out = (o * torch.linspace(-1, 1, o.numel(), dtype=DT).view_as(o)).sum()
    out = out + sum((w**2).sum() for w in weights)
    return out + (0 if mom is None else sum((m**3).sum() for m in mom))


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_named_preset_matches_its_papers_update_written_out(name, mode, chunk):
    """Outputs, final state and gradients (w.r.t. every input and every part of the initial state)
    of each named preset equal the paper's token loop written out, from a mid-chunk state."""
    changes = dict(chunk_size=chunk)
    if PRESETS[name][0].architecture == "mlp":
        changes["expansion"] = 2.0
    spec = preset(name, **changes)
    x = _inputs(spec)
    st0 = _state(spec)

    xs, st, leaves = _leaves(spec, x, st0)
    o, s = neural_memory(
        spec, xs["q"], xs["k"], xs["v"], xs["theta"], g=xs.get("g"), eta=xs.get("eta"),
        delta=xs.get("delta"), initial_state=st, output_final_state=True, mode=mode,
    )  # fmt: skip
    kl = spec.retention == "kl"
    Wfin = [_softmax_in(spec, w) if kl else w for w in s.weights]
    Wanc = [_softmax_in(spec, w) if kl else w for w in s.anchor]
    eng = torch.autograd.grad(_scalar(o, Wfin, s.momentum), leaves, allow_unused=True)

    hx, hst, hleaves = _leaves(spec, x, st0)
    with torch.enable_grad():
        per = [[_paper_loop(name, spec, hx, hst, b, h) for h in range(H)] for b in range(B)]
    ho = torch.stack([torch.stack([p[0] for p in row], 1) for row in per])
    nl = len(spec.layer_dims(K, K))
    hW = [torch.stack([torch.stack([p[1][i] for p in row]) for row in per]) for i in range(nl)]
    hA = [torch.stack([torch.stack([p[3][i] for p in row]) for row in per]) for i in range(nl)]
    hS = None
    if spec.optimizer == "momentum":
        hS = [torch.stack([torch.stack([p[2][i] for p in row]) for row in per]) for i in range(nl)]
    ref = torch.autograd.grad(_scalar(ho, hW, hS), hleaves, allow_unused=True)

    assert_close(o, ho, TOL, what=f"{name} output")
    for a, r in zip(Wfin, hW):
        assert_close(a, r, TOL, what=f"{name} final weights")
    for a, r in zip(Wanc, hA):
        assert_close(a, r, TOL, what=f"{name} final anchor")
    if hS is not None:
        for a, r in zip(s.momentum, hS):
            assert_close(a, r, TOL, what=f"{name} final momentum")
    assert s.position == POS0 + T
    names = list(x) + ["state"] * (len(leaves) - len(x))
    for n, a, r in zip(names, eng, ref):
        if r is None:
            assert a is None or a.abs().max() == 0, f"{name}: gradient of {n} should be zero"
            continue
        assert a is not None, f"{name}: no gradient reached {n}"
        assert_close(a, r, TOL, what=f"{name} gradient of {n}")


# ------------------------------------------------------------------------------------------------
# the stream state does not depend on which form produced it
# ------------------------------------------------------------------------------------------------


def test_decay_first_inside_chunks_keeps_its_accumulated_decay_in_every_form():
    """A Hebbian memory with ``decay_first`` and chunks of 4: the closed-form op (gated linear
    attention) dropped ``anchor_decay`` while the token loop (and one-token decoding) kept it, so a
    prefilled and a decoded stream had differently structured states (``cat_rows`` refused them)
    and ``state_spec`` disagreed with the decoded one."""
    from mnemo.layers import NeuralMemory
    from mnemo.layers.state import cat_rows

    spec = MemorySpec(objective="dot", retention="decay", decay_first=True, chunk_size=4)
    x = _inputs(spec)
    st = MemoryState(_state(spec).weights, None, _state(spec).anchor, None, 0)
    run = dict(g=x["g"], initial_state=st, output_final_state=True)
    o_c, s_c = neural_memory(spec, x["q"], x["k"], x["v"], x["theta"], mode="chunk", **run)
    o_r, s_r = neural_memory(spec, x["q"], x["k"], x["v"], x["theta"], mode="recurrent", **run)
    assert_close(o_c, o_r, TOL)
    assert s_r.anchor_decay is not None and s_c.anchor_decay is not None  # 7 % 4 = 3 tokens in
    assert_close(s_c.anchor_decay, s_r.anchor_decay, TOL)
    assert_close(s_c.anchor_decay, x["g"][:, 4:].sum(1), TOL)  # Σ g since the chunk start

    torch.manual_seed(0)
    m = NeuralMemory(16, n_heads=2, spec=spec).double()
    z = torch.randn(1, 6, 16, dtype=DT)
    _, prefilled = m(z)
    _, decoded = m(z[:, :5])
    _, decoded = m(z[:, 5:], decoded)  # one token: the token loop
    want = m.state_spec(1, 6).anchor_decay
    for s in (prefilled, decoded):
        assert s.anchor_decay is not None and tuple(s.anchor_decay.shape) == tuple(want.shape)
    assert_close(prefilled.anchor_decay, decoded.anchor_decay, TOL)
    both = cat_rows([prefilled, decoded])
    assert both.anchor_decay.shape[0] == 2


@pytest.mark.parametrize("segment", [0, -1, 2.5, True])
def test_mac_names_a_bad_segment(segment):
    """The error named ``MemorySpec.chunk_size`` (an argument the caller never passed)."""
    from mnemo.layers import TitansMAC

    with pytest.raises(ValueError, match=r"segment.*" + repr(segment).replace(".", r"\.")):
        TitansMAC(16, n_heads=2, segment=segment)


# ------------------------------------------------------------------------------------------------
# the Titans layers written out from their docstrings and the paper (§4): LMM, MAG, MAL, MAC
# ------------------------------------------------------------------------------------------------

D, NH = 8, 2
HD = D // NH


def _rms(x, w, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _lmm_inputs(m, z):
    """``q, k, v = silu(W z)`` (no conv), q and k L2-normalised per head; ``θ = max_lr σ``,
    ``exp(g) = 1 − α = σ``, ``η = σ`` from one gate projection; the output gate ``W_g z``."""
    B, L, _ = z.shape
    Wq, Wk, Wv, Wg = m.in_proj.weight.split(NH * HD, 0)
    q = F.normalize(F.silu(z @ Wq.T).view(B, L, NH, HD), dim=-1)
    k = F.normalize(F.silu(z @ Wk.T).view(B, L, NH, HD), dim=-1)
    v = F.silu(z @ Wv.T).view(B, L, NH, HD)
    th, a, e = (z @ m.gate_proj.weight.T + m.gate_proj.bias).split(NH, -1)
    gates = dict(theta=m.max_lr * torch.sigmoid(th), g=torch.log(torch.sigmoid(a)), eta=torch.sigmoid(e))
    return q, k, v, (z @ Wg.T).view(B, L, NH, HD), gates


def _read_out(m, o, gate):
    """``W_o (RMSNorm(o) ⊙ silu(gate))``."""
    B, L = o.shape[:2]
    return (_rms(o, m.norm.weight) * F.silu(gate)).reshape(B, L, D) @ m.o_proj.weight.T


def _lmm_hand(m, z, state=None):
    """The memory over ``z`` (titans preset: the paper's loop, :func:`_paper_loop`), the persistent
    prefix written first on a fresh stream and its outputs dropped."""
    B = z.shape[0]
    P = 0 if (m.persistent is None or state is not None) else m.persistent.shape[0]
    zz = torch.cat([m.persistent.expand(B, -1, -1), z], 1) if P else z
    q, k, v, gate, gates = _lmm_inputs(m, zz)
    st = m.initial_state(B).memory_state() if state is None else state
    x = dict(q=q, k=k, v=v, **gates)
    per = [[_paper_loop("titans", m.spec, x, st, b, h) for h in range(NH)] for b in range(B)]
    o = torch.stack([torch.stack([p[0] for p in row], 1) for row in per])
    end = [torch.stack([torch.stack([p[i][j] for p in row]) for row in per]) for i in (1, 2, 3)
           for j in range(len(st.weights))]  # fmt: skip
    n = len(st.weights)
    new = MemoryState(
        tuple(end[:n]), tuple(end[n : 2 * n]), tuple(end[2 * n :]), None, st.position + zz.shape[1]
    )
    return _read_out(m, o, gate)[:, P:], new


def _attn_hand(pa, z, window, extra=None):
    """Softmax attention with rotary positions ``0 …`` over ``[persistent ‖ extra ‖ z]``: persistent
    keys always visible, ``extra_i`` and ``z_i`` visible to query ``j`` iff ``j − window < i ≤ j``."""
    att = pa.inner
    B, L, _ = z.shape

    def kv(u):
        k, v = att.kv_proj(u).chunk(2, -1)
        return att.rotary(k.view(B, u.shape[1], NH, HD), 0), v.view(B, u.shape[1], NH, HD)

    q = att.rotary(att.q_proj(z).view(B, L, NH, HD), 0)
    kp, vp = kv(pa.persistent.expand(B, -1, -1))
    parts = [kv(extra), kv(z)] if extra is not None else [kv(z)]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None]
    near = (j <= i) & (j > i - (window or L))
    allowed = torch.cat([torch.ones(L, kp.shape[1], dtype=torch.bool)] + [near] * len(parts), 1)
    K_ = torch.cat([kp] + [p[0] for p in parts], 1)
    V_ = torch.cat([vp] + [p[1] for p in parts], 1)
    s = torch.einsum("bthd,bshd->bhts", q, K_) / HD**0.5
    o = torch.einsum("bhts,bshd->bthd", s.masked_fill(~allowed, float("-inf")).softmax(-1), V_)
    return att.o_proj(o.reshape(B, L, D))


def _jitter(m):
    torch.manual_seed(0)
    m = m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def _z(T_, seed=3):
    return torch.randn(2, T_, D, generator=torch.Generator().manual_seed(seed), dtype=DT)


def test_lmm_layer_is_titans_written_out():
    """NeuralMemory (titans preset, persistent prefix, chunk 3, no conv) against its docstring's
    equations and the paper's loop; also in two pieces with the state carried."""
    from mnemo.layers import NeuralMemory

    m = _jitter(
        NeuralMemory(D, n_heads=NH, short_conv=False, persistent_tokens=2, chunk_size=3, expansion=1.0)
    )
    z = _z(7)
    ref, _ = _lmm_hand(m, z)
    assert_close(m(z)[0], ref, TOL)
    y1, s = m(z[:, :4])
    y2, _ = m(z[:, 4:], s)
    assert_close(torch.cat([y1, y2], 1), ref, TOL)


@pytest.mark.parametrize("window", [3, None])
def test_mag_and_mal_are_titans_written_out(window):
    """MAG: ``o = W_o(RMSNorm(SWA*(x)) ⊙ σ(RMSNorm(M(x))))``; MAL: ``o = SWA*(RMSNorm(M(x)))``
    (``SWA*``: sliding window with persistent keys always visible)."""
    from mnemo.layers import TitansMAG, TitansMAL

    kw = dict(
        n_heads=NH, window=window or 64, persistent_tokens=2, chunk_size=3, expansion=1.0, short_conv=False
    )
    mag, mal = _jitter(TitansMAG(D, **kw)), _jitter(TitansMAL(D, **kw))
    z = _z(9)
    ya = _attn_hand(mag.attn, z, window)
    ym, _ = _lmm_hand(mag.memory, z)
    ref = mag.o_proj(_rms(ya, mag.norm_attn.weight) * torch.sigmoid(_rms(ym, mag.norm_mem.weight)))
    assert_close(mag(z)[0], ref, TOL, what="MAG")
    h, _ = _lmm_hand(mal.memory, z)
    ref = _attn_hand(mal.attn, _rms(h, mal.mid_norm.weight), window)
    assert_close(mal(z)[0], ref, TOL, what="MAL")
    y1, s = mal(z[:, :5])
    y2, _ = mal(z[:, 5:], s)
    assert_close(torch.cat([y1, y2], 1), ref, TOL, what="MAL in two pieces")


def test_mac_over_several_segments_is_titans_written_out():
    """MAC over 2⅔ segments of 3: per segment ``h = M*_{before}(q(S))``, ``y = Attn([p ‖ h ‖ S])``
    (causal), the memory written with ``y`` and read after each write, ``o = W_o(y ⊙ σ(m))``;
    also streamed in pieces that cut segments."""
    from mnemo.layers import TitansMAC

    mac = _jitter(TitansMAC(D, n_heads=NH, segment=3, persistent_tokens=2, expansion=1.0, short_conv=False))
    m = mac.memory
    z = _z(8)
    st = m.initial_state(2).memory_state()
    outs = []
    for a in range(0, 8, 3):
        zs = z[:, a : a + 3]
        q, _, _, gate, _ = _lmm_inputs(m, zs)
        # read before the segment (weights at its start: the paper's M*_{t−1}), no write
        r = torch.stack([torch.stack([torch.stack([_mem(m.spec, [w[b, h] for w in st.weights], q[b, t, h])
                 for t in range(zs.shape[1])]) for h in range(NH)], 1) for b in range(2)])  # fmt: skip
        h_ = _read_out(m, r, gate)
        y = _attn_hand(mac.attn, zs, None, extra=h_)
        mread, st = _lmm_hand(m, y, st)
        outs.append(mac.o_proj(y * torch.sigmoid(mread)))
    ref = torch.cat(outs, 1)
    assert_close(mac(z)[0], ref, TOL)
    y1, s = mac(z[:, :4])
    y2, s = mac(z[:, 4:5], s)
    y3, _ = mac(z[:, 5:], s)
    assert_close(torch.cat([y1, y2, y3], 1), ref, TOL)

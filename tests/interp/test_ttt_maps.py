"""Maps of the test-time-trained memories (issue 19 part 3): exact on the memories linear in their
values (against the ops' maps and a hand-derived recursion, momentum, decay and mini-batches
included), an attribution whose contributions add up to the read on the nonlinear ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.interp import capture_maps, induction_score, mixing
from mnemo.layers import NeuralMemory, SelfModifyingProjections, SelfModifyingTitans, TitansMAC
from mnemo.memory import MemorySpec, preset
from mnemo.memory.attribution import exact_value_map, linear_in_values, value_attribution
from mnemo.models import LanguageModel, build_config
from mnemo.ops import delta_rule_map, gated_linear_attention_map

F64 = torch.float64
B, T, H, K = 2, 10, 2, 4


def rel(a, b):
    return float((a - b).norm() / b.norm())


def _inputs(seed=0, channel=False):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=F64)

    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, K)
    theta = torch.rand(B, T, H, generator=gen, dtype=F64)
    g = -0.5 * torch.rand(B, T, H, *((K,) if channel else ()), generator=gen, dtype=F64)
    eta = torch.rand(B, T, H, generator=gen, dtype=F64)
    return q, k, v, theta, g, eta


def reference_map(spec: MemorySpec, q, k, theta, g, eta) -> torch.Tensor:
    """The exact map by hand: every weight matrix of a memory linear in its values is
    ``W = Σ_s a_s v_sᵀ``; track the coefficients ``C [K, T]`` (``W = C V``) through the engine's
    semantics (gradient at the chunk-start weights, decayed first when ``decay_first``; momentum;
    decay; read after the write): ``o_t = q_tᵀ C_t V``, so row ``t`` of the map is ``q_tᵀ C_t``."""
    Bq, Tq, Hq, Kq = q.shape
    M = torch.zeros(Bq, Hq, Tq, Tq, dtype=F64)
    for b in range(Bq):
        for h in range(Hq):
            C = torch.zeros(Kq, Tq, dtype=F64)
            S = torch.zeros(Kq, Tq, dtype=F64)
            anchor, since = C.clone(), torch.zeros(Kq, dtype=F64)
            for t in range(Tq):
                if t % spec.chunk_size == 0:
                    anchor, since = C.clone(), torch.zeros(Kq, dtype=F64)
                gt = None
                if spec.decays:
                    gt = g[b, t, h] if g.ndim == 4 else g[b, t, h].expand(Kq)
                    since = since + gt
                e_t = torch.zeros(Tq, dtype=F64)
                e_t[t] = 1
                kt = k[b, t, h]
                W0 = anchor * since.exp()[:, None] if spec.decay_first else anchor
                # ∇_W ℓ for W = C V: dot: −k vᵀ -> −k e_tᵀ; l2: k (Wᵀk − v)ᵀ -> k (kᵀ C − e_t)ᵀ
                grad = -torch.outer(kt, e_t) if spec.objective == "dot" else torch.outer(kt, kt @ W0 - e_t)
                step = -theta[b, t, h] * grad
                if spec.optimizer == "momentum":
                    S = eta[b, t, h] * S + step
                    step = S
                C = (gt.exp()[:, None] * C if gt is not None else C) + step
                M[b, h, t] = q[b, t, h] @ C
    return M


LINEAR_SPECS = {
    "linear_attention": preset("linear_attention"),
    "gla (per-channel decay)": preset("gla"),
    "mamba2 (scalar decay)": preset("mamba2"),
    "deltanet": preset("deltanet"),
    "gated_deltanet": preset("gated_deltanet"),
    "delta, mini-batch 4": preset("deltanet", chunk_size=4),
    "delta, decay after, mini-batch 3": MemorySpec(objective="l2", retention="decay", chunk_size=3),
    "gated delta, mini-batch 4": preset("gated_deltanet", chunk_size=4),
    "titans-matrix (l2, decay, momentum, mini-batch 4)": MemorySpec(
        objective="l2", retention="decay", optimizer="momentum", chunk_size=4
    ),
    "hebbian momentum": MemorySpec(objective="dot", retention="decay", optimizer="momentum", chunk_size=5),
    "delta, per-channel decay, momentum": MemorySpec(
        objective="l2", retention="decay", decay_per_channel=True, optimizer="momentum", chunk_size=1
    ),
}


@pytest.mark.parametrize("name", sorted(LINEAR_SPECS))
def test_exact_map_equals_the_hand_derived_map_and_reproduces_the_read(name):
    spec = LINEAR_SPECS[name]
    assert linear_in_values(spec)
    q, k, v, theta, g, eta = _inputs(channel=spec.decay_per_channel)
    g = g if spec.decays else None
    eta = eta if spec.optimizer == "momentum" else None
    ref = reference_map(spec, q, k, theta, g, eta)
    for mode in ("chunk", "recurrent"):
        M = exact_value_map(spec, q, k, theta, g=g, eta=eta, mode=mode)
        assert rel(M, ref) <= 1e-10, (name, mode, rel(M, ref))
    # from learned initial weights: the map is unchanged, maps @ values = read − baseline
    w0 = [0.3 * torch.randn(H, i, o, dtype=F64) for i, o in spec.layer_dims(K, K)]
    a = value_attribution(spec, q, k, v, theta, g=g, eta=eta, initial_weights=w0)
    assert a.exact and rel(a.maps, ref) <= 1e-10
    assert a.map_error() <= 1e-10
    # the generic attribution (gradient × input through the unrolled updates) is the same map
    j = value_attribution(spec, q, k, v, theta, g=g, eta=eta, initial_weights=w0, method="jacobian")
    assert rel(j.maps, ref) <= 1e-10, rel(j.maps, ref)
    assert rel(j.contributions, ref[..., None] * v.transpose(1, 2)[:, :, None]) <= 1e-10
    assert j.completeness_error() <= 1e-10


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "linear_attention", "gla", "mamba2"])
def test_exact_map_equals_the_ops_maps(name):
    """The closed-form members against the ops' ``*_map`` (the delta rules' key removal included)."""
    spec = preset(name)
    q, k, v, theta, g, eta = _inputs(1, channel=spec.decay_per_channel)
    g = g if spec.decays else None
    M = exact_value_map(spec, q, k, theta, g=g)
    if spec.objective == "l2":
        ref = delta_rule_map(q, k, theta, g, scale=1.0)
    else:
        ref = gated_linear_attention_map(q, k * theta[..., None], g, scale=1.0)
    assert rel(M, ref) <= 1e-10, rel(M, ref)


@pytest.mark.parametrize("spec_name", ["deltanet", "gated_deltanet", "mamba2", "gla"])
def test_neural_memory_mixing_is_exact_for_matrix_presets(spec_name):
    torch.manual_seed(0)
    m = NeuralMemory(16, n_heads=2, spec=spec_name, persistent_tokens=3).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert m.mixing_exact
    x = torch.randn(2, 9, 16, dtype=F64)
    mx = mixing(m, x)
    assert mx.maps.shape == (2, 2, 9, 9) and torch.all(mx.maps.triu(1) == 0)
    recon = torch.einsum("bhts,bshv->bthv", mx.maps, mx.values)
    assert rel(recon, mx.output) <= 1e-10
    if spec_name in ("deltanet", "gated_deltanet"):  # the op map on the recorded q, k, θ, g
        acts = m.mixing_acts(x)
        ref = delta_rule_map(
            acts["hook_q"], acts["hook_k"], acts["hook_theta"], acts.get("hook_g"), scale=1.0
        )
        assert rel(mx.maps, ref[..., 3:, 3:]) <= 1e-10


NONLINEAR = ["titans", "ttt_mlp", "ttt_linear", "moneta", "memora"]


@pytest.mark.parametrize("name", NONLINEAR)
def test_nonlinear_attribution_is_causal_and_complete_with_integration(name):
    """Integrated gradients of the read in the values add up to the writes' part of the read
    (``o − baseline``); plain gradient × input (``steps = 1``) only to first order."""
    spec = preset(name, chunk_size=4)
    assert not linear_in_values(spec)
    q, k, v, theta, g, eta = _inputs(2)
    theta = 0.1 * theta  # the trained regime (θ ≈ 0.1 max_lr at init)
    g = 0.1 * g
    # seeded like the inputs: drawn from the global RNG, the weights depended on the tests run before.
    # 16 midpoint steps (the default rule) fall under 0.1 for most draws, not all: of weight seeds
    # 0-19, titans 16, ttt_mlp 19, moneta 13, ttt_linear and memora 20; Gauss-Legendre nodes do not
    # fix it (test_ig_quadrature_45.py: the measurement, and what holds over all 20 draws)
    gen = torch.Generator().manual_seed(2)
    w0 = [torch.randn(H, i, o, dtype=F64, generator=gen) * i**-0.5 for i, o in spec.layer_dims(K, K)]
    kw = dict(g=g if spec.decays else None, eta=eta if spec.optimizer == "momentum" else None)
    errs = []
    for steps in (1, 4, 16):
        a = value_attribution(spec, q, k, v, theta, initial_weights=w0, steps=steps, **kw)
        assert not a.exact and a.maps.shape == (B, H, T, T)
        upper = torch.ones(T, T, dtype=torch.bool).triu(1)
        assert torch.all(a.maps.triu(1) == 0) and torch.all(a.contributions[:, :, upper] == 0)
        errs.append(a.completeness_error())
    assert errs[2] < errs[0] and errs[2] < 0.1, errs


def test_attribution_matches_a_finite_difference_jacobian():
    spec = preset("titans", chunk_size=4)
    q, k, v, theta, g, eta = _inputs(3)
    w0 = [torch.randn(H, i, o, dtype=F64) * i**-0.5 for i, o in spec.layer_dims(K, K)]
    kw = dict(g=g, eta=eta, initial_weights=w0)
    a = value_attribution(spec, q, k, v, theta, steps=1, **kw)
    from mnemo.memory import init_state, neural_memory

    s, eps = 4, 1e-6
    d = torch.zeros_like(v)
    d[:, s] = v[:, s]

    def read(vv):
        return neural_memory(spec, q, k, vv, theta, g=g, eta=eta, initial_state=init_state(spec, w0, B))[0]

    fd = (read(v + eps * d) - read(v - eps * d)) / (2 * eps)  # J_·s v_s
    assert rel(a.contributions[:, :, :, s], fd.transpose(1, 2)) <= 1e-6


def test_titans_models_give_maps_and_scores():
    torch.manual_seed(0)
    # hope reads in task-signal segments; run_with_cache joins its hooks over them (hope_reconstruction
    # has the same mixer, read in one pass)
    for name in ("titans_lmm", "titans_mag", "titans_mal", "titans_mac", "hope"):
        m = LanguageModel(build_config(name, vocab_size=20, d_model=16, n_layers=1))
        mixer = m.blocks[0].mixer
        mixer.attribution_steps = 2 if hasattr(mixer, "attribution_steps") else None
        if hasattr(mixer, "memory"):
            mixer.memory.attribution_steps = 2
        ids = torch.randint(0, 20, (2, 12))
        before, _ = m(ids)
        maps = capture_maps(m, ids)
        after, _ = m(ids)
        assert torch.equal(before, after), name
        assert list(maps) == [0] and maps[0].shape[-2:] == (12, 12), name
        assert torch.isfinite(maps[0]).all() and torch.all(maps[0].triu(1) == 0), name
        assert torch.isfinite(induction_score(maps[0], 6)).all()


def test_mac_maps_span_its_segments_and_projections_raise_past_one_chunk():
    mac = TitansMAC(16, n_heads=2, segment=4, persistent_tokens=2)
    # MAC's mixing_acts joins its segments' pieces (review 4: it kept the last segment only, and
    # mixing raised); the map's meaning over several segments: test_review4_memory
    assert mixing(mac, torch.randn(1, 9, 16)).maps.shape == (1, 2, 9, 9)
    smp = SelfModifyingProjections(16, n_heads=2, chunk_size=4)
    with pytest.raises(NotImplementedError, match="a map needs a stream of at most one chunk"):
        mixing(smp, torch.randn(1, 9, 16))
    one = mixing(
        SelfModifyingProjections(16, n_heads=2, chunk_size=16).double(), torch.randn(1, 9, 16, dtype=F64)
    )
    assert rel(torch.einsum("bhts,bshv->bthv", one.maps, one.values), one.output) <= 1e-10


@pytest.mark.parametrize(
    "extra", [{}, {"momentum": 0.6, "adaptive_q": True}], ids=["plain", "hope_paper options"]
)
def test_self_modifying_titans_attribution_is_complete_and_respects_chunks(extra):
    """Completeness (the contributions add up to the writes' part of the read) and Eq. 90's
    chunk-start reads, also with DGD momentum (the attribution's token loop carries the momentum
    from zero, as a fresh stream) and the adaptive query (read from the recorded hook_q)."""
    torch.manual_seed(0)
    m = SelfModifyingTitans(16, n_heads=2, chunk_size=4, proj_chunk_size=3, **extra).double()
    x = torch.randn(2, 11, 16, dtype=F64)
    acts = m.mixing_acts(x)
    a = m.attribution(acts, steps=8)
    assert a.maps.shape == (2, 1, 11, 11) and not a.exact
    assert a.completeness_error() < 1e-3
    # the attributed output is the forward's own: its read minus the read of the same forward with
    # zero values written (hook_v zeroed; with momentum, the momentum of those writes carried too)
    reads = {}
    h_o = m.hook_o.register_forward_hook(lambda mod, i, out: reads.__setitem__("o", out))
    with torch.no_grad():
        m(x)
        o = reads["o"]
        h_v = m.hook_v.register_forward_hook(lambda mod, i, out: torch.zeros_like(out))
        m(x)
        h_v.remove()
    h_o.remove()
    assert rel(a.output[:, :, 0], o - reads["o"]) <= 1e-10
    # Eq. 90: a read inside a chunk uses the chunk-start weights, so no weight on its own chunk
    for t in range(11):
        c0 = t - t % 4
        assert torch.all(a.maps[:, :, t, c0:] == 0)

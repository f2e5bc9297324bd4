"""The test-time-trained memory engine: chunk form == token-loop reference for every combination of
architecture × objective × retention × optimizer; streaming; presets == dedicated ops."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from mnemo.memory import PRESETS, MemorySpec, closed_form_op, init_state, neural_memory, preset
from mnemo.ops import delta_rule, gated_delta_rule, gated_linear_attention, linear_attention
from tests.helpers import assert_close

B, H, K, V = 2, 2, 4, 4
TOL = 1e-10  # float64, as documented for every form (docs/testing.md); measured at most 5.4e-12
PREFIX_TOL = 1e-5  # float32, chunk form against the token loop over 128 tokens (measured 3.3e-7)


def _inputs(spec: MemorySpec, T: int, seed: int = 0, dtype=torch.float64, B=B, K=K, V=V):
    g_ = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=g_, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, generator=g_, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, H, V, generator=g_, dtype=dtype),
        "theta": torch.rand(B, T, H, generator=g_, dtype=dtype) * 0.5 + 0.1,
    }
    if spec.retention != "none":
        shape = (B, T, H, K) if spec.decay_per_channel else (B, T, H)
        x["g"] = F.logsigmoid(torch.randn(shape, generator=g_, dtype=dtype) + 2)
    if spec.optimizer == "momentum":
        x["eta"] = torch.rand(B, T, H, generator=g_, dtype=dtype) * 0.9
    if spec.objective == "huber":
        x["delta"] = torch.rand(B, T, H, generator=g_, dtype=dtype) * 0.5 + 0.05
    return x


def _state(spec, seed=1, dtype=torch.float64, B=B):
    g_ = torch.Generator().manual_seed(seed)
    ws = [0.3 * torch.randn(B, H, i, o, generator=g_, dtype=dtype) for i, o in spec.layer_dims(K, V)]
    return init_state(spec, ws)


def _run(spec, x, state, mode, **kw):
    extra = {n: x[n] for n in ("g", "eta", "delta") if n in x}
    return neural_memory(
        spec,
        x["q"],
        x["k"],
        x["v"],
        x["theta"],
        **extra,
        initial_state=state,
        output_final_state=True,
        mode=mode,
        **kw,
    )


def _slice(x, a, b):
    return {n: t[:, a:b] for n, t in x.items()}


def _combos():
    out = []
    for arch, obj, ret, opt in itertools.product(
        ("matrix", "mlp"),
        ("dot", "l2", "lp", "huber"),
        ("none", "decay", "lq", "kl", "elastic_net"),
        ("gd", "momentum"),
    ):
        kw = dict(architecture=arch, objective=obj, retention=ret, optimizer=opt)
        if arch == "mlp":
            kw.update(depth=2, expansion=2.0, residual=True, norm=True)
        if ret == "elastic_net":
            kw.update(l1=0.5)  # γ_t = 0.5 θ_t ∈ [0.05, 0.3]: the soft-thresholding zeroes many weights
        variants = [kw]
        if obj == "huber":  # the default is the paper's per-token switch; also the coordinate-wise form
            variants.append(dict(kw, huber_mode="coordinate"))
        if ret in ("decay", "elastic_net") and arch == "matrix":
            variants.append(dict(kw, decay_per_channel=True))
        if ret == "decay":
            variants.append(dict(kw, decay_first=True))
        for v in variants:
            name = (
                "-".join(str(x) for x in (arch, obj, ret, opt))
                + ("-coordinate" if v.get("huber_mode") == "coordinate" else "")
                + ("-first" if v.get("decay_first") else "")
                + ("-channel" if v.get("decay_per_channel") else "")
            )
            out.append(pytest.param(v, id=name))
    return out


COMBOS = _combos()


@pytest.mark.parametrize("kw", COMBOS)
@pytest.mark.parametrize("chunk_size, clip", [(1, None), (4, 0.5), (5, None)])
def test_chunk_equals_reference(kw, chunk_size, clip):
    """Every architecture × objective × retention × optimizer, float64: outputs and states."""
    spec = MemorySpec(**kw, chunk_size=chunk_size, grad_clip=clip).validate()
    x = _inputs(spec, 13)
    s0 = _state(spec)
    o_ref, s_ref = _run(spec, x, s0, "recurrent")
    o, s = _run(spec, x, s0, "chunk", use_closed_form=False)
    assert_close(o, o_ref, TOL, what=f"{kw} output")
    for a, b in zip(s.weights, s_ref.weights):
        assert_close(a, b, TOL, what="weights")
    for a, b in zip(s.anchor, s_ref.anchor):
        assert_close(a, b, TOL, what="anchor")
    if s_ref.momentum is not None:
        for a, b in zip(s.momentum, s_ref.momentum):
            assert_close(a, b, TOL, what="momentum")
    assert s.position == s_ref.position == 13


@pytest.mark.parametrize("name", ["titans", "moneta", "yaad", "yaad_coordinate", "memora", "ttt_mlp", "gla"])
def test_gradients_agree_with_reference(name):
    spec = preset(
        name, chunk_size=4, **({"expansion": 2.0} if PRESETS[name][0].architecture == "mlp" else {})
    )
    x = _inputs(spec, 10)
    s0 = _state(spec)

    def grads(mode):
        xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        w0 = [w.clone().requires_grad_(True) for w in s0.weights]
        st = init_state(spec, w0)
        o, s = _run(spec, xs, st, mode, use_closed_form=False)
        (o.square().sum() + sum(w.sum() for w in s.weights)).backward()
        return [xs[n].grad for n in sorted(xs)] + [w.grad for w in w0]

    for a, b in zip(grads("chunk"), grads("recurrent")):
        assert a is not None and b is not None
        assert_close(a, b, TOL)  # measured at most 4.2e-14


@pytest.mark.parametrize("name", ["titans", "ttt_linear", "memora", "gated_deltanet", "yaad"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_streaming_any_split_equals_full(name, mode):
    """Prefill of any length, then pieces of 1, 5, chunk-1, chunk+1 tokens (chunk = 4)."""
    spec = preset(
        name, chunk_size=4, **({"expansion": 2.0} if PRESETS[name][0].architecture == "mlp" else {})
    )
    x = _inputs(spec, 30)
    s0 = _state(spec)
    o_full, s_full = _run(spec, x, s0, mode)
    for prefill in (1, 3, 6):
        outs, t = [], 0
        st = s0
        for size in (prefill, 1, 5, 3, 5, 1, 30):
            o, st = _run(spec, _slice(x, t, min(30, t + size)), st, mode)
            outs.append(o)
            t = min(30, t + size)
        assert_close(torch.cat(outs, 1), o_full, TOL, what=f"prefill {prefill}")
        for a, b in zip(st.weights, s_full.weights):
            assert_close(a, b, TOL)


def test_shorter_than_one_chunk_still_writes_and_reads():
    spec = preset("titans", chunk_size=64, expansion=2.0)
    x = _inputs(spec, 3)
    s0 = _state(spec)
    o, s = _run(spec, x, s0, "chunk")
    o_ref, _ = _run(spec, x, s0, "recurrent")
    assert_close(o, o_ref, TOL)
    assert not torch.allclose(s.weights[0], s0.weights[0])  # it wrote
    o_nowrite, _ = _run(spec, {**x, "theta": torch.zeros_like(x["theta"])}, s0, "chunk")
    assert not torch.allclose(o, o_nowrite)  # and token t reads its own write


def test_samples_are_independent():
    spec = preset("titans", chunk_size=4, expansion=2.0)
    x = _inputs(spec, 11)
    s0 = _state(spec)
    o, s = _run(spec, x, s0, "chunk")
    x2 = {n: t.clone() for n, t in x.items()}
    x2["v"][1] += torch.randn_like(x2["v"][1])  # change sample 1 only
    o2, s2 = _run(spec, x2, s0, "chunk")
    assert torch.equal(o[0], o2[0]) and not torch.allclose(o[1], o2[1])
    assert torch.equal(s.weights[0][0], s2.weights[0][0])


# ----------------------------------------------------------------------------------------------
# presets reproduce the dedicated ops
# ----------------------------------------------------------------------------------------------


def _op_reference(name, x, S0):
    q, k, v, th = x["q"], x["k"], x["v"], x["theta"]
    kw = dict(scale=1.0, initial_state=S0, output_final_state=True, mode="recurrent")
    if name in ("linear_attention",):
        return linear_attention(q, k * th[..., None], v, **kw)
    if name in ("retnet", "gla", "mamba2"):
        return gated_linear_attention(q, k * th[..., None], v, x["g"], **kw)
    if name == "deltanet":
        return delta_rule(q, k, v, th, **kw)
    return gated_delta_rule(q, k, v, x["g"], th, **kw)


@pytest.mark.parametrize(
    "name", ["linear_attention", "retnet", "gla", "mamba2", "deltanet", "gated_deltanet"]
)
@pytest.mark.parametrize("path", ["reference", "chunk-engine", "closed-form"])
def test_matrix_presets_reproduce_dedicated_ops(name, path):
    spec = preset(name)
    if spec.objective == "dot":
        spec = spec.replace(chunk_size=4)  # the Hebbian memory does not depend on the chunk size
    assert closed_form_op(spec) is not None
    x = _inputs(spec, 15)
    s0 = _state(spec)
    o_op, s_op = _op_reference(name, x, s0.weights[0])
    mode = "recurrent" if path == "reference" else "chunk"
    o, s = _run(spec, x, s0, mode, use_closed_form=path == "closed-form")
    assert_close(o, o_op, TOL)
    assert_close(s.weights[0], s_op, TOL)


def test_deep_memory_with_clipping_stays_finite_on_long_sequences():
    spec = MemorySpec(
        architecture="mlp",
        depth=4,
        expansion=2.0,
        residual=True,
        norm=True,
        objective="l2",
        retention="decay",
        optimizer="momentum",
        chunk_size=64,
        grad_clip=1.0,
        max_lr=1.0,
    )
    g_ = torch.Generator().manual_seed(0)
    T = 4096
    x = {
        "q": torch.randn(1, T, 1, 8, generator=g_) * 3,
        "k": torch.randn(1, T, 1, 8, generator=g_) * 3,
        "v": torch.randn(1, T, 1, 8, generator=g_) * 3,
        "theta": torch.full((1, T, 1), 5.0),  # above max_lr: clamped
        "g": torch.full((1, T, 1), -1e-4),
        "eta": torch.full((1, T, 1), 0.99),
    }
    ws = [0.5 * torch.randn(1, 1, i, o, generator=g_) for i, o in spec.layer_dims(8, 8)]
    o, s = neural_memory(
        spec,
        x["q"],
        x["k"],
        x["v"],
        x["theta"],
        g=x["g"],
        eta=x["eta"],
        initial_state=init_state(spec, ws),
        output_final_state=True,
    )
    assert torch.isfinite(o).all()
    assert all(torch.isfinite(w).all() for w in s.weights + s.momentum)
    # and it computes the memory: the first two chunks equal the token loop's outputs
    P = 128
    o_ref, _ = neural_memory(
        spec,
        *(x[n][:, :P] for n in ("q", "k", "v", "theta")),
        g=x["g"][:, :P],
        eta=x["eta"][:, :P],
        initial_state=init_state(spec, ws),
        mode="recurrent",
    )
    assert_close(o[:, :P], o_ref, PREFIX_TOL, what="first two chunks")


def test_bad_inputs_name_the_argument():
    spec = preset("titans")
    x = _inputs(spec, 5)
    with pytest.raises(ValueError, match="needs eta of shape"):
        neural_memory(spec, x["q"], x["k"], x["v"], x["theta"], g=x["g"])
    with pytest.raises(ValueError, match=r"theta must have shape \[B, T, H\]"):
        neural_memory(spec, x["q"], x["k"], x["v"], x["theta"][..., :1], g=x["g"], eta=x["eta"])
    with pytest.raises(ValueError, match="needs the log decay g"):
        neural_memory(spec, x["q"], x["k"], x["v"], x["theta"], eta=x["eta"])
    with pytest.raises(ValueError, match=r"MemorySpec.objective: expected one of"):
        MemorySpec(objective="cosine").validate()
    with pytest.raises(ValueError, match="decay_per_channel"):
        MemorySpec(architecture="mlp", retention="decay", decay_per_channel=True).validate()
    with pytest.raises(ValueError, match="unknown memory preset 'gpt'"):
        preset("gpt")
    with pytest.raises(ValueError, match=r"initial_state.weights\[0\] must have shape"):
        neural_memory(
            preset("deltanet"),
            x["q"],
            x["k"],
            x["v"],
            x["theta"],
            initial_state=init_state(preset("deltanet"), [torch.zeros(2, 2, 3, 4)]),
        )


@pytest.mark.parametrize("name", ["memora", "moneta"])
def test_blocked_materialised_reads_match_reference(name, monkeypatch):
    """Per-token weights are formed in checkpointed blocks when they would not fit the budget;
    force tiny blocks and check outputs and gradients against the token loop."""
    import mnemo.memory.chunk as eng

    monkeypatch.setattr(eng, "_MATERIALIZE_BUDGET", 2 * B * H * 8 * 4)  # ~2 tokens per block
    spec = preset(name, chunk_size=5, expansion=2.0)
    x = _inputs(spec, 12)
    s0 = _state(spec)

    def run(mode):
        xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, _ = _run(spec, xs, s0, mode, use_closed_form=False)
        o.square().sum().backward()
        return o, [xs[n].grad for n in sorted(xs)]

    o1, g1 = run("chunk")
    o2, g2 = run("recurrent")
    assert_close(o1, o2, TOL)
    for a, b in zip(g1, g2):
        assert_close(a, b, TOL)  # measured at most 1.6e-14


@pytest.mark.parametrize("name", ["titans", "memora"])
def test_torch_compile_matches_eager(name):
    """``torch.compile(neural_memory, backend="eager")`` (the fused GELU and decay Functions, the
    dual-form and materialised reads) matches eager, outputs and gradients."""
    spec = dataclasses.replace(preset(name), chunk_size=8)  # 21 tokens: 8 + 8 + 5
    x = {n: t.float() for n, t in _inputs(spec, 21).items()}
    st0 = _state(spec, dtype=torch.float32)

    def call(**kw):
        return _run(spec, kw, st0, "chunk")

    compiled = torch.compile(call, backend="eager")
    res = []
    for f in (call, compiled):
        xs = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, st = f(**xs)
        (o.square().sum() + sum(w.sum() for w in st.weights)).backward()
        res.append((o, [xs[n].grad for n in sorted(xs)]))
    (o1, g1), (o2, g2) = res
    assert_close(o2, o1, 1e-6)
    for a, b in zip(g2, g1):
        assert_close(a, b, 1e-6)

"""``torch.compile`` of whole models equals eager: the training forward, its gradients and one
decode step with the cache.

Tolerance: float32, relative RMS ``1e-5`` for logits and ``1e-4`` for gradients. Inductor fuses
and reorders reductions (the native CPU kernels run eagerly between graph breaks), so results
differ from eager by float32 rounding only: a few ulps per operation over a handful of layers,
~1e-7–1e-6 relative; gradients pass through more reductions (the backward's sums over batch and
time). A wrong graph (a dropped term, a stale state) is off by O(1).

Compilation is slow on 2 cores: the default run compiles one family (the transformer, ~10 s);
the others are ``slow``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from mnemo.models import LanguageModel, build_config, model_names
from tests.helpers import rel_rms, spy_native_calls

pytestmark = pytest.mark.filterwarnings("ignore")

FWD_TOL, GRAD_TOL = 1e-5, 1e-4


@functools.cache
def _compile_works() -> bool:
    from mnemo.bench.models import compile_available

    return compile_available()[0]


@pytest.fixture
def compile_required():
    """Skips the test where ``torch.compile`` cannot compile and run a small function here. (A
    fixture, not a ``skipif`` evaluated at import: that check compiles, ~4 s, and every xdist
    worker paid it while collecting, whether or not it ran any of these tests.)"""
    if not _compile_works():
        pytest.skip("torch.compile unavailable here")


needs_compile = pytest.mark.usefixtures("compile_required")


def _model(name: str, d_model: int = 16, n_layers: int = 2) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=32, d_model=d_model, n_layers=n_layers))


#: the default run's compiled models have one layer: every family's layers are copies of one block
#: (the same code, traced and compiled the same way), so a second layer adds trace and compile time
#: (dynamo inlines each layer) but no code path; the ``slow`` tests keep two
ONE_LAYER = 1


def _check_family(name: str, T: int = 20, d_model: int = 16, decode: bool = True, n_layers: int = 2) -> None:
    torch._dynamo.reset()
    model = _model(name, d_model, n_layers)
    compiled = torch.compile(model)
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(1))

    # forward and backward
    def grads(fn):
        model.zero_grad(set_to_none=True)
        logits = fn(ids)[0]
        (logits.square().mean() + logits[:, -1].sum()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = grads(model)
    logits, got_grads = grads(compiled)
    assert rel_rms(logits, ref_logits) < FWD_TOL, f"{name}: compiled forward differs"
    assert set(got_grads) == set(ref_grads)
    for n, g in ref_grads.items():
        assert rel_rms(got_grads[n], g, floor=1e-8) < GRAD_TOL, f"{name}: gradient of {n} differs"
    if not decode:
        return

    # one decode step with the cache (the prefill state comes from eager)
    with torch.no_grad():
        _, state = model(ids[:, :-1])
        tok = ids[:, -1:]
        ref, ref_state = model(tok, state)
        got, got_state = compiled(tok, state)
    assert rel_rms(got, ref) < FWD_TOL, f"{name}: compiled decode step differs"
    # the step's new state too (compared through the next step's output)
    with torch.no_grad():
        nxt = ref[:, -1:].argmax(-1)
        assert rel_rms(model(nxt, got_state)[0], model(nxt, ref_state)[0]) < FWD_TOL


@needs_compile
def test_compiled_transformer_equals_eager():
    _check_family("transformer", n_layers=ONE_LAYER)


@needs_compile
def test_compiled_mamba2_over_several_chunks_equals_eager():
    """Three chunks (T = 150, chunk_size 64) and 4 heads sharing one B/C group: the grouped SSD
    kernel's stacking copies (which failed to compile when they wrote with ``out=``) and its
    inter-chunk state pass are in the graph. (Its decode step: test_generate_compiled_equals_eager.)"""
    _check_family("mamba2", T=150, d_model=64, decode=False, n_layers=ONE_LAYER)


@needs_compile
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gla", "mamba2", "mamba", "gated_deltanet", "deltanet", "titans_lmm"])
def test_compiled_model_equals_eager(name):
    _check_family(name)
    _check_family(name, T=150, d_model=32)  # several chunks, several heads


#: families whose forward is not one graph, and why: the MoE router's token-to-expert dispatch has
#: data-dependent shapes (the tokens each expert receives); CMS levels that learn from the next-token
#: loss take its gradient on a read's graph inside the forward, which runs eagerly under
#: torch.compile (``mnemo.models.task_signal``: dynamo's trace of it lost the reads' graph)
_TASK_SIGNAL = "CMS task signal: autograd.grad inside the forward runs eagerly"
BREAKS_EXPECTED = {
    "gated_deltanet_attention_moe": "MoE dispatch: data-dependent shapes",
    "hope": _TASK_SIGNAL,
    "hope_attention": _TASK_SIGNAL,
    "hope_long": _TASK_SIGNAL,
    "hope_paper": _TASK_SIGNAL,
}


def _graph_breaks(name: str, T: int) -> list[str]:
    """Every graph break of the forward: the reasons dynamo gives, and one entry per break it gives
    none for (a call of a function dynamo skips, e.g. ``torch.compiler.disable``d)."""
    torch._dynamo.reset()
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(1))
    ex = torch._dynamo.explain(_model(name, n_layers=ONE_LAYER))(ids)
    reasons = [str(b.reason).splitlines()[0] for b in ex.break_reasons]
    return reasons + ["(no reason given)"] * max(0, ex.graph_break_count - len(reasons))


#: one family per code path that could break a graph (chunk forms, native kernels, memory
#: updates, sinks); the rest run with ``slow`` (dynamo's trace costs ~5 s per family on 2 cores)
TRACE_DEFAULT = {"gla", "gated_deltanet", "mamba", "mamba2", "titans_lmm", "transformer_sinks"}


@pytest.mark.parametrize(
    "name",
    [
        n if n in TRACE_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(set(model_names()) - set(BREAKS_EXPECTED))
    ],
)
def test_the_training_forward_traces_as_one_graph(name):
    """No graph break in any family's forward (dynamo's trace only, no inductor: fast). The native
    CPU kernels, data-dependent checks (decay spans, clamps) and ``out=`` writes into views step
    aside while torch.compile traces (the PyTorch forms run); ``T = 20`` spans chunks of the chunk
    forms (chunk_size 64 clipped to T) and the one-token path is the decode test above."""
    assert _graph_breaks(name, 20) == []


def test_the_fla_custom_ops_trace_in_the_training_graph():
    """With fla forced (on the meta device: the custom ops' fake kernels, what a CUDA run with
    fla-core traces), gated DeltaNet's training forward and loss are one graph, no break, with one
    ``mnemo::gated_delta_rule_fla`` node per layer (``scripts/graph_breaks.py`` for every preset)."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core not installed")
    path = Path(__file__).parents[2] / "scripts" / "graph_breaks.py"
    spec = importlib.util.spec_from_file_location("graph_breaks", path)
    graph_breaks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph_breaks)

    ex = graph_breaks.explain("gated_deltanet", device="meta", backend="fla")
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in ex.break_reasons]
    targets = [str(n.target) for n in ex.graphs[0].graph.nodes if n.op == "call_function"]
    assert graph_breaks._custom_ops(ex) == 2, targets
    assert targets.count("mnemo.gated_delta_rule_fla.default") == 2, targets


def test_dynamo_never_reaches_the_native_library_while_tracing(monkeypatch):
    """A fresh process builds the C kernels on the first ``_native.library()`` call, under a lock
    dynamo cannot trace (it broke ``mnemo train --compile``'s graph 7 times for gated DeltaNet): while
    compiling, the dispatch refuses the native backend before asking for the library."""
    from mnemo.ops import _native, dispatch

    def no_library():
        raise AssertionError("library() called while tracing")

    monkeypatch.setattr(_native, "library", no_library)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    call = dispatch.Call("gated_delta_rule", torch.device("cpu"), (torch.float32,), "chunk", 20, 16)
    assert "torch.compile traces" in dispatch._problem("gated_delta_rule", "native", call)


# ------------------------------------------------------------------------------------------------
# generate(compile=True): the one-token decode step under torch.compile
# ------------------------------------------------------------------------------------------------


def _greedy(model, ids, n, **kw):
    return model.generate(ids, n, temperature=0.0, **kw)


@needs_compile
def test_generate_compiled_equals_eager():
    """Mamba-2 (a fixed-size state: one graph for every step): greedy tokens from the compiled
    prefill and step equal eager decoding's for two prompt lengths, the compiled functions really
    ran (dynamo counted their graphs), and the compiled prefill's logits and state are eager's."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    import mnemo.models.lm as lm
    from mnemo.layers.state import tensors

    counters.clear()
    model = _model("mamba2", n_layers=ONE_LAYER)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 32, (3, T), generator=gen) for T in (9, 13)]
    import warnings

    with warnings.catch_warnings():  # a failed compile (eager fallback) must not pass for a compiled run
        warnings.filterwarnings("error", message=r"generate\(compile=True\)")
        for ids in prompts:
            assert torch.equal(_greedy(model, ids, 12, compile=True), _greedy(model, ids, 12))
    assert counters["stats"]["unique_graphs"] >= 2  # the prefill's and the step's
    assert model.training  # generate restores the mode
    model.eval()
    with torch.no_grad():
        for ids in prompts:
            (lc, sc), (le, se) = lm._compiled(model, "prefill")(model, ids), model(ids)
            assert rel_rms(lc, le) < 1e-5
            assert [b.offset for b in sc] == [b.offset for b in se] == [ids.shape[1]] * len(se)
            got, want = tensors(sc), tensors(se)
            assert len(got) == len(want) > 0 and all(rel_rms(a, b) < 1e-5 for a, b in zip(got, want))


def test_a_model_whose_memories_take_gradients_inside_its_forward_trains_compiled():
    """``hope`` (self-modifying Titans, CMS levels that learn from the next-token loss: an
    ``autograd.grad`` on a read's graph inside the forward) under ``torch.compile``: the loss and
    every parameter's gradient are eager's. (Dynamo traced the read and the gradient into a graph
    whose loss was not connected to the reads: "appears to not have been used in the graph".)"""
    torch._dynamo.reset()
    model = _model("hope", n_layers=ONE_LAYER)
    ids = torch.randint(0, 32, (2, 21), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(f):
        model.zero_grad(set_to_none=True)
        loss, _ = f(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want_loss, want = loss_and_grads(model)
    got_loss, got = loss_and_grads(torch.compile(model, backend="aot_eager"))
    assert rel_rms(got_loss, want_loss) < 1e-6
    assert len(got) == len(want) > 0 and all(rel_rms(a, b) < 1e-5 for a, b in zip(got, want))
    torch._dynamo.reset()


# generate(compile=True) of hope (memories that take gradients while decoding): its tokens, no eager
# fallback, and each graph made once are tests/models/test_hope_compiled_recompiles_46.py's


@needs_compile
@pytest.mark.slow
def test_generate_compiled_equals_eager_with_a_growing_cache_and_padding():
    """Softmax attention: the KV cache grows every step (dynamo's dynamic shapes), and left-padded
    prompts of two lengths decode per group (two batch sizes)."""
    torch._dynamo.reset()
    model = _model("transformer", n_layers=ONE_LAYER)
    ids = torch.randint(1, 32, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    import warnings

    with warnings.catch_warnings():  # a failed compile (eager fallback) must not pass for a compiled run
        warnings.filterwarnings("error", message=r"generate\(compile=True\)")
        assert torch.equal(_greedy(model, ids, 10, compile=True), _greedy(model, ids, 10))
        want = _greedy(model, ids, 6, attention_mask=mask)
        assert torch.equal(_greedy(model, ids, 6, attention_mask=mask, compile=True), want)


def test_generate_compile_falls_back_to_eager_when_compiling_fails(monkeypatch):
    """No C compiler (or an unsupported op): the first compiled call raises a RuntimeError
    subclass before running anything; generate warns once, naming the error, and decodes eagerly
    with the same tokens."""
    import mnemo.models.lm as lm

    calls = []

    def broken(model, ids, state=None):
        calls.append(ids.shape)
        error = RuntimeError("no C compiler found")
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, error, None)

    monkeypatch.setattr(lm, "_compiled", lambda model, kind, batch=None: broken)
    model = _model("gla")
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    with pytest.warns(
        RuntimeWarning, match="torch.compile failed .*no C compiler found.*running eagerly"
    ) as rec:
        got = _greedy(model, ids, 6, compile=True)
    assert torch.equal(got, _greedy(model, ids, 6))
    assert len(calls) == 1  # tried once (the prefill), then eager for the rest
    assert len(rec) == 1 and rec[0].filename == __file__  # names the caller of generate()


def test_generate_compile_falls_back_when_a_later_step_fails_to_compile(monkeypatch):
    """A later step can compile too (a growing KV cache, another batch size): its failure also
    falls back (once, with the warning); an error that is not a compilation error (here a
    ValueError) propagates unchanged, without a warning."""
    import mnemo.models.lm as lm

    n = []

    def second_fails(model, ids, state=None):
        n.append(1)
        if len(n) == 2:
            raise torch._dynamo.exc.Unsupported("an op dynamo cannot trace")
        return lm._one_token(model, ids, state)

    monkeypatch.setattr(lm, "_compiled", lambda model, kind, batch=None: second_fails)
    model = _model("gla")
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    with pytest.warns(RuntimeWarning, match="Unsupported: an op dynamo cannot trace"):
        got = _greedy(model, ids, 6, compile=True)
    assert torch.equal(got, _greedy(model, ids, 6)) and len(n) == 2

    def bad(model, ids, state=None):
        raise ValueError("input_ids: not this")

    monkeypatch.setattr(lm, "_compiled", lambda model, kind, batch=None: bad)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="input_ids: not this"):
            _greedy(model, ids, 3, compile=True)


def test_generate_compile_uses_the_compiled_step_and_checks_its_argument(monkeypatch):
    import mnemo.models.lm as lm

    seen = []

    def spy(kind):
        def fn(model, ids, state=None):
            seen.append((kind, ids.shape[1], state is None))
            return lm._one_token(model, ids, state)

        return fn

    monkeypatch.setattr(lm, "_compiled", lambda model, kind, batch=None: spy(kind))
    model = _model("gla")
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_greedy(model, ids, 4, compile=True), _greedy(model, ids, 4))
    # the prefill of the 5-token prompt, then every decode step after the first new token
    assert seen == [("prefill", 5, True)] + [("step", 1, False)] * 3
    with pytest.raises(ValueError, match="compile: expected True or False, got 'yes'"):
        model.generate(ids, 2, compile="yes")


@needs_compile
@pytest.mark.parametrize("kernel", ["native", "twin"])
def test_compiled_selective_scan_over_several_blocks_matches_float64(kernel, monkeypatch):
    """The selective scan under inductor, by each of its opaque custom-op pairs: the C kernel
    (``mnemo::selective_scan_native``, where the native library builds) and its PyTorch twin
    (``mnemo::selective_scan_blocks``, ``MNEMO_NATIVE=0``; its ``out=`` writes into block views
    were mis-compiled, the dt and A gradients 5-11% off). Several 16-token blocks plus a partial
    one, an initial state, groups, with and without the skip ``D``, the gate ``z`` and the step
    bias; every gradient within float32 rounding of a float64 eager run, as eager float32 is. The
    native kernel runs inside the one compiled graph (no break, both entry points called), the
    twin's run calls no kernel."""
    from torch._dynamo.utils import counters

    from mnemo.ops import _native, selective_scan

    if kernel == "native" and _native.library() is None:
        pytest.skip("native CPU kernels unavailable")
    if kernel == "twin":
        monkeypatch.setenv("MNEMO_NATIVE", "0")
    calls = spy_native_calls(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    Bsz, T, D, G, N = 2, 70, 8, 2, 4
    x64 = {
        "u": torch.randn(Bsz, T, D, generator=gen, dtype=torch.float64),
        "delta": torch.randn(Bsz, T, D, generator=gen, dtype=torch.float64) - 1.0,
        "A": -(0.5 * torch.randn(D, N, generator=gen, dtype=torch.float64)).exp(),
        "B": torch.randn(Bsz, T, G, N, generator=gen, dtype=torch.float64),
        "C": torch.randn(Bsz, T, G, N, generator=gen, dtype=torch.float64),
        "h0": torch.randn(Bsz, D, N, generator=gen, dtype=torch.float64),
    }
    extras = {
        "D": torch.randn(D, generator=gen, dtype=torch.float64),
        "z": torch.randn(Bsz, T, D, generator=gen, dtype=torch.float64),
        "delta_bias": 0.5 * torch.randn(D, generator=gen, dtype=torch.float64),
    }

    def f(u, delta, A, B, C, h0, **kw):
        kw.update(delta_softplus=True, initial_state=h0, output_final_state=True, chunk_size=16)
        y, h = selective_scan(u, delta, A, B, C, **kw)
        return y, h

    def run(fn, inputs, dtype):
        leaves = {k: v.to(dtype).clone().requires_grad_() for k, v in inputs.items()}
        y, h = fn(**leaves)
        (y.square().sum() + (h * h.detach().sign()).sum()).backward()
        return [y.detach(), h.detach(), *(leaves[k].grad for k in inputs)]

    for given in ({}, extras):
        inputs = {**x64, **given}
        ref = run(f, inputs, torch.float64)
        eager = run(f, inputs, torch.float32)
        torch._dynamo.reset()
        counters.clear()
        calls.clear()
        compiled = run(torch.compile(f), inputs, torch.float32)
        what = f"{kernel}, {'with' if given else 'without'} D, z, delta_bias"
        if kernel == "native":
            assert calls == ["ss_fwd", "ss_bwd"], f"{what}: native kernel calls {calls}"
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], what
        else:
            assert calls == [], f"{what}: native kernel called with MNEMO_NATIVE=0"
        for name, r, e, c in zip(["y", "h_T", *inputs], ref, eager, compiled):
            r = r.float()
            assert rel_rms(e, r) < 1e-5, f"eager {name} ({what})"
            assert c is not None, f"compiled: no gradient for {name} ({what})"
            assert rel_rms(c, r) < 1e-5, f"compiled {name} ({what}): {rel_rms(c, r):.2e}"
    torch._dynamo.reset()  # (graphs traced under this test's MNEMO_NATIVE)


def test_each_model_gets_its_own_compiled_step():
    """One compiled prefill and one compiled decode step per model, each with a code object of its
    own: dynamo's cache (and its recompile_limit of 8 graphs) is per code object, so a step shared
    by every model ran out after a few families in one process and decoded eagerly, silently.
    Dropped with the model."""
    import gc

    import mnemo.models.lm as lm

    a, b = _model("gla"), _model("mamba2")
    fa, fb = lm._compiled(a, "step"), lm._compiled(b, "step")
    pa = lm._compiled(a, "prefill")
    assert lm._compiled(a, "step") is fa and lm._compiled(a, "prefill") is pa and fa is not fb
    code = [f._torchdynamo_orig_callable.__code__ for f in (fa, fb, pa)]
    assert len({id(c) for c in code}) == 3
    assert code[0] is not lm._one_token.__code__ and code[2] is not lm._prefill.__code__
    assert code[0].co_code == lm._one_token.__code__.co_code
    assert code[2].co_code == lm._prefill.__code__.co_code
    n = len(lm._compiled_fns)
    del a, fa, pa
    gc.collect()
    assert len(lm._compiled_fns) == n - 1


def _step_rewrites(model, batch: int, step=None) -> int:
    """Rewrites the pass makes when ``model``'s compiled step (``step``, default the one
    ``generate`` uses for ``batch`` rows) first runs at ``batch`` rows; the logits must equal the
    eager step's."""
    from torch._dynamo.utils import counters

    import mnemo.models.lm as lm

    step = step or lm._compiled(model, "step", batch)
    ids = torch.randint(0, 32, (batch, 5), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        _, state = model(ids[:, :4])
        ref, _ = model(ids[:, 4:], state)
        _, state = model(ids[:, :4])
        counters.clear()
        out, _ = step(model, ids[:, 4:], state)
    assert rel_rms(out, ref) < FWD_TOL
    return counters["inductor"]["mnemo_matvec"]


@needs_compile
def test_the_compiled_step_writes_small_matrix_products_as_multiply_sums():
    """Issue 40 item 3: MKL's matrix-vector product reads weights at a fifth of this machine's
    bandwidth, so the compiled decode step rewrites each CPU product of at most ``MAX_ROWS`` rows
    as a multiply and a sum (``counters["inductor"]["mnemo_matvec"]`` counts the rewrites; above
    the limit the BLAS call stays). The rewrite needs a static batch dimension, so each batch size
    up to the limit gets a step of its own: batch 1, then 8, then 2 on one model all rewrite, and
    9 and 12 share one step that does not. The logits equal the eager step's every time."""
    import mnemo.models.lm as lm
    from mnemo.models import _matvec

    assert _matvec.MAX_ROWS == 8  # the batches below straddle it
    model = _model("gla", n_layers=ONE_LAYER).eval()
    try:
        for batch in (1, 8, 2):
            assert _step_rewrites(model, batch) > 0, batch
        assert _step_rewrites(model, 9) == 0 and _step_rewrites(model, 12) == 0
        shared = lm._compiled(model, "step")
        assert lm._compiled(model, "step", 9) is shared and lm._compiled(model, "step", 12) is shared
        assert lm._compiled(model, "step", 2) is not lm._compiled(model, "step", 8)
    finally:
        torch._dynamo.reset()


@needs_compile
def test_a_models_first_batch_size_is_static_whatever_other_models_saw():
    """Dynamo records which dimensions changed between calls per code name, not per code object:
    each compiled function's code has a name of its own, so a step that has seen two batch sizes
    (model A at 2, then 3: now dynamic, no rewrite) does not make model B's first batch size
    dynamic (B at 2 rewrites)."""
    import mnemo.models.lm as lm

    a, b = _model("gla", n_layers=ONE_LAYER).eval(), _model("gla", n_layers=ONE_LAYER).eval()
    try:
        shared = lm._compile_kind("step")
        assert _step_rewrites(a, 2, shared) > 0
        assert _step_rewrites(a, 3, shared) == 0  # the second batch size: dynamic
        assert _step_rewrites(b, 2, lm._compile_kind("step")) > 0
    finally:
        torch._dynamo.reset()


@needs_compile
@pytest.mark.parametrize("bias", [False, True])
def test_the_multiply_sum_is_the_matrix_product(bias):
    """The rewrite on its own: a compiled ``F.linear`` (``aten.mm``; with a bias ``aten.addmm``)
    for 1, 3 and 8 rows, float32 and float64, against the eager product, rewritten once per
    graph; 9 rows are left to BLAS."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from mnemo.models._matvec import MatvecPass

    g = torch.Generator().manual_seed(0)
    for rows, dtype in ((1, torch.float32), (3, torch.float64), (8, torch.float32), (9, torch.float32)):
        x = torch.randn(rows, 40, generator=g, dtype=dtype)
        w = torch.randn(24, 40, generator=g, dtype=dtype)
        b = torch.randn(24, generator=g, dtype=dtype) if bias else None
        counters.clear()
        fn = torch.compile(
            lambda x, w, b: F.linear(x, w, b), options={"post_grad_custom_pre_pass": MatvecPass()}
        )
        try:
            out = fn(x, w, b)
        finally:
            torch._dynamo.reset()
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert rel_rms(out, x @ w.t() + (0 if b is None else b)) < tol, (rows, dtype)
        n = counters["inductor"]["mnemo_matvec"]
        assert n == (1 if rows <= 8 else 0), (rows, dict(counters["inductor"]))


@needs_compile
@pytest.mark.parametrize("bias", [False, True])
def test_large_enough_products_of_two_rows_or_more_go_to_the_kernel(bias, monkeypatch):
    """A compiled ``F.linear`` whose weight has at least ``KERNEL_MIN_WEIGHT`` elements, in a graph
    that reads ``KERNEL_MIN_STEP_BYTES`` of weights: 2 and 8 rows become
    ``torch.ops.mnemo.small_mm`` (the C kernel, seen by a spy on the native call), 1 row the
    multiply-sum; with ``MNEMO_NATIVE=0``, ``MatvecPass(kernel=False)`` or a graph whose weights
    stay under ``KERNEL_MIN_STEP_BYTES`` (they fit in the cache) every row count up to 8 is a
    multiply-sum. The values are the eager product's each time."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from mnemo.models._matvec import MatvecPass
    from mnemo.ops import _native
    from mnemo.ops import small_mm as sm

    if _native.library() is None:
        pytest.skip("native kernels unavailable")
    ran = spy_native_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    K, N = 256, 300
    assert K * N >= sm.KERNEL_MIN_WEIGHT and sm.KERNEL_MIN_ROWS == 2
    monkeypatch.setattr(sm, "KERNEL_MIN_STEP_BYTES", K * N * 4)  # this one weight is the whole step
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    for native, kernel, step_min in (("1", True, 1), ("0", True, 1), ("1", False, 1), ("1", True, 2)):
        monkeypatch.setenv("MNEMO_NATIVE", native)
        monkeypatch.setattr(sm, "KERNEL_MIN_STEP_BYTES", step_min * K * N * 4)
        for rows in (1, 2, 8):
            x = torch.randn(rows, K, generator=g)
            counters.clear()
            ran.clear()
            fn = torch.compile(
                lambda x, w, b: F.linear(x, w, b),
                options={"post_grad_custom_pre_pass": MatvecPass(kernel=kernel)},
            )
            try:
                with torch.no_grad():
                    out = fn(x, w, b)
            finally:
                torch._dynamo.reset()
            assert rel_rms(out, x @ w.t() + (0 if b is None else b)) < 1e-6, (native, kernel, rows)
            to_kernel = native == "1" and kernel and step_min == 1 and rows >= 2
            assert counters["inductor"]["mnemo_matvec"] == 1
            assert counters["inductor"]["mnemo_small_mm"] == int(to_kernel), (native, kernel, rows)
            assert ran == (["smm_fwd"] if to_kernel else []), (native, kernel, rows)


@needs_compile
def test_products_the_kernel_cannot_take_stay_multiply_sums(monkeypatch):
    """With every threshold lowered to 0, the pass still keeps a product out of the kernel when its
    operands are not what the kernel reads: an ``addmm`` bias of shape ``[M, N]`` or ``[1, N]``
    (the kernel adds a ``[N]`` bias), a right operand stored ``[K, N]`` contiguous (not a weight
    seen through its transpose). Each stays a multiply-sum with the eager values."""
    from torch._dynamo.utils import counters

    from mnemo.models._matvec import MatvecPass
    from mnemo.ops import _native
    from mnemo.ops import small_mm as sm

    if _native.library() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("MNEMO_NATIVE", "1")
    for name in ("KERNEL_MIN_WEIGHT", "KERNEL_MIN_STEP_BYTES"):
        monkeypatch.setattr(sm, name, 0)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 24, generator=g), torch.randn(40, 24, generator=g)
    cases = {
        "bias [M, N]": (lambda x, w, b: torch.addmm(b, x, w.t()), torch.randn(4, 40, generator=g)),
        "bias [1, N]": (lambda x, w, b: torch.addmm(b, x, w.t()), torch.randn(1, 40, generator=g)),
        "w [K, N] contiguous": (lambda x, w, b: x @ b, torch.randn(24, 40, generator=g)),
    }
    for what, (f, b) in cases.items():
        counters.clear()
        fn = torch.compile(f, options={"post_grad_custom_pre_pass": MatvecPass()})
        try:
            with torch.no_grad():
                out = fn(x, w, b)
        finally:
            torch._dynamo.reset()
        assert rel_rms(out, f(x, w, b)) < 1e-6, what
        assert counters["inductor"]["mnemo_matvec"] == 1, what
        assert counters["inductor"]["mnemo_small_mm"] == 0, what


@needs_compile
def test_the_compiled_step_of_a_batch_calls_the_kernel(monkeypatch):
    """A whole decode step at batch 2 with the weight thresholds lowered to 0 (the test models are
    tiny): its products go to the kernel (each rewritten product ran it once, seen by a spy on the
    native call), and its logits equal the eager step's; at batch 1 none does."""
    from mnemo.ops import _native
    from mnemo.ops import small_mm as sm

    if _native.library() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("MNEMO_NATIVE", "1")
    monkeypatch.setattr(sm, "KERNEL_MIN_WEIGHT", 0)
    monkeypatch.setattr(sm, "KERNEL_MIN_STEP_BYTES", 0)
    from torch._dynamo.utils import counters

    ran = spy_native_calls(monkeypatch)
    model = _model("gla", n_layers=ONE_LAYER).eval()
    try:
        assert _step_rewrites(model, 2) > 0
        assert counters["inductor"]["mnemo_small_mm"] > 0
        assert ran.count("smm_fwd") == counters["inductor"]["mnemo_small_mm"]  # each ran once
        assert _step_rewrites(model, 1) > 0
        assert counters["inductor"]["mnemo_small_mm"] == 0
    finally:
        torch._dynamo.reset()


@needs_compile
@pytest.mark.parametrize("beta,alpha", [(0.5, 1.0), (1.0, 2.0), (0.0, 3.0)])
def test_a_scaled_addmm_is_left_to_blas(beta, alpha):
    """``addmm(b, x, w, beta=, alpha=)`` with a scale other than 1: the pattern does not name the
    scales, so the rewrite would drop them; it is skipped and the result is exact."""
    from torch._dynamo.utils import counters

    from mnemo.models._matvec import MatvecPass

    g = torch.Generator().manual_seed(1)
    b, x, w = torch.randn(24, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, 24, generator=g)
    counters.clear()
    fn = torch.compile(
        lambda b, x, w: torch.addmm(b, x, w, beta=beta, alpha=alpha),
        options={"post_grad_custom_pre_pass": MatvecPass()},
    )
    try:
        out = fn(b, x, w)
    finally:
        torch._dynamo.reset()
    assert rel_rms(out, beta * b + alpha * (x @ w)) < 1e-5
    assert counters["inductor"]["mnemo_matvec"] == 0


def test_without_the_custom_pass_interface_the_step_compiles_plainly(monkeypatch):
    """A torch whose inductor lacks the custom post-grad pass interface (the pass module cannot be
    imported): no options, one step for every batch size, BLAS products (no rewrite), the same
    logits, not an import error."""
    import sys

    import mnemo.models.lm as lm

    pytest.importorskip("torch._inductor.custom_graph_pass")  # else the fallback is the only path
    assert lm._decode_options() is not None
    monkeypatch.setitem(sys.modules, "mnemo.models._matvec", None)  # import raises ImportError
    assert lm._decode_options() is None
    model = _model("gla", n_layers=ONE_LAYER).eval()
    assert lm._compiled(model, "step", 1) is lm._compiled(model, "step", 2) is lm._compiled(model, "step")
    if _compile_works():
        try:
            assert _step_rewrites(model, 1, lm._compile_kind("step")) == 0
        finally:
            torch._dynamo.reset()

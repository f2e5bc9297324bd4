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

import pytest
import torch

from mnemo.models import LanguageModel, build_config, model_names
from tests.helpers import rel_rms

pytestmark = pytest.mark.filterwarnings("ignore")

FWD_TOL, GRAD_TOL = 1e-5, 1e-4


def _compile_works() -> bool:
    from mnemo.bench.models import compile_available

    return compile_available()[0]


needs_compile = pytest.mark.skipif(not _compile_works(), reason="torch.compile unavailable here")


def _model(name: str) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=32, d_model=16, n_layers=2))


def _check_family(name: str, T: int = 20) -> None:
    torch._dynamo.reset()
    model = _model(name)
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
    _check_family("transformer")


@needs_compile
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gla", "mamba2", "mamba", "gated_deltanet", "deltanet", "titans_lmm"])
def test_compiled_model_equals_eager(name):
    _check_family(name)


#: families whose forward is not one graph, and why: the MoE router's token-to-expert dispatch has
#: data-dependent shapes (the tokens each expert receives)
BREAKS_EXPECTED = {"gated_deltanet_attention_moe": "MoE dispatch: data-dependent shapes"}


def _graph_breaks(name: str, T: int) -> list[str]:
    torch._dynamo.reset()
    ids = torch.randint(0, 32, (2, T), generator=torch.Generator().manual_seed(1))
    ex = torch._dynamo.explain(_model(name))(ids)
    return [str(b.reason).splitlines()[0] for b in ex.break_reasons]


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

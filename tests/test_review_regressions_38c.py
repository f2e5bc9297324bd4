"""Regression review of b46127f (memory: the reference under inference_mode, MemorySpec checks) and
9694b73 (nested: Newton-Schulz prescale, state checks, meta CMS pieces): what those fixes missed.
Each test failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.cms import ContinuumMemory
from mnemo.layers.self_modifying import SelfModifyingTitans
from mnemo.memory import MemorySpec, neural_memory, preset
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close, memory_gates


@pytest.mark.parametrize("p", [1.0, 1.5])
def test_lp_eps_whose_square_is_zero_in_float32_is_refused(p):
    """38-M refused ``lp_eps = 0`` below ``p = 2`` (NaN at an exact fit), but the engine adds
    ``lp_eps²`` to a float32 tensor: ``lp_eps = 1e-25`` passed the check, its square is 0 there and
    the exact fit gave NaN all the same."""
    with pytest.raises(ValueError, match=r"MemorySpec\.lp_eps: expected a nonzero number"):
        MemorySpec(objective="lp", p=p, lp_eps=1e-25, retention="none").validate()
    # the smallest accepted ε: an exact fit (zero memory, zero values) stays finite in float32
    spec = MemorySpec(objective="lp", p=p, lp_eps=2.0**-63, retention="none").validate()
    q = torch.randn(1, 4, 1, 3)
    z = torch.zeros(1, 4, 1, 3)
    for mode in ("chunk", "recurrent"):
        o, st = neural_memory(spec, q, z, z, torch.full((1, 4, 1), 0.5), mode=mode, output_final_state=True)
        assert torch.isfinite(o).all() and all(torch.isfinite(w).all() for w in st.weights), mode


@pytest.mark.parametrize("spec", ["titans", "ttt_linear"])
def test_chunk_form_takes_a_gradient_from_a_state_made_under_inference_mode(spec):
    """38-M let the reference run from a state carried out of ``torch.inference_mode`` (copies), but
    the chunk form of the same call (``T > 1``) raised "Inference tensors cannot be saved for
    backward" when a gradient was wanted from that state."""
    s = preset(spec, chunk_size=4)
    B, T, H, K = 1, 6, 2, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    kw = memory_gates(s, B, T, H, gen)
    with torch.no_grad():
        _, ref_state = neural_memory(s, q, k, v, output_final_state=True, **kw)
    with torch.inference_mode():
        _, st = neural_memory(s, q, k, v, output_final_state=True, **kw)
    grads = []
    for state in (ref_state, st):
        qq = q.clone().requires_grad_()
        o, _ = neural_memory(s, qq, k, v, initial_state=state, mode="chunk", **kw)
        (g,) = torch.autograd.grad(o.square().sum(), qq)
        grads.append(g)
    assert_close(grads[1], grads[0], 1e-12, what=f"{spec} gradient from an inference-mode state")


@pytest.mark.parametrize("adaptive_q", [False, True])
def test_self_modifying_titans_decodes_under_inference_mode(adaptive_q):
    """38-M made one-token decoding run under ``torch.inference_mode`` for the engine's memories; the
    self-modifying Titans mixer (hope's) takes its token step's gradient with autograd too, and
    raised "element 0 of tensors does not require grad" on every token under it (and "Setting
    requires_grad=True on inference tensor" from an inference-mode prefill under no_grad)."""
    torch.manual_seed(0)
    m = SelfModifyingTitans(16, n_heads=2, chunk_size=2, adaptive_q=adaptive_q, momentum=0.5).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        full, _ = m(x)
    outs = []
    with torch.inference_mode():
        y, s = m(x[:, :3])
        outs.append(y)
        for t in range(3, 5):
            y, s = m(x[:, t : t + 1], s)
            outs.append(y)
    with torch.no_grad():  # on from the inference-mode state
        for t in range(5, 7):
            y, s = m(x[:, t : t + 1], s)
            outs.append(y)
    assert_close(torch.cat(outs, 1), full, 1e-10, what="self-modifying Titans decoding under inference_mode")


@pytest.mark.parametrize("meta", ["unrolled", "first_order"])
def test_meta_learned_nested_cms_runs_under_inference_mode(meta):
    """The meta-learned nested CMS (9694b73 placed its pieces) takes a slower level's step by
    autograd (:func:`meta_gradient`): under ``torch.inference_mode`` every call in which a slower
    level stepped raised "element 0 of tensors does not require grad"."""
    torch.manual_seed(0)
    m = ContinuumMemory(16, transfer="nested", meta=meta).double()
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    with torch.no_grad():
        full, _ = m(x)
    outs = []
    with torch.inference_mode():
        y, s = m(x[:, :30])
        outs.append(y)
        for t in range(30, 34):  # the 32nd token ends a period of every slower level
            y, s = m(x[:, t : t + 1], s)
            outs.append(y)
    with torch.no_grad():
        y, _ = m(x[:, 34:], s)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full, 1e-10, what=f"nested CMS ({meta}) under inference_mode")


@pytest.mark.parametrize("meta", ["unrolled", "first_order", "none"])
def test_meta_nested_cms_fastest_level_hook_state_is_the_state_after_the_call(meta):
    """9694b73 placed the fastest level's pieces in the call, so ``run_with_cache`` keeps the last
    piece's ``hook_state`` as "the state after the call"; but that state fired before the piece's
    restart from the slower level, so a call ending on a slower level's period boundary cached (and
    an ``ablate_state`` zeroed) a state the call then overwrote. ``meta="none"`` (the restarts
    inside the level's own call) was right."""
    opts = {"levels": [{"period": 2}, {"period": 4}], "transfer": "nested", "meta": meta}
    cfg = build_config(
        "hope_attention_reconstruction", vocab_size=23, d_model=16, n_layers=1, mlp_options=opts
    )
    torch.manual_seed(0)
    m = LanguageModel(cfg).double()
    ids = torch.randint(0, 23, (2, 8), generator=torch.Generator().manual_seed(1))
    for n in (6, 8):  # ends inside the slower level's period / on its boundary (a restart)
        logits, cache = m.run_with_cache(ids[:, :n], ["hook_state"])
        out, state = m(ids[:, :n])
        torch.testing.assert_close(logits, out, rtol=0, atol=0)
        cached, returned = cache["blocks.0.mlp.levels.0.hook_state"], state[0].mlp.levels[0]
        assert cached.position == returned.position == n
        for a, b in zip(cached.weights, returned.weights):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

"""``generate(compile=True)`` of ``hope`` compiles each frame once per kind (prefill, step): the
decode states keep one layout and the stream counters are symbolic from the first step (helper 46c).

Before, dynamo made 28 graphs (19 recompiles) for 12 tokens of a tiny ``hope``: the counters
(``offset``, a CMS level's ``position``, ``updates``) specialised at the first step and made dynamic
at the second, the prompt's state held expanded (stride-0) initial weights and, at a chunk start,
a memory's running and chunk-start weights in one tensor, and the settling of the kept steps traced
``_add_outer`` alone per shape and sign."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from mnemo.models import LanguageModel, build_config
from mnemo.models.lm import _steady_layout

#: graphs of the tiny hope below (prompt 11, 16 new tokens), measured with torch 2.13 (``aot_eager``):
#: the prompt's and the decode step's (its frames split by the eager DGD steps of the self-modifying
#: Titans and the eager signal of the CMS levels). Before helper 46c: 28 graphs (19 recompiles) for
#: 12 new tokens of the same prompt
GRAPHS = 12


def _aot_eager(monkeypatch):
    compile_ = torch.compile

    def compile_aot_eager(fn=None, **kwargs):
        return compile_(fn, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_aot_eager)


class _Recompiles(logging.Handler):
    """The messages of dynamo's ``recompiles`` log (one per recompiled frame)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_hope_generate_compiled_makes_each_graph_once(monkeypatch):
    """``generate(compile=True)`` of ``hope`` (its self-modifying Titans' one-token DGD step takes
    ``autograd.grad``, and its CMS levels the next-token loss's gradient when a segment completes:
    in the prompt, at position 8, and at positions 16 and 24 while decoding): no error, no eager
    fallback, and eager's greedy tokens; no graph nor recompile after the first decode step (the
    prompt and the first step trace every frame; the later steps reuse them, the completed segments
    and the main memory's chunk start at 16, whose running and chunk-start weights were one tensor,
    included); ``GRAPHS`` graphs in all. Traced with ``aot_eager`` (dynamo's capture, where the
    failures were). (It replaces ``test_compile.py``'s
    ``test_generate_compiled_runs_memories_that_take_gradients``.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    _aot_eager(monkeypatch)
    counters.clear()
    torch.manual_seed(0)
    model = LanguageModel(build_config("hope", vocab_size=32, d_model=16, n_layers=1))
    ids = torch.randint(0, 32, (2, 11), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, 16, temperature=0.0)

    handler = _Recompiles()
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    seen = []  # per token: (graphs so far, recompiles so far)
    try:
        with warnings.catch_warnings():
            # a failed compile (the eager fallback's warning) must not pass for a compiled run
            warnings.filterwarnings("error", message=r"generate\(compile=True\)")
            got = model.generate(
                ids,
                16,
                temperature=0.0,
                compile=True,
                on_token=lambda _: seen.append((counters["stats"]["unique_graphs"], len(handler.messages))),
            )
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert len(seen) == 16
    # seen[k] is taken after the prompt (k = 0) or decode step k: nothing new from step 2 on
    assert all(s == seen[1] for s in seen[1:]), (seen, handler.messages)
    assert seen[-1][0] == GRAPHS, (seen, handler.messages)
    # the recompiles left are the first step's traces of frames the prompt traced first (another
    # input length, a state where the prompt had none), none for a counter, a stride or an alias
    assert len(handler.messages) == seen[1][1] > 0
    for word in ("offset", "position", "updates", "absorbed", "stride", "] is ", "alpha"):
        assert not any(word in m for m in handler.messages), (word, handler.messages)


def test_steady_layout_materialises_expanded_and_shared_tensors():
    """:func:`_steady_layout`: a stride-0 tensor becomes a contiguous copy, a tensor held twice in
    one state object is copied in its second field, the values are kept, and a state that needs
    nothing is returned as it is."""
    from mnemo.layers.self_modifying import SelfModifyingTitansState

    w = torch.randn(4, 3)
    ex = w.unsqueeze(0).expand(2, 4, 3)
    own = torch.randn(2, 4, 3)
    st = SelfModifyingTitansState(proj=(own, own), proj_anchor=(ex, ex), memory=(own,), memory_anchor=(own,))
    out = _steady_layout([st])[0]
    leaves = [*out.proj, *out.proj_anchor, *out.memory, *out.memory_anchor]
    assert len({id(t) for t in leaves}) == len(leaves)  # distinct tensors
    assert all(t.is_contiguous() and 0 not in t.stride() for t in leaves)
    assert out.proj[0] is own and out.offset == st.offset
    assert all(torch.equal(a, b) for a, b in zip(leaves, [own, own, ex, ex, own, own]))
    plain = SelfModifyingTitansState(
        proj=(own,), proj_anchor=(torch.randn(2, 4, 3),), memory=(), memory_anchor=()
    )
    assert _steady_layout(plain) is plain
    assert _steady_layout(None) is None


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])

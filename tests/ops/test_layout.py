"""``mnemo.ops._layout``: mnemo's layout changes are einops' ``rearrange``/``repeat``, each one node
of a dynamo graph (dynamo does not step through einops' parser), and only mnemo's own calls are
marked so."""

from __future__ import annotations

import re
from pathlib import Path

import einops
import torch

from mnemo.ops import _layout

ROOT = Path(__file__).resolve().parents[2]


def _graphs(fn, *calls, **compile_kw):
    """The FX graphs dynamo makes for ``fn`` over ``calls`` (each a tuple of arguments), and the
    compiled results."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, **compile_kw)
    out = [compiled(*args) for args in calls]
    torch._dynamo.reset()
    return graphs, out


def test_the_library_calls_einops_layout_functions_only_through_layout():
    """Every ``rearrange``/``repeat`` of mnemo's sources is ``_layout``'s (a direct einops import
    would be traced line by line under torch.compile: ~4,000 bytecodes a call)."""
    direct = re.compile(r"^\s*from einops import .*\b(rearrange|repeat)\b", re.M)
    found = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "mnemo").rglob("*.py")
        if p.name != "_layout.py" and direct.search(p.read_text())
    ]
    assert found == []


def test_each_call_is_one_graph_node_for_every_length():
    """One graph for two lengths (symbolic sizes), no break; the calls are nodes of the graph (not
    einops' reshape/permute steps traced by dynamo), and the values are eager einops'."""

    def f(x, c):
        y = _layout.rearrange(x, "b (n c) h d -> b h n c d", c=c)
        return _layout.repeat(y.sum(-1), "b h n c -> b h n (c r)", r=2)

    xs = [torch.randn(2, T, 3, 5, generator=torch.Generator().manual_seed(T)) for T in (8, 12)]
    graphs, out = _graphs(f, *[(x, 4) for x in xs], fullgraph=True, dynamic=True)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(_layout.rearrange) == 1 and targets.count(_layout.repeat) == 1
    for x, got in zip(xs, out):
        want = einops.repeat(
            einops.rearrange(x, "b (n c) h d -> b h n c d", c=4).sum(-1), "b h n c -> b h n (c r)", r=2
        )
        assert torch.equal(got, want)


def test_gradients_through_a_compiled_call_are_eagers():
    """AOTAutograd traces the graph's einops calls: the compiled value and gradient equal eager's."""

    def f(x):
        return (_layout.rearrange(x, "b (n c) d -> b n (d c)", c=3) ** 2).cumsum(1)

    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 2, 12, dtype=torch.float64)
    want = torch.autograd.grad((f(x) * w).sum(), x)[0]
    torch._dynamo.reset()
    y = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    got = torch.autograd.grad((y * w).sum(), x)[0]
    torch._dynamo.reset()
    assert torch.equal(y, f(x)) and torch.equal(got, want)


def test_a_users_own_einops_calls_are_not_marked():
    """``einops.rearrange`` itself stays as torch treats it (traced into tensor operations): only
    mnemo's wrappers are marked."""

    def f(x):
        return einops.rearrange(x, "b t d -> b d t")

    graphs, _ = _graphs(f, (torch.randn(2, 3, 4),), fullgraph=True)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert einops.rearrange not in targets and _layout.rearrange not in targets

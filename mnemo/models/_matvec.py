"""The compiled one-token decode step's small matrix products as fused multiply-sums (issue 40
item 3).

A decode step multiplies one to a few rows by every weight matrix once: it is bound by reading the
weights, not by arithmetic. On the 2-core AMD machine of ``docs/benchmarks/notes.md``
(``docs/benchmarks/matvec_cpu_2core.txt``, ``python scripts/bench_matvec.py``), MKL's
``sgemv``/``sgemm`` read 48 ``[2048, 512]`` float32 matrices at 11.0 GB/s for 1 row and 9.9 for 8
(and at 11.0 with 1 thread): 0.29 and 0.26 of the STREAM triad measured in the same rounds
(37.8 GB/s). A multiply and a sum over the shared dimension that inductor compiles into one C++
loop reads them at 26.1 GB/s for 1 row (0.69) and 12.2 for 8 (0.32). Inside whole decode steps
(d_model 512, 8 layers; ``docs/benchmarks/decode_floor_cpu_2core.txt``, the ``--blas-too`` run)
that takes the compiled step at 1 row from 0.25-0.26 of the triad to 0.58-0.67 (2.2-2.6x faster);
at 8 rows the loop rereads each weight once a row (from the L3 cache) and the gain is 1.16-1.28x
(0.22-0.23 -> 0.25-0.28).

:class:`MatvecPass` is an inductor post-grad pass (``torch.compile(options=
{"post_grad_custom_pre_pass": MatvecPass()})``) that rewrites every CPU ``aten.mm(x [M, K],
w [K, N])`` and ``aten.addmm(b, x, w)`` with a static ``M ≤ MAX_ROWS`` (float32 or float64) into
``(x[:, :, None] * w[None]).sum(-2)`` (``+ b``), the form of inductor's own
``decompose_mm_pass``, whose CPU limits (1 row, 2048 columns) are module constants: the same
product to float rounding (another summation order). Each rewrite adds 1 to dynamo's
``counters["inductor"]["mnemo_matvec"]``. ``mnemo.models.lm`` compiles
``generate(compile=True)``'s one-token step with it; training and prefill compile without it
(their products have thousands of rows, where BLAS is the right kernel). ``addmm`` with ``beta``
or ``alpha`` other than 1 is left alone. A form with the weight's rows outermost
(``(w.T[:, None, :] * x[None]).sum(-1).T``) was tried: faster for 8 rows on its own, it made whole
8-row decode steps several times slower than BLAS (an ad hoc measurement of session 27), so it is
not used.
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

aten = torch.ops.aten

#: the most rows (a one-token step's batch) whose products the pass rewrites
MAX_ROWS = 8

_PATTERNS = PatternMatcherPass(pass_name="mnemo_matvec")


def _static_rows(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if val is None or val.dim() != 2 or val.device.type != "cpu":
        return None
    rows = val.shape[0]
    return rows if isinstance(rows, int) else None


def _qualifies(x, w) -> bool:
    rows = _static_rows(x)
    if rows is None or rows > MAX_ROWS or _static_rows(w) is None:
        return False
    dtype = x.meta["val"].dtype
    return dtype in (torch.float32, torch.float64) and w.meta["val"].dtype == dtype


def _realize(*nodes) -> None:
    for node in nodes:  # keep the operands' strides: the loop reads the weight as it is stored
        if isinstance(node, torch.fx.Node):
            node.meta["inductor_realize_to_strides"] = True


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _mm_as_multiply_sum(match: Match, x, w):
    if not _qualifies(x, w):
        return

    def multiply_sum(x, w):
        return torch.sum(x[:, :, None] * w[None, :, :], dim=-2)

    match.replace_by_example(multiply_sum, [x, w])
    _realize(x, w)
    counters["inductor"]["mnemo_matvec"] += 1


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=_PATTERNS)
def _addmm_as_multiply_sum(match: Match, bias, x, w):
    if not _qualifies(x, w) or not isinstance(bias, torch.fx.Node):
        return
    scale = match.output_node().kwargs  # the pattern does not name beta and alpha: keep them 1
    if scale.get("beta", 1) != 1 or scale.get("alpha", 1) != 1:
        return

    def multiply_sum(bias, x, w):
        return torch.sum(x[:, :, None] * w[None, :, :], dim=-2) + bias

    match.replace_by_example(multiply_sum, [bias, x, w])
    _realize(x, w)
    counters["inductor"]["mnemo_matvec"] += 1


class MatvecPass(CustomGraphPass):
    """Inductor post-grad pass: CPU products of at most :data:`MAX_ROWS` static rows (float32 or
    float64) as fused multiply-sums (module docstring). Its ``uuid`` is this file's hash, so
    inductor's cache keys change with the implementation."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))

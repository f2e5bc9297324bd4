"""The compiled one-token decode step's small matrix products through a C kernel or as fused
multiply-sums (issue 40 item 3).

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
(0.22-0.23 -> 0.25-0.28). :func:`mnemo.ops.small_mm.small_mm`'s C kernel (session 31) reads each
weight row once for all rows: 1.11-1.78x the fused loop from 2 to 8 rows at d_model 512
(1.43-1.78x at 8), and no faster at 1 row, where the loop is a pure read and the kernel pays a
Python call through its op (``docs/benchmarks/notes.md``).

:class:`MatvecPass` is an inductor post-grad pass (``torch.compile(options=
{"post_grad_custom_pre_pass": MatvecPass()})``) that rewrites every CPU ``aten.mm(x [M, K],
w [K, N])`` and ``aten.addmm(b, x, w)`` with a static ``M ≤ MAX_ROWS`` (float32 or float64):

* into ``torch.ops.mnemo.small_mm(x, w.T, b)`` (the C kernel) where the graph's products read
  at least as many weight bytes as the last-level cache holds (``KERNEL_MIN_STEP_BYTES``), ``M ≥
  KERNEL_MIN_ROWS`` (2), ``w`` is an ``nn.Linear`` weight seen through its transpose (strides
  ``(1, K)``) of at least ``KERNEL_MIN_WEIGHT`` (65,536) elements, ``b`` is ``[N]``, and the native
  library builds and is enabled (``MNEMO_NATIVE``) when the step compiles (constants of
  :mod:`mnemo.ops.small_mm`); each such rewrite adds 1 to dynamo's
  ``counters["inductor"]["mnemo_small_mm"]``;
* else into ``(x[:, :, None] * w[None]).sum(-2)`` (``+ b``), the form of inductor's own
  ``decompose_mm_pass``, whose CPU limits (1 row, 2048 columns) are module constants.

Both are the same product to float rounding (another summation order). Each rewrite of either kind
adds 1 to ``counters["inductor"]["mnemo_matvec"]``. ``mnemo.models.lm`` compiles
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

from ..ops import _native
from ..ops import small_mm as _small_mm  # registers torch.ops.mnemo.small_mm

aten = torch.ops.aten

#: the most rows (a one-token step's batch) whose products the pass rewrites
MAX_ROWS = _small_mm.MAX_ROWS

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


def _is_linear_weight(w) -> bool:
    """``w`` is an ``nn.Linear`` weight seen through its transpose: ``[K, N]`` of static sizes,
    strides ``(1, K)`` (a symbolic size would make the thresholds below add guards)."""
    val = w.meta["val"]
    if not all(isinstance(n, int) for n in (*val.shape, *val.stride())):
        return False
    return val.stride() == (1, val.shape[0])


def _step_weight_bytes(graph: torch.fx.Graph) -> int:
    """Bytes of the distinct ``nn.Linear`` weights the graph's qualifying products read."""
    weights = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (aten.mm.default, aten.addmm.default):
            x, w = node.args[-2], node.args[-1]
            if isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node):
                if _qualifies(x, w) and _is_linear_weight(w):
                    val = w.meta["val"]
                    weights[w] = val.numel() * val.element_size()
    return sum(weights.values())


def _kernel_takes(x, w, bias=None) -> bool:
    """Whether the product goes to the C kernel (:func:`mnemo.ops.small_mm.small_mm`): the step's
    products read at least :data:`~mnemo.ops.small_mm.KERNEL_MIN_STEP_BYTES` of weights in all,
    ``x`` has at least :data:`~mnemo.ops.small_mm.KERNEL_MIN_ROWS` rows, ``w`` is an ``nn.Linear``
    weight seen through its transpose (``[K, N]`` with strides ``(1, K)``) of at least
    :data:`~mnemo.ops.small_mm.KERNEL_MIN_WEIGHT` elements, ``bias`` (if any) is ``[N]``, and the
    native library builds and is enabled now (else the multiply-sum form)."""
    if _graph_weight_bytes < _small_mm.KERNEL_MIN_STEP_BYTES or not _is_linear_weight(w):
        return False
    K, N = w.meta["val"].shape
    if K * N < _small_mm.KERNEL_MIN_WEIGHT:
        return False
    if _static_rows(x) < _small_mm.KERNEL_MIN_ROWS:
        return False
    if bias is not None and tuple(bias.meta["val"].shape) != (N,):
        return False
    return _use_kernel and _native.enabled() and _native.library() is not None


_use_kernel = True  # set by the MatvecPass being applied (its ``kernel``)
_graph_weight_bytes = 0  # set by the MatvecPass being applied (_step_weight_bytes of its graph)


def _realize(*nodes) -> None:
    for node in nodes:  # keep the operands' strides: the loop reads the weight as it is stored
        if isinstance(node, torch.fx.Node):
            node.meta["inductor_realize_to_strides"] = True


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=_PATTERNS)
def _mm_as_multiply_sum(match: Match, x, w):
    if not _qualifies(x, w):
        return
    if _kernel_takes(x, w):

        def kernel(x, w):
            return torch.ops.mnemo.small_mm(x, w.t(), None)

        match.replace_by_example(kernel, [x, w])
        counters["inductor"]["mnemo_matvec"] += 1
        counters["inductor"]["mnemo_small_mm"] += 1
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
    if _kernel_takes(x, w, bias):

        def kernel(bias, x, w):
            return torch.ops.mnemo.small_mm(x, w.t(), bias)

        match.replace_by_example(kernel, [bias, x, w])
        counters["inductor"]["mnemo_matvec"] += 1
        counters["inductor"]["mnemo_small_mm"] += 1
        return

    def multiply_sum(bias, x, w):
        return torch.sum(x[:, :, None] * w[None, :, :], dim=-2) + bias

    match.replace_by_example(multiply_sum, [bias, x, w])
    _realize(x, w)
    counters["inductor"]["mnemo_matvec"] += 1


class MatvecPass(CustomGraphPass):
    """Inductor post-grad pass: CPU products of at most :data:`MAX_ROWS` static rows (float32 or
    float64) through the C kernel or as fused multiply-sums (module docstring; default
    ``kernel=True``); ``kernel=False``: multiply-sums only (for benchmarks). Its ``uuid`` hashes
    this file, :mod:`mnemo.ops.small_mm`, whether the kernel is used and its thresholds, so
    inductor's cache keys change with them."""

    def __init__(self, kernel: bool = True):
        self.kernel = kernel

    def __call__(self, graph: torch.fx.Graph) -> None:
        global _use_kernel, _graph_weight_bytes
        saved = _use_kernel, _graph_weight_bytes
        _use_kernel, _graph_weight_bytes = self.kernel, _step_weight_bytes(graph)
        try:
            _PATTERNS.apply(graph)
        finally:
            _use_kernel, _graph_weight_bytes = saved

    def uuid(self):
        # what decides the rewrites beyond the files: inductor's graph cache must not hand a graph
        # compiled with the kernel off (or other thresholds) to a process with it on
        kernel = self.kernel and _native.enabled() and _native.library() is not None
        limits = (_small_mm.KERNEL_MIN_ROWS, _small_mm.KERNEL_MIN_WEIGHT, _small_mm.KERNEL_MIN_STEP_BYTES)
        extra = f"kernel={kernel},{limits}"
        return get_hash_for_files((__file__, _small_mm.__file__), extra=extra)

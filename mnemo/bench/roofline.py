"""``mnemo bench --suite roofline``: how close whole-model training and decoding come to the machine.

A benchmark, not a test: it prints tables (and optionally JSON) and asserts nothing. In **one
process**, with every timing interleaved (round ``r`` runs every task once, rotated; medians of
``--repeats`` rounds after one warm-up), it measures:

* **the machine**: the dense float32 GEMM rate ``torch.mm([M, K] × [K, N])`` at every distinct
  ``nn.Linear`` shape of the selected models with ``M = B·T`` tokens (the model's own shapes; a
  preset's *peak* is the best of its own shapes), and the memory bandwidth of a STREAM-like
  **copy** (``b ← a``, 8 bytes an element) and **triad** (``a ← b + s·c``, 12 bytes an element) on
  float32 arrays of ``2**25`` elements (128 MiB each, far beyond the caches);
* **training** (per model and ``TxB`` shape): one step = forward with the fused next-token loss
  (``LanguageModel.forward(targets=)``), backward, AdamW step. Its *real* FLOPs are counted once by
  ``torch.utils.flop_counter.FlopCounterMode`` (a ``TorchDispatchMode``) over one forward +
  backward of the step's own ``[B, T]`` batch (not one row times ``B``: the chunk forms halve their
  chunk while *any* row's gates decay too fast, so one row can run at another chunk size than the
  batch), so every matmul the step runs is counted: the projections, the MLPs, the head, and the
  chunked recurrences' own batched matmuls (``bmm``/``mm`` inside the ops) and causal SDPA
  (counted as torch counts it for the GPU kernels — backward recomputes the scores — times
  ``(T+1)/2T`` for the causal half the CPU kernel computes). Achieved FLOP/s = counted FLOPs /
  median step time; the fraction is of the preset's GEMM peak. **Not counted** (listed per model
  in the JSON's ``uncounted_ops``, by calls): element-wise work (gates, exponentials, cumulative
  sums, norms, activations, the softmax of the loss, the AdamW update), short convolutions
  (counted where they run as ``aten.convolution``), triangular solves and other ``linalg`` ops,
  opaque custom kernels (the selective scan's C kernel). ``6·N·T`` (N parameters) is shown beside
  it as the usual estimate;
* **decoding** (per model and ``--gen-batches`` batch ``b``): one-token steps on the state a
  ``--prompt-len`` prompt leaves behind, one after the other over the model's decoding cycle
  (:func:`decode_cycle`: a CMS level's period end, a task-signal segment's re-run, a MAC segment's
  growing cache make some tokens dearer than others; at most ``MAX_DECODE_TOKENS`` of them), every
  timed call from the same start state (so a KV cache stays near that length); the step time is the
  call's time over its tokens (the mean over the cycle, what a long generation pays a token). Bytes
  per step = every weight once (the embedding table only for the ``b`` rows read,
  unless tied to the head, which reads it whole; a learned position table for its one row) + the
  decoding state (``state_size_bytes(b, L)``, read once; its writes are not counted); achieved
  bytes/s = that / median step time, as a fraction of the triad bandwidth. Small models' weights
  partly fit the 32 MiB L3, so a fraction above 1 is possible and means "cache-resident". With
  ``--compile`` each row also times the step ``generate(compile=True)`` runs
  (``mnemo.models.lm._compile_kind("step")``, a fresh one per model and batch as a first
  generation at that batch compiles it, compiled before the timing, its small matrix products as
  fused multiply-sums; its compile time and largest logit difference from the eager step are
  reported); where ``torch.compile`` does not work here (no C compiler,
  ...), the suite says so and keeps the eager rows;
* **where the step's time goes**: ``torch.profiler`` over one training step per model, every op's
  *self* time put in one group: ``matmul`` (mm/bmm/addmm/baddbmm anywhere; the part inside the
  mixers' ops is shown again as ``mm in mixer``), ``recurrence`` (the mixer's other ops, causal
  SDPA, short convolutions, a CMS's memory ops), ``norms``, ``activations`` (SiLU, sigmoid, …,
  and a SwiGLU's products), ``loss`` (the fused cross-entropy's non-matmul ops), ``optimizer``
  (AdamW step and zero_grad, Python included), ``other ops`` (embedding, gradient accumulation,
  copies) and ``python`` (time in no op: Python, autograd bookkeeping, the profiler). Backward ops
  take the group of the forward op they differentiate (autograd's sequence numbers). Shares of the
  profiled step, which the profiler slows by a few percent.

Other processes on the machine change every number; the JSON records the load average.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from . import write_json
from .models import check_model_names, check_shapes_memory, interleaved, parse_gen_batches, parse_shapes

DEFAULT_MODELS = ("gated_deltanet", "mamba2", "gla", "transformer", "titans_lmm", "hope")
DEFAULT_SHAPES = "1024x8"
DEFAULT_N_LAYERS = 6
VOCAB = 256
#: elements of each STREAM array (float32: 128 MiB)
STREAM_ELEMENTS = 2**25
#: the most one-token steps one timed decoding call runs (:func:`decode_cycle`)
MAX_DECODE_TOKENS = 256
GROUPS = ("matmul", "recurrence", "norms", "activations", "loss", "optimizer", "other ops", "python")
NOT_COUNTED = (
    "element-wise ops (gates, exp, cumsum, norms, activations, the loss's softmax, the AdamW "
    "update), triangular solves and other linalg ops, opaque custom kernels (the selective scan's "
    "C kernel); see uncounted_ops per model"
)

_MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::mv", "aten::dot"}
_ACTIVATION_WORDS = ("silu", "sigmoid", "gelu", "softplus", "relu", "tanh", "elu")
_LOSS = ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")
_SDPA = "scaled_dot_product"
_CONV = "convolution"


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------


def _cpu_sdpa_formulas() -> dict:
    """FlopCounterMode formulas for the CPU flash-attention ops (torch counts the GPU kernels only),
    using torch's own formulas, times ``(T+1)/2T`` when causal (the CPU kernel skips the masked
    blocks), and for the in-place ``addmm_`` / ``baddbmm_`` (the chunk forms accumulate with them)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    out = {}

    def causal_share(q_shape, is_causal):
        T = q_shape[-2]
        return (T + 1) / (2 * T) if is_causal and T > 0 else 1.0

    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fwd is not None:

        def f(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs):
            return int(fc.sdpa_flop_count(query, key, value) * causal_share(query, is_causal))

        out[fwd] = f
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if bwd is not None:

        def b(
            grad_out, query, key, value, out, lse, dropout_p=0.0, is_causal=False, *a, out_shape=None, **kw
        ):
            return int(
                fc.sdpa_backward_flop_count(grad_out, query, key, value) * causal_share(query, is_causal)
            )

        out[bwd] = b
    # in-place forms (FlopCounterMode has formulas for the out-of-place ones only)
    for name, base in (("addmm_", "addmm"), ("baddbmm_", "baddbmm")):
        op = getattr(aten, name, None)
        if op is None:
            continue

        def inplace(self_shape, a, b, *args, out_shape=None, base=base, **kwargs):
            return fc.addmm_flop(self_shape, a, b) if base == "addmm" else fc.baddbmm_flop(self_shape, a, b)

        out[op] = inplace
    return out


_NO_WORK = {
    getattr(torch.ops.aten, n)
    for n in (
        "detach",
        "t",
        "_local_scalar_dense",
        "alias",
        "empty_like",
        "empty",
        "empty_strided",
        "lift_fresh",
    )
    if hasattr(torch.ops.aten, n)
}


class _Uncounted(torch.utils._python_dispatch.TorchDispatchMode):
    """Calls of every op FlopCounterMode has no formula for (what the count leaves out), views and
    other work-free ops aside."""

    def __init__(self, registry):
        super().__init__()
        self.registry = registry
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func.overloadpacket not in self.registry
            and not func.is_view
            and func.overloadpacket not in _NO_WORK
        ):
            name = str(func.overloadpacket).replace("aten.", "")
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_flops(fn: Callable[[], object]) -> tuple[int, dict[str, int], dict[str, int]]:
    """Run ``fn()`` (e.g. a forward and backward) under ``FlopCounterMode``: returns ``(total
    FLOPs, {op: FLOPs}, {op without a formula: calls})``. A multiply-add counts 2 FLOPs (``[M, K]
    × [K, N]`` = ``2·M·K·N``); the CPU's causal SDPA is counted (:func:`_cpu_sdpa_formulas`)."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    extra = _cpu_sdpa_formulas()
    counter = FlopCounterMode(display=False, custom_mapping=extra)
    registry = set(flop_registry) | {k for k in extra} | {getattr(k, "overloadpacket", k) for k in extra}
    uncounted = _Uncounted(registry)
    with counter, uncounted:
        fn()
    per_op = {
        str(k).replace("aten.", ""): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()
    }
    return int(counter.get_total_flops()), per_op, uncounted.calls


# ------------------------------------------------------------------------------------------------
# the machine
# ------------------------------------------------------------------------------------------------


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """Distinct ``(in_features, out_features)`` of the model's ``nn.Linear`` layers (the head too)."""
    seen = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and (m.in_features, m.out_features) not in seen:
            seen.append((m.in_features, m.out_features))
    return seen


def gemm_task(M: int, K: int, N: int) -> Callable[[], None]:
    """``torch.mm`` of float32 ``[M, K] × [K, N]`` into a preallocated output."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    c = torch.empty(M, N)
    return lambda: torch.mm(a, b, out=c)


def stream_tasks(n: int = STREAM_ELEMENTS) -> dict[str, tuple[Callable[[], None], int]]:
    """``{"copy": (fn, bytes), "triad": (fn, bytes)}`` on float32 arrays of ``n`` elements."""
    a, b, c = torch.rand(n), torch.rand(n), torch.rand(n)
    return {
        "copy": (lambda: b.copy_(a), 8 * n),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 12 * n),
    }


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


def build(name: str, d_model: int, n_layers: int):
    from ..models import LanguageModel, build_config

    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=VOCAB, d_model=d_model, n_layers=n_layers))


def train_step_fn(model, opt, T: int, B: int, seed: int = 0) -> Callable[[], None]:
    """One training step on fixed random tokens: the fused loss, backward, AdamW step."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        model.train()
        with torch.profiler.record_function("roofline/optimizer"):
            opt.zero_grad(set_to_none=True)
        loss, _ = model(x, targets=y)
        (loss / y.numel()).backward()
        with torch.profiler.record_function("roofline/optimizer"):
            opt.step()

    def forward_backward():
        loss, _ = model(x, targets=y)
        (loss / y.numel()).backward()
        model.zero_grad(set_to_none=True)

    step.forward_backward = forward_backward
    return step


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, the (untied) token embedding
    only for the ``batch`` rows looked up, a learned position table for its one row (every row of
    the batch is at the same position)."""
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    head = model.lm_head.weight
    for emb, rows in ((model.embed, batch), (model.pos_embed, 1)):
        if emb is None or emb.weight is head:
            continue
        w = emb.weight
        total -= w.numel() * w.element_size() - rows * w.shape[1] * w.element_size()
    return total


def decode_cycle(model: nn.Module) -> int:
    """The number of one-token steps after which a model's decoding work repeats: the least common
    multiple of its CMS levels' periods (a period end steps the level), its task-signal segment (a
    segment's last label re-runs the segment: ``mnemo.models.task_signal``) and a MAC layer's
    segment (its segment-local cache grows, then resets); 1 for a model with none of them."""
    from ..layers.cms import CMSLevel
    from ..layers.titans_architectures import TitansMAC

    periods = [getattr(model, "task_segment", None) or 1]
    for m in model.modules():
        if isinstance(m, CMSLevel):
            periods.append(m.level.period)
        elif isinstance(m, TitansMAC):
            periods.append(m.segment)
    return math.lcm(*periods)


def decode_step_fn(
    model, batch: int, context: int, step_fn=None, tokens: int | None = None
) -> Callable[[], torch.Tensor]:
    """One timed decoding call: ``tokens`` one-token steps, one after the other, from the state a
    ``context``-token prompt leaves (every call starts from that same state and reads the same
    tokens); it returns the last step's logits ``[batch, 1, V]`` and carries ``.tokens``. Default
    ``tokens``: the model's :func:`decode_cycle`, at most ``MAX_DECODE_TOKENS`` (``.cycle`` holds the
    whole cycle), so the time over ``.tokens`` is a token's mean cost, not the cost of one phase of
    the cycle. ``step_fn(model, ids, state) -> (logits, state)`` runs a step (default: the model
    itself; e.g. ``mnemo.models.lm._compile_kind("step")``, what ``generate(compile=True)`` runs).

    Raises:
        ValueError: ``tokens`` is not a positive integer.
    """
    cycle = decode_cycle(model)
    if tokens is None:
        tokens = min(cycle, MAX_DECODE_TOKENS)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens: expected a positive integer (one-token steps a call), got {tokens!r}")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (batch, context), generator=g)
    toks = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    model.eval()
    with torch.no_grad():
        _, start = model(prompt)
    run = model if step_fn is None else (lambda ids, state: step_fn(model, ids, state))

    def step():
        state = start
        with torch.no_grad():
            for i in range(tokens):
                logits, state = run(toks[:, i : i + 1], state)
        return logits

    step.tokens, step.cycle = tokens, cycle
    return step


def compiled_decode_step_fn(
    model, batch: int, context: int, matvec: bool = True, kernel: bool = True
) -> tuple[Callable[[], torch.Tensor], float]:
    """:func:`decode_step_fn`'s step through the one-token function ``generate(compile=True)``
    compiles (``mnemo.models.lm._compile_kind("step")``: a fresh one per model and batch, as a
    first generation at that batch compiles it; one shared by two batches would make the batch
    dimension dynamic), compiled here by its first call, and its logits' largest difference from
    the eager step (at the call's last token). ``matvec=False``: without the decode pass (BLAS
    products); ``kernel=False``: with its fused multiply-sums but not
    :func:`mnemo.ops.small_mm.small_mm`'s C kernel."""
    from ..models.lm import _compile_kind

    step = decode_step_fn(model, batch, context, step_fn=_compile_kind("step", matvec=matvec, kernel=kernel))
    eager = decode_step_fn(model, batch, context)
    return step, float((step() - eager()).abs().max())


# ------------------------------------------------------------------------------------------------
# profile
# ------------------------------------------------------------------------------------------------


def _scope_label(module: nn.Module) -> str | None:
    from ..layers.base import Mixer
    from ..layers.cms import ContinuumMemory

    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return "linear"
    if name.endswith("Norm"):
        return "norms"
    if isinstance(module, (Mixer, ContinuumMemory)):
        return "mixer"
    if name in ("SwiGLU", "MoE", "MLP"):
        return "mlp"
    return None


class _Scopes:
    """Forward hooks that open a ``roofline/<label>`` profiler range around each labelled module."""

    def __init__(self, model: nn.Module):
        self.handles = []
        for m in model.modules():
            label = _scope_label(m)
            if label is None:
                continue
            stack = []

            def pre(mod, args, label=label, stack=stack):
                rf = torch.profiler.record_function(f"roofline/{label}")
                rf.__enter__()
                stack.append(rf)

            def post(mod, args, out, stack=stack):
                if stack:
                    stack.pop().__exit__(None, None, None)

            self.handles.append(m.register_forward_pre_hook(pre))
            self.handles.append(m.register_forward_hook(post))

    def remove(self):
        for h in self.handles:
            h.remove()


def classify(events) -> dict[str, float]:
    """Self time (µs) of profiler ``events`` per group of :data:`GROUPS` (plus ``mm in mixer``)."""
    evaluate = "autograd::engine::evaluate_function: "

    def context(ev):
        """(innermost roofline scope, or the autograd node evaluating it, in_loss)"""
        p, in_loss = ev.cpu_parent, False
        while p is not None:
            if p.name.startswith("_ChunkedCrossEntropy"):
                in_loss = True
            if p.name.startswith("roofline/"):
                return p.name[len("roofline/") :], None, in_loss
            if p.name.startswith(evaluate):
                return None, p, in_loss
            p = p.cpu_parent
        return None, None, in_loss

    fwd_scope: dict[int, tuple[str | None, bool]] = {}
    info = []
    for ev in events:
        scope, node, in_loss = context(ev)
        if node is None and ev.sequence_nr is not None and ev.sequence_nr >= 0:
            fwd_scope.setdefault(ev.sequence_nr, (scope, in_loss))
        info.append((ev, scope, node, in_loss))
    out = dict.fromkeys((*GROUPS, "mm in mixer"), 0.0)
    for ev, scope, node, in_loss in info:
        if node is not None:  # a backward op: the scope of the forward op it differentiates
            if node.name.endswith("_ChunkedCrossEntropyBackward"):
                scope, in_loss = None, True
            else:
                scope, in_loss = fwd_scope.get(node.sequence_nr, (None, False))
        name, t = ev.name, ev.self_cpu_time_total
        if scope == "optimizer":
            group = "optimizer"
        elif not name.startswith("aten::"):
            group = "python"
        elif name in _MATMUL:
            group = "matmul"
            if scope == "mixer":
                out["mm in mixer"] += t
        elif scope == "linear":
            group = "matmul"
        elif in_loss or any(w in name for w in _LOSS):
            group = "loss"
        elif scope == "norms" or "norm" in name:
            group = "norms"
        elif any(w in name for w in _ACTIVATION_WORDS) or scope == "mlp":
            group = "activations"
        elif scope == "mixer" or _SDPA in name or _CONV in name:
            group = "recurrence"
        else:
            group = "other ops"
        out[group] += t
    return out


@contextmanager
def _native_stderr_muted():
    """File descriptor 2 pointed at ``/dev/null`` within ``with`` (native code's writes to stderr;
    Python's ``sys.stderr`` is flushed first and writes to the same descriptor)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _build_or_refuse(name: str, d_model: int, n_layers: int):
    """:func:`build`, with a model whose weights this machine cannot allocate refused as a user
    error (``ValueError`` naming the flags) instead of the allocator's traceback."""
    try:
        return build(name, d_model, n_layers)
    except (RuntimeError, MemoryError) as e:
        if not isinstance(e, MemoryError) and "allocate" not in str(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"--d-model/--n-layers: {name} at d_model {d_model} with {n_layers} layer(s) does not fit in "
            f"this machine's memory ({first})"
        ) from None


def profile_step(model, step: Callable[[], None]) -> dict[str, float]:
    """Shares of one profiled training step's time per group (:func:`classify`), and its ``ms``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    scopes = _Scopes(model)
    prof = profile(activities=[ProfilerActivity.CPU])
    try:
        with _native_stderr_muted():  # the profiler's C++ start/stop log lines ("USDT: ... profiler_start")
            prof.start()
        try:
            with record_function("roofline/step"):
                step()
        finally:
            with _native_stderr_muted():
                prof.stop()
    finally:
        scopes.remove()
    events = prof.events()
    us = classify(events)
    total = sum(v for k, v in us.items() if k != "mm in mixer") or 1.0
    shares = {k: v / total for k, v in us.items()}
    shares["profiled_ms"] = total / 1e3
    return shares


# ------------------------------------------------------------------------------------------------
# the suite
# ------------------------------------------------------------------------------------------------


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def run(
    models: list[str],
    d_model: int,
    n_layers: int,
    shapes: list[tuple[int, int]],
    gen_batches: list[int],
    context: int,
    repeats: int,
    profile: bool = True,
    stream_elements: int = STREAM_ELEMENTS,
    log: Callable[[str], None] = print,
    compile: bool = False,
) -> dict:
    """Measure and return the JSON-ready result (module docstring; :func:`print_tables` prints it).
    ``compile``: also time each decode step as ``generate(compile=True)`` runs it (``"compile"`` in
    the result: ``"on"``, ``"off"`` or ``"unavailable: why"``, then eager rows only)."""
    if not models:
        raise ValueError("--models: expected at least one model name, got none")
    check_model_names(models)
    if not shapes:
        raise ValueError("--model-shapes: the roofline suite needs at least one training shape TxB, got none")
    built = {name: _build_or_refuse(name, d_model, n_layers) for name in models}
    tasks: dict = {}
    gemm_shapes: dict[tuple[int, int, int], None] = {}
    for T, B in shapes:
        for model in built.values():
            for K, N in linear_shapes(model):
                gemm_shapes[(B * T, K, N)] = None
    for M, K, N in gemm_shapes:
        tasks[("gemm", M, K, N)] = gemm_task(M, K, N)
    stream = stream_tasks(stream_elements)
    for kind, (fn, _) in stream.items():
        tasks[("stream", kind)] = fn
    opts, steps, flops, compiled, decode_tokens = {}, {}, {}, {}, {}
    compile_status = "off"
    if compile and gen_batches:
        from .model_entries import compile_available

        ok, why = compile_available()
        compile_status = "on" if ok else f"unavailable: {why}"
        if not ok:
            log(f"--compile: torch.compile is unavailable here ({why}); decoding eager only")
    for name, model in built.items():
        opts[name] = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for T, B in shapes:
            step = train_step_fn(model, opts[name], T, B)
            log(f"counting the FLOPs of {name} at T={T} B={B} ...")
            flops[(name, T, B)] = count_flops(step.forward_backward)  # the batch the step runs
            steps[(name, T, B)] = step
            tasks[("train", name, T, B)] = step
        for b in gen_batches:
            tasks[("decode", name, b)] = fn = decode_step_fn(model, b, context)
            decode_tokens[name] = (fn.tokens, fn.cycle)
            if compile_status == "on":
                log(f"compiling the decode step of {name} at batch {b} ...")
                t0 = time.perf_counter()
                fn, diff = compiled_decode_step_fn(model, b, context)
                compiled[(name, b)] = (time.perf_counter() - t0, diff)
                tasks[("decode_compiled", name, b)] = fn
    log(f"timing {len(tasks)} tasks, {repeats} interleaved rounds after one warm-up ...")
    times = interleaved(tasks, repeats)
    med = {k: _median(v) for k, v in times.items()}

    gemm = [
        {"M": M, "K": K, "N": N, "gflops": 2 * M * K * N / med[("gemm", M, K, N)] / 1e9}
        for M, K, N in gemm_shapes
    ]
    machine = {
        "gemm": gemm,
        "gemm_peak_gflops": max(g["gflops"] for g in gemm),
        "copy_gbs": stream["copy"][1] / med[("stream", "copy")] / 1e9,
        "triad_gbs": stream["triad"][1] / med[("stream", "triad")] / 1e9,
        "stream_elements": stream_elements,
    }
    train_rows = []
    for name, model in built.items():
        own = {(K, N) for K, N in linear_shapes(model)}
        params = model.num_parameters()
        for T, B in shapes:
            peak = max(g["gflops"] for g in gemm if g["M"] == B * T and (g["K"], g["N"]) in own)
            total, per_op, uncounted = flops[(name, T, B)]
            t = med[("train", name, T, B)]
            train_rows.append(
                {
                    "model": name,
                    "params": params,
                    "T": T,
                    "batch": B,
                    "step_ms": 1e3 * t,
                    "tokens_per_s": B * T / t,
                    "flops_fwd_bwd": total,
                    "flops_by_op": per_op,
                    "flops_6NT": 6 * params * B * T,
                    "achieved_gflops": total / t / 1e9,
                    "gemm_peak_gflops": peak,
                    "fraction_of_peak": total / t / 1e9 / peak,
                    "uncounted_ops": dict(sorted(uncounted.items(), key=lambda kv: -kv[1])),
                }
            )
    decode_rows = []
    for name, model in built.items():
        for b in gen_batches:
            n, cycle = decode_tokens[name]
            t = med[("decode", name, b)] / n
            wb = weight_bytes_per_step(model, b)
            sb = model.state_size_bytes(b, context, pending=False)  # what a step reads
            decode_rows.append(
                {
                    "model": name,
                    "batch": b,
                    "context": context,
                    "tokens_timed": n,
                    "cycle": cycle,
                    "step_ms": 1e3 * t,
                    "tokens_per_s": b / t,
                    "weight_bytes": wb,
                    "state_bytes": sb,
                    "achieved_gbs": (wb + sb) / t / 1e9,
                    "fraction_of_bandwidth": (wb + sb) / t / 1e9 / machine["triad_gbs"],
                }
            )
            if (name, b) in compiled:
                tc = med[("decode_compiled", name, b)] / n
                decode_rows[-1].update(
                    compiled_step_ms=1e3 * tc,
                    compiled_tokens_per_s=b / tc,
                    compiled_fraction_of_bandwidth=(wb + sb) / tc / 1e9 / machine["triad_gbs"],
                    compile_s=compiled[(name, b)][0],
                    compiled_max_logit_diff=compiled[(name, b)][1],
                )
    profiles = {}
    if profile:
        for (name, T, B), step in steps.items():
            log(f"profiling one training step of {name} at T={T} B={B} ...")
            profiles[f"{name} {T}x{B}"] = profile_step(built[name], step)
    del built, opts, steps, tasks
    gc.collect()
    return {
        "d_model": d_model,
        "n_layers": n_layers,
        "vocab": VOCAB,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": repeats,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": machine,
        "not_counted": NOT_COUNTED,
        "train": train_rows,
        "decode": decode_rows,
        "compile": compile_status,
        "profile": profiles,
    }


def print_tables(r: dict, log: Callable[[str], None] = print) -> None:
    m = r["machine"]
    log(
        f"\nmachine ({r['threads']} threads, torch {r['torch']}, load average at the end "
        f"{', '.join(f'{x:.2f}' for x in r['load_average'] or [])}):"
    )
    log(f"{'GEMM fp32 [M,K]x[K,N]':<28}{'GFLOP/s':>10}")
    for g in m["gemm"]:
        log(f"{g['M']:>8} x {g['K']:>5} x {g['N']:>6}      {g['gflops']:>10.1f}")
    log(
        f"GEMM peak {m['gemm_peak_gflops']:.1f} GFLOP/s; STREAM copy {m['copy_gbs']:.1f} GB/s, triad "
        f"{m['triad_gbs']:.1f} GB/s ({m['stream_elements']:,} float32 elements an array)"
    )
    log(
        "\ntraining step (forward + fused loss + backward + AdamW); FLOPs counted over forward + backward "
        "(matmuls, the recurrences' own included); fraction = achieved / the best GEMM rate at the "
        "model's own shapes"
    )
    head = (
        f"{'model':<16}{'params':>11}{'T x B':>10}{'step ms':>10}{'tok/s':>9}{'GFLOP':>9}{'6NT GF':>9}"
        f"{'GFLOP/s':>9}{'peak':>8}{'frac':>7}"
    )
    log(head)
    log("-" * len(head))
    for t in r["train"]:
        log(
            f"{t['model']:<16}{t['params']:>11,}{t['T']:>6}x{t['batch']:<3}{t['step_ms']:>10.1f}"
            f"{t['tokens_per_s']:>9.0f}{t['flops_fwd_bwd'] / 1e9:>9.1f}{t['flops_6NT'] / 1e9:>9.1f}"
            f"{t['achieved_gflops']:>9.1f}{t['gemm_peak_gflops']:>8.1f}{t['fraction_of_peak']:>7.2f}"
        )
    log(f"not counted: {r['not_counted']}")
    if r["decode"]:
        log(
            f"\ndecoding, one token per row after a {r['decode'][0]['context']}-token prompt; step = the "
            "mean over the tokens of the model's decoding cycle (timed/cycle); bytes = weights "
            "read once (embedding rows only unless tied) + the state; fraction of the triad bandwidth"
        )
        head = f"{'model':<16}{'B':>4}{'cycle':>10}{'step ms':>10}{'tok/s':>10}{'weights MB':>12}"
        head += f"{'state MB':>10}{'GB/s':>8}{'frac':>7}"
        comp = any("compiled_step_ms" in d for d in r["decode"])
        if comp:
            head += f"{'compiled ms':>13}{'tok/s':>10}{'frac':>7}{'compile s':>11}{'max |dlogit|':>14}"
        log(head)
        log("-" * len(head))
        for d in r["decode"]:
            n, cycle = d.get("tokens_timed", 1), d.get("cycle", 1)  # files from before the cycle: 1
            line = (
                f"{d['model']:<16}{d['batch']:>4}{(str(n) if n == cycle else f'{n}/{cycle}'):>10}"
                f"{d['step_ms']:>10.2f}{d['tokens_per_s']:>10.0f}"
                f"{d['weight_bytes'] / 1e6:>12.2f}{d['state_bytes'] / 1e6:>10.2f}{d['achieved_gbs']:>8.2f}"
                f"{d['fraction_of_bandwidth']:>7.3f}"
            )
            if "compiled_step_ms" in d:
                line += (
                    f"{d['compiled_step_ms']:>13.2f}{d['compiled_tokens_per_s']:>10.0f}"
                    f"{d['compiled_fraction_of_bandwidth']:>7.3f}{d['compile_s']:>11.1f}"
                    f"{d['compiled_max_logit_diff']:>14.1e}"
                )
            log(line)
        if comp:
            log(
                "compiled: the step generate(compile=True) runs (torch.compile, inductor), timed in the "
                "same rounds; max |dlogit| = its largest logit difference from the eager step"
            )
        elif str(r.get("compile", "off")).startswith("unavailable"):
            log(f"--compile: {r['compile']}; eager rows only")
    if r["profile"]:
        log(
            "\nwhere a profiled training step's time goes (share of the step; "
            "'mm in mixer' is part of matmul)"
        )
        cols = (*GROUPS, "mm in mixer")
        head = f"{'model':<22}{'ms':>8}" + "".join(f"{c:>12}" for c in cols)
        log(head)
        log("-" * len(head))
        for name, p in r["profile"].items():
            log(f"{name:<22}{p['profiled_ms']:>8.0f}" + "".join(f"{p[c]:>12.2f}" for c in cols))


def main(args) -> int:
    models = (
        [m.strip() for m in args.models.split(",") if m.strip()]
        if getattr(args, "models", None)
        else list(DEFAULT_MODELS)
    )
    shapes = parse_shapes(getattr(args, "model_shapes", None) or DEFAULT_SHAPES)
    gen_batches = parse_gen_batches(getattr(args, "gen_batches", None) or "1,8")
    d_model = getattr(args, "d_model", None) or 256
    n_layers = getattr(args, "n_layers", None) or DEFAULT_N_LAYERS
    check_shapes_memory(shapes, d_model)
    check_shapes_memory(
        [(args.prompt_len, b) for b in gen_batches], d_model, flag="--gen-batches x --prompt-len"
    )
    print(
        f"mnemo bench --suite roofline: d_model={d_model}, {n_layers} layers, vocab {VOCAB}; training "
        f"{', '.join(f'{T}x{B}' for T, B in shapes)}; decoding batches {gen_batches} after "
        f"{args.prompt_len} tokens; {torch.get_num_threads()} threads; medians of {args.repeats} "
        "interleaved rounds after one warm-up"
        f"{'; --compile: the compiled decode step too' if getattr(args, 'compile', False) else ''}\n",
        flush=True,
    )
    result = run(
        models,
        d_model,
        n_layers,
        shapes,
        gen_batches,
        context=args.prompt_len,
        repeats=args.repeats,
        stream_elements=STREAM_ELEMENTS,
        log=lambda s: print(s, flush=True),
        compile=getattr(args, "compile", False),
    )
    print_tables(result)
    if args.json:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    sys.stdout.flush()
    return 0

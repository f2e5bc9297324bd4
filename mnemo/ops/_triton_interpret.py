"""Running the peers' Triton kernels on a CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

The ``fla`` and ``mamba_ssm`` backends of :mod:`mnemo.ops.dispatch` run their Triton kernels on a
CPU only under the interpreter, which executes a kernel as NumPy code, one program instance at a
time (slow: 0.1–3 s a call at small shapes; that is how those backends are tested on machines
without a GPU). Out of the box three things stop the peers' kernels there; :func:`install` fixes
them, once per process, and only when ``TRITON_INTERPRET=1`` is set (it does nothing otherwise,
so a GPU run is never touched):

1. **Autotuning.** ``triton.autotune`` times each candidate configuration through the active
   GPU driver, and the interpreter has none ("0 active drivers"). The shim keeps the first
   candidate left after the kernel's own pruning (:meth:`Autotuner.prune_configs`), so nothing is
   timed. Every candidate computes the same function; only the speed differs.
2. **Loop counters.** Compiled Triton turns ``for i in range(n)`` (and ``tl.range``) into a loop
   whose counter is a Triton scalar; the interpreter runs the loop in Python, so the counter is a
   plain ``int`` and kernels that write ``i.to(tl.int64)`` fail. The shim rewrites those loops in
   the interpreter's source rewrite (the same AST pass that already rewrites comparisons) to
   iterate over :func:`_interpreter_range`, which yields interpreter scalars of the type the
   compiler gives the counter (its bounds' types promoted: ``int32`` for small Python ints,
   ``int64`` for a bound that needs it or is an ``int64`` scalar). ``tl.static_range`` loops keep their
   Python ``int`` counters, as compiled code does.
3. **CUDA calls in host code** (mamba-ssm). Its launchers run under
   ``with torch.cuda.device(x.device.index):``, documented as a no-op for ``None``, but in a
   PyTorch built without CUDA that path compares ``None < 0`` and raises ``TypeError``; and its
   SSD backward reads ``torch.cuda.get_device_properties(x.device).multi_processor_count`` to size
   a split of its work. In a PyTorch built without CUDA only, the shim makes device index
   ``None`` the documented no-op; for a CPU device ``get_device_properties`` answers with an
   object whose ``multi_processor_count`` is the number of CPU cores (any other device: the
   original function).

Nothing here changes results: (1) picks among equivalent configurations, (2) gives the loop
counter the type compiled code gives it, (3) makes a documented no-op one and answers a query
that only sizes a work split. :func:`installed` reports which shims are active;
``tests/ops/test_backends_interpret.py`` checks them on a small kernel of its own and, through
the peers' kernels, on every op.
"""

from __future__ import annotations

import ast
import os
import threading
import types

__all__ = ["interpreting", "install", "installed"]

_lock = threading.Lock()
_installed: tuple[str, ...] = ()
_RANGE_NAME = "_mnemo_interpreter_range"


def interpreting() -> bool:
    """Whether Triton's interpreter is requested (``TRITON_INTERPRET`` set to ``1``, ``true``,
    ``yes`` or ``on``, any case, no surrounding blanks: read as Triton reads it, which does not
    strip them).

    Triton reads the variable when a kernel is defined (``@triton.jit`` picks the interpreted
    function then), so it must be set before the peer's kernel modules are imported."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def installed() -> tuple[str, ...]:
    """The shims in place in this process: a subset of ``("autotune", "range", "cuda_query")``."""
    return _installed


def _promote(a, b):
    """The loop counter's type for two bound types, as compiled Triton promotes them
    (``integer_promote_impl``: the wider type; an unsigned one wins at equal width)."""
    ua, ub = a.is_int_unsigned(), b.is_int_unsigned()
    if ua == ub:
        return a if a.int_bitwidth > b.int_bitwidth else b
    if ua:
        return a if a.int_bitwidth >= b.int_bitwidth else b
    return b if b.int_bitwidth >= a.int_bitwidth else a


def _interpreter_range(*args):
    """``range(*args)`` yielding interpreter scalars instead of Python ints (see shim 2), of the
    type compiled Triton gives the counter: its bounds' types promoted (a Python int is ``int32``,
    ``int64`` when it does not fit; a Triton scalar keeps its type, e.g. ``int64`` after
    ``.to(tl.int64)``)."""
    import numpy as np
    from triton.language import core as tlc
    from triton.runtime import interpreter as itp

    bounds, dtype = [], None
    for a in args:
        if isinstance(a, tlc.tensor):
            b, t = int(a.handle.data.item()), a.dtype
        else:
            b = int(a.value if isinstance(a, tlc.constexpr) else a)
            t = tlc.int32 if -(2**31) <= b < 2**31 else tlc.int64
        bounds.append(b)
        dtype = t if dtype is None else _promote(dtype, t)
    ntype = np.dtype(dtype.name)
    for i in range(*bounds):
        yield tlc.tensor(itp.TensorHandle(np.array([i], dtype=ntype), dtype.scalar), dtype)


class _RangeLoops(ast.NodeTransformer):
    """``for x in range(...)`` / ``for x in tl.range(...)`` -> ``for x in _mnemo_interpreter_range(...)``
    (``tl.range``'s keyword options, such as ``num_stages``, are dropped: they tune the compiled loop)."""

    def visit_For(self, node):
        self.generic_visit(node)
        it = node.iter
        if isinstance(it, ast.Call):
            f = it.func
            plain = isinstance(f, ast.Name) and f.id == "range"
            lang = isinstance(f, ast.Attribute) and f.attr == "range"
            if plain or lang:
                node.iter = ast.Call(func=ast.Name(id=_RANGE_NAME, ctx=ast.Load()), args=it.args, keywords=[])
        return node


def install() -> tuple[str, ...]:
    """Apply the shims (see the module docstring) if ``TRITON_INTERPRET=1`` and triton imports;
    idempotent. Returns :func:`installed`. Raises nothing: a shim whose target is missing in this
    triton version is left out (the kernels then fail as they would without it)."""
    global _installed
    if not interpreting():
        return _installed
    with _lock:
        if _installed:
            return _installed
        done = []
        try:
            from triton.runtime import autotuner, interpreter
        except Exception:  # triton absent or broken: nothing to patch
            return _installed
        # 1. autotuning: one configuration, nothing timed
        tuner = autotuner.Autotuner
        if hasattr(tuner, "prune_configs") and not getattr(tuner.prune_configs, "_mnemo_shim", False):
            prune = tuner.prune_configs

            def prune_configs(self, kwargs, _prune=prune):
                return _prune(self, kwargs)[:1]

            prune_configs._mnemo_shim = True
            tuner.prune_configs = prune_configs
            done.append("autotune")
        # 2. loop counters: rewrite range loops in the interpreter's AST pass
        rewriter = getattr(interpreter, "FunctionRewriter", None)
        if (
            rewriter is not None
            and hasattr(rewriter, "_transform_ast")
            and hasattr(rewriter, "_compile_and_exec")
        ):
            transform, compile_exec = rewriter._transform_ast, rewriter._compile_and_exec
            if not getattr(transform, "_mnemo_shim", False):

                def _transform_ast(self, src, _orig=transform):
                    return ast.fix_missing_locations(_RangeLoops().visit(_orig(self, src)))

                def _compile_and_exec(self, tree, _orig=compile_exec):
                    self.fn.__globals__.setdefault(_RANGE_NAME, _interpreter_range)
                    return _orig(self, tree)

                _transform_ast._mnemo_shim = True
                rewriter._transform_ast = _transform_ast
                rewriter._compile_and_exec = _compile_and_exec
                # functions rewritten before the shim keep their old form: forget them
                getattr(interpreter, "InterpretedFunction", types.SimpleNamespace()).__dict__.get(
                    "rewritten_fn", {}
                ).clear()
            done.append("range")
        # 3. CUDA calls about a CPU device
        import torch

        if not hasattr(torch._C, "_cuda_exchangeDevice"):  # a PyTorch built without CUDA

            def _exchange(device, _orig=torch.cuda._exchange_device):
                return -1 if device is None else _orig(device)

            def _maybe_exchange(device, _orig=torch.cuda._maybe_exchange_device):
                return -1 if device is None else _orig(device)

            if not getattr(torch.cuda._exchange_device, "_mnemo_shim", False):
                _exchange._mnemo_shim = _maybe_exchange._mnemo_shim = True
                torch.cuda._exchange_device = _exchange
                torch.cuda._maybe_exchange_device = _maybe_exchange

        props = torch.cuda.get_device_properties
        if not getattr(props, "_mnemo_shim", False):

            def get_device_properties(device=None, _orig=props):
                if isinstance(device, torch.device) and device.type == "cpu" or device == "cpu":
                    return types.SimpleNamespace(multi_processor_count=os.cpu_count() or 1, name="cpu")
                return _orig(device)

            get_device_properties._mnemo_shim = True
            torch.cuda.get_device_properties = get_device_properties
        done.append("cuda_query")
        _installed = tuple(done)
    return _installed

"""``torch.compile`` marks that do not import dynamo when ``mnemo`` is imported.

``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import ``torch._dynamo``
when they decorate (about 2 s on 2 cores, as long as ``import torch`` itself; it was four fifths of
``import mnemo``'s own time and the same share of every ``mnemo`` command's start that does not
compile). No function can be traced before dynamo is imported, so the marks here are applied when
it is: at once if it already is, else by an import hook (a ``sys.meta_path`` finder that lets the
normal finders locate ``torch._dynamo``, runs the marks after its module has executed, then leaves).
A mark that fails is reported by a ``RuntimeWarning`` and does not fail dynamo's import.

- :func:`constant_result` is ``torch.compiler.assume_constant_result`` (which marks the function
  itself, so the deferred mark reaches every reference to it).
- :func:`in_graph` is ``torch._dynamo.allow_in_graph`` (dynamo records a call of the function as one
  node of its graph and does not trace into it; AOTAutograd traces the call).
- :func:`eager_under_compile` is ``torch.compiler.disable``: it returns a thin wrapper that calls
  the function itself until dynamo is imported and its disabled form (dynamo's own wrapper) from
  then on, and that dynamo then treats as disabled itself (no inlining, no trace of its frame).
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable

__all__ = ["constant_result", "eager_under_compile", "in_graph"]

_DYNAMO = "torch._dynamo"
#: marks waiting for dynamo's import: each takes the ``torch._dynamo`` module
_pending: list[Callable] = []
_lock = threading.Lock()
#: the ``torch._dynamo`` module once its body has executed under the hook (set before importlib
#: clears ``__spec__._initializing``, so a mark made in between is applied, not queued)
_executed = None


def _dynamo_loaded():
    """The ``torch._dynamo`` module once its import has finished, else ``None`` (a module in
    ``sys.modules`` whose ``__spec__._initializing`` is set is still executing)."""
    if _executed is not None:
        return _executed
    module = sys.modules.get(_DYNAMO)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _take_pending() -> list[Callable]:
    with _lock:
        marks = _pending[:]
        _pending.clear()
    return marks


def _apply(marks: list[Callable], dynamo) -> None:
    """Run each mark; one that raises is reported (a warning naming it) and does not stop the others
    or the import of dynamo it runs in."""
    for mark in marks:
        try:
            mark(dynamo)
        except Exception as e:  # noqa: BLE001  (whatever it is, dynamo's import must not fail)
            warnings.warn(
                f"mnemo: a torch.compile mark could not be applied: {e!r}", RuntimeWarning, stacklevel=2
            )


class _AfterDynamoImport:
    """A ``sys.meta_path`` finder for ``torch._dynamo`` alone: the spec the other finders give (asked
    in their order), with its loader's ``exec_module`` followed by the pending marks. It stays in
    ``sys.meta_path`` until dynamo's module has executed: a ``find_spec`` probe that imports nothing,
    or an import that fails, leaves it for the next import."""

    def find_spec(self, name, path=None, target=None):
        if name != _DYNAMO:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if isinstance(finder, _AfterDynamoImport):
                continue
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(name, path, target)) is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # (not found: the import fails as it would have; the marks stay pending)
        exec_module = spec.loader.exec_module

        def exec_then_mark(module):
            global _executed
            exec_module(module)  # (if it raises, the hook stays for a retry)
            with _lock:
                _executed = module
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterDynamoImport)]
            _apply(_take_pending(), module)

        spec.loader.exec_module = exec_then_mark  # (this spec's own loader instance)
        return spec


def _when_dynamo_loads(mark: Callable) -> None:
    with _lock:
        dynamo = _dynamo_loaded()
        if dynamo is None:
            _pending.append(mark)
            if not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
                sys.meta_path.insert(0, _AfterDynamoImport())
            return
    _apply([*_take_pending(), mark], dynamo)


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo now: dynamo runs
    ``fn`` as Python when it traces a call and puts its result in the graph as a constant. Returns
    ``fn`` itself."""
    _when_dynamo_loads(lambda dynamo: dynamo.assume_constant_result(fn))
    return fn


def eager_under_compile(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)`` without importing dynamo now: calls of the returned function
    (a method too) run eagerly under ``torch.compile``, a graph break at the call.

    Once dynamo is loaded the wrapper carries dynamo's disable attributes (so a trace does not
    inline it: the graph breaks at its call, as at a call of the disabled function) and its code is
    skipped when called (so dynamo does not trace the wrapper's own frame either; one code object
    serves every wrapper, and its cache entries would count against one recompile limit)."""
    impl = fn

    def disable(dynamo) -> None:
        nonlocal impl
        impl = dynamo.disable(fn)
        call._torchdynamo_disable = True
        call._torchdynamo_disable_msg = None
        dynamo.eval_frame.skip_code(call.__code__)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return impl(*args, **kwargs)

    _when_dynamo_loads(disable)
    return call


def in_graph(fn: Callable) -> Callable:
    """``torch._dynamo.allow_in_graph(fn)`` without importing dynamo now: a traced call of ``fn`` is one
    node of dynamo's graph (its body is not traced by dynamo; AOTAutograd traces it with the graph's
    fake tensors). For functions of tensors whose Python work depends only on shapes and constant
    arguments (no data-dependent branches, no side effects). Returns ``fn`` itself."""
    _when_dynamo_loads(lambda dynamo: dynamo.allow_in_graph(fn))
    return fn

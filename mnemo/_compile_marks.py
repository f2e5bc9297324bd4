"""``torch.compile`` marks that do not import dynamo when ``mnemo`` is imported.

``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import ``torch._dynamo``
when they decorate (about 2 s on 2 cores, as long as ``import torch`` itself; it was four fifths of
``import mnemo``'s own time and the same share of every ``mnemo`` command's start that does not
compile). No function can be traced before dynamo is imported, so the marks here are applied when
it is: at once if it already is, else by a one-shot import hook (a ``sys.meta_path`` finder that
lets the normal finders locate ``torch._dynamo`` and runs the marks after its module has executed).

- :func:`constant_result` is ``torch.compiler.assume_constant_result`` (which marks the function
  itself, so the deferred mark reaches every reference to it).
- :func:`eager_under_compile` is ``torch.compiler.disable``: it returns a thin wrapper that calls
  the function itself until dynamo is imported and its disabled form (dynamo's own wrapper) from
  then on, and that dynamo then treats as disabled itself (no inlining, no trace of its frame).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

__all__ = ["constant_result", "eager_under_compile"]

_DYNAMO = "torch._dynamo"
#: marks waiting for dynamo's import: each takes the ``torch._dynamo`` module
_pending: list[Callable] = []


def _dynamo_loaded():
    """The ``torch._dynamo`` module once its import has finished, else ``None`` (a module in
    ``sys.modules`` whose ``__spec__._initializing`` is set is still executing)."""
    module = sys.modules.get(_DYNAMO)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _run_pending(dynamo) -> None:
    while _pending:
        _pending.pop(0)(dynamo)


class _AfterDynamoImport:
    """A ``sys.meta_path`` finder for ``torch._dynamo`` alone: the spec the other finders give
    (asked in their order, after this one has removed itself), with its loader's ``exec_module``
    followed by the pending marks."""

    def find_spec(self, name, path=None, target=None):
        if name != _DYNAMO:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(name, path, target)) is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # (not found: the import fails as it would have; the marks stay pending)
        exec_module = spec.loader.exec_module

        def exec_then_mark(module):
            exec_module(module)
            _run_pending(module)

        spec.loader.exec_module = exec_then_mark  # (this spec's own loader instance)
        return spec


def _when_dynamo_loads(mark: Callable) -> None:
    dynamo = _dynamo_loaded()
    if dynamo is not None:
        _run_pending(dynamo)
        mark(dynamo)
        return
    _pending.append(mark)
    if not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


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

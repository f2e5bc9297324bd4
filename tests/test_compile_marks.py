"""``mnemo._compile_marks``: ``torch.compiler.disable`` and ``assume_constant_result`` applied when
dynamo is imported, so that ``import mnemo`` does not import it (about 2 s of every command's start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mnemo._compile_marks import constant_result, eager_under_compile


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_importing_mnemo_does_not_import_dynamo_and_importing_it_later_applies_every_mark():
    """A fresh process: ``mnemo``, its models, layers and command line import without dynamo; the
    marked functions are then their plain selves (a disabled wrapper's cell holds the function);
    ``import torch._dynamo`` applies every mark (constant results marked, the cells now hold
    dynamo's disabled wrappers) and the import hook is gone from ``sys.meta_path``."""
    out = _run(
        """
        import sys
        import mnemo, mnemo.models, mnemo.layers, mnemo.cli
        from mnemo import _compile_marks as marks
        from mnemo.layers import self_modifying, cms
        from mnemo.models import task_signal
        from mnemo.ops import _native, dispatch
        print("loaded before:", "torch._dynamo" in sys.modules)
        wrapped = [self_modifying.dgd_token, cms.ContinuumMemory._meta_grad, task_signal._absorb,
                   task_signal._read_with_signal]
        consts = [_native._available, dispatch._import_problem, dispatch._count_traced]
        inner = lambda f: f.__closure__[0].cell_contents
        print("plain before:", all(inner(f) is f.__wrapped__ for f in wrapped))
        print("marked before:", any(hasattr(f, "_dynamo_marked_constant") for f in consts))
        print("hook before:", sum(isinstance(f, marks._AfterDynamoImport) for f in sys.meta_path))
        import torch._dynamo
        disabled = lambda f: getattr(f, "_torchdynamo_disable", False)
        print("disabled after:", all(disabled(inner(f)) and disabled(f) for f in wrapped))
        print("marked after:", all(f._dynamo_marked_constant is True for f in consts))
        print("hook after:", sum(isinstance(f, marks._AfterDynamoImport) for f in sys.meta_path))
        print("pending after:", len(marks._pending))
        """
    )
    assert out.split("\n")[:-1] == [
        "loaded before: False",
        "plain before: True",
        "marked before: False",
        "hook before: 1",
        "disabled after: True",
        "marked after: True",
        "hook after: 0",
        "pending after: 0",
    ]


def test_a_mark_made_after_dynamo_is_loaded_applies_at_once_and_means_what_torchs_does():
    """Known answer: ``torch.compiler.is_compiling()`` is ``True`` while dynamo traces a function and
    ``False`` where it runs eagerly. Called from a compiled function, an ``eager_under_compile``
    function runs eagerly (it reads ``False``, as ``torch.compiler.disable``'s does), an unmarked one
    is traced (``True``); ``constant_result`` runs once per trace, as Python, and its value is
    folded into the graph (a second call with other inputs reuses it)."""
    import torch._dynamo  # noqa: F401  (loaded: the marks below apply at once)

    def plain(x):
        return x + float(torch.compiler.is_compiling())

    eager = eager_under_compile(plain)
    calls = []

    @constant_result
    def constant() -> float:
        calls.append(torch.compiler.is_compiling())
        return 2.0 + len(calls)

    assert getattr(eager.__closure__[0].cell_contents, "_torchdynamo_disable", False)
    assert constant._dynamo_marked_constant is True

    def f(x):
        return plain(x), eager(x), x * constant()

    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, backend="eager")
        x = torch.zeros(3)
        traced, ran_eagerly, scaled = compiled(x)
        assert torch.equal(traced, torch.ones(3)) and torch.equal(ran_eagerly, torch.zeros(3))
        assert torch.equal(scaled, torch.zeros(3)) and len(calls) >= 1
        n = len(calls)
        _, _, scaled = compiled(torch.ones(3))
        assert torch.equal(scaled, torch.full((3,), 2.0 + n)) and len(calls) == n  # folded, not rerun
        # the wrapper's own frame is never traced (its one code object serves every wrapper: traced,
        # its cache entries counted against one recompile limit): no compiled entry for it
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        assert _debug_get_cache_entry_list(eager.__code__) == []
        assert len(_debug_get_cache_entry_list(f.__code__)) >= 1  # (f itself was compiled)
    finally:
        torch._dynamo.reset()
    # eagerly (no compile) each is its plain self
    assert torch.equal(eager(torch.zeros(2)), torch.zeros(2)) and constant() == 3.0 + n


def test_a_method_marked_eager_binds_and_keeps_its_name():
    class M(torch.nn.Module):
        @eager_under_compile
        def step(self, x):
            """Doc."""
            return x * 2

    m = M()
    assert torch.equal(m.step(torch.ones(2)), torch.full((2,), 2.0))
    assert M.step.__name__ == "step" and M.step.__doc__ == "Doc."


def test_the_marks_survive_a_probe_a_failed_import_a_bad_mark_and_a_late_thread():
    """One fresh process, four ways the marks could be lost (found by review 45; each failed with the
    first version, whose hook left ``sys.meta_path`` when asked for a spec): an availability probe
    (``importlib.util.find_spec``, which imports nothing); a first ``import torch._dynamo`` that
    fails midway (then retried); a mark that raises (``constant_result`` of a builtin: a warning, not
    a failed import of dynamo); a mark made by another thread after dynamo's module has executed and
    before importlib marks it initialised (importlib's ``_verbose_message`` runs in that window).
    Every mnemo mark is applied in the end, the late one too, and no hook is left."""
    out = _run(
        """
        import importlib.util, sys, threading, warnings
        import importlib._bootstrap as bs
        import mnemo.layers.cms, mnemo.layers.self_modifying, mnemo.ops.dispatch
        from mnemo import _compile_marks as marks
        from mnemo.layers import self_modifying as sm
        from mnemo.ops import dispatch
        importlib.util.find_spec("torch._dynamo")
        marks.constant_result(len)

        class FailOnce:
            done = False
            def find_spec(self, name, path=None, target=None):
                if name == "torch._dynamo.convert_frame" and not FailOnce.done:
                    FailOnce.done = True
                    raise ImportError("simulated")
        sys.meta_path.insert(1, FailOnce())
        try:
            import torch._dynamo
            print("first import: ok")
        except ImportError as e:
            print("first import:", e)
        late, orig = {}, bs._verbose_message
        def in_the_window(message, *args, **kw):
            if args and args[0] == "torch._dynamo" and "f" not in late:
                def other():
                    late["f"] = marks.eager_under_compile(lambda x: x)
                t = threading.Thread(target=other)
                t.start()
                t.join()
            return orig(message, *args, **kw)
        bs._verbose_message = in_the_window
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch._dynamo
        bs._verbose_message = orig
        disabled = lambda f: getattr(f, "_torchdynamo_disable", False)
        print("disabled:", disabled(sm.dgd_token) and disabled(sm.dgd_token.__closure__[0].cell_contents))
        print("constant:", getattr(dispatch._count_traced, "_dynamo_marked_constant", False))
        print("late:", disabled(late.get("f")))
        print("warned:", [str(w.message)[:64] for w in caught if w.category is RuntimeWarning])
        hooks = sum(isinstance(f, marks._AfterDynamoImport) for f in sys.meta_path)
        print("hooks:", hooks, len(marks._pending))
        """
    )
    assert out.split("\n")[:-1] == [
        "first import: simulated",
        "disabled: True",
        "constant: True",
        "late: True",
        "warned: ['mnemo: a torch.compile mark could not be applied: AttributeError']",
        "hooks: 0 0",
    ], out


@pytest.mark.parametrize("found", [False, True])
def test_the_hook_gives_the_other_finders_answer(found, monkeypatch):
    """For any module but dynamo the hook answers ``None`` (the next finder decides); for dynamo it
    returns what the other finders find (``None`` if none does: the import fails as it would without
    the hook, the marks stay pending) and stays installed."""
    from mnemo import _compile_marks as marks

    hook = marks._AfterDynamoImport()

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if not found:
                return None
            import importlib.machinery

            return importlib.machinery.ModuleSpec(name, loader=None)

    monkeypatch.setattr(sys, "meta_path", [hook, Finder()])
    assert hook.find_spec("json") is None and hook in sys.meta_path
    spec = hook.find_spec("torch._dynamo")
    assert hook in sys.meta_path  # (until dynamo's module has executed: a probe imports nothing)
    assert (spec is None) if not found else (spec.name == "torch._dynamo" and spec.loader is None)

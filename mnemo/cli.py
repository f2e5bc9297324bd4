"""The ``mnemo`` command: its parser and ``main``. Each sub-command lives in :mod:`mnemo.commands`
(``train``, ``evaluate`` (eval, generate), ``bench``, ``sweep``, ``probe``, ...); ``models`` is
here. ``config_flag_fields`` / ``add_config_flags`` (TrainConfig's flags) are re-exported from
:mod:`mnemo.commands.train`."""

from __future__ import annotations

# Nothing but ``sys`` at the top: the console script imports this module before ``main`` runs,
# so an interrupt (Ctrl-C) during an import made here would print Python's traceback; every other
# import is made inside ``main``, whose handler says it in one line.
import sys

TYPE_CHECKING = False  # (not typing's: importing typing costs start-up time)
if TYPE_CHECKING:  # re-exported lazily (the module's __getattr__, below)
    from .commands.train import add_config_flags, config_flag_fields

__all__ = ["main", "build_parser", "add_config_flags", "config_flag_fields"]


def __getattr__(name: str):
    # TrainConfig's flags, re-exported without importing the train command at start-up
    if name in ("add_config_flags", "config_flag_fields"):
        from .commands import train

        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cmd_models(args) -> int:
    from .models import MODELS, LanguageModel, build_config, model_names

    rows = []
    for name in model_names():
        cfg = build_config(name, vocab_size=66)
        n = LanguageModel(cfg).num_parameters() if args.params else None
        rows.append((name, n, MODELS[name].description))
    width = max(len(r[0]) for r in rows)
    for name, n, desc in rows:
        extra = f"{n / 1e6:6.2f}M  " if n is not None else ""
        print(f"{name:<{width}}  {extra}{desc}")
    return 0


def build_parser():
    """The ``mnemo`` parser (an ``argparse.ArgumentParser``: :class:`mnemo.argtypes.Parser`)."""
    from . import argtypes as kinds

    p = kinds.Parser(prog="mnemo", description="Sequence models as associative memories.")
    sub = p.add_subparsers(dest="command", required=True)
    # train, eval and generate, then models, then bench and the feature modules: the order of
    # ``mnemo --help``
    from .commands import bench, evaluate, train

    train.add_commands(sub)
    evaluate.add_commands(sub)
    m = sub.add_parser("models", help="list the registered model names")
    m.add_argument("--params", action="store_true", help="also count parameters (char vocabulary)")
    m.set_defaults(func=_cmd_models)
    bench.add_commands(sub)

    # feature modules add their own sub-commands: each exposes ``add_commands(subparsers)``
    import importlib

    for module in _COMMAND_MODULES:
        importlib.import_module(module).add_commands(sub)
    return p


#: modules that register more sub-commands (see ``build_parser``)
_COMMAND_MODULES: list[str] = [
    "mnemo.commands.sweep",
    "mnemo.commands.continual",
    "mnemo.commands.probe",
    "mnemo.commands.verify",
    "mnemo.commands.convert",
    "mnemo.commands.harness",
    "mnemo.commands.tokenizer",
    "mnemo.commands.info",
]


def main(argv: list[str] | None = None) -> int:
    """The ``mnemo`` command: its exit status (0 done, 1 a failed check or a diverged run, 2 a
    usage or data error in one line, 3 ``mnemo verify`` on a forced backend that served nothing,
    130 interrupted, 141 its output's reader went)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while the libraries load or the arguments are read: no work yet
        print("\nmnemo: interrupted before any work began; nothing was written", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    import os
    import warnings

    try:  # an unknown MNEMO_CHECK_FINITE / MNEMO_WORKSPACE_MB (read as the ops load) is said in one line
        from . import hf  # noqa: F401  (registers the converters: commands read transformers folders too)
        from .ops._native import enabled as native_enabled
        from .ops.dispatch import BackendError, current_backend
        from .runtime import tune_malloc
        from .train import TrainingDiverged
        from .train.distributed import cleanup
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"mnemo: error: {e}", file=sys.stderr)
        return 2

    try:  # a bad value is refused here, before any work: one line on stderr, status 2
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2): returned, as every other status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    # under torchrun every rank meets the same error: rank 0 reports it
    quiet = os.environ.get("RANK", "0") != "0"

    def report(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr)

    command = " ".join(
        str(c)
        for c in (
            args.command,
            getattr(args, "probe_command", None),
            getattr(args, "tokenizer_command", None),
        )
        if c
    )

    def one_line_warning(message, category, filename, lineno, line=None) -> str:
        # a warning reads as the errors do: no source path, no echoed source line
        kind = "warning" if category is UserWarning else f"warning ({category.__name__})"
        return f"mnemo {command}: {kind}: {message}\n"

    was_format = warnings.formatwarning
    warnings.formatwarning = one_line_warning
    try:
        # an unknown MNEMO_BACKEND / MNEMO_NATIVE / MNEMO_MALLOC_TUNE is said before any work (one line)
        current_backend()
        native_enabled()
        tune_malloc()  # freed tensors' memory stays in the process: no page fault per new tensor
        code = args.func(args)
        # a buffered stdout (not a terminal, no PYTHONUNBUFFERED) whose reader went fails here, under
        # the handlers below, not in the interpreter's exit flush (exit 120, 'Exception ignored')
        out = sys.stdout  # (None under pythonw; a closed one has nothing left to write)
        if out is not None and not getattr(out, "closed", False):
            out.flush()
        return code
    except TrainingDiverged as e:
        report(f"mnemo: {e}")
        return 1
    # user errors; anything else (a TypeError included) is a bug and shows its traceback
    except (ValueError, FileNotFoundError, ImportError, BackendError) as e:
        report(f"mnemo {command}: error: {e}")
        return 2
    except BrokenPipeError:  # the reader went (``mnemo models | head -1``): quiet, as a killed pipe
        try:  # nothing more reaches the closed pipe (Python flushes stdout at exit)
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)  # (the duplicate stays; a main called again opened one more each time)
        except (OSError, ValueError):
            pass
        return 141
    except OSError as e:  # the file system refused (a full disk, a read-only place, a permission)
        report(f"mnemo {command}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        return 2
    except KeyboardInterrupt as e:
        detail = f" ({e})" if str(e) else ""
        then = getattr(e, "then", None)  # (the command knows better: nothing saved yet, say)
        if then is None:
            then = {
                # (mnemo train says what its run folder holds; this is before it knew the folder)
                "train": "; nothing was written",
                "sweep": "; finished runs are stored: run the same mnemo sweep command again to continue",
            }.get(args.command, "")
        report(f"\nmnemo: interrupted{detail}{then}")
        return 143 if getattr(e, "signal", None) == "SIGTERM" else 130  # 128 + the signal's number
    finally:
        warnings.formatwarning = was_format
        cleanup()


if __name__ == "__main__":
    sys.exit(main())

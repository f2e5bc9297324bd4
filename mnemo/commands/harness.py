"""``mnemo harness``: evaluate a checkpoint on lm-evaluation-harness tasks.

Runs ``lm_eval.simple_evaluate`` with the ``"mnemo"`` model of :mod:`mnemo.hf.harness` (the
checkpoint's own tokenizer, batched log-likelihoods, perplexity over the whole document with the
model's state), prints lm-eval's results table and writes the results as JSON. Needs the extra
``pip install "mnemo[hf]"``.

    mnemo harness --checkpoint runs/x --tasks lambada_openai,wikitext --limit 100
    mnemo harness --checkpoint runs/x --tasks my_task --include-path tasks/ --out results.json

With ``--include-path``, tasks found there are loaded without indexing lm-eval's own task
collection (which takes a while); any other task name falls back to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .. import argtypes as kinds

HELP = "evaluate a checkpoint on lm-evaluation-harness tasks (log-likelihood, perplexity, generation)"


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        type=kinds.ExistingDir("a run or checkpoint folder"),
        help="checkpoint directory or run directory (its latest)",
    )
    p.add_argument(
        "--tasks",
        required=True,
        type=kinds.Text("comma-separated task names"),
        help="comma-separated lm-eval task (or group) names",
    )
    p.add_argument(
        "--include-path",
        type=kinds.ExistingDir(),
        help="a directory of extra task YAML files (searched before lm-eval's own)",
    )
    p.add_argument(
        "--limit",
        type=kinds.Float(0, 2**31 - 1, lo_open=True),
        help="documents per task (a fraction of each task when below 1); default all",
    )
    p.add_argument(
        "--num-fewshot",
        type=kinds.Int(0, 1000),
        help="few-shot examples per prompt, at most 1000 (default: the task's)",
    )
    p.add_argument(
        "--batch-size", type=kinds.positive_int, default=16, help="sequences per forward pass (default 16)"
    )
    p.add_argument("--device", default="cpu", type=kinds.device, help="cpu (default), cuda, cuda:1, ...")
    p.add_argument(
        "--model-args",
        default="",
        help="more options of the mnemo lm-eval model as key=value,...: max_length, rolling "
        "(state|window), prefix_token_id, add_bos_token (true|false), max_gen_toks, dtype "
        "(see mnemo.hf.harness)",
    )
    p.add_argument(
        "--out",
        default="harness_results.json",
        type=kinds.OutFile(suffix=".json"),
        help="where to write the results JSON (default: harness_results.json in the current directory)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the --out file if it exists (default: refuse)"
    )
    p.add_argument(
        "--seed",
        type=kinds.Int(0, 2**32 - 1),  # (lm-eval seeds numpy with it too, which takes no more)
        default=0,
        help="seed of lm-eval's sampling and few-shot choice, below 2**32 (default 0)",
    )
    p.add_argument(
        "--log-samples",
        action="store_true",
        help="also write each request's inputs and responses (log-likelihoods, generations) into --out",
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("harness", help=HELP, description=kinds.plain_text(__doc__.split("\n\n")[0]))
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_commands(subparsers) -> None:
    """The hook ``mnemo.cli`` calls for each command module (see ``mnemo.cli._COMMAND_MODULES``)."""
    add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    p = kinds.Parser(prog="mnemo harness", description=HELP)
    _add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``mnemo harness`` as a function: returns the exit status."""
    return run(build_parser().parse_args(argv))


def _task_manager(tasks: list[str], include_path: str | None):
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path: {include_path!r} is not a directory")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"--tasks: unknown task(s) {unknown}"
            + ("" if include_path else " (a task of your own needs --include-path DIR)")
        )
    return manager


#: the options of the mnemo lm-eval model that --model-args may set (the checkpoint is --checkpoint)
MODEL_ARGS = ("max_length", "rolling", "prefix_token_id", "add_bos_token", "max_gen_toks", "dtype")


def parse_model_args(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` as a dict; ``ValueError`` for an item without ``=``, an empty or repeated key,
    an empty value, or a key the mnemo model does not read (:data:`MODEL_ARGS`)."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(
                f"--model-args: expected key=value items separated by commas, got {item.strip()!r}"
            )
        if key not in MODEL_ARGS:
            raise ValueError(
                f"--model-args: unknown option {key!r}; the mnemo model reads {', '.join(MODEL_ARGS)}"
            )
        if key in out:
            raise ValueError(f"--model-args: {key!r} is given twice")
        if not value.strip():  # the model reads an empty value as its default: said, not ignored
            raise ValueError(
                f"--model-args: {key!r} has no value, got {item.strip()!r} (leave it out for its default)"
            )
        out[key] = value.strip()
    return out


def run(args) -> int:
    try:
        import lm_eval
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError as e:
        raise ImportError(f"mnemo harness needs lm-eval: pip install 'mnemo[hf]' ({e})") from None

    from mnemo.bench import dumps_json
    from mnemo.hf.harness import MnemoLM  # noqa: F401  (registers the "mnemo" lm-eval model)
    from mnemo.train import resolve_checkpoint
    from mnemo.train.checkpoint import atomic_write_text

    kinds.refuse_existing(args.out, "--out", args.overwrite)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks: expected at least one task name")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected a positive int, got {args.batch_size}")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit: expected a positive number, got {args.limit}")
    if args.limit is not None and args.limit > 1 and args.limit != int(args.limit):
        raise ValueError(
            "--limit: expected a fraction below 1 (of each task) or a whole number of documents, "
            f"got {args.limit}"
        )
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    ckpt = resolve_checkpoint(args.checkpoint, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    from .evaluate import refuse_task_checkpoint

    refuse_task_checkpoint(ckpt, "the harness scores text")
    model_args = {"checkpoint": str(ckpt), **parse_model_args(args.model_args)}
    manager = _task_manager(tasks, args.include_path)

    t0 = time.time()
    results = lm_eval.simple_evaluate(
        model="mnemo",
        model_args=model_args,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        device=args.device,
        limit=limit,
        task_manager=manager,
        log_samples=args.log_samples,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    elapsed = time.time() - t0
    out = Path(args.out)  # checked writable when the command line was read (before the work)
    out.parent.mkdir(parents=True, exist_ok=True)
    # strict JSON (lm-eval's own writer leaves bare NaN, e.g. a stderr of one sample): null there,
    # named in the "nonfinite" map (mnemo.bench.loads_json restores it)
    text = dumps_json(json.loads(json.dumps(results, default=handle_non_serializable)))
    atomic_write_text(out, text)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    print(f"checkpoint: {ckpt}")
    print(f"wrote {out} ({elapsed:.1f}s)")
    return 0

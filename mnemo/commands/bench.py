"""``mnemo bench``: the ops, peers, decode, models and roofline suites (tables, never asserted in tests)."""

from __future__ import annotations

from pathlib import Path

from .. import argtypes as kinds

#: the suites that read each suite-specific option (the others are refused there, not ignored)
SUITE_OPTIONS = {
    "dtypes": ("ops",),
    "lengths": ("ops",),
    "heads": ("ops",),
    "head_dim": ("ops",),
    "batch": ("ops",),
    "modes": ("ops",),
    "recurrent_max_len": ("ops",),
    "ops": ("ops", "peers", "decode"),
    "repeats": ("ops", "peers", "models", "roofline"),
    "device": ("ops", "models"),
    "contexts": ("decode",),
    "decode_steps": ("decode",),
    "decode_processes": ("decode",),
    "d_model": ("decode", "models", "roofline"),
    "n_layers": ("decode", "models", "roofline"),
    "models": ("decode", "models", "roofline"),
    "peers": ("models",),
    "model_shapes": ("models", "roofline"),
    "gen_batches": ("models", "roofline"),
    "prompt_len": ("models", "roofline"),
    "gen_tokens": ("models",),
    "compile": ("models", "roofline"),
}
_DEFAULTS: dict = {}


def check_suite_options(args) -> None:
    """``ValueError`` for an option given with a suite that does not read it (``--suite all``
    reads them all but ``--ops``, which it does not apply: refused too)."""
    if args.suite == "all":
        if getattr(args, "ops", None) is not None:  # (each suite runs whole: it would time every op)
            raise ValueError(
                f"--ops {args.ops}: --suite all runs each suite whole and does not apply it; drop --ops, "
                "or time the chosen ops with --suite ops, peers or decode"
            )
        return
    for dest, suites in SUITE_OPTIONS.items():
        if args.suite not in suites and dest in _DEFAULTS and getattr(args, dest, None) != _DEFAULTS[dest]:
            flag = "--" + dest.replace("_", "-")
            where = " or ".join(f"--suite {s}" for s in suites)
            raise ValueError(
                f"{flag} is read by {where}, not by --suite {args.suite}: drop it or change the suite"
            )


def _cmd_bench(args) -> int:
    kinds.refuse_existing(args.json, "--json", args.overwrite)
    if args.json:  # its folder now, not after the work (each suite writes the file itself)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    check_suite_options(args)
    for dest in ("models", "peers", "ops"):  # a name twice would time (and print) its rows twice
        names = [n.strip() for n in (getattr(args, dest, None) or "").split(",") if n.strip()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"--{dest}: {', '.join(map(repr, twice))} given twice; give each name once")
    if args.suite == "all":
        return _bench_all(args)
    return _run_suite(args)


def _run_suite(args) -> int:
    if args.suite == "peers":
        from ..bench.peers import main as bench_main
    elif args.suite == "decode":
        from ..bench.decode import main as bench_main

        if args.n_layers is None:  # --n-layers: 4 for the decode suite, 6 for the models suite
            args.n_layers = 4
    elif args.suite == "models":
        from ..bench.models import main as bench_main
    elif args.suite == "roofline":
        from ..bench.roofline import main as bench_main
    else:
        from ..bench.ops import main as bench_main
    return bench_main(args)


def _check_all_args(args) -> None:
    """``--suite all``: refuse, before the first suite runs, the arguments that only the later
    suites read and that are cheap to check (``--models`` against :func:`mnemo.models.model_names`,
    ``--peers``, ``--model-shapes``, ``--gen-batches``, ``--gen-tokens`` and the models suite's
    memory bound), with the messages those suites give: otherwise the ops and peers suites ran
    for minutes first and their rows, kept in a temporary folder, were lost with the error.

    Raises:
        ValueError: naming the option, what was expected and what was given.
    """
    from ..bench.models import (
        DEFAULT_D_MODEL,
        DEFAULT_GEN_BATCHES,
        DEFAULT_SHAPES,
        check_model_names,
        check_peer_names,
        check_shapes_memory,
        parse_gen_batches,
        parse_shapes,
    )

    if args.models is not None:  # the decode suite's check (it runs before the models suite)
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if not models:
            raise ValueError(f"--models: expected at least one model name, got {args.models!r}")
        check_model_names(models)
    if args.peers is not None and args.peers != "none":  # the models suite's checks from here on
        peers = [n.strip() for n in args.peers.split(",") if n.strip()]
        if not peers:
            raise ValueError(f"--peers: expected at least one name, got {args.peers!r}")
        check_peer_names(peers)
    shapes = parse_shapes(args.model_shapes or DEFAULT_SHAPES)
    gen_batches = parse_gen_batches(args.gen_batches or DEFAULT_GEN_BATCHES)
    d_model = args.d_model or DEFAULT_D_MODEL
    check_shapes_memory(shapes, d_model, args.device)
    check_shapes_memory(
        [(args.prompt_len + args.gen_tokens, b) for b in gen_batches],
        d_model,
        args.device,
        flag="--gen-batches x (--prompt-len + --gen-tokens)",
    )
    if not shapes and not gen_batches:
        raise ValueError(
            "--model-shapes none with --gen-batches none: nothing to time (keep training shapes, generation "
            "batches, or both)"
        )
    if args.gen_tokens < 2:
        raise ValueError(
            f"--gen-tokens: expected >= 2 (first token + at least one step), got {args.gen_tokens}"
        )


def _bench_all(args) -> int:
    """``--suite all``: the ops, peers, decode and models suites one after another in one process
    (one set of machine conditions), their tables printed and their rows in one JSON
    ``{"ops": ..., "peers": ..., "decode": ..., "models": ...}``. ``--ops`` is not applied (each
    suite runs whole; ``--models`` still selects the models and decode suites' rows, ``--peers`` the
    models suite's)."""
    import copy
    import tempfile

    from ..bench import loads_json

    _check_all_args(args)
    rc = 0
    suites = ("ops", "peers", "decode", "models")
    combined = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for suite in suites:
                a = copy.copy(args)
                a.suite, a.ops, a.json = suite, None, str(Path(tmp) / f"{suite}.json")
                print(f"\n=== mnemo bench --suite {suite} ===", flush=True)
                rc = max(rc, _run_suite(a))
                path = Path(a.json)
                # the suite's NaN/inf restored: the combined file names them in one "nonfinite" map
                combined[suite] = loads_json(path.read_text()) if path.is_file() else None
    except KeyboardInterrupt as e:  # the finished suites' rows are kept (the others are null)
        if args.json and combined:
            from ..bench import write_json

            write_json(args.json, {s: combined.get(s) for s in suites})
            e.then = f"; the rows of the finished suites ({', '.join(combined)}) are saved in {args.json}"
        elif args.json:
            e.then = f"; no suite finished: {args.json} was not written"
        raise
    if args.json:
        from ..bench import write_json

        write_json(args.json, combined)  # strict JSON (a bare NaN of a suite's row was written here)
        print(f"wrote {args.json}")
    return rc


def add_commands(sub) -> None:
    """Add ``bench`` to the ``mnemo`` sub-command parser."""
    b = sub.add_parser("bench", help="time every op and form against causal SDPA (a table, not a test)")
    b.add_argument(
        "--suite",
        choices=["ops", "peers", "decode", "models", "roofline", "all"],
        default="ops",
        help="ops: every op and form vs causal SDPA; peers: ours vs installed PyPI peers; decode: one-token "
        "decoding speed and memory vs context length; models: whole models' training and generation "
        "tokens/s beside the installed peers' equivalent models; roofline: this machine's GEMM rate and "
        "memory bandwidth, each model's training FLOP/s and decoding bytes/s as fractions of them, and "
        "where the training step's time goes; all: ops, peers, decode and models in one run (one JSON) "
        "(default ops)",
    )
    b.add_argument(
        "--dtypes",
        default="fp32",
        type=kinds.Text("fp32 and/or bf16"),
        help="ops suite: fp32 and/or bf16 (comma-separated; default fp32)",
    )
    b.add_argument(
        "--contexts",
        default="1024,4096,16384,65536",
        type=kinds.IntList(1, unique=True),
        help="decode suite: context lengths (default 1024,4096,16384,65536)",
    )
    b.add_argument(
        "--decode-steps",
        type=kinds.positive_int,
        default=64,
        help="decode suite: one-token steps timed (default 64)",
    )
    b.add_argument(
        "--decode-processes",
        type=kinds.positive_int,
        default=3,
        help="decode suite: fresh processes per row; the row is their median (default 3)",
    )
    b.add_argument(
        "--d-model",
        type=kinds.width,
        default=256,
        help="decode, models and roofline suites: model width (default 256)",
    )
    b.add_argument(
        "--n-layers",
        type=kinds.depth,
        default=None,
        help="decode, models and roofline suites: model depth (default 4, 6 and 6)",
    )
    b.add_argument(
        "--models",
        type=kinds.Text("comma-separated model names"),
        help="models, decode and roofline suites: comma-separated model names (default: every registered "
        "model for the models suite, seven typical ones for the decode suite, gated_deltanet, mamba2, gla, "
        "transformer, titans_lmm and hope for the roofline suite; `mnemo models` lists them)",
    )
    b.add_argument(
        "--peers",
        type=kinds.Text("comma-separated peer names or 'none'"),
        help="models suite: comma-separated peers (transformers_mamba, transformers_mamba2, "
        "transformers_qwen3_next, mambapy, titans_pytorch, titans_pytorch_lmm, nested_learning, "
        "nested_learning_updates; "
        "default: all, the ones not installed are reported and skipped) or 'none'",
    )
    b.add_argument(
        "--model-shapes",
        default=None,
        type=kinds.Text("TxB shapes or 'none'"),
        help="models and roofline suites: training shapes TxB (sequence length x batch), comma-separated "
        "(default 1024x8,4096x2 and 1024x8), or 'none' for the models suite (generation rows only)",
    )
    b.add_argument(
        "--gen-batches",
        default="1,8",
        type=kinds.IntList(1, words=("none",), unique=True),
        help="models and roofline suites: generation (decoding) batch sizes, or 'none' (training rows only) "
        "(default 1,8)",
    )
    b.add_argument(
        "--prompt-len",
        type=kinds.positive_int,
        default=256,
        help="models and roofline suites: generation prompt tokens (roofline: the decoding state's context) "
        "(default 256)",
    )
    b.add_argument(
        "--gen-tokens",
        type=kinds.positive_int,
        default=64,
        help="models suite: new tokens per generate() (default 64)",
    )
    b.add_argument(
        "--compile",
        action="store_true",
        help="models suite: also time every mnemo model under torch.compile (train forward/backward and "
        "the decode step), with its graph breaks; roofline suite: also time the decode step "
        "generate(compile=True) runs; eager only where compilation is unavailable",
    )
    b.add_argument(
        "--lengths",
        default="512,1024,2048,4096,8192",
        type=kinds.IntList(1, unique=True),
        help="ops suite: comma-separated T values (default 512,1024,2048,4096,8192)",
    )
    b.add_argument("--heads", type=kinds.Int(1, 4096), default=4, help="ops suite: heads H (default 4)")
    b.add_argument(
        "--head-dim", type=kinds.Int(1, 65536), default=64, help="ops suite: head dimension (default 64)"
    )
    b.add_argument("--batch", type=kinds.positive_int, default=1, help="ops suite: batch size B (default 1)")
    b.add_argument(
        "--ops",
        type=kinds.Text("comma-separated op names or patterns"),
        help="comma-separated subset of op (or peer comparison) names, or shell-style patterns as in "
        "`mnemo verify --ops` ('gla*': gla_scalar and gla_channel); each must match a name (the decode "
        "suite reads it as --models: exact model names)",
    )
    b.add_argument(
        "--modes",
        type=kinds.Text("comma-separated forms"),
        help="ops suite: comma-separated subset of the forms to time (chunk, parallel, recurrent; "
        "default all); softmax attention's parallel row, the x SDPA reference, always runs",
    )
    b.add_argument(
        "--recurrent-max-len",
        type=kinds.nonneg_int,
        default=2048,
        help="ops suite: skip the token-loop reference above this T (it is slow by design; default 2048)",
    )
    b.add_argument(
        "--repeats",
        type=kinds.Int(1, 1000),
        default=3,
        help="timed runs per row, at most 1000 (medians; the models suite interleaves them across rows) "
        "(default 3)",
    )
    b.add_argument("--json", type=kinds.OutFile(suffix=".json"), help="also write the rows to this JSON file")
    b.add_argument(
        "--overwrite", action="store_true", help="replace the --json file if it exists (default: refuse)"
    )
    b.add_argument(
        "--device",
        default="cpu",
        type=kinds.device,
        help="ops and models suites: cpu, cuda, ... (default cpu)",
    )
    b.set_defaults(func=_cmd_bench)
    _DEFAULTS.update({dest: b.get_default(dest) for dest in SUITE_OPTIONS})

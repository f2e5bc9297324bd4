"""``mnemo probe``: circuit scores and memory time scales of a checkpoint, and training curves.

    mnemo probe circuits --checkpoint DIR      per-layer/head scores (JSON on stdout) + heatmaps
    mnemo probe timescales --checkpoint DIR    half-life distributions per layer (JSON) + a plot
    mnemo probe plot-training DIR              loss and tracked circuit scores against steps
    mnemo probe ablate --checkpoint DIR --top-induction K   the causal check of induction heads (JSON)
    mnemo probe spectrum --checkpoint DIR     memory spectrum (Lyapunov exponents) per layer (JSON) + a plot
    mnemo probe capacity --out DIR            what a test-time-trained memory stores (no checkpoint;
                                              :mod:`mnemo.interp.capacity`)

Each figure is titled with the model and the checkpoint (or run) it shows; each command names the
PNG it wrote (``wrote PATH``: on stderr where stdout carries the JSON).

The scores, the training callback (``CircuitTracker``) and the figures are library code in
:mod:`mnemo.interp.probe`; this module loads checkpoints and runs (through :mod:`mnemo.train`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from .. import argtypes as kinds
from ..interp.probe import circuit_scores, circuits_figure, spectrum_flow_figure, training_figure

_CKPT = kinds.ExistingDir("a run or checkpoint folder")
_DEFAULT_OUT = "RUN/probes/ckpt-NNNNNN/ for a run's checkpoint, else CKPT/probes/"


def default_out(ckpt: Path) -> Path:
    """Where a probe writes when no ``--out`` is given: ``RUN/probes/ckpt-NNNNNN/`` for a
    checkpoint of a run folder (never inside the checkpoint, which training rotates away), else
    ``CKPT/probes/`` (a checkpoint folder of its own, e.g. from ``mnemo convert``)."""
    ckpt = Path(ckpt)
    if (ckpt.parent / "latest").is_file():
        return ckpt.parent / "probes" / ckpt.name
    return ckpt / "probes"


def _json(record, **kw) -> str:
    """Strict JSON as every command writes it (:func:`mnemo.train.sinks.dumps_record`): a NaN or
    infinite value (an undefined score, e.g. no head to score; an infinite half-life) is ``null``
    and the record's field ``"nonfinite"`` maps where it was, so that
    :func:`mnemo.train.sinks.loads_record` restores the floats (files of before hold a bare ``null``,
    which it leaves as it is)."""
    from ..train.sinks import dumps_record

    return json.dumps(json.loads(dumps_record(record)), allow_nan=False, **kw)


def _write_json(path: Path, record) -> None:
    from ..train.checkpoint import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, _json(record, indent=1) + "\n")


def _check_probe_memory(model, batch: int, length: int, flag: str, maps: bool = True) -> None:
    from ..train.memory_estimate import check_forward_memory

    check_forward_memory(model.config, batch, length, "cpu", flag=flag, maps=maps)


def _load(checkpoint):
    from ..models import LanguageModel
    from ..train import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    # float32 whatever the stored dtype, as eval/generate load (a bf16 folder probed in bf16 rounds
    # every map and gate; before from_pretrained kept the stored dtype it was float32 here too)
    return ckpt, LanguageModel.from_pretrained(ckpt, dtype="float32").eval()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _short_path(path) -> str:
    """``path`` as the user would type it: relative to the working directory when it lies below it,
    and cut to its last three parts (``…/run/ckpt-000500``) when still long."""
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            pass
    text = str(p)
    if len(text) > 48 and len(p.parts) > 3:
        text = str(Path("…", *p.parts[-3:]))
    return text


def _model_description(ckpt: Path) -> str:
    """``transformer (2 layers) on repeat_segment`` from a checkpoint's train_config.json and
    config.json (the mixers when there is no train config)."""
    from ..models.lm import CONFIG_NAME
    from ..train.checkpoint import TRAIN_CONFIG_NAME

    tcfg, cfg = _read_json(ckpt / TRAIN_CONFIG_NAME), _read_json(ckpt / CONFIG_NAME)
    name = tcfg.get("model")
    if not name:
        mixers = cfg.get("layers") or cfg.get("pattern") or ([cfg["mixer"]] if cfg.get("mixer") else [])
        name = "+".join(dict.fromkeys(mixers)) or "model"
    n = cfg.get("n_layers")
    text = f"{name} ({n} layer{'s' if n != 1 else ''})" if n else str(name)
    on = tcfg.get("task") or tcfg.get("data")
    return f"{text} on {on}" if on else text


def checkpoint_label(ckpt) -> str:
    """What a figure of one checkpoint is of, e.g.
    ``transformer (2 layers) on repeat_segment · runs/x/ckpt-000500 (step 500)``."""
    ckpt = Path(ckpt)
    m = re.fullmatch(r"ckpt-(\d+)", ckpt.name)
    step = f" (step {int(m.group(1))})" if m else ""
    return f"{_model_description(ckpt)} · {_short_path(ckpt)}{step}"


def run_label(run_dir, steps=None) -> str:
    """What a figure of a training run is of, e.g.
    ``transformer (2 layers) on repeat_segment · runs/phase-2layer (1500 steps)``."""
    from ..train import resolve_checkpoint

    run_dir = Path(run_dir)
    try:
        model = _model_description(resolve_checkpoint(run_dir)) + " · "
    except (FileNotFoundError, OSError):
        model = ""  # metrics without a checkpoint: the run directory alone
    n = f" ({steps} steps)" if steps is not None else ""
    return f"{model}{_short_path(run_dir)}{n}"


def _heatmaps(scores: dict, path: Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt

    fig = circuits_figure(scores, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _read_metrics(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (a run directory written by `mnemo train`)")
    rows = []
    from ..train.sinks import loads_record, metrics_lines

    for i, line in enumerate(metrics_lines(metrics), 1):
        if not line.strip():
            continue
        try:
            row = loads_record(line)  # a NaN written as null + "nonfinite" is a NaN again
        except ValueError as e:
            raise ValueError(f"{metrics}, line {i}: not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(
                f"{metrics}, line {i}: expected a JSON object with an int 'step', got {line[:60]!r}"
            )
        rows.append(row)
    return rows


def plot_training(run_dir, path=None) -> Path:
    """Loss and tracked scores from ``RUN/metrics.jsonl`` against steps (``RUN/training.png``);
    with a tracked spectrum also its flow (:func:`~mnemo.interp.probe.spectrum_flow_figure`,
    ``RUN/training_spectrum.png``, or ``PATH``'s name with ``_spectrum``)."""
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = _read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no rows yet: nothing to plot (no step was logged)")
    label = run_label(run_dir, rows[-1]["step"] if rows else None)
    fig = training_figure(rows, label)
    path = Path(path) if path else run_dir / "training.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    flow = spectrum_flow_figure(rows, label)
    if flow is not None:  # a run with TrainConfig.track_spectrum: the spectrum's flow beside it
        flow_path = path.with_name(path.stem + "_spectrum" + path.suffix)
        flow.savefig(flow_path, dpi=120)
        plt.close(flow)
        print(f"wrote {flow_path}")
    return path


def add_commands(sub) -> None:
    p = sub.add_parser("probe", help="circuit scores, memory time scales, training curves, memory capacity")
    ps = p.add_subparsers(dest="probe_command", required=True)
    c = ps.add_parser("circuits", help="per-layer/head circuit scores of a checkpoint (JSON) + heatmaps")
    c.add_argument("--checkpoint", required=True, type=_CKPT)
    c.add_argument(
        "--length",
        type=kinds.Int(2),
        default=32,
        help="length of the random sequence, repeated twice (default 32)",
    )
    c.add_argument("--batch", type=kinds.positive_int, default=8, help="random sequences (default 8)")
    c.add_argument("--seed", type=kinds.seed, default=0, help="seeds the random sequences (default 0)")
    c.add_argument(
        "--out",
        type=kinds.OutDir(not_a_run=True),
        help=f"where to write circuits.json and circuits.png (default: {_DEFAULT_OUT})",
    )
    c.add_argument(
        "--overwrite", action="store_true", help="replace output files that exist (default: refuse)"
    )
    c.set_defaults(func=_cmd_circuits)
    t = ps.add_parser("timescales", help="decay half-life distributions per layer (JSON) + a plot")
    t.add_argument("--checkpoint", required=True, type=_CKPT)
    t.add_argument(
        "--data",
        type=kinds.Text("a corpus name, file, folder or glob"),
        help="text to measure data-dependent gates on (default: the training data)",
    )
    t.add_argument(
        "--text-field",
        type=kinds.Text("a field name"),
        help="JSONL/Parquet --data: the field holding the text (default: 'text', or the training run's)",
    )
    t.add_argument("--tokens", type=kinds.positive_int, default=2048, help="tokens to run (default 2048)")
    t.add_argument(
        "--out",
        type=kinds.OutDir(not_a_run=True),
        help=f"where to write timescales.json and timescales.png (default: {_DEFAULT_OUT})",
    )
    t.add_argument(
        "--overwrite", action="store_true", help="replace output files that exist (default: refuse)"
    )
    t.set_defaults(func=_cmd_timescales)
    pt = ps.add_parser("plot-training", help="plot loss and tracked scores of a run against steps")
    pt.add_argument("run_dir", type=kinds.ExistingDir("a run folder"))
    pt.add_argument("--out", type=kinds.OutFile(suffix=".png"), help="PNG path (default: RUN/training.png)")
    pt.add_argument(
        "--overwrite", action="store_true", help="replace the PNG(s) if they exist (default: refuse)"
    )
    pt.set_defaults(func=_cmd_plot_training)
    ab = ps.add_parser(
        "ablate", help="ablate the top-K induction heads vs K random heads: ICL score and repeat loss (JSON)"
    )
    ab.add_argument("--checkpoint", required=True, type=_CKPT)
    ab.add_argument(
        "--top-induction", type=kinds.positive_int, required=True, metavar="K", help="heads to ablate"
    )
    ab.add_argument(
        "--draws",
        type=kinds.Int(1, 10_000),
        default=10,
        help="draws of K random heads (the control), at most 10,000 (default 10)",
    )
    ab.add_argument(
        "--length",
        type=kinds.Int(2),
        default=32,
        help="length of the random sequence, repeated twice (default 32)",
    )
    ab.add_argument("--batch", type=kinds.positive_int, default=16, help="random sequences (default 16)")
    ab.add_argument(
        "--seed", type=kinds.seed, default=0, help="seeds the random sequences and head draws (default 0)"
    )
    ab.add_argument(
        "--how", choices=("zero", "mean"), default="mean", help="zero- or mean-ablation (default mean)"
    )
    ab.add_argument(
        "--random-from",
        choices=("rest", "all"),
        default="rest",
        help="draw the random heads from those outside the top K (rest) or from all heads (default rest)",
    )
    ab.add_argument(
        "--out",
        type=kinds.OutPath(".json"),
        help=f"JSON path, or a directory for ablate-topK.json (default: {_DEFAULT_OUT})",
    )
    ab.add_argument(
        "--overwrite", action="store_true", help="replace output files that exist (default: refuse)"
    )
    ab.set_defaults(func=_cmd_ablate)
    sp = ps.add_parser(
        "spectrum", help="memory spectrum per layer: forgetting rates, half-lives, classes (JSON + plot)"
    )
    sp.add_argument("--checkpoint", required=True, type=_CKPT)
    sp.add_argument(
        "--data",
        type=kinds.Text("a corpus name, file, folder or glob"),
        help="text to run the memories on (default: the training data)",
    )
    sp.add_argument(
        "--text-field",
        type=kinds.Text("a field name"),
        help="JSONL/Parquet --data: the field holding the text (default: 'text', or the training run's)",
    )
    sp.add_argument("--tokens", type=kinds.Int(2), default=512, help="tokens to run (default 512)")
    sp.add_argument(
        "--directions",
        type=kinds.positive_int,
        default=32,
        help="exponents per head of a test-time-trained memory (JVP) (default 32)",
    )
    sp.add_argument(
        "--irrelevant-half-life",
        type=kinds.positive_float,
        default=4.0,
        help="tokens: shorter half-lives are irrelevant (default 4)",
    )
    sp.add_argument(
        "--burn-in",
        type=kinds.Int(0),
        default=0,
        help="first tokens left out of the averages (a start transient; a layer stepping by chunks skips "
        "the whole chunks that cover them) (default 0)",
    )
    sp.add_argument(
        "--out",
        type=kinds.OutDir(not_a_run=True),
        help=f"where to write spectrum.json and spectrum.png (default: {_DEFAULT_OUT})",
    )
    sp.add_argument(
        "--overwrite", action="store_true", help="replace output files that exist (default: refuse)"
    )
    sp.set_defaults(func=_cmd_spectrum)
    from .capacity import add_parser as add_capacity

    add_capacity(ps)


def _refuse_outputs(args, *paths: Path) -> None:
    """Before any work: an output file that exists is replaced only with ``--overwrite`` (it may
    be the user's, or an earlier probe's result), whether ``--out`` was given or defaulted."""
    for p in paths:
        kinds.refuse_existing(p, "--out" if args.out else "the default --out", args.overwrite)


def _say_fewer_tokens(asked: int, got: int, data: str) -> None:
    """A text shorter than ``--tokens``: the probe runs on all of it, and says so."""
    if got < asked:
        print(
            f"note: --tokens {asked:,}: {data} gives only {got:,} tokens; the probe ran on all of them",
            file=sys.stderr,
        )


def _scored(run, length: int, bos):
    """``run()`` (a probe that reads the layers' maps on ``2 · length`` random tokens, after a BOS
    with ``bos``); a layer whose map cannot cover that many tokens (a mixer
    whose map spans one chunk, whose ``NotImplementedError`` states the limit) becomes one
    ``ValueError`` naming ``--length`` and that limit."""
    try:
        return run()
    except NotImplementedError as e:
        T = 2 * length + (bos is not None)
        tokens = f"2 × --length{' + 1 (the BOS)' if bos is not None else ''} = {T} tokens"
        reason = " ".join(str(e).split())  # one line
        raise ValueError(
            f"--length {length}: {tokens} are more than a layer's map covers: {reason}"
        ) from None


def _induction_out_of_window(model, length: int) -> dict[str, str]:
    """Layer (as the scores name it, ``"0"``) -> note, for each layer whose mixer has an attention
    ``window`` of fewer than ``length`` keys: the induction target of a query (``length − 1`` tokens
    back on random tokens repeated twice, :func:`~mnemo.interp.probe.circuit_scores`) is then out of
    its reach, and its induction scores are 0 by construction, not measured. ``probe circuits``
    writes the note into those layers' entries (``induction_out_of_window``, ``induction_note``),
    ``probe ablate`` into its result (``induction_out_of_window``: its top-K ranking reads those zeros)."""
    notes = {}
    for i, block in enumerate(model.blocks):
        window = getattr(block.mixer, "window", None)
        if isinstance(window, int) and window < length:  # (the target is length − 1 keys back)
            notes[str(i)] = (
                f"the induction target lies {length - 1} tokens back (--length {length} − 1), "
                f"outside this layer's window of {window} keys (the last {window - 1} and the query): "
                "its induction scores are 0 by construction, not measured"
                + (f"; --length {window} or less measures them" if window >= 2 else "")
            )
    return notes


def _cmd_circuits(args) -> int:
    ckpt, model = _load(args.checkpoint)
    out = Path(args.out) if args.out else default_out(ckpt)
    _refuse_outputs(args, out / "circuits.json", out / "circuits.png")
    bos = _run_bos_id(ckpt, model)
    _check_probe_memory(model, args.batch, 2 * args.length + (bos is not None), "--length / --batch")
    scores = _scored(
        lambda: circuit_scores(model, args.length, args.batch, args.seed, bos=bos), args.length, bos
    )
    out_of_window = _induction_out_of_window(model, args.length)
    for layer, entry in scores.items():
        if entry.get("note"):
            print(f"note: layer {layer}: {entry['note']} (--length {args.length})", file=sys.stderr)
        if layer in out_of_window:
            entry["induction_out_of_window"] = True
            entry["induction_note"] = out_of_window[layer]
            print(f"note: layer {layer}: {entry['induction_note']}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    record = {"checkpoint": str(ckpt), "length": args.length, "bos": bos, "layers": scores}
    _write_json(out / "circuits.json", record)
    path = _heatmaps(scores, out / "circuits.png", checkpoint_label(ckpt))
    print(f"wrote {out / 'circuits.json'} and {path}", file=sys.stderr)  # stdout stays one JSON line
    print(_json(record))
    return 0


def _text_field(args, tcfg: dict) -> str:
    """--text-field, else the training run's field for records (:func:`inherited_text_field`)."""
    from ..data.corpus import inherited_text_field

    if args.text_field:
        return args.text_field
    return inherited_text_field(args.data or tcfg.get("data") or "tinyshakespeare", tcfg.get("text_field"))


def _with_run_bos(ids: torch.Tensor, tok, tcfg: dict) -> torch.Tensor:
    """The text's ids as the run's windows read them: with ``TrainConfig.bos`` its first token is
    that fixed token (:func:`mnemo.train.batches.with_bos`; said on stderr)."""
    from ..train.batches import bos_id, with_bos

    bos = bos_id(tok, tcfg.get("bos"))
    if bos is not None and ids.shape[1]:
        print(
            f"the run's first token {tcfg['bos']!r} (id {bos}) at position 0, as in training", file=sys.stderr
        )
    return with_bos(ids, bos) if ids.shape[1] else ids


def _train_config(ckpt: Path) -> dict:
    """The run's saved training configuration (``{}`` for a checkpoint without one)."""
    from ..train.checkpoint import TRAIN_CONFIG_NAME, load_json

    return load_json(ckpt / TRAIN_CONFIG_NAME) if (ckpt / TRAIN_CONFIG_NAME).is_file() else {}


def _run_bos_id(ckpt: Path, model) -> int | None:
    """The id put before the random sequences of ``probe circuits`` and ``probe ablate``, by the rule
    of ``mnemo generate`` and ``mnemo eval`` (:func:`mnemo.hf.special_ids.checkpoint_bos`): a mnemo
    run's fixed first token (``TrainConfig.bos``; ``None`` when it trained without one), else (a
    converted or ``transformers`` checkpoint) the BOS its tokenizer's post-processor puts before a
    text (``None`` without a tokenizer or such a BOS). Said on stderr when there is one."""
    from ..data import load_tokenizer
    from ..data.tokenizer import check_tokenizer_fits
    from ..hf.special_ids import checkpoint_bos, is_training_run
    from ..train.batches import bos_id

    tcfg = _train_config(ckpt)
    if is_training_run(ckpt):
        if tcfg.get("bos") is None:
            return None
        tok = load_tokenizer(ckpt)
        check_tokenizer_fits(tok, model.config.vocab_size, f"--checkpoint {ckpt}")
        bos = bos_id(tok, tcfg["bos"])
        print(
            f"the run's first token {tcfg['bos']!r} (id {bos}) before each sequence, as in training; "
            "no score or loss counts position 0",
            file=sys.stderr,
        )
        return bos
    try:
        tok = load_tokenizer(ckpt)
    except FileNotFoundError:  # no tokenizer: no BOS to read (as generate / eval, which need one)
        return None
    check_tokenizer_fits(tok, model.config.vocab_size, f"--checkpoint {ckpt}")
    bos = checkpoint_bos(ckpt, tok)
    if bos is not None:
        print(
            f"the tokenizer's BOS (id {bos}) before each sequence, as `mnemo generate` and `mnemo eval` "
            "read a text; no score or loss counts position 0",
            file=sys.stderr,
        )
    return bos


def _text_ids(tok, text: str, tokens: int) -> torch.Tensor:
    """The first ``tokens`` token ids of ``text``, ``[1, T]`` (``T < tokens`` only when the whole text
    is shorter): ``--tokens`` counts tokens, not characters (a byte or a BPE tokenizer's token is not
    one character). Encodes a prefix of the text that grows until it gives more than ``tokens`` ids
    (the last, which a cut may have split, is then left out), not the whole corpus."""
    chars = max(int(tokens), 1)
    while True:
        ids = tok.encode(text[:chars])
        if ids.numel() > tokens or chars >= len(text):
            return ids[:tokens][None]
        chars *= 2


def _cmd_timescales(args) -> int:
    from ..data import load_text, load_tokenizer
    from ..data.tokenizer import check_tokenizer_fits
    from ..interp.timescales import plot, timescales

    ckpt, model = _load(args.checkpoint)
    out = Path(args.out) if args.out else default_out(ckpt)
    _refuse_outputs(args, out / "timescales.json", out / "timescales.png")
    tcfg = _train_config(ckpt)
    data = args.data or tcfg.get("data") or "tinyshakespeare"
    _check_probe_memory(model, 1, args.tokens, "--tokens", maps=False)
    if tcfg.get("task") and not args.data:
        ids = torch.randint(
            0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
        )
    else:
        tok = load_tokenizer(ckpt)
        check_tokenizer_fits(tok, model.config.vocab_size, f"--checkpoint {args.checkpoint}")
        ids = _with_run_bos(_text_ids(tok, load_text(data, _text_field(args, tcfg)), args.tokens), tok, tcfg)
    _say_fewer_tokens(args.tokens, int(ids.shape[1]), data)
    result = timescales(model, ids)
    out.mkdir(parents=True, exist_ok=True)
    record = {"checkpoint": str(ckpt), "tokens": int(ids.shape[1]), "layers": result}
    _write_json(out / "timescales.json", record)
    path = plot(result, out / "timescales.png", title=checkpoint_label(ckpt))
    print(f"wrote {out / 'timescales.json'} and {path}", file=sys.stderr)  # stdout stays one JSON line
    print(_json(record))
    return 0


def _cmd_plot_training(args) -> int:
    target = Path(args.out) if args.out else Path(args.run_dir) / "training.png"
    flow = target.with_name(target.stem + "_spectrum" + target.suffix)
    for p in (target, flow):  # the default path too: a file there may be the user's
        kinds.refuse_existing(p, "--out" if args.out else "the default output", args.overwrite)
    path = plot_training(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


#: :func:`~mnemo.interp.interventions.induction_ablation`'s arguments as ``mnemo probe ablate`` names them
_ABLATE_FLAGS = {
    "k": "--top-induction",
    "draws": "--draws",
    "length": "--length",
    "batch": "--batch",
    "how": "--how",
    "random_from": "--random-from",
}


def _as_flags(message: str, flags: dict[str, str]) -> str:
    """A Python API's error ``"name: …"`` as the command line says it (``"--flag: …"``) when ``name``
    is one of ``flags``' arguments; any other message as it is."""
    name, sep, rest = message.partition(": ")
    return f"{flags[name]}: {rest}" if sep and name in flags else message


def _cmd_ablate(args) -> int:
    from ..interp.interventions import induction_ablation

    ckpt, model = _load(args.checkpoint)
    out = Path(args.out) if args.out else default_out(ckpt)
    path = out if out.suffix == ".json" else out / f"ablate-top{args.top_induction}.json"
    _refuse_outputs(args, path)
    bos = _run_bos_id(ckpt, model)
    _check_probe_memory(model, args.batch, 2 * args.length + (bos is not None), "--length / --batch")

    def run():
        return induction_ablation(
            model,
            args.top_induction,
            draws=args.draws,
            length=args.length,
            batch=args.batch,
            seed=args.seed,
            how=args.how,
            random_from=args.random_from,
            bos=bos,
        )

    try:
        result = _scored(run, args.length, bos)
    except ValueError as e:  # a check of the Python API's argument (k's upper bound needs the heads)
        raise ValueError(_as_flags(str(e), _ABLATE_FLAGS)) from None
    result = {"checkpoint": str(ckpt), **result}
    out_of_window = _induction_out_of_window(model, args.length)
    if out_of_window:  # the heads of those layers were ranked by zeros that measure nothing
        result["induction_out_of_window"] = out_of_window
        for layer, note in out_of_window.items():
            print(
                f"note: layer {layer}: {note}; --top-induction ranks its heads by those zeros",
                file=sys.stderr,
            )
    _write_json(path, result)
    print(f"wrote {path}", file=sys.stderr)  # stdout stays one JSON line
    print(_json(result))
    return 0


def _cmd_spectrum(args) -> int:
    from ..data import load_text, load_tokenizer
    from ..data.tokenizer import check_tokenizer_fits
    from ..interp.spectrum import memory_spectrum, plot, to_json

    if args.burn_in >= args.tokens:
        raise ValueError(
            f"--burn-in: expected fewer tokens than --tokens {args.tokens} (some must be left to average), "
            f"got {args.burn_in}"
        )
    if args.irrelevant_half_life >= args.tokens - args.burn_in:
        raise ValueError(
            f"--irrelevant-half-life ({args.irrelevant_half_life:g} tokens) must be shorter than the "
            f"context, --tokens {args.tokens}{f' - --burn-in {args.burn_in}' if args.burn_in else ''}: a "
            "longer half-life is marginal, not irrelevant"
        )
    ckpt, model = _load(args.checkpoint)
    out = Path(args.out) if args.out else default_out(ckpt)
    _refuse_outputs(args, out / "spectrum.json", out / "spectrum.png")
    tcfg = _train_config(ckpt)
    data = args.data or tcfg.get("data") or "tinyshakespeare"
    _check_probe_memory(model, 1, args.tokens, "--tokens", maps=False)
    try:
        tok = None if (tcfg.get("task") and not args.data) else load_tokenizer(ckpt)
    except FileNotFoundError:
        tok = None
        print("no tokenizer in the checkpoint: random tokens", file=sys.stderr)
    if tok is not None:
        check_tokenizer_fits(tok, model.config.vocab_size, f"--checkpoint {args.checkpoint}")
    if tok is None:  # a task model (or no tokenizer): random tokens
        ids = torch.randint(
            0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
        )
    else:
        ids = _with_run_bos(_text_ids(tok, load_text(data, _text_field(args, tcfg)), args.tokens), tok, tcfg)
    _say_fewer_tokens(args.tokens, int(ids.shape[1]), data)
    if args.burn_in >= ids.shape[1]:
        raise ValueError(
            f"--burn-in: expected fewer tokens than the {int(ids.shape[1])} that {data} gives "
            f"(--tokens {args.tokens}), got {args.burn_in}"
        )
    if args.irrelevant_half_life >= ids.shape[1] - args.burn_in:  # a short text: the context is what it gives
        raise ValueError(
            f"--irrelevant-half-life ({args.irrelevant_half_life:g} tokens) must be shorter than the "
            f"context, the {int(ids.shape[1]) - args.burn_in} tokens that {data} gives "
            f"(--tokens {args.tokens}{f', --burn-in {args.burn_in}' if args.burn_in else ''}): a longer "
            "half-life is marginal, not irrelevant"
        )
    result = memory_spectrum(
        model,
        ids,
        directions=args.directions,
        irrelevant_half_life=args.irrelevant_half_life,
        burn_in=args.burn_in,
    )
    out.mkdir(parents=True, exist_ok=True)
    # strict JSON as every command writes it: an infinite half-life (a direction never forgotten) or
    # a -inf exponent is null, and "nonfinite" maps where (mnemo.interp.spectrum.to_json, the
    # library's serialiser; loads_record restores the floats; files of before, with "inf" strings,
    # read as they were)
    record = {"checkpoint": str(ckpt), "tokens": int(ids.shape[1]), "burn_in": args.burn_in, "layers": result}
    record = to_json(record)
    _write_json(out / "spectrum.json", record)
    path = plot(result, out / "spectrum.png", title=checkpoint_label(ckpt))
    print(f"wrote {out / 'spectrum.json'} and {path}", file=sys.stderr)  # stdout stays one JSON line
    print(_json(record))
    return 0

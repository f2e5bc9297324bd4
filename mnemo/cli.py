"""The ``mnemo`` command: train, eval, generate, models, bench."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

from . import argtypes as kinds


def config_flag_fields(cls=None) -> list:
    """The fields of the :class:`~mnemo.train.TrainConfig` dataclass ``cls`` (default
    ``TrainConfig``) that are ``mnemo train`` flags: those whose ``metadata`` holds ``"cli"``
    (``mnemo.train.config._flag``)."""
    import dataclasses

    if cls is None:
        from .train.config import TrainConfig as cls
    return [f for f in dataclasses.fields(cls) if "cli" in f.metadata]


def add_config_flags(parser, cls=None) -> list[str]:
    """Add one flag per :func:`config_flag_fields` field of ``cls`` to ``parser`` (a parser or an
    argument group): ``--seq-len`` for ``seq_len``, its help and argparse options from the field's
    metadata, the default value appended to the help. A ``bool`` field is a switch setting
    ``True``; every flag defaults to ``None`` ("not given": the config file's value stands).
    Returns the field names (the ``args`` attributes)."""
    import dataclasses

    names = []
    for f in config_flag_fields(cls):
        options = dict(f.metadata["cli"])
        shown = options.pop("default_help", None)
        default = None if f.default is dataclasses.MISSING else f.default
        if isinstance(default, bool) or options.get("type") is bool:
            options.pop("type", None)
            options.update(action="store_const", const=True)
        else:
            if "choices" not in options and "type" not in options:
                raise TypeError(
                    f"TrainConfig.{f.name}: its flag declares no kind (metadata type=, see mnemo.argtypes)"
                )
            if shown is None and default is not None:
                shown = str(default)
        if shown is not None:  # "text (note; default X)" or "text (default X)"
            text = options["help"]
            options["help"] = (
                f"{text[:-1]}; default {shown})" if text.endswith(")") else f"{text} (default {shown})"
            )
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, **options)
        names.append(f.name)
    return names


_MODEL_FLAGS = {"d_model": "d_model", "n_layers": "n_layers"}


def _default_out(model: str) -> Path:
    base = Path("runs") / model
    if not base.exists():
        return base
    i = 2
    while Path(f"{base}-{i}").exists():
        i += 1
    return Path(f"{base}-{i}")


def _parse_task_options(items: list[str] | None) -> dict:
    """``["num_pairs=8", "filler=pad"]`` -> ``{"num_pairs": 8, "filler": "pad"}`` (YAML scalars)."""
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-option expects KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return out


def _parse_lengths(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None


def _mapping(d: dict, key: str) -> dict:
    """``d[key]`` of a config file, which flags add keys to: a mapping (``{}`` when absent)."""
    value = d.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"TrainConfig.{key}: expected a mapping, got {value!r}")
    return value


def _saved_config(out: str | None, changes: dict):
    """The configuration a resumed run will have (for the device to join the process group on),
    read from the run's ``latest`` checkpoint without verifying it (the Trainer does)."""
    from .train import TrainConfig
    from .train.checkpoint import TRAIN_CONFIG_NAME, ForeignCheckpointError, load_json, resolve_checkpoint

    if out is None:
        raise ValueError("--resume needs --out DIR (the run directory to continue)")
    try:
        saved = load_json(resolve_checkpoint(out) / TRAIN_CONFIG_NAME)
    except ForeignCheckpointError:
        raise
    except (FileNotFoundError, ValueError):
        saved = {}  # the Trainer reports it (or falls back to an older checkpoint)
    known = {k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig.from_dict({**known, "device": changes.get("device", known.get("device", "cpu"))})


def _saved_task(out) -> str | None:
    """The task of the run saved in ``out`` (None: a text run, or nothing readable there)."""
    from .train.checkpoint import TRAIN_CONFIG_NAME, load_json

    try:
        from .train import resolve_checkpoint

        ckpt = resolve_checkpoint(out, verify=False)
        return load_json(ckpt / TRAIN_CONFIG_NAME).get("task")
    except (OSError, ValueError):
        return None


def _cmd_train(args) -> int:
    import torch

    from .interp import circuit_callbacks
    from .train import TrainConfig, Trainer, load_config_file

    d = load_config_file(args.config) if args.config else {}
    for f in config_flag_fields(TrainConfig):
        value = getattr(args, f.name)
        if value is not None:
            d[f.name] = value
    task_options = _parse_task_options(args.task_option)
    if task_options:
        d["task_options"] = {**_mapping(d, "task_options"), **task_options}
    lengths = _parse_lengths(args.eval_lengths, "--eval-lengths")
    if lengths is not None:
        d["eval_lengths"] = lengths
    overrides = dict(_mapping(d, "model_overrides"))
    for flag, fld in _MODEL_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[fld] = value
    if overrides:
        d["model_overrides"] = overrides
    text_flags = [
        "--" + name.replace("_", "-")
        for name in ("data", "tokenizer", "text_field", "pack_documents")
        if getattr(args, name, None) not in (None, False)
    ]
    if text_flags and (d.get("task") or (args.resume and _saved_task(args.out))):
        raise ValueError(
            f"{', '.join(text_flags)}: text options; a --task run draws its sequences from the task "
            "(its own vocabulary, no corpus or tokenizer)"
        )
    if args.resume and args.overwrite:
        raise ValueError(
            "--resume and --overwrite: give one of them (--resume continues the run in --out, --overwrite "
            "discards its checkpoints and starts over)"
        )
    if args.resume:
        # a resumed run keeps every saved setting: ``d`` holds only what the command line changes
        cfg = _saved_config(args.out, d)
    else:
        if args.reschedule:
            raise ValueError("--reschedule applies to --resume (a changed --steps of a saved run)")
        cfg = TrainConfig.from_dict(d)
    # under torchrun: join the process group first; every rank checks the run directory before
    # rank 0 alone changes it (and alone prints)
    from .train.distributed import backend_for, barrier, init_from_env, local_device

    rank, world = init_from_env(backend_for(local_device(torch.device(cfg.device))))
    main = rank == 0
    # parallel settings need several processes: one process would train without them while the
    # run's train_config.json records them as on (a resumed run refuses only a flag given now)
    for name in ("fsdp", "context_parallel"):
        asked = d.get(name) if args.resume else getattr(cfg, name)
        if asked and world == 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag}: needs several processes (launch with torchrun --nproc_per_node N mnemo train "
                f"...); this is a single process, which would train without it"
            )
    say = print if main else (lambda *a, **k: None)

    if args.out is None:
        if args.resume:
            raise ValueError("--resume needs --out DIR (the run directory to continue)")
        out = _default_out(cfg.model)
    else:
        out = Path(args.out)
        has_ckpt = (out / "latest").exists()
        if not has_ckpt and ((out / "config.json").is_file() or (out / "model.safetensors").is_file()):
            raise ValueError(
                f"--out: {out} holds a checkpoint (config.json / model.safetensors, e.g. an export); a run "
                "there would be hidden behind it: pick another --out"
            )
        if has_ckpt and not (args.resume or args.overwrite):
            raise ValueError(
                f"{out} already holds a run; pass --resume to continue it or --overwrite to start over"
            )
        if args.resume and not has_ckpt:
            raise FileNotFoundError(f"--resume: no checkpoint in {out} (expected {out}/latest)")
        barrier()
        if main and args.overwrite and out.exists():
            from .train.trainer import lock_run_folder

            lock = lock_run_folder(out)  # refuses while another process trains in the folder
            if lock is not None:
                lock.close()

            from .train.checkpoint import discard_checkpoint

            # a checkpoint's own files go; anything else in it (a user's notes, probe outputs) is
            # moved to OUT/kept/ckpt-NNNNNN/ with a warning, as rotation does
            for p in list(out.glob("ckpt-*")) + [out / "latest", out / "metrics.jsonl"]:
                if p.is_dir():
                    if re.fullmatch(r"ckpt-\d+", p.name):  # a folder the user named ckpt-x stays
                        discard_checkpoint(p, out)
                elif p.exists():
                    p.unlink()
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = Trainer(
        d if args.resume else cfg,
        out,
        resume=args.resume,
        reschedule=args.reschedule,
        progress=not args.no_progress,
        callbacks=circuit_callbacks,  # the tracker when the run's config asks (--track-circuits)
    )
    n_params = trainer.model.num_parameters()
    if trainer.task is None:
        source = (
            f"data {trainer.cfg.data} ({trainer.train_data.ids.numel():,} train / "
            f"{trainer.val_data.ids.numel():,} val tokens)"
        )
    else:
        source = f"task {trainer.cfg.task} {trainer.task.options()} (vocab {trainer.task.vocab_size})"
    c = trainer.cfg
    cp = trainer.context_parallel
    rows = c.batch_size // ((1 if cp else world) * c.grad_accum)
    split = f"{c.grad_accum} micro-batches of {rows} sequences" if c.grad_accum > 1 else ""
    if cp:
        split = f"context parallel: {world} processes x {c.seq_len // world} tokens of each sequence" + (
            f", {split}" if split else ""
        )
    elif world > 1:
        split = f"{world} processes x " + (split or f"{rows} sequences")
    split = f" ({split})" if split else ""
    say(
        f"mnemo train: model {c.model} ({n_params / 1e6:.2f}M parameters), {source}, "
        f"{c.steps} steps of {c.batch_size}x{c.seq_len} tokens{split} -> {out}",
        flush=True,
    )
    if trainer.step >= c.steps:
        say(f"already trained to step {trainer.step} (raise --steps to continue)")
    record = trainer.fit()
    if record:
        say(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()}))
    if trainer.task is not None:
        say(f"checkpoint: {trainer.last_checkpoint}")
        say(f"try: mnemo eval --checkpoint {out} --length {4 * c.seq_len}")
        return 0
    if c.sample_tokens > 0 and (main or trainer.fsdp):  # FSDP: every rank runs the sharded model
        text = trainer.sample()
        if main:
            print("\n--- sample ---")
            print(text)
            print("--------------")
    say(f"checkpoint: {trainer.last_checkpoint}")
    say(f"try: mnemo generate --checkpoint {out} --prompt 'KING:'")
    return 0


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _refuse_sharded(ckpt, given) -> None:
    """``ValueError`` for a sharded (FSDP) checkpoint: the single-process commands read one file."""
    from .train.sharded import is_sharded

    if is_sharded(ckpt):
        raise ValueError(
            f"--checkpoint: {ckpt} is a sharded checkpoint of `mnemo train --fsdp`; write a single-file "
            f"copy first: mnemo convert --from-dcp {given} OUT"
        )


def _load(checkpoint: str, device: str):
    from .data import load_tokenizer
    from .models import LanguageModel
    from .train import resolve_checkpoint
    from .train.checkpoint import TRAIN_CONFIG_NAME, load_json

    ckpt = resolve_checkpoint(checkpoint, warn=_warn)
    _refuse_sharded(ckpt, checkpoint)
    task = load_json(ckpt / TRAIN_CONFIG_NAME).get("task") if (ckpt / TRAIN_CONFIG_NAME).is_file() else None
    if task:  # (eval sends task checkpoints elsewhere first)
        raise ValueError(
            f"--checkpoint: {ckpt} was trained on the task {task!r}, whose tokens are ids, not text: "
            "generate writes text (evaluate a task checkpoint with `mnemo eval --checkpoint ...`)"
        )
    model = LanguageModel.from_pretrained(ckpt, map_location=device)
    tok = load_tokenizer(ckpt)
    return ckpt, model, tok


def _cmd_eval_task(args, ckpt, tcfg: dict) -> int:
    from .models import LanguageModel
    from .train import TrainConfig
    from .train.task_eval import evaluate_task

    cfg = TrainConfig.from_dict(tcfg)
    task = cfg.build_task()
    lengths = _parse_lengths(args.length, "--length") or [args.seq_len or cfg.seq_len]
    for L in lengths:
        task.check_length(L, "--length")
    model = LanguageModel.from_pretrained(ckpt, map_location=args.device)
    if model.config.pos_embedding == "learned" and max(lengths) > model.config.max_position:
        raise ValueError(
            f"--length: {max(lengths)} tokens exceed the model's learned positions "
            f"(max_position = {model.config.max_position})"
        )
    num = args.num_samples or cfg.eval_batches * cfg.batch_size
    from .train.memory_estimate import check_forward_memory, check_sequences_memory

    batch = args.batch_size or cfg.batch_size
    for L in lengths:  # refused before anything is drawn or allocated
        check_sequences_memory(num, L, args.device, flag="--num-samples / --length")
        check_forward_memory(model.config, min(batch, num), L, args.device, flag="--batch-size / --length")
    res = evaluate_task(
        model,
        task,
        lengths,
        num_samples=num,
        batch_size=batch,
        train_len=cfg.seq_len,
        seed=cfg.seed,
        device=args.device,
    )
    for L in lengths:
        r = res[L]
        print(
            json.dumps(
                {
                    "checkpoint": str(ckpt),
                    "task": cfg.task,
                    "length": L,
                    "sequences": num,
                    "val_loss": r["loss"],
                    "val_acc": r["acc"],
                    "val_seq_acc": r["seq_acc"],
                }
            )
        )
    return 0


def _cmd_eval(args) -> int:
    from .train import resolve_checkpoint
    from .train.checkpoint import TRAIN_CONFIG_NAME, load_json

    ckpt = resolve_checkpoint(args.checkpoint, warn=_warn)
    _refuse_sharded(ckpt, args.checkpoint)
    tcfg = load_json(ckpt / TRAIN_CONFIG_NAME) if (ckpt / TRAIN_CONFIG_NAME).is_file() else {}
    if tcfg.get("task"):
        text_only = {
            "--yarn": args.yarn is not None,
            "--data": args.data is not None,
            "--text-field": args.text_field is not None,
            "--pack-documents": args.pack_documents is not None,
            "--full": args.full,
            "--max-batches": args.max_batches is not None,
            "--precision": args.precision is not None,
        }
        given = [flag for flag, on in text_only.items() if on]
        if given:
            raise ValueError(
                f"{', '.join(given)}: text checkpoints only; {ckpt} was trained on the task "
                f"{tcfg['task']!r} and is evaluated on fresh draws of it (options: --length, --num-samples, "
                "--batch-size, --seq-len)"
            )
        return _cmd_eval_task(args, ckpt, tcfg)
    if args.num_samples:
        raise ValueError("--num-samples applies to task checkpoints (trained with --task)")
    for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: expected a positive int, got {value}")
    lengths = _parse_lengths(args.length, "--length")
    if lengths and args.seq_len:
        raise ValueError("--length and --seq-len: give one of them (--length L1,L2 evaluates at each)")
    ckpt, model, tok = _load(str(ckpt), args.device)
    yarn = _yarn_setting(args.yarn, tcfg, model) if args.yarn is not None else None
    for L in lengths or [args.seq_len or tcfg.get("seq_len", 128)]:  # one JSON line per length
        if yarn is not None:
            yarn(L)
        extra = _yarn_extra(model) if yarn is not None else None
        code = _cmd_eval_text(args, tcfg, ckpt, model, tok, L, extra)
        if code:
            return code
    return 0


def _yarn_setting(text: str, tcfg: dict, model):
    """``--yarn [FACTOR]``: a function ``L -> None`` that sets YaRN on every attention layer for
    evaluation at length ``L`` (factor ``FACTOR``, or ``L / training seq_len`` for ``auto``; plain
    RoPE where the factor is 1)."""
    train_len = tcfg.get("seq_len")
    if not train_len:
        raise ValueError("--yarn: the checkpoint has no training seq_len to extend (no train_config)")
    if text == "auto":
        factor = None
    else:
        try:
            factor = float(text)
        except ValueError:
            factor = 0.0
        if not factor >= 1:
            raise ValueError(f"--yarn: expected 'auto' or a factor >= 1, got {text!r}")
    layers = [m for m in model.modules() if hasattr(m, "set_rope_scaling") and getattr(m, "rotary", None)]
    if not layers:
        raise ValueError("--yarn: the model has no attention layer with rotary positions")

    def apply(L: int) -> None:
        s = factor if factor is not None else max(1.0, L / train_len)
        scaling = (
            None
            if s == 1
            else {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": train_len}
        )
        for m in layers:
            m.set_rope_scaling(scaling)

    return apply


def _yarn_extra(model) -> dict:
    """The ``rope_scaling`` in force on the first rotary attention layer (for the JSON line)."""
    for m in model.modules():
        if hasattr(m, "set_rope_scaling") and getattr(m, "rotary", None) is not None:
            return {"rope_scaling": m.rotary.scaling}
    return {}


def _cmd_eval_text(args, tcfg: dict, ckpt, model, tok, seq_len: int, extra: dict | None = None) -> int:
    """``mnemo eval`` on a text checkpoint with windows of ``seq_len`` tokens: one JSON line
    (``extra`` added to it)."""
    import math

    import torch

    from .data import load_corpus
    from .train.trainer import packed_logits

    data = args.data or tcfg.get("data", "tinyshakespeare")
    batch_size = args.batch_size or tcfg.get("batch_size", 32)
    text_field = args.text_field or tcfg.get("text_field", "text")
    pack = tcfg.get("pack_documents", False) if args.pack_documents is None else args.pack_documents == "on"
    if args.max_batches is None:  # what training logs: its first eval_batches validation batches
        max_batches = tcfg.get("eval_batches")
    elif args.max_batches == "all":
        max_batches = None
    else:
        try:
            max_batches = int(args.max_batches)
        except ValueError:
            max_batches = 0
        if max_batches < 1:
            raise ValueError(f"--max-batches: expected a positive int or 'all', got {args.max_batches!r}")
    bf16 = (args.precision or tcfg.get("precision", "fp32")) == "bf16"
    corpus = load_corpus(data, text_field)
    val_docs = corpus.split()[1] if not args.full else corpus
    stream = val_docs.stream(tok, seq_len)  # documents joined as in training (the tokenizer's separator)
    unknown = getattr(tok, "unknown_share", None)
    share = unknown(val_docs.text) if unknown is not None else 0.0
    if share > 0:
        _warn(
            f"{share:.1%} of the characters of {data!r} are outside the tokenizer's vocabulary and are "
            "read as <unk>: the loss is not comparable to the training log's"
        )
    model.eval()
    total, count, sequences = 0.0, 0, 0
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad():
        for batch in stream.eval_batches(batch_size, max_batches, with_documents=pack):
            x, y = batch[0], batch[1]
            with autocast:
                if pack:  # each document alone, as training measured it
                    logits = packed_logits(model, x.to(args.device), batch[2].to(args.device))
                else:
                    logits, _ = model(x.to(args.device))
            total += torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), y.to(args.device).flatten(), reduction="sum"
            ).item()
            count += y.numel()
            sequences += y.shape[0]
    if count == 0:
        raise ValueError(
            f"--data: the {'file' if args.full else 'validation split'} of {data!r} is shorter than one "
            f"window of --seq-len {seq_len} + 1 tokens"
        )
    val_loss = total / count
    tokens_per_char = stream.ids.numel() / stream.num_chars
    same = (
        not args.full
        and data == tcfg.get("data", "tinyshakespeare")
        and seq_len == tcfg.get("seq_len")
        and batch_size == tcfg.get("batch_size")
        and max_batches == tcfg.get("eval_batches")
        and bf16 == (tcfg.get("precision") == "bf16")
        and pack == tcfg.get("pack_documents", False)
        and text_field == tcfg.get("text_field", "text")
        and not (extra or {}).get("rope_scaling")  # --yarn changes the model's positions
    )
    result = {
        "checkpoint": str(ckpt),
        "data": data,
        "split": "all" if args.full else "val",
        "sequences": sequences,
        "seq_len": seq_len,
        "tokens": count,
        "precision": "bf16" if bf16 else "fp32",
        "pack_documents": pack,
        "val_loss": val_loss,
        "bpc": val_loss * tokens_per_char / math.log(2),
        # True: the measurement the training log's val_loss makes (same windows and precision)
        "as_in_training": same,
        **(extra or {}),
    }
    print(json.dumps(result))
    return 0


def _check_generate_memory(model, length: int, device: str) -> None:
    """Refuse, before decoding, a generation whose decoding state (a KV cache grows with the
    length) and tokens cannot fit in the memory available on ``device``."""
    import torch

    from .train.memory_estimate import GiB, available_memory

    need = model.state_size_bytes(1, length) + 16 * length
    have, source = available_memory(torch.device(device))
    if have is not None and need > have:
        raise ValueError(
            f"--max-new-tokens: {length:,} tokens need a decoding state of at least {need / GiB:,.1f} GiB, "
            f"but only {have / GiB:,.1f} GiB are available ({source}); lower --max-new-tokens"
        )


def _cmd_generate(args) -> int:
    from .train import generate_text

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: expected an int >= 0, got {args.max_new_tokens}")
    _, model, tok = _load(args.checkpoint, args.device)
    _check_generate_memory(model, len(tok.encode(args.prompt or "\n")) + args.max_new_tokens, args.device)
    unknown = sorted(set(args.prompt) - set(tok.chars)) if hasattr(tok, "chars") else []
    if unknown:
        print(
            f"warning: --prompt: {len(unknown)} character(s) are not in the checkpoint's vocabulary and "
            f"are read as <unk> (shown as \ufffd): {''.join(unknown)!r}",
            file=sys.stderr,
        )
    text = generate_text(
        model,
        tok,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        device=args.device,
        compile=args.compile,
    )
    print(text)
    return 0


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


def _cmd_bench(args) -> int:
    if args.suite == "all":
        return _bench_all(args)
    if args.suite == "peers":
        from .bench.peers import main as bench_main
    elif args.suite == "decode":
        from .bench.decode import main as bench_main

        if args.n_layers is None:  # --n-layers: 4 for the decode suite, 6 for the models suite
            args.n_layers = 4
    elif args.suite == "models":
        from .bench.models import main as bench_main
    else:
        from .bench.ops import main as bench_main
    return bench_main(args)


def _bench_all(args) -> int:
    """``--suite all``: the ops, peers, decode and models suites one after another in one process
    (one set of machine conditions), their tables printed and their rows in one JSON
    ``{"ops": ..., "peers": ..., "decode": ..., "models": ...}``. ``--ops`` is not applied (each
    suite runs whole; ``--models`` still selects the models and decode suites' rows, ``--peers`` the
    models suite's)."""
    import copy
    import tempfile

    rc = 0
    combined = {}
    with tempfile.TemporaryDirectory() as tmp:
        for suite in ("ops", "peers", "decode", "models"):
            a = copy.copy(args)
            a.suite, a.ops, a.json = suite, None, str(Path(tmp) / f"{suite}.json")
            print(f"\n=== mnemo bench --suite {suite} ===", flush=True)
            rc = max(rc, _cmd_bench(a))
            path = Path(a.json)
            combined[suite] = json.loads(path.read_text()) if path.is_file() else None
    if args.json:
        Path(args.json).write_text(json.dumps(combined, indent=2))
        print(f"wrote {args.json}")
    return rc


#: ``mnemo generate --max-new-tokens``'s bound: ~an hour of one-token steps on a laptop CPU
MAX_NEW_TOKENS = 1_000_000


def build_parser() -> argparse.ArgumentParser:
    p = kinds.Parser(prog="mnemo", description="Sequence models as associative memories.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="train a language model on text (default: a small transformer on tinyshakespeare)",
        description="Train a model. Its settings (TrainConfig) are the defaults, then the --config "
        "file's, then the flags given; a resumed run (--resume) keeps its saved settings and the "
        "flags given change only those.",
    )
    from .train.config import TrainConfig

    run = t.add_argument_group("run")
    run.add_argument(
        "--out",
        metavar="DIR",
        type=kinds.OutDir("a run folder to write"),
        help="run directory (default runs/MODEL, runs/MODEL-2, ...)",
    )
    run.add_argument(
        "--config",
        metavar="FILE",
        type=kinds.ExistingFile("an existing YAML/JSON file"),
        help="YAML/JSON file of TrainConfig fields (flags override it)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest intact checkpoint with every saved setting; "
        "flags given change only those settings (each change is printed)",
    )
    run.add_argument(
        "--reschedule",
        choices=["stretch", "hold"],
        help="--resume with a different --steps: 'stretch' recomputes the warm-up + cosine learning "
        "rate over the new --steps (the lr at the resumed step jumps to its place on the new cosine); "
        "'hold' keeps the saved cosine and holds lr x min_lr_ratio after its end",
    )
    run.add_argument("--overwrite", action="store_true", help="discard the checkpoints already in --out")
    run.add_argument("--threads", type=kinds.threads, metavar="N", help="torch intra-op threads")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    settings = t.add_argument_group(
        "training settings", "TrainConfig fields (mnemo.train.TrainConfig); a flag given overrides --config"
    )
    add_config_flags(settings, TrainConfig)
    settings.add_argument(
        "--task-option",
        action="append",
        metavar="KEY=VALUE",
        help="a task option, e.g. --task-option num_pairs=16 (repeatable; over the config file's)",
    )
    settings.add_argument(
        "--eval-lengths",
        metavar="L1,L2",
        type=kinds.IntList(1),
        help="task runs: also test at these lengths at the end, e.g. 1024,4096",
    )
    sizes = t.add_argument_group("model size", "TrainConfig.model_overrides (over the config file's)")
    sizes.add_argument("--d-model", type=kinds.width, metavar="D", help="override the model width")
    sizes.add_argument("--n-layers", type=kinds.depth, metavar="N", help="override the number of layers")
    t.set_defaults(func=_cmd_train)

    e = sub.add_parser(
        "eval", help="validation loss and bits per character (task runs: accuracy) of a checkpoint"
    )
    e.add_argument(
        "--checkpoint",
        required=True,
        type=kinds.ExistingDir("a run or checkpoint folder"),
        help="run directory or checkpoint directory",
    )
    e.add_argument(
        "--data",
        type=kinds.Text("a corpus name, file, folder or glob"),
        help="corpus (default: the one it was trained on)",
    )
    e.add_argument(
        "--text-field",
        type=kinds.Text("a field name"),
        help="JSONL/Parquet: the field holding the text (default: as in training)",
    )
    e.add_argument(
        "--pack-documents",
        choices=["on", "off"],
        help="each document of a window is its own sequence (default: as in training)",
    )
    e.add_argument(
        "--full",
        action="store_true",
        help="draw the windows from the whole file, not only its validation split (with --max-batches "
        "all: every window of the file)",
    )
    e.add_argument("--seq-len", type=kinds.positive_int, help="window length (default: the training seq_len)")
    e.add_argument(
        "--batch-size", type=kinds.positive_int, help="windows per batch (default: the training batch_size)"
    )
    e.add_argument(
        "--max-batches",
        type=kinds.Int(1, words=("all",)),
        help="validation batches to read, or 'all' for the whole split (default: the training "
        "eval_batches, so val_loss is the training log's measurement)",
    )
    e.add_argument(
        "--precision", choices=["fp32", "bf16"], help="default: the training precision (bf16 = autocast)"
    )
    e.add_argument(
        "--length",
        type=kinds.IntList(1),
        help="comma-separated test lengths, one JSON line each (default: the training length; text "
        "checkpoints: window lengths, as --seq-len)",
    )
    e.add_argument(
        "--yarn",
        nargs="?",
        type=kinds.Float(1, words=("auto",)),
        const="auto",
        metavar="FACTOR",
        help="text checkpoints: apply YaRN (Peng et al. 2023) to every rotary attention layer for the "
        "evaluation, original context = the training seq_len, factor FACTOR or (default) length / "
        "training seq_len per --length; plain RoPE where that is 1",
    )
    e.add_argument(
        "--num-samples",
        type=kinds.positive_int,
        help="task checkpoints: test sequences (default: as in training)",
    )
    e.add_argument("--device", default="cpu", type=kinds.device)
    e.set_defaults(func=_cmd_eval)

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument(
        "--checkpoint",
        required=True,
        type=kinds.ExistingDir("a run or checkpoint folder"),
        help="run directory or checkpoint directory",
    )
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument(
        "--max-new-tokens",
        type=kinds.Int(0, MAX_NEW_TOKENS),
        default=300,
        help=f"tokens to generate, at most {MAX_NEW_TOKENS:,} (the text is printed at the end) (default 300)",
    )
    g.add_argument("--temperature", type=kinds.nonneg_float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=kinds.positive_int, help="sample among the K likeliest tokens")
    g.add_argument("--seed", type=kinds.seed, default=0)
    g.add_argument("--device", default="cpu", type=kinds.device)
    g.add_argument(
        "--compile",
        action="store_true",
        help="prefill and decode under torch.compile (the first call compiles for tens of seconds; pays off "
        "on long outputs)",
    )
    g.set_defaults(func=_cmd_generate)

    m = sub.add_parser("models", help="list the registered model names")
    m.add_argument("--params", action="store_true", help="also count parameters (char vocabulary)")
    m.set_defaults(func=_cmd_models)

    b = sub.add_parser("bench", help="time every op and form against causal SDPA (a table, not a test)")
    b.add_argument(
        "--suite",
        choices=["ops", "peers", "decode", "models", "all"],
        default="ops",
        help="ops: every op and form vs causal SDPA; peers: ours vs installed PyPI peers; decode: one-token "
        "decoding speed and memory vs context length; models: whole models' training and generation "
        "tokens/s beside the installed peers' equivalent models; all: the four in one run (one JSON)",
    )
    b.add_argument(
        "--dtypes",
        default="fp32",
        type=kinds.Text("fp32 and/or bf16"),
        help="ops suite: fp32 and/or bf16 (comma-separated)",
    )
    b.add_argument(
        "--contexts",
        default="1024,4096,16384,65536",
        type=kinds.IntList(1),
        help="decode suite: context lengths",
    )
    b.add_argument(
        "--decode-steps", type=kinds.positive_int, default=64, help="decode suite: one-token steps timed"
    )
    b.add_argument(
        "--decode-processes",
        type=kinds.positive_int,
        default=3,
        help="decode suite: fresh processes per row; the row is their median (default 3)",
    )
    b.add_argument("--d-model", type=kinds.width, default=256, help="decode and models suites: model width")
    b.add_argument(
        "--n-layers",
        type=kinds.depth,
        default=None,
        help="decode and models suites: model depth (default 4 and 6)",
    )
    b.add_argument(
        "--models",
        type=kinds.Text("comma-separated model names"),
        help="models and decode suites: comma-separated model names (default: every registered model for the "
        "models suite, seven typical ones for the decode suite; `mnemo models` lists them)",
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
        default="1024x8,4096x2",
        type=kinds.Text("TxB shapes or 'none'"),
        help="models suite: training shapes TxB (sequence length x batch), comma-separated, or 'none' "
        "(generation rows only)",
    )
    b.add_argument(
        "--gen-batches",
        default="1,8",
        type=kinds.IntList(1, words=("none",)),
        help="models suite: generation batch sizes, or 'none' (training rows only)",
    )
    b.add_argument(
        "--prompt-len", type=kinds.positive_int, default=256, help="models suite: generation prompt tokens"
    )
    b.add_argument(
        "--gen-tokens", type=kinds.positive_int, default=64, help="models suite: new tokens per generate()"
    )
    b.add_argument(
        "--compile",
        action="store_true",
        help="models suite: also time every mnemo model under torch.compile (train forward/backward and "
        "the decode step), with its graph breaks; eager only where compilation is unavailable",
    )
    b.add_argument(
        "--lengths", default="512,1024,2048,4096,8192", type=kinds.IntList(1), help="comma-separated T values"
    )
    b.add_argument("--heads", type=kinds.Int(1, 4096), default=4)
    b.add_argument("--head-dim", type=kinds.Int(1, 65536), default=64)
    b.add_argument("--batch", type=kinds.positive_int, default=1)
    b.add_argument(
        "--ops",
        type=kinds.Text("comma-separated op names"),
        help="comma-separated subset of op (or peer comparison) names",
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
        help="skip the token-loop reference above this T (it is slow by design)",
    )
    b.add_argument(
        "--repeats",
        type=kinds.Int(1, 1000),
        default=3,
        help="timed runs per row, at most 1000 (medians; the models suite interleaves them across rows) "
        "(default 3)",
    )
    b.add_argument("--json", type=kinds.OutFile(), help="also write the rows to this JSON file")
    b.add_argument("--device", default="cpu", type=kinds.device)
    b.set_defaults(func=_cmd_bench)

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
]


def main(argv: list[str] | None = None) -> int:
    import os

    from . import hf  # noqa: F401  (registers the converters: commands read transformers folders too)
    from .runtime import tune_malloc
    from .train import TrainingDiverged
    from .train.distributed import cleanup

    try:  # a bad value is refused here, before any work: one line on stderr, status 2
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2): returned, as every other status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    tune_malloc()  # freed tensors' memory stays in the process: no page fault per new tensor
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
        return args.func(args)
    except TrainingDiverged as e:
        report(f"mnemo: {e}")
        return 1
    # user errors; anything else (a TypeError included) is a bug and shows its traceback
    except (ValueError, FileNotFoundError, ImportError) as e:
        report(f"mnemo {command}: error: {e}")
        return 2
    except OSError as e:  # the file system refused (a full disk, a read-only place, a permission)
        report(f"mnemo {command}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        return 2
    except KeyboardInterrupt as e:
        detail = f" ({e})" if str(e) else ""
        then = {
            "train": "; the last checkpoint is intact: continue with --resume",
            "sweep": "; finished runs are stored: run the same mnemo sweep command again to continue",
        }.get(args.command, "")
        report(f"\nmnemo: interrupted{detail}{then}")
        return 130
    finally:
        warnings.formatwarning = was_format
        cleanup()


if __name__ == "__main__":
    sys.exit(main())

"""``mnemo train``: its parser (TrainConfig's flags, declared in the config's field metadata) and
the command, which resolves the run folder (new, --resume, --overwrite) and runs the
:class:`~mnemo.train.Trainer`."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import warnings
from pathlib import Path

from .. import argtypes as kinds


def config_flag_fields(cls=None) -> list:
    """The fields of the :class:`~mnemo.train.TrainConfig` dataclass ``cls`` (default
    ``TrainConfig``) that are ``mnemo train`` flags: those whose ``metadata`` holds ``"cli"``
    (``mnemo.train.config._flag``)."""
    import dataclasses

    if cls is None:
        from ..train.config import TrainConfig as cls
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
#: TrainConfig's settings of a text run, which a task run does not read
_TEXT_FIELDS = (
    "data",
    "tokenizer",
    "text_field",
    "pack_documents",
    "carry_state",
    "bos",
    "sample_tokens",
    "sample_prompt",
    "sample_temperature",
)


def _default_out(model: str) -> Path:
    base = Path("runs") / model
    if not base.exists():
        return base
    i = 2
    while Path(f"{base}-{i}").exists():
        i += 1
    return Path(f"{base}-{i}")


#: what commands write into a run folder beside its checkpoints by default: ``mnemo probe``'s figures and
#: JSON (``probes/``, :func:`mnemo.commands.probe.default_out`), the trainer's TensorBoard events
#: (``tb/``) and ``mnemo probe plot-training``'s figure (``training.png``)
_DERIVED_RESULTS = ("probes", "tb", "training.png")


def _set_aside_old_results(out: Path) -> None:
    """``--overwrite``: what the discarded run left beside its checkpoints (:data:`_DERIVED_RESULTS`)
    describes the old model, so it moves to ``OUT/kept/overwritten-N/`` with a warning instead of
    mixing with the new run's, or blocking its default outputs (nothing is deleted)."""
    old = [out / name for name in _DERIVED_RESULTS if (out / name).exists() or (out / name).is_symlink()]
    if not old:
        return
    from ..train.checkpoint import new_kept_folder

    names = ", ".join(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in old)
    dest = new_kept_folder(out, "overwritten")
    for p in old:
        p.rename(dest / p.name)
    print(
        f"warning: --overwrite: the old run's {names} moved to {dest} (they describe the discarded model)",
        file=sys.stderr,
    )


def _set_aside_old_run(out: Path) -> Path | None:
    """``--overwrite``, once the new run is built: the old run's checkpoints, ``latest`` and
    ``metrics.jsonl`` move to ``OUT/.overwritten-PID/`` (out of the new run's way; a kill leaves
    them there, whole), ``probes/`` and ``tb/`` to ``OUT/kept/``. :func:`_settle_old_run` then
    discards them once the new run has a checkpoint, or puts them back if it has none."""
    from ..train.checkpoint import _CKPT_NAME, run_checkpoints

    # (a ckpt-NNNNNN linked by hand goes aside too, the link itself, also one whose target is gone: it
    # would be in the way of the new run's checkpoint of that step)
    linked = [p for p in out.glob("ckpt-*") if p.is_symlink() and _CKPT_NAME.fullmatch(p.name)]
    old = run_checkpoints(out) + linked
    old += [p for p in (out / "latest", out / "metrics.jsonl") if p.is_file()]
    _set_aside_old_results(out)
    if not old:
        return None
    aside = out / f".overwritten-{os.getpid()}"
    aside.mkdir()
    for p in old:
        p.rename(aside / p.name)
    return aside


def _say_foreign_entries(out: Path, args) -> None:
    """A new run in a folder that already holds other things (a user's files): say that the run's
    files go beside them, and that ``--overwrite`` has no run there to discard (hostile trial 14:
    it trained into a folder of unrelated files without a word). The ``--config`` file is no news."""
    config = Path(args.config).resolve() if getattr(args, "config", None) else None
    other = sorted(p.name for p in out.iterdir() if p.name != ".lock" and p.resolve() != config)
    if not other:
        return
    shown = ", ".join(other[:3]) + (f", … ({len(other)} in all)" if len(other) > 3 else "")
    print(
        f"warning: --out {out} already holds files that are not a run's ({shown}): the run's files go "
        "beside them, which are left as they are"
        + ("; --overwrite has no earlier run there to discard" if args.overwrite else ""),
        file=sys.stderr,
    )


def _settle_old_run(aside: Path | None, out: Path, replaced: bool) -> None:
    """After ``fit`` (returned or raised): with a new checkpoint (``replaced``), each old checkpoint's
    own files go and anything else in it (a user's notes, probe outputs) moves to
    ``OUT/kept/ckpt-NNNNNN/`` with a warning, as rotation does; without one, the old run comes back
    as it was (the new run's ``metrics.jsonl`` of steps that no checkpoint holds is dropped), said."""
    from ..train.checkpoint import discard_checkpoint

    if aside is None:
        return
    if replaced:
        for p in aside.glob("ckpt-*"):
            discard_checkpoint(p, out)
        shutil.rmtree(aside)
        return
    for name in ("latest", "metrics.jsonl"):
        (out / name).unlink(missing_ok=True)  # (the new run's: no checkpoint holds its steps)
    for p in aside.iterdir():
        p.rename(out / p.name)
    aside.rmdir()
    print(
        f"--overwrite: the new run wrote no checkpoint; the old run in {out} is back as it was",
        file=sys.stderr,
    )


def _refuse_inputs_discarded(out: Path, cfg) -> None:
    """``--overwrite`` discards ``out``'s checkpoints, ``latest`` and ``metrics.jsonl``: a run that
    reads one of them (``--init-from``, ``--data``, ``--tokenizer``) would destroy its own input.

    Raises:
        ValueError: naming the flag, its value and the run folder.
    """
    from ..train.checkpoint import run_checkpoints

    doomed = [p.resolve() for p in (out / "latest", out / "metrics.jsonl", *run_checkpoints(out))]
    for flag, value in (("--init-from", cfg.init_from), ("--data", cfg.data), ("--tokenizer", cfg.tokenizer)):
        if not value or not isinstance(value, (str, Path)):
            continue
        p = Path(value).resolve()
        if (flag == "--init-from" and p == out.resolve()) or any(p == d or d in p.parents for d in doomed):
            raise ValueError(
                f"{flag}: {value} is part of the run in {out}, which --overwrite discards: copy it "
                "elsewhere first, or pick another --out"
            )


def _parse_task_options(items: list[str] | None) -> dict:
    """``["num_pairs=8", "filler=pad"]`` -> ``{"num_pairs": 8, "filler": "pad"}`` (YAML scalars)."""
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-option expects KEY=VALUE, got {item!r}")
        key = key.strip()
        if key in out:
            raise ValueError(
                f"--task-option {key} given twice ({key}={out[key]!r} and {item!r}): give each option once"
            )
        out[key] = yaml.safe_load(value) if value.strip() else None
    return out


def _parse_lengths(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None


def _absolute_data(value):
    """A new run's ``data`` as it is saved: a relative path (or glob) made absolute, so that a later
    ``--resume``, ``mnemo eval`` or ``mnemo generate`` from another working directory reads the same
    text, not whatever that directory holds under the same name; a bundled name, an absolute path
    and a path that exists nowhere (refused later, as given) stay as they are."""
    from ..data.corpus import BUNDLED

    if not isinstance(value, str) or value in BUNDLED:
        return value
    p = os.path.expanduser(value)
    if os.path.isabs(p) or not (os.path.exists(p) or any(c in p for c in "*?[")):
        return value
    parts = Path(p).parts
    wild = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    # a glob's literal folders made absolute, the rest as written (abspath read "*/.." as no folder)
    glob = os.path.join(os.path.abspath(os.path.join(*parts[:wild]) if wild else "."), *parts[wild:])
    return glob + os.sep if p.endswith(("/", os.sep)) else glob  # "corpus/**/" matches folders only


def _data_files_in(pattern: str, out: Path) -> list[str]:
    """The files the data glob ``pattern`` matches in ``out`` or below it, when ``out`` lies at or
    below the glob's literal start: once ``out`` is a run's folder, the corpus reader takes them for
    that run's files and refuses them (:func:`mnemo.data.corpus.run_files`), as ``--out`` equal to a
    ``--data`` folder is refused."""
    import glob

    p = os.path.expanduser(pattern)
    parts = Path(p).parts
    first = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    top = Path(os.path.abspath(os.path.join(*parts[:first]) if first else "."))
    o = Path(os.path.abspath(out))
    if o != top and top not in o.parents:  # (no glob walk for a run folder beside the corpus)
        return []
    found = (f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    return sorted(f for f in found if o in Path(os.path.abspath(f)).parents)


def _same_data(given: str, saved: str) -> bool:
    """Whether ``--data`` names the corpus the run saved: the same text, or the same path however
    it is written (``c.txt`` for a run that saved ``/home/me/c.txt``)."""
    import os

    from ..data.corpus import BUNDLED

    if given == saved:
        return True
    if given in BUNDLED or saved in BUNDLED:
        return False
    return os.path.abspath(os.path.expanduser(given)) == os.path.abspath(os.path.expanduser(saved))


def _mapping(d: dict, key: str) -> dict:
    """``d[key]`` of a config file, which flags add keys to: a mapping (``{}`` when absent)."""
    value = d.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"TrainConfig.{key}: expected a mapping, got {value!r}")
    return value


def _saved_config(out: str | None, changes: dict):
    """The configuration a resumed run will have (for the device to join the process group on),
    read from the run's ``latest`` checkpoint without verifying it (the Trainer does)."""
    from ..train import TrainConfig
    from ..train.checkpoint import TRAIN_CONFIG_NAME, ForeignCheckpointError, load_json, resolve_checkpoint

    if out is None:
        raise ValueError("--resume needs --out DIR (the run directory to continue)")
    try:
        # a damaged latest is said once, by the Trainer, which falls back the same way
        saved = load_json(resolve_checkpoint(out, warn=lambda _msg: None) / TRAIN_CONFIG_NAME)
    except ForeignCheckpointError:
        raise
    except (FileNotFoundError, ValueError):
        saved = {}  # the Trainer reports it (or falls back to an older checkpoint)
    known = {k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__}
    try:
        return TrainConfig.from_dict({**known, "device": changes.get("device", known.get("device", "cpu"))})
    except ValueError:  # a saved setting this mnemo refuses: the Trainer names the file
        return TrainConfig.from_dict({"device": changes.get("device", known.get("device", "cpu"))})


def _saved_task(out) -> str | None:
    """The task of the run saved in ``out`` (None: a text run, or nothing readable there)."""
    from ..train.checkpoint import TRAIN_CONFIG_NAME, load_json

    try:
        from ..train import resolve_checkpoint

        ckpt = resolve_checkpoint(out, verify=False)
        return load_json(ckpt / TRAIN_CONFIG_NAME).get("task")
    except (OSError, ValueError):
        return None


def _cmd_train(args) -> int:
    run: dict = {}  # ``out``: the run folder, once known
    with contextlib.ExitStack() as held:  # the run folder's lock, once taken: until the command ends
        try:
            return _train(args, held, run)
        except KeyboardInterrupt as e:
            # an interrupt that does not say what it left (a second Ctrl-C while the first one's
            # checkpoint was being written, say): what is on disk now, not a guess
            if getattr(e, "then", None) is None and run.get("restored"):  # (--overwrite, nothing saved)
                e.then = (
                    f"; the old run in {run['out']} is back as it was: run the command again to start over"
                )
            elif getattr(e, "then", None) is None and "out" in run:
                e.then = _interrupted_then(run["out"])
            raise


def _interrupted_then(out: Path) -> str:
    """What the ``mnemo: interrupted`` line adds about run folder ``out`` after an interrupt that
    did not say it: its newest checkpoint (what ``--resume`` continues from), or that none was
    saved (and whether a ``metrics.jsonl`` without one needs ``--overwrite`` to start again)."""
    from ..train.checkpoint import resolve_checkpoint

    try:  # (not verified: a second Ctrl-C is no time to hash a large checkpoint; --resume checks it)
        ckpt = resolve_checkpoint(out, verify=False)
    except (OSError, ValueError):
        ckpt = None
    if ckpt is not None:
        again = f"--resume --out {shlex.quote(str(out))}"
        return f"; {out}'s newest checkpoint is {ckpt.name}: continue with {again}"
    if (out / "metrics.jsonl").is_file():
        return f"; no checkpoint was saved in {out} (only its metrics.jsonl): pass --overwrite to start over"
    return f"; no checkpoint was saved in {out}: run the command again to start"


def parameter_count(n: int) -> str:
    """``n`` parameters as the banner says it: the count itself below a million (``"12,345"``; a
    tiny model's ``0.01M`` said nothing), else three significant digits (``"1.23M"``, ``"7.5B"``)."""
    if n < 1_000_000:
        return f"{n:,}"
    if n < 999_500_000:
        return f"{n / 1e6:.3g}M"
    return f"{n / 1e9:.3g}B"


def _converted_model(source: str) -> tuple[str, dict] | None:
    """For ``--init-from`` a checkpoint converted from another library (``mnemo convert``: it holds
    :data:`~mnemo.hf.convert.CARRIED_CONFIG_NAME`) with no ``--model`` nor model flags or
    ``model_overrides``: ``(model, model_overrides)`` that rebuild its architecture — its first
    layer's mixer as the model name and every field of its ``config.json`` but the vocabulary (the
    tokenizer's) as overrides — so that ``mnemo train --init-from DIR --tokenizer DIR`` fine-tunes
    it. ``None`` otherwise (a run of mnemo's own trains the model it is given, as before)."""
    import json

    from ..hf.convert import CARRIED_CONFIG_NAME
    from ..models import ModelConfig
    from ..train.checkpoint import resolve_checkpoint

    try:
        ckpt = resolve_checkpoint(source)
        if not (ckpt / CARRIED_CONFIG_NAME).is_file():
            return None
        config = ModelConfig.from_dict(json.loads((ckpt / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):  # (the run's own loading names what is wrong)
        return None
    fields = config.to_dict()
    for key in ("vocab_size", "model_type"):
        fields.pop(key, None)
    return config.layer_mixers()[0], fields


def _train(args, held: contextlib.ExitStack, run: dict) -> int:
    import torch

    from ..interp import circuit_callbacks
    from ..train import TrainConfig, Trainer, load_config_file

    d = load_config_file(args.config) if args.config else {}
    in_file = dict(d)
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
    if d.get("init_from") and "model" not in d and not overrides:
        adopted = _converted_model(d["init_from"])
        if adopted is not None:  # fine-tuning a converted checkpoint: its own architecture
            d["model"], d["model_overrides"] = adopted
    text_flags = [
        "--" + name.replace("_", "-")
        for name in ("data", "tokenizer", "text_field", "pack_documents", "carry_state", "bos")
        if getattr(args, name, None) not in (None, False)
    ]
    text_flags += [
        "--" + name.replace("_", "-")
        for name in ("sample_tokens", "sample_prompt", "sample_temperature")
        if getattr(args, name, None) not in (None, 0)  # --sample-tokens 0 asks for no sample: fine
    ]
    # the config file's text settings too (a value other than the default: a saved train_config.json
    # of a task run holds the defaults), which a task run would otherwise ignore without a word
    defaults = TrainConfig()
    text_flags += [
        f"{args.config}: {name}"
        for name in _TEXT_FIELDS
        if name in in_file
        and getattr(args, name, None) is None
        and in_file[name] != getattr(defaults, name)
        and not (name == "sample_tokens" and in_file[name] == 0)
    ]
    if text_flags and (d.get("task") or (args.resume and _saved_task(args.out))):
        raise ValueError(
            f"{', '.join(text_flags)}: text options; a --task run draws its sequences from the task "
            "(its own vocabulary, no corpus or tokenizer, no text sample at the end)"
        )
    if args.resume and args.overwrite:
        raise ValueError(
            "--resume and --overwrite: give one of them (--resume continues the run in --out, --overwrite "
            "discards its checkpoints and starts over)"
        )
    if args.resume:
        # a resumed run keeps every saved setting: ``d`` holds only what the command line changes
        cfg = _saved_config(args.out, d)
        if isinstance(d.get("data"), str) and _same_data(d["data"], cfg.data):
            d["data"] = cfg.data  # the saved file however written (a new run saves it absolute)
    else:
        if args.reschedule:
            raise ValueError("--reschedule applies to --resume (a changed --steps of a saved run)")
        if "data" in d:
            d["data"] = _absolute_data(d["data"])
        cfg = TrainConfig.from_dict(d)
    if d.get("optimizer", cfg.optimizer) == "m3_paper":  # Algorithm 1 alone: these are not read
        unread = [k for k in ("warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio") if k in d]
        if unread:
            named = ", ".join(f"{k} (--warmup-steps)" if k == "warmup_steps" else k for k in unread)
            raise ValueError(
                f"{named}: not read with optimizer m3_paper (Nested Learning's Algorithm 1 alone: a "
                "constant lr, no warm-up, decay, weight decay or clipping); drop it, or use --optimizer m3 "
                "(Algorithm 1 with this trainer's warm-up + cosine, weight decay and clipping)"
            )
    # under torchrun: join the process group first; every rank checks the run directory before
    # rank 0 alone changes it (and alone prints)
    from ..train.distributed import backend_for, barrier, init_from_env, local_device

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
    run["out"] = out
    # (a folder's corpus is the files in it; a bundled name is never a folder, whatever the cwd holds)
    from ..data.corpus import BUNDLED, glob_reads_run

    named = isinstance(cfg.data, str) and not cfg.task and cfg.data not in BUNDLED
    data = Path(cfg.data).expanduser() if named else None
    if data is not None and data.is_dir() and out.resolve() == data.resolve():
        raise ValueError(
            f"--out: {out} is the --data folder: the run's files (metrics.jsonl, checkpoints) would go "
            "among its corpus files and the folder would read as a run's, not a corpus; give the run a "
            "folder of its own, e.g. runs/NAME"
        )
    if named and any(c in cfg.data for c in "*?[") and not data.exists() and glob_reads_run(cfg.data, out):
        raise ValueError(
            f"--out: {out} is where --data {cfg.data!r} reads: the glob would match the run's own files "
            "(metrics.jsonl, the checkpoints' .json files), so a --resume or mnemo eval of the run would "
            "read its logs as corpus; give the run a folder outside the glob, e.g. runs/NAME"
        )
    glob_data = named and any(c in cfg.data for c in "*?[") and not data.exists()
    inside = _data_files_in(cfg.data, out) if glob_data else []
    if inside:
        more = f", ... ({len(inside) - 1} more)" if len(inside) > 1 else ""
        raise ValueError(
            f"--out: {out} holds files that --data {cfg.data!r} reads ({inside[0]}{more}): the run's files "
            "(metrics.jsonl, checkpoints) would go among its corpus files and the folder would read as a "
            "run's, not a corpus; give the run a folder of its own, e.g. runs/NAME"
        )
    existed = out.exists()
    if main:  # the folder is this process's from here on: what is checked below stays true until the end
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out: {out} cannot be created: {e.strerror}") from None
        from ..train.run_folder import lock_run_folder

        lock = lock_run_folder(out, remove_empty=not existed)  # refuses while another process holds it
        if lock is not None:
            held.enter_context(lock)
    if args.out is not None:
        has_ckpt = (out / "latest").exists()
        # a run whose `latest` was lost still holds its checkpoints and log
        # (a linked ckpt-* whose target is gone too: the new run's checkpoint of that step fails on it)
        ckpts = out.glob("ckpt-[0-9]*") if out.is_dir() else []
        leftovers = sorted(p.name for p in ckpts if p.is_dir() or p.is_symlink())
        leftovers += ["metrics.jsonl"] if (out / "metrics.jsonl").is_file() else []
        if not has_ckpt and ((out / "config.json").is_file() or (out / "model.safetensors").is_file()):
            raise ValueError(
                f"--out: {out} holds a checkpoint (config.json / model.safetensors, e.g. an export); a run "
                "there would be hidden behind it: pick another --out"
            )
        if has_ckpt and not (args.resume or args.overwrite):
            raise ValueError(
                f"{out} already holds a run; pass --resume to continue it or --overwrite to start over"
            )
        if not has_ckpt and leftovers and not (args.resume or args.overwrite):
            if leftovers == ["metrics.jsonl"]:  # a run that stopped before its first checkpoint
                raise ValueError(
                    f"{out} holds the metrics.jsonl of a run that wrote no checkpoint (nothing to resume); "
                    "pass --overwrite to start over (its log is discarded once the new run has a "
                    "checkpoint), or pick another --out"
                )
            raise ValueError(
                f"{out} holds a run without its `latest` pointer ({', '.join(leftovers[-3:])}); pass "
                "--resume to continue from its newest intact checkpoint or --overwrite to start over"
            )
        if args.resume and not has_ckpt and not any(n.startswith("ckpt-") for n in leftovers):
            raise FileNotFoundError(
                f"--resume: no checkpoint in {out} (expected {out}/latest)"
                + (
                    "; its metrics.jsonl is of a run that wrote none: --overwrite starts over"
                    if leftovers
                    else ""
                )
            )
        if main and existed and not has_ckpt and not leftovers:
            _say_foreign_entries(out, args)
        barrier()
        if args.overwrite and out.exists():
            _refuse_inputs_discarded(out, cfg)  # (every rank: each stops with the same error)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # the data, tokenizer, model and --init-from weights load before --overwrite discards
        trainer = Trainer(
            d if args.resume else cfg,
            out,
            resume=args.resume,
            reschedule=args.reschedule,
            progress=not args.no_progress,
            callbacks=circuit_callbacks,  # the tracker when the run's config asks (--track-circuits)
        )
    except KeyboardInterrupt as e:
        e.then = "; the run was still being set up: " + (
            f"{out} is as it was" if existed else "nothing was written"
        )
        raise
    aside = None
    if args.overwrite and args.out is not None:
        if main and out.exists():
            aside = _set_aside_old_run(out)
        barrier()
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
    streams = trainer.data.streams
    if streams is not None:  # --carry-state: what each stream reads before all restart
        split = f"{split}, " if split else ""
        split += (
            f"carried state: {c.batch_size} streams of {streams.windows:,} windows = "
            f"{streams.stream_tokens:,} tokens each, then all restart"
        )
    split = f" ({split})" if split else ""
    say(
        f"mnemo train: model {c.model} ({parameter_count(n_params)} parameters), {source}, "
        f"{c.steps} steps of {c.batch_size}x{c.seq_len} tokens{split} -> {out}",
        flush=True,
    )
    if c.optimizer != "adamw":  # what the run adds to (or keeps of) Algorithm 1
        from ..train.optim import describe_optimizer

        say(describe_optimizer(c), flush=True)
    if trainer.step > c.steps:  # --steps below the checkpoint's step: say so, the run is not cut back
        say(
            f"already trained to step {trainer.step}, past --steps {c.steps}: nothing to do (the run is "
            f"not cut back; raise --steps above {trainer.step} to continue)"
        )
    elif trainer.step >= c.steps:
        say(f"already trained to step {trainer.step} (raise --steps to continue)")
    elif trainer.early_stopped:  # the checkpoint resumes as stopped: fit() trains nothing
        say(
            f"already stopped early at step {trainer.step} (val_acc reached --early-stop-acc "
            f"{c.early_stop_acc:g}): nothing to do"
        )
    try:
        with warnings.catch_warnings():  # (said above, on stdout: not twice)
            warnings.filterwarnings("ignore", message="steps: the run is already at step")
            record = trainer.fit()
    except BaseException:  # a divergence, an interrupt, a full disk: the old run stays if nothing replaced it
        run["restored"] = aside is not None and trainer.last_checkpoint is None
        _settle_old_run(aside, out, replaced=trainer.last_checkpoint is not None)
        raise
    _settle_old_run(aside, out, replaced=trainer.last_checkpoint is not None)
    if record:
        # 6 significant digits: a small value (the lr of a warm-up's first step) stays itself, not 0.0;
        # strict JSON as metrics.jsonl (a NaN or a never-halving spectrum's inf: null + "nonfinite")
        from ..train.sinks import dumps_record

        say(dumps_record({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in record.items()}))
    if trainer.task is not None:
        say(f"checkpoint: {trainer.last_checkpoint}")
        say(f"try: mnemo eval --checkpoint {shlex.quote(str(out))} --length {4 * c.seq_len}")
        return 0
    unknown = _unknown_chars(trainer.data.tokenizer, c.sample_prompt)
    if c.sample_tokens > 0 and (main or trainer.fsdp):  # FSDP: every rank runs the sharded model
        if unknown and main:  # (the default ROMEO: on a corpus of other characters)
            print(
                f"warning: sample_prompt {c.sample_prompt!r} (a --config file sets it): {len(unknown)} "
                f"character(s) are not in the run's vocabulary and are read as <unk>: {''.join(unknown)!r}",
                file=sys.stderr,
            )
        text = trainer.sample()
        if main:
            print("\n--- sample ---")
            print(text)
            print("--------------")
    say(f"checkpoint: {trainer.last_checkpoint}")
    prompt = _suggested_prompt(trainer.data, c.sample_prompt, unknown)
    say(f"try: mnemo generate --checkpoint {shlex.quote(str(out))} --prompt {shlex.quote(prompt)}")
    return 0


def _unknown_chars(tok, prompt: str) -> list[str]:
    """The characters of ``prompt`` a char tokenizer does not hold (read as <unk>); [] otherwise."""
    return sorted(set(prompt) - set(tok.chars)) if hasattr(tok, "chars") else []


def _suggested_prompt(data, prompt: str, unknown: list[str]) -> str:
    """A prompt for the closing ``try: mnemo generate`` line: ``KING:`` (a play's speaker) or else
    the run's ``sample_prompt`` when the vocabulary holds it, else the first word of the training
    text (the vocabulary's own)."""
    if not _unknown_chars(data.tokenizer, "KING:"):
        return "KING:"
    if not unknown:
        return prompt
    text = data.tokenizer.decode(data.train_data.ids[:64].tolist())
    words = text.split()
    return words[0][:16] if words else prompt


def add_commands(sub) -> None:
    """Add ``train`` to the ``mnemo`` sub-command parser."""
    t = sub.add_parser(
        "train",
        help="train a language model on text (default: a small transformer on tinyshakespeare)",
        description="Train a model. Its settings (TrainConfig) are the defaults, then the --config "
        "file's, then the flags given; a resumed run (--resume) keeps its saved settings and the "
        "flags given change only those.",
    )
    from ..train.config import TrainConfig

    run = t.add_argument_group("run")
    run.add_argument(
        "--out",
        metavar="DIR",
        type=kinds.OutDir("a run folder to write", not_inside_run=True),
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
        type=kinds.IntList(1),  # (TrainConfig refuses a length given twice, naming the field)
        help="task runs: also test at these lengths at the end, e.g. 1024,4096",
    )
    sizes = t.add_argument_group("model size", "TrainConfig.model_overrides (over the config file's)")
    sizes.add_argument("--d-model", type=kinds.width, metavar="D", help="override the model width")
    sizes.add_argument("--n-layers", type=kinds.depth, metavar="N", help="override the number of layers")
    t.set_defaults(func=_cmd_train)

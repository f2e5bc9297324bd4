"""``mnemo convert`` and ``mnemo export``: checkpoints of other libraries in and out.

    mnemo convert SRC OUT                # transformers Mamba / Mamba-2 / FalconMamba / Bamba / Qwen3-Next /
                                         # Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen3-MoE /
                                         # Qwen2-MoE / Granite / Granite 4.0-H / DeepSeek-V3
                                         # (and Kimi K2) / DeepSeek-V2 / Jamba / Kimi Linear,
                                         # flash-linear-attention's GLA / RetNet / DeltaNet / Gated
                                         # DeltaNet (fla-hub), or mamba-ssm
    mnemo convert --from-dcp RUN OUT     # a sharded (FSDP) checkpoint as a single-file run folder
    mnemo export CKPT OUT --format hf    # a mnemo checkpoint (or run folder) as a folder transformers loads
                                         # (--dtype: its weights' dtype; default: the source's / model's)

``convert SRC OUT`` and ``export`` write ``OUT`` whole into a temporary sibling folder and move
it into place when complete: a failed write (a full disk, a file size limit) leaves ``OUT`` as it
was. Both refuse a non-empty ``OUT`` unless ``--force``, which replaces a checkpoint folder (one
holding ``config.json``) whole once the new one is complete; never a training run's folder or
checkpoint. ``convert`` says the dtype it stored (float32) and the source's, ``export`` the class it
wrote and its weights' dtype (a converted checkpoint's source dtype unless ``--dtype``). Errors are
one line (exit status 2). See :mod:`mnemo.hf.convert` for the formats,
what is carried and what is refused.
"""

from __future__ import annotations

from .. import argtypes as kinds


def _convert(args) -> int:
    if getattr(args, "from_dcp", False):
        from ..hf.convert import check_not_source
        from ..train.sharded import consolidate_checkpoint

        check_not_source(args.out, args.src)
        if args.force:  # (it would be silently ignored: nothing of OUT is replaced)
            raise ValueError(
                "--force: does not apply to --from-dcp, which writes OUT/ckpt-STEP (and OUT/latest) into a "
                "folder that holds no run and replaces nothing (a folder holding a run is refused: pick a "
                "new or empty folder); leave --force out"
            )
        out = consolidate_checkpoint(args.src, args.out)
        print(f"wrote single-file checkpoint {out} (from the sharded checkpoint {args.src})")
        return 0
    from ..hf.convert import convert

    out = convert(args.src, args.out, force=args.force)
    print(f"wrote mnemo checkpoint {out} (from {args.src})")
    print(_stored(out, "weights stored as float32 (source {source}): {size}"))
    return 0


def _stored(out, line: str) -> str:
    """``line`` with ``{source}`` (the source dtype a converted checkpoint ``out`` carries: float32
    where it carries none), ``{dtype}`` (``out/config.json``'s) and ``{size}`` (of
    ``out/model.safetensors``, in MB) filled in."""
    import json
    from pathlib import Path

    from ..hf.convert import CARRIED_CONFIG_NAME

    out = Path(out)
    carried = out / CARRIED_CONFIG_NAME
    source = json.loads(carried.read_text()).get("fields", {}).get("dtype") if carried.is_file() else None
    dtype = json.loads((out / "config.json").read_text()).get("dtype")
    size = (out / "model.safetensors").stat().st_size / 1e6
    return line.format(source=source or "float32", dtype=dtype, size=f"{size:.3g} MB")


def _export(args) -> int:
    from ..hf.convert import export_hf

    if args.format != "hf":  # argparse's choices already say so; kept for direct calls
        raise ValueError(f"--format: expected 'hf', got {args.format!r}")
    out = export_hf(args.ckpt, args.out, force=args.force, dtype=args.dtype)
    import json
    from pathlib import Path

    arch = json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    print(f"wrote transformers checkpoint {out} (from {args.ckpt})")
    print(_stored(out, f"exported as {arch}, weights stored as {{dtype}}: {{size}}"))
    return 0


def add_commands(subparsers) -> None:
    """The hook ``mnemo.cli`` calls for each command module (see ``mnemo.cli._COMMAND_MODULES``)."""
    p = subparsers.add_parser(
        "convert",
        help="convert a transformers (Mamba, Mamba-2, FalconMamba, Bamba, Qwen3-Next, Llama, Qwen2, Qwen3, "
        "Mistral, Mixtral, Qwen3-MoE, Qwen2-MoE, Granite, Granite 4.0-H, DeepSeek-V3 (and Kimi K2), "
        "DeepSeek-V2, Jamba, Kimi Linear), "
        "flash-linear-attention (GLA, RetNet, DeltaNet, Gated DeltaNet) or mamba-ssm checkpoint folder "
        "into a mnemo checkpoint folder",
        description="Convert a checkpoint of another library (transformers Mamba / Mamba-2 / FalconMamba / "
        "Bamba / Qwen3-Next / Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen3-MoE / Qwen2-MoE / Granite / "
        "Granite 4.0-H (GraniteMoeHybrid) / DeepSeek-V3 (and Kimi K2) / DeepSeek-V2 / Jamba / Kimi Linear; "
        "flash-linear-attention's fla-hub GLA / RetNet / "
        "DeltaNet / Gated DeltaNet; mamba-ssm), or with --from-dcp a sharded FSDP checkpoint, into a mnemo "
        "checkpoint folder.",
    )
    p.add_argument(
        "src", type=kinds.ExistingDir(), help="the checkpoint folder to read (config.json and weights)"
    )
    p.add_argument("out", type=kinds.OutDir(), help="the mnemo checkpoint folder to write")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT when it is a non-empty checkpoint folder (once the new one is complete); "
        "not with --from-dcp",
    )
    p.add_argument(
        "--from-dcp",
        action="store_true",
        help="SRC is a sharded checkpoint of `mnemo train --fsdp` (a run folder or ckpt-*): write "
        "OUT/ckpt-STEP as an ordinary single-file checkpoint (weights and optimizer state), "
        "which eval, generate, export and --resume read",
    )
    p.set_defaults(func=_convert)

    p = subparsers.add_parser(
        "export",
        help="write a mnemo checkpoint as a folder that another library loads (--format hf: transformers)",
        description="Write a mnemo checkpoint (or a run folder's latest) as a folder that transformers loads "
        "with its own class (--format hf), tokenizer files included.",
    )
    p.add_argument(
        "ckpt",
        type=kinds.ExistingDir(),
        help="the mnemo checkpoint folder to read (a run folder: its latest checkpoint)",
    )
    p.add_argument("out", type=kinds.OutDir(), help="the folder to write")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf: transformers' own classes (default)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT when it is a non-empty checkpoint folder (once the new one is complete)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float64", "bfloat16", "float16"],
        default=None,
        help="the weights' dtype in OUT (default: a converted checkpoint's source dtype, else the model's)",
    )
    p.set_defaults(func=_export)


def main(argv: list[str] | None = None) -> int:
    """Run ``convert`` / ``export`` with ``argv`` (for tests and scripts)."""
    parser = kinds.Parser(prog="mnemo")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)

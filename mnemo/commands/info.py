"""``mnemo info``: the ops' backend table for this machine (:func:`mnemo.ops.backends`).

Prints the versions that matter (PyTorch, triton, fla-core, mamba-ssm), whether CUDA is available,
``TRITON_INTERPRET`` and ``MNEMO_BACKEND``, then one row per (op, backend): available or not, and
why (not installed, no CUDA, needs ``TRITON_INTERPRET=1`` on a CPU, an import failure, no kernel
for the op), else the kernel that runs. Options decided per call (dtype, ``mode``, ``cu_seqlens``)
are documented in :mod:`mnemo.ops.dispatch`.

    mnemo info                  # this machine's default device (cuda if available, else cpu)
    mnemo info --device meta    # what a meta-device (shape-only) run would use
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os

HELP = "print the ops' backend table for this machine (torch, native, fla, mamba_ssm)"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run(args) -> int:
    import torch

    from ..ops import backends
    from ..ops.dispatch import current_backend, format_table

    rows = backends(args.device)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.json:
        print(json.dumps([row.__dict__ for row in rows], indent=1))
        return 0
    print(
        f"torch {torch.__version__}  triton {_version('triton')}  fla-core {_version('fla-core')}  "
        f"mamba-ssm {_version('mamba-ssm')}"
    )
    print(
        f"CUDA available: {torch.cuda.is_available()}  device: {device}  "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!s}  backend: {current_backend()}"
    )
    print()
    print(format_table(rows))
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``info`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("info", help=HELP, description=HELP + ".")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "meta"],
        default=None,
        help="the device to describe (default: cuda when available, else cpu)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.set_defaults(func=run)
    return p


def add_commands(subparsers) -> None:
    """The hook ``mnemo.cli`` calls for each command module (see ``mnemo.cli._COMMAND_MODULES``)."""
    add_parser(subparsers)

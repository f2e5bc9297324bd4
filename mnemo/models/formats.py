"""Checkpoint formats of other libraries that :meth:`LanguageModel.from_pretrained` can read.

The converters live above the core (:mod:`mnemo.hf.convert`, which registers them here when it
is imported: ``import mnemo.hf``); this module only holds the registry, so ``models`` never imports
``hf``. A loader is ``fn(directory: Path) -> (ModelConfig, state_dict) | None`` (``None``: not its
format).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

#: registered loaders of foreign checkpoint folders, tried in order
FOREIGN_LOADERS: list[Callable[[Path], tuple | None]] = []


def register_foreign_loader(fn: Callable[[Path], tuple | None]) -> Callable[[Path], tuple | None]:
    """Add ``fn`` to :data:`FOREIGN_LOADERS` (once); returns it (usable as a decorator)."""
    if fn not in FOREIGN_LOADERS:
        FOREIGN_LOADERS.append(fn)
    return fn


def load_foreign(directory: Path) -> tuple | None:
    """``(config, state_dict)`` from the first registered loader that reads ``directory``."""
    for fn in FOREIGN_LOADERS:
        out = fn(directory)
        if out is not None:
            return out
    return None

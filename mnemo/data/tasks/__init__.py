"""Synthetic recall tasks (DESIGN.md §6) and their registry.

Every task maps ``(batch_size, seq_len, torch.Generator)`` to ``(input_ids [B, T], targets
[B, T])`` with :data:`IGNORE_INDEX` (``-100``) where nothing is supervised; see
:class:`~mnemo.data.tasks.base.Task`. ``build_task(name, **options)`` builds one by name,
``TASKS`` maps names to classes (whose dataclass fields are the options), ``split_seed`` gives
disjoint train/test generator seeds.

========================  =====================================================================
``mqar``                  multi-query associative recall (Zoology)
``selective_copying``     copy the data tokens scattered among noise (Mamba §4.1)
``induction_heads``       recall the token after an earlier trigger; any test length (H3, Mamba)
``passkey``               a key–value needle in long filler (passkey test, S-NIAH)
``niah``                  RULER's needles in text (noise / essay haystack, numbers / UUIDs, multi-key)
``copying``               copy a random string after a delay (copy memory, Repeat After Me)
``repeat_segment``        random tokens with one segment repeated later (induction-head emergence)
========================  =====================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import IGNORE_INDEX, Task, make_generator, sample_without_replacement, split_seed
from .copying import Copying
from .induction_heads import InductionHeads
from .mqar import MQAR
from .niah import NIAH
from .passkey import Passkey
from .repeat_segment import RepeatSegment
from .selective_copying import SelectiveCopying

TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (MQAR, SelectiveCopying, InductionHeads, Passkey, NIAH, Copying, RepeatSegment)
}


def task_names() -> list[str]:
    return sorted(TASKS)


def task_options(name: str) -> dict[str, Any]:
    """The options of task ``name`` with their defaults."""
    cls = _task_class(name)
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _task_class(name: str) -> type[Task]:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(task_names())}")
    return TASKS[name]


def build_task(name: str, options: dict[str, Any] | None = None, **kw) -> Task:
    """Task ``name`` with ``options`` (a dict) and/or keyword options over its defaults.

    Raises:
        ValueError: unknown task name, unknown option (the message lists the known ones), or an
            invalid option value (the message names the option).
    """
    cls = _task_class(name)
    opts = {**(options or {}), **kw}
    known = task_options(name)
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise ValueError(f"unknown {name} option(s) {unknown}; known options: {sorted(known)}")
    return cls(**opts)


__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "Task",
    "MQAR",
    "SelectiveCopying",
    "InductionHeads",
    "Passkey",
    "NIAH",
    "Copying",
    "RepeatSegment",
    "build_task",
    "make_generator",
    "sample_without_replacement",
    "split_seed",
    "task_names",
    "task_options",
]

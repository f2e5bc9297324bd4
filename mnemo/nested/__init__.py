"""Backwards-compatible names for the Nested Learning pieces, which now live by role:

* :mod:`mnemo.layers.cms` — the Continuum Memory System (``Level``, ``CMSLevel``,
  ``ContinuumMemory``, their states);
* :mod:`mnemo.layers.self_modifying`, :mod:`mnemo.layers.self_modifying_projections` — the
  self-modifying mixers (registered with the mixer registry by :mod:`mnemo.layers`);
* :mod:`mnemo.models.task_signal` — the task-loss error signal of CMS levels;
* :mod:`mnemo.train.m3` — the M3 optimizer (loaded on first use of ``mnemo.nested.M3``).

This module only re-exports them (new code should import from the modules above). The old
submodule paths ``mnemo.nested.cms``, ``mnemo.nested.self_modifying`` and
``mnemo.nested.self_modifying_projections`` are kept importable as aliases of the moved modules.
"""

import sys as _sys

from ..layers import cms as _cms
from ..layers import self_modifying as _self_modifying
from ..layers import self_modifying_projections as _self_modifying_projections
from ..layers.cms import CMSLevel, CMSState, ContinuumMemory, Level, LevelState
from ..layers.self_modifying import SelfModifyingTitans
from ..layers.self_modifying_projections import SelfModifyingProjections

for _name, _module in (
    ("cms", _cms),
    ("self_modifying", _self_modifying),
    ("self_modifying_projections", _self_modifying_projections),
):
    _sys.modules.setdefault(f"{__name__}.{_name}", _module)

__all__ = [
    "Level",
    "LevelState",
    "CMSLevel",
    "CMSState",
    "ContinuumMemory",
    "SelfModifyingTitans",
    "SelfModifyingProjections",
    "M3",
]


def __getattr__(name: str):
    """``M3`` (from :mod:`mnemo.train.m3`) and ``task_signal`` (:mod:`mnemo.models.task_signal`),
    imported on first use (importing them here eagerly would import the trainer / the models)."""
    if name == "M3":
        from ..train.m3 import M3

        return M3
    if name == "task_signal":
        from ..models import task_signal

        return task_signal
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Nested Learning: update-frequency levels, the Continuum Memory System, self-modifying Titans,
multi-frequency optimizers (Behrouz et al. 2025)."""

from .cms import CMSLevel, CMSState, ContinuumMemory, Level, LevelState
from .m3 import M3
from .self_modifying import SelfModifyingTitans
from .self_modifying_projections import SelfModifyingProjections

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

from ..layers import register_mixer  # noqa: E402

register_mixer("self_modifying_titans", SelfModifyingTitans)
register_mixer("self_modifying_projections", SelfModifyingProjections)

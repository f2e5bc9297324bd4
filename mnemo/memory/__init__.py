"""The Miras design space: ``MemorySpec`` (architecture × attentional bias × retention × optimizer),
the test-time-trained memory engine that runs any spec, and named presets."""

from .engine import MemoryState, closed_form_op, init_state, neural_memory
from .presets import PRESETS, preset
from .spec import MemorySpec

__all__ = ["MemorySpec", "MemoryState", "neural_memory", "init_state", "closed_form_op", "PRESETS", "preset"]

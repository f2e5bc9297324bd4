"""Reading memories: attention and implicit attention maps for every mixer, circuit scores
(previous-token, duplicate-token, induction, copying, in-context learning), memory time scales,
and the training callback that tracks circuit scores (:class:`CircuitTracker`)."""

from .maps import Mixing, capture_maps, decay_matrix, delta_map, gla_map, mixing, scan_map
from .probe import CircuitTracker, circuit_callbacks, circuit_scores
from .scores import (
    copying_score,
    duplicate_token_score,
    icl_score,
    induction_score,
    normalise,
    previous_token_score,
    repeated_random_tokens,
)

__all__ = [
    "Mixing",
    "mixing",
    "capture_maps",
    "decay_matrix",
    "gla_map",
    "delta_map",
    "scan_map",
    "normalise",
    "previous_token_score",
    "duplicate_token_score",
    "induction_score",
    "copying_score",
    "icl_score",
    "repeated_random_tokens",
    "circuit_scores",
    "CircuitTracker",
    "circuit_callbacks",
]

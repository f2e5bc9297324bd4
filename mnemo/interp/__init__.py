"""Reading memories: attention and implicit attention maps for every mixer, circuit scores
(previous-token, duplicate-token, induction, copying, in-context learning), memory time scales,
the memory spectrum (Lyapunov exponents of the write's transitions), causal interventions
(ablation, activation and state patching, steering) and the training callback that tracks circuit
scores (:class:`CircuitTracker`)."""

from .interventions import (
    ablate,
    ablate_channel,
    ablate_head,
    ablate_state,
    ablate_write,
    activation_patching,
    compose,
    induction_ablation,
    logit_difference,
    mean_activations,
    next_token_loss,
    patch,
    state_patch,
    steer,
)
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
from .spectrum import (
    classify,
    delta_rule_spectrum,
    diagonal_spectrum,
    lyapunov_spectrum,
    matrix_spectrum,
    memory_jvp_spectrum,
    memory_spectrum,
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
    "compose",
    "ablate",
    "ablate_head",
    "ablate_channel",
    "ablate_write",
    "ablate_state",
    "mean_activations",
    "steer",
    "patch",
    "activation_patching",
    "state_patch",
    "induction_ablation",
    "logit_difference",
    "next_token_loss",
    "lyapunov_spectrum",
    "matrix_spectrum",
    "diagonal_spectrum",
    "delta_rule_spectrum",
    "memory_jvp_spectrum",
    "memory_spectrum",
    "classify",
]

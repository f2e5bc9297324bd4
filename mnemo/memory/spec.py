"""The Miras design space as a value: ``MemorySpec`` = architecture × attentional bias × retention ×
optimizer (Behrouz et al. 2025, "It's All Connected", §3; Titans: Behrouz et al. 2024, §3).

A memory ``M_W`` maps keys to values. It is written by an online learner: on each token it takes a
step on the inner objective ``ℓ(M_W(k_t), v_t)`` (the *attentional bias*), forgets by its
*retention* rule, and moves with its *optimizer*. ``chunk_size`` is the inner mini-batch: every
gradient inside a chunk is taken at the chunk-start weights (Titans §3.2, TTT mini-batch GD).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ARCHITECTURES = ("matrix", "mlp")
OBJECTIVES = ("dot", "l2", "lp", "huber")
HUBER_MODES = ("token", "coordinate")
RETENTIONS = ("none", "decay", "lq", "kl", "elastic_net")
OPTIMIZERS = ("gd", "momentum")
ACTIVATIONS = ("gelu", "silu", "relu", "tanh")


@dataclass(frozen=True)
class MemorySpec:
    """One point of the design space. Every field is independent of the others.

    Architecture:
        architecture: ``"matrix"`` (one ``[K, V]`` map per head) or ``"mlp"`` (``depth`` linear
            layers ``K → h → … → V`` with ``h = expansion · K`` and ``activation`` between them).
        residual: ``M(x) = x + f(x)`` (needs ``K == V``). norm: layer-normalise ``f(x)`` before the
            residual (TTT: ``x + LN(f(x))``; the LN's learned scale and shift, outer parameters, are
            ``neural_memory``'s ``norm_weight``/``norm_bias``, else none). Both default off (the ``mlp``
            presets turn them on).
    Attentional bias (inner objective on ``e = M(k) − v``):
        ``"dot"``: ``−⟨M(k), v⟩`` (Hebbian); ``"l2"``: ``½‖e‖²`` (delta rule; Titans, Eq. 12, and
        the TTT paper write ``‖e‖²`` without the ½, so their ``θ`` is half the ``θ`` here; the TTT
        authors' code steps with ``e``, the ½ form, as here);
        ``"lp"``: ``(1/p) Σ |e|^p`` with the smooth surrogate ``|e| ≈ (e² + ε²)^{1/2}``, ``ε = lp_eps``
        (``|ε| ≥ 2⁻⁶³`` when ``p < 2``, so that ``ε²`` is a normal float32: the slope at ``e = 0`` is
        ``0 · ∞`` otherwise; Moneta, Miras
        Eq. 11, writes ``‖e‖_p^p`` without the ``1/p``: its ``η`` is ``θ / p`` here);
        ``"huber"``: Huber with a data-dependent threshold ``δ_t`` (the per-token input ``delta``),
        in one of two forms chosen by ``huber_mode``:

        - ``"token"`` (default; Miras Huber variant 3, Eq. 16, the form Yaad uses, §5): the
          whole token switches on the error norm,
          ``ℓ = ½‖e‖²`` if ``‖e‖₂ ≤ δ_t`` else ``δ_t ‖e‖₁``, so the step is
          ``W_t = W_{t−1} − θ_t ∇ℓ₂`` (∂ℓ/∂y = ``e``) or ``W_t = W_{t−1} − θ_t δ_t ∇ℓ₁``
          (∂ℓ/∂y = ``δ_t sign(e)``). The step is discontinuous at ``‖e‖ = δ_t``, as in the paper.
          The ℓ₁ branch's step ``δ_t sign(e)`` is also discontinuous at every ``e_i = 0``, so the
          memory's outputs are very sensitive to the rounding of its inputs. Measured in float64
          (relative change of the output; the size depends on the model and the inputs), rounding
          the input to bf16 changed the ``yaad`` preset's output by 16% to 44%
          (``yaad_coordinate`` and ``titans``: about 0.5%), and a bf16 autocast run differed from
          the float64 one by 23%. Expect bf16 and fp32 runs of this form to differ that much
          (neither is wrong); the ``"coordinate"`` form's step is continuous in ``e``.
        - ``"coordinate"`` (Miras Eq. 14, Huber variant 1): ``Σ_i huber_{δ_t}(e_i)``, each error
          coordinate switches separately (∂ℓ/∂y = ``clip(e, −δ_t, δ_t)``).
    Retention (forgetting; the accumulator ``A`` is what the optimizer moves, ``W = N(A)``):
        ``"none"``: ``A_t = A_{t−1} + step``;
        ``"decay"``: ``A_t = exp(g_t) A_{t−1} + step`` (``exp(g_t) = 1 − α_t``, Titans' weight decay;
            ``decay_per_channel`` gives one decay per key channel, matrix memories only);
        ``"lq"``: decay as above and ``W = A / ‖A‖_q^{q−2}`` (Moneta's ℓq retention; the norm, over
            each layer's matrix, is offset by ``10⁻⁶``, ``(‖A‖_q + 10⁻⁶)^{q−2}``, so that ``W`` and its
            gradient are finite at ``A = 0``);
        ``"kl"``: decay as above and ``W = kl_scale · softmax(A)`` over each layer's input axis
            (Memora's KL retention: ``softmax(α log W − η∇)`` is exactly this map of a linearly
            decayed logit accumulator).
        ``"elastic_net"``: ℓ1 + ℓ2 retention (Miras, elastic-net retention gate, Eq. 22: global retention
            ``G(W) = 1/(2β)‖W‖² + 1/α‖W‖₁``, local retention ``½‖W − W_{t−1}‖²``), whose closed form
            is a soft-thresholding of the decayed, stepped weights (no ``N``; ``A`` are the weights)::

                W_t = S_{γ_t}(exp(g_t) ⊙ W_{t−1} + step_t),   S_γ(x) = sign(x) · max(|x| − γ, 0)

            In the paper ``λ = β/(β+η)`` (here ``exp(g_t)``), ``ζ = ηλ`` (here ``θ_t``) and
            ``γ = ηβ/(α(η+β)) = ζ/α``: the threshold is the step size times the ℓ1 strength ``1/α``,
            so ``γ_t = l1 · θ_t`` (θ after the ``max_lr`` clamp, before gradient clipping) with the
            field ``l1 = 1/α ≥ 0`` (``l1 = 0`` is plain decay). The threshold is applied after every
            token in both forms, exactly as in Eq. 22 (the chunk form scans its chunk token by token
            for this retention; only the gradients are batched). With ``chunk_size > 1`` the gradients
            are taken at the chunk-start weights, the engine's mini-batch rule for every retention.
            (Eq. 23, the FTRL form ``W = S(A)`` of a linear accumulator, is a different recursion and
            is not what this option computes.)
        decay_first: take the gradient at the *decayed* weights (Gated DeltaNet's order:
            ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + …``) instead of Titans' order (gradient at the
            previous weights, then decay). Only with ``"none"``/``"decay"``.
    Optimizer:
        ``"gd"``: ``step_t = −θ_t ∇ℓ_t``; ``"momentum"``: ``S_t = η_t S_{t−1} − θ_t ∇ℓ_t``,
        ``step_t = S_t`` (Titans' surprise). ``θ_t`` is clamped to ``max_lr``; each token's gradient
        is rescaled to norm ``≤ grad_clip`` when set.
    chunk_size: the inner mini-batch (``1`` = plain online learning).

    Defaults: ``depth=2``, ``expansion=4.0``, ``residual=False``, ``norm=False``, ``p=3.0``,
    ``lp_eps=1e-6``, ``decay_per_channel=False``, ``decay_first=False``, ``q=4.0``, ``kl_scale=1.0``,
    ``l1=0.01``, ``chunk_size=64`` (and ``architecture="matrix"``, ``objective="l2"``,
    ``retention="none"``, ``optimizer="gd"``, no ``max_lr`` or ``grad_clip``).
    """

    architecture: str = "matrix"
    depth: int = 2
    expansion: float = 4.0
    activation: str = "gelu"
    residual: bool = False
    norm: bool = False
    objective: str = "l2"
    p: float = 3.0
    lp_eps: float = 1e-6
    huber_mode: str = "token"
    retention: str = "none"
    decay_per_channel: bool = False
    decay_first: bool = False
    q: float = 4.0
    kl_scale: float = 1.0
    l1: float = 0.01
    optimizer: str = "gd"
    max_lr: float | None = None
    grad_clip: float | None = None
    chunk_size: int = 64

    def validate(self) -> MemorySpec:
        """Raise ``ValueError`` naming the offending field; return self."""

        def bad(name, expected):
            raise ValueError(f"MemorySpec.{name}: expected {expected}, got {getattr(self, name)!r}")

        for name, options in (
            ("architecture", ARCHITECTURES),
            ("objective", OBJECTIVES),
            ("retention", RETENTIONS),
            ("optimizer", OPTIMIZERS),
            ("activation", ACTIVATIONS),
            ("huber_mode", HUBER_MODES),
        ):
            if getattr(self, name) not in options:
                bad(name, f"one of {options}")

        for name in ("residual", "norm", "decay_per_channel", "decay_first"):
            if not isinstance(getattr(self, name), bool):  # a config's "False" is truthy
                bad(name, "a bool")

        def number(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        for name in ("expansion", "p", "lp_eps", "q", "kl_scale", "l1"):
            if not number(getattr(self, name)):
                bad(name, "a finite number")
        for name in ("max_lr", "grad_clip"):
            if getattr(self, name) is not None and not number(getattr(self, name)):
                bad(name, "None or a finite number")
        if not isinstance(self.depth, int) or isinstance(self.depth, bool) or self.depth < 1:
            bad("depth", "an int >= 1")
        if self.expansion <= 0:
            bad("expansion", "a positive number")
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            bad("chunk_size", "a positive int")
        if self.objective == "lp" and self.p < 1:
            bad("p", "a number >= 1")
        if self.objective == "lp" and self.p < 2 and abs(self.lp_eps) < 2.0**-63:  # |e|^{p−1}/|e| is 0/0
            # at e = 0 unless ε² is a normal float32 (the engine's compute dtype; a smaller ε² is 0 there)
            bad(
                "lp_eps",
                f"a nonzero number of magnitude >= 2**-63 (~1.1e-19) with p = {self.p} < 2 (the slope "
                "at e = 0 is 0 · ∞ otherwise; the engine adds lp_eps² in float32)",
            )
        if self.retention == "lq" and self.q <= 0:
            bad("q", "a positive number")
        if self.retention == "kl" and self.kl_scale <= 0:
            bad("kl_scale", "a positive number")
        if self.retention == "elastic_net" and not (
            isinstance(self.l1, (int, float)) and math.isfinite(self.l1) and self.l1 >= 0
        ):
            bad("l1", "a finite number >= 0 (the l1 strength of 'elastic_net' retention)")
        if self.decay_per_channel and (self.retention == "none" or self.layer_count() != 1):
            bad("decay_per_channel", "False unless a matrix memory (one layer) has a decaying retention")
        if self.decay_first and self.retention not in ("none", "decay"):
            bad("decay_first", "False with 'lq'/'kl'/'elastic_net' retention")
        if self.max_lr is not None and self.max_lr <= 0:
            bad("max_lr", "None or a positive number")
        if self.grad_clip is not None and self.grad_clip <= 0:
            bad("grad_clip", "None or a positive number")
        return self

    def layer_count(self) -> int:
        return 1 if self.architecture == "matrix" else self.depth

    def layer_dims(self, key_dim: int, value_dim: int) -> list[tuple[int, int]]:
        """``(in, out)`` of each linear layer of the memory for head sizes ``K`` and ``V``."""
        if self.architecture == "matrix":
            return [(key_dim, value_dim)]
        hidden = max(1, int(round(self.expansion * key_dim)))
        dims = [key_dim] + [hidden] * (self.depth - 1) + [value_dim]
        return list(zip(dims[:-1], dims[1:]))

    @property
    def decays(self) -> bool:
        return self.retention != "none"

    def replace(self, **changes) -> MemorySpec:
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MemorySpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MemorySpec field(s) {unknown}; known: {sorted(known)}")
        return cls(**d).validate()

"""M3, Multi-scale Momentum Muon: Algorithm 1 of Nested Learning (Behrouz, Razaviyayn, Zhong,
Mirrokni, "Nested Learning: The Illusion of Deep Learning Architectures", arXiv 2512.24695, §7.2).

The optimizer is a two-level continuum memory over gradients: a fast momentum ``M1`` written every
step and a slow momentum ``M2`` written once per block of ``f`` steps; both are orthogonalised by
Newton–Schulz (as in Muon) and the sum is preconditioned by an accumulated second moment ``V``.

Algorithm 1, as published (inputs ``Θ0``, ``η = lr``, ``T = ns_steps``, ``β1, β2, β3 = betas``,
``α = alpha``, ``ε = eps``, ``f = slow_every``)::

    1. M1 ← 0,  M2 ← 0,  V ← 0
    2. for each lower-frequency iteration k = 0, 1, 2, …:
    3.     M2 ← M2 + β3 · Σ_{i in block k−1} g_i      (the previous block's f gradients; none for k = 0)
    4.     O2 ← NewtonSchulz_T(M2)                      (cached for the whole block)
    5.     for t = k f + 1, …, (k + 1) f:
    6.         g_t ← ∇L(Θ_{t−1})
    7.         M1 ← M1 + β1 g_t
    8.         V  ← V  + β2 g_t²
    9.         O1 ← NewtonSchulz_T(M1)
    10.        Θ_t ← Θ_{t−1} − η (O1 + α O2) / (√V + ε)

So the slow momentum made from block ``k−1`` is first used at step ``k f + 1``: steps ``1 … f``
use ``O2 = 0``, and step ``f + 1`` uses ``NS(β3 (g_1 + … + g_f))``. The accumulations have **no
decay** (``M ← M + β g``, not an exponential moving average) and no bias correction: this is the
paper's text, followed literally by default (``V`` only grows, so the step size shrinks roughly
like ``1/√t``, as in Adagrad).

Reading notes and departures (each one named):

- The paper's slow sum is written ``Σ_{i=(k−1)f}^{kf} g_i`` (``f + 1`` indices, and negative ones
  for ``k = 0``); we read it as the ``f`` gradients of the previous block, ``t = (k−1)f+1 … kf``.
- The denominator is ``√V + ε`` (Adam's placement of ``ε``); one transcription of the paper's
  source writes ``√(V + ε)``; the two differ only where ``V`` is near ``ε``.
- Newton–Schulz is defined for matrices only. Parameters with ``ndim ≥ 2`` are orthogonalised as
  the matrix ``[shape[0], prod(shape[1:])]``; parameters with ``ndim < 2`` (biases, norm gains,
  scalars) are **not orthogonalised**: ``O = M`` for them (so their update is
  ``(M1 + α M2) / (√V + ε)``).
- ``weight_decay = λ > 0`` (default 0, i.e. none, as in the paper) adds decoupled weight decay,
  AdamW style: ``Θ ← Θ (1 − η λ)`` before line 10.
- ``ema=True`` (default ``False``) is a departure from Algorithm 1: exponential moving averages
  ``M1 ← β1 M1 + (1−β1) g``, ``V ← β2 V + (1−β2) g²``, ``M2 ← β3 M2 + (1−β3) · (Σ block g) / f``
  (no bias correction), i.e. Adam-like memories that forget.
- Steps are counted per parameter (steps on which it had a gradient), so a parameter without a
  gradient on some step neither advances its block nor updates.
- ``ns_coefficients="cubic"`` (default ``"quintic"``, Muon's) swaps the Newton–Schulz polynomial;
  see :func:`newton_schulz`.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

#: Muon's quintic Newton–Schulz coefficients (Jordan et al. 2024).
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: str = "quintic") -> torch.Tensor:
    """Orthogonalise a matrix (or a batch of matrices) by a Newton–Schulz iteration: approximately
    ``U Vᵀ`` for ``G = U S Vᵀ`` (the polar factor; singular values sent to ≈ 1, singular vectors
    kept). Source: Muon (Jordan, Jin, Boza, You, Cesista, Newhouse, Bernstein, 2024,
    "Muon: an optimizer for hidden layers in neural networks").

        X ← G / ‖G‖_F         (transposed first when rows > cols, so that X Xᵀ is the smaller Gram)
        quintic:  A = X Xᵀ,  X ← a X + (b A + c A²) X,   (a, b, c) = (3.4445, −4.7750, 2.0315)
        cubic:    X ← 1.5 X − 0.5 (X Xᵀ) X

    The quintic iteration (Muon's) is tuned for speed, not convergence: after 5 steps the singular
    values land in roughly ``[0.7, 1.2]`` rather than at 1. The cubic one converges to the exact
    polar factor (quadratically, once the singular values are near 1; a singular value ``σ`` far
    below 1 first grows by about 1.5× per step), for singular values in ``(0, √3)`` — always the
    case after the Frobenius normalisation. A zero matrix (or an empty one) gives zeros; a tiny or a
    huge one gives the result of its rescaled self (the norm is taken after an exact power-of-two
    scaling, so it neither underflows nor overflows).

    Args:
        G: ``[..., m, n]`` floating tensor; the leading dims are a batch (each matrix normalised
            by its own Frobenius norm). float32 / float64 are computed in their own dtype; bfloat16
            and float16 are computed in float32.
        steps: number of iterations ``T`` (int ≥ 0; 0 returns the normalised ``G``; default ``5``).
        coefficients: ``"quintic"`` (Muon's, default) or ``"cubic"``.
    Returns:
        ``[..., m, n]`` in ``G``'s dtype.
    Raises:
        TypeError: ``G`` is not a floating tensor. ValueError: ``G`` has fewer than 2 dims,
        ``steps`` is not an int ≥ 0, or ``coefficients`` is unknown (the message names them).
    """
    if not isinstance(G, torch.Tensor) or not G.is_floating_point():
        got = G.dtype if isinstance(G, torch.Tensor) else type(G).__name__
        raise TypeError(f"newton_schulz: G: expected a floating-point tensor, got {got}")
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: G: expected shape [..., m, n] (ndim >= 2), got {tuple(G.shape)}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"newton_schulz: steps: expected an int >= 0, got {steps!r}")
    if coefficients not in ("quintic", "cubic"):
        raise ValueError(f"newton_schulz: coefficients: expected 'quintic' or 'cubic', got {coefficients!r}")
    X = G if G.dtype in (torch.float32, torch.float64) else G.float()
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    if X.numel():  # each matrix first scaled by a power of two to entries below 1 (exact): the
        # Frobenius norm's sum of squares would underflow to 0 for a tiny G (which gave NaN) and
        # overflow to inf for a huge one (which gave zeros)
        X = torch.ldexp(X, -torch.frexp(X.abs().amax(dim=(-2, -1), keepdim=True)).exponent)
    norm = torch.linalg.matrix_norm(X, keepdim=True) if X.numel() else X.new_ones(())
    X = X / norm.clamp_min(torch.finfo(X.dtype).tiny)  # zero matrix -> zeros
    if coefficients == "quintic":
        a, b, c = MUON_COEFFICIENTS
        for _ in range(steps):
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
    else:
        for _ in range(steps):
            X = 1.5 * X - 0.5 * ((X @ X.mT) @ X)
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def _orthogonalise(M: torch.Tensor, steps: int, coefficients: str) -> torch.Tensor:
    """``NS_T(M)`` on the ``[shape[0], -1]`` view for ``ndim ≥ 2``; ``M`` itself for ``ndim < 2``."""
    if M.ndim < 2 or M.numel() == 0:
        return M
    return newton_schulz(M.reshape(M.shape[0], -1), steps, coefficients).view_as(M)


def _check_hparams(h: dict, where: str) -> None:
    def bad(name, expected):
        raise ValueError(f"M3{where}: {name}: expected {expected}, got {h[name]!r}")

    def real(v):
        return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)

    if not (real(h["lr"]) and h["lr"] > 0):
        bad("lr", "a number > 0")
    betas = h["betas"]
    three = isinstance(betas, (tuple, list)) and len(betas) == 3
    if not (three and all(real(b) and 0 <= b < 1 for b in betas)):
        bad("betas", "three numbers (beta1, beta2, beta3) in [0, 1)")
    if not (real(h["alpha"]) and h["alpha"] >= 0):
        bad("alpha", "a number >= 0")
    if not (real(h["eps"]) and h["eps"] > 0):
        bad("eps", "a number > 0")
    for name in ("ns_steps", "slow_every"):
        v = h[name]
        lo = 0 if name == "ns_steps" else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            bad(name, f"an int >= {lo}")
    if not (real(h["weight_decay"]) and h["weight_decay"] >= 0):
        bad("weight_decay", "a number >= 0")
    if h["ns_coefficients"] not in ("quintic", "cubic"):
        bad("ns_coefficients", "'quintic' or 'cubic'")
    if not isinstance(h["ema"], bool):
        bad("ema", "True or False")


class M3(torch.optim.Optimizer):
    """Multi-scale Momentum Muon, Algorithm 1 of Nested Learning (§7.2); see the module docstring
    for the numbered algorithm and every departure.

    Per parameter, at step ``t`` (counted per parameter, from 1) of block ``k = (t − 1) // f``::

        if t − 1 is a positive multiple of f:  M2 ← M2 + β3 Σ(last f gradients);  O2 ← NS(M2)
        M1 ← M1 + β1 g;   V ← V + β2 g²;   O1 ← NS(M1)
        Θ ← Θ (1 − lr λ)  (only if weight_decay λ > 0)
        Θ ← Θ − lr (O1 + α O2) / (√V + ε)

    ``NS`` is :func:`newton_schulz` on the ``[shape[0], -1]`` matrix for ``ndim ≥ 2`` parameters;
    for ``ndim < 2`` parameters (biases, norm gains) there is no orthogonalisation: ``O = M``.

    Args:
        params: parameters or param groups (every hyper-parameter below may be set per group).
        lr: ``η > 0``. Note the update's size: ``O1`` has singular values ≈ 1 and is divided
            elementwise by ``√V ≈ √(β2 Σ g²)``, so it scales like ``1 / |g|`` and is not Adam's
            ``≈ lr`` per element; tune ``lr`` for M3 separately. Default ``1e-3``.
        betas: ``(β1, β2, β3)``, each in ``[0, 1)``: fast momentum, second moment, slow momentum.
        alpha: ``α ≥ 0``, weight of the slow momentum ``O2`` (default ``0.5``).
        eps: ``ε > 0`` in the denominator ``√V + ε``. Unlike in Adam it matters: ``O1`` is not
            proportional to ``g`` (orthogonalisation lifts small directions to singular value 1),
            so an element with a tiny gradient gets ``|Δ| ≈ lr |O| / ε``; ``ε`` caps that step.
            The default ``1e-8`` follows Adam; training runs need far more (the trainer uses
            ``1e-2``, :class:`mnemo.train.TrainConfig` ``m3_eps``).
        ns_steps: Newton–Schulz iterations ``T`` (int ≥ 0; default ``5``).
        slow_every: ``f`` (int ≥ 1), steps per block of the slow momentum (default ``10``).
        weight_decay: decoupled weight decay ``λ ≥ 0`` (AdamW style; not in Algorithm 1; 0 = none;
            default ``0.0``).
        ns_coefficients: ``"quintic"`` (Muon's, default) or ``"cubic"``.
        ema: ``False`` (Algorithm 1: ``M ← M + β g``) or ``True`` (departure: exponential moving
            averages, see the module docstring). Default ``False``.

    State per parameter (``state_dict()`` round-trips it exactly): ``step`` (int), ``m1``, ``v``,
    ``m2``, ``g_sum`` (sum of the current block's gradients), ``o2`` (the cached ``NS(M2)``).

    Raises:
        ValueError: a hyper-parameter is out of range; the message names it, the expected range
        and the received value.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999, 0.99),
        alpha: float = 0.5,
        eps: float = 1e-8,
        ns_steps: int = 5,
        slow_every: int = 10,
        weight_decay: float = 0.0,
        ns_coefficients: str = "quintic",
        ema: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            alpha=alpha,
            eps=eps,
            ns_steps=ns_steps,
            slow_every=slow_every,
            weight_decay=weight_decay,
            ns_coefficients=ns_coefficients,
            ema=ema,
        )
        _check_hparams(defaults, "")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hparams(group, f" (param group {len(self.param_groups) - 1})")
        except ValueError:
            self.param_groups.pop()
            raise
        group["betas"] = tuple(group["betas"])

    @torch.no_grad()
    def step(self, closure=None):
        """One step of Algorithm 1 for every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, alpha, eps, wd = group["lr"], group["alpha"], group["eps"], group["weight_decay"]
            b1, b2, b3 = group["betas"]
            f, T, coeff, ema = group["slow_every"], group["ns_steps"], group["ns_coefficients"], group["ema"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("M3 does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    for name in ("m1", "v", "m2", "g_sum", "o2"):
                        st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                m1, v, m2, g_sum, o2 = st["m1"], st["v"], st["m2"], st["g_sum"], st["o2"]
                if t > 1 and (t - 1) % f == 0:  # lines 3-4: a new block starts
                    if ema:
                        m2.mul_(b3).add_(g_sum, alpha=(1 - b3) / f)
                    else:
                        m2.add_(g_sum, alpha=b3)
                    g_sum.zero_()
                    o2.copy_(_orthogonalise(m2, T, coeff))
                g_sum.add_(g)
                if ema:  # departure (documented): moving averages
                    m1.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                else:  # lines 7-8
                    m1.add_(g, alpha=b1)
                    v.addcmul_(g, g, value=b2)
                o1 = _orthogonalise(m1, T, coeff)  # line 9
                update = o1.add(o2, alpha=alpha) if alpha else o1
                if wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(update, v.sqrt().add_(eps), value=-lr)  # line 10
        return loss

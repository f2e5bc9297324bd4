"""M3: an outer-loop optimizer with momenta at several frequencies (Nested Learning, Behrouz et al.
2025, §4: optimizers are associative memories over gradients; a slow momentum is a memory updated
at a lower frequency).

For every parameter, with gradient ``g_t`` at step ``t``::

    m₁ ← β₁ m₁ + (1 − β₁) g_t                         fast momentum (every step)
    v  ← β₂ v  + (1 − β₂) g_t²                        second moment (every step)
    a  ← a + g_t                                       gradient accumulated for the slow level
    every f steps:  m₂ ← β₃ m₂ + (1 − β₃) a / f,  a ← 0 slow momentum (every f steps)
    θ  ← θ − lr · ( (m̂₁ + γ m₂) / (√v̂ + ε) + λ θ )    (m̂₁, v̂ bias-corrected; λ decoupled decay)
"""

from __future__ import annotations

import torch


class M3(torch.optim.Optimizer):
    """Multi-frequency momentum. Args: ``lr``; ``betas = (β₁, β₂, β₃)``; ``slow_every = f``;
    ``slow_weight = γ``; ``eps``; ``weight_decay = λ`` (decoupled, as in AdamW).

    Raises ``ValueError`` naming the argument for out-of-range hyper-parameters.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999, 0.99),
        slow_every: int = 10,
        slow_weight: float = 0.5,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if lr <= 0:
            raise ValueError(f"M3: lr must be > 0, got {lr}")
        if len(betas) != 3 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"M3: betas must be three numbers in [0, 1), got {betas}")
        if not isinstance(slow_every, int) or slow_every < 1:
            raise ValueError(f"M3: slow_every must be an int >= 1, got {slow_every}")
        if eps <= 0 or weight_decay < 0 or slow_weight < 0:
            raise ValueError(
                f"M3: need eps > 0, weight_decay >= 0, slow_weight >= 0, got {eps}, {weight_decay}, "
                f"{slow_weight}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            slow_every=slow_every,
            slow_weight=slow_weight,
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2, b3 = group["betas"]
            f, gamma = group["slow_every"], group["slow_weight"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m1"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                    st["m2"] = torch.zeros_like(p)
                    st["acc"] = torch.zeros_like(p)
                st["step"] += 1
                t = st["step"]
                st["m1"].mul_(b1).add_(g, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                st["acc"].add_(g)
                if t % f == 0:
                    st["m2"].mul_(b3).add_(st["acc"], alpha=(1 - b3) / f)
                    st["acc"].zero_()
                m1_hat = st["m1"] / (1 - b1**t)
                denom = (st["v"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(m1_hat + gamma * st["m2"], denom, value=-group["lr"])
        return loss

"""Time the MoE dispatch forms (docs/results/moe.md): forward + backward of ``MoE`` on ``N`` random
tokens, median of 10 after 3 warm-ups, one thread, float32, CPU.

    OMP_NUM_THREADS=1 python scripts/moe_dispatch_bench.py
"""

from __future__ import annotations

import time

import torch

from mnemo.layers.moe import MoE

SHAPES = [  # (tokens N, d_model, experts E, top_k, expert hidden)
    (2048, 128, 8, 2, 256),
    (2048, 128, 16, 2, 128),
    (4096, 256, 8, 2, 512),
    (512, 64, 4, 1, 128),
]


def bench(N, d, E, k, H, dispatch, reps=10) -> float:
    torch.manual_seed(0)
    m = MoE(d, E, k, expert_hidden=H, dispatch=dispatch)
    x = torch.randn(N, d, requires_grad=True)
    for _ in range(3):
        m(x).sum().backward()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        m(x).sum().backward()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    print("| N | d | E | k | hidden | sorted ms | padded ms | reference ms |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        t = [bench(*shape, dispatch) for dispatch in ("sorted", "padded", "reference")]
        print(
            "| " + " | ".join(map(str, shape)) + " | " + " | ".join(f"{v:.1f}" for v in t) + " |", flush=True
        )


if __name__ == "__main__":
    main()

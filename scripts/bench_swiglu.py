"""SwiGLU's C kernel against its PyTorch form, in one process, interleaved.

Rows (``glibc``'s malloc tuned as the CLI tunes it): the gate alone (forward + backward of
``silu(a) ⊙ b`` for ``h = [a, b]`` of ``[R, 2H]``), and whole training steps (forward, fused loss,
backward, AdamW; random tokens, initial weights) of the named presets with
``mnemo.layers.mlp.swiglu`` switched between the kernel and the PyTorch form on alternate calls.
Ratios are PyTorch form / kernel (above 1: the kernel is faster).

    python scripts/bench_swiglu.py [--rounds 7] [--op-shape 8192x704]
        [--models gated_deltanet,transformer,gla] [--model-sizes 128x4x128x32,256x6x1024x8]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import mnemo.layers.mlp as mlp
from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.runtime import tune_malloc

_KERNEL = mlp.swiglu


def use_kernel(on: bool) -> None:
    """Switch SwiGLU's gate between the kernel (mnemo's behaviour) and the PyTorch form."""
    mlp.swiglu = _KERNEL if on else mlp._swiglu_reference


def _interleaved(run, rounds: int) -> dict[str, float]:
    """Median seconds of ``run(True)`` (kernel) and ``run(False)`` (PyTorch), alternating order."""
    run(True), run(False)  # warm-up
    times = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            t = time.perf_counter()
            run(on)
            times[on].append(time.perf_counter() - t)
    return {"kernel": statistics.median(times[True]), "pytorch": statistics.median(times[False])}


def _dims(text: str, n: int, flag: str, example: str) -> list[tuple[int, ...]]:
    out = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != n or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"{flag}: expected items like {example}, got {item!r}")
        out.append(tuple(int(p) for p in parts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (medians; default 7)")
    ap.add_argument("--op-shape", default="8192x704", help="R x H of the op row (h is [R, 2H]), or 'none'")
    ap.add_argument("--models", default="gated_deltanet,transformer,gla", help="presets, or 'none'")
    ap.add_argument(
        "--model-sizes", default="128x4x128x32,256x6x1024x8", help="d_model x layers x T x B, comma-separated"
    )
    ap.add_argument("--threads", type=positive_int, default=2)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit(f"--rounds: expected >= 1, got {a.rounds}")
    torch.set_num_threads(a.threads)
    tuned = tune_malloc()  # as the CLI does: freed memory is reused, no page fault per new tensor
    print(f"# python scripts/bench_swiglu.py --rounds {a.rounds} --op-shape {a.op_shape} --models {a.models}")
    print(
        f"#   --model-sizes {a.model_sizes} --threads {a.threads}  (torch {torch.__version__}; "
        f"malloc tuned: {tuned}; kernel from {mlp._KERNEL_MIN_NUMEL} elements with a gradient)"
    )
    print(f"{'row':44s} {'kernel ms':>10s} {'pytorch ms':>11s} {'pytorch / kernel':>17s}")
    if a.op_shape != "none":
        ((R, H),) = _dims(a.op_shape, 2, "--op-shape", "8192x704")
        h = torch.randn(R, 2 * H, requires_grad=True)
        dy = torch.randn(R, H)

        def op(on):
            use_kernel(on)
            mlp.swiglu(h).backward(dy)
            h.grad = None

        m = _interleaved(op, a.rounds)
        row = f"gate alone, h [{R}, {2 * H}], fwd + bwd"
        ratio = m["pytorch"] / m["kernel"]
        print(f"{row:44s} {m['kernel'] * 1e3:10.2f} {m['pytorch'] * 1e3:11.2f} {ratio:16.2f}x")
    if a.models != "none":
        from mnemo.bench import roofline

        for d, L, T, B in _dims(a.model_sizes, 4, "--model-sizes", "256x6x1024x8"):
            for name in (m.strip() for m in a.models.split(",")):
                model = roofline.build(name, d, L)
                step = roofline.train_step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-4), T, B)

                def run(on, step=step):
                    use_kernel(on)
                    step()

                m = _interleaved(functools.partial(run), a.rounds)
                row = f"train step {name} d {d} x {L}, {T} x {B}"
                print(
                    f"{row:44s} {m['kernel'] * 1e3:10.1f} {m['pytorch'] * 1e3:11.1f} "
                    f"{m['pytorch'] / m['kernel']:16.3f}x"
                )
    use_kernel(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

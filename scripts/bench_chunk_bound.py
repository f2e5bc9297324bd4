"""What bounds the gated linear attention's chunk form on this CPU: its matrix products alone.

GLA's chunk form (scalar gates, T tokens, chunk C, head dim D) does twelve batched ``[C, D]``-sized
products per chunk and head for forward+backward: four forward (``q̃ k̃ᵀ``, ``k̃ᵀ v``, ``q̃ S``,
``A v``) and eight backward (``q̃ᵀ dO``, ``dO vᵀ``, ``dO Sᵀ``, ``dA k̃``, ``dAᵀ q̃``, ``v Gᵀ``,
``k̃ G``, ``Aᵀ dO``), with the operand transposes the op uses. This script times, in one process and
interleaved: the op's forward+backward, the same twelve ``bmm`` calls alone on tensors of the op's
layout (each product its own output, as in the op), and a 2048² matmul (the peak ``mnemo bench``
reports against). The products alone are the ceiling of the op's ``% of peak``: what the op adds on
top (the state scans, layout copies, gate factors, gradient assembly) can only lower it.

    python scripts/bench_chunk_bound.py --rounds 5 --groups 128,32,8

Run it on a quiet machine (nothing else heavy beside it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=positive_int, default=4096)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--chunk", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument(
        "--groups",
        default="",
        help="comma-separated group sizes: also time the products run over that many blocks at a time "
        "(all twelve products of one group, then the next: operands that stay in cache)",
    )
    a = p.parse_args(argv)
    from mnemo.bench.ops import _linear_flops
    from mnemo.ops import gated_linear_attention

    T, H, D, C = a.length, a.heads, a.head_dim, a.chunk
    N = H * (T // C)  # batched blocks
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, D, generator=gen).requires_grad_() for _ in range(3))
    g = (-0.1 * torch.rand(1, T, H, generator=gen)).requires_grad_()

    def op():
        for t in (q, k, v, g):
            t.grad = None
        gated_linear_attention(q, k, v, g, mode="chunk")[0].sum().backward()

    blk = {n: torch.randn(N, C, D, generator=gen) for n in ("q", "k", "v", "dO", "S", "G")}
    blk["A"] = torch.randn(N, C, C, generator=gen)
    blk["dA"] = torch.randn(N, C, C, generator=gen)
    S, G = torch.randn(N, D, D, generator=gen), torch.randn(N, D, D, generator=gen)
    # (left, right) of each product; .mT views are transposed operands, as in the op
    pairs = [
        (blk["q"], blk["k"].mT),  # A = q̃ k̃ᵀ
        (blk["k"].mT, blk["v"]),  # k̃ᵀ v
        (blk["q"], S),  # q̃ S
        (blk["A"], blk["v"]),  # A v
        (blk["q"].mT, blk["dO"]),  # q̃ᵀ dO
        (blk["dO"], blk["v"].mT),  # dA = dO vᵀ
        (blk["dO"], S.mT),  # dO Sᵀ
        (blk["dA"], blk["k"]),  # dA k̃
        (blk["dA"].mT, blk["q"]),  # dAᵀ q̃
        (blk["v"], G.mT),  # v Gᵀ
        (blk["k"], G),  # k̃ G
        (blk["A"].mT, blk["dO"]),  # Aᵀ dO
    ]
    outs = [torch.empty(N, x.shape[1], y.shape[2]) for x, y in pairs]

    def products():
        for (x, y), o in zip(pairs, outs):
            torch.bmm(x, y, out=o)

    def grouped(size):
        def run():
            for i0 in range(0, N, size):
                sl = slice(i0, i0 + size)
                for (x, y), o in zip(pairs, outs):
                    torch.bmm(x[sl], y[sl], out=o[sl])

        return run

    groups = [int(x) for x in a.groups.split(",") if x]

    big = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    flops = 3 * _linear_flops(1, T, H, D, C)  # what mnemo bench counts for fwd+bwd
    prod_flops = sum(2 * N * x.shape[1] * x.shape[2] * y.shape[2] for x, y in pairs)
    rows = {"op": [], "products": [], "peak": [], **{f"g{n}": [] for n in groups}}
    for r in range(a.rounds):
        peak = 2 * 2048**3 / _median_ms(lambda: torch.mm(*big), 4) / 1e6
        rows["peak"].append(peak)
        rows["op"].append(_median_ms(op, a.repeats))
        rows["products"].append(_median_ms(products, a.repeats))
        for n in groups:
            rows[f"g{n}"].append(_median_ms(grouped(n), a.repeats))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(
        f"GLA chunk form (scalar gates), T={T} H={H} D={D} C={C} fp32, forward+backward, "
        f"{torch.get_num_threads()} threads; {a.rounds} interleaved rounds, each a median of {a.repeats}"
    )
    print(f"counted work {flops / 1e9:.2f} GFLOP (the twelve products: {prod_flops / 1e9:.2f} GFLOP)")
    head = f"{'round':>6}{'peak GFLOP/s':>14}{'op ms':>9}{'op %peak':>10}"
    print(
        head
        + f"{'products ms':>13}{'products %peak':>16}{'share':>7}"
        + "".join(f"{f'g{n} %peak':>11}" for n in groups)
    )
    for i in range(a.rounds):
        pk, t_op, t_pr = rows["peak"][i], rows["op"][i], rows["products"][i]
        print(
            f"{i + 1:>6}{pk:14.0f}{t_op:9.2f}{100 * flops / t_op / 1e6 / pk:10.3g}{t_pr:13.2f}"
            f"{100 * prod_flops / t_pr / 1e6 / pk:16.3g}{t_pr / t_op:7.3g}"
            + "".join(f"{100 * prod_flops / rows[f'g{n}'][i] / 1e6 / pk:11.3g}" for n in groups)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``mnemo bench``: forward and forward+backward time of every op and form, next to causal SDPA.

A benchmark, not a test: it prints a table (and optionally JSON) and asserts nothing. Ratios are
measured in the same process, so they compare like with like on whatever machine runs it::

    mnemo bench                                  # T in {512 ... 8192}, B=1, H=4, D=64
    mnemo bench --lengths 4096 --ops gla_channel --json out.json
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class OpBench:
    """One op to time. ``make(B, T, H, D, device) -> dict`` of float32 inputs; ``call(x, mode)``
    returns the output tensor. ``parallel_bytes(B, T, H, D)`` estimates the quadratic form's
    memory so huge cases are skipped rather than swapping."""

    name: str
    modes: tuple[str, ...]
    make: Callable
    call: Callable
    parallel_bytes: Callable = lambda B, T, H, D: 4 * B * H * T * T * 4


def _qkv(B, T, H, D, device, gen):
    return {n: torch.randn(B, T, H, D, generator=gen, device="cpu").to(device) for n in ("q", "k", "v")}


def _gen():
    return torch.Generator().manual_seed(0)


def _registry() -> list[OpBench]:
    from ..ops import (
        delta_rule,
        gated_delta_rule,
        gated_linear_attention,
        linear_attention,
        selective_scan,
        softmax_attention,
        ssd,
    )

    def make_plain(B, T, H, D, device):
        return _qkv(B, T, H, D, device, _gen())

    def make_scalar(B, T, H, D, device):
        g = _gen()
        x = _qkv(B, T, H, D, device, g)
        x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=g) + 3).to(device)
        return x

    def make_channel(B, T, H, D, device):
        g = _gen()
        x = _qkv(B, T, H, D, device, g)
        x["g"] = (F.logsigmoid(torch.randn(B, T, H, D, generator=g)) / 16).to(device)
        return x

    def make_delta(B, T, H, D, device):
        g = _gen()
        x = _qkv(B, T, H, D, device, g)
        x["k"] = F.normalize(x["k"], dim=-1)
        x["beta"] = torch.rand(B, T, H, generator=g).to(device)
        x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=g) + 3).to(device)
        return x

    def make_scan(B, T, H, D, device):
        # Mamba-1 shapes: d_inner = H * D channels, d_state 16
        g, Dm, N = _gen(), H * D, 16
        return {
            "u": torch.randn(B, T, Dm, generator=g).to(device),
            "delta": (0.5 * torch.randn(B, T, Dm, generator=g)).to(device),
            "A": -torch.rand(Dm, N, generator=g).mul(4).add(0.5).to(device),
            "B": torch.randn(B, T, N, generator=g).to(device),
            "C": torch.randn(B, T, N, generator=g).to(device),
        }

    def make_ssd(B, T, H, D, device):
        # Mamba-2 shapes: H heads of head_dim D, d_state = D
        g = _gen()
        return {
            "x": torch.randn(B, T, H, D, generator=g).to(device),
            "dt": (0.5 * torch.randn(B, T, H, generator=g)).to(device),
            "A": -torch.rand(H, generator=g).mul(4).add(0.5).to(device),
            "B": torch.randn(B, T, 1, D, generator=g).to(device),
            "C": torch.randn(B, T, 1, D, generator=g).to(device),
        }

    return [
        OpBench(
            "softmax_attention",
            ("parallel",),
            make_plain,
            lambda x, mode: softmax_attention(x["q"], x["k"], x["v"], mode=mode)[0],
        ),
        OpBench(
            "linear_attention",
            ("chunk", "parallel", "recurrent"),
            make_plain,
            lambda x, mode: linear_attention(x["q"], x["k"], x["v"], mode=mode)[0],
        ),
        OpBench(
            "linear_attention_elu_norm",
            ("chunk", "parallel", "recurrent"),
            make_plain,
            lambda x, mode: linear_attention(
                x["q"], x["k"], x["v"], feature_map="elu", normalize=True, mode=mode
            )[0],
        ),
        OpBench(
            "gla_scalar",
            ("chunk", "parallel", "recurrent"),
            make_scalar,
            lambda x, mode: gated_linear_attention(x["q"], x["k"], x["v"], x["g"], mode=mode)[0],
        ),
        OpBench(
            "gla_channel",
            ("chunk", "parallel", "recurrent"),
            make_channel,
            lambda x, mode: gated_linear_attention(x["q"], x["k"], x["v"], x["g"], mode=mode)[0],
            parallel_bytes=lambda B, T, H, D: 4 * 4 * B * H * T * T * D,
        ),
        OpBench(
            "delta_rule",
            ("chunk", "parallel", "recurrent"),
            make_delta,
            lambda x, mode: delta_rule(x["q"], x["k"], x["v"], x["beta"], mode=mode)[0],
        ),
        OpBench(
            "gated_delta_rule",
            ("chunk", "parallel", "recurrent"),
            make_delta,
            lambda x, mode: gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode=mode)[0],
        ),
        OpBench(
            "selective_scan",
            ("chunk", "recurrent"),
            make_scan,
            lambda x, mode: selective_scan(
                x["u"], x["delta"], x["A"], x["B"], x["C"], delta_softplus=True, mode=mode
            )[0],
        ),
        OpBench(
            "ssd",
            ("chunk", "parallel", "recurrent"),
            make_ssd,
            lambda x, mode: ssd(x["x"], x["dt"], x["A"], x["B"], x["C"], dt_softplus=True, mode=mode)[0],
        ),
    ]


def _time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_op(bench: OpBench, mode: str, B: int, T: int, H: int, D: int, device: str, repeats: int):
    """(forward seconds under no_grad, forward+backward seconds)."""
    x = bench.make(B, T, H, D, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def fwd():
        with torch.no_grad():
            bench.call(x, mode)
        sync()

    leaves = {n: t.detach().requires_grad_(True) for n, t in x.items()}

    def fwd_bwd():
        for t in leaves.values():
            t.grad = None
        bench.call(leaves, mode).sum().backward()
        sync()

    return _time(fwd, repeats), _time(fwd_bwd, repeats)


def main(args) -> int:
    lengths = [int(t) for t in str(args.lengths).split(",")]
    benches = _registry()
    if args.ops:
        wanted = set(args.ops.split(","))
        unknown = wanted - {b.name for b in benches}
        if unknown:
            raise ValueError(f"unknown op(s) {sorted(unknown)}; choose from {[b.name for b in benches]}")
        benches = [b for b in benches if b.name in wanted or b.name == "softmax_attention"]
    B, H, D = args.batch, args.heads, args.head_dim
    print(
        f"mnemo bench: B={B} H={H} D={D} float32 on {args.device}, {torch.get_num_threads()} threads; "
        "times are medians of",
        args.repeats,
        "runs",
    )
    print("x SDPA = (causal SDPA time) / (this time): above 1 means faster than softmax attention\n")
    header = (
        f"{'op':<28}{'mode':<11}{'T':>6}{'fwd ms':>11}{'fwd+bwd ms':>12}{'x SDPA fwd':>12}{'x SDPA f+b':>12}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for T in lengths:
        sdpa = None
        for bench in benches:
            for mode in bench.modes:
                row = {"op": bench.name, "mode": mode, "T": T}
                skip = None
                if mode == "recurrent" and T > args.recurrent_max_len:
                    skip = f"skipped: T > --recurrent-max-len {args.recurrent_max_len}"
                elif (
                    mode == "parallel"
                    and bench.name != "softmax_attention"
                    and bench.parallel_bytes(B, T, H, D) > 3e9
                ):
                    skip = "skipped: quadratic form needs > 3 GB"
                if skip:
                    row["skipped"] = skip
                    print(f"{bench.name:<28}{mode:<11}{T:>6}   {skip}")
                    rows.append(row)
                    continue
                f, fb = time_op(bench, mode, B, T, H, D, args.device, args.repeats)
                if bench.name == "softmax_attention":
                    sdpa = (f, fb)
                row.update(
                    fwd_ms=1e3 * f, fwd_bwd_ms=1e3 * fb, x_sdpa_fwd=sdpa[0] / f, x_sdpa_fwd_bwd=sdpa[1] / fb
                )
                rows.append(row)
                print(
                    f"{bench.name:<28}{mode:<11}{T:>6}{1e3 * f:>11.2f}{1e3 * fb:>12.2f}"
                    f"{row['x_sdpa_fwd']:>12.2f}{row['x_sdpa_fwd_bwd']:>12.2f}",
                    flush=True,
                )
        _print_speedups(rows, T)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"B": B, "H": H, "D": D, "device": args.device, "rows": rows}, fh, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def _print_speedups(rows: list[dict], T: int) -> None:
    """Chunk form vs its own token-loop reference at this T (the chunked kernel's raison d'être)."""
    at_T = {(r["op"], r["mode"]): r for r in rows if r["T"] == T and "fwd_ms" in r}
    for (op, mode), r in at_T.items():
        ref = at_T.get((op, "recurrent"))
        if mode == "chunk" and ref is not None:
            print(
                f"{'':<28}{'':<11}{T:>6}   chunk is {ref['fwd_ms'] / r['fwd_ms']:.1f}x (fwd) and "
                f"{ref['fwd_bwd_ms'] / r['fwd_bwd_ms']:.1f}x (fwd+bwd) faster than recurrent [{op}]"
            )

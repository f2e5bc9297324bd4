"""``mnemo bench``: forward and forward+backward time of every op and form, next to causal SDPA.

A benchmark, not a test: it prints a table (and optionally JSON) and asserts nothing. Ratios are
measured in the same process, so they compare like with like on whatever machine runs it::

    mnemo bench                                  # T in {512 ... 8192}, B=1, H=4, D=64
    mnemo bench --lengths 4096 --ops gla_channel --json out.json
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import write_json


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
    #: forward FLOPs of the chunk form (matmul work the algorithm does), or None
    chunk_flops: Callable | None = None


def _chunked_length(T, C):
    """``(C, T)`` as the chunk forms run them: a chunk of at most ``T`` tokens, and ``T`` padded up to a
    whole number of chunks (the padded tokens' products are computed too)."""
    C = min(C, T)
    return C, -(-T // C) * C


def _linear_flops(B, T, H, D, C=64):
    """Chunked (gated) linear attention, forward: QKᵀ and AV inside chunks, kᵀv and qS across."""
    C, T = _chunked_length(T, C)
    return B * H * (2 * T * C * 2 * D + 4 * T * D * D)


def _delta_flops(B, T, H, D, C=64):
    """Chunked (gated) delta rule, forward, the products the chunk form runs: ``K Kᵀ``, ``Q Kᵀ`` and
    ``P ṽ`` (``6TCD``), ``[W̃ | Ũ] = Ã⁻¹ [βK | βV]``, a product with the inverse (``4TCD``), the
    ``[C, K]·[K, V]``-sized ``W̃ S``, ``Q S`` and ``Kᵀ [W̃ | Ũ]`` (``8TD²``) and the chunk-state pass
    ``S ← M S + D`` (``2(T/C)D³``). Forming ``Ã⁻¹`` (forward substitution, ``~C³/3`` per chunk) is
    not counted. (Until the second review this counted ``Ã⁻¹ [βK | βV]`` as triangular solves,
    ``2TCD``: right at ``D = C`` only by the chance that ``2(T/C)D³ = 2TCD`` there, ~10% low
    elsewhere and at ``D = C`` against the work.)"""
    C, T = _chunked_length(T, C)
    return B * H * (10 * T * C * D + 8 * T * D * D + 2 * (T // C) * D * D * D)


def _ssd_flops(B, T, H, D, C=64):
    """Mamba-2's SSD with one group of ``B``/``C`` shared by the ``H`` heads (``d_state = D``, as
    this suite builds it), forward: the ``[C, C]`` scores ``C Bᵀ`` once per group (``2TCD``; per
    head, as :func:`_linear_flops` counts QKᵀ, would be ``H`` times too many), per head ``A v``
    (``2TCD``) and the state products ``C S`` and ``Bᵀ v`` (``4TD²``)."""
    C, T = _chunked_length(T, C)
    return B * (2 * T * C * D + H * (2 * T * C * D + 4 * T * D * D))


def _sdpa_flops(B, T, H, D):
    """Causal softmax attention, forward: QKᵀ and PV over the lower triangle."""
    return B * H * 2 * T * T * D


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

    def make_kda(B, T, H, D, device):  # the delta rule's inputs with a decay per key channel
        x = make_delta(B, T, H, D, device)
        x["g"] = F.logsigmoid(torch.randn(B, T, H, D, generator=_gen()) + 3).to(device)
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
            chunk_flops=_sdpa_flops,
        ),
        OpBench(
            "linear_attention",
            ("chunk", "parallel", "recurrent"),
            make_plain,
            lambda x, mode: linear_attention(x["q"], x["k"], x["v"], mode=mode)[0],
            chunk_flops=_linear_flops,
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
            chunk_flops=_linear_flops,
        ),
        OpBench(
            "gla_channel",
            ("chunk", "parallel", "recurrent"),
            make_channel,
            lambda x, mode: gated_linear_attention(x["q"], x["k"], x["v"], x["g"], mode=mode)[0],
            parallel_bytes=lambda B, T, H, D: 4 * 4 * B * H * T * T * D,
            chunk_flops=_linear_flops,
        ),
        OpBench(
            "delta_rule",
            ("chunk", "parallel", "recurrent"),
            make_delta,
            lambda x, mode: delta_rule(x["q"], x["k"], x["v"], x["beta"], mode=mode)[0],
            chunk_flops=_delta_flops,
        ),
        OpBench(
            "gated_delta_rule",
            ("chunk", "parallel", "recurrent"),
            make_delta,
            lambda x, mode: gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode=mode)[0],
            chunk_flops=_delta_flops,
        ),
        OpBench(
            "kda",
            ("chunk", "parallel", "recurrent"),
            make_kda,
            lambda x, mode: gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mode=mode)[0],
            chunk_flops=_delta_flops,
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
            chunk_flops=_ssd_flops,
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


def time_op(
    bench: OpBench,
    mode: str,
    B: int,
    T: int,
    H: int,
    D: int,
    device: str,
    repeats: int,
    dtype: torch.dtype = torch.float32,
):
    """(forward seconds under no_grad, forward+backward seconds) with inputs in ``dtype``."""
    x = {n: t.to(dtype) for n, t in bench.make(B, T, H, D, device).items()}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def fwd():
        with torch.no_grad():
            bench.call(x, mode)
        sync()

    leaves = {n: t.detach().requires_grad_(True) for n, t in x.items()}

    def fwd_bwd():
        for t in leaves.values():
            t.grad = None
        bench.call(leaves, mode).float().sum().backward()
        sync()

    return _time(fwd, repeats), _time(fwd_bwd, repeats)


def time_decode(bench: OpBench, B: int, H: int, D: int, device: str, repeats: int, steps: int = 64) -> float:
    """Seconds per one-token recurrent step (``T = 1``) of the op, state carried."""
    if "recurrent" not in bench.modes:
        return float("nan")
    xs = bench.make(B, steps, H, D, device)

    def run():
        with torch.no_grad():
            for t in range(steps):
                # per-token inputs are [B, T, ...]; parameters such as A ([Dm, N] or [H]) are not
                bench.call(
                    {n: v[:, t : t + 1] if _per_token(v, steps) else v for n, v in xs.items()}, "recurrent"
                )

    return _time(run, max(1, repeats // 2)) / steps


def _per_token(v: torch.Tensor, T: int) -> bool:
    return v.ndim >= 3 and v.shape[1] == T


#: the side of the square matmul that :func:`matmul_peak` times by default (the test suite sets it
#: smaller: a yardstick's size, not what a row measures)
PEAK_N = 2048


def matmul_peak(
    dtype: torch.dtype = torch.float32,
    n: int | None = None,
    repeats: int = 10,
    warmup: int = 3,
    device: str = "cpu",
) -> float:
    """Measured GFLOP/s of an ``n × n`` matmul in ``dtype`` (``n`` default :data:`PEAK_N`; the
    machine's practical peak): the fastest of ``repeats`` runs after ``warmup`` runs. A peak is a
    best case, so the fastest run (not the median) is the estimate; a median taken while the
    threads are still waking up once read 180 against 330 GFLOP/s in the same minute, which would
    have doubled every ``% peak``."""
    n = PEAK_N if n is None else n
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        a @ b
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def main(args) -> int:
    lengths = [int(t) for t in str(args.lengths).split(",")]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    wanted_dtypes = [d.strip() for d in str(getattr(args, "dtypes", "fp32")).split(",")]
    for d in wanted_dtypes:
        if d not in dtypes:
            raise ValueError(f"--dtypes: expected fp32 and/or bf16, got {d!r}")
    benches = _registry()
    if args.ops:
        from ..argtypes import match_names

        wanted = set(match_names("--ops", args.ops, [b.name for b in benches]))  # names or 'gla*'
        benches = [b for b in benches if b.name in wanted or b.name == "softmax_attention"]
    modes_arg = getattr(args, "modes", None)
    modes = {"chunk", "parallel", "recurrent"} if not modes_arg else set(modes_arg.split(","))
    if not modes <= {"chunk", "parallel", "recurrent"}:
        raise ValueError(f"--modes: expected chunk, parallel and/or recurrent, got {modes_arg!r}")
    B, H, D = args.batch, args.heads, args.head_dim
    from ..train.memory_estimate import GiB, available_memory

    have, source = available_memory(torch.device(args.device))
    # a lower bound: q, k, v, o, their gradients, fp32 (the parallel forms need more)
    need = 8 * B * max(lengths) * H * D * 4
    if have is not None and need > have:
        raise ValueError(
            f"--lengths / --heads / --head-dim / --batch: the inputs alone need {need / GiB:,.1f} GiB at "
            f"T = {max(lengths):,}, but only {have / GiB:,.1f} GiB are available ({source})"
        )
    peaks = {d: matmul_peak(dtypes[d], device=args.device) for d in wanted_dtypes}
    print(
        f"mnemo bench: B={B} H={H} D={D} on {args.device}, {torch.get_num_threads()} threads; medians of "
        f"{args.repeats} runs"
    )
    print(
        f"matmul peak ({PEAK_N}x{PEAK_N}, same run): "
        + ", ".join(f"{d} {p:.0f} GFLOP/s" for d, p in peaks.items())
    )
    print(
        "x SDPA = (causal SDPA time) / (this time): above 1 means faster than softmax attention; GFLOP/s and "
        "% peak count the chunk algorithm's matmul work (fwd+bwd = 3x fwd); % peak is against the mean of "
        "the matmul peaks measured right before and right after that row (the 'peak' column), because "
        "this machine's speed drifts by up to 2x within minutes\n"
    )
    header = (
        f"{'op':<26}{'mode':<10}{'dtype':<6}{'T':>6}{'fwd ms':>10}{'fwd+bwd ms':>12}{'x SDPA fwd':>11}"
        f"{'x SDPA f+b':>11}{'GFLOP/s':>9}{'peak':>6}{'%peak':>7}{'decode us':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    decode_done = set()
    for dname in wanted_dtypes:
        dtype = dtypes[dname]
        for T in lengths:
            sdpa = None
            for bench in benches:
                for mode in bench.modes:
                    if mode not in modes and bench.name != "softmax_attention":
                        continue
                    row = {"op": bench.name, "mode": mode, "dtype": dname, "T": T}
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
                        print(f"{bench.name:<26}{mode:<10}{dname:<6}{T:>6}   {skip}")
                        rows.append(row)
                        continue
                    counted = bench.chunk_flops is not None and (
                        mode == "chunk" or (mode == "parallel" and bench.name == "softmax_attention")
                    )
                    local_peak = (
                        matmul_peak(dtype, repeats=4, warmup=1, device=args.device)
                        if counted
                        else float("nan")
                    )
                    f, fb = time_op(bench, mode, B, T, H, D, args.device, args.repeats, dtype)
                    if counted:  # the mean of the peaks measured right before and right after the row
                        local_peak = (
                            local_peak + matmul_peak(dtype, repeats=4, warmup=1, device=args.device)
                        ) / 2
                    if bench.name == "softmax_attention":
                        sdpa = (f, fb)
                    row.update(
                        fwd_ms=1e3 * f,
                        fwd_bwd_ms=1e3 * fb,
                        x_sdpa_fwd=sdpa[0] / f,
                        x_sdpa_fwd_bwd=sdpa[1] / fb,
                    )
                    gflops = pct = float("nan")
                    if counted:
                        gflops = 3 * bench.chunk_flops(B, T, H, D) / fb / 1e9
                        pct = 100 * gflops / local_peak
                        row.update(gflops_fwd_bwd=gflops, matmul_peak_gflops=local_peak, percent_of_peak=pct)
                    dec = float("nan")
                    if mode == "recurrent" and (bench.name, dname) not in decode_done:
                        dec = 1e6 * time_decode(bench, B, H, D, args.device, args.repeats)
                        decode_done.add((bench.name, dname))
                        row["decode_us_per_token"] = dec
                    rows.append(row)
                    print(
                        f"{bench.name:<26}{mode:<10}{dname:<6}{T:>6}{1e3 * f:>10.2f}{1e3 * fb:>12.2f}"
                        f"{row['x_sdpa_fwd']:>11.2f}{row['x_sdpa_fwd_bwd']:>11.2f}{_cell(gflops, 9)}"
                        f"{local_peak:>6.0f}{_cell(pct, 7)}{_cell(dec, 10)}",
                        flush=True,
                    )
            _print_speedups(rows, T, dname)
    peaks_end = {d: matmul_peak(dtypes[d], device=args.device) for d in wanted_dtypes}
    print(
        "\nmatmul peak measured again at the end: "
        + ", ".join(
            f"{d} {p:.0f} GFLOP/s ({100 * (p / peaks[d] - 1):+.0f}% against the start)"
            for d, p in peaks_end.items()
        )
    )
    if args.json:
        write_json(
            args.json,
            {
                "B": B,
                "H": H,
                "D": D,
                "device": args.device,
                "matmul_peak_gflops": peaks,
                "matmul_peak_gflops_at_end": peaks_end,
                "rows": rows,
            },
        )
        print(f"\nwrote {args.json}")
    return 0


def _print_speedups(rows: list[dict], T: int, dtype: str = "fp32") -> None:
    """Chunk form vs its own token-loop reference at this T (the chunked kernel's raison d'être)."""
    at_T = {
        (r["op"], r["mode"]): r
        for r in rows
        if r["T"] == T and r.get("dtype", "fp32") == dtype and "fwd_ms" in r
    }
    for (op, mode), r in at_T.items():
        ref = at_T.get((op, "recurrent"))
        if mode == "chunk" and ref is not None:
            print(
                f"{'':<26}{'':<10}{dtype:<6}{T:>6}   chunk is "
                f"{_times(ref['fwd_ms'] / r['fwd_ms'])} (fwd) and "
                f"{_times(ref['fwd_bwd_ms'] / r['fwd_bwd_ms'])} (fwd+bwd) than recurrent [{op}]"
            )


def _times(ratio: float) -> str:
    """``3.0`` -> ``"3.0x faster"``, ``0.25`` -> ``"4.0x slower"`` (never "0.2x faster")."""
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"


def _cell(value: float, width: int) -> str:
    """A table cell of one decimal, or ``-`` where the value does not apply (not ``nan``)."""
    return f"{'-':>{width}}" if value != value else f"{value:>{width}.1f}"

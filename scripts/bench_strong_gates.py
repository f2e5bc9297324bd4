"""Strong gates and the chunk size: the hand-written chunk forms at halved chunks against the
autograd fallback, in one process, interleaved.

The factorised chunk forms (``_DeltaChunk``, ``_GLAChunk``) represent a chunk's decays as
``e^{±b}`` and so take chunks that decay by at most 30 nats; where one decays by more, the call
first halves the chunk (down to 16 tokens, ``mnemo.ops._chunked.chunks_within_span``) and only then
falls back to the autograd form at the full chunk size. Two tables:

* ``op``: the gated delta rule and per-channel GLA (forward + backward at ``[B, T, H, K]``, mild
  gates) in the hand-written form at chunk 64 / 32 / 16 / 8 and the autograd form at 64: what a
  halved chunk costs against what the fallback costs (the floor of 16 is chosen from it);
* ``models``: whole training steps (forward, fused loss, backward, AdamW; random tokens, weights
  at initialisation) of the named presets with the halving switched off ("before": straight to
  the fallback, as mnemo did before) and on ("after"), alternately in each round.

    python scripts/bench_strong_gates.py [--rounds 5] [--op-shape 8x1024x4x64]
        [--models gated_deltanet,gla] [--model-sizes 128x4x128x32,256x6x1024x8,512x8x2048x1]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import time

import torch
import torch.nn.functional as F

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)

dr = importlib.import_module("mnemo.ops.delta_rule")
gla = importlib.import_module("mnemo.ops.gated_linear_attention")
_HALVING = {m: m.chunks_within_span for m in (dr, gla)}


def halving(on: bool) -> None:
    """Switch the chunk halving on (mnemo's behaviour) or off (the fallback at once, as before)."""
    for mod, f in _HALVING.items():
        mod.chunks_within_span = f if on else functools.partial(f, min_chunk=10**9)


def _interleaved(tasks: dict, rounds: int) -> dict:
    """Median seconds per task; the order of the tasks reverses every other round."""
    for fn in tasks.values():
        fn()  # warm-up
    times = {name: [] for name in tasks}
    for r in range(rounds):
        for name in tasks if r % 2 == 0 else list(tasks)[::-1]:
            t = time.perf_counter()
            tasks[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def op_table(B: int, T: int, H: int, K: int, rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    g_head = -0.02 * torch.rand(B, T, H, generator=gen)  # mild: every form runs as asked
    g_chan = -0.02 * torch.rand(B, T, H, K, generator=gen)
    S0 = torch.zeros(B, H, K, K)

    def run(op: str, C: int, autograd: bool):
        xs = [
            t.clone().requires_grad_()
            for t in ((q, k, v, beta, g_head) if op == "delta" else (q, k, v, g_chan))
        ]
        if op == "delta":
            f = dr.delta_chunk_autograd if autograd else dr.delta_chunk
        else:
            f = gla.gla_chunk_autograd if autograd else gla.gla_chunk
        o, S = f(*xs, S0, C)
        (o.square().sum() + S.sum()).backward()

    tasks = {}
    for op in ("delta", "gla"):
        for C in (64, 32, 16, 8):
            tasks[(op, f"hand-written, chunk {C}")] = functools.partial(run, op, C, False)
        tasks[(op, "autograd, chunk 64")] = functools.partial(run, op, 64, True)
    med = _interleaved(tasks, rounds)
    print(
        f"op: forward + backward, B {B}, T {T}, H {H}, K = V = {K}, fp32, "
        f"{rounds} interleaved rounds, medians"
    )
    print(f"{'op':24s} {'form':26s} {'ms':>8s} {'autograd / this':>16s}")
    for op, label in (("delta", "gated delta rule"), ("gla", "GLA, per-channel gates")):
        ref = med[(op, "autograd, chunk 64")]
        for (o, form), t in med.items():
            if o == op:
                print(f"{label:24s} {form:26s} {t * 1e3:8.1f} {ref / t:15.2f}x")


def model_table(models: list[str], sizes: list[tuple[int, int, int, int]], rounds: int) -> None:
    from mnemo.bench import roofline

    print(
        f"\nmodels: training step (forward, fused loss, backward, AdamW), random tokens, initial weights; "
        f"{rounds} interleaved rounds, medians; before = no halving (the autograd fallback at once)"
    )
    print(
        f"{'model':16s} {'d_model x layers, T x B':24s} {'before ms':>10s} {'after ms':>10s} "
        f"{'speed-up':>9s} "
        f"{'tok/s before':>13s} {'after':>8s}"
    )
    for d, L, T, B in sizes:
        for name in models:
            model = roofline.build(name, d, L)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            step = roofline.train_step_fn(model, opt, T, B)

            def run(on, step=step):
                halving(on)
                step()

            med = _interleaved(
                {"before": functools.partial(run, False), "after": functools.partial(run, True)}, rounds
            )
            a, b = med["before"], med["after"]
            size = f"{d} x {L}, {T} x {B}"
            print(
                f"{name:16s} {size:24s} {a * 1e3:10.1f} {b * 1e3:10.1f} {a / b:8.2f}x "
                f"{T * B / a:13.0f} {T * B / b:8.0f}"
            )
    halving(True)


def _sizes(text: str) -> list[tuple[int, int, int, int]]:
    out = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--model-sizes: expected DxLxTxB items like 256x6x1024x8, got {item!r}")
        out.append(tuple(int(p) for p in parts))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (medians; default 5)")
    ap.add_argument("--op-shape", default="8x1024x4x64", help="BxTxHxK of the op table, or 'none'")
    ap.add_argument("--models", default="gated_deltanet,gla", help="presets of the model table, or 'none'")
    ap.add_argument(
        "--model-sizes",
        default="128x4x128x32,256x6x1024x8,512x8x2048x1",
        help="d_model x layers x T x B, comma-separated",
    )
    ap.add_argument("--threads", type=positive_int, default=2)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit(f"--rounds: expected >= 1, got {a.rounds}")
    torch.set_num_threads(a.threads)
    print(
        f"# python scripts/bench_strong_gates.py --rounds {a.rounds} --op-shape {a.op_shape} "
        f"--models {a.models} "
        f"--model-sizes {a.model_sizes} --threads {a.threads}  (torch {torch.__version__})"
    )
    if a.op_shape != "none":
        shape = a.op_shape.split("x")
        if len(shape) != 4 or not all(p.isdigit() and int(p) > 0 for p in shape):
            raise SystemExit(f"--op-shape: expected BxTxHxK like 8x1024x4x64, got {a.op_shape!r}")
        op_table(*(int(p) for p in shape), a.rounds)
    if a.models != "none":
        model_table([m.strip() for m in a.models.split(",")], _sizes(a.model_sizes), a.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fused (chunked) cross-entropy against the plain head + ``F.cross_entropy``, and AdamW's
implementations: a training step's peak memory and time ratios (a benchmark: prints tables, asserts
nothing).

Rows (``--sizes``): ``main`` = the main job's size (registry defaults: d_model 128, 4 layers, byte
vocabulary 256; T 128, B 32), ``vocab32k`` = the same model with a 32,000-token vocabulary (tied
head, as the registry's default).

* **time**: one training step (forward, loss, backward, AdamW step), plain vs fused, interleaved in
  one process (``--rounds`` rounds, medians; ratio = plain / fused, above 1: fused faster).
* **peak memory**: each variant in a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then
  maps every large block on its own and returns it at ``free``, so the resident set follows the live
  tensors): after a warm-up step (the optimizer's state exists) the process resets its peak RSS
  (``/proc/self/clear_refs``, value 5) and reads ``VmHWM − VmRSS before`` over one more step. Beside
  it, the ``[B·T, V]`` float32 logits' size from the shapes (the plain path keeps the logits and
  their log-softmax for the backward, then their gradient).
* **optimizer**: ``opt.step()`` alone on the model's gradients for AdamW's for-loop
  (``foreach=False``, torch's CPU default), ``foreach=True`` and ``fused=True``, interleaved.

    python scripts/bench_fused_loss.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)

SIZES = {"main": dict(vocab=256, T=128, B=32), "vocab32k": dict(vocab=32000, T=128, B=32)}
MODEL = "gated_deltanet"


def build(vocab: int, model: str = MODEL):
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    return LanguageModel(build_config(model, vocab_size=vocab))


def step_fn(m, opt, vocab: int, T: int, B: int, fused: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        if fused:
            loss, _ = m(x, targets=y)
        else:
            logits, _ = m(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        (loss / y.numel()).backward()
        opt.step()

    return step


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_in_this_process(size: str, fused: bool, model: str) -> dict:
    s = SIZES[size]
    m = build(s["vocab"], model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    step = step_fn(m, opt, s["vocab"], s["T"], s["B"], fused)
    step()  # the optimizer's state now exists
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    step()
    return {"peak_delta": _status("VmHWM") - before, "rss_before": before}


def peak_memory(size: str, fused: bool, model: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    code = (
        "import json, sys; sys.path.insert(0, 'scripts'); from bench_fused_loss import peak_in_this_process; "
        f"print(json.dumps(peak_in_this_process({size!r}, {fused!r}, {model!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleaved(tasks: dict, rounds: int) -> dict:
    for fn in tasks.values():
        fn()  # warm-up
    times = {k: [] for k in tasks}
    keys = list(tasks)
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = time.perf_counter()
            tasks[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--sizes", default="main,vocab32k")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument(
        "--memory-runs", type=positive_int, default=2, help="fresh processes per memory row (median)"
    )
    ap.add_argument("--parts", default="memory,time,optimizer", help="which tables (comma-separated)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    sizes = args.sizes.split(",")
    print(
        f"load average before: {os.getloadavg()}; {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}"
    )
    print(f"model {args.model} (registry defaults), {args.rounds} interleaved rounds\n")

    print("peak memory of one training step over the RSS before it (fresh process each, MiB)")
    print(f"{'size':<10}{'logits MiB':>12}{'plain':>10}{'fused':>10}{'saved':>10}")
    for size in sizes if "memory" in parts else ():
        s = SIZES[size]
        logits = s["B"] * s["T"] * s["vocab"] * 4 / 2**20
        peaks = {}
        for fused in (False, True):
            runs = [peak_memory(size, fused, args.model)["peak_delta"] for _ in range(args.memory_runs)]
            peaks[fused] = statistics.median(runs) / 2**20
        print(
            f"{size:<10}{logits:>12.1f}{peaks[False]:>10.1f}{peaks[True]:>10.1f}"
            f"{peaks[False] - peaks[True]:>10.1f}",
            flush=True,
        )

    print("\ntraining step time (ms, medians; ratio = plain / fused)")
    print(f"{'size':<10}{'plain':>10}{'fused':>10}{'ratio':>8}")
    for size in sizes if "time" in parts else ():
        s = SIZES[size]
        tasks = {}
        for fused in (False, True):
            m = build(s["vocab"], args.model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            tasks[fused] = step_fn(m, opt, s["vocab"], s["T"], s["B"], fused)
        med = interleaved(tasks, args.rounds)
        print(
            f"{size:<10}{1e3 * med[False]:>10.1f}{1e3 * med[True]:>10.1f}{med[False] / med[True]:>8.2f}",
            flush=True,
        )
        del tasks

    print("\nAdamW step alone on the model's gradients (ms, medians; ratio = for-loop / this)")
    print(
        f"{'size':<10}{'params':>10}{'for-loop':>10}{'foreach':>10}{'fused':>10}"
        f"{'r foreach':>10}{'r fused':>9}"
    )
    for size in sizes if "optimizer" in parts else ():
        s = SIZES[size]
        m = build(s["vocab"], args.model)
        step_fn(m, torch.optim.SGD(m.parameters(), lr=0.0), s["vocab"], s["T"], s["B"], True)()  # gradients
        tasks = {}
        for kind, kw in (
            ("loop", {"foreach": False}),
            ("foreach", {"foreach": True}),
            ("fused", {"fused": True}),
        ):
            params = [p.detach().clone().requires_grad_() for p in m.parameters()]
            for p, q in zip(params, m.parameters()):
                p.grad = q.grad.clone()
            tasks[kind] = torch.optim.AdamW(params, lr=1e-4, **kw).step
        med = interleaved(tasks, max(args.rounds, 5) * 4)
        n = sum(p.numel() for p in m.parameters())
        print(
            f"{size:<10}{n:>10,}{1e3 * med['loop']:>10.2f}{1e3 * med['foreach']:>10.2f}"
            f"{1e3 * med['fused']:>10.2f}"
            f"{med['loop'] / med['foreach']:>10.2f}{med['loop'] / med['fused']:>9.2f}",
            flush=True,
        )
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

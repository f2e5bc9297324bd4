"""What bounds one-token decoding on a CPU (issue 40 item 3: decoding at >= 50% of the memory
bandwidth limit): the bytes a step must read against the operators it dispatches.

For each preset at the main job's size (registry defaults: d_model 128, 4 layers; vocabulary 256 as
in ``mnemo bench --suite roofline``; ``--d-model``/``--n-layers`` for the roofline's and issue 40's
larger sizes, e.g. 512 x 8) and batch 1 and 8, in one process, interleaved:

- ``bytes``: weights read once (the embedding only for the looked-up rows) + the recurrent state
  (or KV cache) after a 256-token prompt, as the roofline suite counts them;
- ``t(50% bw)``: the time those bytes take at half this run's STREAM triad bandwidth: the step time
  the target asks for;
- ``ops``: the ATen operators one decode step dispatches (counted with a ``TorchDispatchMode``:
  every call that reaches a kernel, views included);
- ``floor``: ``ops`` x this run's median cost of one dispatched operator on a one-element tensor
  (a mix of add, mul, view and a 1x1 matmul): the time eager PyTorch needs to launch them, whatever
  they compute;
- ``step``: the measured decode step (``--steps-per-call`` calls back to back, each over the model's
  decoding cycle, ``mnemo.bench.roofline.decode_cycle``: per token, the mean over the cycle; ``ops``
  is likewise the mean per token);
- with ``--compile``, ``compiled``: the same step as ``LanguageModel.generate(compile=True)`` runs
  it (``mnemo.models.lm._compile_kind("step")``, a fresh one per model and batch: inductor fuses
  the elementwise operators into a few C++ loops, so the per-operator floor no longer applies, and
  hands products of at most 8 rows to ``mnemo.ops.small_mm``'s C kernel, or writes the smaller ones
  as fused multiply-sums, instead of BLAS calls), and its fraction of the bandwidth; with
  ``--blas-too`` also the compiled step with BLAS products, with ``--fused-too`` the compiled step
  with fused multiply-sums only (the pass before the kernel), in the same rounds.

When ``floor`` alone exceeds ``t(50% bw)``, no eager decode step that dispatches these operators one
by one can meet the target: it needs fewer operators (fusion into one kernel per layer or per step).

    python scripts/bench_decode_floor.py [--models gated_deltanet,mamba2,gla,transformer] [--repeats 20]
        [--compile [--blas-too] [--fused-too]] [--d-model 128] [--n-layers 4]
"""

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.bench.models import interleaved
from mnemo.bench.roofline import (
    build,
    compiled_decode_step_fn,
    decode_step_fn,
    stream_tasks,
    weight_bytes_per_step,
)


class CountOps(TorchDispatchMode):
    """Counts every ATen operator call that reaches dispatch."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def op_floor_task(n: int = 200):
    """``n`` one-element operators of four kinds (add, mul, view, 1x1 matmul), ``n`` in all."""
    a, b = torch.ones(1, 1), torch.ones(1, 1)

    def run():
        for _ in range(n // 4):
            c = a + b
            c = c * b
            c = c.view(1)
            torch.mm(a, b)

    return run, n


def repeated(fn, n: int):
    """``fn`` called ``n`` times in a row, as one task."""

    def run():
        for _ in range(n):
            fn()

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gated_deltanet,mamba2,gla,transformer")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument(
        "--steps-per-call",
        type=positive_int,
        default=20,
        help="decode steps back to back in one timed call (as generation runs them; 1 = each step "
        "timed alone, after the other tasks have evicted its weights from the caches)",
    )
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument(
        "--d-model", type=positive_int, default=128, help="model width (default: the main job's, 128)"
    )
    p.add_argument("--n-layers", type=positive_int, default=4, help="blocks (default: the main job's, 4)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time the step generate(compile=True) runs (compiles each model and batch first)",
    )
    p.add_argument(
        "--blas-too",
        action="store_true",
        help="with --compile: also time the compiled step with BLAS products (no fused multiply-sums, "
        "as generate(compile=True) ran before issue 40's matvec pass), in the same rounds",
    )
    p.add_argument(
        "--fused-too",
        action="store_true",
        help="with --compile: also time the compiled step whose products are all fused multiply-sums "
        "(no mnemo.ops.small_mm kernel, as generate(compile=True) ran in sessions 27-30), in the same rounds",
    )
    p.add_argument(
        "--stream-elements",
        type=positive_int,
        default=None,
        help="triad array length (default: the roofline's)",
    )
    a = p.parse_args(argv)
    if a.blas_too and not a.compile:
        p.error("--blas-too: times the compiled step without the pass, so it needs --compile")
    if a.fused_too and not a.compile:
        p.error("--fused-too: times the compiled step without the kernel, so it needs --compile")
    torch.set_num_threads(a.threads)
    models = a.models.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    built = {m: build(m, a.d_model, a.n_layers) for m in models}
    tasks, ops, diffs, compile_s, per_call = {}, {}, {}, {}, {}
    for m, model in built.items():
        for b in batches:
            step = decode_step_fn(model, b, a.context)
            step()
            with CountOps() as c:
                step()
            ops[(m, b)] = round(c.n / step.tokens)  # a token's mean over the cycle
            per_call[m] = a.steps_per_call * step.tokens
            tasks[("decode", m, b)] = repeated(step, a.steps_per_call)
            if a.compile:
                t = time.time()
                fn, diffs[(m, b)] = compiled_decode_step_fn(model, b, a.context)
                fn()
                compile_s[(m, b)] = time.time() - t
                tasks[("compiled", m, b)] = repeated(fn, a.steps_per_call)
                if a.blas_too:
                    blas, _ = compiled_decode_step_fn(model, b, a.context, matvec=False)
                    blas()
                    tasks[("blas", m, b)] = repeated(blas, a.steps_per_call)
                if a.fused_too:
                    fused, _ = compiled_decode_step_fn(model, b, a.context, kernel=False)
                    fused()
                    tasks[("fused", m, b)] = repeated(fused, a.steps_per_call)
    floor_fn, floor_n = op_floor_task()
    tasks["floor"] = floor_fn
    stream = stream_tasks() if a.stream_elements is None else stream_tasks(a.stream_elements)
    tasks["triad"] = stream["triad"][0]
    t0 = time.time()
    times = interleaved(tasks, a.repeats, warmup=2)
    med = {
        k: statistics.median(v) / (per_call[k[1]] if k[0] in ("decode", "compiled", "blas", "fused") else 1)
        for k, v in times.items()
    }
    triad = stream["triad"][1] / med["triad"]
    per_op = med["floor"] / floor_n
    print(
        f"# d_model {a.d_model}, {a.n_layers} layers; {a.threads} threads, torch {torch.__version__}, "
        f"{a.repeats} interleaved rounds of "
        f"{a.steps_per_call} decode call(s) of a cycle each per timing, medians per token; "
        f"triad {triad / 1e9:.1f} GB/s; one dispatched operator {per_op * 1e6:.2f} us; "
        f"timing took {time.time() - t0:.0f} s"
    )
    head = "model            batch   bytes MB  t(50% bw) ms   ops  floor ms  step ms  floor/t(50%)  "
    head += "step/floor  fraction of bw"
    if a.compile:
        head += "  compiled ms  fraction of bw  compile s  max |logit diff|"
        if a.blas_too:
            head += "  BLAS ms  fraction of bw  BLAS/compiled"
        if a.fused_too:
            head += "  fused ms  fraction of bw  fused/compiled"
    print(head)
    rows = []
    for m, model in built.items():
        for b in batches:
            nbytes = weight_bytes_per_step(model, b) + model.state_size_bytes(b, a.context, pending=False)
            target = nbytes / (0.5 * triad)
            floor = ops[(m, b)] * per_op
            step = med[("decode", m, b)]
            line = (
                f"{m:16s} {b:5d} {nbytes / 1e6:10.2f} {target * 1e3:13.3f} {ops[(m, b)]:5d} "
                f"{floor * 1e3:9.3f} "
                f"{step * 1e3:8.3f} {floor / target:13.1f} {step / floor:11.2f} {nbytes / step / triad:15.3f}"
            )
            rows.append({"model": m, "batch": b, "bytes": nbytes, "ops": ops[(m, b)], "floor_s": floor})
            rows[-1].update(target_s=target, step_s=step)
            if a.compile:
                comp = med[("compiled", m, b)]
                line += f" {comp * 1e3:12.3f} {nbytes / comp / triad:15.3f} {compile_s[(m, b)]:10.1f}"
                line += f" {diffs[(m, b)]:17.1e}"
                rows[-1].update(compiled_s=comp, logit_diff=diffs[(m, b)])
                if a.blas_too:
                    blas = med[("blas", m, b)]
                    line += f" {blas * 1e3:8.3f} {nbytes / blas / triad:15.3f} {blas / comp:14.2f}"
                    rows[-1].update(blas_s=blas)
                if a.fused_too:
                    fused = med[("fused", m, b)]
                    line += f" {fused * 1e3:9.3f} {nbytes / fused / triad:15.3f} {fused / comp:15.2f}"
                    rows[-1].update(fused_s=fused)
            print(line)
    return rows


if __name__ == "__main__":
    main()

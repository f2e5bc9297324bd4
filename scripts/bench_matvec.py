"""Why the compiled decode step writes its small matrix products as fused multiply-sums (issue 40
item 3; ``mnemo/models/_matvec.py``): how fast each way of multiplying 1 or 8 rows by a weight
matrix reads the weights, against the STREAM triad bandwidth measured in the same rounds.

48 distinct ``[2048, 512]`` float32 matrices (201 MB, far beyond the caches), each multiplied once
per call, in one process, interleaved, medians; with 2 threads, then 1:

- ``F.linear``: PyTorch's BLAS path (MKL ``sgemv`` for 1 row, ``sgemm`` for 8);
- ``multiply-sum eager``: ``(w * x).sum(-1)`` in eager PyTorch (1 row);
- ``multiply-sum compiled``: ``(x[:, :, None] * w.T[None]).sum(-2)`` under ``torch.compile``, the
  form ``MatvecPass`` writes for small weights and single rows (one C++ loop; one compiled function
  per row count, static);
- ``small_mm kernel``: ``torch.ops.mnemo.small_mm`` (``mnemo/ops/_native/small_mm.c``: each weight
  row read once for all rows), what ``MatvecPass`` calls for 2-8 rows in steps whose weights exceed
  the last-level cache; ``F.linear`` where the native kernels are unavailable;

    python scripts/bench_matvec.py [--rounds 11]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import mnemo.ops.small_mm  # noqa: F401  (registers torch.ops.mnemo.small_mm)
from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.bench.roofline import stream_tasks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=11)
    p.add_argument("--matrices", type=positive_int, default=48)
    p.add_argument("--stream-elements", type=positive_int, default=None, help="triad array length")
    a = p.parse_args(argv)
    d, n = 512, 2048
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, d, generator=g) for _ in range(a.matrices)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    def fused():  # one compiled function per row count: its rows a static dimension, as in the pass
        return torch.compile(lambda x, w: (x[:, :, None] * w.t()[None]).sum(-2), dynamic=False)

    def kernel(x, w):
        return torch.ops.mnemo.small_mm(x, w, None)

    def over_weights(fn, rows):
        x = torch.randn(rows, d, generator=g)

        def run():
            for w in weights:
                fn(x, w)

        return run

    tasks = {
        "F.linear, 1 row": over_weights(F.linear, 1),
        "F.linear, 8 rows": over_weights(F.linear, 8),
        "multiply-sum eager, 1 row": over_weights(lambda x, w: (w * x).sum(-1), 1),
        "multiply-sum compiled, 1 row": over_weights(fused(), 1),
        "multiply-sum compiled, 8 rows": over_weights(fused(), 8),
        "small_mm kernel, 1 row": over_weights(kernel, 1),
        "small_mm kernel, 8 rows": over_weights(kernel, 8),
    }
    stream = stream_tasks() if a.stream_elements is None else stream_tasks(a.stream_elements)
    tasks["triad"] = stream["triad"][0]
    rows = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for fn in tasks.values():  # warm-up (and compile)
            fn()
        times = {k: [] for k in tasks}
        for _ in range(a.rounds):
            for k, fn in tasks.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        triad = stream["triad"][1] / statistics.median(times["triad"])
        print(f"{threads} thread(s): triad {triad / 1e9:.1f} GB/s; weights {nbytes / 1e6:.0f} MB")
        for k, v in times.items():
            if k == "triad":
                continue
            t = statistics.median(v)
            rows.append({"threads": threads, "task": k, "s": t, "fraction": nbytes / t / triad})
            print(
                f"  {k:32s} {t * 1e3:8.2f} ms {nbytes / t / 1e9:7.1f} GB/s {nbytes / t / triad:6.2f} of triad"
            )
    return rows


if __name__ == "__main__":
    main()

"""The gated RMSNorm's C kernel against its PyTorch form, in one process, interleaved.

Rows: the op alone (forward + backward at ``[B, T, D]``, both gate orders: Mamba-2's
``RMSNorm(x ⊙ silu(z))`` and the gated DeltaNet / GLA ``RMSNorm(x) ⊙ silu(z)``), and with
``--models`` a training step (forward, backward, AdamW) of each named family at d_model 256,
6 layers, with ``mnemo.layers.norm.gated_rms_norm`` switched between the kernel and the PyTorch
form on alternate calls. Ratios are PyTorch form / kernel (above 1: the kernel is faster), per
round and their median.

    python scripts/bench_gated_norm.py [--shape 8x1024x512] [--rounds 7] [--models mamba2,gated_deltanet]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mnemo.layers.norm as norm_mod
from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)


def _reference(x, z, w, eps=1e-5, *, groups=1, gate_first=False):
    return norm_mod._gated_rms_norm_reference(x, z, w, eps, groups, gate_first)


FORMS = {"kernel": norm_mod.gated_rms_norm, "pytorch": _reference}


def _interleaved(run, rounds: int) -> tuple[dict[str, float], list[float]]:
    """Median ms per form and the per-round ratios pytorch / kernel (order alternates)."""
    for form in FORMS:
        run(form)  # warm-up
    times = {form: [] for form in FORMS}
    for r in range(rounds):
        for form in FORMS if r % 2 == 0 else list(FORMS)[::-1]:
            t = time.perf_counter()
            run(form)
            times[form].append(time.perf_counter() - t)
    ratios = [p / k for p, k in zip(times["pytorch"], times["kernel"])]
    return {f: 1e3 * statistics.median(v) for f, v in times.items()}, ratios


def _row(label: str, ms: dict[str, float], ratios: list[float]) -> str:
    per = " ".join(f"{x:.2f}" for x in ratios)
    return f"{label:<34}{ms['kernel']:>10.1f}{ms['pytorch']:>12.1f}{statistics.median(ratios):>9.2f}   {per}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x1024x512", help="B x T x D of the op rows (default 8x1024x512)")
    p.add_argument("--groups", type=positive_int, default=1, help="norm groups in the op rows (default 1)")
    p.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--models", default="", help="families for training-step rows (default: none)")
    p.add_argument("--model-shape", default="1024x8", help="T x B of the model rows (default 1024x8)")
    a = p.parse_args(argv)
    B, T, D = (int(v) for v in a.shape.split("x"))
    torch.manual_seed(0)
    x, z, dy = (torch.randn(B, T, D, requires_grad=i < 2) for i in range(3))
    w = torch.ones(D, requires_grad=True)
    threads = torch.get_num_threads()
    print(f"gated RMSNorm, float32, {threads} threads, {a.rounds} interleaved rounds (medians)")
    print(f"{'row':<34}{'kernel ms':>10}{'pytorch ms':>12}{'ratio':>9}   per round")
    for gate_first in (True, False):

        def op(form, gate_first=gate_first):
            y = FORMS[form](x, z, w, 1e-5, groups=a.groups, gate_first=gate_first)
            y.backward(dy)

        label = f"op {a.shape} {'gate first' if gate_first else 'gate after'} g{a.groups}"
        print(_row(label, *_interleaved(op, a.rounds)), flush=True)
    if a.models:
        from mnemo.models import LanguageModel, build_config

        Tm, Bm = (int(v) for v in a.model_shape.split("x"))
        for name in a.models.split(","):
            torch.manual_seed(0)
            model = LanguageModel(build_config(name, vocab_size=256, d_model=256, n_layers=6))
            opt = torch.optim.AdamW(model.parameters(), 1e-4)
            ids = torch.randint(0, 256, (Bm, Tm))

            def step(form, model=model, opt=opt, ids=ids):
                norm_mod.gated_rms_norm = FORMS[form]
                try:
                    logits = model(ids)[0]
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
                    opt.step()
                    opt.zero_grad()
                finally:
                    norm_mod.gated_rms_norm = FORMS["kernel"]

            print(_row(f"train step {name} {a.model_shape}", *_interleaved(step, a.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

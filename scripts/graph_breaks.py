"""``torch.compile`` graph breaks of every registered preset's training step (issue 36, item 4).

For each preset at a tiny size (d_model 32, 2 layers, vocabulary 32, batch 2, T 40, float32):

* ``cpu graphs/breaks``: :func:`torch._dynamo.explain` of the training forward and its loss (the
  model's forward, then the cross-entropy on float32 logits, as :meth:`Trainer.train_step` computes
  it) on the CPU with the ``auto`` backends (the C kernels step aside while dynamo traces: the
  PyTorch forms are traced). One graph and 0 breaks means ``mnemo train --compile`` compiles the
  whole step; the backward is AOTAutograd's, traced from the same graph;
* ``bwd``: the same function compiled with the ``aot_eager`` backend (dynamo + AOTAutograd, no
  inductor: fast) and differentiated: ``ok``, or the error;
* ``fla graphs/breaks (ops)``: the same explain on the ``meta`` device with ``use_backend("fla")``
  forced, for the presets whose ops have an fla kernel: the ops enter the graph as the custom ops
  ``mnemo::<op>_fla`` (their fake kernels; ``ops`` counts them in the graphs), which is what a CUDA
  run with fla-core installed traces. ``-``: the preset calls no op with an fla kernel;
* ``first break / backward error``: the first break's reason and the backward's error, shortened.

With ``--precision bf16`` the ``fla`` column is not measured (the meta device has no autocast).

    python scripts/graph_breaks.py [--out docs/benchmarks/graph_breaks_cpu.txt] [--precision bf16] [NAME ...]

``--precision bf16`` traces under ``torch.autocast(device_type, torch.bfloat16)``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, build_config
from mnemo.models.registry import model_names
from mnemo.ops import dispatch, use_backend

TINY = {"d_model": 32, "n_layers": 2, "vocab_size": 32}
B, T = 2, 40


def _model(name: str, device: str) -> LanguageModel:
    torch.manual_seed(0)
    with torch.device(device):
        return LanguageModel(build_config(name, **TINY))


def _step_fn(model: LanguageModel, precision: str, device: str):
    """The training forward and its loss, as the trainer computes them."""

    def step(ids: torch.Tensor) -> torch.Tensor:
        ctx = (
            torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        )
        with ctx:
            logits, _ = model(ids)
        return F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return step


def _ids(device: str) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1)).to(device)


def _first_reason(ex) -> str:
    if not ex.break_reasons:
        return ""
    return " ".join(str(ex.break_reasons[0].reason).split())[:90]


def explain(name: str, precision: str = "fp32", device: str = "cpu", backend: str | None = None):
    """``torch._dynamo.explain`` of ``name``'s training forward + loss (see the module docstring);
    ``backend``: force that op backend. Returns the explain output."""
    torch._dynamo.reset()
    model = _model(name, device)
    with use_backend(backend) if backend else contextlib.nullcontext():
        return torch._dynamo.explain(_step_fn(model, precision, device))(_ids(device))


def backward_ok(name: str, precision: str = "fp32") -> str:
    """Compile the training forward + loss with ``aot_eager`` and differentiate it: ``"ok"`` or
    the error's first line."""
    torch._dynamo.reset()
    model = _model(name, "cpu")
    try:
        loss = torch.compile(_step_fn(model, precision, "cpu"), backend="aot_eager")(_ids("cpu"))
        loss.backward()
        reached = sum(p.grad is not None for p in model.parameters())
        return "ok" if reached else "no gradient"
    except Exception as e:  # reported in the table
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"


def _custom_ops(ex) -> int:
    return sum("mnemo." in str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function")


def _uses_fla(name: str) -> bool:
    """Whether ``name``'s forward calls an op that has an fla kernel (one eager meta forward)."""
    dispatch.reset_dispatch_log()
    with torch.no_grad():
        _model(name, "meta")(_ids("meta"))
    return any((op, "fla") in dispatch.PEER_KERNELS for op, _, _ in dispatch.dispatch_log())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="presets (default: all registered)")
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--no-backward", action="store_true", help="skip the bwd column (faster)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    names = args.names or model_names()
    header = (
        f"{'preset':30s} {'cpu graphs':>10s} {'breaks':>6s} {'bwd':>4s} "
        f"{'fla graphs':>10s} {'breaks':>6s} {'ops':>4s}  first break / backward error"
    )
    lines = [header, "-" * len(header)]
    t0 = time.perf_counter()
    for name in names:
        try:
            ex = explain(name, args.precision)
        except Exception as e:  # dynamo refused the trace: reported in the table
            why = " ".join(str(e).split())[:90]
            lines.append(
                f"{name:30s} {'error':>10s} {'-':>6s} {'-':>4s} {'-':>10s} {'-':>6s} {'-':>4s}  {why}"
            )
            print(lines[-1], flush=True)
            continue
        bwd = "-" if args.no_backward else backward_ok(name, args.precision)
        note = _first_reason(ex)
        if bwd not in ("-", "ok"):
            note, bwd = f"backward: {bwd}" + (f"; {note}" if note else ""), "fail"
        fla = ("-", "-", "-")
        if args.precision == "bf16":
            pass  # (no autocast on the meta device: the fla column is fp32's)
        elif _uses_fla(name):
            try:
                exf = explain(name, args.precision, "meta", "fla")
                fla = (str(exf.graph_count), str(exf.graph_break_count), str(_custom_ops(exf)))
            except Exception as e:  # reported in the table
                fla = ("error", type(e).__name__, "-")
        line = (
            f"{name:30s} {ex.graph_count:>10d} {ex.graph_break_count:>6d} {bwd:>4s} "
            f"{fla[0]:>10s} {fla[1]:>6s} {fla[2]:>4s}  {note}"
        )
        lines.append(line)
        print(line, flush=True)
    took = time.perf_counter() - t0
    cmd = "python scripts/graph_breaks.py" + (
        f" --precision {args.precision}" if args.precision != "fp32" else ""
    )
    head = [
        f"# {cmd} (torch {torch.__version__}, {torch.get_num_threads()} threads, {took:.0f} s wall)",
        f"# training forward + float32 cross-entropy, d_model {TINY['d_model']}, {TINY['n_layers']} layers, "
        f"batch {B}, T {T}, {args.precision}; cpu: auto backends; fla: meta device, use_backend('fla'),",
        "# the ops as custom ops mnemo::<op>_fla (ops = their nodes in the graphs); bwd: aot_eager backward",
    ]
    print(f"({took:.0f} s)")
    if args.out:
        args.out.write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()

"""Host syncs of every registered model, shown on the ``meta`` device (issue 36, item 3).

For each preset (d_model 32, 2 layers, vocabulary 64, batch 2, 40 tokens):

* ``fwd``, ``bwd``, ``prefill``, ``decode``: the step on plain ``meta`` (a value read raises);
* ``strict``: the same step under :class:`mnemo.testing.device_probe.StrictDeviceProbe` (no CPU
  tensor in a meta op, no mixed-dtype matmul, no host-to-device copy);
* ``meta syncs/step``: device reads of one :meth:`Trainer.train_step` (``grad_accum`` 2, seq 32)
  with the model on ``meta``, counted by :func:`~mnemo.testing.device_probe.host_reads` (each
  read answered with zeros so the step runs to its end); ``host``: reads of host data there (the
  batch's token count);
* ``cpu reads/step``: every value read of the same step on the CPU, and of those the ones made in
  the model's forward/backward (``model``: the ops' NaN/inf checks, the vocabulary check, the
  decay-dependent form choices, MoE slices), which were device syncs before this change.

    python scripts/meta_device_table.py [--out docs/benchmarks/meta_device.txt] [NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, build_config
from mnemo.models.registry import model_names
from mnemo.testing.device_probe import StrictDeviceProbe, host_reads
from mnemo.train import TrainConfig, Trainer

META = torch.device("meta")
TINY = {"d_model": 32, "n_layers": 2, "vocab_size": 64}
STAGES = ("fwd", "bwd", "prefill", "decode")


def run_step(name: str, strict: bool) -> tuple[dict[str, str], str]:
    """Pass/fail per stage of the meta step, and the first error (``""`` if none)."""
    with META:
        model = LanguageModel(build_config(name, **TINY))
    ids = torch.zeros(2, 40, dtype=torch.long, device=META)
    result = dict.fromkeys(STAGES, "-")
    stage = "fwd"
    try:
        with StrictDeviceProbe() if strict else contextlib.nullcontext():
            logits, _ = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            aux = model.aux_loss()
            result["fwd"], stage = "pass", "bwd"
            (loss if aux is None else loss + aux).backward()
            result["bwd"], stage = "pass", "prefill"
            model.eval()
            with torch.no_grad():
                _, state = model(ids)
                result["prefill"], stage = "pass", "decode"
                model(ids[:, -1:], state)
                result["decode"] = "pass"
        return result, ""
    except Exception as e:  # noqa: BLE001 - reported in the table
        result[stage] = "FAIL"
        return result, f"{name} {stage}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _trainer(name: str, out: str, device: torch.device) -> Trainer:
    cfg = TrainConfig(
        model=name,
        model_overrides={"d_model": 32, "n_layers": 2},
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        steps=4,
        sample_tokens=0,
    )
    with warnings.catch_warnings():  # (HOPE's slowest CMS level never steps in 32 tokens: fine here)
        warnings.simplefilter("ignore", UserWarning)
        tr = Trainer(cfg, out)
    if device == META:
        tr.model.to(META)
        tr.device = META
    return tr


def trainer_reads(name: str) -> tuple[int, int, int, int]:
    """``(meta syncs, meta host reads, cpu reads, cpu reads in the model)`` of the second step."""
    counts = []
    for device in (META, torch.device("cpu")):
        with tempfile.TemporaryDirectory() as out:
            tr = _trainer(name, out, device)
            with host_reads(answer_meta=device == META):  # the first step creates the optimizer state
                tr.train_step()
            with host_reads(answer_meta=device == META) as r:
                tr.train_step()
        in_model = sum(1 for _, _, where in r.sites if "/mnemo/train/" not in where)
        counts.append((r.syncs, r.host_reads, in_model))
    (m_sync, m_host, _), (_, c_reads, c_model) = counts
    return m_sync, m_host, c_reads, c_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="presets (default: every registered one)")
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    names = args.names or model_names()
    head = (
        f"{'preset':30s} {'fwd':5s} {'bwd':5s} {'prefill':7s} {'decode':6s} {'strict':6s} "
        f"{'meta syncs/step':>15s} {'host':>4s} {'cpu reads/step':>14s} {'model':>5s}"
    )
    lines, errors, totals = [head, "-" * len(head)], [], dict.fromkeys((*STAGES, "strict"), 0)
    t0 = time.perf_counter()
    for name in names:
        plain, err = run_step(name, strict=False)
        strict, serr = run_step(name, strict=True)
        ok_strict = "pass" if all(v == "pass" for v in strict.values()) else "FAIL"
        errors += [e for e in (err, serr) if e]
        for s in STAGES:
            totals[s] += plain[s] == "pass"
        totals["strict"] += ok_strict == "pass"
        m_sync, m_host, c_reads, c_model = trainer_reads(name)
        lines.append(
            f"{name:30s} {plain['fwd']:5s} {plain['bwd']:5s} {plain['prefill']:7s} {plain['decode']:6s} "
            f"{ok_strict:6s} {m_sync:15d} {m_host:4d} {c_reads:14d} {c_model:5d}"
        )
        print(lines[-1], flush=True)
    n = len(names)
    lines.append("-" * len(head))
    lines.append(
        "passed: "
        + ", ".join(f"{k} {v}/{n}" for k, v in totals.items())
        + f"  ({time.perf_counter() - t0:.0f} s)"
    )
    lines += errors
    print("\n".join(lines[-1 - len(errors) :]))
    if args.out:
        env = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        note = (
            "# meta syncs/step: device values the trainer step reads on meta (its one finite check);\n"
            "# host: reads of host data (the batch's token count). cpu reads/step: every value read\n"
            "# of the step on the CPU (unchanged by this work); model: those made in the forward and\n"
            "# backward (NaN/inf and vocabulary checks, decay-dependent form choices, MoE slices),\n"
            "# which the same step makes 0 of off the CPU; the rest: AdamW's per-parameter step\n"
            "# counts (CPU tensors on any device), the per-micro-batch loss and the gradient norm.\n"
        )
        args.out.write_text(
            f"# python scripts/meta_device_table.py ({env})\n" + note + "\n".join(lines) + "\n"
        )


if __name__ == "__main__":
    main()

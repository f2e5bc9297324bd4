"""Smoke tests of the measurement scripts whose numbers docs/benchmarks cites (never timed here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chunk_bound_prints_one_row_per_round_with_every_group(capsys):
    mod = _load("bench_chunk_bound")
    args = ["--length", "256", "--rounds", "2", "--repeats", "1", "--groups", "2,1"]
    assert mod.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.lstrip().startswith("round"))
    assert header.split()[-2:] == ["g1", "%peak"] and "g2" in header
    rows = [line.split() for line in out if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"]
    # peak, op ms, op %peak, products ms, products %peak, share, two group columns: all positive numbers
    assert all(len(r) == 9 and all(float(x) > 0 for x in r[1:]) for r in rows)
    # the counted work: 256 tokens, 4 heads of 64, chunk 64 -> 3 x (4 x (2*256*64*128 + 4*256*64*64)) flops
    assert "counted work 0.10 GFLOP (the twelve products: 0.10 GFLOP)" in out[1]


def test_gated_norm_bench_prints_both_gate_orders_and_a_model_row(capsys):
    mod = _load("bench_gated_norm")
    argv = ["--shape", "2x8x16", "--groups", "2", "--rounds", "2"]
    argv += ["--models", "mamba2", "--model-shape", "8x1"]
    assert mod.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("op ", "train step"))]
    assert [r.split()[2:5] for r in rows[:2]] == [["gate", "first", "g2"], ["gate", "after", "g2"]]
    assert rows[2].startswith("train step mamba2 8x1")
    # kernel ms, pytorch ms, ratio, then one ratio per round: positive numbers
    for r in rows:
        nums = [float(v) for v in r.split()[-5:]]
        assert len(nums) == 5 and all(v > 0 for v in nums)
    import mnemo.layers.norm as norm_mod

    assert norm_mod.gated_rms_norm is mod.FORMS["kernel"]  # the switch is put back


def test_strong_gates_bench_prints_every_form_and_restores_the_halving(capsys):
    """scripts/bench_strong_gates.py (docs/benchmarks/notes.md, "Strong gates and the chunk size"):
    one tiny round prints the five forms of each op and one model row; its "before" switch sends a
    call whose 64-token chunks decay past 30 nats to the fallback and "after" halves it to 32; the
    halving is back on when it returns."""
    import torch

    mod = _load("bench_strong_gates")
    argv = ["--rounds", "1", "--op-shape", "1x16x1x4", "--models", "gated_deltanet"]
    assert mod.main(argv + ["--model-sizes", "16x1x16x2"]) == 0
    out = capsys.readouterr().out.splitlines()
    forms = [line for line in out if line.startswith(("gated delta rule", "GLA"))]
    assert len(forms) == 10 and sum("autograd, chunk 64" in line for line in forms) == 2
    row = next(line for line in out if line.startswith("gated_deltanet"))
    assert all(float(v.rstrip("x")) > 0 for v in row.split()[-5:])
    g = torch.full((1, 128, 1), -0.6)  # 38.4 nats in 64 tokens, 19.2 in 32
    mod.halving(False)
    assert mod.dr.chunks_within_span(g, 64, torch.float32, 30.0) == (None, None)
    mod.halving(True)
    assert mod.dr.chunks_within_span(g, 64, torch.float32, 30.0)[0] == 32
    import mnemo.ops._chunked as chunked

    assert mod.dr.chunks_within_span is chunked.chunks_within_span
    assert mod.gla.chunks_within_span is chunked.chunks_within_span


def test_swiglu_bench_prints_the_op_and_a_model_row_and_restores_the_kernel(capsys):
    """scripts/bench_swiglu.py (docs/benchmarks/notes.md, "SwiGLU's gate"): one tiny round prints
    the op row and one training-step row with positive times; the kernel is switched back on."""
    import mnemo.layers.mlp as mlp

    mod = _load("bench_swiglu")
    argv = ["--rounds", "1", "--op-shape", "8x4", "--models", "gated_deltanet", "--model-sizes", "16x1x16x2"]
    assert mod.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("gate alone", "train step"))]
    assert len(rows) == 2 and rows[1].startswith("train step gated_deltanet d 16 x 1, 16 x 2")
    for r in rows:
        assert all(float(v.rstrip("x")) > 0 for v in r.split()[-3:])
    assert mlp.swiglu is mod._KERNEL and mlp.swiglu.__name__ == "swiglu"


def test_mla_decode_bench_prints_one_row_per_context_with_the_caches_bytes(capsys):
    import torch

    threads = torch.get_num_threads()
    mod = _load("bench_mla_decode")
    try:
        mod.main(
            ["--d-model", "32", "--n-heads", "2", "--contexts", "8,2000", "--rounds", "2", "--steps", "2"]
        )
    finally:
        torch.set_num_threads(threads)  # (the script sets its --threads)
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["8", "2000"]
    assert all(float(x) > 0 for r in rows for x in r[1:4])
    # the caches: MLA 2000 tokens x (d_c 64 + d_h^R 8) float32 (0.576 MB), attention 2000 x 2 x 32 (0.512)
    assert rows[1][4:] == ["0.6", "0.5"]

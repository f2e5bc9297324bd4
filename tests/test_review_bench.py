"""The benchmarks' arithmetic against hand counts and ``FlopCounterMode`` (the FLOPs of what the
timed code runs, the bytes a decode step reads)."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.bench import ops, roofline
from mnemo.models import LanguageModel, build_config


def _strong_gated_deltanet(build=roofline.build):
    """A one-layer gated DeltaNet whose gates decay by 29-32 nats in 64 tokens: the first row of the
    roofline's seeded ``[4, 64]`` batch fits one 64-token chunk, another row does not (so the batch
    runs at chunk 32)."""
    m = build("gated_deltanet", 16, 1)
    mix = m.blocks[0].mixer
    with torch.no_grad():
        mix.A_log.fill_(math.log(0.5))
        mix.dt_bias.zero_()
        mix.a_proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    return m


def test_roofline_counts_the_flops_of_the_batch_the_step_runs(monkeypatch):
    """The chunk forms halve their chunk while any row's gates decay too fast, so one row times B is
    not the batch's count (here 21.5 vs 17.5 MFLOP); the suite counts the step's own batch."""
    T, B = 64, 4
    m = _strong_gated_deltanet()
    opt = torch.optim.AdamW(m.parameters())
    one = roofline.count_flops(roofline.train_step_fn(m, opt, T, 1).forward_backward)[0]
    batch = roofline.count_flops(roofline.train_step_fn(m, opt, T, B).forward_backward)[0]
    assert batch != B * one  # the case this test is about
    build = roofline.build
    monkeypatch.setattr(roofline, "build", lambda name, d, n: _strong_gated_deltanet(build))
    r = roofline.run(
        ["gated_deltanet"], 16, 1, [(T, B)], [], context=8, repeats=1, profile=False, stream_elements=2**10
    )
    (row,) = r["train"]
    assert row["flops_fwd_bwd"] == batch == sum(row["flops_by_op"].values())


@pytest.mark.parametrize("batch", [1, 3])
def test_a_learned_position_table_is_read_for_one_row(batch):
    """Every row of a decode step is at the same position: the position table gives one row."""
    cfg = build_config("transformer_abs", vocab_size=64, d_model=16, n_layers=1, tie_embeddings=False)
    m = LanguageModel(cfg)
    assert m.pos_embed is not None and m.embed.weight is not m.lm_head.weight
    every = sum(p.numel() * 4 for p in m.parameters())
    emb, pos = m.embed.weight, m.pos_embed.weight
    expected = every - emb.numel() * 4 + batch * 16 * 4 - pos.numel() * 4 + 16 * 4
    assert roofline.weight_bytes_per_step(m, batch) == expected


@pytest.mark.parametrize(
    "name", ["linear_attention", "gla_scalar", "gla_channel", "gated_delta_rule", "kda", "ssd"]
)
def test_the_ops_suites_forward_flops_are_what_the_chunk_form_computes(name, monkeypatch):
    """``chunk_flops`` (the ``GFLOP/s`` and ``% peak`` columns, times 3 for forward + backward) equals
    the matmul work ``FlopCounterMode`` sees in the chunk form's forward. SSD's score matrix ``C Bᵀ``
    is one per group, not one per head (it was counted as GLA's per-head ``QKᵀ``: 1.23x too many at
    H = 4, D = 64). At the suite's default head dim 64 (the delta rule's count holds at D = C = 64
    only: its solves' products do not scale as ``2TCD``; not tested at other D). (Second review: that
    match was a coincidence, the delta rule's count now holds at every D with its C-kernel state pass
    run by the PyTorch twin the counter sees; tests/test_review2_bench_config.py.)"""
    import importlib

    from mnemo.ops import _chunked

    monkeypatch.setattr(
        importlib.import_module("mnemo.ops.delta_rule"), "scan_matrix", _chunked.scan_matrix_torch
    )
    (bench,) = [b for b in ops._registry() if b.name == name]
    for B, T, H, D in ((1, 128, 2, 64), (2, 256, 3, 64)):
        x = bench.make(B, T, H, D, "cpu")
        counted = roofline.count_flops(lambda x=x: bench.call(x, "chunk"))[0]
        assert bench.chunk_flops(B, T, H, D) == counted, (B, T, H, D)


@pytest.mark.parametrize("script", ["bench_python_vs_cli", "bench_workspace"])
def test_a_scripts_existing_json_is_refused_before_the_run(script, tmp_path, monkeypatch, capsys):
    """``--json`` at an existing file: refused at once (exit 2, nothing run), not replaced after the
    run; ``--overwrite`` is the way to replace it."""
    import importlib.util
    import subprocess
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    out.write_text("kept")

    def no_runs(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "run", no_runs)
    with pytest.raises(SystemExit) as e:
        mod.main(["--json", str(out), "--rounds", "1"])
    assert e.value.code == 2 and out.read_text() == "kept"
    assert "--overwrite" in capsys.readouterr().err

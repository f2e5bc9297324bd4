"""Small defects noticed in earlier reviews and left for later (session 35's note), each test failing
on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp.capacity import recall_accuracy
from mnemo.ops import ssd


def test_ssd_state_size_zero_names_b_and_c():
    # the error named q and k, arguments ssd does not have (it reached the GLA form's check)
    x, dt, A = torch.randn(1, 5, 2, 3), torch.rand(1, 5, 2), -torch.rand(2)
    B = C = torch.randn(1, 5, 1, 0)
    with pytest.raises(ValueError, match=r"B and C need a state size N >= 1, got B of shape \[1, 5, 1, 0\]"):
        ssd(x, dt, A, B, C)


@pytest.mark.parametrize("shape", [(1, 0, 1, 4), (1, 3, 1, 0)])
def test_recall_accuracy_without_pairs_or_channels_is_refused(shape):
    # an IndexError from amax() before
    with pytest.raises(ValueError, match=r"v: expected N >= 1 pairs and D >= 1 channels"):
        recall_accuracy(torch.randn(shape), torch.randn(shape))


def test_the_memory_check_counts_an_fsdp_process_its_shard_of_the_parameters(monkeypatch):
    # every process was counted the whole model's parameters, gradients and moments: a model that
    # fits only sharded was refused (the estimate is a lower bound, never a false alarm)
    from types import SimpleNamespace

    from mnemo.train import TrainConfig
    from mnemo.train import memory_estimate as me
    from mnemo.train.build import _count_parameters, build_model

    def cfg(fsdp):
        return TrainConfig(
            model="transformer", model_overrides={"d_model": 64, "n_layers": 2}, seq_len=8, batch_size=4,
            steps=1, eval_batches=1, warmup_steps=0, sample_tokens=0, fsdp=fsdp,
        )  # fmt: skip

    from mnemo.models import build_config

    whole = 4 * 4 * _count_parameters(build_config("transformer", vocab_size=16, d_model=64, n_layers=2))
    monkeypatch.setattr(me, "available_memory", lambda device: (int(0.6 * whole), "a test"))
    strategy = SimpleNamespace(device=torch.device("cpu"), world=4, prepare=lambda model: None)
    with pytest.raises(ValueError, match="the model's parameters \\+ optimizer state alone need"):
        build_model(cfg(False), 16, strategy)  # data-parallel: every process holds the whole model
    assert build_model(cfg(True), 16, strategy).num_parameters() * 16 == whole  # sharded: a quarter each


def test_a_resumed_moe_run_records_the_whole_intervals_expert_loads(tmp_path):
    # MoEBalance's interval was not checkpointed: after a resume in the middle of a logging interval
    # the record's moe_load / moe_aux_loss / moe_z_loss covered only the resumed steps
    import json

    from mnemo.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model="gated_deltanet_attention_moe", model_overrides={"d_model": 16, "n_layers": 1}, seq_len=16,
        batch_size=4, eval_batches=1, sample_tokens=0, warmup_steps=1, steps=6, eval_interval=3, seed=2,
    )  # fmt: skip
    Trainer(cfg, tmp_path / "a", progress=False, log=lambda *a: None).fit()
    Trainer(cfg, tmp_path / "b", progress=False, log=lambda *a: None).fit(until=2)
    Trainer(None, tmp_path / "b", resume=True, progress=False, log=lambda *a: None).fit(until=4)
    Trainer(None, tmp_path / "b", resume=True, progress=False, log=lambda *a: None).fit()

    def records(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rows]

    a, b = records("a"), records("b")
    assert [r["step"] for r in a] == [3, 6] and "moe_load" in a[0] and a[1]["moe_aux_loss"] > 0
    assert b == a


def test_generate_on_a_checkpoint_without_a_tokenizer_says_what_to_do(tmp_path, capsys):
    # it said only "checkpoint file missing: .../tokenizer.json" (a new user's report)
    from mnemo.cli import main
    from mnemo.models import LanguageModel, build_config

    LanguageModel(build_config("gla", vocab_size=32, d_model=16, n_layers=1)).save_pretrained(tmp_path / "m")
    assert main(["generate", "--checkpoint", str(tmp_path / "m"), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        "tokenizer.json" in err
        and f"copy the tokenizer.json of the model's source into {tmp_path / 'm'}" in err
    )


def test_the_state_space_parameters_are_kept_out_of_weight_decay(tmp_path):
    # Mamba's A_log [d_inner, N] is a matrix by ndim, so AdamW decayed it towards 0 (every state's
    # A = -exp(A_log) drifting to -1); mamba-ssm marks A_log and D _no_weight_decay
    from mnemo.models import LanguageModel, build_config
    from mnemo.train import TrainConfig
    from mnemo.train.optim import make_optimizer

    model = LanguageModel(build_config("mamba", vocab_size=16, d_model=16, n_layers=1))
    opt = make_optimizer(model, TrainConfig(lr=0.1, weight_decay=0.5))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    mixer = model.blocks[0].mixer
    assert mixer.A_log.ndim == 2 and id(mixer.A_log) not in decayed and id(mixer.D) not in decayed
    assert id(mixer.in_proj.weight) in decayed  # the projections still are
    # what it means: a step with no gradient leaves A_log as it was, and shrinks a projection by lr * wd
    before_A, before_W = mixer.A_log.detach().clone(), mixer.in_proj.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(mixer.A_log, before_A)
    torch.testing.assert_close(mixer.in_proj.weight, before_W * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)


def test_a_state_plot_redrawn_from_the_kept_json_is_the_reports(tmp_path):
    # the loss sweeps' published state plots were empty axes (fixed in the report); their databases
    # are not kept, so the figures are redrawn from the report's kept SWEEP.json
    import json

    import matplotlib.pyplot as plt

    from mnemo.sweep.report import cell_stats, plot_accuracy_vs_state, replot_state_from_summary
    from tests.tasks.test_review2_sweep_stats import _row

    rows = [_row(1e-3, s, 0.5, loss=v) for s, v in enumerate([2.1, 2.3, 2.2, 2.6])]
    rows += [_row(1e-3, s, 0.5, label="mamba", loss=v) for s, v in enumerate([1.1, 1.4, 1.2, 1.3])]
    cells = cell_stats(rows, "val_loss")
    summary = {"sweep": "s", "metric": "val_loss", "confidence": 0.95, "seeds": [0, 1, 2, 3], "cells": cells}
    (tmp_path / "s.json").write_text(json.dumps(summary))

    def drawn(fig):  # the title and each line's points (the means: marker "o"; the caps: "_")
        ax = fig.axes[0]
        lines = sorted((l.get_marker(), tuple(l.get_xdata()), tuple(l.get_ydata())) for l in ax.lines)
        return ax.get_title(), lines

    title = "s: val_loss vs state size (mean over seeds, bars: 95% CI)"
    _, a = plot_accuracy_vs_state(rows, tmp_path / "a.png", "val_loss", title, return_figure=True)
    _, b = plot_accuracy_vs_state([], tmp_path / "b.png", "val_loss", title, stats=cells, return_figure=True)
    try:
        assert drawn(a) == drawn(b)
        means = sorted(y for m, _, ys in drawn(a)[1] if m == "o" for y in ys)
        assert means == [pytest.approx(1.25), pytest.approx(2.3)]
    finally:
        plt.close(a)
        plt.close(b)
    assert replot_state_from_summary(tmp_path / "s.json", tmp_path / "c.png") == tmp_path / "c.png"
    assert (tmp_path / "c.png").read_bytes() == (tmp_path / "b.png").read_bytes()


@pytest.mark.parametrize("N", [0, 1, 2])
def test_a_packed_short_convolution_shorter_than_its_kernel(N):
    # x[:, :N - lag] with N < lag kept elements (a negative stop), and the shapes no longer matched
    from mnemo.layers.conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(3, 4).double()
    x = torch.randn(1, N, 3, dtype=torch.float64)
    y = conv.forward_packed(x, torch.tensor([0, N]))
    torch.testing.assert_close(y, conv(x)[0], rtol=0, atol=1e-12)  # one document = the plain call

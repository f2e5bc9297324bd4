"""Break-it review of ``mnemo continual`` (:mod:`mnemo.commands.continual`) and the task-signal
model wrapper (:mod:`mnemo.models.task_signal`): each test pins a defect found in review."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import mnemo.commands.continual as cont
from mnemo.bench import dumps_json
from mnemo.models import LanguageModel, build_config

V, D = 23, 16


def _task_model(periods):
    torch.manual_seed(0)
    levels = [{"period": p, "objective": "task", "partial": "carry"} for p in periods]
    cfg = build_config("hope_attention", vocab_size=V, d_model=D, n_layers=2, mlp_options={"levels": levels})
    return LanguageModel(cfg).double()


def _ids(B, T, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# task_signal


def test_int32_ids_run_a_task_signal_model_as_long_ids_do():
    """``LanguageModel.forward`` accepts int32 ids; with task levels the segment's next-token loss
    took them as cross-entropy targets and raised (``expected target dtype to be Long``)."""
    m = _task_model((2, 4))
    ids = _ids(2, 7)
    with torch.no_grad():
        ref, _ = m(ids)
        whole, _ = m(ids.int())
        head, st = m(ids[:, :3].int())
        tail, _ = m(ids[:, 3:].int(), st)  # the replayed segment's labels are int32 too
    torch.testing.assert_close(whole, ref)
    torch.testing.assert_close(torch.cat([head, tail], 1), ref)


def test_a_pending_segment_longer_than_the_models_segment_is_refused_not_looped_on():
    """A state from a model with longer segments (here S = 4 against S = 2): its pending segment is
    longer than S, and ``_segments`` stepped ``t`` backwards forever (reads counted: the loop is
    stopped after 50)."""
    m, other = _task_model((2, 4)), _task_model((4, 8))
    with torch.no_grad():
        _, st = other(_ids(2, 7))  # its pending segment holds 3 tokens: more than this model's S = 2
    reads, forward = [0], m._forward

    def counted(*a, **k):
        reads[0] += 1
        if reads[0] > 50:
            raise RuntimeError("endless loop: more than 50 reads for a 3-token call")
        return forward(*a, **k)

    m._forward = counted
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"state: the pending segment.*n <= 2 .*got \[2, 3\]"),
    ):
        m(_ids(2, 3, seed=2), st)


def test_a_state_of_another_batch_size_is_refused_naming_the_state():
    """A complete pending segment of batch 2 joined to a batch-3 call: a raw ``torch.cat`` error."""
    m = _task_model((2, 4))
    with torch.no_grad():
        _, st = m(_ids(2, 6))  # the last segment (2 tokens) is complete, waiting for its label
        with pytest.raises(ValueError, match=r"state: the pending segment.*B = 3 .*got \[2, 2\]"):
            m(_ids(3, 3), st)


# --------------------------------------------------------------------------------------------
# continual: metrics and summaries


def test_a_metric_with_no_queries_is_nan_not_zero_accuracy():
    """forgetting_mqar with every key reassigned (``m == n``, valid) has no untouched query, and an
    abab evaluation of one stream has no baseline (``A_before_B``) query: both were reported 0.0."""
    levels = cont.model_specs(8, periods=(1,))["cms-1"]
    task = cont.make_task("forgetting_mqar", n=4, m=4, n_keys=8)
    torch.manual_seed(0)
    net = cont.ContinualNet(task.vocab_size, 8, levels)
    acc = cont.evaluate(net, task, torch.Generator().manual_seed(0), 4, 64)
    assert math.isnan(acc["untouched"]) and math.isfinite(acc["reassigned"])
    task = cont.make_task("abab", n_keys=8, n_a=2, n_b=6)
    net = cont.ContinualNet(task.vocab_size, 8, levels)
    acc = cont.evaluate(net, task, torch.Generator().manual_seed(0), 1, 64)
    assert math.isnan(acc["A_before_B"]) and math.isfinite(acc["A_after_B"])
    assert math.isnan(cont._derived("abab", task, acc)["forgetting"])


def _result(seed, value, loss, diverged=None):
    nan = float("nan")
    return {
        "seed": seed,
        "A_after_B": nan if diverged else value,
        "B": nan if diverged else 0.5,
        "A_before_B": nan if diverged else 0.9,
        "forgetting": nan if diverged else 0.9 - value,
        "final_train_loss": loss,  # a diverged run's loss before it stopped: finite
        "loss_fall_last_fifth": 0.1,
        "diverged_at_step": diverged,
        "wall_s": 0.0,
        "loss_curve": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": loss}],
        "lr": 1e-2,
    }


def test_the_summary_leaves_diverged_seeds_out_of_every_metric(monkeypatch):
    """A seed that diverged at step 52 of 1,500 has no reported metrics, but its training loss up to
    the divergence was averaged with the finished runs' (docs/results/continual_64keys: cms-3's
    final train loss 1.922 ± 3.779 over seed 0's 0.166 and two runs stopped at steps 52 and 84)."""
    runs = {0: _result(0, 0.9, 0.2), 1: _result(1, 0.8, 2.8, diverged=52), 2: _result(2, 0.7, 0.4)}
    monkeypatch.setattr(cont, "train_one", lambda exp, task, levels, s, seed, bar=None: runs[seed])
    s = cont.Settings(steps=2, periods=(1, 4), task={"n_keys": 8, "n_a": 2, "n_b": 6})
    r = cont.run_experiment("abab", 3, s, False, ["cms-1"], 1)
    summary = r["models"]["cms-1"]["summary"]
    for m in ("final_train_loss", "loss_fall_last_fifth", "A_after_B"):
        assert summary[m]["n"] == 2 and summary[m]["dropped"] == 1, m
    assert summary["final_train_loss"]["mean"] == pytest.approx(0.3)
    assert "2.800" not in cont.table(r).split("| cms-1 |")[1].split("\n")[0]


# --------------------------------------------------------------------------------------------
# continual: the run cache


def test_the_run_key_covers_the_outer_optimizers_defaults(monkeypatch):
    """``train_one`` takes AdamW's betas, the schedule's floor (``min_lr_ratio``) and M3's betas from
    :class:`~mnemo.train.config.TrainConfig`'s defaults (``train/config.py``); a change there
    changes every run's numbers, so it must change the kept runs' key."""
    before = cont._source_md5()
    read = Path.read_bytes

    def edited(self):
        data = read(self)
        return data + b"\n# edited" if self.as_posix().endswith("mnemo/train/config.py") else data

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert cont._source_md5() != before


def test_force_retrains_this_calls_runs_and_keeps_other_models_runs(monkeypatch, tmp_path):
    """``fresh`` (``--force``) deleted every kept run of the experiment, those of models (and seeds)
    the call does not train included: ``--force --models wide-1`` wiped hours of other runs."""
    calls = []

    def fake_train(experiment, task, levels, s, seed, bar=None):
        calls.append((len(levels), seed))
        return _result(seed, 0.5, 1.0)

    monkeypatch.setattr(cont, "train_one", fake_train)
    s = cont.Settings(steps=2, periods=(1, 4), task={"n_keys": 8, "n_a": 2, "n_b": 6})

    def go(models, fresh=False):
        return cont.run_experiment("abab", 2, s, False, models, 1, cache_dir=tmp_path, fresh=fresh)

    go(["cms-1", "cms-2"])
    kept = sorted(p.name for p in (tmp_path / "abab").glob("cms-2-*.json"))
    assert len(kept) == 2 and len(calls) == 4
    calls.clear()
    go(["cms-1"], fresh=True)
    assert calls == [(1, 0), (1, 1)]  # this call's runs train again
    assert sorted(p.name for p in (tmp_path / "abab").glob("cms-2-*.json")) == kept
    calls.clear()
    go(["cms-1", "cms-2"])
    assert calls == []  # every run is kept


def test_the_run_key_leaves_out_settings_that_reach_a_run_through_its_levels_or_task():
    """``cms-1``'s levels are the same under ``--periods 1,4`` and ``1,4,16``, and ``--task n_keys=32``
    is abab's default: the same run, which was keyed (and trained) again; settings the training
    reads still change the key."""
    task = cont.make_task("abab")
    s = cont.Settings(periods=(1, 4))
    levels = cont.model_specs(16, periods=(1, 4))["cms-1"]
    assert levels == cont.model_specs(16, periods=(1, 4, 16))["cms-1"]

    def key(**changes):
        return cont.run_key("abab", "cms-1", task, levels, dataclasses.replace(s, **changes), 0, "src")

    same = [key(periods=(1, 4, 16)), key(task={"n_keys": 32}), key(warmup=500, steps=200)]
    assert same == [key(), key(), key(warmup=200, steps=200)]
    assert len({key(), key(lr=3e-2), key(steps=201), key(d_model=8), key(optimizer="m3")}) == 5
    assert key(optimizer="m3", m3_eps=0.1) != key(optimizer="m3")


def test_class_incremental_just_after_holds_the_last_phases_own_queries():
    """``just_after`` (per seed) took ``R[P, P]``, the final block's value, for the last phase, not
    the queries right after it (tag ``just_after_{P-1}``)."""
    task = cont.make_task("class_incremental", phases=2)
    acc = {"just_after_0": 0.9, "just_after_1": 0.8, "final_0": 0.5, "final_1": 0.7}
    d = cont._derived("class_incremental", task, acc)
    assert d["just_after"] == [0.9, 0.8] and d["final"] == [0.5, 0.7]
    assert d["avg_acc"] == pytest.approx(0.6) and d["BWT"] == pytest.approx(0.5 - 0.9)


def test_a_last_step_that_leaves_non_finite_weights_is_a_divergence(monkeypatch):
    """A finite loss with a non-finite gradient at the last step: the weights the evaluation reads
    are NaN (every prediction token 0, recall 0.000), and the run was reported as finished. Now a
    divergence at that step, whose ``metrics_at_divergence`` evaluate the last finite weights (as
    the docstring promises; the first fix evaluated the NaN ones)."""
    clip, calls, finite = torch.nn.utils.clip_grad_norm_, [0], []

    def nan_at_the_last_step(params, max_norm):
        params = list(params)
        calls[0] += 1
        if calls[0] == 2:  # before the last update: the weights the first one left
            finite.extend(p.detach().clone() for p in params)
            for p in params:
                p.grad.fill_(float("nan"))
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_at_the_last_step)
    s = cont.Settings(steps=2, warmup=1, eval_streams=8, d_model=8, periods=(1,))
    s.task = {"n_keys": 8, "n_a": 2, "n_b": 6}
    task = cont.make_task("abab", **s.task)
    levels = cont.model_specs(8, periods=(1,))["cms-1"]
    r = cont.train_one("abab", task, levels, s, 0)
    assert r["diverged_at_step"] == 2 and math.isnan(r["A_after_B"])
    torch.manual_seed(0)
    net = cont.ContinualNet(task.vocab_size, s.d_model, levels, 0, s.slow_rate_lr_scale)
    assert len(finite) == len(list(net.parameters()))
    with torch.no_grad():
        for p, q in zip(net.parameters(), finite):
            p.copy_(q)
    want = cont._derived("abab", task, cont.evaluate(net, task, torch.Generator().manual_seed(10_000), 8, 64))
    assert r["metrics_at_divergence"] == want


def test_a_pages_block_summarises_the_stored_seeds_again(monkeypatch, tmp_path):
    """``mnemo reproduce --no-run`` rebuilt a page's table from the stored summaries, so a
    ``continual.json`` written before the fix kept showing the diverged seeds' training loss."""

    runs = {0: _result(0, 0.9, 0.2), 1: _result(1, 0.8, 2.8, diverged=52), 2: _result(2, 0.7, 0.4)}
    monkeypatch.setattr(cont, "train_one", lambda exp, task, levels, s, seed, bar=None: runs[seed])
    s = cont.Settings(steps=2, periods=(1, 4), task={"n_keys": 8, "n_a": 2, "n_b": 6})
    r = cont.run_experiment("abab", 3, s, False, ["cms-1"], 1)
    old = r["models"]["cms-1"]["summary"]["final_train_loss"]
    old.update(cont.mean_ci95([0.2, 2.8, 0.4]), values=[0.2, 2.8, 0.4])  # as the code wrote it
    (tmp_path / "continual.json").write_text(dumps_json({"experiments": {"abab": r}}))
    page = tmp_path / "page.md"
    page.write_text("")
    job = {"out": tmp_path, "experiments": ("abab",), "argv": ["--experiment", "abab"]}
    block = cont.page_block(page, job, train=False)
    row = block.split("| cms-1 |")[1].split("\n")[0]
    assert "1.133" not in row and "0.300 ± " in row and "(n=2)" in row


def test_an_unknown_experiment_or_no_seeds_is_refused_by_name():
    """``run_experiment("nosuch")`` and ``run(("nosuch",))`` raised a bare ``KeyError: 'nosuch'``;
    ``run_experiment(seeds=0)`` returned models with no seeds."""
    s = cont.Settings(steps=1, periods=(1,), task={"n_keys": 8, "n_a": 2, "n_b": 6}, eval_streams=2)
    with pytest.raises(ValueError, match=r"experiment: expected one of .*abab.*got \['nosuch'\]"):
        cont.run_experiment("nosuch", progress=False)
    with pytest.raises(ValueError, match=r"experiment: expected one of .*got \['nosuch'\]"):
        cont.run(("nosuch",), 1, progress=False)
    for seeds in (0, -1):
        with pytest.raises(ValueError, match=f"seeds: expected an int >= 1, got {seeds}"):
            cont.run_experiment("abab", seeds, s, False, ["cms-1"])

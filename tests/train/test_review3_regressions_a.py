"""Third review, regressions of the second review's fixes (training loop, optimizer, states):
a Mamba-1 run checkpointed before ``no_weight_decay`` moved its 2-D ``A_log`` out of the decayed
group still resumes (single-file and DCP shards) and trains as it was trained; a timm-style
``no_weight_decay()`` method is read, not iterated; FSDP's memory check still refuses a model whose
whole weights, built on each process before sharding, do not fit; a second ``fit()`` of the same
trainer keeps its own log; ``state.to`` still takes every argument ``Tensor.to`` takes (``copy=``,
``memory_format=``)."""

from __future__ import annotations

import json
import warnings
from unittest import mock

import pytest
import torch

import mnemo.train.memory_estimate as memory_estimate
import mnemo.train.optim as optim
from mnemo.layers import state as states
from mnemo.models import build_config
from mnemo.train import TrainConfig, Trainer
from mnemo.train.build import _count_parameters, build_model
from mnemo.train.strategy import Strategy

MAMBA = dict(
    model="mamba",
    model_overrides={"d_model": 16, "n_layers": 2},
    seq_len=16,
    batch_size=4,
    eval_batches=1,
    sample_tokens=0,
    warmup_steps=1,
    steps=4,
    eval_interval=2,
    seed=5,
    weight_decay=0.5,  # large: a decayed A_log moves visibly in one step
)


def _trainer(out, **kw):
    return Trainer(TrainConfig.from_dict(MAMBA), out, progress=False, log=lambda *a: None, **kw)


def test_a_mamba_run_checkpointed_before_no_weight_decay_resumes_as_it_was_trained(tmp_path):
    """make_optimizer moved Mamba-1's 2-D A_log from the decayed group to the other one: a run
    checkpointed before (its saved groups of other sizes) no longer resumed (optimizer
    load_state_dict: "loaded state dict contains a parameter group that doesn't match the size of
    optimizer's group"). It resumes, with A_log decayed as its first steps were, so the resumed
    run equals the uninterrupted one that the older code trained."""
    before = lambda model: set()  # noqa: E731  (the grouping before no_weight_decay was read)
    with mock.patch.object(optim, "_no_weight_decay", before):
        whole = _trainer(tmp_path / "whole")
        whole.fit()
        old = _trainer(tmp_path / "old")
        old.fit(until=2)
    with pytest.warns(UserWarning, match="no_weight_decay"):
        resumed = _trainer(tmp_path / "old", resume=True)
    assert resumed.step == 2
    resumed.fit()
    for (name, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    # a new run keeps A_log out of weight decay (the fix it undoes only for old checkpoints)
    new = _trainer(tmp_path / "new")
    a_log = {id(m.A_log) for m in new.model.modules() if type(m).__name__ == "Mamba"}
    assert len(a_log) == 2
    for g in new.optimizer.param_groups:
        held = {id(p) for p in g["params"]} & a_log
        assert not held or g["weight_decay"] == 0.0


class _FakeSharded(Strategy):
    """A stand-in for 8 FSDP processes on the CPU: build_model's memory checks only."""

    name = "fake fsdp"

    def __init__(self):
        self.device, self.world, self.rank = torch.device("cpu"), 8, 0
        self.prepared = False

    def prepare(self, model) -> None:
        self.prepared = True


def test_fsdp_memory_check_counts_the_whole_model_built_before_sharding(monkeypatch):
    """build_model counted each FSDP process 1/world of the parameters, gradients and moments, but
    it builds the whole model on every process's device before strategy.prepare shards it: with 8
    processes 16/8 = 2 bytes per parameter passed the check while the whole fp32 weights (4 bytes
    per parameter) did not fit, and the run ran out of memory in .to(device) instead of being
    refused by name."""
    over = {"d_model": 128, "n_layers": 4}
    cfg = TrainConfig.from_dict({**MAMBA, "model": "gla", "model_overrides": over, "fsdp": True})

    n = _count_parameters(build_config(cfg.model, vocab_size=256, **cfg.model_overrides))
    assert n > 500_000  # (the batch and evaluation logits: ~0.13 MB)
    have = 3 * n  # bytes: more than the shard's 16 n / 8 (+ the small batch), less than 4 n whole
    monkeypatch.setattr(memory_estimate, "available_memory", lambda device: (have, "a test's number"))
    strategy = _FakeSharded()
    with pytest.raises(ValueError, match="fsdp") as e:
        build_model(cfg, 256, strategy)
    assert f"{have / 1024**3:,.1f} GiB" in str(e.value) and not strategy.prepared
    # with room for the whole weights (and the shard's step) the run is let through, as before
    monkeypatch.setattr(memory_estimate, "available_memory", lambda device: (100 * n, "a test's number"))
    build_model(cfg, 256, strategy)
    assert strategy.prepared


def test_state_to_takes_copy_and_memory_format_as_tensor_to_does():
    """state.to parsed its arguments with torch._C._nn._parse_to, which refuses ``copy=`` (".to()
    does not accept copy argument") and drops ``memory_format``: ``states.to(s, "cpu",
    copy=True)``, a copy as Tensor.to makes it, raised; it copies (integer entries too)."""
    x = torch.randn(2, 3, 4, 5)
    ids = torch.tensor([3, 4])
    s = {"x": x, "ids": ids, "again": x}
    out = states.to(s, "cpu", copy=True)
    assert torch.equal(out["x"], x) and out["x"].data_ptr() != x.data_ptr()
    assert torch.equal(out["ids"], ids) and out["ids"].data_ptr() != ids.data_ptr()
    assert out["again"] is out["x"]  # (still shared once)
    out = states.to(s, torch.float64, copy=True)
    assert out["x"].dtype == torch.float64 and out["ids"].dtype == torch.int64
    assert out["ids"].data_ptr() != ids.data_ptr()
    out = states.to({"x": x}, memory_format=torch.channels_last)  # (4-D tensors only, as Tensor.to)
    assert out["x"].is_contiguous(memory_format=torch.channels_last) and torch.equal(out["x"], x)
    # the forms that worked keep working: no copy without copy=True
    assert states.to(s, "cpu")["x"] is x
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert states.to(s, x.to(torch.float16))["x"].dtype == torch.float16


def test_a_second_fit_of_the_same_trainer_keeps_its_own_log(tmp_path):
    """fit() set aside the metrics.jsonl of "a run that wrote no checkpoint" whenever the trainer
    had none, also on a second fit() of the same trainer (a sink that failed at step 2, before the
    step-4 checkpoint, and the call retried): the trainer's own step-2 record went to
    kept/unfinished-1/ and its log read 4 alone. A log is set aside only before the first step."""
    failed = []

    class Flaky:  # a logger that fails once (a network error, say)
        def log(self, record):
            if not failed:
                failed.append(record["step"])
                raise RuntimeError("the logging service is down")

        def close(self):
            pass

    cfg = TrainConfig.from_dict({**MAMBA, "model": "gla", "checkpoint_interval": 4})
    t = Trainer(cfg, tmp_path, progress=False, log=lambda *a: None, sinks=[Flaky()])
    with pytest.raises(RuntimeError, match="logging service"):
        t.fit()
    assert failed == [2] and t.step == 2 and t.last_checkpoint is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "run that wrote no checkpoint" warning)
        t.fit()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4] and not (tmp_path / "kept").exists()


def test_make_optimizer_reads_a_timm_style_no_weight_decay_method():
    """_no_weight_decay iterated getattr(module, "no_weight_decay", ()): a module with a
    ``no_weight_decay()`` method (timm's convention: the names of its parameters kept out of weight
    decay) made make_optimizer raise TypeError ("'method' object is not iterable"), a model that
    built its optimizer before. The method is called; a single name given as a string is one name,
    not its letters."""

    class Timm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_embed = torch.nn.Parameter(torch.zeros(4, 8))
            self.proj = torch.nn.Linear(8, 8)

        def no_weight_decay(self):
            return {"pos_embed"}

    class Named(torch.nn.Module):
        no_weight_decay = "table"

        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(4, 8))
            self.other = torch.nn.Parameter(torch.zeros(4, 8))

    model = torch.nn.ModuleDict({"a": Timm(), "b": Named()})
    cfg = TrainConfig.from_dict({"weight_decay": 0.1})
    opt = optim.make_optimizer(model, cfg)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    assert decayed == {id(model["a"].proj.weight), id(model["b"].other)}


def test_a_sharded_mamba_checkpoint_of_the_older_groups_loads_whole_groups(tmp_path):
    """load_sharded into make_optimizer's new groups from DCP shards written with the older ones
    (A_log decayed) left the first group without its hyperparameters (no lr, weight_decay, betas:
    a KeyError at the first step, and consolidate_checkpoint wrote that group out). The groups take
    the saved ones, every parameter's moments where they were."""
    import torch.distributed.checkpoint as dcp

    from mnemo.models import LanguageModel
    from mnemo.train.sharded import SHARDED_DIR, _state_dicts, load_sharded

    cfg = TrainConfig.from_dict(MAMBA)
    model_cfg = build_config("mamba", vocab_size=64, d_model=16, n_layers=2)
    torch.manual_seed(0)
    model = LanguageModel(model_cfg)
    with mock.patch.object(optim, "_no_weight_decay", lambda model: set()):
        opt = optim.make_optimizer(model, cfg)
    model(torch.randint(0, 64, (2, 8)))[0].float().square().mean().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process without a group)
        dcp.save(_state_dicts(model, opt), checkpoint_id=str(tmp_path / SHARDED_DIR))
    model2 = LanguageModel(model_cfg)
    opt2 = optim.make_optimizer(model2, cfg)
    with pytest.warns(UserWarning, match="A_log"):
        load_sharded(tmp_path, model2, opt2)
    name1 = {id(p): n for n, p in model.named_parameters()}
    name2 = {id(p): n for n, p in model2.named_parameters()}
    for g, g2 in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
        assert [name1[id(p)] for p in g["params"]] == [name2[id(p)] for p in g2["params"]]
    for (n, p), (_, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[p2]["exp_avg"]), n

"""Data-parallel training on 2 gloo processes equals the single-process run; gradient accumulation and
activation checkpointing change nothing but memory; bad splits of the batch name the field."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, MQAR, TASKS, make_generator
from mnemo.models import LanguageModel, build_config
from mnemo.train import TrainConfig, Trainer, TrainingDiverged
from tests.helpers import free_port, join_as_torchrun, spawn

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5


@dataclass
class RaggedMQAR(MQAR):
    """MQAR with about half of the queries unsupervised at random (row 0 keeps all of its): the
    ranks' shares of a batch hold different numbers of supervised tokens. Test-only."""

    name = "mqar_ragged"

    def _generate(self, B, T, gen):
        x, y = super()._generate(B, T, gen)
        drop = torch.rand(y.shape, generator=gen) < 0.5
        drop[0] = False
        return x, y.masked_fill(drop, IGNORE_INDEX)


def _text_cfg(**kw) -> TrainConfig:
    base = dict(
        model="transformer",
        model_overrides={"d_model": 16, "n_layers": 2},
        seq_len=16,
        batch_size=4,
        steps=6,
        eval_interval=2,
        eval_batches=2,
        warmup_steps=2,
        sample_tokens=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def _task_cfg(**kw) -> TrainConfig:
    base = dict(
        model="gla",
        model_overrides={"d_model": 16, "n_layers": 2},
        task="mqar_ragged",
        task_options={"vocab_size": 32, "num_pairs": 4},
        seq_len=16,
        batch_size=4,
        steps=6,
        eval_interval=2,
        eval_batches=2,
        warmup_steps=2,
    )
    base.update(kw)
    return TrainConfig(**base)


def _hope_cfg(**kw) -> TrainConfig:
    return _text_cfg(model="hope", seq_len=32, steps=4, eval_batches=1, **kw)


def _moe_cfg(**kw) -> TrainConfig:
    """A MoE hybrid with load-balance, z and sequence-wise (DeepSeek-V3) losses and bias balancing
    (global counts)."""
    opts = {"n_experts": 4, "top_k": 2, "expert_hidden": 8, "aux_loss_coef": 0.1, "z_loss_coef": 0.01,
            "seq_aux_loss_coef": 0.01, "bias_balancing": True, "bias_update_rate": 0.01}  # fmt: skip
    pattern = ["gated_deltanet", "attention"]
    overrides = {"d_model": 16, "n_layers": 2, "pattern": pattern, "mlp_options": opts}
    return _text_cfg(model="gated_deltanet_attention_moe", model_overrides=overrides, steps=4, **kw)


@pytest.fixture(scope="module", autouse=True)
def _ragged_task():
    TASKS[RaggedMQAR.name] = RaggedMQAR
    yield
    TASKS.pop(RaggedMQAR.name, None)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_losses(got: list[dict], want: list[dict], keys=("train_loss", "val_loss")) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for k in keys:
            assert g[k] == pytest.approx(w[k], rel=RTOL), (g["step"], k, g[k], w[k])


# ------------------------------------------------------------------------------------------------
# two processes: the task run (mp.spawn, Trainer API) and the text run (torchrun + the CLI)
# ------------------------------------------------------------------------------------------------


def _worker(rank, world, port, out):
    join_as_torchrun(rank, world, port)
    TASKS[RaggedMQAR.name] = RaggedMQAR
    from mnemo.train.distributed import cleanup

    try:
        # unequal supervised counts per rank, 2 micro-batches of 1 row per rank and step
        Trainer(_task_cfg(grad_accum=2), Path(out) / "task", progress=False).fit()
        # a text run interrupted after step 3 (a checkpoint there), resumed in one process below
        Trainer(_text_cfg(), Path(out) / "partial", progress=False).fit(until=3)
        # HOPE: parameters that feed only the state, not the loss (DDP must not wait for them)
        Trainer(
            _hope_cfg(grad_accum=2, activation_checkpointing=True), Path(out) / "hope", progress=False
        ).fit()
        # MoE: each rank's auxiliary losses on its rows, the expert-bias step on the global counts
        Trainer(_moe_cfg(), Path(out) / "moe", progress=False).fit()
        # a NaN loss on one rank only stops every rank (no rank left waiting in a collective)
        tr = Trainer(_text_cfg(), Path(out) / "nan", progress=False)
        tr.train_step()
        if rank == 1:
            with torch.no_grad():
                tr.model.embed.weight.fill_(float("nan"))
        try:
            tr.train_step()
        except TrainingDiverged as e:
            (Path(out) / f"diverged{rank}.txt").write_text(str(e))
    finally:
        cleanup()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    spawn(_worker, (2, free_port(), str(out)), 2, start_method="forkserver")
    return out


@pytest.fixture(scope="module")
def torchrun_text(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_cli") / "run"
    cfg = _text_cfg()
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "mnemo", "train", "--model", cfg.model, "--d-model", "16", "--n-layers", "2",
        "--seq-len", "16", "--batch-size", "4", "--steps", "6", "--eval-interval", "2",
        "--eval-batches", "2", "--warmup-steps", "2", "--sample-tokens", "0",
        "--no-progress", "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


@pytest.fixture(scope="module")
def single_text(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single_text")
    Trainer(_text_cfg(), out, progress=False).fit()
    return out


def test_two_processes_equal_one_on_text_via_torchrun(torchrun_text, single_text):
    out, stdout = torchrun_text
    got = _metrics(out)
    _assert_same_losses(got, _metrics(single_text))  # also: rank 0 alone wrote metrics.jsonl
    assert stdout.count("mnemo train: model transformer") == 1, stdout  # rank 0 alone prints
    assert "(2 processes x 2 sequences)" in stdout
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000006"]
    assert all(r["tokens_per_s"] > 0 for r in got)


def test_two_processes_with_unequal_supervised_counts_equal_one(spawned, tmp_path):
    cfg = _task_cfg()
    # the ranks' halves of the first global batch hold different numbers of supervised tokens
    _, y = cfg.build_task().generate(cfg.batch_size, cfg.seq_len, make_generator(cfg.seed, "train"))
    counts = (y != IGNORE_INDEX).sum(1)
    assert counts[:2].sum() != counts[2:].sum()
    Trainer(cfg, tmp_path, progress=False).fit()  # one process, no accumulation
    _assert_same_losses(_metrics(spawned / "task"), _metrics(tmp_path), ("train_loss", "val_loss", "val_acc"))


def test_two_processes_train_a_model_with_parameters_unused_by_the_loss(spawned, tmp_path):
    # at seq_len 32 the period-32 CMS levels never step inside a window: their parameters get no
    # gradient (what this test needs), and the trainer says so
    with pytest.warns(UserWarning, match="CMS level 2 has period 32 >= the window of 32 tokens"):
        Trainer(_hope_cfg(), tmp_path, progress=False).fit()
    _assert_same_losses(_metrics(spawned / "hope"), _metrics(tmp_path))


def test_two_processes_train_moe_like_one_process_with_two_micro_batches(spawned, tmp_path):
    """The auxiliary losses are means over micro-batches and ranks (per-rank rows = per-micro-batch
    rows), and the balancing bias steps on the global counts: 2 ranks x 1 micro-batch equals
    1 process x 2 micro-batches, losses, loads and biases.

    ``moe_seq_aux_loss`` too: ``MoEBalance.after_step`` all-reduces (sums) every rank's per-layer
    ``L_seq`` sums and ``record`` divides by the micro-batches x ranks of the interval and the
    layers, so rank 0 logs the mean over both ranks' rows, as the one process does over its two
    micro-batches (measured: equal to the last bit; ``RTOL`` as for the other losses). Rank 0's
    own rows alone (the one process's first micro-batches) give a value off by 3.4e-4 and 6.2e-4
    (relative, steps 2 and 4): the comparison would catch a metric left unreduced."""
    tr = Trainer(_moe_cfg(grad_accum=2), tmp_path, progress=False)
    seq: list[list[float]] = []  # per training micro-batch: each MoE layer's L_seq

    def capture(module, args, output):
        if module.training:
            if module is first:
                seq.append([])
            seq[-1].append(module.last_seq_aux_loss.item())

    first = next(m for _, m in tr.model.moe_layers())
    for _, m in tr.model.moe_layers():
        m.register_forward_hook(capture)
    tr.fit()
    keys = ("train_loss", "val_loss", "moe_aux_loss", "moe_z_loss", "moe_seq_aux_loss")
    want = _metrics(tmp_path)
    _assert_same_losses(_metrics(spawned / "moe"), want, (*keys, "moe_load_max", "moe_load_min"))
    # 2 intervals of 2 steps of 2 micro-batches; rank 0's rows are each step's first micro-batch
    assert [len(s) for s in seq] == [2] * 8 and [r["step"] for r in want] == [2, 4]
    for r, interval in zip(want, (seq[:4], seq[4:])):
        assert r["moe_seq_aux_loss"] == pytest.approx(sum(map(sum, interval)) / 8, rel=1e-12)
        rank0 = sum(map(sum, interval[::2])) / 4
        assert rank0 != pytest.approx(r["moe_seq_aux_loss"], rel=10 * RTOL)
    from safetensors.torch import load_file

    other = load_file(str(spawned / "moe" / "ckpt-000004" / "model.safetensors"))
    for i, m in tr.model.moe_layers():
        assert m.expert_bias.abs().sum() > 0
        assert torch.allclose(other[f"blocks.{i}.mlp.expert_bias"], m.expert_bias, atol=1e-7)


def test_a_nan_on_one_rank_stops_every_rank(spawned):
    for rank in range(2):
        assert (
            "training stopped at step 2: the loss became nan" in (spawned / f"diverged{rank}.txt").read_text()
        )


def test_resume_a_two_process_checkpoint_in_one_process(spawned, single_text, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(spawned / "partial", run)
    assert (run / "latest").read_text().strip() == "ckpt-000003"
    tr = Trainer(_text_cfg(), run, resume=True, progress=False)
    assert tr.step == 3 and tr.world == 1
    tr.fit()
    _assert_same_losses(_metrics(run), _metrics(single_text))  # steps 2 (2 ranks), 4 and 6 (1 rank)


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [_text_cfg, _task_cfg], ids=["text", "task"])
def test_grad_accum_equals_one_big_batch(make, tmp_path):
    a = Trainer(make(), tmp_path / "a", progress=False)
    b = Trainer(make(grad_accum=4), tmp_path / "b", progress=False)
    for _ in range(4):
        assert b.train_step() == pytest.approx(a.train_step(), rel=RTOL)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=f"weights {n}")


@pytest.mark.parametrize("name", ["transformer", "gla"])
def test_activation_checkpointing_gives_the_same_losses_and_gradients(name):
    torch.manual_seed(0)
    model = LanguageModel(build_config(name, vocab_size=32, d_model=16, n_layers=2))
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    calls = []
    # a pre-hook: the recomputation stops early, once it has rebuilt the tensors backward needs
    model.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))

    def run(flag):
        model.zero_grad(set_to_none=True)
        model.activation_checkpointing = flag
        calls.clear()
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)

    loss0, grads0, n0 = run(False)
    loss1, grads1, n1 = run(True)
    assert (n0, n1) == (1, 2)  # the block's forward ran again in the backward pass
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-6, atol=1e-8, msg=f"gradient of {n}")
    # decoding with a state and evaluation never recompute
    calls.clear()
    with torch.no_grad():
        _, state = model(ids[:, :8])
        model(ids[:, 8:9], state)
    model.eval()
    logits, _ = model(ids)
    logits.sum().backward()
    assert len(calls) == 3


def test_activation_checkpointing_in_the_trainer(tmp_path):
    a = Trainer(_text_cfg(), tmp_path / "a", progress=False)
    b = Trainer(_text_cfg(activation_checkpointing=True), tmp_path / "b", progress=False)
    assert b.model.activation_checkpointing and not a.model.activation_checkpointing
    for _ in range(3):
        assert b.train_step() == pytest.approx(a.train_step(), rel=1e-6)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"grad_accum": 0}, "TrainConfig.grad_accum: expected a positive int"),
        ({"grad_accum": 3}, r"TrainConfig.batch_size: expected a multiple of grad_accum \(3\), got 4"),
        ({"activation_checkpointing": "yes"}, "TrainConfig.activation_checkpointing"),
    ],
)
def test_bad_configs_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        _text_cfg(**changes).validate()


def test_batch_not_divisible_by_processes_names_the_field(tmp_path, monkeypatch):
    import mnemo.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "init_from_env", lambda backend=None: (0, 2))
    with pytest.raises(
        ValueError, match=r"TrainConfig.batch_size: the global batch \(6\) must be a multiple"
    ):
        Trainer(_text_cfg(batch_size=6, grad_accum=2), tmp_path, progress=False)


def test_cli_flags_reach_the_config(tmp_path, capsys):
    from mnemo.cli import main

    argv = ["train", "--model", "transformer", "--d-model", "16", "--n-layers", "1", "--seq-len", "16"]
    argv += ["--batch-size", "4", "--steps", "2", "--eval-interval", "2", "--eval-batches", "1"]
    argv += ["--sample-tokens", "0", "--no-progress", "--out", str(tmp_path / "a")]
    assert main(argv + ["--grad-accum", "2", "--activation-checkpointing"]) == 0
    saved = json.loads((tmp_path / "a" / "ckpt-000002" / "train_config.json").read_text())
    assert saved["grad_accum"] == 2 and saved["activation_checkpointing"] is True
    assert "(2 micro-batches of 2 sequences)" in capsys.readouterr().out
    assert main(argv[:-2] + ["--out", str(tmp_path / "b"), "--grad-accum", "3"]) == 2
    assert "TrainConfig.batch_size" in capsys.readouterr().err

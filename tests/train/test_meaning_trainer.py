"""Known answers for the training loop and its files: a model with all-zero weights has loss ln V
per token; throughput is tokens over measured step time (a fake clock); checkpoints are written
into new nested folders with a manifest of sizes and SHA-256; settings at their allowed bounds
validate; a global batch is split into equal row blocks."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
from types import SimpleNamespace

import pytest
import torch

from mnemo.train import TrainConfig, Trainer
from mnemo.train.checkpoint import save_checkpoint, verify_checkpoint
from mnemo.train.distributed import shard
from tests.helpers import tiny_mqar_trainer


def _trainer(tmp_path, **kw):
    return tiny_mqar_trainer(tmp_path, **kw)


def test_zero_weights_give_ln_v_per_token_and_throughput_is_tokens_over_step_time(tmp_path, monkeypatch):
    import mnemo.train.trainer as trainer_module

    tr = _trainer(tmp_path, steps=4)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.zero_()  # logits 0 everywhere: cross-entropy ln V on every supervised token
    ln_v = math.log(tr.model.config.vocab_size)
    clock = iter(0.25 * i for i in range(10_000))
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    with contextlib.redirect_stdout(io.StringIO()):
        tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]  # two evaluation windows of two steps
    for r in rows:  # each step took exactly 0.25 s on the fake clock: 4 × 16 tokens / 0.25 s
        assert r["train_loss"] == pytest.approx(ln_v, rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / 0.25, rel=1e-9)


def test_a_step_returns_the_mean_loss_over_supervised_tokens(tmp_path):
    tr = _trainer(tmp_path)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.zero_()
    assert tr.train_step() == pytest.approx(math.log(tr.model.config.vocab_size), rel=1e-6)


def test_checkpoints_go_into_new_nested_folders_with_a_manifest(tmp_path):
    out = tmp_path / "a" / "b" / "run"

    def write(d):
        (d / "x.bin").write_bytes(b"\x00\x01" * 50)
        (d / "y.txt").write_text("hello")

    for step in (3, 5, 7):
        ckpt = save_checkpoint(out, step, write, keep=2)
    assert ckpt == out / "ckpt-000007" and (out / "latest").read_text().strip() == "ckpt-000007"
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000005", "ckpt-000007"]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest == {
        "format": 1,
        "files": {
            "x.bin": {"bytes": 100, "sha256": hashlib.sha256(b"\x00\x01" * 50).hexdigest()},
            "y.txt": {"bytes": 5, "sha256": hashlib.sha256(b"hello").hexdigest()},
        },
    }
    assert verify_checkpoint(ckpt) == []
    (ckpt / "y.txt").write_text("jello")  # same size, other bytes
    assert any("SHA-256" in p for p in verify_checkpoint(ckpt))


def test_settings_at_their_bounds_validate_and_past_them_do_not():
    TrainConfig(beta1=0.0, beta2=0.0, warmup_steps=0, sample_tokens=0, min_lr_ratio=1.0).validate()
    TrainConfig(sample_temperature=0.0).validate()  # temperature 0: greedy sampling
    for bad in (
        {"beta1": 1.0},
        {"beta2": 1.0},
        {"beta2": -0.1},
        {"warmup_steps": -1},
        {"warmup_steps": True},
        {"warmup_steps": 2.0},
        {"sample_tokens": -1},
        {"sample_temperature": -0.5},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainConfig(**bad).validate()


def test_shard_splits_the_global_batch_into_equal_row_blocks():
    batch = torch.arange(6 * 4).reshape(6, 4)
    assert torch.equal(shard(batch, 1, 3), batch[2:4])
    with pytest.raises(ValueError, match="multiple of the world size"):
        shard(torch.zeros(6, 8), 0, 4)  # 6 rows over 4 ranks (the 8 columns would divide)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_precision_sets_the_compute_dtype_of_matmuls(tmp_path, precision, dtype):
    tr = _trainer(tmp_path, precision=precision)
    a = torch.randn(4, 4)
    with tr._autocast():
        assert (a @ a).dtype == dtype


def test_task_evaluation_is_the_same_with_and_without_a_test_set_cache(tmp_path):
    from mnemo.train.task_eval import evaluate_task

    tr = _trainer(tmp_path)
    kw = dict(num_samples=8, batch_size=4, train_len=16, seed=0)
    plain = evaluate_task(tr.model, tr.task, [16, 32], **kw)
    cache: dict = {}
    first = evaluate_task(tr.model, tr.task, [16, 32], cache=cache, **kw)
    again = evaluate_task(tr.model, tr.task, [16, 32], cache=cache, **kw)
    # (length, rows) test sets, and the "for" entry naming the seed and task they were drawn for
    assert sorted(k for k in cache if k != "for") == [(16, 8), (32, 8)] and "for" in cache
    assert plain == first == again


def test_only_context_parallelism_needs_seq_len_divisible_by_the_world_size(tmp_path, monkeypatch):
    """Two ranks (faked; no process group exists, so construction stops when DDP needs it): with
    context parallelism an odd ``seq_len`` cannot be split; without it sequences are never split."""
    import mnemo.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "init_from_env", lambda backend: (0, 2))
    with pytest.raises(ValueError, match="seq_len: context parallelism over 2 processes"):
        _trainer(tmp_path, model="gla", seq_len=15, context_parallel=True)
    with pytest.raises(ValueError) as e:  # gets past the check, to the missing process group
        _trainer(tmp_path, seq_len=15)
    assert "seq_len" not in str(e.value) and "process group" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_asking_for_cuda_without_it_is_refused():
    from mnemo.train.distributed import local_device

    with pytest.raises(ValueError, match="no CUDA device is available"):
        local_device(torch.device("cuda"))
    assert local_device(torch.device("cpu")) == torch.device("cpu")


def test_gradient_accumulation_gives_the_same_step_as_one_batch(tmp_path):
    """grad_accum = 2: two micro-batches of 2 rows, summed gradients: the step of one batch of 4."""
    params = []
    for accum in (1, 2):
        tr = _trainer(tmp_path / str(accum), grad_accum=accum, seed=3)
        loss = tr.train_step()
        params.append((loss, [p.detach().clone() for p in tr.model.parameters()]))
    (l1, p1), (l2, p2) = params
    assert l2 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_finished_run_releases_its_folder(tmp_path):
    from mnemo.train.trainer import lock_run_folder

    tr = _trainer(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        tr.fit()
    lock = lock_run_folder(tmp_path / "run")  # would raise while another holder kept it
    if lock is not None:
        lock.close()


def test_learned_positions_cover_exactly_max_position_tokens(tmp_path):
    over = {"d_model": 16, "n_layers": 1, "max_position": 16}
    _trainer(tmp_path / "a", model="transformer_abs", model_overrides=over, seq_len=16)  # fits exactly
    with pytest.raises(ValueError, match="max_position"):
        _trainer(tmp_path / "b", model="transformer_abs", model_overrides=over, seq_len=17)


def test_task_evaluation_reads_at_most_eval_batches_batches(tmp_path):
    """``evaluate(max_batches)`` on a task scores ``min(max_batches, eval_batches) · batch_size``
    test sequences: the mean cross-entropy over their supervised tokens, by hand."""
    from mnemo.data.tasks import IGNORE_INDEX

    tr = _trainer(tmp_path, eval_batches=2)  # batch_size 4: at most 8 test sequences
    tr.model.eval()

    def by_hand(n):
        x, y = tr.task.sample(n, tr.cfg.seq_len, seed=tr.cfg.seed, split="test")
        with torch.no_grad():
            logits, _ = tr.model(x)
        keep = y != IGNORE_INDEX
        return torch.nn.functional.cross_entropy(logits[keep].double(), y[keep]).item()

    eight, four = by_hand(8), by_hand(4)
    assert eight != pytest.approx(by_hand(40), rel=1e-4)  # more sequences would change the mean
    assert tr.evaluate(max_batches=10)["val_loss"] == pytest.approx(eight, rel=1e-5)
    assert tr.evaluate()["val_loss"] == pytest.approx(eight, rel=1e-5)
    assert tr.evaluate(max_batches=1)["val_loss"] == pytest.approx(four, rel=1e-5)


def test_text_validation_of_zero_weights_is_ln_v_nats_and_log2_v_bits_per_character(tmp_path):
    """All-zero weights give logits 0, so every validation token costs exactly ln V nats; two
    batches of 4 windows of 16 tokens score 128 tokens; with characters as tokens (one token per
    character) that is log₂ V bits per character."""
    tr = _trainer(tmp_path, task=None, task_options={}, sample_tokens=0)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.zero_()
    V = tr.model.config.vocab_size
    ev = tr.evaluate(2)
    assert ev["val_tokens"] == 2 * 4 * 16
    assert ev["val_loss"] == pytest.approx(math.log(V), rel=1e-6)
    assert ev["val_bpc"] == pytest.approx(math.log2(V), rel=1e-6)


def test_grad_clip_zero_disables_clipping(tmp_path):
    """``grad_clip = 0`` is documented as "no clipping": its first step equals the step with a
    threshold no gradient norm reaches (clipping there multiplies by exactly 1)."""
    steps = []
    for clip in (0.0, 1e30):
        tr = _trainer(tmp_path / str(clip), grad_clip=clip, seed=3)
        before = [p.detach().clone() for p in tr.model.parameters()]
        tr.train_step()
        steps.append([p.detach() - b for p, b in zip(tr.model.parameters(), before)])
    moved = max(d.abs().max().item() for d in steps[1])
    assert moved > 1e-4  # the step did move the weights (AdamW's first step: about lr per weight)
    for a, b in zip(*steps):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_resume_changes_dict_settings_key_by_key_and_replaces_other_values_whole():
    """A dict merges into a dict-valued setting key by key; a non-dict given for a dict-valued
    setting (``model_overrides = None``) replaces it whole, which changes a fixed setting: refused
    by name. A dict given for a non-dict setting is checked as given."""
    from mnemo.train import resume_config

    saved = TrainConfig(model_overrides={"d_model": 16, "n_layers": 1})
    same, notes = resume_config(saved, {"model_overrides": {"n_layers": 1}})
    assert same.model_overrides == {"d_model": 16, "n_layers": 1} and notes == []
    with pytest.raises(ValueError, match="TrainConfig.model_overrides: a resumed run keeps"):
        resume_config(saved, {"model_overrides": None})
    with pytest.raises(ValueError, match="eval_batches: expected a positive int"):
        resume_config(saved, {"eval_batches": {"a": 1}})


def test_eval_batch_size_keeps_the_training_tokens_per_batch():
    """``batch_size · train_len`` tokens per pass, in whole sequences of ``length`` (at least one);
    a degenerate length below one token counts as one token (no division by zero)."""
    from mnemo.train.task_eval import eval_batch_size

    assert eval_batch_size(8, 64, 128) == 4 and eval_batch_size(8, 64, 100) == 5  # 512 // 100
    assert eval_batch_size(2, 16, 1000) == 1
    assert eval_batch_size(4, 16, 1) == eval_batch_size(4, 16, 0) == 64


def test_a_default_step_trains_on_32_windows(tmp_path):
    """``batch_size`` defaults to 32 windows per optimizer step (TrainConfig docstring): a run that
    does not set it draws batches of 32 sequences of ``seq_len`` tokens."""
    assert TrainConfig().batch_size == 32
    cfg = TrainConfig(
        model="transformer",
        model_overrides={"d_model": 8, "n_layers": 1},
        task="mqar",
        task_options={"num_pairs": 2, "vocab_size": 16},
        seq_len=16,
        steps=1,
        warmup_steps=0,
    )
    tr = Trainer(cfg, tmp_path / "run", progress=False)
    drawn = []
    generate = tr.task.generate

    def spy(n, length, generator):
        drawn.append((n, length))
        return generate(n, length, generator)

    tr.task.generate = spy
    tr.train_step()
    assert drawn == [(32, 16)]


def test_the_default_text_sample_is_drawn_at_temperature_0_8(tmp_path):
    """The end-of-run sample defaults to 400 tokens after "ROMEO:" at temperature 0.8 (logits /
    0.8; TrainConfig docstring): ``Trainer.sample`` equals :func:`generate_text` given those values
    explicitly, and another temperature draws another text from the same seed."""
    from mnemo.train.trainer import generate_text

    cfg = TrainConfig()
    assert (cfg.sample_tokens, cfg.sample_prompt, cfg.sample_temperature) == (400, "ROMEO:", 0.8)
    tr = _trainer(tmp_path, task=None, task_options={})
    torch.manual_seed(0)
    with torch.no_grad():  # spread-out logits, so the temperature changes what is drawn
        for p in tr.model.parameters():
            p.copy_(torch.randn_like(p))
    want = generate_text(tr.model, tr.tokenizer, "ROMEO:", 40, temperature=0.8, seed=0)
    hot = generate_text(tr.model, tr.tokenizer, "ROMEO:", 40, temperature=1.8, seed=0)
    assert want != hot
    assert tr.sample(max_new_tokens=40) == want


@pytest.mark.parametrize("progress", [False, True])
def test_the_progress_bar_is_drawn_exactly_when_asked(tmp_path, capsys, progress):
    """``progress=True`` draws the tqdm bar (``train <model>``, on stderr) and ``False`` draws
    nothing there: scripts and sweeps ask for a quiet run."""
    trainer = _trainer(tmp_path)
    trainer.progress = progress
    capsys.readouterr()
    trainer.fit()
    err = capsys.readouterr().err
    assert ("train transformer" in err) is progress

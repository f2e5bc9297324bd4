"""The `mnemo` command: train / eval / generate / models, and its error messages."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from mnemo.cli import main
from mnemo.train import resolve_checkpoint

FAST = [
    "--steps",
    "4",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-interval",
    "2",
    "--eval-batches",
    "1",
    "--d-model",
    "32",
    "--n-layers",
    "1",
    "--sample-tokens",
    "20",
    "--no-progress",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "--model", "gla", "--out", str(out), *FAST]) == 0
    return out


def test_train_writes_metrics_and_checkpoint(run_dir):
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert {"step", "train_loss", "val_loss", "tokens_per_s"} <= set(r)
    assert (run_dir / "latest").read_text().strip() == "ckpt-000004"


def test_eval_is_the_training_logs_measurement_by_default(run_dir, capsys):
    """`mnemo eval` on a run reports the val_loss the training log recorded for that checkpoint
    (same split, windows, batches and precision) and says which measurement it made."""
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt = resolve_checkpoint(run_dir)
    last = next(r for r in logged if r["step"] == int(ckpt.name.split("-")[1]))
    assert main(["eval", "--checkpoint", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["as_in_training"] is True and result["split"] == "val"
    assert result["val_loss"] == pytest.approx(last["val_loss"], rel=1e-12)
    assert result["tokens"] == last["val_tokens"] == 1 * 4 * 32  # eval_batches x batch_size x seq_len
    assert result["bpc"] == pytest.approx(last["val_bpc"], rel=1e-12)
    # more batches than the log's: another measurement, and the output says so
    assert main(["eval", "--checkpoint", str(run_dir), "--max-batches", "2"]) == 0
    more = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert more["as_in_training"] is False and more["tokens"] == 2 * 4 * 32
    # the whole split (read in batches of 512 windows, not the run's 4: the same windows, fewer calls)
    assert main(["eval", "--checkpoint", str(run_dir), "--max-batches", "all", "--batch-size", "512"]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert whole["as_in_training"] is False and whole["sequences"] == (111540 - 1) // 32
    assert whole["tokens"] == whole["sequences"] * 32
    assert main(["eval", "--checkpoint", str(run_dir), "--max-batches", "0"]) == 2
    assert "argument --max-batches: expected an int >= 1 or 'all', got '0'" in capsys.readouterr().err


def test_generate_continues_the_prompt(run_dir, capsys):
    assert (
        main(["generate", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "15"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) >= len("ROMEO:") + 1


def test_generate_compile_flag_decodes_through_the_compiled_step(run_dir, capsys, monkeypatch):
    """--compile reaches generate(compile=True) (a spy stands in for torch.compile's function, which
    tests/models/test_compile.py compiles for real) and greedy text is unchanged."""
    import mnemo.models.lm as lm

    steps = []

    def spy(model, ids, state=None):
        steps.append(ids.shape)
        return lm._one_token(model, ids, state)

    monkeypatch.setattr(lm, "_compiled", lambda model, kind, batch=None: spy)
    args = ["generate", "--checkpoint", str(run_dir), "--prompt", "RO", "--max-new-tokens", "5"]
    assert main([*args, "--temperature", "0"]) == 0
    eager = capsys.readouterr().out
    assert steps == []
    assert main([*args, "--temperature", "0", "--compile"]) == 0
    assert capsys.readouterr().out == eager
    assert len(steps) == 5  # the prefill and 4 decode steps


def test_resume_extends_a_run(tmp_path, capsys):
    """--resume keeps every saved setting (eval_interval, checkpoint_interval, ... are not reset
    to their defaults), prints each flag that changes one, and a new --steps needs --reschedule."""
    out = tmp_path / "run"
    args = ["--model", "gla", "--steps", "4", "--eval-interval", "2", "--checkpoint-interval", "4"]
    args += ["--eval-batches", "1", "--d-model", "32", "--n-layers", "1", "--sample-tokens", "0"]
    args += ["--batch-size", "4", "--seq-len", "32", "--lr", "1e-2", "--warmup-steps", "0"]
    assert main(["train", "--out", str(out), *args, "--no-progress"]) == 0
    capsys.readouterr()
    resume = ["train", "--out", str(out), "--resume", "--no-progress"]
    # a longer run must say what happens to the cosine
    assert main([*resume, "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.steps: 4 -> 8" in err and "--reschedule stretch" in err and "--reschedule hold" in err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    # settings that define the run cannot change on resume
    assert main([*resume, "--lr", "1e-3"]) == 2
    assert "TrainConfig.lr: a resumed run keeps lr = 0.01" in capsys.readouterr().err

    assert main([*resume, "--steps", "8", "--reschedule", "hold", "--sample-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    assert "resume: steps 4 -> 8" in printed and "resume: sample_tokens 0 -> 5" in printed
    assert "learning-rate cosine over 4 steps, as saved" in printed
    assert "eval_interval" not in printed  # not given, not changed
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # the saved eval_interval (2), not 100
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000008"]  # interval 4
    # 'hold': past the saved 4-step cosine the lr stays at lr * min_lr_ratio
    assert [r["lr"] for r in records[2:]] == pytest.approx([1e-3, 1e-3], rel=1e-9)

    # 'stretch': a cosine over 12 steps, so at step 8 the lr is back on it (no warm-up)
    assert main([*resume, "--steps", "12", "--reschedule", "stretch"]) == 0
    printed = capsys.readouterr().out
    assert "learning-rate cosine over 12 steps (was 4)" in printed
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    cosine = lambda s: 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi * s / 12))  # noqa: E731
    # the lr logged at step s is the rate step s's update used: the schedule after s - 1 steps
    assert [r["lr"] for r in records[4:]] == pytest.approx([cosine(9), cosine(11)], rel=1e-9)
    cfg = json.loads((out / "ckpt-000012" / "train_config.json").read_text())
    assert cfg["eval_interval"] == 2 and cfg["steps"] == 12 and cfg["schedule_steps"] is None


def test_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"transformer", "linear_attention", "retnet", "gla"} <= names


def test_config_file_then_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: retnet\nlr: 0.002\nmodel_overrides: {d_model: 32, n_layers: 1}\nseq_len: 16\n")
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                str(cfg),
                "--out",
                str(out),
                "--steps",
                "2",
                "--batch-size",
                "2",
                "--eval-interval",
                "2",
                "--eval-batches",
                "1",
                "--sample-tokens",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    saved = json.loads((out / "ckpt-000002" / "train_config.json").read_text())
    assert saved["model"] == "retnet" and saved["lr"] == 0.002 and saved["steps"] == 2


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--model", "gpt5"], "unknown model 'gpt5'; registered models:"),
        (["train", "--data", "/nonexistent/file.txt"], "data file not found"),
        (["train", "--steps", "0"], "argument --steps: expected an int in [1, 1000000000], got '0'"),
        (
            ["eval", "--checkpoint", "/nonexistent"],
            "argument --checkpoint: expected a run or checkpoint folder",
        ),
        (["generate", "--checkpoint", "."], "no checkpoint in"),
    ],
)
def test_errors_are_clear(argv, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_existing_run_is_not_overwritten(run_dir, capsys):
    assert main(["train", "--out", str(run_dir), *FAST]) == 2
    assert "--resume" in capsys.readouterr().err


def test_empty_data_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--data", str(empty), "--out", str(tmp_path / "r")]) == 2
    assert "is empty" in capsys.readouterr().err


def test_corrupt_checkpoint_is_reported(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *FAST]) == 0
    capsys.readouterr()
    w = out / "ckpt-000004" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])  # truncated
    # the run directory: the damaged newest checkpoint is named, the previous intact one is used
    assert main(["generate", "--checkpoint", str(out), "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert f"{w} has" in captured.err and "(shorter: truncated or edited)" in captured.err
    assert f"using {out / 'ckpt-000002'} instead" in captured.err
    assert len(captured.out) == 3 + 1  # three generated characters (from ckpt-000002) and a newline
    # the damaged checkpoint named directly: refused, naming the file
    assert main(["generate", "--checkpoint", str(w.parent)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {w.parent} is damaged: {w} has" in err
    # without a manifest (an older checkpoint) the weights loader still names the bad file
    (w.parent / "manifest.json").unlink()
    w.write_bytes(b"\x00" * 10)
    assert main(["generate", "--checkpoint", str(w.parent)]) == 2
    assert "corrupt or incompatible weights file" in capsys.readouterr().err


@pytest.mark.slow
def test_module_entry_point():
    """``python -m mnemo`` runs the command. (``slow``: by default tests/tasks/test_sweep.py's two
    signal tests and tests/nested/test_continual.py's killed experiment start ``python -m mnemo``
    and check its output and exit status; this one's process cost ~5 s for the same path.)"""
    r = subprocess.run([sys.executable, "-m", "mnemo", "models"], capture_output=True, text=True, check=True)
    assert "transformer" in r.stdout


@pytest.fixture
def fast_peak(monkeypatch):
    """The ops suite measures the machine's matmul peak (2048 x 2048, ~2 s) around every counted
    row: the tests of the table use a fixed peak, and the measurement is tested on its own."""
    import mnemo.bench.ops as ops

    monkeypatch.setattr(ops, "matmul_peak", lambda *a, **k: 100.0)


def test_matmul_peak_measures_a_positive_rate():
    from mnemo.bench.ops import matmul_peak

    assert 0 < matmul_peak(n=64, repeats=2, warmup=1) < 1e6


def test_bench_prints_a_table(capsys, tmp_path, fast_peak):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--lengths",
                "64",
                "--repeats",
                "1",
                "--heads",
                "2",
                "--head-dim",
                "8",
                "--ops",
                "gla_channel,delta_rule,selective_scan,ssd",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    speed = r"[0-9.]+x (faster|slower)"  # (on a loaded machine the chunk form can be the slower)
    said = rf"chunk is {speed} \(fwd\) and {speed} \(fwd\+bwd\) than recurrent \[delta_rule\]"
    assert "x SDPA" in text and re.search(said, text)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["op"], r["mode"]) for r in rows} >= {
        ("softmax_attention", "parallel"),
        ("gla_channel", "chunk"),
        ("delta_rule", "recurrent"),
    }
    assert all(r["fwd_ms"] > 0 for r in rows if "fwd_ms" in r)


def test_bench_modes_keeps_only_those_forms_and_the_sdpa_reference(tmp_path, capsys, fast_peak):
    out = tmp_path / "new" / "bench.json"  # (hostile trial 12: a --json folder to be made failed at the end)
    argv = ["bench", "--lengths", "32", "--repeats", "1", "--heads", "1", "--head-dim", "4"]
    assert main([*argv, "--ops", "ssd", "--modes", "chunk", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["op"], r["mode"]) for r in rows} == {("softmax_attention", "parallel"), ("ssd", "chunk")}
    assert main([*argv, "--modes", "fast"]) == 2
    assert "--modes: expected chunk, parallel and/or recurrent, got 'fast'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# tasks, sweeps, reports
# --------------------------------------------------------------------------------------------

TASK_FAST = [
    "--task",
    "mqar",
    "--task-option",
    "num_pairs=2",
    "--task-option",
    "vocab_size=16",
    "--seq-len",
    "16",
    "--steps",
    "4",
    "--batch-size",
    "4",
    "--eval-interval",
    "2",
    "--eval-batches",
    "2",
    "--d-model",
    "16",
    "--n-layers",
    "1",
    "--no-progress",
]


def test_train_and_eval_a_task(tmp_path, capsys):
    out = tmp_path / "mqar"
    assert (
        main(["train", "--model", "gated_deltanet", "--out", str(out), "--eval-lengths", "64", *TASK_FAST])
        == 0
    )
    text = capsys.readouterr().out
    assert "task mqar" in text and "vocab 16" in text and "acc@64" in text
    saved = json.loads((out / "ckpt-000004" / "train_config.json").read_text())
    assert saved["task"] == "mqar" and saved["task_options"] == {"num_pairs": 2, "vocab_size": 16}
    final = json.loads([x for x in text.splitlines() if x.startswith("{")][-1])
    assert {"val_acc", "val_loss", "val_acc@64"} <= set(final)

    assert main(["eval", "--checkpoint", str(out), "--length", "16,128", "--num-samples", "8"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["length"] for r in lines] == [16, 128]
    assert all(0 <= r["val_acc"] <= 1 and r["sequences"] == 8 and r["task"] == "mqar" for r in lines)
    # the training-length result is the trainer's own test set (same seed, same sequences)
    assert main(["eval", "--checkpoint", str(out), "--batch-size", "3"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["length"] == 16 and abs(again["val_loss"] - final["val_loss"]) < 1e-4


def test_task_options_from_a_config_file_and_flags(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(
        "task: selective_copying\ntask_options: {num_tokens: 4, vocab_size: 8}\nseq_len: 16\n"
        "model_overrides: {d_model: 16, n_layers: 1}\n"
    )
    out = tmp_path / "run"
    argv = [
        "train",
        "--config",
        str(cfg),
        "--out",
        str(out),
        "--model",
        "mamba",
        "--task-option",
        "num_tokens=3",
    ]
    argv += [
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--eval-interval",
        "2",
        "--eval-batches",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    saved = json.loads((out / "ckpt-000002" / "train_config.json").read_text())
    assert saved["task"] == "selective_copying" and saved["task_options"] == {
        "num_tokens": 3,
        "vocab_size": 8,
    }


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--task", "mqr"], "TrainConfig.task: expected None or one of"),
        (["train", "--task", "mqar", "--task-option", "num_pairs"], "--task-option expects KEY=VALUE"),
        (["train", "--task", "mqar", "--task-option", "pairs=3"], "unknown mqar option(s) ['pairs']"),
        (
            ["train", "--task", "mqar", "--eval-lengths", "1k"],
            "argument --eval-lengths: expected comma-separated ints >= 1, got '1k'",
        ),
        (["train", "--eval-lengths", "512"], "TrainConfig.eval_lengths: expected an empty list when no task"),
        (["report", "/nonexistent.sqlite"], "argument db: expected an existing sweep database"),
        (["sweep", "/nonexistent.yaml"], "argument config: expected an existing sweep YAML file"),
    ],
)
def test_task_and_sweep_errors_are_clear(argv, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_eval_lengths_on_a_text_checkpoint(run_dir, capsys):
    """--length on a text checkpoint: one JSON line per window length; --num-samples is refused."""
    assert main(["eval", "--checkpoint", str(run_dir), "--length", "16,64", "--max-batches", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["seq_len"] for r in lines] == [16, 64] and lines[1]["tokens"] == 4 * 64
    assert main(["eval", "--checkpoint", str(run_dir), "--num-samples", "4"]) == 2
    assert "--num-samples applies to task checkpoints" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run_dir), "--length", "64", "--seq-len", "32"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run_dir), "--yarn"]) == 2  # a GLA model: no rotary attention
    assert "--yarn: the model has no attention layer with rotary positions" in capsys.readouterr().err


def test_tasks_lists_the_tasks(capsys):
    assert main(["tasks"]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")}
    assert names == {
        "mqar",
        "selective_copying",
        "induction_heads",
        "passkey",
        "niah",
        "copying",
        "repeat_segment",
    }


def test_sweep_then_report_from_the_command_line(tmp_path, capsys):
    spec = {
        "name": "cli",
        "base": {
            "task": "induction_heads",
            "seq_len": 16,
            "batch_size": 4,
            "steps": 2,
            "eval_interval": 2,
            "eval_batches": 1,
            "eval_lengths": [64],
            "model_overrides": {"d_model": 16, "n_layers": 1},
        },
        "models": ["mamba", "transformer_abs"],
        "grid": {"lr": [1e-3, 3e-3]},
        "db": str(tmp_path / "cli.sqlite"),
        "out": str(tmp_path / "runs"),
    }
    path = tmp_path / "sweep.yaml"
    import yaml

    path.write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(path), "--no-progress"]) == 0
    assert "ran 4 (4 done" in capsys.readouterr().out
    assert main(["sweep", str(path), "--no-progress"]) == 0
    assert "4 already finished, ran 0" in capsys.readouterr().out
    assert main(["sweep", str(path), "--list"]) == 0
    listed = capsys.readouterr().out
    assert listed.count("  done  ") == 4 and "gone" not in listed
    # a finished run whose folder was deleted: still done (its results are in the database), and said
    import shutil

    (first,) = [line.split()[0] for line in listed.splitlines() if "mamba" in line and "0.001" in line]
    shutil.rmtree(tmp_path / "runs" / first)
    assert main(["sweep", str(path), "--list"]) == 0
    listed = capsys.readouterr().out
    assert listed.count("  done  ") == 4 and listed.count("is gone; the results stay in the database") == 1
    assert f"{first}  done" in listed and "(1 finished run folder(s) gone)" in listed
    assert main(["report", str(tmp_path / "cli.sqlite"), "--out", str(tmp_path / "rep")]) == 0
    text = capsys.readouterr().out
    assert "| mamba |" in text and "| transformer_abs |" in text and "acc@64" in text
    assert (tmp_path / "rep" / "cli_acc_vs_state.png").is_file()
    assert (tmp_path / "rep" / "cli_acc_vs_length.png").is_file()
    assert (tmp_path / "rep" / "cli.json").is_file()
    again = ["report", str(tmp_path / "cli.sqlite"), "--out", str(tmp_path / "r2"), "--no-plots"]
    assert main([*again, "--threshold", "0"]) == 0
    text = capsys.readouterr().out
    assert "| ≥ 0 |" in text and "| n=1 | 1 | 1/1 |" in text


@pytest.fixture
def decode_children_in_process(monkeypatch):
    """The decode suite starts one ``python -c CODE`` child per model and context (a fresh peak
    RSS), ~4.5 s of imports each: ``real(n)`` lets the first ``n`` children be processes and runs
    the later ones' CODE in this process (its stdout captured), as the child would."""
    import contextlib
    import io

    import mnemo.bench.decode as decode

    started, spawn = [], subprocess.run  # (decode.subprocess is the module: patched for everyone)

    def real(n: int) -> list:
        def run(cmd, **kw):
            started.append(cmd)
            if len(started) <= n:
                return spawn(cmd, **kw)
            assert cmd[:2] == [sys.executable, "-c"], cmd
            out = io.StringIO()
            with torch.random.fork_rng(), contextlib.redirect_stdout(out):  # (it seeds torch)
                exec(cmd[2], {})
            return subprocess.CompletedProcess(cmd, 0, stdout=out.getvalue(), stderr="")

        monkeypatch.setattr(decode.subprocess, "run", run)
        return started

    return real


def test_bench_decode_suite_runs(capsys, decode_children_in_process):
    """One row per context, the first from a real child process, and the line comparing them."""
    started = decode_children_in_process(1)
    assert (
        main(
            [
                "bench",
                "--suite",
                "decode",
                "--models",
                "gla",
                "--decode-processes",
                "1",
                "--contexts",
                "64,256",
                "--decode-steps",
                "2",
                "--d-model",
                "32",
                "--n-layers",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tokens/s" in out and "4x context" in out
    assert len(started) == 2  # one child per context


def test_bench_all_runs_the_four_suites_into_one_json(
    capsys, tmp_path, monkeypatch, fast_peak, decode_children_in_process
):
    """(The decode suite's child runs in this process: test_bench_decode_suite_runs starts a real one.)"""
    import mnemo.bench.decode as decode
    import mnemo.bench.ops as ops
    import mnemo.bench.peers as peers

    monkeypatch.setattr(peers, "PEERS", {})  # the peers (if installed) take minutes at full size
    monkeypatch.setattr(decode, "DEFAULT_MODELS", ["gla"])
    full = ops._registry
    monkeypatch.setattr(
        ops, "_registry", lambda: [b for b in full() if b.name in ("softmax_attention", "linear_attention")]
    )
    out = tmp_path / "all.json"
    argv = ["bench", "--suite", "all", "--lengths", "64", "--repeats", "1", "--heads", "2"]
    argv += ["--head-dim", "8", "--contexts", "64", "--decode-steps", "2", "--d-model", "32"]
    argv += ["--n-layers", "1", "--json", str(out), "--decode-processes", "1"]
    argv += ["--models", "gla", "--peers", "none", "--model-shapes", "16x1", "--gen-batches", "1"]
    argv += ["--prompt-len", "4", "--gen-tokens", "2"]
    started = decode_children_in_process(0)
    assert main(argv) == 0
    text = capsys.readouterr().out
    for suite in ("ops", "peers", "decode", "models"):
        assert f"=== mnemo bench --suite {suite} ===" in text
    data = json.loads(out.read_text())
    # a non-finite value (a speed-up over a peer not run) is null, named in one top-level map
    assert set(data) - {"nonfinite"} == {"ops", "peers", "decode", "models"}
    from mnemo.bench import loads_json

    restored = loads_json(out.read_text())
    for path in data.get("nonfinite", {}):
        node = restored
        for key in path.split("/"):
            node = node[int(key)] if isinstance(node, list) else node[key]
        assert not math.isfinite(node), path
    assert data["peers"] == [] and data["decode"][0]["model"] == "gla" and data["ops"]
    assert len(started) == 1
    assert [r["model"] for r in data["models"]["train"]] == ["gla"] and data["models"]["n_layers"] == 1


def test_generate_refuses_a_negative_length(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--max-new-tokens", "-5"]) == 2
    assert "argument --max-new-tokens: expected an int in [0, 1000000], got '-5'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_generate_on_a_missing_device_names_the_device(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert (
        "argument --device: expected 'cpu', 'cuda' or 'cuda:N', got 'cuda' (this machine has no CUDA" in err
    )
    assert "corrupt" not in err and err.count("\n") == 1


def test_generate_warns_about_prompt_characters_outside_the_vocabulary(run_dir, capsys):
    argv = ["generate", "--checkpoint", str(run_dir), "--prompt", "ROMEO ß€:", "--max-new-tokens", "3"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "2 character(s) are not in the checkpoint's vocabulary" in captured.err
    assert "'ß€'" in captured.err and captured.out.startswith("ROMEO")


def test_a_run_folder_in_use_is_refused_and_left_untouched(run_dir, capsys):
    """Another live process holds the folder's lock: training into it (resume or overwrite) stops
    with an error naming that process, and nothing in the folder changes."""
    import fcntl

    holder = open(run_dir / ".lock", "a+")
    fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.seek(0)
    holder.truncate()
    holder.write("4242\n")
    holder.flush()
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    metrics = (run_dir / "metrics.jsonl").read_text()
    try:
        for extra in (["--resume", "--steps", "6", "--reschedule", "hold"], ["--overwrite"]):
            assert main(["train", "--out", str(run_dir), *FAST, *extra]) == 2
            assert "is in use by another training process (pid 4242)" in capsys.readouterr().err
    finally:
        holder.close()
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    # the holder is gone (as after a crash): the lock is free again and the run resumes
    assert main(["train", "--out", str(run_dir), "--resume", "--steps", "6", "--reschedule", "hold"]) == 0


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupt_saves_every_finished_step_and_resumes_exactly(
    tmp_path, capsys, monkeypatch, request, signame
):
    """A signal during step 3 of 6 (eval every 2): the run stops after that step with a checkpoint of
    step 3 (not the step-2 one), exits 128 + the signal's number (130, 143), and --resume then gives
    the uninterrupted run's log."""
    import os
    import signal

    from mnemo.train.trainer import Trainer

    # a shell script's background job starts with SIGINT ignored, which the trainer respects: this
    # test takes the handlers a terminal gives, and gives the old ones back at the end
    olds = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    }
    request.addfinalizer(lambda: [signal.signal(s, h) for s, h in olds.items()])
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    args = [a if a != "4" else "6" for a in FAST]
    assert main(["train", "--out", str(tmp_path / "whole"), *args]) == 0
    real = Trainer.train_step

    def step_and_signal(self):
        loss = real(self)
        if self.step == 3:
            os.kill(os.getpid(), getattr(signal, signame))  # arrives while step 3 is finishing
        return loss

    monkeypatch.setattr(Trainer, "train_step", step_and_signal)
    cut = tmp_path / "cut"
    assert main(["train", "--out", str(cut), *args]) == {"SIGINT": 130, "SIGTERM": 143}[signame]
    assert f"{signame} at step 3" in capsys.readouterr().err
    assert (cut / "latest").read_text().strip() == "ckpt-000003"
    monkeypatch.setattr(Trainer, "train_step", real)
    assert main(["train", "--out", str(cut), *args, "--resume"]) == 0
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    key = ("step", "train_loss", "val_loss")
    assert [[r[k] for k in key] for r in resumed] == [[r[k] for k in key] for r in whole]
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored


# ``mnemo train`` flags are generated from TrainConfig's field metadata
FLAG_FIELDS = [  # every flag `mnemo train` had when the flags were hand-written, in field order
    "model",
    "data",
    "text_field",
    "pack_documents",
    "carry_state",  # added with issue 37 (truncated BPTT: mnemo train --carry-state)
    "bos",  # added with issue 39 (a fixed first token: mnemo train --bos)
    "tokenizer",
    "seq_len",
    "batch_size",
    "grad_accum",
    "context_parallel",
    "fsdp",
    "activation_checkpointing",
    "compile",  # added with issue 36 (mnemo train --compile)
    "steps",
    "lr",
    "warmup_steps",
    "optimizer",
    "eval_interval",
    "eval_batches",
    "checkpoint_interval",
    "seed",
    "device",
    "precision",
    "sample_tokens",
    "tensorboard",
    "init_from",
    "task",
    "train_examples",  # added with issue 20 (Zoology's fixed training set)
    "early_stop_acc",  # added with issue 20 (Zoology's early stop)
    "track_circuits",
    "circuit_length",
    "track_spectrum",
    "spectrum_burn_in",
]
# fields set otherwise: their own flags (--d-model/--n-layers, --task-option, --eval-lengths,
# --resume --reschedule) or the config file only
NOT_FLAGS = {"model_overrides", "task_options", "eval_lengths", "schedule_steps", "min_lr_ratio"}
NOT_FLAGS |= {"weight_decay", "beta1", "beta2", "grad_clip", "sample_prompt", "sample_temperature"}
NOT_FLAGS |= {"m3_slow_every", "m3_beta3", "m3_alpha", "m3_ns_steps", "m3_eps", "m3_ema"}


def _train_options() -> dict:
    """``--flag -> argparse action`` of the ``mnemo train`` parser."""
    from mnemo.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s: a for a in sub.choices["train"]._actions for s in a.option_strings}


def test_every_trainconfig_flag_field_is_a_train_flag():
    import dataclasses

    from mnemo.cli import config_flag_fields
    from mnemo.train import TrainConfig

    assert [f.name for f in config_flag_fields()] == FLAG_FIELDS
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(FLAG_FIELDS) | NOT_FLAGS
    options = _train_options()
    for name in FLAG_FIELDS:
        action = options["--" + name.replace("_", "-")]
        assert action.dest == name and action.default is None and action.help  # None: not given
    for flag in ["--config", "--out", "--resume", "--reschedule", "--overwrite", "--threads"]:
        assert flag in options
    for flag in ["--no-progress", "--task-option", "--eval-lengths", "--d-model", "--n-layers"]:
        assert flag in options
    from mnemo import argtypes

    assert (
        options["--tokenizer"].metavar == "char|byte|PATH" and options["--lr"].type is argtypes.positive_float
    )
    assert (
        options["--checkpoint-interval"].type is argtypes.positive_int and options["--track-circuits"].const
    )
    assert "(default 1000)" in options["--steps"].help
    assert "default --eval-interval" in options["--checkpoint-interval"].help


def test_a_new_field_with_metadata_is_a_flag():
    import argparse
    from dataclasses import dataclass, field

    from mnemo import argtypes
    from mnemo.cli import add_config_flags
    from mnemo.train import TrainConfig

    @dataclass
    class Extended(TrainConfig):
        dropout: float = field(
            default=0.0, metadata={"cli": {"help": "dropout rate", "type": argtypes.probability}}
        )
        label_smoothing: bool = field(default=False, metadata={"cli": {"help": "smooth the labels"}})
        note: str = "config file only"

    p = argparse.ArgumentParser()
    names = add_config_flags(p, Extended)
    assert p.parse_args(["--dropout", "0.5"]).dropout == 0.5
    with pytest.raises(SystemExit):  # the declared kind refuses a value out of its range
        p.parse_args(["--dropout", "1.5"])

    @dataclass
    class Undeclared(TrainConfig):
        width: int = field(default=3, metadata={"cli": {"help": "no kind"}})

    with pytest.raises(TypeError, match="TrainConfig.width: its flag declares no kind"):
        add_config_flags(argparse.ArgumentParser(), Undeclared)
    assert names == FLAG_FIELDS + ["dropout", "label_smoothing"]
    args = p.parse_args(["--dropout", "0.25", "--label-smoothing", "--seq-len", "64"])
    assert (args.dropout, args.label_smoothing, args.seq_len, args.steps) == (0.25, True, 64, None)
    assert "dropout rate (default 0.0)" in " ".join(p.format_help().split())


def test_type_errors_are_bugs_not_user_errors(monkeypatch):
    """A TypeError inside a command is a library bug: it propagates with its traceback."""
    import mnemo.cli as cli

    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(cli, "_cmd_models", broken)
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["models"])


@pytest.mark.parametrize(
    "text, match",
    [
        ("lr: fast\n", "TrainConfig.lr: expected a finite number, got 'fast'"),
        ("device: 0\n", "TrainConfig.device: expected a string, got 0"),
        ("task: mqar\ntask_options: [1]\n", "TrainConfig.task_options: expected a mapping, got [1]"),
        ("model_overrides: 3\n", "TrainConfig.model_overrides: expected a mapping, got 3"),
        ("- 1\n", "must hold a mapping of TrainConfig fields"),
    ],
)
def test_config_file_values_of_the_wrong_type_are_user_errors(text, match, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(text)
    argv = ["train", "--config", "c.yaml", "--task-option", "num_pairs=2", "--d-model", "16"]
    if "task:" not in text:
        argv.remove("--task-option")
        argv.remove("num_pairs=2")
    assert main(argv) == 2
    assert match in capsys.readouterr().err

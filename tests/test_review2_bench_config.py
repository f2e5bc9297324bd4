"""Second break-it review of the benchmarks and the model configuration / registry: strict JSON
(no ``NaN``), true medians, flags refused by name, bools refused where an int is expected."""

from __future__ import annotations

import json
import subprocess
import types
from argparse import Namespace

import pytest

from mnemo.bench import decode, models, ops, peers, roofline
from mnemo.memory import MemorySpec
from mnemo.models import LanguageModel, build_config


def _strict_json(path):
    """The file parsed as strict JSON: ``NaN``/``Infinity`` are not JSON (``json.loads`` would
    accept them; browsers, ``jq`` and other languages' parsers refuse the file)."""

    def refuse(name):
        raise AssertionError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _models_args(**kw):
    base = dict(
        models="transformer",
        peers="none",
        d_model=16,
        n_layers=1,
        model_shapes="8x1",
        device="cpu",
        gen_batches="none",
        prompt_len=4,
        gen_tokens=2,
        repeats=1,
        compile=False,
        json=None,
    )
    return Namespace(**{**base, **kw})


def _models_result(**rows):
    return {
        "d_model": 16,
        "n_layers": 1,
        "vocab": 256,
        "peers": {},
        "errors": {},
        "notes": {},
        "train": [],
        "generate": [],
        **rows,
    }


def test_the_models_suites_json_holds_null_not_nan(tmp_path, monkeypatch):
    """A ratio whose partner row failed (or a decode rate when generate took no longer than the first
    token) is ``nan``; it was written as ``NaN``, which makes the whole file invalid JSON."""
    row = {
        "model": "peer",
        "library": "peer",
        "compiled": False,
        "T": 8,
        "batch": 1,
        "params": 10,
        "train_step_ms": 2.0,
        "train_tokens_per_s": 4000.0,
        "vs": "transformer",
        "ratio_train": float("nan"),
    }
    monkeypatch.setattr(models, "run", lambda *a, **k: _models_result(train=[row]))
    out = tmp_path / "m.json"
    assert models.main(_models_args(json=str(out))) == 0
    (got,) = _strict_json(out)["train"]
    assert got["ratio_train"] is None and got["train_step_ms"] == 2.0


def test_the_peers_suites_json_holds_null_not_nan(tmp_path, monkeypatch, capsys):
    """The HOPE comparison has no backward (``fwd_bwd_ms`` is ``nan`` by design): the file must stay JSON."""

    def fake(repeats):
        row = {"fwd_ms": 1.0, "fwd_bwd_ms": float("nan"), "params": 3}
        return {"name": "fake", "peer": "p", "peer_key": "p", "mnemo": dict(row), "p": dict(row)}

    monkeypatch.setattr(peers, "PEERS", {"fake": fake})
    out = tmp_path / "p.json"
    assert peers.main(Namespace(ops="fake", repeats=1, json=str(out))) == 0
    (got,) = _strict_json(out)
    assert got["mnemo"] == {"fwd_ms": 1.0, "fwd_bwd_ms": None, "params": 3}


def test_the_roofline_suites_json_holds_null_not_nan(tmp_path, monkeypatch):
    result = {"machine": {"gemm_peak_gflops": float("inf")}, "train": [{"fraction_of_peak": float("nan")}]}
    monkeypatch.setattr(roofline, "run", lambda *a, **k: result)
    monkeypatch.setattr(roofline, "print_tables", lambda r: None)
    out = tmp_path / "r.json"
    args = Namespace(
        models="transformer",
        model_shapes="8x1",
        gen_batches="none",
        d_model=16,
        n_layers=1,
        prompt_len=4,
        repeats=1,
        compile=False,
        json=str(out),
    )
    assert roofline.main(args) == 0
    assert _strict_json(out) == {
        "machine": {"gemm_peak_gflops": None},
        "train": [{"fraction_of_peak": None}],
        # where each null was, and what (b994f63: the bench JSON names its non-finite values)
        "nonfinite": {"machine/gemm_peak_gflops": "Infinity", "train/0/fraction_of_peak": "NaN"},
    }


def test_the_roofline_suite_refuses_no_model_by_its_flag():
    """``--models ,`` selected nothing: it ran the STREAM arrays, then died on ``max() arg is an
    empty sequence`` (no flag named)."""
    with pytest.raises(ValueError, match="--models: expected at least one model"):
        roofline.run([], 16, 1, [(8, 1)], [], context=4, repeats=1, profile=False, stream_elements=2**10)


def test_the_decode_suite_refuses_no_model_by_its_flag(monkeypatch):
    """``--models ,`` printed an empty table and exited 0."""

    def no_runs(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "run", no_runs)
    args = Namespace(
        models=" , ",
        ops=None,
        contexts="8",
        decode_processes=1,
        d_model=16,
        n_layers=1,
        decode_steps=2,
        json=None,
    )
    with pytest.raises(ValueError, match="--models: expected at least one model name"):
        decode.main(args)


def test_the_models_suite_reads_names_as_the_cli_checks_them(monkeypatch):
    """The CLI's duplicate check strips blanks (``gla, gla`` is a duplicate), the roofline and decode
    suites strip them; the models suite refused ``"transformer, gla"`` as an unknown ``' gla'``."""
    seen = {}

    def fake_run(names, peer_names, *a, **k):
        seen["models"], seen["peers"] = names, peer_names
        return _models_result(train=[{"x": 1}])

    monkeypatch.setattr(models, "run", fake_run)
    monkeypatch.setattr(models, "print_tables", lambda r: None)
    assert models.main(_models_args(models=" transformer , gla", peers="mambapy ,")) == 0
    assert seen == {"models": ["transformer", "gla"], "peers": ["mambapy"]}
    with pytest.raises(ValueError, match="--models"):
        models.main(_models_args(models=" , "))


def test_the_decode_step_time_is_the_median_of_an_even_count(monkeypatch):
    """The docstring promises "the median step"; with the default 64 (even) steps it took the upper
    of the middle two. Steps of 1 s and 3 s: median 2 s, 0.5 tokens/s (not 1/3)."""
    clock = iter([0.0, 1.0, 10.0, 13.0])
    monkeypatch.setattr(decode, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    r = decode.measure("gla", 8, 2, 16, 1)
    assert r["tokens_per_s"] == pytest.approx(0.5, rel=1e-12)
    assert r["mean_tokens_per_s"] == pytest.approx(2 / 4, rel=1e-12)


def test_the_decode_row_is_the_median_of_its_processes(monkeypatch, capsys):
    """``--decode-processes 2`` reported the faster process (the upper of two), not their median; and
    the context ratio line printed ``0x context`` for contexts given longest first (integer division)."""
    speeds = iter([(64, 10.0), (64, 20.0), (16, 30.0), (16, 50.0)])

    def fake_run(cmd, **k):
        L, v = next(speeds)
        row = {
            "model": "gla",
            "context": L,
            "tokens_per_s": v,
            "mean_tokens_per_s": v,
            "peak_rss_mb": v,
            "state_mb": 0.5,
        }
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = Namespace(
        models="gla",
        ops=None,
        contexts="64,16",
        decode_processes=2,
        d_model=16,
        n_layers=1,
        decode_steps=2,
        json=None,
    )
    assert decode.main(args) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("gla")]
    assert [float(line[2]) for line in lines] == [15.0, 40.0]  # tokens/s: medians of (10, 20), (30, 50)
    assert [float(line[3]) for line in lines] == [15.0, 40.0]  # peak RSS
    assert "0.25x context: tokens/s x2.67" in out


@pytest.mark.parametrize("field", ["depth", "chunk_size"])
def test_a_memory_spec_refuses_a_bool_for_an_int(field):
    """``MemorySpec(depth=True)`` built a one-layer memory (``True - 1`` hidden layers) and saved
    ``"depth": true``; every other int check (``ModelConfig``, the mixers' options) refuses a bool."""
    with pytest.raises(ValueError, match=f"MemorySpec.{field}: expected .*got True"):
        MemorySpec(architecture="mlp", **{field: True}).validate()
    cfg = build_config(
        "titans_lmm", vocab_size=16, d_model=16, n_layers=1, mixer_options={"neural_memory": {field: True}}
    )
    with pytest.raises(ValueError, match=f"MemorySpec.{field}"):
        LanguageModel(cfg)


@pytest.mark.parametrize(
    "name", ["linear_attention", "gla_scalar", "gla_channel", "delta_rule", "gated_delta_rule", "kda", "ssd"]
)
def test_the_ops_suites_chunk_flops_are_the_products_the_chunk_form_runs(name, monkeypatch):
    """``chunk_flops`` (the ops table's ``GFLOP/s`` and ``% peak``) against ``FlopCounterMode`` over
    the chunk form, at head dims other than 64 and lengths that are not whole chunks (the form pads
    ``T`` to whole chunks, and runs one chunk of ``T`` below 64: the count used ``T``, 22% low at
    ``T = 100``). The delta rule's chunk-state pass runs in a C kernel ``FlopCounterMode`` cannot see:
    its PyTorch twin is used here so that every product is counted. Its count took ``Ã⁻¹[βK | βV]``
    as triangular solves (``2TCD``; the form multiplies by the inverse, ``4TCD``), which matched the
    counter at ``D = 64`` only because the counter missed the scan's ``2(T/C)D³ = 2TCD`` there."""
    import importlib

    from mnemo.ops import _chunked

    monkeypatch.setattr(
        importlib.import_module("mnemo.ops.delta_rule"), "scan_matrix", _chunked.scan_matrix_torch
    )
    (bench,) = [b for b in ops._registry() if b.name == name]
    for B, T, H, D in ((1, 16, 2, 32), (1, 20, 2, 16), (1, 100, 2, 32), (2, 200, 3, 64), (1, 256, 2, 128)):
        x = bench.make(B, T, H, D, "cpu")
        counted = roofline.count_flops(lambda x=x: bench.call(x, "chunk"))[0]
        assert bench.chunk_flops(B, T, H, D) == counted, (B, T, H, D)


@pytest.mark.parametrize(
    "script, flag",
    [
        ("bench_chunk_bound", "--repeats"),
        ("bench_decode_floor", "--repeats"),
        ("bench_fused_loss", "--rounds"),
        ("bench_gated_norm", "--rounds"),
        ("bench_matvec", "--rounds"),
        ("bench_mixer_share", "--rounds"),
        ("bench_python_vs_cli", "--rounds"),
        ("bench_strong_gates", "--rounds"),
        ("bench_swiglu", "--rounds"),
        ("bench_task_signal", "--rounds"),
        ("bench_workspace", "--repeats"),
    ],
)
def test_a_bench_scripts_count_of_zero_is_refused_by_its_flag(script, flag, monkeypatch, capsys):
    """The scripts took every count as a bare ``int``: ``--repeats 0`` died on ``no median for empty
    data`` (after building and warming up), ``--rounds 0`` on an ``IndexError`` after the runs or
    printed empty tables. Now argparse refuses it at once (exit 2), naming the flag."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def no_runs(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "run", no_runs)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", flag, "0"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected" in err and "'0'" in err

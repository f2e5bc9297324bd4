"""``mnemo bench --suite models`` at a tiny size: the rows, fields and ratios (never timings)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from mnemo.bench import model_peers as bench_peers
from mnemo.bench import models as bench
from mnemo.cli import main

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

TINY = ["--d-model", "16", "--n-layers", "2", "--model-shapes", "32x2", "--gen-batches", "1,2"]
TINY += ["--prompt-len", "8", "--gen-tokens", "3", "--repeats", "1"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "models.json"
    peers = "transformers_mamba" if HAS_TRANSFORMERS else "none"
    argv = ["bench", "--suite", "models", "--models", "transformer,gla", "--peers", peers, *TINY]
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_rows_and_fields(result):
    assert (result["d_model"], result["n_layers"], result["vocab"]) == (16, 2, 256)
    names = {r["model"] for r in result["train"]}
    assert {"transformer", "gla"} <= names
    for r in result["train"]:
        assert (r["T"], r["batch"]) == (32, 2) and r["params"] > 0
        assert r["train_step_ms"] > 0 and len(r["train_step_ms_runs"]) == 1
        assert math.isclose(r["train_tokens_per_s"], 64 / (r["train_step_ms"] / 1e3), rel_tol=1e-9)
    gen = {(r["model"], r["batch"]): r for r in result["generate"]}
    for name in ("transformer", "gla"):
        for b in (1, 2):
            r = gen[(name, b)]
            assert (r["prompt_len"], r["new_tokens"]) == (8, 3)
            assert r["first_token_ms"] > 0 and r["generate_ms"] > 0
            assert math.isclose(r["gen_tokens_per_s"], b * 3 / (r["generate_ms"] / 1e3), rel_tol=1e-9)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")
def test_peer_ratios_are_the_ratios_of_the_recorded_times(result):
    assert result["peers"] == {"transformers_mamba": "ok"}
    train = {r["model"]: r for r in result["train"]}
    peer, ours = train["MambaForCausalLM"], train["mamba"]  # the pair is added to the rows
    assert peer["vs"] == "mamba" and peer["params"] == ours["params"]  # the same weights
    assert math.isclose(peer["ratio_train"], peer["train_step_ms"] / ours["train_step_ms"], rel_tol=1e-12)
    gen = {(r["model"], r["batch"]): r for r in result["generate"]}
    for b in (1, 2):
        p, o = gen[("MambaForCausalLM", b)], gen[("mamba", b)]
        assert math.isclose(p["ratio_first_token"], p["first_token_ms"] / o["first_token_ms"], rel_tol=1e-12)
        assert math.isclose(p["ratio_generate"], p["generate_ms"] / o["generate_ms"], rel_tol=1e-12)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")
def test_the_peer_is_the_same_model():
    """The exported MambaForCausalLM computes the mnemo row's logits (so the ratio compares
    implementations, not models)."""
    import torch

    size = bench.Size(16, 2)
    rows = {}
    row = lambda n: rows.setdefault(n, bench.mnemo_entry(n, size=size))  # noqa: E731
    peer = bench_peers.peer_transformers_mamba(size, row)[0]
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = rows["mamba"].logits(ids)
        got = peer.logits(ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("titans_pytorch") is None, reason="titans-pytorch not installed")
def test_the_titans_lmm_peer_differs_from_titans_lmm_in_the_mixers_only():
    """The like-for-like Titans pair: mnemo's titans_lmm with titans-pytorch's NeuralMemory in
    every mixer slot; every other weight (embedding, norms, MLPs, head) is mnemo's, so the ratio
    isolates the memory layer. The peer model trains (a step changes its memory's weights)."""
    import torch
    from titans_pytorch import NeuralMemory

    size = bench.Size(32, 2)
    rows = {}
    row = lambda n: rows.setdefault(n, bench.mnemo_entry(n, size=size))  # noqa: E731
    peer = bench_peers.peer_titans_pytorch_lmm(size, row)[0]
    ours = rows["titans_lmm"].model
    assert peer.vs == "titans_lmm" and peer.generate is None
    assert all(isinstance(b.mixer.memory, NeuralMemory) for b in peer.model.blocks)
    theirs = {n: p for n, p in peer.model.named_parameters() if ".mixer." not in n}
    mine = {n: p for n, p in ours.named_parameters() if ".mixer." not in n}
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[n], mine[n]) for n in mine)
    assert all(theirs[n] is not mine[n] for n in mine)  # a copy: training one leaves the other
    ids = torch.randint(0, 256, (2, 70))  # more than one 64-token chunk
    logits = peer.logits(ids)
    assert logits.shape == (2, 70, 256) and torch.isfinite(logits).all()
    before = [p.detach().clone() for p in peer.model.blocks[0].mixer.parameters()]
    logits.square().mean().backward()
    torch.optim.AdamW(peer.model.parameters(), lr=1e-2).step()
    after = list(peer.model.blocks[0].mixer.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.skipif(
    importlib.util.find_spec("nested_learning") is None, reason="nested-learning not installed"
)
def test_the_nested_learning_updates_row_updates_its_memories_and_trains():
    """The like-for-like HOPE pair: the same HOPEModel as the read-only row, trained with
    nested-learning's test-time updates. Per 8-token chunk it reads the fast state the earlier
    chunks wrote: the first chunk's logits equal a read-only chunked pass from a fresh fast state,
    the later ones do not; the fast state the update pass writes changes; the logits carry autograd
    and an AdamW step changes the weights."""
    import torch

    size = bench.Size(16, 2)
    rows = {}
    mnemo_row = lambda n: rows.setdefault(n, bench.mnemo_entry(n, size=size))  # noqa: E731
    plain = bench_peers.peer_nested_learning(size, mnemo_row)[0]
    peer = bench_peers.peer_nested_learning_updates(size, mnemo_row)[0]
    assert peer.vs == "hope" and peer.generate is None and "nested_learning_updates" in bench.PEERS
    assert bench.PEER_PARTNER["nested_learning_updates"] == "hope"
    m = peer.model
    ref_state = plain.model.state_dict()
    assert all(torch.equal(ref_state[k], v) for k, v in m.state_dict().items())  # the same weights
    ids = torch.randint(0, 256, (2, 24))  # three 8-token chunks
    with torch.no_grad():
        fresh = m.init_fast_state()
        read_only = torch.cat([m(ids[:, s : s + 8], fast_state=fresh) for s in range(0, 24, 8)], 1)

    written = []
    init = m.init_fast_state

    def spy():
        written.append(init())
        return written[-1]

    m.init_fast_state = spy
    try:
        logits = peer.logits(ids)
    finally:
        del m.init_fast_state
    assert logits.shape == (2, 24, 256) and logits.requires_grad and torch.isfinite(logits).all()
    assert torch.allclose(logits[:, :8], read_only[:, :8], atol=1e-5)
    assert (logits[:, 8:] - read_only[:, 8:]).abs().max() > 1e-3  # read after the writes
    state, fresh = written[0].blocks[0], m.init_fast_state().blocks[0]
    assert not torch.equal(state.selfmod_state.memory.w1[0], fresh.selfmod_state.memory.w1)
    assert any(d.abs().max() > 0 for d in state.cms_params["cms_fast"].values())

    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    peer.opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    bench.train_step(peer, T=24, B=2)()
    changed = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert any("selfmod.m_memory" in n for n in changed) and any(".cms." in n for n in changed)


def test_tables_print_every_row(result, capsys):
    bench.print_tables(result)
    out = capsys.readouterr().out
    assert "training" in out and "generation" in out
    for r in result["train"]:
        assert r["model"] in out


def test_a_missing_peer_is_reported_and_skipped(monkeypatch, capsys):
    def missing(size, mnemo_row):
        raise ImportError("no", name="not_a_peer_lib")

    monkeypatch.setitem(bench.PEERS, "fake", missing)
    monkeypatch.setitem(bench.PEER_PARTNER, "fake", "gla")
    res = bench.run(
        ["gla"], ["fake"], bench.Size(16, 1), [(16, 1)], [1], prompt_len=4, gen_tokens=2, repeats=1, log=print
    )
    assert res["peers"] == {"fake": "not installed (not_a_peer_lib)"}
    assert "fake: skipped, peer not installed" in capsys.readouterr().out
    assert [r["model"] for r in res["train"]] == ["gla"]


def test_groups_are_built_timed_printed_and_freed_one_at_a_time(monkeypatch):
    """Memory holds one group's models: the previous group's model is gone when the next is built,
    and each group's rows are printed before the next group is built."""
    import gc
    import weakref

    built, log = [], []
    real = bench.mnemo_entry

    def tracking(name, model=None, size=None, note=""):
        gc.collect()
        log.append(("build", name, [r() is not None for r in built]))
        e = real(name, model=model, size=size, note=note)
        built.append(weakref.ref(e.model))
        return e

    monkeypatch.setattr(bench, "mnemo_entry", tracking)
    sz = bench.Size(16, 1)
    res = bench.run(["gla", "retnet"], [], sz, [(16, 1)], [1], 4, 2, 1, log=lambda s: log.append(s))
    assert [r["model"] for r in res["train"]] == ["gla", "retnet"]
    builds = [e for e in log if isinstance(e, tuple)]
    assert builds == [("build", "gla", []), ("build", "retnet", [False])]
    second = log.index(builds[1])
    assert any(isinstance(s, str) and s.strip().startswith("gla ") for s in log[:second])


def test_model_shapes_none_times_generation_only(tmp_path, capsys):
    assert bench.parse_shapes("none") == [] and bench.parse_shapes(" None ") == []
    out = tmp_path / "gen.json"
    argv = ["bench", "--suite", "models", "--models", "gla", "--peers", "none", *TINY]
    argv[argv.index("32x2")] = "none"
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["train"] == []
    assert sorted((r["model"], r["batch"]) for r in res["generate"]) == [("gla", 1), ("gla", 2)]
    capsys.readouterr()
    bench.print_tables(res)
    out = capsys.readouterr().out
    assert "gla" in out and "generation" in out and "training" not in out


def test_gen_batches_none_times_training_only(tmp_path):
    assert bench.parse_gen_batches("none") == [] and bench.parse_gen_batches("1,8") == [1, 8]
    out = tmp_path / "train.json"
    argv = ["bench", "--suite", "models", "--models", "gla", "--peers", "none", *TINY]
    argv[argv.index("1,2")] = "none"
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["generate"] == [] and [(r["model"], r["T"]) for r in res["train"]] == [("gla", 32)]


def test_bad_arguments_name_the_flag():
    with pytest.raises(ValueError, match="--gen-batches"):
        bench.parse_gen_batches("1,x")
    with pytest.raises(ValueError, match="--model-shapes"):
        bench.parse_shapes("1024*8")
    with pytest.raises(ValueError, match="--models: unknown"):
        bench.run(["nope"], [], bench.Size(16, 1), [(8, 1)], [1], 4, 2, 1)
    with pytest.raises(ValueError, match="--peers: unknown"):
        bench.run(["gla"], ["nope"], bench.Size(16, 1), [(8, 1)], [1], 4, 2, 1)


def test_interleaved_rotates_the_order():
    calls = []
    tasks = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = bench.interleaved(tasks, repeats=3, warmup=1)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert all(len(v) == 3 for v in times.values())


CORES = (("mamba2", "ssd"), ("gated_deltanet", "gdr"))


def test_mixer_share_stand_ins_replace_the_core_and_keep_every_gradient():
    """scripts/bench_mixer_share.py's ``rest`` step is only a fair lower bound on the work outside
    the mixer core if the core really is replaced and every parameter still gets a gradient."""
    from mnemo.bench.models import Size, mnemo_entry

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_mixer_share.py"
    spec = importlib.util.spec_from_file_location("bench_mixer_share", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = []
    free_gdr, free_ssd = mod._free_gated_delta_rule, mod._free_ssd_chunk
    mod._free_gated_delta_rule = lambda *a, **k: calls.append("gdr") or free_gdr(*a, **k)
    mod._free_ssd_chunk = lambda *a, **k: calls.append("ssd") or free_ssd(*a, **k)
    ids = torch.randint(0, 256, (2, 16))
    entries = [(mnemo_entry(n, size=Size(d_model=32, n_layers=2)), core, 2) for n, core in CORES]
    if HAS_TRANSFORMERS:  # the row the script times: 6 layers, the 4th one softmax attention
        qwen = bench_peers.peer_transformers_qwen3_next(Size(d_model=32, n_layers=6), None)[0]
        entries.append((qwen, "gdr", 5))
    for e, core, layers in entries:
        name = e.name
        with mod._mixer_core_free():
            e.logits(ids).square().mean().backward()
        assert calls.count(core) == layers and len(calls) == layers, (name, calls)  # one call per layer
        missing = [n for n, p in e.model.named_parameters() if p.grad is None]
        assert not missing, (name, missing)
        calls.clear()
    # the real ops are back after the context
    import mnemo.layers.delta as delta_layer
    import mnemo.layers.ssm as ssm_layer

    assert delta_layer.gated_delta_rule.__module__ == "mnemo.ops.delta_rule"
    assert ssm_layer.run_ssd_chunk.__module__ == "mnemo.ops._ssd_chunk"

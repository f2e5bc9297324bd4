"""``mnemo bench --suite roofline``: the FLOP count against hand counts, the profile's grouping, and
the suite at a tiny size (its JSON schema and refused flags; never timings)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from mnemo.bench import roofline
from mnemo.cli import main
from mnemo.models import LanguageModel, build_config
from mnemo.models.fused_loss import chunked_cross_entropy


def test_a_linear_layer_counts_2mnk_three_times():
    M, K, N = 12, 7, 5
    lin = torch.nn.Linear(K, N, bias=False)
    x = torch.randn(M, K, requires_grad=True)
    total, per_op, _ = roofline.count_flops(lambda: lin(x).sum().backward())
    assert total == 3 * 2 * M * N * K  # y = x Wᵀ, ∂x = ∂y W, ∂W = ∂yᵀ x
    x = torch.randn(M, K)  # no input gradient: the forward and ∂W only
    assert roofline.count_flops(lambda: lin(x).sum().backward())[0] == 2 * 2 * M * N * K


def test_in_place_accumulating_matmuls_are_counted():
    acc, a, b = torch.zeros(3, 4, 5), torch.randn(3, 4, 6), torch.randn(3, 6, 5)
    m, x, y = torch.zeros(4, 5), torch.randn(4, 6), torch.randn(6, 5)
    total, _, uncounted = roofline.count_flops(lambda: (acc.baddbmm_(a, b), m.addmm_(x, y)))
    assert total == 2 * 3 * 4 * 6 * 5 + 2 * 4 * 6 * 5
    assert "baddbmm_" not in uncounted and "addmm_" not in uncounted


def test_the_fused_lm_head_counts_three_matmuls_of_the_head():
    N, d, V = 40, 8, 33
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    y = torch.randint(0, V, (N,))
    total, _, uncounted = roofline.count_flops(
        lambda: chunked_cross_entropy(h, w, y, chunk_rows=7).backward()
    )
    assert total == 3 * 2 * N * d * V
    assert "logsumexp" in uncounted  # the softmax is element-wise work, listed as not counted


def test_a_transformer_counts_its_linears_and_causal_attention():
    """Hand count: every nn.Linear (their inputs all carry gradients) 6·M·K·N, the head 6·M·d·V, and
    causal SDPA as torch's formulas (2 matmuls forward, 5 backward) times (T+1)/2T."""
    torch.manual_seed(0)
    B, T, V = 2, 16, 64
    m = LanguageModel(build_config("transformer", vocab_size=V, d_model=32, n_layers=1))
    ids = torch.randint(0, V, (B, T))
    total, per_op, _ = roofline.count_flops(lambda: m(ids, targets=ids)[0].backward())
    M = B * T
    linears = sum(
        6 * M * mod.in_features * mod.out_features for mod in m.modules() if isinstance(mod, torch.nn.Linear)
    )
    H, D = m.blocks[0].mixer.n_heads, m.blocks[0].mixer.head_dim
    causal = (T + 1) / (2 * T)
    sdpa = int(2 * 2 * B * H * T * T * D * causal) + int(5 * 2 * B * H * T * T * D * causal)
    assert total == linears + sdpa
    assert any("scaled_dot_product" in k for k in per_op)


@pytest.mark.parametrize("name", ["gla", "hope"])
def test_flops_are_linear_in_the_batch(name):
    """Every op is batched over the rows (at gates that keep one chunk size; the suite counts the
    step's own batch all the same: tests/test_review_bench.py)."""
    m = roofline.build(name, 16, 1)
    opt = torch.optim.AdamW(m.parameters())
    one = roofline.count_flops(roofline.train_step_fn(m, opt, 16, 1).forward_backward)[0]
    three = roofline.count_flops(roofline.train_step_fn(m, opt, 16, 3).forward_backward)[0]
    assert three == 3 * one > 0


def test_profile_groups_a_step_by_what_ran(capfd):
    torch.manual_seed(0)
    m = roofline.build("gla", 16, 1)
    opt = torch.optim.AdamW(m.parameters())
    shares = roofline.profile_step(m, roofline.train_step_fn(m, opt, 16, 2))
    err = capfd.readouterr().err  # the profiler's native start/stop lines do not reach the table
    assert "profiler_start" not in err and "USDT" not in err, err
    print("after", file=sys.stderr)  # and stderr works again afterwards
    assert capfd.readouterr().err == "after\n"
    assert set(roofline.GROUPS) <= set(shares)
    assert abs(sum(shares[g] for g in roofline.GROUPS) - 1) < 1e-9
    for g in ("matmul", "recurrence", "norms", "loss", "optimizer", "python"):
        assert shares[g] > 0, g
    assert 0 < shares["mm in mixer"] <= shares["matmul"]


@pytest.mark.parametrize("tie", [False, True])
def test_decode_bytes_count_weights_once_and_embedding_rows(tie):
    m = LanguageModel(build_config("gla", vocab_size=256, d_model=16, n_layers=1, tie_embeddings=tie))
    every = sum(p.numel() * 4 for p in m.parameters())  # a tied table once
    emb = m.embed.weight
    # untied: the embedding reads 3 rows of its table; tied: the head reads the table whole
    expected = every if tie else every - emb.numel() * 4 + 3 * emb.shape[1] * 4
    assert roofline.weight_bytes_per_step(m, 3) == expected


@pytest.mark.parametrize(
    "name,cycle",
    [
        ("gated_deltanet", 1),
        ("transformer", 1),
        ("hope", 32),
        ("hope_reconstruction", 32),
        ("titans_mac", 64),
    ],
)
def test_the_decoding_cycle_is_the_lcm_of_the_models_periods(name, cycle):
    """hope: CMS periods 8, 16, 32 and an 8-token task segment -> 32; MAC: its 64-token segment;
    a model without periods: every token costs the same, 1."""
    m = LanguageModel(build_config(name, vocab_size=32, d_model=16, n_layers=1))
    assert roofline.decode_cycle(m) == cycle


def test_a_long_cycle_is_timed_in_part_and_says_so():
    """hope_long (periods 16, 128, 512, 2048): a call times MAX_DECODE_TOKENS of the 2048."""
    m = LanguageModel(build_config("hope_long", vocab_size=roofline.VOCAB, d_model=16, n_layers=1))
    assert roofline.decode_cycle(m) == 2048
    step = roofline.decode_step_fn(m, 1, 4, tokens=3)
    assert (step.tokens, step.cycle) == (3, 2048)
    with pytest.raises(ValueError, match="tokens: expected a positive integer"):
        roofline.decode_step_fn(m, 1, 4, tokens=0)


def test_a_decoding_call_steps_through_its_tokens_from_the_same_start():
    """The timed call is ``tokens`` consecutive one-token steps (a hand loop over the model's own
    forward gives the same last logits, and a second call the same again: each call starts from the
    prompt's state); hope's call spans its segment ends (the dearer tokens that re-run a segment)."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope", vocab_size=256, d_model=16, n_layers=1))
    step = roofline.decode_step_fn(m, 1, 8)
    assert step.tokens == step.cycle == 32
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, roofline.VOCAB, (1, 8), generator=g)
    toks = torch.randint(0, roofline.VOCAB, (1, 32), generator=g)
    with torch.no_grad():
        _, state = m(prompt)
        for i in range(32):
            logits, state = m(toks[:, i : i + 1], state)
    first = step()
    assert torch.equal(first, logits) and torch.equal(step(), first)


def test_a_decode_rows_step_is_the_calls_time_over_its_tokens(tmp_path, monkeypatch):
    """run() divides the median call by the tokens it stepped: with every call timed at 64 ms, hope
    (a 32-token cycle) reports 2 ms a token and gla (cycle 1) 64 ms."""
    monkeypatch.setattr(roofline, "STREAM_ELEMENTS", 2**10)
    monkeypatch.setattr(roofline, "interleaved", lambda tasks, repeats: {k: [0.064] for k in tasks})
    r = roofline.run(["gla", "hope"], 16, 1, [(8, 1)], [1], 4, 1, profile=False, log=lambda s: None)
    rows = {d["model"]: d for d in r["decode"]}
    assert (rows["hope"]["tokens_timed"], rows["hope"]["cycle"]) == (32, 32)
    assert abs(rows["hope"]["step_ms"] - 2.0) < 1e-9 and abs(rows["hope"]["tokens_per_s"] - 500) < 1e-6
    assert rows["gla"]["tokens_timed"] == 1 and abs(rows["gla"]["step_ms"] - 64.0) < 1e-9


TINY = ["--d-model", "16", "--n-layers", "1", "--model-shapes", "16x2", "--gen-batches", "1,2"]
TINY += ["--prompt-len", "8", "--repeats", "1"]


def test_suite_runs_and_writes_the_schema(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(roofline, "STREAM_ELEMENTS", 2**16)
    out = tmp_path / "roofline.json"
    assert main(["bench", "--suite", "roofline", "--models", "gla", *TINY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for heading in ("GEMM peak", "training step", "decoding", "where a profiled training step"):
        assert heading in text
    r = json.loads(out.read_text())
    assert (r["d_model"], r["n_layers"], r["vocab"]) == (16, 1, 256)
    assert {"gemm", "gemm_peak_gflops", "copy_gbs", "triad_gbs"} <= set(r["machine"])
    assert r["machine"]["gemm_peak_gflops"] == max(g["gflops"] for g in r["machine"]["gemm"])
    assert {(g["M"], g["K"], g["N"]) for g in r["machine"]["gemm"]} >= {(32, 16, 256)}  # the head's shape
    assert [t["model"] for t in r["train"]] == ["gla"]
    for t in r["train"]:
        assert (t["T"], t["batch"]) == (16, 2)
        assert t["flops_fwd_bwd"] == sum(t["flops_by_op"].values()) > 0
        assert (
            abs(t["achieved_gflops"] - t["flops_fwd_bwd"] / (t["step_ms"] / 1e3) / 1e9)
            < 1e-9 * t["achieved_gflops"]
        )
        assert abs(t["fraction_of_peak"] - t["achieved_gflops"] / t["gemm_peak_gflops"]) < 1e-12
    assert {(d["model"], d["batch"]) for d in r["decode"]} == {(n, b) for n in ("gla",) for b in (1, 2)}
    for d in r["decode"]:
        assert d["state_bytes"] > 0 and d["weight_bytes"] > 0
        assert abs(d["fraction_of_bandwidth"] * r["machine"]["triad_gbs"] - d["achieved_gbs"]) < 1e-9
    assert set(r["profile"]) == {"gla 16x2"}
    assert r["load_average"] is not None and r["threads"] == torch.get_num_threads()


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--contexts", "64"], "--contexts is read by --suite decode, not by --suite roofline"),
        (["--peers", "none"], "--peers is read by --suite models, not by --suite roofline"),
        (["--lengths", "64"], "--lengths is read by --suite ops, not by --suite roofline"),
        (["--model-shapes", "none"], "--model-shapes: the roofline suite needs at least one training shape"),
        (["--model-shapes", "16by2"], "--model-shapes: expected TxB"),
        (["--models", "nosuch"], "--models: unknown model(s) ['nosuch']"),
    ],
)
def test_bad_flags_are_refused_with_the_flag_named(argv, said, capsys, monkeypatch):
    monkeypatch.setattr(roofline, "STREAM_ELEMENTS", 2**10)
    assert main(["bench", "--suite", "roofline", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err, err


def test_a_model_too_large_to_build_is_a_one_line_error(capsys):
    """A width the parser accepts but the allocator cannot serve: exit 2 naming the flags, no
    traceback (it was the allocator's RuntimeError, 12 frames; hostile trial 9)."""
    rc = main(
        [
            "bench",
            "--suite",
            "roofline",
            "--models",
            "gated_deltanet",
            "--d-model",
            "1048576",
            "--n-layers",
            "1",
            "--model-shapes",
            "1x1",
            "--gen-batches",
            "none",
            "--repeats",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "--d-model" in err and "does not fit" in err and "Traceback" not in err


def test_decode_floor_counts_the_operators_a_step_dispatches():
    """scripts/bench_decode_floor.py (issue 40 item 3): its operator counter counts each
    dispatched ATen call once (a known expression: 3 ops), and a decode step's row holds its
    operator count, its floor, the target time and at least the bytes of every block weight."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_floor.py"
    spec = importlib.util.spec_from_file_location("bench_decode_floor", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    with mod.CountOps() as c:
        (a + b).mul(b).sum()
    assert c.n == 3
    rows = mod.main(
        [
            "--models",
            "gla",
            "--batches",
            "1",
            "--repeats",
            "1",
            "--stream-elements",
            "4096",
            "--context",
            "16",
        ]
    )
    (row,) = rows
    assert row["ops"] > 50 and row["floor_s"] > 0 and row["target_s"] > 0 and row["step_s"] > 0
    model = roofline.build("gla", 128, 4)
    body = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks."))
    assert row["model"] == "gla" and row["bytes"] >= 4 * body  # every block weight read once, fp32


def test_decode_floor_times_the_step_generate_compiles():
    """``--compile``: the row adds the step that ``generate(compile=True)`` runs, timed per step over
    ``--steps-per-call`` steps, and its logits equal the eager step's to float rounding."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_floor.py"
    spec = importlib.util.spec_from_file_location("bench_decode_floor", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = []
    counted = mod.repeated(lambda: calls.append(1), 3)
    counted()
    assert len(calls) == 3
    argv = ["--models", "mamba2", "--batches", "1", "--repeats", "1", "--stream-elements", "4096"]
    argv += ["--d-model", "32", "--n-layers", "1"]  # (one small block: compiling 4 of d 128 took ~40 s)
    (row,) = mod.main([*argv, "--context", "16", "--compile", "--steps-per-call", "2", "--blas-too"])
    assert row["compiled_s"] > 0 and row["step_s"] > 0 and row["blas_s"] > 0
    assert 0 <= row["logit_diff"] < 1e-4  # fp32 logits of a random model: |logit| ~ 1


def test_compile_adds_the_step_generate_compiles_to_each_decode_row(tmp_path, monkeypatch, capsys):
    """``--compile`` (issue 40 item 3): each decode row also times the step ``generate(compile=True)``
    runs; its logits equal the eager step's to float rounding, and its fraction is its bytes over its
    own time, of the same triad."""
    monkeypatch.setattr(roofline, "STREAM_ELEMENTS", 2**16)
    out = tmp_path / "roofline.json"
    argv = ["bench", "--suite", "roofline", "--models", "mamba2", *TINY, "--compile", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "compiled ms" in text and "the compiled decode step too" in text
    r = json.loads(out.read_text())
    assert r["compile"] == "on" and len(r["decode"]) == 2
    for d in r["decode"]:
        assert d["compiled_step_ms"] > 0 and d["compile_s"] > 0
        assert 0 <= d["compiled_max_logit_diff"] < 1e-4  # fp32 logits of a random model: |logit| ~ 1
        bytes_ = d["weight_bytes"] + d["state_bytes"]
        expect = bytes_ / (d["compiled_step_ms"] / 1e3) / 1e9 / r["machine"]["triad_gbs"]
        assert abs(d["compiled_fraction_of_bandwidth"] - expect) < 1e-9 * expect
        assert abs(d["compiled_tokens_per_s"] - d["batch"] / (d["compiled_step_ms"] / 1e3)) < 1e-6


def test_compile_unavailable_keeps_the_eager_rows_and_says_why(tmp_path, monkeypatch, capsys):
    """Where ``torch.compile`` cannot run (no C compiler, ...), ``--compile`` reports why and the
    suite finishes with its eager decode rows."""
    from mnemo.bench import model_entries

    monkeypatch.setattr(roofline, "STREAM_ELEMENTS", 2**16)
    monkeypatch.setattr(model_entries, "compile_available", lambda: (False, "no C compiler (test)"))
    out = tmp_path / "roofline.json"
    argv = ["bench", "--suite", "roofline", "--models", "gla", *TINY, "--compile", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "torch.compile is unavailable here (no C compiler (test))" in text
    r = json.loads(out.read_text())
    assert r["compile"] == "unavailable: no C compiler (test)"
    assert len(r["decode"]) == 2 and not any("compiled_step_ms" in d for d in r["decode"])


def test_matvec_bench_times_each_way_against_the_triad():
    """scripts/bench_matvec.py (issue 40 item 3): every task gets a time and a fraction of the
    triad (bytes over time over bandwidth) at 2 threads and 1."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_matvec.py"
    spec = importlib.util.spec_from_file_location("bench_matvec", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--rounds", "1", "--matrices", "2", "--stream-elements", "4096"])
    assert {r["threads"] for r in rows} == {1, 2} and len(rows) == 14
    assert all(r["s"] > 0 and r["fraction"] > 0 for r in rows)

"""The memory-capacity probe (:mod:`mnemo.interp.capacity`; ``mnemo probe capacity``,
:mod:`mnemo.commands.capacity`).

What the numbers mean, each against an independent computation: the delta rule stores orthonormal
keys exactly (recall 1, error 0), a hand loop of per-token (and per-chunk) gradient steps on
``½‖k + LN(W₂ gelu(W₁ k)) − v‖²`` written from the equation reproduces the probe's reads, and the
recall metric scores known reads.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.cli import main
from mnemo.commands.capacity import capacity_claims, capacity_markdown
from mnemo.interp.capacity import (
    capacity_sweep,
    capacity_variants,
    initial_weights,
    random_pairs,
    recall_accuracy,
    write_and_recall,
)

D = torch.float64


def test_delta_rule_stores_orthonormal_keys_exactly():
    spec = capacity_variants(chunk_size=1)["matrix_plain"][0]
    K, N, B = 8, 6, 3
    k = torch.eye(K, dtype=D)[:N].expand(B, N, K)[:, :, None]  # [B, N, 1, K] basis keys
    v = torch.randn(B, N, 1, K, dtype=D, generator=torch.Generator().manual_seed(0))
    w = initial_weights(spec, K, B, torch.Generator().manual_seed(1), D)
    assert all(float(x.abs().max()) == 0.0 for x in w)  # the delta rule starts at zero
    for passes in (1, 3):
        r = write_and_recall(spec, k, v, 1.0, w, passes)
        assert r["recall"].tolist() == [1.0] * B
        assert float(r["nmse"].max()) < 1e-24
    # at theta 1/2 one pass stores half of each value: y_i = v_i / 2, error (1/2)^2 of |v|^2
    r = write_and_recall(spec, k, v, 0.5, w, 1)
    assert torch.allclose(r["nmse"], torch.full((B,), 0.25, dtype=D), atol=1e-12)


def _read(x, Ws, residual, norm):
    """``M_W(x)`` written from the definitions: ``W₁`` alone (matrix) or ``gelu(x W₁) W₂``, then
    ``LN`` (no affine, eps 1e-5) with ``norm``, plus ``x`` with ``residual``."""
    h = x @ Ws[0] if len(Ws) == 1 else F.gelu(x @ Ws[0]) @ Ws[1]
    if norm:
        h = F.layer_norm(h, (h.shape[-1],), eps=1e-5)
    return x + h if residual else h


def _hand_loop(k, v, Ws, theta, passes, chunk, residual, norm):
    """Mini-batch GD on ``½‖M_W(k) − v‖²``: the ``chunk`` tokens of a step share the weights their
    gradients are taken at (``chunk = 1``: online GD), one stream, with autograd; then every key is read."""
    Ws = [w.clone() for w in Ws]
    ks, vs = k.repeat(passes, 1), v.repeat(passes, 1)
    for s in range(0, ks.shape[0], chunk):
        a = [w.clone().requires_grad_() for w in Ws]
        loss = sum(
            0.5 * ((_read(ks[t], a, residual, norm) - vs[t]) ** 2).sum()
            for t in range(s, min(s + chunk, len(ks)))
        )
        grads = torch.autograd.grad(loss, a)
        Ws = [w - theta * g for w, g in zip(Ws, grads)]
    return torch.stack([_read(kk, Ws, residual, norm) for kk in k])


@pytest.mark.parametrize("variant", ["mlp", "matrix", "mlp_plain", "matrix_plain", "mlp_equal"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_every_variant_matches_a_hand_loop(variant, chunk):
    """10 tokens (5 pairs, 2 passes) in chunks of 1 and of 3 (a remainder), non-orthogonal keys."""
    spec = capacity_variants(chunk_size=chunk)[variant][0]
    assert spec.activation == "gelu" and spec.layer_count() == (1 if "matrix" in variant else 2)
    K, N, B, theta, passes = 4, 5, 2, 0.3, 2
    g = torch.Generator().manual_seed(3)
    k, v = random_pairs(N, K, B, g, D)
    w = initial_weights(spec, K, B, g, D)
    if "matrix" in variant:  # the Titans layer's start for a matrix memory
        assert all(float(x.abs().max()) == 0.0 for x in w)
    r = write_and_recall(spec, k, v, theta, w, passes)
    for b in range(B):
        ws = [x[b, 0] for x in w]
        y = _hand_loop(k[b, :, 0], v[b, :, 0], ws, theta, passes, chunk, spec.residual, spec.norm)
        nmse = (((y - v[b, :, 0]) ** 2).sum(-1) / (v[b, :, 0] ** 2).sum(-1)).mean()
        assert float(r["nmse"][b]) == pytest.approx(float(nmse), rel=1e-9)
        sim = F.normalize(y, dim=-1) @ F.normalize(v[b, :, 0], dim=-1).T
        hits = (sim.argmax(-1) == torch.arange(N)).double().mean()
        assert float(r["recall"][b]) == float(hits)


def test_float32_reads_the_same_pairs_as_float64():
    spec = capacity_variants()["mlp"][0]
    out = {}
    for dt in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(5)
        k, v = random_pairs(12, 16, 16, g, dt)
        w = initial_weights(spec, 16, 16, g, dt)
        out[dt] = (k, write_and_recall(spec, k, v, 0.03, w, 2))
    assert torch.equal(out[torch.float32][0], out[torch.float64][0].float())  # the same pairs
    r32, r64 = out[torch.float32][1], out[torch.float64][1]
    assert torch.allclose(r32["nmse"].double(), r64["nmse"], rtol=1e-4)
    assert (r32["recall"].double() - r64["recall"]).abs().max() <= 1 / 12  # at most one read flips


def test_recall_metric_on_known_reads():
    v = torch.randn(2, 5, 1, 4, generator=torch.Generator().manual_seed(0))
    assert recall_accuracy(v, v).tolist() == [1.0, 1.0]
    assert recall_accuracy(3.0 * v, v).tolist() == [1.0, 1.0]  # cosine: the scale does not count
    assert recall_accuracy(v.roll(1, dims=1), v).tolist() == [0.0, 0.0]  # every read another's value
    y = v.clone()
    y[:, :2] = v[:, 2:4]  # reads 0 and 1 return the values of pairs 2 and 3
    assert recall_accuracy(y, v).tolist() == pytest.approx([0.6, 0.6])
    y[:, 2:] = 0.0  # a read of nothing is a miss, not a tie won by the first value
    assert recall_accuracy(y, v).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="same shape"):
        recall_accuracy(v[:, :4], v)


def test_bad_input_is_refused():
    s = capacity_variants()["mlp"][0]
    k, v = random_pairs(3, 4, 1, torch.Generator().manual_seed(0))
    w = initial_weights(s, 4, 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="retention='none'"):
        write_and_recall(s.replace(retention="decay"), k, v, 0.1, w)
    with pytest.raises(ValueError, match="eta goes with"):
        write_and_recall(s, k, v, 0.1, w, eta=0.5)  # a GD spec given a momentum
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="theta must be a positive number"):
            write_and_recall(s, k, v, bad, w)
    with pytest.raises(ValueError, match="passes"):
        write_and_recall(s, k, v, 0.1, w, passes=0)
    with pytest.raises(ValueError, match="deep .mlp. memory"):
        capacity_variants("ttt_linear")
    with pytest.raises(ValueError, match="l2 objective"):
        capacity_variants("yaad")  # (its Huber objective needs a delta the probe does not pass)
    with pytest.raises(ValueError, match="preset name"):
        capacity_variants("foo")
    with pytest.raises(ValueError, match="select_seed"):
        capacity_sweep(capacity_variants(), [4], seeds=[0, 1, 2], select_seed=1, progress=False)


def test_sweep_chooses_theta_on_the_held_out_seed_and_pairs_the_seeds():
    variants = {n: s for n, s in capacity_variants(max_lr=1e3).items() if n in ("matrix_plain", "mlp_plain")}
    res = capacity_sweep(
        variants, [4, 12], passes=[1], theta_grid=[0.03, 0.3, 1e3], seeds=[0, 1, 2], streams=8, progress=False
    )
    assert len(res["cells"]) == 4
    for c in res["cells"]:
        sel = {float(t): r for t, r in c["selection"].items() if r is not None}  # None: diverged
        assert c["theta"] == max(sel, key=sel.get)
        # the reported seeds rerun at that theta: seed 0 by hand
        spec = variants[c["variant"]][0]
        g = torch.Generator().manual_seed(0)
        k, v = random_pairs(c["n_pairs"], 16, 8, g)
        w = initial_weights(spec, 16, 8, g)
        r = write_and_recall(spec, k, v, c["theta"], w, 1)
        assert c["recall"][0] == pytest.approx(float(r["recall"].mean()), abs=1e-6)
    # a rate whose reads blow up is recorded as such and never chosen (MLP(x) at theta 1e3)
    assert all(c["selection"]["1000"] is None for c in res["cells"] if c["variant"] == "mlp_plain")
    # the delta rule at 4 pairs in 16 dimensions recalls nearly everything
    cell = next(c for c in res["cells"] if c["variant"] == "matrix_plain" and c["n_pairs"] == 4)
    assert min(cell["recall"]) > 0.9
    judged = capacity_claims(res)
    assert [(j["n_pairs"], j["passes"]) for j in judged] == [(4, 1), (12, 1)]
    for j in judged:
        a = next(c for c in res["cells"] if c["variant"] == "mlp_plain" and c["n_pairs"] == j["n_pairs"])
        b = next(c for c in res["cells"] if c["variant"] == "matrix_plain" and c["n_pairs"] == j["n_pairs"])
        diffs = [x - y for x, y in zip(a["recall"], b["recall"])]
        assert j["mean"] == pytest.approx(sum(diffs) / 3)
    md = capacity_markdown(res)
    assert "| 12 |" in md and "mlp_plain − matrix_plain" in md


def test_cli_writes_json_table_and_figure(tmp_path, capsys):
    out = tmp_path / "cap"
    argv = ["probe", "capacity", "--variants", "matrix_plain,mlp", "--pairs", "4,8", "--passes", "1"]
    argv += ["--seeds", "3", "--streams", "4", "--theta-grid", "0.1,1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    rec = json.loads((out / "capacity.json").read_text())
    assert [c["variant"] for c in rec["cells"]] == ["matrix_plain", "mlp"] * 2
    assert rec["settings"]["chunk_size"] == 1 and math.isfinite(rec["wall_s"])
    assert (out / "capacity.png").stat().st_size > 0
    assert "mlp − matrix" not in (out / "capacity.md").read_text()  # its control did not run
    before = (out / "capacity.json").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2  # the files are kept without --overwrite
    assert "--overwrite" in capsys.readouterr().err and (out / "capacity.json").read_bytes() == before
    assert main([*argv, "--overwrite", "--variants", "mlp,deep"]) == 2
    assert "--variants" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--select-seed", "2"]) == 2
    assert "--select-seed" in capsys.readouterr().err


def _result(cells, pairs=(8,), passes=(1,)):
    variants = {v: {} for v in ("mlp", "matrix")}
    settings = dict(variants=variants, n_pairs=list(pairs), passes=list(passes), theta_grid=[0.1])
    settings.update(seeds=[0, 1, 2], select_seed=9, key_dim=4, streams=2, base="titans", chunk_size=1)
    return {"settings": settings, "cells": cells}


def _c(variant, recall, n=8, p=1):
    return dict(variant=variant, n_pairs=n, passes=p, theta=0.1, selection={}, seeds=[0, 1, 2], recall=recall)


def test_claims_pair_the_seeds_and_know_the_ceiling_and_the_lost_seeds():
    # a difference of +0.1 on every seed: reproduced, with no width
    j = capacity_claims(_result([_c("mlp", [0.6, 0.7, 0.8]), _c("matrix", [0.5, 0.6, 0.7])]))[0]
    assert (j["verdict"], j["n"]) == ("reproduced", 3) and j["mean"] == pytest.approx(0.1)
    # both at 0.99 or above on every seed: the probe cannot separate them
    j = capacity_claims(_result([_c("mlp", [1.0, 0.995, 1.0]), _c("matrix", [0.99, 1.0, 0.999])]))[0]
    assert j["verdict"] == "not testable here" and "cannot separate" in j["why"]
    # a seed whose reads were not finite (None) leaves the pairing: 2 paired seeds, not testable
    res = _result([_c("mlp", [0.6, None, 0.8]), _c("matrix", [0.5, 0.6, 0.7])])
    j = capacity_claims(res)[0]
    assert (j["verdict"], j["seeds"]) == ("not testable here", [0, 2])
    md = capacity_markdown(res)
    assert "0.700 ± " in md and "n = 2" in md  # the cell says over how many seeds
    md = capacity_markdown(_result([_c("mlp", [None, None, None]), _c("matrix", [0.5, 0.6, 0.7])]))
    assert "diverged (θ 0.1)" in md
    assert "the opposite holds" in capacity_markdown(
        _result([_c("mlp", [0.4, 0.5, 0.6]), _c("matrix", [0.5, 0.6, 0.7])])
    )


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--base", "yaad"], "--base"),
        (["--base", "nope"], "--base"),
        (["--pairs", "8,4,8"], "--pairs"),
        (
            ["--pairs", "1024", "--passes", "4", "--chunk-size", "65536", "--streams", "100000"],
            "--chunk-size",
        ),
        (["--theta-grid", "0.1,0.1"], "--theta-grid"),
        (["--theta-grid", "0.1,0.1000001"], "--theta-grid"),  # alike in the results' %g keys
        (["--variants", "mlp,,matrix"], "--variants: an empty name"),
    ],
)
def test_cli_refuses_bad_settings_before_any_work(extra, flag, tmp_path, capsys):
    assert main(["probe", "capacity", *extra, "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_a_results_page_line_is_rebuilt_by_mnemo_reproduce(tmp_path, capsys):
    """``<!-- mnemo:capacity ARGS -->``: ``mnemo reproduce`` runs the probe and writes its block;
    ``--no-run`` rebuilds it from the stored JSON and refuses results of another command."""
    out = tmp_path / "cap"
    args = "--variants matrix_plain,mlp --pairs 4,8 --passes 1 --seeds 3 --streams 4 --theta-grid 0.1,1"
    page = tmp_path / "page.md"
    page.write_text(f"# capacity\n\nprose kept\n\n<!-- mnemo:capacity {args} --no-progress --out {out} -->\n")
    assert main(["reproduce", str(page), "--no-progress"]) == 0
    text = page.read_text()
    assert "prose kept" in text and "<!-- mnemo:begin cap -->" in text and "<!-- mnemo:end cap -->" in text
    assert f"mnemo probe capacity {args}" in text and "![capacity](cap/capacity.png)" in text
    assert "| 8 |" in text and (out / "capacity.json").is_file()
    block = text[text.index("<!-- mnemo:begin cap -->") :]
    stamp = (out / "capacity.json").stat().st_mtime_ns
    assert main(["reproduce", str(page), "--no-run"]) == 0  # from the stored JSON, nothing rerun
    assert (out / "capacity.json").stat().st_mtime_ns == stamp
    assert page.read_text()[page.read_text().index("<!-- mnemo:begin cap -->") :] == block
    capsys.readouterr()
    page.write_text(page.read_text().replace("--streams 4", "--streams 8"))
    assert main(["reproduce", str(page), "--no-run"]) == 2
    err = capsys.readouterr().err
    assert "streams 4 against 8" in err and "page.md:5" in err


def test_two_lines_with_one_block_name_are_refused(tmp_path, capsys):
    page = tmp_path / "page.md"
    same = tmp_path / "continual_same"  # (a continual block is named after its --out too)
    a = f"<!-- mnemo:capacity --pairs 4 --seeds 3 --out {same} -->"
    b = f"<!-- mnemo:continual --experiment abab --seeds 3 --out {same} -->"
    page.write_text(f"# p\n\n{a}\n\n{b}\n")
    assert main(["reproduce", str(page), "--no-run"]) == 2
    assert "give each its own --out" in capsys.readouterr().err
    assert not same.exists()


@pytest.mark.parametrize("variant", ["mlp", "matrix"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_momentum_matches_a_hand_loop(variant, chunk):
    """Titans' surprise with momentum, written from the equation: the gradients of a chunk taken at
    its starting weights, then token by token ``S ← η S − θ G_t``, ``W ← W + S``."""
    spec = capacity_variants(chunk_size=chunk, momentum=True)[variant][0]
    K, N, B, theta, eta, passes = 4, 5, 2, 0.2, 0.7, 2
    g = torch.Generator().manual_seed(4)
    k, v = random_pairs(N, K, B, g, D)
    w = initial_weights(spec, K, B, g, D)
    r = write_and_recall(spec, k, v, theta, w, passes, eta=eta)
    for b in range(B):
        Ws = [x[b, 0].clone() for x in w]
        S = [torch.zeros_like(x) for x in Ws]
        ks, vs = k[b, :, 0].repeat(passes, 1), v[b, :, 0].repeat(passes, 1)
        for s in range(0, len(ks), chunk):
            a = [x.clone().requires_grad_() for x in Ws]
            grads = [
                torch.autograd.grad(0.5 * ((_read(ks[t], a, spec.residual, spec.norm) - vs[t]) ** 2).sum(), a)
                for t in range(s, min(s + chunk, len(ks)))
            ]
            for G in grads:
                S = [eta * m - theta * gi for m, gi in zip(S, G)]
                Ws = [x + m for x, m in zip(Ws, S)]
        y = torch.stack([_read(kk, Ws, spec.residual, spec.norm) for kk in k[b, :, 0]])
        nmse = (((y - v[b, :, 0]) ** 2).sum(-1) / (v[b, :, 0] ** 2).sum(-1)).mean()
        assert float(r["nmse"][b]) == pytest.approx(float(nmse), rel=1e-9)
    with pytest.raises(ValueError, match="eta goes with"):
        write_and_recall(spec, k, v, theta, w, passes)
    with pytest.raises(ValueError, match="eta must be"):
        write_and_recall(spec, k, v, theta, w, passes, eta=1.0)


def test_a_page_line_is_checked_where_it_writes_and_before_any_line_runs(tmp_path, monkeypatch, capsys):
    """A relative ``--out`` is the page checkout's: checked there (a training run's folder is
    refused wherever ``mnemo reproduce`` is called from); a line refused by a check that needs no
    work stops the page before an earlier line trains."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    run = root / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "latest").write_text("ckpt-000001\n")
    (run / "metrics.jsonl").write_text("")
    page = root / "docs" / "page.md"
    small = "--pairs 4 --passes 1 --seeds 3 --streams 2 --theta-grid 0.1 --no-progress"
    page.write_text(f"# p\n\n<!-- mnemo:capacity {small} --out runs/r1 -->\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # runs/r1 does not exist here
    assert main(["reproduce", str(page)]) == 2
    err = capsys.readouterr().err
    assert "page.md:3" in err and "training run" in err
    assert sorted(p.name for p in run.iterdir()) == ["latest", "metrics.jsonl"]
    page.write_text(
        f"# p\n\n<!-- mnemo:capacity {small} --out runs/good -->\n\n"
        f"<!-- mnemo:capacity {small} --variants bogus --out runs/bad -->\n"
    )
    assert main(["reproduce", str(page)]) == 2
    err = capsys.readouterr().err
    assert "page.md:5" in err and "--variants" in err
    assert not (root / "runs" / "good").exists()  # nothing ran


def test_the_command_leaves_the_thread_count_as_it_found_it(tmp_path):
    import torch

    before = torch.get_num_threads()
    argv = ["probe", "capacity", *SMALL, "--theta-grid", "0.1", "--threads", str(before + 1), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    assert torch.get_num_threads() == before
    assert json.loads((tmp_path / "o" / "capacity.json").read_text())["settings"]["threads"] == before + 1


SMALL = ["--variants", "matrix_plain", "--pairs", "4", "--passes", "1", "--seeds", "3", "--streams", "2"]


def test_the_memory_check_counts_the_memorys_own_weights(tmp_path, monkeypatch, capsys):
    """The deep memory's weights are per stream: at key dimension 256 an ``mlp`` memory holds
    8·256² = 524,288 weights a stream, 3 copies (weights, gradient, stepped weights) of them in 2,000
    streams is 11.7 GiB in float32, where the sequence and its work take ~0.15 GB (the run, measured:
    a peak of 8.9 GB)."""
    import mnemo.train.memory_estimate as est

    monkeypatch.setattr(est, "available_memory", lambda device: (4 << 30, "test"))
    argv = ["probe", "capacity", "--variants", "mlp", "--pairs", "4", "--passes", "1", "--seeds", "3"]
    argv += ["--key-dim", "256", "--streams", "2000", "--theta-grid", "0.1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "GiB, but only 4.0 GiB are available" in err
    need = float(err.split("needs about ")[1].split(" GiB")[0])
    weights = 3 * 8 * 256**2 * 2000 * 4 / (1 << 30)
    assert weights < need < weights + 0.3
    assert not (tmp_path / "o").exists()


def test_out_with_a_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """``--out '~/x'`` (quoted, or ``--out=~/x``: no shell expands it) is checked and written under
    the home folder, not in a folder named ``~``."""
    home, wd = tmp_path / "home", tmp_path / "wd"
    home.mkdir(), wd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(wd)
    argv = ["probe", "capacity", *SMALL, "--theta-grid", "0.1", "--no-progress"]
    assert main([*argv, "--out=~/cap"]) == 0
    assert (home / "cap" / "capacity.json").is_file() and not (wd / "~").exists()
    assert main([*argv, "--out", "~/cap"]) == 2  # the results there are found: not replaced
    assert main([*argv, "--out", "~/cap", "--overwrite"]) == 0


def test_reported_seeds_at_a_theta_past_the_delta_rules_range_do_not_warn():
    import warnings

    from mnemo.ops._common import RangeWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", RangeWarning)
        r = capacity_sweep(
            {"matrix_plain": capacity_variants()["matrix_plain"]},
            [4],
            [1],
            [5.0],
            seeds=[0, 1, 2],
            select_seed=1000,
            streams=2,
            progress=False,
        )
    assert r["cells"][0]["theta"] == 5.0


def _page_with(tmp_path, line_args: str, out: str = "cap"):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text("")
    page = root / "docs" / "p.md"
    page.write_text(f"# p\n\n<!-- mnemo:capacity {line_args} --no-progress --out {out} -->\n")
    return page


def test_a_line_does_not_replace_results_it_did_not_write(tmp_path, capsys):
    """The line's --out holds another command's results and the page has no block of the line yet:
    refused before anything runs, the results untouched; with the block there (an earlier version
    of the line wrote them) they are replaced; results of the very same command are adopted."""
    small = " ".join(SMALL)
    page = _page_with(tmp_path, f"{small} --theta-grid 0.1")
    out = page.parents[1] / "cap"
    argv = ["probe", "capacity", *SMALL, "--theta-grid", "0.1,1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0  # another command's results (another grid)
    stamp = (out / "capacity.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["reproduce", str(page), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "p.md:3" in err and "no generated block made for" in err and "theta_grid [0.1, 1.0] against" in err
    assert "move them away" in err
    assert (out / "capacity.json").stat().st_mtime_ns == stamp and "mnemo:begin" not in page.read_text()
    page.write_text(page.read_text().replace("--theta-grid 0.1 ", "--theta-grid 0.1,1 "))
    assert main(["reproduce", str(page), "--no-progress"]) == 0  # the same command: adopted, rerun
    page.write_text(page.read_text().replace("--theta-grid 0.1,1 ", "--theta-grid 0.1 "))
    assert main(["reproduce", str(page), "--no-progress"]) == 0  # its own block: replaced
    assert json.loads((out / "capacity.json").read_text())["settings"]["theta_grid"] == [0.1]
    # the block of that name was made for another folder: a line moved to other/cap, which holds
    # another command's results, is refused; so is a broken file where the results would go
    other = page.parents[1] / "other" / "cap"
    assert main([*argv[:-1], str(other)]) == 0
    page.write_text(page.read_text().replace("--out cap -->", "--out other/cap -->"))
    capsys.readouterr()
    assert main(["reproduce", str(page), "--no-progress"]) == 2
    assert "no generated block made for other/cap" in capsys.readouterr().err.replace(
        str(page.parents[1]) + "/", ""
    )
    (other / "capacity.json").write_text("[]")
    assert main(["reproduce", str(page), "--no-progress"]) == 2
    assert "is not a result of mnemo probe capacity" in capsys.readouterr().err
    assert (other / "capacity.json").read_text() == "[]"


def test_reproduce_threads_reach_a_line_without_its_own(tmp_path):
    before = torch.get_num_threads()
    page = _page_with(tmp_path, " ".join(SMALL) + " --theta-grid 0.1")
    want = before + 1
    assert main(["reproduce", str(page), "--no-progress", "--threads", str(want)]) == 0
    held = json.loads((page.parents[1] / "cap" / "capacity.json").read_text())["settings"]
    assert held["threads"] == want and torch.get_num_threads() == before


def test_a_broken_result_file_is_named_not_a_traceback(tmp_path, capsys):
    page = _page_with(tmp_path, " ".join(SMALL) + " --theta-grid 0.1")
    assert main(["reproduce", str(page), "--no-progress"]) == 0
    path = page.parents[1] / "cap" / "capacity.json"
    held = json.loads(path.read_text())
    for key in ("cells", "wall_s"):
        path.write_text(json.dumps({k: v for k, v in held.items() if k != key}))
        capsys.readouterr()
        assert main(["reproduce", str(page), "--no-run"]) == 2
        err = capsys.readouterr().err
        assert "is not a result of mnemo probe capacity" in err and key in err and "Traceback" not in err


def test_two_lines_whose_folders_share_a_name_are_told_apart(tmp_path, capsys):
    page = tmp_path / "page.md"
    a, b = tmp_path / "x" / "c", tmp_path / "y" / "c"
    page.write_text(f"# p\n\n<!-- mnemo:capacity --out {a} -->\n\n<!-- mnemo:capacity --out {b} -->\n")
    assert main(["reproduce", str(page), "--no-run"]) == 2
    err = capsys.readouterr().err
    assert "page.md:5" in err and "also the block of line 3" in err and f"--out {a}" in err
    assert not a.exists() and not b.exists()

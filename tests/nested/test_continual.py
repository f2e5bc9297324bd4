"""``mnemo continual``: stream generators, metrics, and a tiny end-to-end run."""

import json
import math

import pytest
import torch

from mnemo.commands.continual import (
    BOS,
    QUERY,
    ABABTask,
    ClassIncrementalTask,
    ContinualNet,
    ForgettingMQARTask,
    backward_transfer,
    mean_ci95,
    model_specs,
    t_quantile_975,
)


def _pairs_and_queries(ids, targets, tags, alt=None):
    """Split a key–value stream into shown pairs ``[(key, value, position)]`` and queries
    ``[(key, target, tag, alt, position)]`` (a query is ``key ?``, its answer supervised at ``?``)."""
    assert ids[0] == BOS
    pairs, queries = [], []
    for i in range(1, len(ids), 2):
        k, nxt = ids[i], ids[i + 1]
        assert targets[i] == -100 and tags[i] == 0  # key positions are never supervised
        if nxt == QUERY:
            queries.append((k, targets[i + 1], tags[i + 1], None if alt is None else alt[i + 1], i))
        else:
            assert targets[i + 1] == -100 and tags[i + 1] == 0
            pairs.append((k, nxt, i))
    return pairs, queries


def test_abab_streams_are_disjoint_maps_queried_as_documented():
    task = ABABTask(n_a=3, n_b=5, n_keys=10, n_values=4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        for interference in (True, False):
            s = task.stream(gen, interference)
            assert len(s.ids) == 1 + 2 * (task.n_a + task.n_b) + 4 * task.n_a  # both types: same length
            pairs, queries = _pairs_and_queries(s.ids, s.tgt, s.tag)
            keys = [k for k, _, _ in pairs]
            assert len(set(keys)) == task.n_a + task.n_b  # every key shown once
            assert all(2 <= k < 2 + task.n_keys for k in keys)
            assert all(2 + task.n_keys <= v < task.vocab_size for _, v, _ in pairs)
            A, B = set(keys[: task.n_a]), set(keys[task.n_a :])  # A is shown first, then B
            assert not A & B
            value = {k: v for k, v, _ in pairs}
            assert all(t == value[k] for k, t, _, _, _ in queries)  # answer = the value shown for k
            first_b = min(p for k, _, p in pairs if k in B)
            if interference:  # A, then B, then all A keys and n_a B keys, mixed
                assert all(p > max(p for _, _, p in pairs) for *_, p in queries)
                assert {k for k, _, tag, _, _ in queries if tag == 1} == A
                qb = {k for k, _, tag, _, _ in queries if tag == 2}
                assert qb <= B and len(qb) == task.n_a
            else:  # baseline: A queries come before any B pair
                assert {k for k, _, tag, _, _ in queries if tag == 3} == A
                assert all(p < first_b for k, _, tag, _, p in queries if tag == 3)
                assert {tag for *_, tag, _, _ in queries} == {3, 4}
    b = task.batch(4, gen)  # even rows interference, odd rows baseline
    assert (b.tags[0] == 1).any() and (b.tags[1] == 3).any() and not (b.tags[0] == 3).any()
    with pytest.raises(ValueError, match="n_a"):
        ABABTask(n_a=8, n_b=8, n_keys=10)


def test_forgetting_mqar_targets_are_the_latest_value():
    # hand-checked construction: keys shown with their first values, the reassigned keys shown again
    # with a different value, then every key queried once; the target is the last value shown
    task = ForgettingMQARTask(n=4, m=2, n_keys=6, n_values=3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        s = task.stream(gen)
        assert len(s.ids) == 1 + 2 * task.n + 2 * task.m + 2 * task.n
        pairs, queries = _pairs_and_queries(s.ids, s.tgt, s.tag, s.alt)
        assert len(pairs) == task.n + task.m and len(queries) == task.n
        first = {k: v for k, v, _ in reversed(pairs)}  # first value shown per key
        latest = {k: v for k, v, _ in pairs}
        moved = {k for k, _, _ in pairs[task.n :]}
        assert len(moved) == task.m and {k for k, _, _ in pairs[: task.n]} >= moved
        assert all(first[k] != latest[k] for k in moved)  # a reassignment always changes the value
        for k, target, tag, alt, _ in queries:
            assert target == latest[k]
            if k in moved:
                assert tag == 1 and alt == first[k]
            else:
                assert tag == 2 and alt == -100
        assert {k for k, *_ in queries} == set(latest)


def test_class_incremental_label_sets_are_disjoint_per_phase():
    task = ClassIncrementalTask(
        phases=3, classes_per_phase=2, shots=2, queries=1, final_queries=2, n_labels=8, feat_dim=4
    )
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        s, phase_labels = task.stream(gen)
        flat = [lab for p in phase_labels for lab in p]
        assert len(flat) == len(set(flat)) == 6  # disjoint, never repeated
        ids, tgt, tag = s.ids, s.tgt, s.tag
        # walk the stream: each phase shows only its own labels, then queries only them
        pos, k = 1, task.classes_per_phase
        for p in range(task.phases):
            shown = {ids[pos + 2 * i + 1] - 3 for i in range(task.shots * k)}
            assert shown == set(phase_labels[p])
            assert all(ids[pos + 2 * i] == 2 for i in range(task.shots * k))  # example token
            pos += 2 * task.shots * k
            for i in range(task.queries * k):
                assert ids[pos + 2 * i + 1] == QUERY and tag[pos + 2 * i + 1] == 1 + p
                assert tgt[pos + 2 * i + 1] - 3 in phase_labels[p]
            pos += 2 * task.queries * k
        final = [(tgt[i] - 3, tag[i]) for i in range(pos, len(ids)) if tag[i]]
        assert len(final) == task.final_queries * k * task.phases
        for lab, t in final:
            assert lab in phase_labels[t - 1 - task.phases]
        assert len(ids) == pos + 2 * len(final)
    b = task.batch(2, gen)
    assert b.feats.shape == (2, b.ids.shape[1], 4)
    assert (b.feats[b.ids != 2] == 0).all() and (b.feats[b.ids == 2] != 0).any()


def test_backward_transfer_on_a_hand_made_matrix():
    nan = float("nan")
    acc = [[0.9, nan, nan], [0.7, 0.8, nan], [0.5, 0.6, 1.0]]  # only the diagonal and last row count
    assert backward_transfer(acc) == pytest.approx(((0.5 - 0.9) + (0.6 - 0.8)) / 2)
    assert backward_transfer([[1.0, nan], [1.0, 0.5]]) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        backward_transfer([[1.0]])


def test_mean_ci95_is_the_t_interval():
    r = mean_ci95([1.0, 2.0, 3.0])  # s = 1, t_{0.975,2} = 4.303
    assert r["mean"] == pytest.approx(2.0) and r["n"] == 3
    assert r["ci95"] == pytest.approx(4.303 / math.sqrt(3))
    x = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]  # mean 5, Σ(x−5)² = 32, s = √(32/7)
    r = mean_ci95(x)
    assert r["mean"] == pytest.approx(5.0)
    assert r["ci95"] == pytest.approx(2.365 * math.sqrt(32 / 7) / math.sqrt(8))
    assert math.isnan(mean_ci95([0.5])["ci95"]) and mean_ci95([0.5])["mean"] == 0.5
    assert mean_ci95([1.0, float("nan"), 3.0])["dropped"] == 1
    # beyond the table: Cornish–Fisher against known quantiles (2.0003 at df 60, 1.9799 at df 120)
    assert t_quantile_975(60) == pytest.approx(2.0003, abs=2e-4)
    assert t_quantile_975(120) == pytest.approx(1.9799, abs=2e-4)
    assert t_quantile_975(30) == 2.042


def test_model_specs_controls():
    specs = model_specs(d_model=16, expansion=1.0, periods=(1, 4, 16, 64))
    assert list(specs) == ["cms-1", "cms-2", "cms-3", "cms-4", "static-4", "wide-1"]
    assert [lv["period"] for lv in specs["cms-4"]] == [1, 4, 16, 64]
    assert all(lv["lr"] == 0 for lv in specs["static-4"])
    count = {n: sum(p.numel() for p in ContinualNet(50, 16, lv).parameters()) for n, lv in specs.items()}
    assert count["static-4"] == count["cms-4"]
    assert abs(count["wide-1"] - count["cms-4"]) / count["cms-4"] < 0.01  # matched parameters
    assert len(specs["wide-1"]) == 1 and specs["wide-1"][0]["period"] == 1


def test_static_control_does_not_learn_in_context():
    torch.manual_seed(0)
    task = ForgettingMQARTask(n=4, m=2, n_keys=8, n_values=4)
    b = task.batch(2, torch.Generator().manual_seed(0))
    static = ContinualNet(task.vocab_size, 8, model_specs(8, 1.0, (1, 4))["static-2"])
    logits, _ = static(b.ids)
    # no memory: the logits at a query depend only on (key, ?) — equal for equal keys in any stream
    q = (b.ids == QUERY).nonzero().tolist()
    prev = {}
    for r, t in q:
        key = int(b.ids[r, t - 1])
        if key in prev:
            assert torch.allclose(logits[r, t], prev[key], atol=1e-5)
        prev[key] = logits[r, t]


def test_cli_end_to_end_writes_json_markdown_and_plots(tmp_path, capsys):
    from mnemo.cli import main

    argv = ["continual", "--experiment", "all", "--seeds", "1", "--steps", "2", "--eval-streams", "4"]
    argv += ["--models", "cms-1,nope", "--workers", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 2  # an unknown model name is an error naming the valid ones
    assert "nope" in capsys.readouterr().err
    argv[argv.index("cms-1,nope")] = "cms-1,static-4"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| cms-1 |" in out and "| static-4 |" in out and "A_after_B" in out and "BWT" in out
    res = json.loads((tmp_path / "continual.json").read_text())
    assert set(res) >= {"git", "torch", "experiments"}
    expected = {
        "abab": ["A_after_B", "B", "A_before_B", "forgetting", "final_train_loss"],
        "forgetting_mqar": ["reassigned", "untouched", "reassigned_old", "final_train_loss"],
        "class_incremental": ["avg_acc", "BWT", "final_train_loss"],
    }
    for exp, metrics in expected.items():
        r = res["experiments"][exp]
        assert r["seeds"] == [0] and set(r["models"]) == {"cms-1", "static-4"}
        for m in r["models"].values():
            assert set(m["summary"]) == set(metrics)
            assert {"mean", "ci95", "n", "values"} <= set(m["summary"][metrics[0]])
            (seed,) = m["per_seed"]
            assert set(metrics) <= set(seed) and seed["diverged_at_step"] is None
            if exp == "abab":
                assert seed["forgetting"] == pytest.approx(seed["A_before_B"] - seed["A_after_B"])
            if exp == "class_incremental":
                assert len(seed["just_after"]) == len(seed["final"]) == r["task"]["phases"]
            assert {"parameters", "levels", "wall_s"} <= set(m)
        assert (tmp_path / f"{exp}.png").stat().st_size > 0
    md = (tmp_path / "continual.md").read_text()
    assert "**abab**" in md and "**class_incremental**" in md and "| cms-1 |" in md
    # --force with one experiment: the plots of the experiments it no longer holds go (hostile
    # trial 11: abab.png stayed beside results without abab)
    one = ["continual", "--experiment", "abab", "--seeds", "1", "--steps", "2", "--eval-streams", "4"]
    one += ["--models", "cms-1", "--workers", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(one) == 2 and "already holds results" in capsys.readouterr().err
    assert main([*one, "--force"]) == 0
    assert "removed the replaced results' plots: forgetting_mqar.png, class_incremental.png" in (
        capsys.readouterr().out
    )
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["abab.png"]
    assert set(json.loads((tmp_path / "continual.json").read_text())["experiments"]) == {"abab"}

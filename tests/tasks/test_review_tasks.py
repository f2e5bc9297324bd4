"""Hostile review of the synthetic tasks: degenerate options and bad arguments are refused with a
message that names the parameter, the expected value and the one received; an independent checker
reads every sample back (each answer is the value bound to its key)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task
from mnemo.data.tasks.continual import make_task


@pytest.mark.parametrize("name", ["selective_copying", "copying"])
def test_one_data_symbol_is_refused(name):
    # vocab_size 3 leaves one data token between the noise/blank and the marker: every target is
    # known before the sequence is read, so nothing is copied
    with pytest.raises(ValueError, match=r"'vocab_size'.*>= 4.*got 3"):
        build_task(name, vocab_size=3)
    task = build_task(name, vocab_size=4)
    x, y = task.sample(64, task.min_length, seed=0)
    assert len(set(y[y != IGNORE_INDEX].tolist())) == 2


@pytest.mark.parametrize("bad", [np.int64(64), 64.0, "64"])
def test_a_non_int_length_is_named_as_such(bad):
    task = build_task("mqar")
    with pytest.raises(ValueError, match=r"seq_len: expected an int.*got") as e:
        task.sample(2, bad)
    assert "at least" not in str(e.value)  # not "needs at least 32 tokens, got 64"


def test_a_bool_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got True"):
        build_task("mqar").sample(True, 64)


def test_bool_and_unhashable_options_are_named():
    with pytest.raises(ValueError, match="'power_a'"):
        build_task("mqar", power_a=True)
    with pytest.raises(ValueError, match="'value'"):
        build_task("niah", value=["number"])
    with pytest.raises(ValueError, match="'haystack'"):
        build_task("niah", haystack=["essay"])


def test_niah_essay_longer_than_the_corpus_names_seq_len():
    task = build_task("niah")
    with pytest.raises(ValueError, match=r"seq_len.*'noise'"):
        task.sample(1, 2_000_000)


def _check_mqar(task, x, y):
    """Independent reading: distinct keys/values in their halves, every query answered by its key's value."""
    N, V = task.num_pairs, task.vocab_size
    for xb, yb in zip(x.tolist(), y.tolist()):
        keys, values = xb[0 : 2 * N : 2], xb[1 : 2 * N : 2]
        assert len(set(keys)) == N and len(set(values)) == N
        assert all(1 <= k < V // 2 <= v < V for k, v in zip(keys, values))
        bound = dict(zip(keys, values))
        queries = [t for t, target in enumerate(yb) if target != IGNORE_INDEX]
        assert sorted(xb[t] for t in queries) == sorted(keys)
        assert all(t >= 2 * N and (t - 2 * N) % 2 == 0 and yb[t] == bound[xb[t]] for t in queries)
        others = [xb[t] for t in range(2 * N, len(xb)) if t not in queries]
        assert all(not 1 <= tok < V // 2 for tok in others)  # no key outside a query


@pytest.mark.parametrize("T", [32, 33, 57, 200])
@pytest.mark.parametrize("opts", [{}, {"vocab_size": 18}, {"vocab_size": 19, "filler": "pad"}])
def test_mqar_read_back_independently(T, opts):
    task = build_task("mqar", **opts)
    x, y = task.sample(32, T, seed=3, split="test")
    assert x.shape == y.shape == (32, T)
    _check_mqar(task, x, y)


@pytest.mark.parametrize(
    "experiment, sizes, option",
    [
        ("abab", {"n_a": 0}, "n_a"),
        ("abab", {"n_a": -1}, "n_a"),
        ("abab", {"n_values": 1}, "n_values"),
        ("abab", {"n_values": 0}, "n_values"),
        ("class_incremental", {"classes_per_phase": 0}, "classes_per_phase"),
        ("class_incremental", {"shots": 0}, "shots"),
        ("class_incremental", {"queries": 0}, "queries"),
        ("class_incremental", {"final_queries": 0}, "final_queries"),
        ("class_incremental", {"feat_dim": 0}, "feat_dim"),
        ("class_incremental", {"noise": -1.0}, "noise"),
    ],
)
def test_continual_degenerate_sizes_are_refused(experiment, sizes, option):
    # no A queries (a metric of nothing), one value (no recall), no features (nothing to classify)
    with pytest.raises(ValueError, match=rf"^{option}: expected .*got"):
        make_task(experiment, **sizes)


def test_continual_defaults_still_build():
    for experiment in ("abab", "forgetting_mqar", "class_incremental", "retention"):
        batch = make_task(experiment).batch(2, torch.Generator().manual_seed(0))
        assert (batch.targets != IGNORE_INDEX).any()

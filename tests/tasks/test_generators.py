"""Task generators: each definition's properties, determinism per seed, disjoint train/test seeds."""

from __future__ import annotations

import pytest
import torch

from mnemo.data.tasks import (
    IGNORE_INDEX,
    TASKS,
    build_task,
    make_generator,
    sample_without_replacement,
    split_seed,
    task_names,
    task_options,
)

LENGTH = {
    "mqar": 64,
    "selective_copying": 64,
    "induction_heads": 64,
    "passkey": 64,
    "niah": 64,
    "copying": 48,
    "repeat_segment": 64,
}


# --------------------------------------------------------------------------------------------
# every task
# --------------------------------------------------------------------------------------------


def test_registry_lists_the_tasks():
    assert task_names() == sorted(LENGTH)
    for name in task_names():
        assert TASKS[name].paper, name
        assert build_task(name).options() == task_options(name)


@pytest.mark.parametrize("name", sorted(LENGTH))
def test_shapes_ranges_and_supervision(name):
    task = build_task(name)
    x, y = task.sample(16, LENGTH[name], seed=3)
    assert x.shape == y.shape == (16, LENGTH[name])
    assert x.dtype == y.dtype == torch.long
    assert 0 <= int(x.min()) and int(x.max()) < task.vocab_size
    sup = y != IGNORE_INDEX
    assert sup.any(dim=1).all(), "every sequence supervises something"
    assert (0 <= y[sup]).all() and (y[sup] < task.vocab_size).all()
    assert (y[~sup] == IGNORE_INDEX).all()


@pytest.mark.parametrize("name", sorted(LENGTH))
def test_deterministic_per_seed_and_train_test_differ(name):
    task = build_task(name)
    T = LENGTH[name]
    a = task.sample(8, T, seed=5)
    b = task.generate(8, T, make_generator(5, "train"))
    c = task.sample(8, T, seed=6)
    test = task.sample(8, T, seed=5, split="test")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], test[0])
    # a generator continues its stream: two consecutive batches differ
    g = make_generator(5)
    assert not torch.equal(task.generate(8, T, g)[0], task.generate(8, T, g)[0])


def test_split_seeds_are_disjoint():
    train = {split_seed(s, "train") for s in range(200)}
    test = {split_seed(s, "test") for s in range(200)}
    assert not train & test
    with pytest.raises(ValueError, match="split must be one of"):
        split_seed(0, "val")
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        split_seed(-1, "train")


@pytest.mark.parametrize("name", sorted(LENGTH))
def test_too_short_sequences_and_bad_arguments_are_named(name):
    task = build_task(name)
    with pytest.raises(ValueError, match=r"seq_len: .* needs sequences of at least"):
        task.sample(2, task.min_length - 1)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        task.generate(2, LENGTH[name], 0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        task.generate(0, LENGTH[name], make_generator(0))


def test_unknown_task_and_options_are_named():
    with pytest.raises(ValueError, match="unknown task 'mqr'; registered tasks: copying, induction_heads"):
        build_task("mqr")
    with pytest.raises(ValueError, match=r"unknown mqar option\(s\) \['pairs'\]; known options"):
        build_task("mqar", pairs=3)
    with pytest.raises(ValueError, match="mqar option 'num_pairs': expected an int >= 1, got 0"):
        build_task("mqar", num_pairs=0)
    with pytest.raises(ValueError, match="mqar option 'num_pairs': 20 distinct keys need vocab_size >= 42"):
        build_task("mqar", num_pairs=20, vocab_size=32)
    with pytest.raises(ValueError, match="mqar option 'filler'"):
        build_task("mqar", filler="noise")
    with pytest.raises(ValueError, match="passkey option 'num_needles'"):
        build_task("passkey", num_needles=5, num_keys=4)
    with pytest.raises(ValueError, match="copying option 'teacher_forcing'"):
        build_task("copying", teacher_forcing="yes")


def test_sample_without_replacement_is_distinct_and_weighted():
    g = make_generator(0)
    idx = sample_without_replacement(500, 10, 10, g)
    assert (idx.sort(-1).values == torch.arange(10)).all()  # a permutation per row
    w = torch.log(torch.tensor([100.0] + [1.0] * 9))
    first = sample_without_replacement(2000, 10, 1, g, log_weights=w)[:, 0]
    assert (first == 0).float().mean() > 0.85  # 100/109 = 0.92


# --------------------------------------------------------------------------------------------
# MQAR
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("filler", ["random", "pad"])
def test_mqar_definition(filler):
    N, V, T = 8, 64, 96
    task = build_task("mqar", num_pairs=N, vocab_size=V, filler=filler)
    x, y = task.sample(64, T, seed=1)
    half = V // 2
    keys, values = x[:, 0 : 2 * N : 2], x[:, 1 : 2 * N : 2]
    assert ((keys >= 1) & (keys < half)).all(), "keys come from the lower half (0 is the pad)"
    assert ((values >= half) & (values < V)).all(), "values come from the upper half"
    for b in range(x.shape[0]):
        assert len(set(keys[b].tolist())) == N and len(set(values[b].tolist())) == N
        pos = (y[b] != IGNORE_INDEX).nonzero()[:, 0]
        assert len(pos) == N and (pos >= 2 * N).all(), "N queries, all after the context"
        assert sorted(x[b, pos].tolist()) == sorted(keys[b].tolist()), "each key queried exactly once"
        lookup = dict(zip(keys[b].tolist(), values[b].tolist()))
        assert y[b, pos].tolist() == [lookup[k] for k in x[b, pos].tolist()], "label = the key's value"
        rest = torch.ones(T, dtype=torch.bool)
        rest[: 2 * N] = False
        rest[pos] = False  # everything else, the token after each query included, is filler
        if filler == "pad":
            assert (x[b, rest] == 0).all()
        else:
            assert (x[b, rest] >= half).all(), "random filler never looks like a key"
    assert (y[:, : 2 * N] == IGNORE_INDEX).all()


def test_mqar_query_gaps_follow_a_power_law():
    N, T = 4, 1024
    x, y = build_task("mqar", num_pairs=N, vocab_size=64).sample(512, T, seed=0)
    pos = (y != IGNORE_INDEX).nonzero()[:, 1]
    slots = (pos - 2 * N) // 2
    S = (T - 2 * N) // 2
    early = (slots < S // 2).float().mean().item()
    assert early > 0.75, f"a power law puts most queries early (uniform would give 0.5), got {early:.2f}"
    assert slots.max() > S // 2, "but some far away"


# --------------------------------------------------------------------------------------------
# selective copying, induction heads, passkey, copying
# --------------------------------------------------------------------------------------------


def test_selective_copying_definition():
    n, V, T = 16, 16, 256
    task = build_task("selective_copying", num_tokens=n, vocab_size=V)
    x, y = task.sample(32, T, seed=2)
    C = T - n
    assert (x[:, C:] == V - 1).all() and (x[:, :C] != V - 1).all(), "markers only at the end"
    for b in range(x.shape[0]):
        data = x[b, :C][x[b, :C] != 0]
        assert len(data) == n and ((data >= 1) & (data < V - 1)).all()
        assert y[b, C:].tolist() == data.tolist(), "the data tokens, in order"
    assert (y[:, :C] == IGNORE_INDEX).all()
    # the data positions are spread over the context, not clustered
    pos = (x[:, :C] != 0).nonzero()[:, 1].float()
    assert pos.min() < C / 8 and pos.max() > 7 * C / 8


@pytest.mark.parametrize("T", [16, 256, 4096])
def test_induction_heads_definition(T):
    V = 16
    x, y = build_task("induction_heads", vocab_size=V).sample(64, T, seed=4)
    trig = V - 1
    assert ((x == trig).sum(dim=1) == 2).all(), "the trigger appears exactly twice"
    assert (x[:, -1] == trig).all()
    p = (x[:, :-1] == trig).int().argmax(dim=1)
    assert (p <= T - 3).all()
    assert torch.equal(y[:, -1], x[torch.arange(64), p + 1]), "answer = the token after the first trigger"
    assert (y[:, :-1] == IGNORE_INDEX).all()
    if T >= 256:  # the first trigger can sit anywhere
        assert p.min() < T // 4 and p.max() > 3 * T // 4


@pytest.mark.parametrize("filler", ["random", "repeat"])
@pytest.mark.parametrize("num_needles", [1, 3])
def test_passkey_definition(filler, num_needles):
    L, F, T = 5, 16, 128
    task = build_task("passkey", value_len=L, filler_vocab=F, filler=filler, num_needles=num_needles)
    x, y = task.sample(32, T, seed=7)
    H = T - L - 1
    assert (x[:, H] == task.query_token).all()
    for b in range(x.shape[0]):
        starts = (x[b, :H] == task.needle_token).nonzero()[:, 0]
        assert len(starts) == num_needles
        needles = {int(x[b, s + 1]): x[b, s + 2 : s + 2 + L].tolist() for s in starts}
        assert len(needles) == num_needles, "distinct keys"
        key = int(x[b, H + 1])
        assert y[b, H + 1 :].tolist() == needles[key], "the queried needle's value"
        assert x[b, H + 2 :].tolist() == needles[key][:-1], "teacher-forced value in the input"
        hay = torch.ones(H, dtype=torch.bool)
        for s in starts:
            hay[s : s + L + 2] = False
        assert (x[b, :H][hay] < F).all(), "the rest of the haystack is filler"
        if filler == "repeat":
            t = hay.nonzero()[:, 0]
            assert torch.equal(x[b, :H][hay], t % F)
    assert (y[:, : H + 1] == IGNORE_INDEX).all()
    depth = (x[:, :H] == task.needle_token).nonzero()[:, 1].float()
    assert depth.min() < H / 4 and depth.max() > 3 * H / 4, "needles at every depth"


@pytest.mark.parametrize("teacher_forcing", [True, False])
def test_copying_definition(teacher_forcing):
    L, V, T = 8, 32, 40
    task = build_task("copying", copy_len=L, vocab_size=V, teacher_forcing=teacher_forcing)
    x, y = task.sample(16, T, seed=8)
    data = x[:, :L]
    assert ((data >= 1) & (data < V - 1)).all()
    assert (x[:, L : T - L] == 0).all(), "blank delay"
    assert (x[:, T - L] == V - 1).all(), "marker"
    assert torch.equal(y[:, T - L :], data)
    assert (y[:, : T - L] == IGNORE_INDEX).all()
    after = x[:, T - L + 1 :]
    assert torch.equal(after, data[:, :-1]) if teacher_forcing else (after == 0).all()
    # copy_len None copies half the sequence, without a delay
    x2, y2 = build_task("copying", copy_len=None).sample(4, 20, seed=0)
    assert (y2 != IGNORE_INDEX).sum(dim=1).tolist() == [10] * 4 and torch.equal(y2[:, 10:], x2[:, :10])


@pytest.mark.parametrize("supervise", ["all", "repeat"])
def test_repeat_segment_definition(supervise):
    L, V, T = 8, 32, 40
    task = build_task("repeat_segment", segment_len=L, vocab_size=V, supervise=supervise)
    x, y = task.sample(64, T, seed=3)
    assert ((x >= 0) & (x < V)).all()
    for b in range(x.shape[0]):
        # some later window repeats an earlier, non-overlapping one (the last token of the repeat
        # may be the final target, one past the inputs, so L - 1 tokens are checked)
        windows = x[b].unfold(0, L - 1, 1)
        found = [
            (i, j)
            for i in range(windows.shape[0])
            for j in range(i + L, windows.shape[0])
            if torch.equal(windows[i], windows[j])
        ]
        assert found, f"sequence {b} has no repeated segment"
    if supervise == "all":
        assert torch.equal(y[:, :-1], x[:, 1:]), "next-token targets everywhere"
    else:
        n = (y != IGNORE_INDEX).sum(1)
        assert (n <= L - 1).all() and (n >= 1).all(), "only predictions inside the repeat"
        sup = y != IGNORE_INDEX
        assert torch.equal(y[:, :-1][sup[:, :-1]], x[:, 1:][sup[:, :-1]])
    with pytest.raises(ValueError, match="supervise"):
        build_task("repeat_segment", supervise="some")

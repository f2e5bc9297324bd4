"""Third break-it review of the recall tasks, the task metrics and the statistics behind claims."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task
from mnemo.sweep.stats import mean_interval
from mnemo.train.task_eval import task_metrics

# --------------------------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------------------------


def test_repeat_segment_of_one_token_supervised_on_the_repeat_is_refused():
    # a repeat of one token has no position inside it whose next token the repeat predicts: every
    # target would be IGNORE_INDEX (a training loss of nothing, a test set task_metrics refuses)
    with pytest.raises(ValueError, match="segment_len"):
        build_task("repeat_segment", segment_len=1, supervise="repeat")
    build_task("repeat_segment", segment_len=1, supervise="all")  # every position is still a target
    x, y = build_task("repeat_segment", segment_len=2, supervise="repeat").sample(8, 5, seed=1)
    assert ((y != IGNORE_INDEX).sum(1) == 1).all()  # the smallest legal repeat supervises one token


@pytest.mark.parametrize("T", [4, 5, 7, 9])
def test_repeat_segment_repeat_targets_are_derivable_by_hand(T):
    # supervise="repeat", smallest and odd lengths, batch 1: a supervised position t has
    # x[t - d] == x[t] for the repeat's offset d and its target is x[t - d + 1] (the copy), read by an
    # independent decoder that only sees the sequence and which positions are supervised
    task = build_task("repeat_segment", vocab_size=3, segment_len=2, supervise="repeat")
    for seed in range(40):
        x, y = task.sample(1, T, seed=seed)
        x, y = x[0].tolist(), y[0].tolist()
        t = [i for i, v in enumerate(y) if v != IGNORE_INDEX]
        assert len(t) == 1
        t = t[0]
        # the first copy starts d >= L = 2 tokens earlier; the target is the token after it
        assert any(x[t - d] == x[t] and y[t] == x[t - d + 1] for d in range(2, t + 1))


# --------------------------------------------------------------------------------------------
# task metrics
# --------------------------------------------------------------------------------------------


class _PositionModel(torch.nn.Module):
    """Predicts ``(3 · position) % V`` at every absolute position (the state counts the tokens)."""

    V = 5

    def forward(self, x, state=None):
        off = 0 if state is None else state
        pos = torch.arange(off, off + x.shape[1])
        logits = 2.0 * torch.nn.functional.one_hot((3 * pos) % self.V, self.V).double()
        return logits.expand(x.shape[0], -1, -1), off + x.shape[1]


def test_task_metrics_against_a_hand_count_at_every_piece_length():
    g = torch.Generator().manual_seed(0)
    N, T, V = 5, 11, _PositionModel.V
    x = torch.randint(0, V, (N, T), generator=g)
    y = torch.randint(0, V, (N, T), generator=g)
    mask = torch.rand(N, T, generator=g) < 0.5
    mask[:, 0] = True  # every row supervised
    y[~mask] = IGNORE_INDEX
    hit = (y == (3 * torch.arange(T)) % V) & mask
    # cross-entropy of logits 2·onehot: -log(e^2 / (e^2 + V - 1)) on a hit, -log(1 / (e^2 + V - 1)) else
    z = math.exp(2) + V - 1
    loss = (int(hit.sum()) * (math.log(z) - 2) + int((mask & ~hit).sum()) * math.log(z)) / int(mask.sum())
    seq = sum(bool((hit[i] == mask[i]).all()) for i in range(N)) / N
    for piece_len in (None, 1, 3, 4, 11, 50):
        r = task_metrics(_PositionModel(), x, y, batch_size=2, piece_len=piece_len)
        assert r["n"] == int(mask.sum()) and r["answers"] == N
        assert r["acc"] == int(hit.sum()) / int(mask.sum())
        assert r["seq_acc"] == seq
        assert r["loss"] == pytest.approx(loss, rel=1e-12)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_task_metrics_names_a_bad_piece_len(bad):
    # piece_len 0 or negative was silently read as 1 (token-by-token streaming), a float crashed
    # inside range() with a message that names nothing
    x = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="piece_len"):
        task_metrics(_PositionModel(), x, x.clone(), batch_size=1, piece_len=bad)


# --------------------------------------------------------------------------------------------
# statistics and claims
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [0.1, 0.7, 0.99, 1 / 3, 2.5])
@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_identical_seeds_give_their_value_and_a_zero_width_interval(v, n):
    # fsum(3 × 0.99) / 3 is 0.9899999999999999: a cell whose every seed scored 0.99 reported a mean
    # below 0.99 and a non-zero spread
    st = mean_interval([v] * n)
    assert st["mean"] == v and st["std"] == 0.0 and st["half_width"] == 0.0
    assert st["low"] == st["high"] == v


def test_the_interval_by_hand_after_the_mean_change():
    # n = 3, values 0.2, 0.5, 0.9: mean 1.6/3, s² = Σ(x − m)² / 2, t_{0.975, 2} = 4.302652729749464
    xs = [0.2, 0.5, 0.9]
    m = 1.6 / 3
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / 2)
    st = mean_interval(xs)
    assert st["mean"] == pytest.approx(m, rel=1e-15, abs=0)
    assert st["std"] == pytest.approx(s, rel=1e-14)
    assert st["half_width"] == pytest.approx(4.302652729749464 * s / math.sqrt(3), rel=1e-14)
    # n = 2: t_{0.975, 1} = tan(0.475 π) = 12.706204736174707
    st = mean_interval([1.0, 2.0])
    assert st["half_width"] == pytest.approx(12.706204736174707 * math.sqrt(0.5) / math.sqrt(2), rel=1e-14)


class _MQAROracle(torch.nn.Module):
    """Remembers the first value after each key (state ``[B, V]``, −1 unknown) and predicts it at a
    key's later occurrence, except for keys divisible by 3 (a deliberate miss a hand count sees)."""

    def __init__(self, V):
        super().__init__()
        self.V = V

    def forward(self, x, state=None):
        B, T = x.shape
        mem = torch.full((B, self.V), -1) if state is None else state[0].clone()
        prev = torch.full((B,), -1) if state is None else state[1]
        logits = torch.zeros(B, T, self.V)
        for t in range(T):
            for b in range(B):
                tok, p = int(x[b, t]), int(prev[b])
                if 1 <= p < self.V // 2 and mem[b, p] < 0:
                    mem[b, p] = tok
                if 1 <= tok < self.V // 2 and mem[b, tok] >= 0:
                    logits[b, t, (int(mem[b, tok]) + (tok % 3 == 0)) % self.V] = 1.0
            prev = x[:, t]
        return logits, (mem, prev)


def test_evaluate_task_on_mqar_against_a_hand_count_at_longer_lengths():
    from mnemo.train.task_eval import evaluate_task

    task = build_task("mqar", vocab_size=32, num_pairs=4)
    res = evaluate_task(
        _MQAROracle(32), task, [16, 37, 64], num_samples=6, batch_size=4, train_len=16, seed=5
    )
    for L, r in res.items():
        x, y = task.sample(6, L, seed=5, split="test")
        sup = y != IGNORE_INDEX
        miss = sup & (x % 3 == 0)
        assert r["n"] == int(sup.sum()) == 6 * 4
        assert r["acc"] == int((sup & ~miss).sum()) / int(sup.sum())
        assert r["seq_acc"] == float((~miss.any(1)).float().mean())


@pytest.mark.parametrize("seed", [2**63, 2**64])
def test_a_seed_too_large_for_a_generator_is_named(seed):
    # 2·seed + 1 past 2**64 − 1 failed inside torch with "Overflow when unpacking long long"
    from mnemo.data.tasks import make_generator, split_seed

    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        split_seed(seed, "test")
    with pytest.raises(ValueError, match="seed"):
        build_task("induction_heads").sample(1, 8, seed=seed)
    assert make_generator(2**63 - 1, "test").initial_seed() == 2**64 - 1  # the largest still works


@pytest.mark.parametrize("T", [3, 5, 9, 10])
def test_copying_as_much_as_fits_at_odd_and_even_lengths(T):
    # copy_len None: L = T // 2; an odd T leaves exactly one blank before the marker (the docstring
    # said "no delay"), an even one none
    task = build_task("copying", copy_len=None, vocab_size=4)
    x, y = task.sample(1, T, seed=0)
    L = T // 2
    assert (x[0, L : T - L] == 0).sum() == T - 2 * L == T % 2
    assert x[0, T - L] == task.marker_token and y[0, T - L :].tolist() == x[0, :L].tolist()

"""RULER's needles (``niah``): the layout read back by a hand scan, the haystack as the corpus or
the noise sentence with the needles cut out, the haystack's next-token targets, and the headline
metric — teacher-forced all-correct answers equal exact match of greedily generated values."""

from __future__ import annotations

import pytest
import torch

from mnemo.data.tasks import IGNORE_INDEX, build_task
from mnemo.data.tasks.niah import NOISE, _essay
from mnemo.train.task_eval import evaluate_task


def _scan(task, x):
    """By hand: the needles (key -> value) before the query, the query's key, the haystack's text."""
    A, L = task.text_vocab, task.value_len
    H = x.numel() - L - 1
    needles, text, t = {}, [], 0
    while t < H:
        if int(x[t]) == task.needle_token:
            needles[int(x[t + 1])] = [int(v) for v in x[t + 2 : t + 2 + L]]
            t += L + 2
        else:
            assert int(x[t]) < A, "outside a needle only text"
            text.append(int(x[t]))
            t += 1
    assert int(x[H]) == task.query_token
    return needles, int(x[H + 1]), text


@pytest.mark.parametrize("haystack", ["essay", "noise", "random"])
@pytest.mark.parametrize("num_needles", [1, 3])
def test_the_answer_is_the_value_of_the_queried_key(haystack, num_needles):
    task = build_task(
        "niah", haystack=haystack, haystack_loss=haystack != "random", num_needles=num_needles, value_len=5
    )
    x, y = task.sample(6, 97, seed=1)
    alphabet, essay = _essay()
    corpus = "".join(alphabet[i] for i in essay.tolist())
    noise = NOISE * 3
    for b in range(6):
        needles, key, text = _scan(task, x[b])
        assert len(needles) == num_needles, "distinct keys, non-overlapping needles"
        assert y[b, -5:].tolist() == needles[key] and x[b, -4:].tolist() == needles[key][:4]
        s = "".join(alphabet[i] for i in text)
        assert len(s) == 97 - 6 - num_needles * 7
        if haystack == "essay":
            assert s in corpus, "the text goes on after a needle where it stopped before it"
        if haystack == "noise":
            assert s in noise
        # next-token targets on the text, never where the next token is a needle's
        for t in range(97 - 6):
            if haystack == "random":
                assert y[b, t] == IGNORE_INDEX
            elif int(x[b, t + 1]) < task.text_vocab and t + 1 < 97 - 6:
                assert y[b, t] == x[b, t + 1]
            else:
                assert y[b, t] == IGNORE_INDEX
        scored = task.scored(x[b : b + 1], y[b : b + 1])[0]
        assert (scored[:-5] == IGNORE_INDEX).all() and scored[-5:].tolist() == needles[key]


def test_option_errors_name_the_option():
    with pytest.raises(ValueError, match="'haystack_loss': a 'random' haystack cannot be predicted"):
        build_task("niah", haystack="random")
    with pytest.raises(ValueError, match=r"'haystack': expected 'noise', 'essay' or 'random', got 'x'"):
        build_task("niah", haystack="x")
    with pytest.raises(ValueError, match="niah option 'value'"):
        build_task("niah", value="words")
    with pytest.raises(ValueError, match="3 needles need as many distinct keys, but num_keys = 2"):
        build_task("niah", num_needles=3, num_keys=2)
    with pytest.raises(ValueError, match="seq_len: niah .* needs sequences of at least 18 tokens, got 17"):
        build_task("niah").sample(1, 17)
    x, _ = build_task("niah").sample(1, 18)  # the shortest: one needle, one text token, the query
    assert x.shape == (1, 18) and int((x[0, :10] < build_task("niah").text_vocab).sum()) == 1


class _Oracle(torch.nn.Module):
    """A stand-in model that reads the needle's value out of its input and predicts it, except
    that it gets digit 3 wrong in sequences whose queried key is even: some sequences are right,
    some are not, with a known answer per sequence. Streams like a model (the state is the prefix)."""

    def __init__(self, task):
        super().__init__()
        self.task = task

    def _guess(self, row: list[int], t: int) -> int:
        """The token predicted at position ``t`` of ``row`` (0 outside an answer)."""
        if self.task.query_token not in row[:t]:
            return 0
        q = row.index(self.task.query_token)
        return self._answer(row, q, t, wrong_digit=3)

    def _answer(self, row: list[int], q: int, t: int, wrong_digit: int) -> int:
        """The digit that position ``t`` predicts after the query ``? κ`` at ``q`` (0 outside its
        answer), one off at ``wrong_digit`` for an even key."""
        key, digit = row[q + 1], t - (q + 1)  # which answer digit position t predicts
        if not 0 <= digit < self.task.value_len:
            return 0
        guess = row[row.index(key) + 1 + digit]  # after the needle's key (its first occurrence)
        if digit == wrong_digit and key % 2 == 0:
            guess = guess + 1 if guess + 1 < self.task.vocab_size else guess - 1
        return guess

    def forward(self, ids, state=None):
        prefix = ids if state is None else torch.cat([state, ids], 1)
        B, T = prefix.shape
        logits = torch.zeros(B, ids.shape[1], self.task.vocab_size)
        off = T - ids.shape[1]
        for b in range(B):
            row = prefix[b].tolist()
            for t in range(off, T):
                logits[b, t - off, self._guess(row, t)] = 1.0
        return logits, prefix


def _greedy_exact_match(model, task, x):
    """An independent exact match: generate ``value_len`` tokens greedily after ``? κ``."""
    L = task.value_len
    hits = []
    for b in range(x.shape[0]):
        prompt = x[b : b + 1, : x.shape[1] - L + 1]  # up to and including the key
        out = prompt
        for _ in range(L):
            nxt = model(out)[0][:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], 1)
        _, key, _ = _scan(task, x[b])
        needles, _, _ = _scan(task, x[b])
        hits.append(out[0, -L:].tolist() == needles[key])
    return hits


def test_seq_acc_is_exact_match_of_the_generated_value_at_every_length():
    task = build_task("niah", haystack="noise", value_len=5, num_needles=2, num_keys=8)
    model = _Oracle(task)
    for T in (40, 120):  # 120: streamed in pieces of 40 with the state carried
        x, y = task.sample(12, T, seed=0, split="test")
        y = task.scored(x, y)
        hits = _greedy_exact_match(model, task, x)
        assert 0 < sum(hits) < len(hits), "the oracle is right on some sequences and wrong on others"
        res = evaluate_task(model, task, [T], num_samples=12, batch_size=4, train_len=40, seed=0)[T]
        assert res["seq_acc"] == pytest.approx(sum(hits) / len(hits))
        wrong = len(hits) - sum(hits)
        assert res["acc"] == pytest.approx(1 - wrong / (12 * 5)), "one wrong digit per missed sequence"
        assert res["n"] == 12 * 5, "only the answers are scored, not the haystack"


def _scan_queries(task, x):
    """By hand: the needles before the first query and the ``(key, value)`` blocks of the queries
    (the last block's value is one token short: the sequence ends before its last digit)."""
    L, m = task.value_len, task.value_len + 2
    H = x.numel() - (task.num_queries * m - 1)
    needles, t = {}, 0
    while t < H:
        if int(x[t]) == task.needle_token:
            needles[int(x[t + 1])] = [int(v) for v in x[t + 2 : t + 2 + L]]
            t += m
        else:
            t += 1
    blocks = []
    for j in range(task.num_queries):
        o = H + j * m
        assert int(x[o]) == task.query_token
        blocks.append((int(x[o + 1]), [int(v) for v in x[o + 2 : o + 2 + L]]))
    return needles, blocks, H


@pytest.mark.parametrize("num_queries", [2, 4])
def test_multi_query_asks_distinct_needles_and_trains_every_answer(num_queries):
    """MQ-NIAH: ``q`` queries name ``q`` distinct needles; each answer's targets are its needle's
    value, shown teacher-forced; only the answers are scored, and each belongs to its own unit."""
    task = build_task("niah", haystack="noise", num_needles=4, num_queries=num_queries, value_len=3)
    T = 80
    x, y = task.sample(10, T, seed=2)
    scored, units = task.scored(x, y), task.answer_units(x, task.scored(x, y))
    for b in range(10):
        needles, blocks, H = _scan_queries(task, x[b])
        assert len(needles) == 4 and H == T - num_queries * 5 + 1
        keys = [k for k, _ in blocks]
        assert len(set(keys)) == num_queries and set(keys) <= set(needles)
        for j, (key, shown) in enumerate(blocks):
            o = H + j * 5
            want = needles[key]
            assert y[b, o + 1 : o + 4].tolist() == want, "at κ: d1, at d_i: d_(i+1)"
            assert shown == want[: len(shown)], "the values are teacher-forced"
            assert y[b, o] == IGNORE_INDEX and (j == num_queries - 1 or y[b, o + 4] == IGNORE_INDEX)
            assert units[b, o + 1 : o + 4].tolist() == [j] * 3
        assert (scored[b, :H] == IGNORE_INDEX).all() and int(
            (scored[b] != IGNORE_INDEX).sum()
        ) == 3 * num_queries
        assert ((units[b] >= 0) == (scored[b] != IGNORE_INDEX)).all()
    assert task.min_length == (4 + num_queries) * 5
    assert build_task("niah").answer_units(x, y) is None


class _MultiOracle(_Oracle):
    """The oracle for several queries: it answers the latest ``? κ`` before each position, and gets
    digit 1 wrong when the key is even."""

    def _guess(self, row: list[int], t: int) -> int:
        qs = [i for i in range(t) if row[i] == self.task.query_token]  # its key is at ≤ t
        return self._answer(row, qs[-1], t, wrong_digit=1) if qs else 0


def test_multi_query_seq_acc_is_the_share_of_answers_generated_exactly():
    """With several queries ``seq_acc`` is the fraction of answers whose value greedy decoding
    generates exactly (each answer generated after the true earlier ones), at the training length
    and streamed at 3x; ``acc`` counts digits."""
    L, nq = 4, 3
    task = build_task("niah", haystack="noise", value_len=L, num_needles=3, num_queries=nq, num_keys=8)
    model = _MultiOracle(task)
    for T in (47, 150):
        x, _ = task.sample(8, T, seed=0, split="test")
        hits = []
        for b in range(8):
            needles, blocks, H = _scan_queries(task, x[b])
            for j, (key, _) in enumerate(blocks):
                out = x[b : b + 1, : H + j * (L + 2) + 2]  # up to and including this query's key
                for _ in range(L):
                    out = torch.cat([out, model(out)[0][:, -1].argmax(-1, keepdim=True)], 1)
                hits.append(out[0, -L:].tolist() == needles[key])
        assert 0 < sum(hits) < len(hits)
        # streamed in pieces of 47 at 150 tokens: the boundary at 141 cuts the answers' block
        res = evaluate_task(model, task, [T], num_samples=8, batch_size=3, train_len=47, seed=0)[T]
        assert res["seq_acc"] == pytest.approx(sum(hits) / len(hits)) and res["answers"] == 8 * nq
        assert res["acc"] == pytest.approx(1 - (len(hits) - sum(hits)) / (8 * nq * L))
        assert res["n"] == 8 * nq * L


def test_multi_query_and_unit_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"'num_queries': expected at most num_needles = 2 queries .* got 3"):
        build_task("niah", num_needles=2, num_queries=3)
    with pytest.raises(ValueError, match="num_queries"):
        build_task("niah", num_queries=0)
    from mnemo.train.task_eval import task_metrics

    task = build_task("niah", haystack="noise", num_needles=2, num_queries=2, value_len=2)
    x, y = task.sample(2, 30, seed=0)
    y = task.scored(x, y)
    units = task.answer_units(x, y)
    with pytest.raises(ValueError, match=r"units: expected the targets' shape \[2, 30\], got \[2, 29\]"):
        task_metrics(_MultiOracle(task), x, y, batch_size=2, units=units[:, 1:])
    with pytest.raises(
        ValueError, match=r"units: every supervised position needs .* got -1 at sequence 0, position"
    ):
        task_metrics(_MultiOracle(task), x, y, batch_size=2, units=torch.full_like(units, -1))

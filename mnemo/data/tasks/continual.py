"""The in-context continual-learning streams of ``mnemo continual`` (:mod:`mnemo.commands.continual`
defines each task, its metrics and the model that reads them): ``abab``, ``forgetting_mqar``,
``class_incremental`` and ``retention``. They are not registry tasks (:mod:`mnemo.data.tasks`): a
stream carries vector inputs and a tag per query beside its tokens and targets (:class:`Batch`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

EXPERIMENTS = ("abab", "forgetting_mqar", "class_incremental", "retention")
BOS, QUERY = 0, 1  # token ids shared by every task

# --------------------------------------------------------------------------------------------
# stream generators


class Batch(NamedTuple):
    """A batch of streams. ``ids [B, T]`` tokens; ``feats [B, T, F]`` vector inputs or ``None``;
    ``targets [B, T]`` (``-100`` = unsupervised); ``tags [B, T]`` the metric each supervised position
    counts towards (``0`` none); ``alt [B, T]`` a second label to count (stale values) or ``-100``."""

    ids: torch.Tensor
    feats: torch.Tensor | None
    targets: torch.Tensor
    tags: torch.Tensor
    alt: torch.Tensor


class _Builder:
    """Accumulates one stream (token, target, tag, alt, feature per position)."""

    def __init__(self, feat_dim: int = 0):
        self.ids, self.tgt, self.tag, self.alt, self.feat = [], [], [], [], []
        self.feat_dim = feat_dim

    def add(self, tok, target=-100, tag=0, alt=-100, feat=None):
        self.ids.append(int(tok))
        self.tgt.append(int(target))
        self.tag.append(int(tag))
        self.alt.append(int(alt))
        if self.feat_dim:
            self.feat.append(feat if feat is not None else torch.zeros(self.feat_dim))


def _check_sizes(task, **minimum: int) -> None:
    """Raise ``ValueError`` naming the first size of ``task`` that is not an int ``>= minimum[name]``;
    a NumPy integer counts as an int and is kept as one (the task's sizes are saved as JSON)."""
    for name, low in minimum.items():
        v = getattr(task, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
        setattr(task, name, int(v))


def _stack(builders) -> Batch:
    def t(name):
        return torch.tensor([getattr(b, name) for b in builders], dtype=torch.long)

    lengths = {len(b.ids) for b in builders}
    if len(lengths) != 1:
        raise ValueError(f"streams of unequal lengths {sorted(lengths)}")
    feats = None
    if builders[0].feat_dim:
        feats = torch.stack([torch.stack(b.feat) for b in builders])
    return Batch(t("ids"), feats, t("tgt"), t("tag"), t("alt"))


@dataclass
class ABABTask:
    """In-context A → B → A with disjoint key sets (see the module docstring). Tags: 1 ``A_after_B``,
    2 ``B``, 3 ``A_before_B``, 4 ``B_baseline`` (B queries of the baseline stream)."""

    n_a: int = 8
    n_b: int = 24
    n_keys: int = 32
    n_values: int = 16
    metrics = {"A_after_B": 1, "B": 2, "A_before_B": 3}

    def __post_init__(self):
        # an A key to query (else A_after_B is a mean of nothing); two values (one is no recall)
        _check_sizes(self, n_a=1, n_b=1, n_keys=1, n_values=2)
        if self.n_a + self.n_b > self.n_keys:
            raise ValueError(f"n_a + n_b: expected <= n_keys = {self.n_keys}, got {self.n_a + self.n_b}")
        if self.n_a > self.n_b:
            raise ValueError(f"n_a: expected <= n_b = {self.n_b} (n_a B keys are queried), got {self.n_a}")

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_keys + self.n_values

    def key(self, i):
        return 2 + i

    def value(self, j):
        return 2 + self.n_keys + j

    def stream(self, gen: torch.Generator, interference: bool) -> _Builder:
        perm = torch.randperm(self.n_keys, generator=gen).tolist()
        A, B = perm[: self.n_a], perm[self.n_a : self.n_a + self.n_b]
        val = dict(zip(A + B, torch.randint(self.n_values, (self.n_a + self.n_b,), generator=gen).tolist()))
        qb = [B[i] for i in torch.randperm(self.n_b, generator=gen)[: self.n_a].tolist()]
        s = _Builder()
        s.add(BOS)

        def pairs(keys):
            for k in keys:
                s.add(self.key(k))
                s.add(self.value(val[k]))

        def queries(keys, tag_of):
            for k in keys:
                s.add(self.key(k))
                s.add(QUERY, self.value(val[k]), tag_of(k))

        pairs(A)
        if interference:
            pairs(B)
            both = A + qb
            order = torch.randperm(len(both), generator=gen).tolist()
            aset = set(A)
            queries([both[i] for i in order], lambda k: 1 if k in aset else 2)
        else:
            queries([A[i] for i in torch.randperm(self.n_a, generator=gen).tolist()], lambda k: 3)
            pairs(B)
            queries(qb, lambda k: 4)
        return s

    def batch(self, batch_size: int, gen: torch.Generator) -> Batch:
        return _stack([self.stream(gen, interference=i % 2 == 0) for i in range(batch_size)])


@dataclass
class ForgettingMQARTask:
    """``n`` key–value pairs, then ``m`` of the keys reassigned a new value, then queries of all keys;
    the target is the latest value. Tags: 1 ``reassigned`` (``alt`` = the stale value), 2 ``untouched``."""

    n: int = 16
    m: int = 8
    n_keys: int = 32
    n_values: int = 16
    metrics = {"reassigned": 1, "untouched": 2}

    def __post_init__(self):
        _check_sizes(self, n=1, m=1, n_keys=1, n_values=2)  # (a float or bool crashed in randperm/randint;
        # one value is no recall)
        if not 0 < self.m <= self.n <= self.n_keys:
            raise ValueError(f"(n, m): expected 0 < m <= n <= n_keys = {self.n_keys}, got {(self.n, self.m)}")

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_keys + self.n_values

    def stream(self, gen: torch.Generator) -> _Builder:
        keys = torch.randperm(self.n_keys, generator=gen)[: self.n].tolist()
        old = dict(zip(keys, torch.randint(self.n_values, (self.n,), generator=gen).tolist()))
        moved = [keys[i] for i in torch.randperm(self.n, generator=gen)[: self.m].tolist()]
        shift = torch.randint(1, self.n_values, (self.m,), generator=gen).tolist()
        new = {k: (old[k] + d) % self.n_values for k, d in zip(moved, shift)}  # always a new value
        s = _Builder()
        s.add(BOS)
        K, V = 2, 2 + self.n_keys
        for k in keys:
            s.add(K + k)
            s.add(V + old[k])
        for k in moved:
            s.add(K + k)
            s.add(V + new[k])
        for i in torch.randperm(self.n, generator=gen).tolist():
            k = keys[i]
            s.add(K + k)
            if k in new:
                s.add(QUERY, V + new[k], 1, V + old[k])
            else:
                s.add(QUERY, V + old[k], 2)
        return s

    def batch(self, batch_size: int, gen: torch.Generator) -> Batch:
        return _stack([self.stream(gen) for _ in range(batch_size)])


@dataclass
class ClassIncrementalTask:
    """In-context class-incremental learning (see the module docstring). Token ids: 0 BOS, 1 ``?``,
    2 the "example" token (its vector input carries the features), labels ``3 … 3 + n_labels − 1``.
    Tags: ``1 + p`` a query of phase ``p`` just after phase ``p``; ``1 + P + p`` a final query of
    phase ``p``."""

    phases: int = 4
    classes_per_phase: int = 2
    shots: int = 3
    queries: int = 1
    final_queries: int = 2
    n_labels: int = 16
    feat_dim: int = 16
    noise: float = 1.0

    def __post_init__(self):
        # every phase shows and queries a class, and an example carries features to classify by
        _check_sizes(
            self, phases=1, classes_per_phase=1, shots=1, queries=1, final_queries=1, n_labels=1, feat_dim=1
        )
        if not isinstance(self.noise, (int, float)) or isinstance(self.noise, bool) or not self.noise >= 0:
            raise ValueError(f"noise: expected a number >= 0, got {self.noise!r}")
        if self.phases * self.classes_per_phase > self.n_labels:
            raise ValueError(
                f"phases * classes_per_phase: expected <= n_labels = {self.n_labels}, "
                f"got {self.phases * self.classes_per_phase}"
            )
        if self.phases < 2:
            raise ValueError(f"phases: expected >= 2 (BWT needs two), got {self.phases}")

    @property
    def vocab_size(self) -> int:
        return 3 + self.n_labels

    @property
    def metrics(self):
        P = self.phases
        m = {f"just_after_{p}": 1 + p for p in range(P)}
        m.update({f"final_{p}": 1 + P + p for p in range(P)})
        return m

    def stream(self, gen: torch.Generator) -> tuple[_Builder, list[list[int]]]:
        P, k = self.phases, self.classes_per_phase
        labels = torch.randperm(self.n_labels, generator=gen)[: P * k].tolist()
        phase_labels = [labels[p * k : (p + 1) * k] for p in range(P)]
        protos = torch.randn(P * k, self.feat_dim, generator=gen)
        s = _Builder(self.feat_dim)
        s.add(BOS)

        def example(c):
            return protos[c] + self.noise * torch.randn(self.feat_dim, generator=gen)

        def query_block(classes, tag_of, n):
            order = [c for c in classes for _ in range(n)]
            for i in torch.randperm(len(order), generator=gen).tolist():
                c = order[i]
                s.add(2, feat=example(c))
                s.add(QUERY, 3 + labels[c], tag_of(c))

        for p in range(P):
            cls = list(range(p * k, (p + 1) * k))
            shots = [c for c in cls for _ in range(self.shots)]
            for i in torch.randperm(len(shots), generator=gen).tolist():
                c = shots[i]
                s.add(2, feat=example(c))
                s.add(3 + labels[c])
            query_block(cls, lambda c, p=p: 1 + p, self.queries)
        query_block(list(range(P * k)), lambda c: 1 + P + c // k, self.final_queries)
        return s, phase_labels

    def batch(self, batch_size: int, gen: torch.Generator) -> Batch:
        return _stack([self.stream(gen)[0] for _ in range(batch_size)])


@dataclass
class RetentionTask:
    """Recall graded by age: ``n`` key–value pairs with distinct keys, then ``per_bin`` queries from
    each of ``bins`` age bins, shuffled; the target is the key's value. The pairs are cut into
    ``bins`` consecutive groups in the order they were shown (pair ``i`` falls in group
    ``i · bins // n``); age bin ``j = bins − 1 − group``, so ``j = 0`` holds the newest pairs and
    ``j = bins − 1`` the oldest. Tags: ``1 + j``. Few queries (``bins · per_bin`` against ``n``
    pairs) limit the queries' own writes; shuffling spreads them evenly over the bins.

    The pairs start after ``2r`` extra ``BOS`` tokens, ``r`` uniform in ``0 … offset`` per stream,
    and ``2(offset − r)`` more ``BOS`` close the stream after the last query (every stream of a
    batch has the same length): a slow level's period boundaries fall on different pairs in
    different streams, so no pair's age is tied to one absolute position.

    Raises:
        ValueError: ``n`` not in ``1 … n_keys``; ``bins < 2``; ``per_bin`` not in ``1 … n // bins``
            (the smallest bin's pairs); ``n_values < 2``; ``offset < 0``.
    """

    n: int = 24
    bins: int = 4
    per_bin: int = 2
    n_keys: int = 64
    n_values: int = 16
    offset: int = 8

    def __post_init__(self):
        _check_sizes(
            self, n=1, bins=1, per_bin=1, n_keys=1, offset=0, n_values=2
        )  # (a float or bool crashed)
        if not 0 < self.n <= self.n_keys:
            raise ValueError(f"n: expected 0 < n <= n_keys = {self.n_keys}, got {self.n}")
        if self.bins < 2:
            raise ValueError(f"bins: expected >= 2 (an oldest and a newest), got {self.bins}")
        if not 0 < self.per_bin <= self.n // self.bins:
            raise ValueError(
                f"per_bin: expected 1 .. n // bins = {self.n // self.bins} (the smallest bin's pairs), "
                f"got {self.per_bin}"
            )

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_keys + self.n_values

    @property
    def metrics(self):
        return {f"age_{j}": 1 + j for j in range(self.bins)}

    def stream(self, gen: torch.Generator) -> _Builder:
        keys = torch.randperm(self.n_keys, generator=gen)[: self.n].tolist()
        vals = torch.randint(self.n_values, (self.n,), generator=gen).tolist()
        r = int(torch.randint(self.offset + 1, (1,), generator=gen))
        s = _Builder()
        for _ in range(1 + 2 * r):
            s.add(BOS)
        K, V = 2, 2 + self.n_keys
        for k, v in zip(keys, vals):
            s.add(K + k)
            s.add(V + v)
        asked = []  # (pair index, age bin)
        for group in range(self.bins):
            members = [i for i in range(self.n) if i * self.bins // self.n == group]
            pick = torch.randperm(len(members), generator=gen)[: self.per_bin].tolist()
            asked += [(members[i], self.bins - 1 - group) for i in pick]
        for o in torch.randperm(len(asked), generator=gen).tolist():
            i, j = asked[o]
            s.add(K + keys[i])
            s.add(QUERY, V + vals[i], 1 + j)
        for _ in range(2 * (self.offset - r)):
            s.add(BOS)
        return s

    def batch(self, batch_size: int, gen: torch.Generator) -> Batch:
        return _stack([self.stream(gen) for _ in range(batch_size)])


def make_task(experiment: str, **overrides):
    cls = {
        "abab": ABABTask,
        "forgetting_mqar": ForgettingMQARTask,
        "class_incremental": ClassIncrementalTask,
        "retention": RetentionTask,
    }
    if experiment not in cls:
        raise ValueError(f"experiment: expected one of {EXPERIMENTS}, got {experiment!r}")
    return cls[experiment](**overrides)

"""Hand-built circuits: a previous-token head, a two-layer induction circuit, copying heads."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.interp import (
    capture_maps,
    copying_score,
    duplicate_token_score,
    icl_score,
    induction_score,
    mixing,
    previous_token_score,
    sink_score,
)
from mnemo.layers import Attention
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close

V = 8  # vocabulary
HD = 16  # head dim: 8 rotary frequency pairs


def _rope_prev_token_qk(att: Attention, src_dim: int, a: float = 9.0) -> None:
    """q = c, k = R(θ) c from a constant residual dimension: with RoPE the score is
    |c|² Σ_i cos((n − m + 1) θ_i), maximal at key n = m − 1 for every frequency at once."""
    theta = att.rotary.inv_freq.double()
    half = HD // 2
    q = torch.zeros(HD, dtype=torch.float64)
    q[:half] = a
    k = torch.cat([a * torch.cos(theta), a * torch.sin(theta)])  # R(θ) applied to (a, 0) pairs
    with torch.no_grad():
        att.q_proj.weight.zero_()
        att.kv_proj.weight.zero_()
        att.q_proj.weight[:, src_dim] = q
        att.kv_proj.weight[:HD, src_dim] = k


def _stream(ids):
    """Residual stream: dim 0 constant, dims 1..V current token one-hot, dims 1+V..2V free."""
    B, T = ids.shape
    x = torch.zeros(B, T, 1 + 2 * V, dtype=torch.float64)
    x[..., 0] = 1.0
    x[..., 1 : 1 + V] = torch.nn.functional.one_hot(ids, V).double()
    return x


def _perm_twice(batch=4, gen=None):
    seq = torch.stack([torch.randperm(V, generator=gen) for _ in range(batch)])
    return torch.cat([seq, seq], 1)


def test_wired_previous_token_head_scores_one():
    att = Attention(1 + 2 * V, n_heads=1, head_dim=HD).double()
    _rope_prev_token_qk(att, 0)
    ids = _perm_twice(gen=torch.Generator().manual_seed(0))
    maps = mixing(att, _stream(ids)).maps
    assert previous_token_score(maps)[0] > 0.95
    assert induction_score(maps, V)[0] < 0.05


def test_wired_two_layer_induction_circuit_scores_one():
    d = 1 + 2 * V
    prev = Attention(d, n_heads=1, head_dim=HD).double()
    _rope_prev_token_qk(prev, 0)
    with torch.no_grad():  # layer 1 values: the token one-hot; output: into the "previous token" dims
        prev.kv_proj.weight[HD:] = 0
        prev.o_proj.weight.zero_()
        for t in range(V):
            prev.kv_proj.weight[HD + t, 1 + t] = 1.0
            prev.o_proj.weight[1 + V + t, t] = 1.0
    ind = Attention(d, n_heads=1, head_dim=HD, rope=False).double()
    with torch.no_grad():  # layer 2: query = current token, key = previous token (content match)
        ind.q_proj.weight.zero_()
        ind.kv_proj.weight.zero_()
        for t in range(V):
            ind.q_proj.weight[t, 1 + t] = 6.0
            ind.kv_proj.weight[t, 1 + V + t] = 6.0
    ids = _perm_twice(gen=torch.Generator().manual_seed(1))
    x0 = _stream(ids)
    x1 = x0 + prev(x0)[0]
    maps = mixing(ind, x1).maps
    assert induction_score(maps, V)[0] > 0.9
    # without an earlier occurrence (first copy) it spreads out, so its previous-token share is small
    assert previous_token_score(maps)[0] < 0.2
    assert duplicate_token_score(maps, ids)[0] < 0.1  # it looks one past the duplicate, not at it


def test_copying_score_signs():
    torch.manual_seed(0)
    m = LanguageModel(
        build_config(
            "transformer", vocab_size=12, d_model=16, n_layers=1, mixer_options={"attention": {"n_heads": 2}}
        )
    ).double()
    with torch.no_grad():
        att = m.blocks[0].mixer
        D = att.head_dim
        # head 0: W_V W_O = identity on its 8 dims -> OV = W_E W_U restricted: positive (copying)
        att.kv_proj.weight[2 * D * 0 + 16 : 16 + 2 * D] = 0  # clear values
        att.kv_proj.weight[16:24] = torch.eye(16)[:8]
        att.kv_proj.weight[24:32] = torch.eye(16)[8:]
        att.o_proj.weight.zero_()
        att.o_proj.weight[:8, :8] = torch.eye(8)
        att.o_proj.weight[8:, 8:] = -torch.eye(8)  # head 1: negated -> anti-copying
        m.lm_head.weight.copy_(m.embed.weight)
    s = copying_score(m, 0)
    assert s[0] > 0.9 and s[1] < -0.9


class _Copier(torch.nn.Module):
    """Logits ``a`` on the token that followed the latest earlier occurrence of the current token
    (an ideal induction circuit, with ``a < 0`` an anti-copier), ``0`` elsewhere: uniform where the
    token has not been seen before."""

    def __init__(self, vocab: int, a: float):
        super().__init__()
        self.vocab, self.a = vocab, a

    def forward(self, ids):
        B, T = ids.shape
        logits = torch.zeros(B, T, self.vocab, dtype=torch.float64)
        for b in range(B):
            for t in range(T):
                earlier = [s for s in range(t) if ids[b, s] == ids[b, t]]
                if earlier:
                    logits[b, t, ids[b, earlier[-1] + 1]] = self.a
        return logits, None


def test_icl_score_value_and_sign_on_built_models():
    """Random tokens repeated once (``T = 2L``): the positions in the late span (the last 20%) all
    sit in the second copy, the early ones (5% to 15%) in the first. Uniform logits: the loss is
    ``ln V`` everywhere, score exactly 0. The ideal copier puts ``a`` on the right token in the
    second copy: late loss ``ln(1 + (V − 1) e^{−a})``, early ``ln V``, score the difference
    (strongly negative: later tokens are predicted better); the anti-copier (``−a``) scores
    positive."""
    Vocab, L, a = 50, 40, 8.0
    ids = _perm_twice_of(Vocab, L, batch=3, gen=torch.Generator().manual_seed(2))
    # (icl_score takes the loss in float32: agreement to ~1e-7)
    assert icl_score(_Copier(Vocab, 0.0), ids) == pytest.approx(0.0, abs=1e-6)
    late = math.log(1 + (Vocab - 1) * math.exp(-a))  # the right token has logit a, the others 0
    assert icl_score(_Copier(Vocab, a), ids) == pytest.approx(late - math.log(Vocab), abs=1e-6)  # -3.9
    anti = math.log(math.exp(-a) + Vocab - 1) + a  # the right token has logit -a, the others 0
    assert icl_score(_Copier(Vocab, -a), ids) == pytest.approx(anti - math.log(Vocab), abs=1e-6)  # +8.0


def _perm_twice_of(vocab, length, batch, gen):
    seq = torch.stack([torch.randperm(vocab, generator=gen)[:length] for _ in range(batch)])
    return torch.cat([seq, seq], 1)


def test_icl_score_and_capture_on_a_model():
    """On a real model: the score is the late-span mean loss minus the early-span one, written out
    here for ``T = 39`` predicted positions (early: 1..5, late: 31..38)."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("transformer", vocab_size=20, d_model=16, n_layers=2))
    ids = torch.randint(0, 20, (3, 40))
    with torch.no_grad():
        logits, _ = m(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(0)
    want = (loss[31:39].mean() - loss[1:6].mean()).item()
    assert icl_score(m, ids) == pytest.approx(want, rel=1e-6, abs=1e-7)
    maps = capture_maps(m, ids)
    assert set(maps) == {0, 1} and maps[0].shape == (3, 4, 40, 40)
    assert_close(maps[0].sum(-1), torch.ones(3, 4, 40), 1e-6, what="softmax rows sum to one")


def test_sink_score_on_known_maps():
    """Uniform causal attention puts 1/(t+1) on position 0: the score equals the uniform level
    (mean over t = 4..7 of 1/(t+1) = (1/5 + 1/6 + 1/7 + 1/8) / 4); a head whose every query attends
    to position 0 alone scores 1; a previous-token head 0 (past position 1)."""
    T = 8
    causal = torch.tril(torch.ones(T, T))
    uniform_map = (causal / causal.sum(-1, keepdim=True))[None, None]
    sink = torch.zeros(T, T)
    sink[:, 0] = 1.0
    prev = torch.zeros(T, T)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    maps = torch.cat([uniform_map, sink[None, None], prev[None, None]], dim=1)  # [1, 3, T, T]
    score, uniform = sink_score(maps)
    level = (1 / 5 + 1 / 6 + 1 / 7 + 1 / 8) / 4
    assert uniform == pytest.approx(level, rel=1e-12)
    assert score.tolist() == pytest.approx([level, 1.0, 0.0], abs=1e-7)
    score2, uniform2 = sink_score(maps, start=1)
    assert uniform2 == pytest.approx(sum(1 / (t + 1) for t in range(1, T)) / (T - 1))
    assert score2[1] == 1.0
    with pytest.raises(ValueError, match=r"start: expected a query position in \[0, 8\), got 8"):
        sink_score(maps, start=8)


def test_scores_skip_a_bos_sink_without_renormalising_the_rows():
    """A head that puts 0.6 of every row on position 0 (a BOS sink) and 0.4 on the previous token
    (the first real token: all on the sink): with ``skip=1`` its previous-token score is 0.4 (the
    sink's share is dropped, not shared out: renormalising would read 1.0); without the skip the
    step from position 1 onto the BOS counts too, (1 + 5 · 0.4) / 6 = 0.5. Its induction and
    duplicate-token scores follow the same rule."""
    L = 3
    T = 1 + 2 * L  # BOS, a b c, a b c
    ids = torch.tensor([[9, 1, 2, 3, 1, 2, 3]])
    m = torch.zeros(1, 1, T, T)
    m[0, 0, 0, 0] = m[0, 0, 1, 0] = 1.0
    for t in range(2, T):
        m[0, 0, t, 0], m[0, 0, t, t - 1] = 0.6, 0.4
    assert previous_token_score(m, skip=1).item() == pytest.approx(0.4)
    assert previous_token_score(m).item() == pytest.approx(0.5)
    # an induction head shape: from real position i of the second copy to i − L + 1, weight 0.25
    ind = torch.zeros(1, 1, T, T)
    ind[..., :, 0] = 0.75
    for i in range(L, 2 * L):  # every real position of the second copy; +1 in the map
        ind[0, 0, 1 + i, 1 + i - L + 1] = 0.25
    ind[0, 0, 0, 0] = 1.0
    for t in range(1, T):
        if ind[0, 0, t].sum() < 1:
            ind[0, 0, t, t] = 1 - ind[0, 0, t].sum()
    assert induction_score(ind, L, skip=1).item() == pytest.approx(0.25)
    # duplicate tokens: real positions 3, 4, 5 hold an earlier token; this map puts 0.5 there
    dup = torch.zeros(1, 1, T, T)
    dup[..., :, 0] = 0.5
    dup[0, 0, 0, 0] = 1.0
    for t in range(1, T):
        dup[0, 0, t, t - L if t > L else t] += 0.5
    assert duplicate_token_score(dup, ids, skip=1).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"skip: expected a number of leading positions in \[0, 5\] .*got 6"):
        previous_token_score(m, skip=T - 1)
    with pytest.raises(ValueError, match="maps cover 6 positions after skip = 1, need 2 \\* length = 8"):
        induction_score(ind, 4, skip=1)


def test_repeated_random_tokens_put_a_bos_first_and_never_draw_it():
    """``bos``: ``[BOS, seq, seq]``; the copies never hold the BOS (drawn from one id fewer and
    shifted over it when it lies in their range; unchanged when it lies below ``offset``)."""
    from mnemo.interp.scores import repeated_random_tokens

    plain = repeated_random_tokens(64, 5, 6, torch.Generator().manual_seed(3))
    assert plain.shape == (64, 10) and torch.equal(plain[:, :5], plain[:, 5:])
    ids = repeated_random_tokens(64, 5, 6, torch.Generator().manual_seed(3), bos=2)
    assert ids.shape == (64, 11) and (ids[:, 0] == 2).all() and torch.equal(ids[:, 1:6], ids[:, 6:])
    drawn = torch.randint(0, 5, (64, 5), generator=torch.Generator().manual_seed(3))
    assert torch.equal(ids[:, 1:6], drawn + (drawn >= 2).long())  # 0 1 | 3 4 5: every id but the BOS
    assert set(ids[:, 1:].unique().tolist()) == {0, 1, 3, 4, 5}
    low = repeated_random_tokens(64, 5, 6, torch.Generator().manual_seed(3), offset=3, bos=1)
    assert set(low[:, 1:].unique().tolist()) == {3, 4, 5} and (low[:, 0] == 1).all()
    for bad in (-1, 6):
        with pytest.raises(ValueError, match=rf"bos: expected a token id in \[0, 6\) .* got {bad}"):
            repeated_random_tokens(2, 5, 6, bos=bad)


def test_induction_score_averages_every_query_of_the_second_copy():
    """Olsson et al.'s prefix matching: from each position ``i`` of the second copy (``L … 2L − 1``,
    all ``L`` of them; the last one's earlier occurrence is followed by the second copy's first
    token) to ``i − L + 1``, on the row-normalised maps; a hand loop over random maps."""
    gen = torch.Generator().manual_seed(0)
    L, skip = 5, 1
    maps = torch.rand(2, 3, 2 * L + skip, 2 * L + skip, generator=gen, dtype=torch.float64).tril()
    p = maps / maps.sum(-1, keepdim=True)
    hand = torch.zeros(3, dtype=torch.float64)
    for h in range(3):
        vals = [p[b, h, skip + i, skip + i - L + 1] for b in range(2) for i in range(L, 2 * L)]
        hand[h] = sum(vals) / len(vals)
    assert_close(induction_score(maps, L, skip=skip), hand, 1e-12)


def test_score_inputs_are_named_when_they_are_wrong():
    from mnemo.interp import capture_maps, circuit_scores

    maps = torch.rand(1, 2, 6, 6)
    with pytest.raises(ValueError, match=r"length: expected an int >= 2, got 0"):
        induction_score(maps, 0)
    with pytest.raises(ValueError, match=r"length: expected an int >= 2, got 1"):
        induction_score(maps, 1)
    with pytest.raises(ValueError, match=r"maps: expected a tensor \[B, H, T, T\] .*got \[2, 6, 6\]"):
        induction_score(maps[0], 3)
    with pytest.raises(ValueError, match=r"maps: expected a tensor \[B, H, T, T\] .*got \[6, 6\]"):
        previous_token_score(maps[0, 0])
    with pytest.raises(ValueError, match=r"ids: expected the maps' tokens \[B, T\] = \[1, 6\], got \[1, 5\]"):
        duplicate_token_score(maps, torch.zeros(1, 5, dtype=torch.long))
    torch.manual_seed(0)
    m = LanguageModel(build_config("transformer", vocab_size=V, d_model=16, n_layers=1)).eval()
    with pytest.raises(
        ValueError, match=r"layer: expected an int in \[0, 1\) \(the model has 1 layers\), got 7"
    ):
        copying_score(m, 7)
    with pytest.raises(ValueError, match=r"layers: \[7\] out of range; the model has 1 layers"):
        capture_maps(m, torch.zeros(1, 4, dtype=torch.long), layers=[7])
    with pytest.raises(ValueError, match=r"batch: expected an int >= 1, got 0"):
        circuit_scores(m, length=4, batch=0)
    with pytest.raises(ValueError, match=r"length: expected an int >= 2, got 1"):
        circuit_scores(m, length=1, batch=1)
    assert list(capture_maps(m, torch.zeros(1, 4, dtype=torch.long), layers=0)) == [0]

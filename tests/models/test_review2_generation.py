"""Second review of generation, decoding and streaming: state copies and moves that keep what a
state holds (its integer entries, its shared records), and sampling against hand computations."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import state as S
from mnemo.models import LanguageModel, build_config


def _hope_state(dtype=torch.float32):
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope", vocab_size=50, d_model=16, n_layers=2)).to(dtype).eval()
    ids = torch.randint(0, 50, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, state = m(ids)
    return m, ids, state


def _storages(state) -> int:
    """Bytes of the distinct storages behind a state's tensors (what it holds in memory)."""
    seen = {}
    for t in S.tensors(state):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_moving_a_state_to_another_dtype_keeps_its_token_ids():
    """``state.to(state, torch.float64)`` converted every tensor, the pending segment's token ids of a
    task-signal model (hope) too: the next call failed in the embedding ("expected Long ... got
    DoubleTensor"). As ``nn.Module.to``, a dtype now converts the floating-point entries only."""
    m, ids, state = _hope_state()
    nxt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    wide = S.to(state, torch.float64)
    pending = [b.mlp.pending.ids for b in wide]
    assert all(p.dtype == torch.long for p in pending)
    assert torch.equal(pending[0], ids[:, 16:])  # segment of 8: tokens 16 … 20 are pending
    floats = [t for t in S.tensors(wide) if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float64 for t in floats)
    with torch.no_grad():
        want, _ = m(nxt, state)
        got, _ = m.double()(nxt, wide)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), want, atol=2e-6, rtol=0)
    # device and dtype together, keywords too
    again = S.to(state, device="cpu", dtype=torch.bfloat16)
    assert all(b.mlp.pending.ids.dtype == torch.long for b in again)


def test_a_snapshot_or_move_holds_a_shared_record_once():
    """The task signal's pending segment (the whole model's state at the segment's start) is one
    record shared by every CMS block's state. ``snapshot`` / ``to`` / ``select_rows`` / ``cat_rows``
    mapped each occurrence anew, so
    the copy held it once per block: 2.6x the memory of the state it copied with 2 layers (and the
    ``--carry-state`` snapshot of a 4-layer hope, once per layer)."""
    _, _, state = _hope_state()
    first = state[0].mlp.pending
    assert all(b.mlp.pending is first for b in state)  # one record in the model's own state
    joined = S.cat_rows([S.select_rows(state, 1), S.select_rows(state, 0)])
    for copy in (S.snapshot(state), S.to(state, torch.float64), S.detach(state), joined):
        ids = [b.mlp.pending.ids for b in copy]
        assert all(i is ids[0] for i in ids)
        starts = [S.tensors(b.mlp.pending.start) for b in copy]
        assert all(a is b for other in starts[1:] for a, b in zip(starts[0], other, strict=True))
    # the copy holds what the model's own state holds: within the declared bound, and exactly the
    # declared bytes while the first segment runs (``state_size_bytes``: exact for seq_len <= S)
    m, _, state = _hope_state()
    assert _storages(S.snapshot(state)) <= m.state_size_bytes(2, 21)
    with torch.no_grad():
        _, first_segment = m(torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3)))
    assert _storages(S.snapshot(first_segment)) == m.state_size_bytes(2, 5)


def test_a_state_of_another_batch_size_is_named_for_titans_mag():
    """Every model refused a state of another batch size with a message naming the state, except
    Titans MAG, whose attention branch failed inside ``torch.cat`` ("Sizes of tensors must match")."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("titans_mag", vocab_size=50, d_model=16, n_layers=2)).eval()
    with torch.no_grad():
        _, state = m(torch.randint(0, 50, (2, 9)))
        for B in (1, 3):
            with pytest.raises(ValueError, match=f"state: .* batch size 2, the input has {B}"):
                m(torch.randint(0, 50, (B, 2)), state)
        assert m(torch.randint(0, 50, (2, 2)), state)[0].shape == (2, 2, 50)


def test_a_nucleus_whose_edge_equals_top_p_keeps_no_more_tokens():
    """The nucleus is the fewest likeliest tokens whose probabilities sum to at least ``top_p``. With
    ``top_p`` equal to the likeliest token's probability that is the token alone, and with ``top_p``
    equal to the two likeliest's sum, those two. The mass before each token was computed as
    ``cumsum − p``, which rounds: in about 1 in 12 such float32 distributions it fell below ``top_p``
    and a second (or third) token was drawn."""
    from mnemo.models.lm import sample_next

    g = torch.Generator().manual_seed(0)
    wrong = []
    for a in torch.linspace(0.3, 0.95, 120).tolist():
        for b in (0.03, 0.1, 0.2):
            if a + b >= 0.99:
                continue
            logits = torch.tensor([a, b, 1 - a - b]).log()
            probs = (logits - logits.amax()).softmax(-1)  # what sample_next draws from at temperature 1
            sorted_p, order = probs.sort(descending=True)
            one = sorted_p[0].item()
            two = sorted_p[:2].cumsum(0)[1].item()
            draws = sample_next(logits.expand(64, 3), 1.0, None, g, one)
            if not bool((draws == order[0]).all()):
                wrong.append(("one", a, b))
            draws = sample_next(logits.expand(64, 3), 1.0, None, g, two)
            if bool((draws == order[2]).any()):
                wrong.append(("two", a, b))
    assert wrong == []

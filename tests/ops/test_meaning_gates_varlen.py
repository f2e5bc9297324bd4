"""Known answers for the gated ops: a zero scale reads nothing, and packed sequences of unequal
lengths (the last one shorter than the longest) equal separate runs from their own initial state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.ops import delta_rule, gated_linear_attention, linear_attention
from tests.helpers import assert_close

MODES = ("chunk", "recurrent", "parallel")


def _qkvg(T, B=1, H=2, K=3, V=4, seed=0, per_channel=False):
    g_ = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g_, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g_, dtype=torch.float64)
    shape = (B, T, H, K) if per_channel else (B, T, H)
    g = F.logsigmoid(torch.randn(shape, generator=g_, dtype=torch.float64) + 1)
    return q, k, v, g


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_zero_scale_reads_zero_and_still_writes(mode, per_channel):
    q, k, v, g = _qkvg(9, per_channel=per_channel)
    o, S = gated_linear_attention(q, k, v, g, scale=0.0, output_final_state=True, mode=mode, chunk_size=4)
    assert torch.equal(o, torch.zeros_like(o))
    _, S_ref = gated_linear_attention(q, k, v, g, output_final_state=True, mode="recurrent")
    assert_close(S, S_ref, 1e-12)  # the state does not depend on the read scale


def test_a_scale_multiplies_the_read():
    q, k, v, g = _qkvg(9)
    o1, _ = gated_linear_attention(q, k, v, g, scale=1.0, chunk_size=4)
    o3, _ = gated_linear_attention(q, k, v, g, scale=3.0, chunk_size=4)
    assert_close(o3, 3.0 * o1, 1e-12)


LENS = [5, 8, 2]  # the last sequence is shorter than the longest: its padding indexes past T


def _packed_vs_separate(run, tensors, H, Kdim, Vdim):
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)))
    S0 = torch.randn(
        len(LENS), H, Kdim, Vdim, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    o, S = run(*tensors, cu_seqlens=cu, initial_state=S0)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oi, Si = run(*(t[:, a:b] for t in tensors), initial_state=S0[i : i + 1])
        assert_close(o[:, a:b], oi, 1e-12, what=f"sequence {i} output")
        assert_close(S[i : i + 1], Si, 1e-12, what=f"sequence {i} state")


@pytest.mark.parametrize("mode", MODES)
def test_packed_sequences_equal_separate_runs(mode):
    T = sum(LENS)
    q, k, v, g = _qkvg(T, per_channel=True)
    beta = torch.rand(1, T, 2, dtype=torch.float64)
    kn = F.normalize(k, dim=-1)

    def gla(q, k, v, g, **kw):
        return gated_linear_attention(q, k, v, g, output_final_state=True, mode=mode, chunk_size=4, **kw)

    def la(q, k, v, **kw):
        return linear_attention(
            q, k, v, feature_map="elu", output_final_state=True, mode=mode, chunk_size=4, **kw
        )

    def dr(q, k, v, beta, **kw):
        return delta_rule(q, k, v, beta, output_final_state=True, mode=mode, chunk_size=4, **kw)

    _packed_vs_separate(gla, (q, k, v, g), 2, 3, 4)
    _packed_vs_separate(la, (q, k, v), 2, 3, 4)
    _packed_vs_separate(dr, (q, kn, v, beta), 2, 3, 4)


def test_a_feature_map_must_treat_q_and_k_alike():
    calls = []

    def uneven(x):  # the second call (k) gets one feature more than the first (q)
        calls.append(1)
        return torch.cat([x] + [x[..., :1]] * (len(calls) - 1), -1)

    q, k, v, _ = _qkvg(5)
    with pytest.raises(ValueError, match="feature_map must map"):
        linear_attention(q, k, v, feature_map=uneven)
    with pytest.raises(ValueError, match="feature_map must map"):  # leading dims changed alike
        linear_attention(q, k, v, feature_map=lambda x: x.flatten(2))


def test_ops_return_no_final_state_unless_asked():
    q, k, v, g = _qkvg(5)
    beta = torch.rand(1, 5, 2, dtype=torch.float64)
    assert gated_linear_attention(q, k, v, g)[1] is None
    assert linear_attention(q, k, v)[1] is None
    assert delta_rule(q, F.normalize(k, dim=-1), v, beta)[1] is None
    from mnemo.ops import gated_delta_rule

    assert gated_delta_rule(q, F.normalize(k, dim=-1), v, g, beta)[1] is None


@pytest.mark.parametrize("safe_span", [3.0, 1e9])
def test_sub_block_channel_scores_match_the_definition(safe_span):
    """A_ts = Σ_k q_tk k_sk exp(b_tk − b_sk) for s ≤ t: with a chunk decaying by more than
    ``safe_span`` but each 4-token sub-block by less, the sub-blocks anchor at their own start."""
    from mnemo.ops.gated_linear_attention import _intra_chunk_channel_scores

    g_ = torch.Generator().manual_seed(0)
    C, K = 16, 3
    q, k = (torch.randn(2, C, K, generator=g_, dtype=torch.float64) for _ in range(2))
    b = (-0.2 * torch.rand(2, C, K, generator=g_, dtype=torch.float64)).cumsum(-2)  # ≤ 0.8 per sub-block
    A = _intra_chunk_channel_scores(q, k, b, sub=4, safe_span=safe_span)
    ref = torch.einsum("btk,bsk,btsk->bts", q, k, (b[:, :, None, :] - b[:, None, :, :]).exp())
    assert_close(A, ref.tril(), 1e-12)


def test_varlen_index_pads_to_the_longest_sequence_and_zero_sequences_to_nothing():
    """``varlen_index``: ``Tmax`` is the longest sequence's length; row ``i`` gathers positions
    ``c_i, c_i + 1, …`` (clamped into the packed axis), valid for the first ``len_i`` of them.
    Hand-computed for lengths 3, 0, 2; with no sequence (``cu = [0]``) or only an empty one the
    padded batch has no columns (``Tmax = 0``: a padded column would hold only padding)."""
    from mnemo.ops._common import pad_packed, unpad_packed, varlen_index

    idx, valid, tmax = varlen_index(torch.tensor([0, 3, 3, 5]), torch.device("cpu"))
    assert tmax == 3
    assert idx.tolist() == [[0, 1, 2], [3, 4, 4], [3, 4, 4]]  # 3 + t clamped at T − 1 = 4
    assert valid.tolist() == [[True, True, True], [False, False, False], [True, True, False]]
    x = torch.arange(5.0).reshape(1, 5, 1)
    assert pad_packed(x, idx, valid)[..., 0].tolist() == [[0, 1, 2], [0, 0, 0], [3, 4, 0]]
    assert torch.equal(unpad_packed(pad_packed(x, idx, valid), valid), x)
    for cu, rows in (([0], 0), ([0, 0], 1)):
        idx, valid, tmax = varlen_index(torch.tensor(cu), torch.device("cpu"))
        assert tmax == 0 and idx.shape == valid.shape == (rows, 0)
        padded = pad_packed(torch.zeros(1, 0, 2), idx, valid)
        assert padded.shape == (rows, 0, 2) and unpad_packed(padded, valid).shape == (1, 0, 2)

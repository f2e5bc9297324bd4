"""Attention sinks (StreamingLLM, Xiao et al. 2023): bounded cache, cache-relative positions, all
forms equal, the map's sink columns, errors."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.layers import Attention
from mnemo.ops import KVCache, softmax_attention, softmax_attention_map
from mnemo.ops.softmax_attention import attention_mask, kept_keys, sink_window_attention
from mnemo.testing.mixers import check_mixer


def _rel(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def streaming_reference(att: Attention, x: torch.Tensor) -> torch.Tensor:
    """The paper's procedure, one token at a time: the cache holds the first ``n_sink`` tokens and
    the most recent ones; the ``m`` cached keys (before rotary) are rotated at positions
    ``0 … m−1`` and the query at ``m − 1`` (its own key is the last)."""
    B, T, _ = x.shape
    H, D, n, W = att.n_heads, att.head_dim, att.n_sink, att.window
    q = att.q_proj(x).view(B, T, H, D)
    k, v = att.kv_proj(x).view(B, T, 2, H, D).unbind(2)
    outs = []
    for i in range(T):
        vis = [j for j in range(i + 1) if j < n or i - j < W]
        m = len(vis)
        kr = att.rotary.rotate(k[:, vis], torch.arange(m))
        qr = att.rotary.rotate(q[:, i : i + 1], torch.tensor([m - 1]))
        p = (torch.einsum("bthd,bshd->bhts", qr, kr) * D**-0.5).softmax(-1)
        outs.append(torch.einsum("bhts,bshd->bthd", p, v[:, vis]))
    return att.o_proj(torch.cat(outs, 1).reshape(B, T, H * D))


def test_parallel_equals_the_papers_cache_positions_and_token_decoding():
    torch.manual_seed(0)
    att = Attention(16, n_heads=2, window=4, n_sink=2).double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    ref = streaming_reference(att, x)
    par, _ = att(x)
    rec, _ = att(x, mode="recurrent")
    state, steps = None, []
    for t in range(x.shape[1]):
        y, state = att(x[:, t : t + 1], state)
        steps.append(y)
        assert state.kv.k.shape[1] == min(t + 1, 2 + 4 - 1)  # never more than n_sink + window − 1
    chunks, st = [], None
    for a, b in ((0, 3), (3, 10), (10, 11), (11, 23)):
        y, st = att(x[:, a:b], st)
        chunks.append(y)
    for got in (par, rec, torch.cat(steps, 1), torch.cat(chunks, 1)):
        assert _rel(got, ref) < 1e-12
    # a plain window (no sinks) is a different function once the first tokens leave the window
    plain = Attention(16, n_heads=2, window=4).double()
    plain.load_state_dict(att.state_dict())
    assert _rel(plain(x)[0][:, 6:], ref[:, 6:]) > 1e-3
    assert torch.allclose(plain(x)[0][:, :4], ref[:, :4], atol=1e-12)  # the same before any eviction


def test_cache_stays_bounded_over_a_long_stream_in_a_model():
    from mnemo.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=13,
        d_model=16,
        n_layers=2,
        mixer_options={"attention": {"n_heads": 2, "window": 5, "n_sink": 3}},
    )
    model = LanguageModel(cfg).double().eval()
    ids = torch.randint(0, 13, (1, 60))
    with torch.no_grad():
        full, _ = model(ids)
        _, state = model(ids[:, :7])
        outs = [full[:, :7]]
        for t in range(7, 60):
            y, state = model(ids[:, t : t + 1], state)
            outs.append(y)
            assert all(s.mixer.kv.k.shape[1] <= 3 + 5 - 1 for s in state)
    assert _rel(torch.cat(outs, 1), full) < 1e-12
    assert model.state_size_bytes(1, 10_000) == model.state_size_bytes(1, 100)  # flat in the length
    spec = model.blocks[0].mixer.state_spec(1, 10_000)
    assert spec.kv.k.shape[1] == 7 == sum(kept_keys(10_000, 5, 3))


@pytest.mark.parametrize(
    "options",
    [
        {"window": 3, "n_sink": 2},
        {"window": 4, "n_sink": 1, "n_kv_heads": 1, "mode": "recurrent"},
        {"window": 2, "n_sink": 3, "rope": False},
    ],
)
def test_generic_mixer_checks_with_sinks(options):
    failed = [r for r in check_mixer("attention", options=options) if not r.passed]
    assert not failed, failed


def test_hand_computed_tiny_case():
    """1 head, K = V = 1, scale 1, window 1, one sink: query t sees key 0 and itself.
    k = (0, ln 2, ln 3), q = 1: o_1 = (1·v_0 + 2·v_1)/3, o_2 = (1·v_0 + 3·v_2)/4."""
    q = torch.ones(1, 3, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, math.log(2), math.log(3)], dtype=torch.float64).view(1, 3, 1, 1)
    v = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64).view(1, 3, 1, 1)
    expected = torch.tensor([1.0, (1 + 20) / 3, (1 + 300) / 4], dtype=torch.float64)
    for mode in ("parallel", "recurrent"):
        o, cache = softmax_attention(
            q, k, v, window=1, n_sink=1, scale=1.0, mode=mode, output_final_state=True
        )
        assert torch.allclose(o.flatten(), expected, atol=1e-12)
        assert cache.k.flatten().tolist() == [0.0]  # the sink; window − 1 = 0 recent keys
    o, _ = softmax_attention(q, k, v, window=1, scale=1.0)
    assert torch.allclose(o.flatten(), v.flatten())  # no sink: each token sees only itself
    # sink_q scores the sink column: with sink_q = 0 the sink's score is 0 = log 1, for every query
    o, _ = softmax_attention(q, k, v, window=2, n_sink=1, scale=1.0, sink_q=torch.zeros_like(q))
    assert torch.allclose(o[0, 2, 0, 0], torch.tensor((1 + 2 * 10 + 3 * 100) / 6, dtype=torch.float64))


def test_cached_op_calls_equal_one_call_and_the_map_has_the_sink_columns():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sq = torch.randn(1, 12, 2, 4, generator=g, dtype=torch.float64)
    full, _ = softmax_attention(q, k, v, window=3, n_sink=2, sink_q=sq)
    cache, outs = None, []
    for a, b in ((0, 5), (5, 6), (6, 12)):
        o, cache = softmax_attention(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            window=3,
            n_sink=2,
            sink_q=sq[:, a:b],
            initial_state=cache,
            output_final_state=True,
        )
        outs.append(o)
        assert cache.k.shape[1] <= 4
    assert _rel(torch.cat(outs, 1), full) < 1e-12
    M = softmax_attention_map(q, k, window=3, n_sink=2, sink_q=sq)
    assert torch.allclose(torch.einsum("bhts,bshd->bthd", M, v), full, atol=1e-12)
    allowed = attention_mask(12, 12, window=3, n_sink=2)
    assert torch.all(M[..., ~allowed] == 0) and torch.all(M[:, :, 5:, :2] > 0)  # sink columns in late rows
    assert torch.all(M[:, :, 8:, 2:6] == 0)  # the evicted middle (row 8 sees 0, 1 and 6, 7, 8)


def test_blockwise_long_sequence_path_equals_the_masked_form():
    g = torch.Generator().manual_seed(1)
    qh, kh, vh = (torch.randn(1, 2, 29, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = attention_mask(29, 29, window=5, n_sink=3)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=0.5)
    for block in (1, 4, 7, 64):
        got = sink_window_attention(qh, kh, vh, 5, 3, 0.5, block=block)
        assert _rel(got, ref) < 1e-12


def test_attention_map_through_hooks_includes_sinks():
    from mnemo.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=13,
        d_model=16,
        n_layers=1,
        mixer_options={"attention": {"n_heads": 2, "window": 3, "n_sink": 2}},
    )
    model = LanguageModel(cfg).double().eval()
    ids = torch.randint(0, 13, (1, 10))
    with torch.no_grad():
        plain, _ = model(ids)
        logits, cache = model.run_with_cache(ids)
    assert _rel(logits, plain) < 1e-12  # the pattern path computes the same output
    pattern = cache["blocks.0.mixer.hook_pattern"]
    assert pattern.shape == (1, 2, 10, 10) and torch.all(pattern[:, :, 4:, :2] > 0)
    assert torch.allclose(pattern.sum(-1), torch.ones(1, 2, 10, dtype=torch.float64))
    att = model.blocks[0].mixer
    acts = {n: cache[f"blocks.0.mixer.{n}"] for n in att.mixing_hooks}
    assert torch.allclose(att.mixing(acts).maps, pattern, atol=1e-12)  # maps without the recorded pattern
    # decoding with the pattern hook attached (cache + sinks) equals decoding without it
    with torch.no_grad():
        _, st = model(ids[:, :6])
        a, _ = model(ids[:, 6:], st)
        b, _ = model.run_with_hooks(ids[:, 6:], [("hook_pattern", lambda x, name: None)], st)
    assert _rel(b, a) < 1e-12


def test_bad_values_name_the_argument():
    with pytest.raises(ValueError, match="n_sink: attention sinks need a window"):
        Attention(16, n_heads=2, n_sink=4)
    with pytest.raises(ValueError, match="n_sink: expected an int >= 0, got -1"):
        Attention(16, n_heads=2, window=4, n_sink=-1)
    with pytest.raises(ValueError, match="n_sink: expected an int >= 0, got True"):
        Attention(16, n_heads=2, window=4, n_sink=True)
    q = torch.randn(1, 4, 2, 4)
    with pytest.raises(ValueError, match="n_sink .* needs causal attention with a window"):
        softmax_attention(q, q, q, n_sink=2)
    with pytest.raises(ValueError, match="n_sink must be an int >= 0, got 1.5"):
        softmax_attention(q, q, q, window=2, n_sink=1.5)
    with pytest.raises(ValueError, match=r"sink_q must have q's shape \[1, 4, 2, 4\], got \[1, 3, 2, 4\]"):
        softmax_attention(q, q, q, window=2, n_sink=1, sink_q=q[:, :3])
    with pytest.raises(ValueError, match="sink_q is only used with attention sinks"):
        softmax_attention(q, q, q, window=2, sink_q=q)
    with pytest.raises(ValueError, match="n_sink .* not supported with cu_seqlens"):
        softmax_attention(q, q, q, window=2, n_sink=1, cu_seqlens=torch.tensor([0, 2, 4]))


def test_decode_bench_fills_a_bounded_cache():
    from mnemo.bench.decode import _fill_state
    from mnemo.models import LanguageModel, build_config

    model = LanguageModel(build_config("transformer_sinks", vocab_size=256, d_model=32, n_layers=1)).eval()
    with torch.no_grad():
        _, state = model(torch.randint(0, 256, (1, 4)))
        state = _fill_state(model, state, 5000)
        att = model.blocks[0].mixer
        bound = att.n_sink + att.window - 1
        assert state[0].mixer.kv.k.shape[1] == bound and state[0].mixer.offset == 5000
        _, state = model(torch.randint(0, 256, (1, 1)), state)
    assert isinstance(state[0].mixer.kv, KVCache) and state[0].mixer.kv.k.shape[1] == bound

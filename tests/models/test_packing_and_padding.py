"""Document packing (``cu_seqlens`` through the whole model) and batched generation of left-padded
prompts: a packed batch equals each document run alone; each padded row equals its prompt alone."""

from __future__ import annotations

import pytest
import torch

from mnemo.models import LanguageModel, ModelConfig, model_names
from tests.helpers import assert_close
from tests.models.test_lm import _model


@pytest.mark.parametrize("name", model_names())
def test_packed_documents_equal_separate_runs(name):
    m = _model(name)
    if m.task_segment is not None:
        with pytest.raises(ValueError, match="cu_seqlens: packing is not supported"):
            m(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 4]))
        return
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 3]  # a one-token document and ones shorter than the conv width
    docs = [torch.randint(0, 50, (1, L), generator=g) for L in lengths]
    cu = torch.tensor([0, 5, 6, 15, 18])
    packed, state = m(torch.cat(docs, 1), cu_seqlens=cu)
    assert state is None
    alone = torch.cat([m(d)[0] for d in docs], 1)
    assert_close(packed, alone, 1e-12, what=f"{name} packed vs alone")
    # and it is not what the unpacked stream gives: information would cross the boundaries
    stream, _ = m(torch.cat(docs, 1))
    assert (stream[:, 5:] - alone[:, 5:]).abs().max() > 1e-6


def test_packing_restarts_learned_positions():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=20,
        d_model=16,
        n_layers=1,
        mixer="attention",
        pos_embedding="learned",
        max_position=8,
        mixer_options={"attention": {"n_heads": 2, "rope": False}},
    )
    m = LanguageModel(cfg).double().eval()
    a, b = torch.randint(0, 20, (1, 6)), torch.randint(0, 20, (1, 7))
    packed, _ = m(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 6, 13]))  # 13 > max_position
    assert_close(packed, torch.cat([m(a)[0], m(b)[0]], 1), 1e-12, what="learned positions")


def test_packing_errors_name_the_argument():
    m = _model("gla")
    ids = torch.zeros(1, 6, dtype=torch.long)
    for bad, msg in [
        (torch.tensor([0, 3, 5]), "from 0 to N = 6"),
        (torch.tensor([1, 3, 6]), "from 0 to N = 6"),
        (torch.tensor([0, 3, 3, 6]), "strictly increasing"),
        (torch.tensor([0.0, 6.0]), "1-D integer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            m(ids, cu_seqlens=bad)
    with pytest.raises(ValueError, match="one row"):
        m(torch.zeros(2, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 6]))
    _, state = m(ids)
    with pytest.raises(ValueError, match="empty states"):
        m(ids, state, cu_seqlens=torch.tensor([0, 6]))


def _left_pad(prompts, pad=0):
    T = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - p.numel() :], mask[i, T - p.numel() :] = p, 1
    return ids, mask


@pytest.mark.parametrize("name", ["transformer", "gla", "mamba", "mamba2", "deltanet", "titans_mac", "hope"])
def test_padded_batched_generation_equals_each_prompt_alone(name):
    if name not in model_names():
        pytest.skip(f"no registered model {name}")
    m = _model(name)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 50, (L,), generator=g) for L in (7, 2, 7, 4)]
    ids, mask = _left_pad(prompts, pad=49)  # a real token id: it must not leak into any state
    out = m.generate(ids, 6, temperature=0, attention_mask=mask)
    assert out.shape == (4, 7 + 6)
    assert torch.equal(out[:, :7], ids)
    for i, p in enumerate(prompts):
        alone = m.generate(p[None], 6, temperature=0)[0, p.numel() :]
        assert torch.equal(out[i, 7:], alone), (name, i)


def test_padded_generation_rejects_right_padding():
    m = _model("gla")
    ids = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="attention_mask row 1"):
        m.generate(ids, 2, temperature=0, attention_mask=mask)
    with pytest.raises(ValueError, match="shape of input_ids"):
        m.generate(ids, 2, temperature=0, attention_mask=mask[:, :3])


@pytest.mark.parametrize(
    "name, joined",
    [
        ("gla", True),
        ("linear_attention", True),
        ("mamba", True),
        ("mamba2", True),
        ("deltanet", True),
        ("gated_deltanet", True),
        ("retnet", False),
        ("transformer", False),
    ],
)
def test_offset_free_models_decode_padded_rows_as_one_batch(name, joined):
    m = _model(name)
    assert all(b.mixer.offset_free for b in m.blocks) == joined
    calls = []
    m.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape))
    prompts = [torch.arange(1, 1 + L) for L in (5, 2, 3)]
    ids, mask = _left_pad(prompts)
    out = m.generate(ids, 4, temperature=0, attention_mask=mask)
    decode = [s for s in calls if s[1] == 1]
    # three prefills (one per length); then 3 one-token steps as one batch of 3, or per group
    assert len([s for s in calls if s[1] > 1]) == 3 and len(decode) == (3 if joined else 3 * 3)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, 5:], m.generate(p[None], 4, temperature=0)[0, p.numel() :])


def test_packed_short_convolution_restarts_at_each_document():
    from mnemo.layers.conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).double()
    with torch.no_grad():
        conv.bias.normal_()
    lengths = [3, 1, 6, 2]
    x = torch.randn(1, sum(lengths), 6, dtype=torch.float64)
    cu = torch.tensor([0, 3, 4, 10, 12])
    alone = torch.cat([conv(x[:, a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert_close(conv.forward_packed(x, cu), alone, 1e-14, what="packed conv")
    # by hand: the first token of a document sees only itself (tap W-1) and the bias
    w, b = conv.weight[:, 0, :], conv.bias
    first = torch.nn.functional.silu(x[0, 4] * w[:, 3] + b)
    assert_close(conv.forward_packed(x, cu)[0, 4], first, 1e-14, what="first token of document 3")


@pytest.mark.parametrize("short_conv", [False, True])
@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_gla_packs_documents_in_one_op_call(short_conv, mode, monkeypatch):
    from mnemo.layers import linear_attention as la

    torch.manual_seed(0)
    layer = la.GatedLinearAttention(32, n_heads=2, short_conv=short_conv, mode=mode, chunk_size=4).double()
    calls = []
    op = la.gated_linear_attention
    monkeypatch.setattr(la, "gated_linear_attention", lambda *a, **k: calls.append(k) or op(*a, **k))
    lengths = [5, 1, 9, 3]
    x = torch.randn(1, sum(lengths), 32, dtype=torch.float64)
    cu = torch.tensor([0, 5, 6, 15, 18])
    y = layer.forward_packed(x, cu)
    assert len(calls) == 1 and calls[0]["cu_seqlens"] is cu
    bounds = cu.tolist()
    alone = torch.cat([layer(x[:, a:b])[0] for a, b in zip(bounds[:-1], bounds[1:])], 1)
    assert_close(y, alone, 1e-12, what=f"gla packed {mode}")


def test_learned_positions_decode_padded_rows_per_stream():
    """Learned positions are per stream: rows of different lengths must not share one offset."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=20, d_model=16, n_layers=1, mixer="gla", pos_embedding="learned", max_position=32
    )
    m = LanguageModel(cfg).double().eval()
    with torch.no_grad():
        m.pos_embed.weight.mul_(50.0)  # positions dominate, so a wrong offset changes the tokens
    assert not m.offset_free
    prompts = [torch.tensor([3, 4, 5]), torch.arange(1, 9)]
    ids, mask = _left_pad(prompts)
    out = m.generate(ids, 5, temperature=0, attention_mask=mask)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, 8:], m.generate(p[None], 5, temperature=0)[0, p.numel() :]), i
    with pytest.raises(ValueError, match="max_new_tokens"):
        m.generate(ids, -1, attention_mask=mask)

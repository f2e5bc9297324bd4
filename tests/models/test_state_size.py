"""State-size accounting: ``LanguageModel.state_size_bytes`` equals the bytes of the state the
model actually returns (the x-axis of the recall / memory plots)."""

from __future__ import annotations

import pytest
import torch

from mnemo.models import LanguageModel, build_config

MODELS = [
    "transformer",
    "transformer_abs",
    "linear_attention",
    "retnet",
    "gla",
    "deltanet",
    "gated_deltanet",
    "mamba",
    "mamba_lti",
    "mamba2",
    "titans_lmm",
    "titans_mac",
    "titans_mag",
    "gated_deltanet_hybrid",
]


def _bytes(obj, seen) -> int:
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o, seen) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_bytes(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    return 0


@pytest.mark.parametrize("name", MODELS)
def test_reported_state_size_is_the_returned_state(name):
    torch.manual_seed(0)
    m = LanguageModel(build_config(name, vocab_size=32, d_model=32, n_layers=2))
    for T in (37, 70):  # off every chunk / segment boundary (16, 32, 64)
        with torch.no_grad():
            _, state = m(torch.randint(0, 32, (3, T)))
        assert m.state_size_bytes(3, T) == _bytes(state, set()), (name, T)


def test_attention_grows_with_length_recurrent_models_do_not():
    att = LanguageModel(build_config("transformer", vocab_size=32, d_model=32, n_layers=2))
    gdn = LanguageModel(build_config("gated_deltanet", vocab_size=32, d_model=32, n_layers=2))
    assert att.state_size_bytes(1, 512) == 2 * att.state_size_bytes(1, 256) > 0
    assert gdn.state_size_bytes(1, 512) == gdn.state_size_bytes(1, 256) > 0
    # 2 layers x 4 heads x (8 x 8 fp32 matrix) + conv tail (3 taps x 96 channels fp32)
    assert gdn.state_size_bytes(1, 0) == 2 * (4 * 8 * 8 * 4 + 3 * 96 * 4)


@pytest.mark.parametrize("name", ["hope", "hope_attention", "hope_paper"])
def test_a_task_signal_models_state_size_counts_its_pending_segment(name):
    """A model whose levels learn from the task signal carries its pending segment (the state at
    the segment's start and the segment's ids): the report bounds the bytes of the distinct
    tensors of the state it returns (this file's count) — after one pass and after token-by-token
    decoding — and is exact within the first segment (the start state is the initial one, nothing
    is snapshotted). It used to count
    the current state alone (245 KB reported, 345 KB held: hope_paper at 37 tokens)."""
    torch.manual_seed(0)
    m = LanguageModel(build_config(name, vocab_size=32, d_model=16, n_layers=2)).eval()
    S = m.task_segment
    ids = torch.randint(0, 32, (2, 40))
    for T in (1, S, S + 1, 2 * S, 37, 40):
        with torch.no_grad():
            _, whole = m(ids[:, :T])
            _, stepped = m(ids[:, :1])
            for t in range(1, T):
                _, stepped = m(ids[:, t : t + 1], stepped)
        reported = m.state_size_bytes(2, T)
        held = max(_bytes(whole, set()), _bytes(stepped, set()))
        assert reported >= held, (name, T, reported, held)
        if T <= S:
            assert reported == _bytes(whole, set()) == _bytes(stepped, set()), (name, T)
    # the current state alone no longer bounds it: past the first segment the snapshot is held too
    with torch.no_grad():
        _, state = m(ids[:, :37])
    assert _bytes(state, set()) > m.state_size_bytes(2, 37, pending=False)

"""Third review of the Hugging Face interop: ``MnemoForCausalLM`` against ``transformers``' own
generation on the same weights (greedy, beam search, left padding, a returned cache reused), and the
defects found (a left-padded chunk given with a cache, ``generate`` with ``max_length`` past the
learned positions)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from mnemo.hf.convert import convert  # noqa: E402
from mnemo.hf.modeling import MnemoForCausalLM  # noqa: E402
from tests.helpers import tiny_mnemo_for_causal_lm  # noqa: E402

VOCAB = 40


def _mnemo(mixer: str = "mamba", seed: int = 0, **over) -> MnemoForCausalLM:
    return tiny_mnemo_for_causal_lm(mixer, seed, VOCAB, **over)


def _hf(kind: str) -> torch.nn.Module:
    """A tiny random-weight transformers Mamba / Mamba-2 (every parameter off its init)."""
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, conv_kernel=4, expand=2)
    if kind == "mamba":
        model = transformers.MambaForCausalLM(transformers.MambaConfig(state_size=4, **common))
    else:
        cfg = transformers.Mamba2Config(
            state_size=4, head_dim=4, num_heads=8, n_groups=2, chunk_size=4, **common
        )
        model = transformers.Mamba2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.rand(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(r * 1.5 - 0.5)
            elif name.endswith(("dt_proj.bias", "dt_bias")):
                p.copy_(r * 2 - 3)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_generate_equals_transformers_generate_on_the_same_weights(kind, tmp_path):
    """A converted checkpoint generates through ``MnemoForCausalLM`` exactly what ``transformers``
    generates with its own class: greedy and beam search, with and without left padding; a second
    call continued from the first call's returned cache equals one longer call."""
    hf = _hf(kind)
    hf.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(tmp_path / "hf", tmp_path / "mn")
    m = MnemoForCausalLM.from_pretrained(tmp_path / "mn")
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    ids = ids * mask
    for kw in ({}, {"attention_mask": mask}, {"num_beams": 3}, {"num_beams": 3, "attention_mask": mask}):
        want = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
        got = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
        assert torch.equal(got, want), kw
    first = m.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    mask2 = torch.cat([mask, torch.ones_like(first.sequences[:, ids.shape[1] :])], 1)
    more = m.generate(
        first.sequences, attention_mask=mask2, cache=first.cache, max_new_tokens=3, do_sample=False
    )
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(more, want)


def test_a_left_padded_chunk_given_with_a_cache_is_refused():
    """With a cache, a ``[B, T]`` mask whose new tokens are left-padded put the pads into the
    recurrent state silently (the same mask written ``[B, S + T]`` is refused): refused by name."""
    m = _mnemo("mamba")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = m(ids[:, :3]).cache
        new = ids[:, 3:].clone()
        new[0, 0] = 0
        mask = torch.ones_like(new)
        mask[0, 0] = 0
        with pytest.raises(ValueError, match="attention_mask"):
            m(new, cache=cache, attention_mask=mask)
        full = torch.cat([torch.ones(2, 3, dtype=torch.long), mask], 1)
        with pytest.raises(ValueError, match="attention_mask"):
            m(new, cache=cache, attention_mask=full)
        # right padding of the new tokens stays accepted (a causal model never sees it), and a mask
        # of ones equals no mask
        right = torch.ones_like(new)
        right[0, -1] = 0
        want = m(ids[:, 3:], cache=cache).logits
        assert torch.equal(m(ids[:, 3:], cache=cache, attention_mask=right).logits[1], want[1])
        assert torch.equal(m(ids[:, 3:], cache=cache, attention_mask=torch.ones_like(new)).logits, want)


@pytest.mark.parametrize("how", ["max_length"])
def test_generate_past_max_position_through_max_length_is_refused_up_front(how):
    """``generate`` bounded by ``max_length`` instead of ``max_new_tokens`` ran past the learned
    positions and failed mid-generation; it is refused before any work, as with ``max_new_tokens``.
    (The default length is capped at ``config.max_position_embeddings`` as transformers does since
    review 4: test_review4_interop.)"""
    m = _mnemo("gla", pos_embedding="learned", max_position=12)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    kw = {"max_length": 20}
    calls = []
    m.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="max_position") as e:
        m.generate(ids, do_sample=False, pad_token_id=0, **kw)
    assert calls == [], "the check came after the prefill"
    assert "20" in str(e.value) or "14" in str(e.value), str(e.value)
    # within the positions it generates as before
    out = m.generate(ids, do_sample=False, pad_token_id=0, max_length=12)
    assert out.shape == (1, 12)

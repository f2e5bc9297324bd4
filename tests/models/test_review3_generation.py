"""Generation, decoding states and the fused loss, third break-it pass: the summed loss of a model
whose CMS levels learn from the next-token loss keeps a float64 model's precision; the chunked
cross-entropy refuses a second derivative it cannot give instead of silently dropping it; a state
entry that is not a BlockState is named; int32 prompts generate with an attention mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, build_config
from mnemo.models.fused_loss import chunked_cross_entropy


def _tiny(name, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    kw = {"vocab_size": 40, "d_model": 16, "n_layers": 1, **kw}
    return LanguageModel(build_config(name, **kw)).to(dtype)


@pytest.mark.parametrize("name", ["hope", "gla"])
def test_the_summed_loss_of_a_float64_model_is_float64_and_exact(name):
    """forward(targets=) promises a float64 loss for a float64 model; the task-signal path (HOPE)
    cast its float64 logits to float32 first (a float32 loss, 1e-9 off)."""
    m = _tiny(name).eval()
    assert (m.task_segment is not None) == (name == "hope")
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(2))
    y[0, 3] = -100
    with torch.no_grad():
        loss, _ = m(ids, targets=y)
        logits, _ = m(ids)
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    assert loss.dtype == torch.float64 and ref.dtype == torch.float64
    assert abs(loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    assert m.loss(ids, y).dtype == torch.float64


def test_the_chunked_loss_refuses_a_graph_of_its_gradient():
    """Its backward scales gradients stored in the forward: asked for create_graph=True, it gave a
    gradient that did not depend on h, so a gradient penalty silently lost its second-order term
    (F.cross_entropy's path gives it). It must raise instead."""
    torch.manual_seed(0)
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 5, (6,))
    loss = chunked_cross_entropy(h, w, y, chunk_rows=4)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss, (w,), create_graph=True)
    # first-order gradients still equal the plain path's
    gh, gw = torch.autograd.grad(chunked_cross_entropy(h, w, y, chunk_rows=4), (h, w))
    rh, rw = torch.autograd.grad(F.cross_entropy(F.linear(h, w), y, reduction="sum"), (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["transformer_abs", "gla", "hope"])
@pytest.mark.parametrize("entry", [None, "x", (1, 2)])
def test_a_state_entry_that_is_not_a_block_state_is_named(name, entry):
    """A list of the right length whose entries are not BlockState ([None] * L, a tuple per layer)
    failed with an AttributeError naming neither ``state`` nor the layer (learned positions, HOPE),
    or for a plain recurrent model was silently read as empty states."""
    m = _tiny(name, torch.float32, n_layers=2).eval()
    ids = torch.randint(0, 40, (2, 5))
    with pytest.raises(ValueError, match=r"state\[0\]: expected the BlockState that forward returned"):
        m(ids, [entry, entry])
    _, state = m(ids)
    with pytest.raises(ValueError, match=r"state\[1\]: .* got " + type(entry).__name__):
        m(ids, [state[0], entry])
    m(ids, state)  # the returned state is still taken


@pytest.mark.parametrize("name", ["gla", "transformer"])
def test_int32_prompts_generate_with_and_without_attention_mask(name):
    """forward takes int32 ids; generate(attention_mask=) wrote the int64 samples into an int32
    buffer and failed with torch's "Index put requires the source and destination dtypes match"."""
    m = _tiny(name, torch.float32).eval()
    prompts = torch.randint(1, 40, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    ref = m.generate(prompts, 4, temperature=0, attention_mask=mask)
    out = m.generate(prompts.int(), 4, temperature=0, attention_mask=mask)
    assert out.dtype == torch.long and torch.equal(out, ref)
    plain = m.generate(prompts.int(), 4, temperature=0)
    assert plain.dtype == torch.long and torch.equal(plain, m.generate(prompts, 4, temperature=0))

"""The chunked cross-entropy (mnemo/models/fused_loss.py) equals the plain head + cross-entropy in
loss and gradients, never builds the [N, vocab] logits, and is what LanguageModel.forward(targets=)
returns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mnemo.models import LanguageModel, build_config, fused_loss
from mnemo.models.fused_loss import chunked_cross_entropy


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(dtype, N=37, d=8, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, d, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = -100  # some ignored positions
    return h, w, y


# float32: the module docstring documents ~1e-7 (2.4e-7 the worst measured over 160 cases)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 5e-7)])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 37, 100])
def test_loss_and_gradients_equal_plain_cross_entropy(dtype, tol, reduction, chunk_rows):
    h, w, y = _inputs(dtype)
    ref = F.cross_entropy(F.linear(h, w), y, ignore_index=-100, reduction=reduction)
    gh_ref, gw_ref = torch.autograd.grad(3.0 * ref, (h, w))
    got = chunked_cross_entropy(h, w, y, reduction=reduction, chunk_rows=chunk_rows)
    gh, gw = torch.autograd.grad(3.0 * got, (h, w))  # a non-unit incoming gradient
    assert got.dtype == dtype and got.ndim == 0
    assert abs(float(got.detach()) - float(ref)) <= tol * abs(float(ref))
    assert _rel(gh, gh_ref) <= tol and _rel(gw, gw_ref) <= tol
    assert gh.dtype == h.dtype and gw.dtype == w.dtype


def test_loss_only_where_no_gradient_is_needed():
    h, w, y = _inputs(torch.float32)
    with torch.no_grad():
        got = chunked_cross_entropy(h, w, y, chunk_rows=4)
    ref = F.cross_entropy(F.linear(h, w), y, reduction="sum")
    assert abs(float(got) - float(ref)) <= 5e-7 * abs(float(ref))


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_without_grad_mode_only_the_loss_is_computed(ctx):
    """Known count: the head's matmul is 2·N·V·d FLOPs; with gradients the forward adds ∂h and ∂W
    (3 matmuls of that size). Without grad mode (evaluation) inputs that require grad must not
    make it compute them: 2·N·V·d FLOPs, the same loss."""
    from torch.utils.flop_counter import FlopCounterMode

    N, d, V = 37, 8, 11
    h, w, y = _inputs(torch.float32, N=N, d=d, V=V)
    with FlopCounterMode(display=False) as grad_mode:
        with_grad = chunked_cross_entropy(h, w, y, chunk_rows=5)
    assert grad_mode.get_total_flops() == 3 * 2 * N * V * d  # the path that trains
    with ctx(), FlopCounterMode(display=False) as counter:
        got = chunked_cross_entropy(h, w, y, chunk_rows=5)
    assert counter.get_total_flops() == 2 * N * V * d
    assert not got.requires_grad
    assert float(got) == float(with_grad.detach())


class _Largest(TorchDispatchMode):
    """The largest tensor any op returns (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _tiny(tie=False, vocab=97):
    torch.manual_seed(0)
    cfg = build_config("gla", vocab_size=vocab, d_model=16, n_layers=1, tie_embeddings=tie)
    return LanguageModel(cfg)


def test_model_forward_with_targets_never_builds_the_logits(monkeypatch):
    B, T, V = 2, 24, 1024  # the logits [B·T, V] outgrow every other tensor of the model
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMENTS", V * 8)  # 8 tokens a chunk
    m = _tiny(vocab=V)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with _Largest() as fused:
        loss, _ = m(ids, targets=ids)
        loss.backward()
    with _Largest() as plain:
        logits, _ = m(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="sum").backward()
    assert plain.largest >= B * T * V  # the plain path holds the logits (the check sees them)
    assert fused.largest <= V * 16  # a chunk's logits (or W, ∂W [V, d = 16])


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_and_every_parameter_gradient_equal_the_plain_path(tie):
    m = _tiny(tie).double()
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(2))
    y = ids.roll(-1, 1)
    y[:, -1] = -100
    logits, _ = m(ids)
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref, list(m.parameters()))
    got, _ = m(ids, targets=y)
    grads = torch.autograd.grad(got, list(m.parameters()))
    assert abs(float(got.detach()) - float(ref)) <= 1e-12 * abs(float(ref))
    for (name, _), a, b in zip(m.named_parameters(), grads, ref_grads):
        assert _rel(a, b) <= 1e-12, name
    mean = m.loss(ids, y).detach()
    assert abs(float(mean) - float(ref) / 2 / 18) <= 1e-12 * float(mean)


def test_bad_arguments_are_named():
    h, w, y = _inputs(torch.float32)
    with pytest.raises(ValueError, match="weight: expected a floating \\[V, d = 8\\]"):
        chunked_cross_entropy(h, w[:, :3], y)
    with pytest.raises(ValueError, match="targets: expected an integer \\[N = 37\\]"):
        chunked_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="reduction: expected 'sum' or 'mean', got 'none'"):
        chunked_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="chunk_rows: expected an int >= 1, got 0"):
        chunked_cross_entropy(h, w, y, chunk_rows=0)
    bad = y.clone()
    bad[3], bad[7] = 11, -3  # V = 11: one past the vocabulary, and a negative that is not ignore_index
    with pytest.raises(
        ValueError,
        match=r"targets: expected class indices in \[0, vocab = 11\) or ignore_index = -100, got 2 "
        r"outside \(values in \[-3, 11\]\)",
    ):
        chunked_cross_entropy(h, w, bad)
    assert torch.isfinite(chunked_cross_entropy(h, w, y.masked_fill(y == -100, -1), ignore_index=-1))
    m = _tiny()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="targets must be an integer tensor shaped like input_ids"):
        m(ids, targets=ids[:, :3])
    with pytest.raises(ValueError, match="targets: not with logits_at"):
        m(ids, targets=ids, logits_at=ids > 0)

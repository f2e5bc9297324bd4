"""The language-model loss without the ``[N, vocab]`` logits tensor: cross-entropy of a linear head
computed over the tokens in chunks.

``F.cross_entropy(h @ Wᵀ, y)`` materialises the logits ``[N, V]`` in float32 (``N = B·T`` tokens,
``V`` the vocabulary), and autograd keeps them, plus their gradient of the same size, until the
backward pass: at ``N = 16k`` tokens and ``V = 32k`` that is 2 GiB each. :func:`chunked_cross_entropy`
computes, for ``chunk_rows`` tokens at a time, the chunk's logits, its loss and already its
gradients with respect to ``h`` and ``W`` (the softmax minus the one-hot target, times ``W`` and
times ``h``), then drops the chunk's logits. The backward pass only scales the stored gradients by
the incoming gradient of the loss (a scalar), so the work is the plain path's three matmuls
(logits, ``∂h``, ``∂W``), never a fourth to recompute the logits, and the memory held from the
forward to the backward is ``∂h [N, d]`` and ``∂W [V, d]`` (float32) instead of ``[N, V]`` twice.

The gradients are exact (the same arithmetic as autograd's path through ``log_softmax``), up to the
order of the float sums: loss and gradients agree with ``F.cross_entropy(F.linear(h, W), y)`` to
about 1e-7 relative in float32 (at most 2.4e-7 measured over 160 small cases; the tests allow 5e-7,
``tests/models/test_fused_loss.py``). Without grad mode (``torch.no_grad``, evaluation) only the
loss is computed: one matmul per chunk, no gradients.
"""

from __future__ import annotations

import math

import torch

from ..ops._common import assert_on_device, avoid_host_reads

#: logits elements per chunk (``chunk_rows = max(1, CHUNK_ELEMENTS // vocab)``): 2**25 floats, 128 MiB.
#: Smaller chunks make the head's matmuls thin: at vocab 32k and d 128 on 2 cores (4096 tokens),
#: 65-row chunks (8 MiB) made the loss 1.7x slower than the plain path, 256 rows 0.95x its time,
#: 1024 rows 0.84x (docs/benchmarks/fused_loss_cpu_2core.txt)
CHUNK_ELEMENTS = 2**25


def default_chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``: ``CHUNK_ELEMENTS // vocab`` (at least 1), so
    a chunk's float32 logits take at most 128 MiB (131,072 tokens at a byte vocabulary, 1,048 at 32k)."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``h @ weightᵀ`` with its gradients computed chunk by chunk in the
    forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index: int, chunk_rows: int, scaling: float = 1.0):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N = h.shape[0]
        acc = torch.promote_types(torch.promote_types(h.dtype, weight.dtype), torch.float32)
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for start in range(0, N, chunk_rows):
            hc = h[start : start + chunk_rows]
            tc = targets[start : start + chunk_rows]
            logits = (hc @ weight.t()).to(acc)  # [n, V]
            if scaling != 1.0:  # (Granite's logits_scaling: logits / s)
                logits = logits.div_(scaling)
            valid = tc != ignore_index
            safe = torch.where(valid, tc, torch.zeros_like(tc))
            lse = torch.logsumexp(logits, dim=-1)  # [n]
            picked = logits.gather(1, safe[:, None])[:, 0]
            total = total + torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if need_h or need_w:
                # ∂ loss / ∂ logits = softmax − one-hot, zero on ignored rows (in place on the logits)
                g = logits.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, safe[:, None], torch.full_like(lse, -1.0)[:, None])
                g.mul_(valid[:, None].to(g.dtype))
                if scaling != 1.0:  # ∂ logits / ∂ (h Wᵀ) = 1 / s
                    g.div_(scaling)
                if need_h:
                    grad_h[start : start + chunk_rows] = g.to(weight.dtype) @ weight
                if need_w:
                    grad_w += g.t() @ hc.to(acc)  # (a no-op cast in float32; mm: FLOP counters see it)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # the stored gradients are constants: no second-order terms
            raise RuntimeError(
                "chunked_cross_entropy: its gradient is computed in the forward and is first order only, "
                "so a graph of it (create_graph=True: a gradient penalty, a second derivative) would "
                "silently miss the second-order terms; use F.cross_entropy(F.linear(h, weight), targets)"
            )
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def _check_targets(targets: torch.Tensor, V: int, ignore_index: int) -> None:
    """``targets`` in ``[0, V)`` or equal to ``ignore_index`` (see :func:`chunked_cross_entropy`'s
    Raises); skipped while ``torch.compile`` traces."""
    if not targets.numel() or torch.compiler.is_compiling():
        return
    ok = ((targets >= 0) & (targets < V)) | (targets == ignore_index)
    if avoid_host_reads(targets):
        assert_on_device(
            ok.all(), f"targets must lie in [0, vocab = {V}) or equal ignore_index = {ignore_index}"
        )
        return
    if not bool(ok.all()):
        bad = targets[~ok]
        raise ValueError(
            f"targets: expected class indices in [0, vocab = {V}) or ignore_index = {ignore_index}, got "
            f"{bad.numel()} outside (values in [{int(bad.min())}, {int(bad.max())}])"
        )


def chunked_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "sum",
    chunk_rows: int | None = None,
    logits_scaling: float = 1.0,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight).float() / logits_scaling, targets, ignore_index=…,
    reduction=…)``
    without the ``[N, V]`` logits (module docstring). The logits, loss and ``∂W`` accumulate in
    float32 (float64 when ``h`` or ``weight`` is float64); under autocast the head's matmuls run
    in the autocast dtype, as ``nn.Linear``'s would.

    Args:
        h: ``[N, d]`` (or ``[B, T, d]``, flattened) hidden states, floating point.
        weight: ``[V, d]`` the head's weight (``nn.Linear(d, V, bias=False).weight``), floating point.
        targets: ``[N]`` (or ``[B, T]``) integer class indices in ``[0, V)``, or ``ignore_index``.
        ignore_index: targets left out of the loss and the count (default ``-100``).
        reduction: ``"sum"`` (default) or ``"mean"`` (over the targets that are not ignored: NaN
            when all are, as ``F.cross_entropy``).
        chunk_rows: tokens per chunk (default :func:`default_chunk_rows` of ``V``).
        logits_scaling: the logits are ``h @ weightᵀ`` divided by it, in the accumulation dtype
            (Granite's ``logits_scaling``, :class:`~mnemo.models.ModelConfig`; default ``1.0``: no
            division). A finite number > 0.
    Returns:
        0-d float32 tensor (float64 for float64 inputs), differentiable with respect to ``h``
        and ``weight`` (once: the gradient is computed in the forward and the graph has no second
        derivative; asking for a graph of the gradient, ``create_graph=True``, raises
        ``RuntimeError`` rather than drop the second-order terms).
    Raises:
        ValueError: a shape, dtype, ``reduction`` or ``chunk_rows`` that does not fit, or (CPU
            tensors) a target outside ``[0, V)`` that is not ``ignore_index``; the message names
            the argument, what was expected and what was received. On another device an
            out-of-range target fails the stream with a device-side assert that names ``targets``
            (reading the values back would synchronise every call).
    """
    if h.ndim == 3:
        h = h.flatten(0, 1)
    if targets.ndim == 2:
        targets = targets.flatten()
    if h.ndim != 2 or not h.is_floating_point():
        raise ValueError(f"h: expected a floating [N, d] or [B, T, d] tensor, got {h.dtype} {list(h.shape)}")
    if weight.ndim != 2 or weight.shape[1] != h.shape[1] or not weight.is_floating_point():
        raise ValueError(
            f"weight: expected a floating [V, d = {h.shape[1]}] tensor, "
            f"got {weight.dtype} {list(weight.shape)}"
        )
    if targets.ndim != 1 or targets.shape[0] != h.shape[0] or targets.dtype not in (torch.long, torch.int32):
        raise ValueError(
            f"targets: expected an integer [N = {h.shape[0]}] tensor, "
            f"got {targets.dtype} {list(targets.shape)}"
        )
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0])
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected an int >= 1, got {chunk_rows!r}")
    s = logits_scaling
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
        raise ValueError(f"logits_scaling: expected a finite number > 0, got {s!r}")
    targets = targets.long()
    _check_targets(targets, weight.shape[0], ignore_index)
    if not torch.is_grad_enabled():
        # no graph will be built (no_grad, inference_mode, evaluation): the Function would still see
        # needs_input_grad from requires_grad and compute ∂h and ∂W in the forward, two more
        # matmuls of the head's size and [N, d] + [V, d] held for nothing
        h, weight = h.detach(), weight.detach()
    total = _ChunkedCrossEntropy.apply(h, weight, targets, int(ignore_index), chunk_rows, float(s))
    if reduction == "mean":
        total = total / (targets != ignore_index).sum()
    return total

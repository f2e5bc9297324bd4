"""Short causal depthwise convolution with a streaming state."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import _native, _workspace
from ..ops._common import check_cu_seqlens, seen_by_transform
from .state import spec


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time, followed by SiLU (as in H3, Mamba, GLA, DeltaNet).

        y_t = silu( Σ_{i=0}^{W−1} w_i ⊙ x_{t−W+1+i} + b )

    Args:
        channels: ``C``. kernel_size: ``W`` (taps, including the current token; default
            ``kernel_size=4``).
        activation: apply SiLU after the convolution (default ``True``).
        bias: a bias ``b`` (default ``True``; zeros at initialisation).
        (``ValueError`` naming the argument unless the sizes are ints ``>= 1`` and the flags bools.)

    ``forward(x [B, T, C], state [B, C, W−1] | None) -> (y [B, T, C], state [B, C, W−1])``:
    ``state`` holds the last ``W − 1`` inputs (zeros at the start), so any ``T`` (also
    ``T < W − 1``) continues a stream exactly. bfloat16/float16 inputs are convolved (and the SiLU
    applied) in float32 and rounded once to the input's dtype; the state stays in that dtype.
    Raises ``ValueError`` (naming ``x``, expected vs received shape) unless ``x`` is
    ``[B, T, channels]``.
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, activation: bool = True, bias: bool = True):
        super().__init__()
        for name, value in (("channels", channels), ("kernel_size", kernel_size)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("activation", activation), ("bias", bias)):
            if not isinstance(value, bool):  # (a config's "False" string would switch by truthiness)
                raise ValueError(f"{name}: expected a bool, got {value!r}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_input(x)
        B, T, C = x.shape
        W = self.kernel_size
        if state is None:
            state = x.new_zeros(B, C, W - 1)
        elif tuple(state.shape) != (B, C, W - 1):
            raise ValueError(
                f"conv state must have shape [B, C, W-1] = [{B}, {C}, {W - 1}], got {list(state.shape)}"
            )
        xp = torch.cat([state.to(x.dtype).transpose(1, 2), x], dim=1)  # [B, W-1+T, C]
        # bf16/fp16 inputs accumulate in float32 and are rounded once at the end (DESIGN §3), so
        # the one-token step and the multi-token pass agree to one rounding of the output dtype
        acc = torch.promote_types(x.dtype, torch.float32)
        xa = xp.to(acc)
        w = self.weight[:, 0, :].to(acc)  # [C, W]
        b = None if self.bias is None else self.bias.to(acc)
        if T == 1:  # one decoding step: W multiply-adds per channel; a kernel call costs more
            y = (xa * w.t()).sum(1, keepdim=True)
            if b is not None:
                y = y + b
        elif seen_by_transform(xa, w, b):
            # torch.func transforms and forward-mode AD: the same sum as recorded operations (the
            # Function's hand-written backward has no jvp or vmap rule)
            y = xa[:, :T] * w[:, 0]
            for i in range(1, W):
                y = y + xa[:, i : i + T] * w[:, i]
            if b is not None:
                y = y + b
        else:
            y = _CausalConv.apply(xa, w, b, T)
        if self.activation:
            y = F.silu(y)
        y = y.to(x.dtype)
        # a copy of the tail (a view would keep the whole padded input [B, W-1+T, C] alive with the
        # state: after a long prefill, megabytes per layer held through decoding for a few bytes)
        tail = xp[:, xp.shape[1] - (W - 1) :].transpose(1, 2)
        return y, tail.clone(memory_format=torch.contiguous_format)  # [B, C, W-1]

    def forward_packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed documents ``x [1, N, C]`` with boundaries ``cu_seqlens [D + 1]``: each document
        is convolved from a zero state (a tap that would reach into the previous document reads
        zero), ``y [1, N, C]``. W masked shifted multiply-adds (``W`` is a few taps). Raises
        ``ValueError`` / ``TypeError`` for boundaries that do not pack ``x`` (``B ≠ 1``, not from
        0 to ``N``, decreasing, not integers)."""
        self._check_input(x)
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
        N, W = x.shape[1], self.kernel_size
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        pos = torch.arange(N, device=x.device) - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        acc = torch.promote_types(x.dtype, torch.float32)  # bf16/fp16 accumulate in float32
        xa = x.to(acc)
        w = self.weight[:, 0, :].to(acc)  # [C, W]; tap i reads x_{t - (W - 1 - i)}
        y = xa * w[:, W - 1]
        for lag in range(1, W):
            shifted = F.pad(xa, (0, 0, lag, 0))[:, :N]  # (xa[:, :N - lag] kept all of xa for N < lag)
            y = y + shifted * (pos >= lag).to(acc)[None, :, None] * w[:, W - 1 - lag]
        if self.bias is not None:
            y = y + self.bias.to(acc)
        return (F.silu(y) if self.activation else y).to(x.dtype)

    def _check_input(self, x: torch.Tensor) -> None:
        """``x`` must be ``[B, T, channels]``: a wrong channel count would broadcast against the
        per-channel taps (one channel silently became ``channels``) or fail inside a kernel."""
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.channels:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape [B, T, C] = [B, T, {self.channels}], got {got}")

    def state_spec(self, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The streaming state ``[B, C, W − 1]`` as a ``meta`` tensor (it is in the input's dtype;
        default ``batch_size=1``)."""
        return spec((batch_size, self.channels, self.kernel_size - 1), dtype)


class _CausalConv(torch.autograd.Function):
    """``y_t = Σ_i w_i ⊙ xp_{t+i} (+ b)`` on the time-major layout.

    On the CPU (float32/float64) both passes run the C kernel of :mod:`mnemo.ops._native` (one
    pass over memory instead of one per tap; ``MNEMO_NATIVE=0`` switches it off). Otherwise: W
    shifted multiply-adds forward, and a backward that accumulates the input gradient in place
    (no per-shift zero tensors). Twice differentiable: when a graph of the gradient is asked for
    (``create_graph=True``) the backward runs that PyTorch form, whose operations autograd
    records (the C kernel is first order)."""

    @staticmethod
    def forward(ctx, xp, w, b, T):
        W = w.shape[1]
        native = _native.usable(xp, w, *([] if b is None else [b]))
        if native:
            xp = xp.contiguous()
            B, _, C = xp.shape
            y = _workspace.empty((B, T, C), xp.dtype, xp.device)  # reused across calls (no page faults)
            _native.call(
                "conv_fwd", xp.dtype, C, _native.slots(C), [B, T, C, W, xp, w.t().contiguous(), b, y]
            )
        else:
            y = xp[:, :T] * w[:, 0]
            for i in range(1, W):
                y.addcmul_(xp[:, i : i + T], w[:, i])
            if b is not None:
                y += b
        ctx.save_for_backward(xp, w)
        ctx.has_bias, ctx.T, ctx.native = b is not None, T, native
        return y

    @staticmethod
    def backward(ctx, dy):
        xp, w = ctx.saved_tensors
        T, W = ctx.T, w.shape[1]
        dxp = dw = db = None
        if ctx.native and dy.dtype == xp.dtype and not torch.is_grad_enabled():
            B, _, C = xp.shape
            dy = dy.contiguous()
            dxp = _workspace.empty(xp.shape, xp.dtype, xp.device) if ctx.needs_input_grad[0] else None
            dwt = xp.new_empty(W, C)
            db = xp.new_empty(C) if ctx.has_bias else None
            _native.call(
                "conv_bwd",
                xp.dtype,
                C,
                _native.slots(C),
                [B, T, C, W, xp, w.t().contiguous(), dy, dxp, dwt, db],
            )
            return dxp, dwt.t(), db, None
        if ctx.needs_input_grad[0]:
            dxp = torch.zeros_like(xp)
            for i in range(W):
                dxp[:, i : i + T].addcmul_(dy, w[:, i])
        if ctx.needs_input_grad[1]:
            dy2 = dy.reshape(-1, dy.shape[-1])
            dw = torch.stack([(xp[:, i : i + T].reshape(-1, dy.shape[-1]) * dy2).sum(0) for i in range(W)], 1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum((0, 1))
        return dxp, dw, db, None

"""Products of a few rows with a weight matrix, for one-token decoding (issue 40 item 3): ``y = x wᵀ
+ b`` with ``x: [M, K]``, ``M ≤ 8``, read at the speed of the weight's memory.

A decode step multiplies its batch (1-8 rows) by every weight matrix once, so it is bound by
reading the weights. MKL's ``sgemv``/``sgemm`` read them at about a quarter of the STREAM triad
on the 2-core machine of ``docs/benchmarks/notes.md``, and the multiply-sum loop inductor compiles
(:mod:`mnemo.models._matvec`) rereads each weight row once per row of ``x``: 12 GB/s for 8 rows.
The C kernel (``mnemo/ops/_native/small_mm.c``) reads each weight row once for all rows of ``x``,
with the next rows prefetched while a block is multiplied (``python scripts/bench_matvec.py``).

:func:`small_mm` is the function, through the operator ``torch.ops.mnemo.small_mm`` (opaque to
``torch.compile``), which the compiled decode step calls for every product whose weight is large
enough, in a step whose weights do not fit in the last-level cache (:data:`KERNEL_MIN_WEIGHT`,
:data:`KERNEL_MIN_STEP_BYTES`; :class:`mnemo.models._matvec.MatvecPass`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from . import _native
from ._common import transformed

__all__ = [
    "small_mm",
    "last_level_cache_bytes",
    "MAX_ROWS",
    "KERNEL_MIN_ROWS",
    "KERNEL_MIN_WEIGHT",
    "KERNEL_MIN_STEP_BYTES",
]

#: the most rows of ``x`` the kernel takes (a decode step's batch)
MAX_ROWS = 8

#: the smallest weight (``N · K`` elements) the compiled decode step hands to the kernel: a call
#: through the op costs ~12 us of Python and splits inductor's fused loops around it, which a small
#: product does not win back
KERNEL_MIN_WEIGHT = 1 << 16


def last_level_cache_bytes(
    default: int = 32 << 20, root: str | Path = "/sys/devices/system/cpu/cpu0/cache"
) -> int:
    """The largest CPU cache's size in bytes, read from Linux sysfs.

    Args:
        default: the answer where no size can be read (default ``33554432``: 32 MiB, the AMD EPYC
            machine of ``docs/benchmarks/notes.md``).
        root: ``cpu0``'s cache directory, each ``index*/size`` such as ``32768K``.
    """
    best = 0
    for index in Path(root).glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


#: the kernel serves a compiled decode step only when the step's products' weights together reach
#: this many bytes (default: the last-level cache's size, :func:`last_level_cache_bytes`). A model
#: whose weights fit there reads them from the cache, where inductor's fused loop is as fast and
#: needs no call: at d_model 128 and 256 (2-21 MB of weights, under this machine's 32 MB L3),
#: drafts that routed by weight size alone made 8-row steps 0.74-1.09x as fast; at d_model 512
#: (54-110 MB of weights) 8-row steps run 1.43-1.78x as fast (``docs/benchmarks/notes.md``)
KERNEL_MIN_STEP_BYTES = last_level_cache_bytes()

#: the fewest rows of ``x`` the compiled decode step hands to the kernel: one row is a pure read
#: of the weight, which inductor's fused loop does as fast without the op's call
#: (``docs/benchmarks/notes.md``)
KERNEL_MIN_ROWS = 2

#: the smallest weight split across threads (8 rows, K = 512, through ``_native.call``: at 16,384
#: elements one thread and two take the same 9 us, at 32,768 two take 10.8 us against 12.6)
_THREADED_MIN_WEIGHT = 1 << 15


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and not (name == "bias" and t is None):
            raise TypeError(
                f"{name}: expected a tensor{' or None' if name == 'bias' else ''}, got {type(t).__name__}"
            )
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x: expected [M, K] with 1 <= M <= {MAX_ROWS}, got shape {list(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight: expected [N, K] with K = {x.shape[1]} (x's last dimension), "
            f"got shape {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected shape [{weight.shape[0]}] (weight's rows), got {list(bias.shape)}")
    given = {n: t.dtype for n, t in (("x", x), ("weight", weight), ("bias", bias)) if t is not None}
    if len(set(given.values())) != 1:
        names = ", ".join(given)
        got = ", ".join(f"{n} {d}" for n, d in given.items())
        raise ValueError(f"{names}: expected one dtype, got {got}")


def small_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``) for a few rows: the products of one-token decoding.

    Args:
        x: ``[M, K]``, ``1 ≤ M ≤`` :data:`MAX_ROWS`.
        weight: ``[N, K]`` (an ``nn.Linear`` weight), ``x``'s dtype.
        bias: ``[N]`` in ``x``'s dtype, or ``None``.
    Returns:
        ``[M, N]`` in ``x``'s dtype.
    Forms: float32/float64 CPU tensors run the C kernel ``small_mm.c`` through the op
    ``torch.ops.mnemo.small_mm`` (each weight row read once for all ``M`` rows; a contiguous copy of
    ``x`` or ``weight`` is made if they are not, which for the weight costs a full extra pass);
    everything else (CUDA, bfloat16, ``MNEMO_NATIVE=0``, no C compiler) runs ``F.linear``. The two
    differ by float rounding only (another summation order). Differentiable: the gradients are
    PyTorch products (``dx = dy · weight``, ``dweight = dyᵀ · x``, ``dbias = Σ_rows dy``); under
    forward-mode AD, a ``torch.func`` transform or ``torch.compile`` the whole call is ``F.linear``
    (the compiled decode step puts the op into its graphs through its own pass). The op itself,
    which the compiled decode step calls, has no backward: called directly on tensors that need a
    gradient, its output's backward leaves their gradients unset (PyTorch warns that no autograd
    kernel is registered; registering one would put a Python call on every decode product).
    Raises:
        TypeError: ``x`` or ``weight`` not a tensor, ``bias`` neither a tensor nor ``None``.
        ValueError: shapes or dtypes as above (naming the argument, the expected and the received).
    """
    _check(x, weight, bias)
    operands = (x, weight) if bias is None else (x, weight, bias)
    # forward-mode AD, torch.func: F.linear has their rules. Under torch.compile F.linear too: dynamo
    # cannot trace the check, and a transform it traces would meet the op, which has no rule for it
    # (the decode step's pass puts the op into its graphs itself)
    if torch.compiler.is_compiling() or transformed(*operands):
        return _linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return _SmallMM.apply(x, weight, bias)
    return torch.ops.mnemo.small_mm(x, weight, bias)


class _SmallMM(torch.autograd.Function):
    """:func:`small_mm` with a gradient: the op forward, PyTorch products backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mnemo.small_mm(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.t() @ x if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's PyTorch twin: ``F.linear``."""
    return F.linear(x, weight, bias)


# A plain operator (torch.library.Library), not torch.library.custom_op: a call through custom_op's
# Python wrappers costs ~26 us here, through the dispatcher straight to the CPU kernel below ~12 us
# (the decode step makes one call per weight matrix). Opaque to torch.compile (its fake kernel
# gives the shape).
_LIB = torch.library.Library("mnemo", "FRAGMENT")
_LIB.define("small_mm(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _small_mm_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CPU kernel of ``torch.ops.mnemo.small_mm``: the checks of :func:`small_mm` (which the
    decode step's pass has made when it built the call) only where a cheap test of the shapes and
    dtypes fails, so that a wrong call raises the same error as on other devices."""
    if (
        x.dim() != 2
        or weight.dim() != 2
        or not 1 <= x.shape[0] <= MAX_ROWS
        or weight.shape[1] != x.shape[1]
        or weight.dtype != x.dtype
        or (bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype))
    ):
        _check(x, weight, bias)  # raises
    dtype = x.dtype
    if (
        dtype not in (torch.float32, torch.float64) or not _native.enabled() or _native.library() is None
    ):  # (cheaper than _native.usable_opaque: this runs once per weight matrix and decode step)
        return _linear(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    if K == 0:  # (the kernel takes K >= 1; the product is then the bias)
        return _linear(x, weight, bias)
    y = x.new_empty((M, N))
    nt = _native.slots(N) if N * K >= _THREADED_MIN_WEIGHT else 1
    args = [M, K, x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), y]
    _native.call("smm_fwd", dtype, N, nt, args)
    return y


def _small_mm_other(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)  # (the op takes what small_mm takes on every device)
    return _linear(x, weight, bias)


_LIB.impl("small_mm", _small_mm_cpu, "CPU")
_LIB.impl("small_mm", _small_mm_other, "CompositeExplicitAutograd")  # other devices: F.linear


@torch.library.register_fake("mnemo::small_mm")
def _(x, weight, bias):
    _check(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))

"""Probes for device-resident steps: no value read back to the host, no host tensor mixed in.

A training or decoding step of a model that lives on an accelerator should not wait for it: every
value read back to Python (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``, ``.cpu()``) and
every op whose output shape depends on the values (``nonzero``, a boolean index, ``bincount``,
``unique``) is a host synchronisation, and every copy of a host tensor into the step is a
host-to-device transfer. The ``meta`` device shows most of them on a machine without a GPU
(a read raises there), but not all: plain meta kernels accept a CPU tensor mixed into a meta
computation for ``F.linear``/``mm``, ``embedding``, ``index_select`` and ``gather``, and do not
check the dtypes of a matmul (an fp32 weight in a bf16 model). The two dispatch modes here close
that gap:

* :class:`StrictDeviceProbe` (``with StrictDeviceProbe(): step()``) raises
  :class:`DeviceProbeError` on the first op that mixes devices, runs a matmul on mixed float
  dtypes, copies a host tensor to the device, reads a device value back, or has a value-dependent
  output shape on the device. It works on any device (``meta``, ``cuda``); on CPU tensors it only
  checks the matmul dtypes (every tensor is a host tensor there).
* :class:`HostReadCounter` counts the reads of a step instead of failing: on the device
  (``syncs``: each would wait for the accelerator) and on the host (``host_reads``: CPU values,
  free of any device wait, e.g. a batch before it is moved). With ``answer_meta=True`` a read of a
  ``meta`` value is answered with zeros instead of raising, so a whole step (a trainer's, whose
  one read per step is its finite check) can run on ``meta`` and be counted.

What neither sees: the copy ``torch.tensor(data, device=dev)`` makes (it does not pass the
dispatcher), and reads in code that runs outside the ``with`` block. Both modes are plain
:class:`torch.utils._python_dispatch.TorchDispatchMode` subclasses: they see the ops of the
forward and of the backward (the autograd engine carries the mode to its threads), below autograd
and autocast (the dtypes are those the kernels receive).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["DeviceProbeError", "HostReadCounter", "StrictDeviceProbe", "host_reads"]

aten = torch.ops.aten

#: matmul-family ops whose floating-point tensor arguments must share one dtype
MATMUL_OPS = frozenset(
    {
        aten.mm,
        aten.bmm,
        aten.addmm,
        aten.addbmm,
        aten.baddbmm,
        aten.matmul,
        aten.linear,
        aten.mv,
        aten.addmv,
        aten.dot,
        aten.vdot,
        aten.addr,
        aten._addmm_activation,
        aten.convolution,
        aten._convolution,
    }
)

#: copies: their source and destination devices may differ (checked as transfers instead)
COPY_OPS = frozenset({aten._to_copy, aten.copy_, aten._copy_from, aten._copy_from_and_resize})

#: ops whose output shape depends on the values (a host synchronisation on an accelerator)
VALUE_SHAPED_OPS = frozenset(
    {
        aten.nonzero,
        aten.masked_select,
        aten._unique,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
        aten.unique_dim_consecutive,
        aten.bincount,
        aten.histc,
    }
)

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class DeviceProbeError(AssertionError):
    """A step did what :class:`StrictDeviceProbe` forbids; the message names the op, the tensors'
    devices and dtypes, and the first caller frame outside torch."""


def _where() -> str:
    """The innermost frame outside torch and this module: where the offending op was called."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_HERE) and not path.startswith(_TORCH):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<unknown>"


def _describe(tensors) -> str:
    return ", ".join(f"{t.dtype} {list(t.shape)} on {t.device}" for t in tensors)


def _is_host_scalar(t: torch.Tensor) -> bool:
    """A 0-d CPU tensor, which PyTorch lets any device's op take (as a number)."""
    return t.device.type == "cpu" and t.ndim == 0


def _transfer(func, args, kwargs) -> tuple[torch.device, torch.device] | None:
    """``(source, destination)`` devices of a copy op, or ``None`` for any other op."""
    packet = func.overloadpacket
    if packet not in COPY_OPS:
        return None
    if packet is aten._to_copy:
        src = args[0]
        dst = kwargs.get("device") or src.device
        return src.device, torch.device(dst)
    if packet is aten.copy_:
        return args[1].device, args[0].device
    # _copy_from(self, dst) / _copy_from_and_resize(self, dst)
    return args[0].device, args[1].device


def _value_shaped(func, args, kwargs) -> bool:
    """Whether the op's output shape depends on its values: the ops of :data:`VALUE_SHAPED_OPS`,
    an index by a boolean mask (``x[mask]``, ``x[mask] = v``) and ``repeat_interleave`` without
    ``output_size``."""
    packet = func.overloadpacket
    if packet in VALUE_SHAPED_OPS:
        return True
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet is aten.repeat_interleave:  # (output_size is keyword-only in both tensor overloads)
        return func is not aten.repeat_interleave.self_int and kwargs.get("output_size") is None
    return False


class StrictDeviceProbe(TorchDispatchMode):
    """``with StrictDeviceProbe(): step()`` — fail on the first op of the step that

    1. mixes devices: a tensor on one device among tensors on another, e.g. a CPU weight in a
       ``meta``/CUDA ``F.linear``, ``embedding``, ``index_select`` or ``gather`` (0-d CPU tensors
       are allowed: PyTorch takes them as numbers on any device);
    2. runs a matmul-family op (:data:`MATMUL_OPS`: ``mm``, ``bmm``, ``addmm``, ``baddbmm``,
       ``linear``, ``matmul``, convolutions, …) on floating-point tensors of different dtypes
       (a bf16 activation times an fp32 weight);
    3. copies a host tensor to another device (``.to(device)``, ``copy_`` from the CPU), any size;
    4. reads a device value back (``.item()``, ``bool``, ``float``, ``.tolist()``, ``.cpu()``:
       ``_local_scalar_dense`` or a copy to the CPU);
    5. computes a value-dependent shape on a device (``nonzero``, a boolean index, ``bincount``,
       ``unique``, ``masked_select``, ``repeat_interleave`` of a tensor of repeats).

    Raises :class:`DeviceProbeError` (an ``AssertionError``) naming the op, its tensors and the
    caller. Rules 3–5 concern non-CPU devices only. With ``allow_transfers_in=True`` rule 3 is off
    (a step that receives its batch from the host, e.g. a trainer's). ``ops_seen`` counts the
    ops checked (a probe that saw nothing proves nothing)."""

    def __init__(self, *, allow_transfers_in: bool = False):
        super().__init__()
        self.allow_transfers_in = allow_transfers_in
        self.ops_seen = 0

    def _fail(self, what: str, func, tensors) -> None:
        raise DeviceProbeError(f"{what}: {func} on {_describe(tensors)}, called at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops_seen += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        transfer = _transfer(func, args, kwargs)
        if transfer is not None:
            src, dst = transfer
            if src.type == "cpu" and dst.type != "cpu" and not self.allow_transfers_in:
                self._fail("host-to-device copy inside the step", func, tensors)
            if src.type != "cpu" and dst.type == "cpu":
                self._fail("device-to-host copy (a host read) inside the step", func, tensors)
        else:
            devices = {t.device for t in tensors if not _is_host_scalar(t)}
            if len(devices) > 1:
                self._fail("tensors on different devices in one op", func, tensors)
            if func.overloadpacket is aten._local_scalar_dense and tensors[0].device.type != "cpu":
                self._fail("a device value read back to the host", func, tensors)
            if _value_shaped(func, args, kwargs) and any(t.device.type != "cpu" for t in tensors):
                self._fail("an output shape that depends on device values (a host sync)", func, tensors)
            if func.overloadpacket in MATMUL_OPS:
                floats = {t.dtype for t in tensors if t.is_floating_point()}
                if len(floats) > 1:
                    self._fail("a matmul on mixed float dtypes", func, tensors)
        return func(*args, **kwargs)


@dataclass
class HostReads:
    """What :class:`HostReadCounter` saw: ``syncs`` (reads of non-CPU values, copies to the host,
    value-shaped ops on a device: each a host synchronisation on an accelerator), ``host_reads``
    (reads of CPU values: ``_local_scalar_dense``, ``.tolist()``, ``.numpy()``, value-shaped ops
    on the CPU; no device wait) and ``sites``: ``(kind, op, caller)`` per event."""

    syncs: int = 0
    host_reads: int = 0
    sites: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, sync: bool, op: str) -> None:
        if sync:
            self.syncs += 1
        else:
            self.host_reads += 1
        self.sites.append(("sync" if sync else "host", op, _where()))


class HostReadCounter(TorchDispatchMode):
    """Count the host reads of a step (see :class:`HostReads`); :func:`host_reads` is the
    context-manager form that also counts ``.tolist()``/``.numpy()`` of CPU tensors (which do not
    pass the dispatcher).

    ``answer_meta=True``: a read of a ``meta`` value (``_local_scalar_dense``, a copy to the CPU)
    is counted and answered with zeros of its dtype and shape instead of raising, so code that reads
    once per step (a trainer's finite check) runs on ``meta`` to the end; the values it then sees
    are placeholders, not results."""

    def __init__(self, *, answer_meta: bool = False):
        super().__init__()
        self.answer_meta = answer_meta
        self.reads = HostReads()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten._local_scalar_dense:
            t = args[0]
            self.reads.add(t.device.type != "cpu", str(func))
            if t.device.type == "meta" and self.answer_meta:
                return False if t.dtype == torch.bool else 0 if not t.is_floating_point() else 0.0
            return func(*args, **kwargs)
        transfer = _transfer(func, args, kwargs)
        if transfer is not None and transfer[0].type != "cpu" and transfer[1].type == "cpu":
            self.reads.add(True, str(func))
            src = args[0] if packet is aten._to_copy else args[1] if packet is aten.copy_ else args[0]
            if src.device.type == "meta" and self.answer_meta:
                if packet is aten._to_copy:
                    dtype = kwargs.get("dtype") or src.dtype
                    return torch.zeros(src.shape, dtype=dtype, device="cpu")
                return (args[0] if packet is aten.copy_ else args[1]).zero_()  # the destination
            return func(*args, **kwargs)
        if _value_shaped(func, args, kwargs):
            on_device = any(
                isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_leaves((args, kwargs))
            )
            self.reads.add(on_device, str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads(*, answer_meta: bool = False) -> Iterator[HostReads]:
    """``with host_reads() as r: step()`` then ``r.syncs``, ``r.host_reads``, ``r.sites``: a
    :class:`HostReadCounter` plus counters on ``Tensor.tolist`` and ``Tensor.numpy`` of CPU
    tensors (on other devices they pass the dispatcher as a copy to the host and are counted
    there). ``answer_meta`` as in :class:`HostReadCounter`."""
    mode = HostReadCounter(answer_meta=answer_meta)
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counted(name):
        original = saved[name]

        def wrapper(self, *args, **kwargs):
            if self.device.type == "cpu":
                mode.reads.add(False, f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return wrapper

    for name in saved:
        setattr(torch.Tensor, name, counted(name))
    try:
        with mode:
            yield mode.reads
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)

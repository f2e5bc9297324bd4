"""What every token mixer shares: its forward contract, hook points and implicit attention."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from ..ops._common import check_cu_seqlens, pad_packed, unpad_packed, varlen_index
from .state import nbytes


class Mixing(NamedTuple):
    """A mixer's implicit attention on one input: ``output[:, t, h] = Σ_s maps[:, h, t, s] ·
    values[:, s, h]`` (from a zero state; the mixer's read-out — norms, gates, projections —
    comes after ``output``).

    For a memory that is not linear in its values (a test-time-trained MLP memory, whose mixer
    has ``mixing_exact = False``), ``maps`` is an attribution of each read to the earlier writes
    and ``output`` is the read minus the read with every value zeroed; the identity above then
    holds only approximately (see :mod:`mnemo.memory.attribution`)."""

    maps: torch.Tensor  # [B, H, T, T]
    values: torch.Tensor  # [B, T, H, V]
    output: torch.Tensor  # [B, T, H, V]


class Mixer(nn.Module):
    """Base class of token mixers: ``forward(x, state=None) -> (y, state)``.

    ``x, y: [B, T, d_model]``. The same module serves training (``T`` large, the chunk/parallel
    form) and one-token decoding (``T = 1``, the recurrent form), and any split in between:
    running ``x[:, :a]`` then ``x[:, a:]`` with the returned state equals one call on ``x``.
    ``mode`` (constructor or per call) selects the op form for ``T > 1``; ``T = 1`` always uses the
    recurrent step. ``x`` has the dtype of the mixer's weights, or under ``torch.autocast`` any
    floating dtype but float64 (:func:`check_input`: ``ValueError`` naming ``x`` otherwise).

    **Anatomy.** ``forward`` is the only place a mixer computes its intermediates; each passes
    through a :class:`~mnemo.layers.hooks.HookPoint` attribute named by the field's term —
    ``hook_q``, ``hook_k``, ``hook_v``, ``hook_g`` (log decay), ``hook_beta``, ``hook_dt``,
    ``hook_o`` (the op's output, before the read-out), ``hook_state`` (the state after the call),
    ``hook_pattern`` (softmax probabilities) — as the op receives it. A subclass lists its names and
    shapes in its docstring. :meth:`mixing` turns the recorded values into the implicit attention.
    """

    #: the hook names :meth:`mixing` needs (recorded by ``LanguageModel.run_with_cache``)
    mixing_hooks: tuple[str, ...] = ()

    #: ``True`` when the state's ``offset`` (tokens consumed) never changes what the mixer computes
    #: (no positions, no periods): states of streams of different lengths can then decode as one
    #: batch (``LanguageModel.generate`` with an ``attention_mask``). Conservative default ``False``.
    offset_free: bool = False

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.register_load_state_dict_post_hook(refill_meta_constants)

    @property
    def map_heads(self) -> int | None:
        """Heads of the map :meth:`mixing` returns (``H`` of ``[B, H, T, T]``), known without running
        it — what ``heads=`` of :mod:`mnemo.interp`'s interventions index: a hook value
        ``[B, T, H, …]`` has them on axis 2, and a mixer whose map has one head (a memory over the
        whole ``d_model``) has it whole in every value. Default: ``n_heads`` for a mixer with
        :attr:`mixing_hooks`, ``None`` without a map."""
        return getattr(self, "n_heads", None) if self.mixing_hooks else None

    def ov_matrices(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per head ``(W_V [d_model, D], W_O [D, d_model])`` — what a head writes to the residual
        stream for the token it attends to (the OV circuit of Elhage et al. 2021) — for mixers whose
        heads read values through a softmax pattern; ``None`` for the others (the default)."""
        return None

    def mixing(self, acts: dict[str, torch.Tensor]) -> Mixing:
        """The implicit attention from this mixer's recorded hook values ``acts`` (short names,
        e.g. ``{"hook_q": ..., "hook_k": ..., "hook_v": ..., "hook_o": ...}``, of one fresh-stream
        call). Mixers whose memory is nonlinear in the values (test-time-trained MLP memories)
        have no such matrix and raise ``NotImplementedError``."""
        raise NotImplementedError(
            f"{type(self).__name__} has no implicit attention map (its memory is not linear in the values)"
        )

    @torch.no_grad()
    def mixing_acts(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The values of :attr:`mixing_hooks` (names relative to this mixer, ``memory.hook_q``
        included) on one fresh-stream call on ``x [B, T, d_model]``: what :meth:`mixing` takes (a
        hook point that fires more than once: its last value)."""
        return {h: values[-1] for h, values in self._mixing_firings(x).items() if values}

    def _mixing_firings(self, x: torch.Tensor) -> dict[str, list]:
        """Every value each of :attr:`mixing_hooks` gave on one fresh-stream call on ``x``, in order."""
        fired: dict[str, list] = {h: [] for h in self.mixing_hooks}
        handles = [
            self.get_submodule(h).register_forward_hook(lambda mod, args, out, h=h: fired[h].append(out))
            for h in self.mixing_hooks
        ]
        try:
            self(x)
        finally:
            for handle in handles:
                handle.remove()
        return fired

    def forward_packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor, *, mode: str | None = None):
        """Several documents packed in one row: ``x [1, N, d_model]``, ``cu_seqlens [D + 1]``
        (long, ``0 = c_0 < c_1 < … < c_D = N``: document ``i`` is ``x[:, c_i:c_{i+1}]``). Returns
        ``y [1, N, d_model]`` where each document is mixed as if alone (its state starts empty; no
        information crosses a boundary).

        This default right-pads the documents into one batch ``[D, max length, d_model]`` (zeros)
        and runs one call: a mixer's output at a token never depends on later tokens (any split
        of a stream equals one pass — the contract every mixer is tested on), so the padding
        after a document cannot reach it. Hooks then see the padded batch. A mixer whose op
        takes ``cu_seqlens`` may override this with an unpadded call. Raises ``ValueError`` for
        offsets that do not cover ``x`` (:func:`~mnemo.ops._common.check_cu_seqlens`)."""
        check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])  # (else the documents past c_D vanish)
        idx, valid, _ = varlen_index(cu_seqlens, x.device)
        y, _ = self(pad_packed(x, idx, valid), None, mode=mode)
        return unpad_packed(y, valid)

    def _mode(self, T: int, mode: str | None) -> str:
        if mode is not None:
            return mode
        return "recurrent" if T == 1 else self.mode

    def state_spec(self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None):
        """The state after ``seq_len`` tokens, declared with ``meta`` tensors
        (:func:`mnemo.layers.state.spec`): its shapes and dtypes, nothing allocated. Defaults:
        ``batch_size=1``, ``seq_len=0`` (one sequence before any token); every mixer's override keeps
        them. ``dtype`` is the activation dtype (default: the mixer's parameters')."""
        raise NotImplementedError(f"{type(self).__name__} does not declare its state (state_spec)")

    def state_size_bytes(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> int:
        """Bytes of the state after ``seq_len`` tokens: :func:`~mnemo.layers.state.nbytes` of
        :meth:`state_spec` (derived from the declared shapes and dtypes; a bf16 cache counts 2
        bytes per value). Defaults: ``batch_size=1``, ``seq_len=0``."""
        return nbytes(self.state_spec(batch_size, seq_len, dtype))


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (bf16/fp16 -> fp32; fp32 and fp64 unchanged)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def buffer_dtype() -> torch.dtype:
    """The dtype of a fixed float buffer made at construction (rotary frequencies, RetNet's log
    decays, an MoE's balancing bias): float64 under ``torch.set_default_dtype(torch.float64)``, else
    float32 (never half precision), so that a model built float64 equals one cast with ``.double()``."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def off_meta():
    """A context for recomputing a fixed buffer in ``_apply``: the CPU as the default device while that
    is ``meta`` (a module materialised with ``to_empty`` inside its ``with torch.device("meta")``
    block: a constant made there has no values to copy), else nothing changed."""
    return torch.device("cpu") if torch.get_default_device().type == "meta" else contextlib.nullcontext()


def refill_meta_constants(module: nn.Module, incompatible_keys=None) -> None:
    """A ``load_state_dict`` post hook (every :class:`Mixer` registers it): after a build on the
    ``meta`` device and ``load_state_dict(sd, assign=True)`` (no ``to_empty``), the weights are
    real but the non-persistent constants (rotary frequencies, RetNet's decays, FAVOR+'s
    projection: never in a state dict) are still on meta. Each submodule holding such a buffer is
    materialised through its ``_apply`` (which recomputes them) on the device of the module's first
    real parameter or buffer, in float64 when that is float64 (as ``.double()``), else float32.
    Nothing happens while every tensor is on meta or none is, nor while a weight (a parameter or a
    persistent buffer) is still on meta (a ``strict=False`` load without it: the constants stay on
    meta, so that a forward fails rather than computing with the missing weight; a later load that
    brings it, e.g. the next shard, fills them)."""
    real = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    if not real:
        return
    for m in module.modules():
        weights = (
            *m.parameters(recurse=False),
            *(b for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set),
        )
        if any(t.is_meta for t in weights):
            return
    ref = next((t for t in real if t.is_floating_point()), real[0])
    dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32

    def fill(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=ref.device)

    for m in module.modules():
        if any(b.is_meta for b in m.buffers(recurse=False)):
            m._apply(fill, recurse=False)


def batch_mm(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``x [B, L, i] @ W [B, i, o]``; per-sample fast weights still shared over the batch (expanded
    with batch stride 0) take one ``[B·L, i] @ [i, o]`` product (no per-sample copies)."""
    return x @ W[0] if W.stride(0) == 0 and W.shape[0] else x @ W  # (a batch of 0: no W[0])


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (it moves with every in-place change), or ``None`` for an inference
    tensor (made under ``torch.inference_mode``), which has none."""
    return None if t.is_inference() else t._version


def autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for ``t``'s device type (``False`` for a device type autocast does not
    know, e.g. ``meta``, where ``torch.is_autocast_enabled`` raises)."""
    try:
        return torch.is_autocast_enabled(t.device.type)
    except RuntimeError:
        return False


def input_dtype(proj: nn.Module) -> torch.dtype | None:
    """The dtype a mixer's input must have for its input projection ``proj`` (the ``dtype`` of
    :func:`check_input`): ``proj.weight``'s when that is a floating tensor, else ``None`` (not
    checked: a quantised projection takes float input by its own rules, e.g. the ``Linear`` of
    ``torch.ao.quantization.quantize_dynamic``, whose ``weight`` is a method, or an integer weight).
    A parametrised ``weight`` (``torch.nn.utils.parametrize``) is not computed: its ``original``'s
    dtype is read (computing it ran, e.g., a second power iteration of ``spectral_norm`` per call)."""
    params = getattr(proj, "parametrizations", None)
    if params is not None and "weight" in params:
        w = getattr(params["weight"], "original", None)
    else:
        w = getattr(proj, "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else None


def check_input(
    x: torch.Tensor, d_model: int, name: str = "x", *, dtype: torch.dtype | None = None
) -> tuple[int, int]:
    """``(B, T)`` of a mixer's input ``x [B, T, d_model]``.

    ``dtype`` (default ``None``: not checked) is the dtype of the weights ``x`` meets first (a
    mixer's input projection): ``x`` must have it, or, under autocast on ``x``'s device type
    (``torch.autocast``), any floating dtype but float64 against weights that are not float64
    either (autocast casts float32 / bfloat16 / float16 to its own dtype, never float64). Any other
    pair would fail inside the first matmul with torch's unnamed "expected m1 and m2 to have the
    same dtype"; nothing is cast silently.

    Raises:
        ValueError: ``x`` is not a tensor of shape ``[B, T, d_model]``, or its dtype does not meet
            ``dtype`` (the message names ``name``, the expected and the received dtype).
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != d_model:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape [B, T, d_model] = [B, T, {d_model}], got {shape}")
    if dtype is not None:
        check_input_dtype(x, dtype, name)
    return x.shape[0], x.shape[1]


def check_input_dtype(
    x: torch.Tensor, dtype: torch.dtype, name: str = "x", owner: str = "the layer's weights"
) -> None:
    """The dtype rule of :func:`check_input` alone (any shape): ``x`` must have ``dtype`` (the dtype
    of the weights it meets first), or, under autocast on ``x``'s device type, any floating dtype
    but float64 against weights that are not float64 either. ``owner`` (default ``"the layer's
    weights"``) says in the message whose dtype ``dtype`` is.

    Raises:
        ValueError: naming ``name``, the expected and the received dtype.
    """
    if x.dtype == dtype:
        return
    wide = torch.float64 in (x.dtype, dtype)
    if not (x.is_floating_point() and not wide and autocast_on(x)):
        raise ValueError(
            f"{name}: expected dtype {dtype} (the dtype of {owner}"
            f"{'' if wide else ', or any floating dtype under torch.autocast'}), got {x.dtype}; "
            f"cast the input (x.to({dtype})) or the layer"
        )


def _float_leaves(value, path: str):
    """``(path, tensor)`` for every floating tensor in ``value`` (a state: dataclasses, tuples,
    lists and dicts of tensors), ``path`` as ``state.proj[0]`` / ``state.proj['k']``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _float_leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _float_leaves(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _float_leaves(v, f"{path}[{k!r}]")


def check_state_dtype(state, module: nn.Module, name: str = "state", fast_weights: bool = False) -> None:
    """Raise ``ValueError`` (naming the entry, the expected and the received dtype) for a floating
    tensor of ``state`` that is float64 where ``module``'s parameters are not, or not float64 where
    they are: the dtype ``module`` makes its own state in is its parameters' (with ``fast_weights``,
    default ``fast_weights=False``: memories / test-time-trained weights kept in the compute dtype,
    also float32 for bf16/fp16 parameters). ``name`` (default ``name="state"``) prefixes the
    entries' names. A state made by the module before a ``.double()`` (or after) would fail deep
    inside a matmul with torch's unnamed dtype error, or be computed in float64 and come back
    float64; nothing is cast silently. Other pairs (float32 / bf16 / fp16) pass: a bf16 autocast
    forward leaves bf16 activations in a float32 module's state, and a bf16 module keeps its
    memories in float32."""
    pd = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if pd is None:
        return
    want = [pd]
    if fast_weights and pd != torch.float64 and pd != torch.float32:
        want.append(torch.float32)
    for path, t in _float_leaves(state, name):
        # float64 on one side only: never meant (a bf16 autocast forward legitimately leaves bf16
        # activations, e.g. conv tails, in a float32 module's state, which its ops cast)
        if t.dtype not in want and torch.float64 in (t.dtype, pd):
            raise ValueError(
                f"{path}: expected dtype {' or '.join(map(str, want))} (the state "
                f"{type(module).__name__} makes for its {pd} parameters), got {t.dtype} (a state made "
                f"before the module was cast?); pass the state this module returned, or cast it "
                f"(mnemo.layers.state.to(state, {pd}))"
            )

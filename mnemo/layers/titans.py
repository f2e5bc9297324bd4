"""Test-time-trained memory mixers: the Titans long-term memory (LMM) for any ``MemorySpec``
(Behrouz et al. 2024, "Titans: Learning to Memorize at Test Time", §3); the three Titans
architectures MAC, MAG and MAL built around it (§4) are in :mod:`mnemo.layers.titans_architectures`.

Read/write semantics (identical in training, streaming and one-token decoding): the memory engine
(:mod:`mnemo.memory.engine`) writes token ``t`` with a gradient taken at its inner chunk's start
weights, and token ``t`` reads the weights *after* its own write. MAC additionally reads the memory
*before* each segment (the weights at the segment start, one segment = one inner chunk).

**Maps.** :meth:`NeuralMemory.mixing` attributes the read at ``t`` to each written value ``v_s`` by
gradient × input through the unrolled updates (:mod:`mnemo.memory.attribution`, where the choice
is argued): the exact mixing matrix for memories linear in their values (matrix memories with the
dot/l2 objective, decay and momentum: linear attention, GLA, the delta rules with their key
removal), an attribution — not a mixing matrix — for the nonlinear ones (MLP memories, Moneta,
Yaad, Memora). MAG and MAL report their long-term memory's map; MAC its memory's map when the
recording covers the whole stream (one segment).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..memory import MemorySpec, MemoryState, closed_form_op, init_state, neural_memory, preset
from ..memory.attribution import ValueAttribution, linear_in_values, value_attribution
from ..ops._common import check_mode
from ..ops._layout import rearrange
from .base import Mixer, Mixing, check_input, check_state_dtype, input_dtype, upcast
from .conv import ShortConvolution
from .hooks import HookPoint, enter_piece, leave_pieces, show_state
from .linear_attention import check_heads, check_int
from .norm import RMSNorm
from .registry import register_mixer
from .state import spec, state_dataclass


def _spec(spec: MemorySpec | str, overrides: dict) -> MemorySpec:
    if isinstance(spec, str):
        return preset(spec, **overrides)
    if not isinstance(spec, MemorySpec):  # (an int or a dict failed later with "no attribute 'validate'")
        raise TypeError(
            f"spec: expected a MemorySpec or a preset name (str), got {type(spec).__name__} {spec!r}"
        )
    return spec.replace(**overrides) if overrides else spec.validate()


def state_dtypes(module: nn.Module, dtype: torch.dtype | None = None) -> tuple[torch.dtype, torch.dtype]:
    """``(activation dtype, fast-weight dtype)`` of ``module``'s state: ``dtype`` (default: its
    parameters') for caches and conv tails, and the compute dtype of test-time-trained weights
    (float64 for float64 activations, else float32)."""
    if dtype is None:
        p = next(module.parameters(), None)
        dtype = p.dtype if p is not None else torch.get_default_dtype()
    return dtype, (torch.float64 if dtype == torch.float64 else torch.float32)


def check_state_type(state, cls: type, owner: str) -> None:
    """Refuse a ``state`` that is neither ``None`` nor a ``cls`` (e.g. the engine's
    :class:`~mnemo.memory.MemoryState`, or another mixer's state), naming the argument."""
    if state is not None and not isinstance(state, cls):
        raise ValueError(
            f"state: expected a {cls.__name__} (the state this {owner} returned) or None, got "
            f"{type(state).__name__}"
        )


def _conv_spec(conv: ShortConvolution | None, batch_size: int, dtype: torch.dtype):
    """A conv tail ``[B, C, W − 1]`` as a ``meta`` tensor (``None`` without a conv)."""
    return None if conv is None else spec((batch_size, conv.channels, conv.kernel_size - 1), dtype)


# ------------------------------------------------------------------------------------------------
# typed states
# ------------------------------------------------------------------------------------------------


@state_dataclass
class NeuralMemoryState:
    """The state of :class:`NeuralMemory`: the memory stream of the engine, its conv tail, the offset.

    Attributes:
        weights: the accumulators ``A`` of the memory's layers, each ``[B, H, in, out]`` (the fast
            weights are ``N(A)``; float32, float64 for a float64 model). A fresh state holds the
            learned initial weights expanded over the batch (no copies).
        momentum: the momentum buffers ``S`` (``optimizer="momentum"``, Titans' surprise), shaped
            like ``weights``, or ``None``.
        anchor: the accumulators at the start of the current inner chunk (gradients are taken at
            ``N(anchor)`` until the chunk ends), shaped like ``weights``.
        anchor_decay: log decay accumulated since the anchor (``[B, H]``, ``[B, H, K]`` per
            channel) for ``decay_first`` specs inside a chunk; ``None`` otherwise.
        position: tokens the memory has consumed (``offset`` plus the persistent prefix once the
            stream has started); chunk boundaries are absolute positions. Default ``0``.
        conv: the short-conv tail ``[B, 3 H D, W − 1]`` (activation dtype), or ``None``.
        offset: tokens of the stream consumed so far (default ``0``).
    """

    weights: tuple
    momentum: tuple | None = None
    anchor: tuple
    anchor_decay: torch.Tensor | None = None
    position: int = 0
    conv: torch.Tensor | None = None
    offset: int = 0

    def memory_state(self) -> MemoryState:
        """The engine's :class:`~mnemo.memory.MemoryState` (``weights … position``)."""
        return MemoryState(self.weights, self.momentum, self.anchor, self.anchor_decay, self.position)

    @classmethod
    def from_memory_state(cls, mem: MemoryState, conv=None, offset: int = 0) -> NeuralMemoryState:
        """The state that continues the engine's ``mem`` with the conv tail ``conv`` after
        ``offset`` stream tokens (default ``offset=0``)."""
        return cls(
            weights=mem.weights,
            momentum=mem.momentum,
            anchor=mem.anchor,
            anchor_decay=mem.anchor_decay,
            position=mem.position,
            conv=conv,
            offset=offset,
        )


def ttt_family(spec: MemorySpec) -> bool:
    """``True`` for TTT's layers (Sun et al. 2024): ``x + LN(f(x))`` (``residual`` and ``norm``)
    trained by plain mini-batch GD on the l2 loss, without retention (TTT-Linear, TTT-MLP)."""
    return (
        spec.residual
        and spec.norm
        and spec.objective == "l2"
        and spec.retention == "none"
        and spec.optimizer == "gd"
    )


def initial_weight_std(spec: MemorySpec, fan_in: int) -> float:
    """The std of the normal draw of a memory layer's learned initial weights (``0``: zeros).

    * a matrix memory with ``norm`` (TTT-Linear's ``x + LN(W x)``): ``0.02``, as TTT's reference
      ``W_0`` (at ``W = 0`` the norm's gain is ``1/√ε``: the first chunk's step would be ~300x the
      later ones); other matrix memories (the delta rules' state): ``0``;
    * an MLP memory of the TTT family (:func:`ttt_family`, TTT-MLP): ``0.02`` for every layer, as
      the TTT authors' code draws ``W1`` and ``W2`` (its biases ``b1``, ``b2`` start at zero; the
      memory here has no biases);
    * other MLP memories (Titans, Moneta, Yaad, Memora, whose papers give no initialisation):
      ``fan_in ** -0.5`` (fan-in scaling).
    """
    if spec.architecture == "matrix":
        return 0.02 if spec.norm else 0.0
    return 0.02 if ttt_family(spec) else fan_in**-0.5


def _fill_inner_norm(module, state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook of :class:`NeuralMemory` with ``inner_norm_affine``: a state dict
    saved before the option existed lacks ``γ, β``; they load as ``γ = 1``, ``β = 0``, exactly the
    parameter-free norm that state dict was trained with (the same outputs). Only a state dict that
    holds this memory (its initial weights): a partial one (``strict=False``) leaves ``γ, β`` as
    they are."""
    ref = state_dict.get(prefix + "init_weights.0")
    if ref is None:
        return
    for name, fill in (("inner_norm_weight", 1.0), ("inner_norm_bias", 0.0)):
        if prefix + name not in state_dict:
            p = getattr(module, name)
            # a meta build (loaded with assign=True, which keeps these tensors as they are): on the
            # state dict's device, in its dtype
            kw = {"dtype": ref.dtype, "device": ref.device} if p.is_meta else {}
            state_dict[prefix + name] = torch.full_like(p, fill, **kw)


# ------------------------------------------------------------------------------------------------
# the long-term memory
# ------------------------------------------------------------------------------------------------


@register_mixer("neural_memory")
class NeuralMemory(Mixer):
    """The long-term memory module (Titans §3.1 / LMM), for any point of the Miras design space.

        q, k, v = silu(conv(W x))           q, k ← q/‖q‖, k/‖k‖ per head
        θ_t = max_lr · sigmoid(W_θ x)       exp(g_t) = 1 − α_t = sigmoid(W_α x)
        η_t = sigmoid(W_η x)                δ_t = softplus(W_δ x)        (as the spec needs them)
        o_t = M_{W_t}(q_t)  (the memory engine)          y = W_o (RMSNorm(o) ⊙ silu(W_g x))

    ``persistent_tokens`` learned vectors (initialised ``N(0, 0.02²)``) are prepended to the stream
    once, at its start (Titans' persistent memory); their outputs are dropped. The memory's
    initial weights are learned parameters (one set per head); a matrix memory starts at zero (with
    ``norm``, TTT-Linear's ``x + LN(W x)``, at ``N(0, 0.02²)`` as the TTT authors' code initialises
    ``W_0``: at ``W = 0`` the layer norm's gain ``1/√ε`` makes the first chunk's step hundreds of
    times the later ones); each ``[in, out]`` layer of TTT-MLP (:func:`ttt_family`) at
    ``N(0, 0.02²)`` as the TTT authors' ``W1``, ``W2`` (the memory has no biases; theirs start at
    zero), of the other MLP memories at ``N(0, 1/in)`` (fan-in scaling; see
    :func:`initial_weight_std`).

    TTT (Sun et al. 2024; presets ``ttt_linear``, ``ttt_mlp``) follows the paper's mini-batch GD,
    ``W_t = W_0 − Σ_{s ≤ t} θ_s ∇ℓ_s(W_0)`` inside a mini-batch, with these named differences from
    the authors' layer (their code, ``ttt-lm-jax`` / ``ttt-lm-pytorch``):

    * learning rate: ``max_lr`` (default ``max_lr=1``) plays their ``η_base`` (1 for TTT-Linear,
      0.1 for TTT-MLP). Their code steps with ``LN(Z) − target``, the gradient of ``½‖e‖²`` as
      here (the paper writes ``‖e‖²``), but divides ``η`` by the head size ``D``, which this layer
      does not: for the same ``η_base`` and gate their step is this layer's divided by ``D``;
    * no ``1/t`` in a mini-batch: their code scales the accumulated step of a mini-batch's
      ``t``-th token by ``1/t`` (plus a learned offset per position, ``0`` at init), so its reads
      use the running *mean* of the steps and its end-of-mini-batch weights take the mean of the
      ``b`` tokens' steps (this layer's weights with ``θ / b``); here the steps are summed (the
      paper's equation);
    * the inner layer norm has ``eps = 1e-5`` (theirs ``eps = 1e-6``), and the memory has no
      biases (theirs ``b1``, ``b2``). Its learned per-head scale ``γ`` and shift ``β`` (their
      ``ttt_norm_weight``, ``ttt_norm_bias``; ``f(x) = x + γ ⊙ LN(f_res(x)) + β``, the inner loss
      taken through them) are matched by ``inner_norm_affine`` (on by default for the TTT family).

    Hook points (``T'`` = ``T`` plus the persistent prefix on the first call of a stream, whose
    rows come first: :func:`~mnemo.layers.hooks.span` places them before the call's token 0, so an
    intervention's positions are the call's tokens; each value as the memory engine receives it,
    so a replacement changes the write and the read):

    * ``hook_q``, ``hook_k`` ``[B, T', H, D]`` (after the conv and the L2 normalisation),
      ``hook_v`` ``[B, T', H, D]``;
    * ``hook_theta`` ``[B, T', H]``: the inner learning rate ``θ_t`` (float32, float64 in a float64
      model, as the gates below);
    * ``hook_g`` (specs with a retention): the log retention ``g_t = log(1 − α_t)`` (Titans'
      forget gate ``α_t``), ``[B, T', H]`` or ``[B, T', H, D]`` per channel;
    * ``hook_eta`` (optimizer ``"momentum"``): the momentum decay ``η_t`` ``[B, T', H]``;
    * ``hook_delta`` (objective ``"huber"``): the Huber threshold ``δ_t`` ``[B, T', H]``;
    * ``hook_o`` ``[B, T', H, D]``: the memory read-out ``M_{W_t}(q_t)``, before the norm, the
      output gate and the output projection;
    * ``hook_state``: the :class:`NeuralMemoryState` after the call.

    Args:
        d_model, n_heads, head_dim (default ``d_model // n_heads``; default ``n_heads=4``).
        spec: a :class:`~mnemo.memory.MemorySpec` or a preset name (``"titans"``, ``"moneta"``, …);
            ``spec_overrides`` replace fields (e.g. ``chunk_size=32``).
        short_conv / conv_size: causal depthwise conv + SiLU on q, k, v (defaults
            ``short_conv=True``, ``conv_size=4``).
        persistent_tokens: learned vectors prepended to the stream, see above (default ``0``).
        max_lr: upper bound of ``θ`` (default: the spec's ``max_lr`` or 1); given, it also replaces
            the spec's ``max_lr`` clamp when the spec has one.
        mode: ``"chunk"`` or ``"recurrent"`` (reference) for ``T > 1``.
        inner_norm_affine: give the memory's inner layer norm (``spec.norm``) a learned per-head
            scale ``γ`` and shift ``β`` (parameters ``inner_norm_weight``, ``inner_norm_bias``,
            stored flat ``[H · D]`` like other norm gains, init ``γ = 1``, ``β = 0``), as the TTT
            authors' layer; default ``inner_norm_affine=None``: on for the TTT family
            (:func:`ttt_family`: presets ``ttt_linear``, ``ttt_mlp``), off otherwise. A state
            dict without them (saved before the option existed) loads as ``γ = 1``, ``β = 0``:
            exactly the parameter-free norm it was trained with.

    State: :class:`NeuralMemoryState`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 4,
        head_dim: int | None = None,
        spec: MemorySpec | str = "titans",
        short_conv: bool = True,
        conv_size: int = 4,
        persistent_tokens: int = 0,
        max_lr: float | None = None,
        mode: str = "chunk",
        inner_norm_affine: bool | None = None,
        **spec_overrides,
    ):
        super().__init__(mode)
        check_mode(mode, ("chunk", "recurrent"))  # (else a typo surfaces only at the first T > 1 call)
        check_heads(d_model, n_heads, head_dim)
        check_int("persistent_tokens", persistent_tokens, 0)
        if not isinstance(short_conv, bool):  # a config's "False" is truthy and would build the conv
            raise ValueError(f"short_conv: expected a bool, got {short_conv!r}")
        if max_lr is not None and (
            isinstance(max_lr, bool) or not isinstance(max_lr, (int, float)) or not 0 < max_lr < math.inf
        ):  # θ = max_lr · sigmoid(·): a negative bound would ascend the inner loss
            raise ValueError(f"max_lr: expected None or a positive finite number, got {max_lr!r}")
        self.spec = _spec(spec, spec_overrides)
        if max_lr is not None and self.spec.max_lr is not None:  # the engine's clamp is the same bound
            self.spec = self.spec.replace(max_lr=max_lr)
        if inner_norm_affine is None:
            inner_norm_affine = ttt_family(self.spec)
        if not isinstance(inner_norm_affine, bool):  # a config's "False" is truthy
            raise ValueError(f"inner_norm_affine: expected None or a bool, got {inner_norm_affine!r}")
        if inner_norm_affine and not self.spec.norm:
            raise ValueError(
                "inner_norm_affine: expected False or None for a spec without an inner norm "
                f"(norm=False), got {inner_norm_affine!r}"
            )
        head_dim = head_dim or d_model // n_heads
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.max_lr = max_lr if max_lr is not None else (self.spec.max_lr or 1.0)
        width = 3 * n_heads * head_dim
        # one projection for q, k, v and the output gate; one for all per-head gates
        self.in_proj = nn.Linear(d_model, width + n_heads * head_dim, bias=False)
        self.conv = ShortConvolution(width, conv_size) if short_conv else None
        s = self.spec
        self.gate_sizes = {"theta": n_heads}
        if s.decays:
            self.gate_sizes["alpha"] = n_heads * (head_dim if s.decay_per_channel else 1)
        if s.optimizer == "momentum":
            self.gate_sizes["eta"] = n_heads
        if s.objective == "huber":
            self.gate_sizes["delta"] = n_heads
        self.gate_proj = nn.Linear(d_model, sum(self.gate_sizes.values()), bias=True)
        self.init_weights = nn.ParameterList(
            [nn.Parameter(torch.zeros(n_heads, i, o)) for i, o in s.layer_dims(head_dim, head_dim)]
        )
        self.persistent = nn.Parameter(torch.zeros(persistent_tokens, d_model)) if persistent_tokens else None
        # the inner norm's γ, β, flat [H·D] (1-D: kept out of weight decay and M3's orthogonalisation
        # as every norm gain)
        self.inner_norm_weight = nn.Parameter(torch.ones(n_heads * head_dim)) if inner_norm_affine else None
        self.inner_norm_bias = nn.Parameter(torch.zeros(n_heads * head_dim)) if inner_norm_affine else None
        if inner_norm_affine:
            self._register_load_state_dict_pre_hook(_fill_inner_norm, with_module=True)
        self.norm = RMSNorm(head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_theta = HookPoint()
        # the gates this spec has (a hook point only where the value exists)
        self.hook_g = HookPoint() if "alpha" in self.gate_sizes else None
        self.hook_eta = HookPoint() if "eta" in self.gate_sizes else None
        self.hook_delta = HookPoint() if "delta" in self.gate_sizes else None
        self.hook_o, self.hook_state = HookPoint(), HookPoint()
        self._init_special()

    #: gate bias at init: θ ≈ 0.1 · max_lr, 1 − α ≈ 0.993 (slow forgetting), η ≈ 0.73, δ ≈ 0.97
    _GATE_BIAS = {"theta": math.log(0.1 / 0.9), "alpha": 5.0, "eta": 1.0, "delta": 0.5}

    def _init_special(self) -> None:
        with torch.no_grad():
            for bias, name in zip(self.gate_proj.bias.split(list(self.gate_sizes.values())), self.gate_sizes):
                bias.fill_(self._GATE_BIAS[name])
            if self.persistent is not None:
                nn.init.normal_(self.persistent, std=0.02)
            if self.inner_norm_weight is not None:
                self.inner_norm_weight.fill_(1.0)
                self.inner_norm_bias.zero_()
            for w in self.init_weights:
                std = initial_weight_std(self.spec, w.shape[-2])
                if std == 0:
                    w.zero_()
                else:
                    nn.init.normal_(w, std=std)

    def _gates(self, x):
        """``θ, g, η, δ`` for input ``x [B, T, d_model]`` (``None`` where the spec needs none)."""
        s, H = self.spec, self.n_heads
        raw = dict(zip(self.gate_sizes, upcast(self.gate_proj(x)).split(list(self.gate_sizes.values()), -1)))
        theta = self.max_lr * torch.sigmoid(raw["theta"])
        g = eta = delta = None
        if s.decays:
            g = F.logsigmoid(raw["alpha"])
            if s.decay_per_channel:
                g = rearrange(g, "b t (h k) -> b t h k", h=H)
        if "eta" in raw:
            eta = torch.sigmoid(raw["eta"])
        if "delta" in raw:
            delta = F.softplus(raw["delta"])
        return theta, g, eta, delta

    def qkv(self, x, conv_state):
        """``(q, k, v, out_gate, conv_state)`` for ``x [B, T, d_model]``; q and k L2-normalised."""
        qkv, gate = self.in_proj(x).split(
            [3 * self.n_heads * self.head_dim, self.n_heads * self.head_dim], -1
        )
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, conv_state)
        else:
            qkv = F.silu(qkv)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b t h d", three=3, h=self.n_heads)
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, gate, conv_state

    def inner_norm_affine(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The inner norm's ``(γ, β)`` as ``[H, D]`` (``(None, None)``: the parameter-free norm)."""
        if self.inner_norm_weight is None:
            return None, None
        H, D = self.n_heads, self.head_dim
        return self.inner_norm_weight.view(H, D), self.inner_norm_bias.view(H, D)

    def initial_state(self, batch_size: int) -> NeuralMemoryState:
        """A fresh stream: the learned initial weights (expanded over the batch), no conv tail."""
        mem = init_state(self.spec, [w for w in self.init_weights], batch_size)
        return NeuralMemoryState.from_memory_state(mem)

    def read_out(self, o, gate):
        """``W_o (RMSNorm(o) ⊙ silu(gate))`` for memory reads ``o [B, T, H, D]``."""
        o = self.norm(o, rearrange(gate, "b t (h d) -> b t h d", h=self.n_heads))  # fused gated norm
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))

    def forward(self, x: torch.Tensor, state: NeuralMemoryState | None = None, *, mode: str | None = None):
        B, T = check_input(x, self.d_model, dtype=input_dtype(self.in_proj))
        check_state_type(state, NeuralMemoryState, "NeuralMemory")
        if state is not None:  # (a float64 state into a float32 memory was cast silently)
            check_state_dtype(state, self, fast_weights=True)
        offset = state.offset if state is not None else 0
        n_prefix = 0
        if self.persistent is not None and offset == 0 and T > 0:  # written once, with the first token
            n_prefix = self.persistent.shape[0]
            x = torch.cat([self.persistent.to(x.dtype).expand(B, -1, -1), x], dim=1)
        q, k, v, gate, conv_state = self.qkv(x, state.conv if state is not None else None)
        theta, g, eta, delta = self._gates(x)
        # with the prefix, the hooks' rows are the prefix and then the call's tokens 0 … T − 1
        piece = enter_piece(-n_prefix, T + n_prefix, T)
        try:
            q, k, v, theta = self.hook_q(q), self.hook_k(k), self.hook_v(v), self.hook_theta(theta)
            if g is not None:
                g = self.hook_g(g)
            if eta is not None:
                eta = self.hook_eta(eta)
            if delta is not None:
                delta = self.hook_delta(delta)
            mem = (state if state is not None else self.initial_state(B)).memory_state()
            norm_weight, norm_bias = self.inner_norm_affine()
            o, mem = neural_memory(
                self.spec,
                q,
                k,
                v,
                theta,
                g=g,
                eta=eta,
                delta=delta,
                initial_state=mem,
                output_final_state=True,
                mode=self._mode(x.shape[1], mode),
                norm_weight=norm_weight,
                norm_bias=norm_bias,
            )
            o = self.hook_o(o)
        finally:
            leave_pieces(piece)
        y = self.read_out(o, gate)[:, n_prefix:]
        new = NeuralMemoryState.from_memory_state(mem, conv=conv_state, offset=offset + T)
        return y, show_state(self.hook_state, new)  # a copy shown: the anchor may be a parameter

    # --------------------------------------------------------------------------------------------
    # maps (the per-token attribution of the read to the writes)
    # --------------------------------------------------------------------------------------------

    #: integration steps of the attribution of a nonlinear memory (``1``: plain gradient × input
    #: at the recorded values; ``n``: integrated gradients from the zero-value baseline, whose
    #: contributions add up to the writes' part of the read as ``n`` grows). Ignored by memories
    #: linear in their values (their map is exact).
    attribution_steps: int = 4
    #: quadrature rule of those steps: ``"midpoint"`` (the default; ``α_i = (i − ½)/n``, ``i = 1 … n``, equal
    #: weights) or ``"gauss_legendre"`` (exact for reads polynomial in the values of degree ``≤ 2n``,
    #: far smaller errors for most smooth reads but not better at every ``n`` on the nonlinear
    #: presets: :mod:`mnemo.memory.attribution` gives the measurement). ``steps = 1`` is gradient ×
    #: input under either rule.
    attribution_rule: str = "midpoint"

    @property
    def mixing_hooks(self) -> tuple[str, ...]:  # type: ignore[override]
        names = ["hook_q", "hook_k", "hook_v", "hook_theta"]
        names += [n for n in ("hook_g", "hook_eta", "hook_delta") if getattr(self, n) is not None]
        return tuple(names)

    @property
    def mixing_exact(self) -> bool:
        """``True`` when :meth:`mixing` is an exact mixing matrix (``maps @ values == output``):
        the memory is linear in its values (:func:`~mnemo.memory.attribution.linear_in_values`)."""
        return linear_in_values(self.spec)

    def attribution(
        self, acts: dict, steps: int | None = None, method: str = "auto", *, rule: str | None = None
    ) -> ValueAttribution:
        """The read at ``t`` attributed to each written value ``v_s``, from the hook values ``acts``
        of one fresh-stream call (:class:`~mnemo.memory.attribution.ValueAttribution`: the map,
        the per-token contribution vectors for nonlinear memories, the baseline). The persistent
        prefix belongs to the memory's starting point (written, not attributed): the result covers
        the stream's own ``T`` tokens. ``steps`` defaults to :attr:`attribution_steps`, ``rule``
        (keyword-only; :func:`~mnemo.memory.attribution.attribute_read`) to
        :attr:`attribution_rule` (``"midpoint"``)."""
        # (a 0-token call writes no prefix: it is written with the first token, see forward)
        written = acts["hook_q"].shape[1] > 0
        n_prefix = self.persistent.shape[0] if self.persistent is not None and written else 0
        norm_weight, norm_bias = self.inner_norm_affine()
        return value_attribution(
            self.spec,
            acts["hook_q"],
            acts["hook_k"],
            acts["hook_v"],
            acts["hook_theta"],
            g=acts.get("hook_g"),
            eta=acts.get("hook_eta"),
            delta=acts.get("hook_delta"),
            initial_weights=list(self.init_weights),
            start=n_prefix,
            steps=self.attribution_steps if steps is None else steps,
            rule=self.attribution_rule if rule is None else rule,
            method=method,
            mode=self.mode,
            norm_weight=norm_weight,
            norm_bias=norm_bias,
        )

    def mixing(self, acts: dict) -> Mixing:
        """The memory's map ``[B, H, T, T]`` over the stream's tokens (the persistent prefix is
        part of the starting state). ``output`` is the writes' part of the read: the read
        ``M_{W_t}(q_t)`` minus the read of the memory written with zero values (the learned initial
        weights, decayed, and the prefix's writes).

        * Memories linear in their values (:attr:`mixing_exact`): the exact mixing matrix,
          ``maps @ values == output`` (equal to :func:`~mnemo.ops.delta_rule_map` /
          :func:`~mnemo.ops.gated_linear_attention_map` where those apply; momentum and mini-batch
          variants included).
        * Nonlinear memories (MLP memories, ℓp/Huber objectives, ℓq/KL/elastic-net retention): an
          *attribution*, not a mixing matrix — ``maps[t, s] = ⟨c_ts, v_s⟩ / ‖v_s‖²`` with
          ``c_ts`` the integrated-gradient contribution of ``v_s`` to the read at ``t`` (see
          :mod:`mnemo.memory.attribution`). ``Σ_s c_ts ≈ output`` (complete as
          :attr:`attribution_steps` grows); ``maps @ values`` keeps only each contribution's
          component along its own value and does *not* reproduce ``output``
          (:meth:`attribution` returns both errors)."""
        a = self.attribution(acts)
        return Mixing(a.maps, a.values, a.output)

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> NeuralMemoryState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: the activations',
        default the parameters'): the accumulators, their chunk-start copy and (momentum) the
        momentum buffers in the fast-weight dtype, and the conv tail; independent of ``seq_len``
        except for ``anchor_decay`` (``decay_first`` specs inside a chunk, as the chunk form leaves
        it). Defaults: ``batch_size=1``, ``seq_len=0``."""
        act, cd = state_dtypes(self, dtype)
        B, H, s = batch_size, self.n_heads, self.spec
        dims = s.layer_dims(self.head_dim, self.head_dim)

        def layers():
            return tuple(spec((B, H, i, o), cd) for i, o in dims)

        prefix = self.persistent.shape[0] if self.persistent is not None and seq_len > 0 else 0
        position = seq_len + prefix
        anchor_decay = None
        if s.decays and s.decay_first and closed_form_op(s) is None and position % s.chunk_size:
            anchor_decay = spec((B, H, self.head_dim) if s.decay_per_channel else (B, H), cd)
        return NeuralMemoryState(
            weights=layers(),
            momentum=layers() if s.optimizer == "momentum" else None,
            anchor=layers(),
            anchor_decay=anchor_decay,
            position=position,
            conv=_conv_spec(self.conv, B, act),
            offset=seq_len,
        )

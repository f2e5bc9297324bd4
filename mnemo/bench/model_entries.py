"""The rows of ``mnemo bench --suite models`` (:mod:`mnemo.bench.models`): the shared model size,
one :class:`Entry` per model (how to train and generate with it), mnemo's rows and their compiled
twins.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

VOCAB = 256

#: defaults of the suite (the CLI's ``--model-shapes`` etc.); the issue's shared size
DEFAULT_SHAPES = "1024x8,4096x2"
DEFAULT_D_MODEL = 256
DEFAULT_N_LAYERS = 6
DEFAULT_GEN_BATCHES = "1,8"


@dataclass(frozen=True)
class Size:
    """The shared model size: residual width ``d_model``, ``n_layers`` blocks, ``vocab`` tokens."""

    d_model: int
    n_layers: int
    vocab: int = VOCAB


@dataclass
class Entry:
    """One row: a model and how to train and generate with it.

    Attributes:
        name: the row label (a family name for mnemo rows).
        library: ``"mnemo"`` or the peer's distribution name.
        model: the module (its parameters are what the AdamW step updates).
        logits: ``ids [B, T] (long) -> logits [B, T, vocab]`` with autograd (the training forward).
        generate: ``(prompt [b, P] long, n) -> anything``: greedy generation of ``n`` new tokens with
            the library's own API, or ``None`` where the library has none.
        aux: ``() -> 0-d tensor or None``: an auxiliary loss of the last forward (MoE balance).
        vs: the row a peer is compared with (a mnemo row; a compiled row: its eager row).
        note: what is special about the row (printed under the tables).
    """

    name: str
    library: str
    model: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]
    generate: Callable[[torch.Tensor, int], object] | None
    aux: Callable[[], torch.Tensor | None] | None = None
    vs: str | None = None
    note: str = ""
    compiled: bool = False
    graph_breaks: int | None = None
    opt: torch.optim.Optimizer | None = field(default=None, repr=False)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


# ------------------------------------------------------------------------------------------------
# mnemo rows
# ------------------------------------------------------------------------------------------------


def mnemo_entry(name: str, model=None, size: Size | None = None, note: str = "") -> Entry:
    """The row of the registered family ``name`` at ``size`` (or of the given ``LanguageModel``)."""
    from ..models import LanguageModel, build_config

    if model is None:
        torch.manual_seed(0)
        model = LanguageModel(
            build_config(name, vocab_size=size.vocab, d_model=size.d_model, n_layers=size.n_layers)
        )

    def generate(prompt, n):
        return model.generate(prompt, n, temperature=0.0)

    return Entry(name, "mnemo", model, lambda x: model(x)[0], generate, aux=model.aux_loss, note=note)


def compiled_entry(eager: Entry) -> Entry:
    """``eager``'s model (a copy) under ``torch.compile``: the training forward compiled, and
    generation through ``generate(temperature=0, compile=True)`` (compiled prefill and
    one-token step)."""
    model = copy.deepcopy(eager.model)
    fwd = torch.compile(model)

    def generate(prompt, n):
        with warnings.catch_warnings():  # a failed compile fails the row, never times eager decoding
            warnings.filterwarnings("error", message=r"generate\(compile=True\)")
            return model.generate(prompt, n, temperature=0.0, compile=True)

    return Entry(
        f"{eager.name} [compiled]",
        "mnemo",
        model,
        lambda x: fwd(x)[0],
        generate,
        aux=model.aux_loss,
        vs=eager.name,
        compiled=True,
    )


def compile_available() -> tuple[bool, str]:
    """``(True, "")`` when ``torch.compile`` (default backend) compiles and runs a small function
    here, else ``(False, why)`` (e.g. no C compiler for the CPU inductor backend)."""
    try:
        fn = torch.compile(lambda x: torch.sin(x) * 2 + 1)
        x = torch.randn(8)
        if not torch.allclose(fn(x), torch.sin(x) * 2 + 1):
            return False, "a compiled test function gave a different result"
        return True, ""
    except Exception as e:  # any failure of the compiler stack means: run eager
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

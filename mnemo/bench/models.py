"""``mnemo bench --suite models``: whole language models training and generating, beside peers.

A benchmark, not a test: it prints tables (and optionally JSON) and asserts nothing. Every
registered model family is built at one shared size (``--d-model``, ``--n-layers``, byte vocabulary
of 256) with random weights, and timed doing what a user does with it:

* **training**: one step = forward, next-token cross-entropy (plus the MoE auxiliary loss where the
  model has one), backward and an AdamW step, on ``[B, T]`` random tokens for each ``T x B`` of
  ``--model-shapes``; tokens/s = ``B · T / (median step seconds)``.
* **generation** (batch 1 and 8 by default: ``--gen-batches``): the library's own greedy
  ``generate()`` on a random ``[b, --prompt-len]`` prompt, timed once for one new token (the time to
  first token: prefill plus one step) and once for ``--gen-tokens`` new tokens. Generation tokens/s
  = ``b · N / (generate seconds)``; decode tokens/s = ``b · (N − 1) / (generate − first-token
  seconds)`` (the one-token steps alone).

Each installed peer builds the equivalent model with the same dimensions and random weights (no
download): ``transformers`` ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` with the weights of mnemo's
``mamba`` / ``mamba2`` model (exported), ``Qwen3NextForCausalLM`` with dense MLPs beside the mnemo
model imported from it (``qwen3_next_equiv``: the same layers and weights), mambapy's ``LM``,
titans-pytorch's ``MemoryAsContextTransformer`` (beside ``titans_mac``; not the same algorithm, see
its row's note), mnemo's ``titans_lmm`` with titans-pytorch's ``NeuralMemory`` as every mixer
(beside ``titans_lmm``: the same algorithm) and nested-learning's
``HOPEModel`` (``hope_selfmod`` blocks, beside ``hope``). A peer that is not installed (or does not
run here) is reported and skipped; the peers are imported only here, never by the library.
``ratio`` columns are ``peer time / mnemo time`` for the row the peer is paired with, from the same
run (above 1: mnemo is faster).

Timing follows :func:`mnemo.bench.ops._time` (warm-up, then the median of ``--repeats`` runs), with
the repeats **interleaved**: round ``r`` times every row once (the order rotated each round), so a
drift of the machine's speed hits all rows alike rather than whichever row ran during it.

``--compile`` adds, for every mnemo family, a row with the model under ``torch.compile`` (default
mode): the training forward/backward, the prefill and the one-token decode step compiled (the
optimizer step stays eager), with the number of graph breaks dynamo reported while compiling. Where
compilation is unavailable (no C compiler for the CPU inductor backend, ...) the suite says so and
runs eager only.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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


# ------------------------------------------------------------------------------------------------
# peers: each builder gets the shared size and a function returning a mnemo row by name (built on
# demand), and returns the peer's rows (a peer may add the mnemo row it is compared with)
# ------------------------------------------------------------------------------------------------


def _hf_generate(model):
    @torch.no_grad()
    def generate(prompt, n):
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    return generate


def _hf_from_mnemo(mnemo_model, export, config_cls, model_cls):
    cfg, sd = export(mnemo_model.config, mnemo_model.state_dict())
    cfg = {k: v for k, v in cfg.items() if k != "model_type"}
    model = model_cls(config_cls(**cfg))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"exported weights do not fit: missing {missing}, unexpected {unexpected}")
    if cfg.get("tie_word_embeddings", False):
        model.tie_weights()
    return model


def _peer_transformers_ssm(row: str, hf_name: str, note: str, mnemo_row: Callable[[str], Entry]) -> Entry:
    """``transformers`` ``{hf_name}ForCausalLM`` with the weights of mnemo's ``row`` (exported by
    :mod:`mnemo.hf.convert`)."""
    import transformers

    from ..hf import convert

    ours = mnemo_row(row)
    config_cls = getattr(transformers, f"{hf_name}Config")
    model_cls = getattr(transformers, f"{hf_name}ForCausalLM")
    m = _hf_from_mnemo(ours.model, getattr(convert, f"export_{row}"), config_cls, model_cls)
    return Entry(
        f"{hf_name}ForCausalLM",
        "transformers",
        m,
        lambda x: m(input_ids=x, use_cache=False).logits,
        _hf_generate(m),
        vs=row,
        note=note,
    )


def peer_transformers_mamba(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """``transformers`` ``MambaForCausalLM`` with the weights of mnemo's ``mamba`` row."""
    note = "transformers' CPU path (no mamba-ssm kernels), the weights of the mamba row"
    return [_peer_transformers_ssm("mamba", "Mamba", note, mnemo_row)]


def peer_transformers_mamba2(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """``transformers`` ``Mamba2ForCausalLM`` with the weights of mnemo's ``mamba2`` row."""
    note = "transformers' CPU path (its torch_forward), the weights of the mamba2 row"
    return [_peer_transformers_ssm("mamba2", "Mamba2", note, mnemo_row)]


def qwen3_next_config(size: Size, n_heads: int = 4):
    """A ``Qwen3NextConfig`` at ``size``: dense SwiGLU MLPs (``num_experts = 0``), Gated DeltaNet
    layers with softmax attention every 4th layer (``gated_deltanet_hybrid``'s pattern; the last
    layer when there are fewer than 4), ``n_heads`` heads of ``d_model / n_heads`` for both, full
    rotary, tied embeddings."""
    from transformers import Qwen3NextConfig

    from ..layers.mlp import swiglu_hidden

    d = size.d_model
    if d % n_heads:
        raise ValueError(f"d_model: expected a multiple of n_heads = {n_heads}, got {d}")
    hd = d // n_heads
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    types = [kinds[i % 4] for i in range(size.n_layers)]
    if "full_attention" not in types:  # transformers' Qwen3-Next cache needs one attention layer
        types[-1] = "full_attention"
    return Qwen3NextConfig(
        vocab_size=size.vocab,
        hidden_size=d,
        intermediate_size=swiglu_hidden(d),
        num_hidden_layers=size.n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        head_dim=hd,
        linear_num_key_heads=n_heads,
        linear_num_value_heads=n_heads,
        linear_key_head_dim=hd,
        linear_value_head_dim=hd,
        linear_conv_kernel_dim=4,
        num_experts=0,
        layer_types=types,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        tie_word_embeddings=True,
    )


def peer_transformers_qwen3_next(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """``transformers`` ``Qwen3NextForCausalLM`` (dense MLPs) and the mnemo model imported from it
    (``qwen3_next_equiv``: the same layers, options and weights)."""
    from transformers import Qwen3NextForCausalLM

    from ..hf.qwen3_next import import_qwen3_next, transformers_reference_kernels_off_gpu

    transformers_reference_kernels_off_gpu()  # fla-core installed, no GPU: transformers' own forms
    from ..models import LanguageModel

    torch.manual_seed(0)
    m = Qwen3NextForCausalLM(qwen3_next_config(size))
    config, sd = import_qwen3_next(m.config.to_dict(), m.state_dict())
    ours = LanguageModel(config)
    ours.load_state_dict(sd, strict=True)
    return [
        mnemo_entry(
            "qwen3_next_equiv",
            model=ours,
            note="mnemo's import of the Qwen3NextForCausalLM row: same layers and weights",
        ),
        Entry(
            "Qwen3NextForCausalLM",
            "transformers",
            m,
            lambda x: m(input_ids=x, use_cache=False).logits,
            _hf_generate(m),
            vs="qwen3_next_equiv",
            note="dense MLPs, transformers' CPU path (torch chunked gated delta rule)",
        ),
    ]


class _MambapyLM(nn.Module):
    """Embedding → ``mambapy.mamba.Mamba`` (its residual blocks) → RMSNorm → head, the layout of
    mambapy's ``LM`` (whose module imports its Mamba-2, which needs ``mamba_ssm``'s Triton kernels)."""

    def __init__(self, config, vocab: int):
        from mambapy.mamba import Mamba, RMSNorm

        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(vocab, config.d_model)
        self.mamba = Mamba(config)
        self.norm_f = RMSNorm(config.d_model, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.d_model, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight  # tied, as mnemo's (mambapy's LM unties them)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` -> logits ``[B, T, vocab]`` (mambapy's parallel scan)."""
        return self.lm_head(self.norm_f(self.mamba(self.embedding(ids))))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        """Greedy, with mambapy's one-token ``Mamba.step`` and its caches ``(h, conv inputs)``: the
        prompt goes in one token at a time (mambapy has no prefill that returns a cache)."""
        c = self.config
        z = torch.zeros(prompt.shape[0], c.d_inner, c.d_conv - 1, device=prompt.device)
        caches = [(None, z.clone()) for _ in range(c.n_layers)]
        out = [prompt]
        for i in range(prompt.shape[1] + n - 1):
            tok = prompt[:, i] if i < prompt.shape[1] else out[-1][:, 0]
            x, caches = self.mamba.step(self.embedding(tok), caches)
            if i + 1 >= prompt.shape[1]:
                out.append(self.lm_head(self.norm_f(x)).argmax(-1, keepdim=True))
        return torch.cat(out, 1)


def peer_mambapy(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """mambapy's Mamba (``mambapy.mamba.Mamba``, parallel scan in training) in an LM beside mnemo's
    ``mamba`` row (same ``d_state = 16``, expand 2, conv 4, ``dt_rank = ⌈d_model / 16⌉``)."""
    from mambapy.mamba import MambaConfig

    mnemo_row("mamba")
    torch.manual_seed(0)
    m = _MambapyLM(MambaConfig(d_model=size.d_model, n_layers=size.n_layers, pscan=True), size.vocab)
    return [
        Entry(
            "mambapy Mamba",
            "mambapy",
            m,
            m,
            m.generate,
            vs="mamba",
            note="mambapy's step(): the prompt goes in one token at a time (it has no cached prefill)",
        )
    ]


def _own_memory(m: nn.Module) -> None:
    """titans-pytorch makes some parameters broadcast views (stride 0): AdamW's in-place update
    refuses those, so each gets memory of its own."""
    with torch.no_grad():
        for p in m.parameters():
            if any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape)):
                p.data = p.data.clone()


def peer_titans_pytorch(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """titans-pytorch's ``MemoryAsContextTransformer`` beside mnemo's ``titans_mac`` row: 64-token
    segments, 4 persistent tokens, 4 heads, a 2-layer MLP memory per head updated per segment,
    in every layer; no long-term memory tokens and one residual stream (mnemo has neither)."""
    from titans_pytorch import MemoryAsContextTransformer, MemoryMLP

    mnemo_row("titans_mac")
    d, heads = size.d_model, 4
    torch.manual_seed(0)
    m = MemoryAsContextTransformer(
        num_tokens=size.vocab,
        dim=d,
        depth=size.n_layers,
        segment_len=64,
        num_persist_mem_tokens=4,
        num_longterm_mem_tokens=0,
        neural_memory_batch_size=64,
        heads=heads,
        dim_head=d // heads,
        ff_mult=4,
        num_residual_streams=1,
        neural_memory_model=MemoryMLP(d // heads, depth=2, expansion_factor=4.0),
        neural_memory_kwargs=dict(heads=heads, dim_head=d // heads),
    )

    _own_memory(m)

    @torch.no_grad()
    def generate(prompt, n):
        return m.sample(prompt, prompt.shape[1] + n, temperature=0.0, show_progress=False, use_cache=True)

    return [
        Entry(
            "MemoryAsContextTransformer",
            "titans-pytorch",
            m,
            m,
            generate,
            vs="titans_mac",
            note="not the same algorithm: it stores and retrieves its memory over the whole sequence in "
            "one parallel pass from the layer input, where Titans' MAC (section 4.1) and mnemo read each "
            "segment with the memory written from the previous segment's attention output, a loop over "
            "T / 64 segments; the like-for-like row is NeuralMemory LM vs titans_lmm",
        )
    ]


class _PeerMemoryMixer(nn.Module):
    """A peer's memory layer in a mnemo block's mixer slot: ``(x, state, mode) -> (y, None)``
    (training only: no state is kept)."""

    def __init__(self, memory: nn.Module):
        super().__init__()
        self.memory = memory

    def forward(self, x, state=None, mode=None):
        return self.memory(x)[0], None


def peer_titans_pytorch_lmm(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """mnemo's ``titans_lmm`` model with every mixer swapped for titans-pytorch's ``NeuralMemory``
    (2-layer MLP memory per head, expansion 4, ``chunk_size = batch_size = 64``: the pairing of
    the peers suite's Titans LMM row), the embedding, norms, MLPs and head mnemo's own: the ratio
    isolates the memory layer. Unlike the MAC pair, both sides run the same algorithm (store and
    retrieve over the whole sequence, chunk-anchored gradients). mnemo's layer also has 4
    persistent tokens. Training only (no generation through the peer's state here)."""
    from titans_pytorch import MemoryMLP
    from titans_pytorch import NeuralMemory as PeerMemory

    ours = mnemo_row("titans_lmm")
    d, heads = size.d_model, 4
    torch.manual_seed(0)
    m = copy.deepcopy(ours.model)
    for block in m.blocks:
        block.mixer = _PeerMemoryMixer(
            PeerMemory(
                d,
                chunk_size=64,
                batch_size=64,
                heads=heads,
                dim_head=d // heads,
                model=MemoryMLP(d // heads, depth=2, expansion_factor=4.0),
            )
        )
    _own_memory(m)
    return [
        Entry(
            "NeuralMemory LM",
            "titans-pytorch",
            m,
            lambda x: m(x)[0],
            None,
            vs="titans_lmm",
            note="mnemo's titans_lmm with titans-pytorch's NeuralMemory as every mixer (same algorithm)",
        )
    ]


def peer_nested_learning(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """nested-learning's ``HOPEModel`` with ``hope_selfmod`` blocks (self-modifying Titans + CMS of
    periods 8/16/32; chunks 16 for the memory and 64 for the projections) beside mnemo's ``hope``.
    Training uses its plain ``forward`` (its outer-loss path), which reads the self-modifying memory
    and the CMS without updating them (the updates need a fast state and a teach signal): a static
    read, cheaper than mnemo's ``hope``, whose memories learn in the forward. It has no ``generate()``."""
    from nested_learning.levels import LevelSpec
    from nested_learning.model import HOPEModel
    from nested_learning.model import ModelConfig as NLConfig

    mnemo_row("hope")
    torch.manual_seed(0)
    m = HOPEModel(
        NLConfig(
            vocab_size=size.vocab,
            dim=size.d_model,
            num_layers=size.n_layers,
            heads=4,
            titan_level=LevelSpec("titan", 16),
            cms_levels=[LevelSpec("cms_fast", 8), LevelSpec("cms_mid", 16), LevelSpec("cms_slow", 32)],
            block_variant="hope_selfmod",
            self_mod_chunk_size=64,
            self_mod_chunk_size_memory=16,
        )
    )
    return [
        Entry(
            "HOPEModel",
            "nested-learning",
            m,
            m,
            None,
            vs="hope",
            note="no generate(); its plain forward (no fast state, no teach signal) reads the memories "
            "without updating them: NOT the computation of mnemo's hope (test-time updates), so the ratio "
            "does not compare like with like",
        )
    ]


def peer_nested_learning_updates(size: Size, mnemo_row: Callable[[str], Entry]) -> list[Entry]:
    """The :func:`peer_nested_learning` model (same config, seed and weights) trained the way
    nested-learning trains with test-time memory updates: its ``run_training_loop`` with the
    paper-faithful settings (``configs/pilot_paper_faithful.yaml`` + ``hope/pilot_selfmod.yaml``):
    ``algorithm_mode=two_pass_stopgrad_updates``, ``online_updates``, ``use_fast_state``,
    ``per_layer_teach_signal``, ``online_boundary_targets``, ``online_chunk_size=0`` (the smallest CMS
    period: 8 tokens).

    Per step: a fresh fast state (``HOPEModel.init_fast_state()``); then for each non-overlapping
    8-token chunk (``_iter_online_boundary_chunks``), in order:

    1. read pass, with autograd: ``forward_with_block_outputs(chunk, fast_state=...)``, every block
       reading its self-modifying Titans memory and CMS through the fast state left by the earlier
       chunks (meta weights + stop-gradient deltas);
    2. the chunk's mean next-token cross-entropy (the last position targets the next chunk's first
       token) and the per-layer teach signals ``_compute_layer_teach_signals`` (its gradient with
       respect to every block's output, detached);
    3. update pass, under ``no_grad``: ``model(chunk, teach_signals=..., fast_state=...,
       finalize_updates=<last chunk>)``, which writes the fast state: in every block the
       self-modifying Titans (``forward_with_updates``: M_k, M_v, M_eta, M_alpha and M_memory, a
       per-token DGD recursion with gradients at the chunk-start weights; the configured chunks 64
       / 16 end at the 8-token call's end, so both groups update once per 8 tokens, per sequence)
       and the CMS levels (one deep-momentum step of the level's MLP delta on the teach signal per
       8 / 16 / 32 tokens, the delta shared over the batch).

    The callable returns the read passes' logits, concatenated (with their graph). Their loop
    calls ``loss.backward()`` per chunk on the chunk's mean loss; here the bench's one backward of
    the mean over all positions runs the same backward graphs, with the gradient scaled by about
    ``8 / T`` (AdamW is insensitive to the scale). Their gradient clipping (max norm 1) and bf16
    autocast are left out, as for every row. It has no ``generate()``."""
    # ``nested_learning.training`` (the loop) imports omegaconf etc. at import time; its three
    # helpers used here are a few lines each and are restated, not imported
    m = peer_nested_learning(size, mnemo_row)[0].model
    # their ``online_chunk_size: 0``: the smallest CMS period (``_infer_online_chunk_size``)
    chunk = min(int(spec.update_period) for spec in m.config.cms_levels)

    def logits(ids):
        fast_state = m.init_fast_state()
        T = ids.shape[1]
        out = []
        for start in range(0, T, chunk):  # ``_iter_online_boundary_chunks``
            end = min(start + chunk, T)
            tokens = ids[:, start:end]
            lg, _pre, block_outputs = m.forward_with_block_outputs(tokens, fast_state=fast_state)
            out.append(lg)
            targets = ids[:, start + 1 : end + 1]  # the boundary target: the next chunk's first token
            if targets.shape[1] == 0:  # their loop skips a chunk with no target
                continue
            loss = F.cross_entropy(lg[:, : targets.shape[1]].reshape(-1, lg.shape[-1]), targets.reshape(-1))
            # ``_compute_layer_teach_signals``: d loss / d (every block's output), detached
            teach = [g.detach() for g in torch.autograd.grad(loss, block_outputs, retain_graph=True)]
            with torch.no_grad():
                m(tokens, teach_signals=teach, fast_state=fast_state, finalize_updates=end >= T)
        return torch.cat(out, 1)

    return [
        Entry(
            "HOPEModel+updates",
            "nested-learning",
            m,
            logits,
            None,
            vs="hope",
            note="no generate(); nested-learning's training step with test-time updates (two passes per "
            "8-token chunk: a differentiable read, then a no-grad write driven by the per-layer teach "
            "signals, a backward of the chunk loss). Differs from mnemo's hope: writes are stop-gradient "
            "(no outer gradient through the updates, so M_k/M_v/M_eta/M_alpha get none), the CMS learns "
            "from the task gradient (mnemo's hope: a reconstruction objective, in the one forward) with "
            "its fast weights shared over the batch, the self-mod memories update every 8 tokens (mnemo: "
            "16 / 64) with the local conv restarted per chunk, and no output norm/gate (mnemo's hope "
            "has Titans' output gate)",
        )
    ]


#: the peers, by the name ``--peers`` selects them with
PEERS: dict[str, Callable[[Size, Callable[[str], Entry]], list[Entry]]] = {
    "transformers_mamba": peer_transformers_mamba,
    "transformers_mamba2": peer_transformers_mamba2,
    "transformers_qwen3_next": peer_transformers_qwen3_next,
    "mambapy": peer_mambapy,
    "titans_pytorch": peer_titans_pytorch,
    "titans_pytorch_lmm": peer_titans_pytorch_lmm,
    "nested_learning": peer_nested_learning,
    "nested_learning_updates": peer_nested_learning_updates,
}

#: the mnemo row each peer is timed beside (its group: built, timed and freed together)
PEER_PARTNER: dict[str, str] = {
    "transformers_mamba": "mamba",
    "transformers_mamba2": "mamba2",
    "transformers_qwen3_next": "qwen3_next_equiv",
    "mambapy": "mamba",
    "titans_pytorch": "titans_mac",
    "titans_pytorch_lmm": "titans_lmm",
    "nested_learning": "hope",
    "nested_learning_updates": "hope",
}
#: mnemo rows that only a peer's builder makes (imported from the peer's model)
PEER_DEFINED = {"qwen3_next_equiv"}


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def interleaved(
    tasks: dict,
    repeats: int,
    warmup: int = 1,
    on_error: Callable[[object, BaseException], None] | None = None,
) -> dict:
    """Seconds of every call of ``tasks[key]()``: ``warmup`` untimed calls of each task, then
    ``repeats`` rounds, each calling every task once (round ``r`` starts at task ``r`` of the list,
    so no task always runs first). Returns ``{key: [seconds, ...]}``; a task that raises is dropped
    (``on_error(key, exc)`` is told) and returns no times."""
    keys = list(tasks)
    times = {k: [] for k in keys}
    alive = []
    for k in keys:
        try:
            for _ in range(warmup):
                tasks[k]()
            alive.append(k)
        except Exception as e:  # a model that fails must not stop the others' rows
            if on_error is None:
                raise
            on_error(k, e)
    for r in range(repeats):
        order = alive[r % len(alive) :] + alive[: r % len(alive)] if alive else []
        for k in order:
            t0 = time.perf_counter()
            tasks[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def train_step(
    entry: Entry, T: int, B: int, lr: float = 1e-4, seed: int = 0, device: str = "cpu"
) -> Callable[[], None]:
    """One training step of ``entry`` on fixed random tokens ``[B, T + 1]``: forward, mean next-token
    cross-entropy (+ the auxiliary loss), backward, AdamW step (one optimizer per entry, made on
    the first call and kept until the caller sets ``entry.opt = None``). ``device``: where the
    tokens go (the model must be there already)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=gen).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    if entry.opt is None:
        entry.opt = torch.optim.AdamW(entry.model.parameters(), lr=lr)
    opt = entry.opt

    def step():
        entry.model.train()
        opt.zero_grad(set_to_none=True)
        logits = entry.logits(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        aux = entry.aux() if entry.aux is not None else None
        if aux is not None:
            loss = loss + aux
        loss.backward()
        opt.step()

    return step


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


# ------------------------------------------------------------------------------------------------
# the suite
# ------------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1024x8,4096x2"`` -> ``[(1024, 8), (4096, 2)]`` (``T x batch``); ``"none"`` -> ``[]`` (no
    training rows: generation only, e.g. for a peer too slow to train at the shared size)."""
    if str(text).strip().lower() == "none":
        return []
    out = []
    for part in str(text).split(","):
        try:
            T, B = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--model-shapes: expected TxB[,TxB...] such as 1024x8, got {part!r}") from None
        if T < 1 or B < 1:
            raise ValueError(f"--model-shapes: expected T >= 1 and B >= 1, got {part!r}")
        out.append((T, B))
    return out


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in out):
        raise ValueError(f"{flag}: expected integers >= 1, got {text!r}")
    return out


def parse_gen_batches(text: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]`` (generation batch sizes); ``"none"`` -> ``[]`` (no generation rows:
    training only)."""
    if str(text).strip().lower() == "none":
        return []
    return _int_list(text, "--gen-batches")


def run(
    models: list[str],
    peers: list[str],
    size: Size,
    shapes: list[tuple[int, int]],
    gen_batches: list[int],
    prompt_len: int,
    gen_tokens: int,
    repeats: int,
    compile: bool = False,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> dict:
    """Build the rows and time them; returns the JSON-ready result (see :func:`main` for the
    tables). ``models``: mnemo family names; ``peers``: keys of :data:`PEERS`; ``device``: where
    every model runs (CUDA timings synchronise after each call). Times are in milliseconds (the
    ``*_ms`` fields); ``ratio_*`` = a row's time / its ``vs`` row's time at the same shape."""
    from ..models import model_names

    known = model_names()
    unknown = [m for m in models if m not in known]
    if unknown:
        raise ValueError(f"--models: unknown model(s) {unknown}; registered: {', '.join(known)}")
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"--peers: unknown peer(s) {bad}; choose from {', '.join(PEERS)} or 'none'")
    if gen_tokens < 2:
        raise ValueError(f"--gen-tokens: expected >= 2 (first token + at least one step), got {gen_tokens}")

    # One group at a time: a mnemo row, its compiled copy and the peers paired with it are built,
    # timed (interleaved among themselves, which is where the ratios come from), printed and freed
    # before the next group is built, so memory holds one group's models and optimizer states, and
    # a run that is stopped has already printed every finished group.
    groups: list[str] = []
    for name in [*models, *(PEER_PARTNER[p] for p in peers)]:
        if name not in groups:
            groups.append(name)
    peer_status: dict[str, str] = {}
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    notes: dict[str, str] = {}
    train_rows: list[dict] = []
    gen_rows: list[dict] = []
    compile_status = "off"
    if compile:
        ok, why = compile_available()
        compile_status = "on" if ok else f"unavailable: {why}"
        if not ok:
            log(f"--compile: torch.compile is unavailable here ({why}); running eager only")
    for group in groups:
        rows_list = _build_group(group, peers, size, compile_status == "on", skipped, peer_status, log)
        if not rows_list:
            continue
        for entry in rows_list:
            entry.model.to(device)
            if entry.note:
                notes[entry.name] = entry.note
        t_rows, g_rows = _time_group(
            rows_list, shapes, gen_batches, prompt_len, gen_tokens, repeats, device, errors, log
        )
        train_rows += t_rows
        gen_rows += g_rows
        for r in t_rows:
            log("  " + _train_line(r))
        for r in g_rows:
            log("  " + _gen_line(r))
        del rows_list, entry  # the group's models, optimizer states and closures go here
        gc.collect()
    return {
        "d_model": size.d_model,
        "n_layers": size.n_layers,
        "vocab": size.vocab,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "torch": torch.__version__,
        "repeats": repeats,
        "compile": compile_status,
        "peers": peer_status,
        "skipped_models": skipped,
        "errors": errors,
        "notes": notes,
        "train": train_rows,
        "generate": gen_rows,
    }


def _build_group(
    group: str,
    peers: list[str],
    size: Size,
    compile: bool,
    skipped: dict[str, str],
    peer_status: dict[str, str],
    log: Callable[[str], None],
) -> list[Entry]:
    """The rows of ``group``: the mnemo row (built here, or by the peer that defines it, such as
    ``qwen3_next_equiv``), its compiled copy (``compile``) and every peer of ``peers`` paired with it."""
    built: dict[str, Entry] = {}

    def mnemo_row(name: str) -> Entry:
        if name not in built:
            built[name] = mnemo_entry(name, size=size)
        return built[name]

    if group in PEER_DEFINED:
        pass  # the peer's builder makes the mnemo row
    else:
        try:
            mnemo_row(group)
        except Exception as e:
            skipped[group] = f"{type(e).__name__}: {e}"
            log(f"{group}: skipped, the model does not build at this size ({skipped[group]})")
            return []
    peer_rows: list[Entry] = []
    for key in peers:
        if PEER_PARTNER[key] != group:
            continue
        try:
            rows = PEERS[key](size, mnemo_row)
        except ImportError as e:
            peer_status[key] = f"not installed ({e.name or e})"
            log(f"{key}: skipped, peer not installed ({e.name or e}); run ../shared/bench/install-peers")
            continue
        except Exception as e:
            peer_status[key] = f"failed to build: {type(e).__name__}: {e}"
            log(f"{key}: skipped, {peer_status[key]}")
            continue
        peer_status[key] = "ok"
        for r in rows:
            if r.library == "mnemo":
                built[r.name] = r
            else:
                peer_rows.append(r)
    ours = list(built.values())
    return ours + ([compiled_entry(e) for e in ours] if compile else []) + peer_rows


def _time_group(
    rows_list: list[Entry],
    shapes: list[tuple[int, int]],
    gen_batches: list[int],
    prompt_len: int,
    gen_tokens: int,
    repeats: int,
    device: str,
    errors: dict[str, str],
    log: Callable[[str], None],
) -> tuple[list[dict], list[dict]]:
    """Training and generation rows of one group, timed interleaved among the group's rows, with
    the ratios of the rows paired inside it."""

    def on_error(key, exc):
        name = key[0]
        errors[f"{name} {key[1:]}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log(f"{name} {key[1:]}: failed ({errors[f'{name} {key[1:]}']})")

    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def with_breaks(entry, fn):
        if not entry.compiled:

            def synced():
                fn()
                sync()

            return synced
        from torch._dynamo.utils import counters

        def wrapped():  # count the graph breaks dynamo meets while compiling this row
            before = sum(counters["graph_break"].values())
            fn()
            sync()
            entry.graph_breaks = (entry.graph_breaks or 0) + sum(counters["graph_break"].values()) - before

        return wrapped

    names = ", ".join(e.name for e in rows_list)
    train_rows = []
    for T, B in shapes:
        tasks = {
            (e.name, "train", T, B): with_breaks(e, train_step(e, T, B, device=device)) for e in rows_list
        }
        log(f"timing training of {names} at T={T} B={B}, {repeats} interleaved rounds ...")
        times = interleaved(tasks, repeats, on_error=on_error)
        for e in rows_list:
            t = _median(times[(e.name, "train", T, B)])
            train_rows.append(
                {
                    "model": e.name,
                    "library": e.library,
                    "compiled": e.compiled,
                    "T": T,
                    "batch": B,
                    "params": e.params,
                    "train_step_ms": 1e3 * t,
                    "train_step_ms_runs": [1e3 * s for s in times[(e.name, "train", T, B)]],
                    "train_tokens_per_s": B * T / t if t == t else float("nan"),
                    "vs": e.vs,
                }
            )
        for e in rows_list:
            e.opt = None  # free the optimizer states before the next shape's activations
    _add_ratios(train_rows, ("T", "batch"), {"train_step_ms": "ratio_train"})

    gen_rows = []
    tasks = {}
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, VOCAB, (b, prompt_len), generator=gen).to(device) for b in gen_batches}
    for e in rows_list:
        if e.generate is None:
            continue
        e.model.eval()
        for b in gen_batches:
            p = prompts[b]
            tasks[(e.name, "first_token", b)] = with_breaks(e, lambda e=e, p=p: e.generate(p, 1))
            tasks[(e.name, "generate", b)] = with_breaks(e, lambda e=e, p=p: e.generate(p, gen_tokens))
    if tasks:
        log(
            f"timing generation of {names}: prompt {prompt_len} tokens, {gen_tokens} new tokens, "
            f"batches {gen_batches}, {repeats} interleaved rounds ..."
        )
    times = interleaved(tasks, repeats, on_error=on_error)
    for e in rows_list:
        if e.generate is None:
            continue
        for b in gen_batches:
            t1 = _median(times[(e.name, "first_token", b)])
            tn = _median(times[(e.name, "generate", b)])
            gen_rows.append(
                {
                    "model": e.name,
                    "library": e.library,
                    "compiled": e.compiled,
                    "batch": b,
                    "prompt_len": prompt_len,
                    "new_tokens": gen_tokens,
                    "first_token_ms": 1e3 * t1,
                    "generate_ms": 1e3 * tn,
                    "gen_tokens_per_s": b * gen_tokens / tn if tn == tn else float("nan"),
                    "decode_tokens_per_s": (b * (gen_tokens - 1) / (tn - t1)) if tn > t1 else float("nan"),
                    "vs": e.vs,
                }
            )
    _add_ratios(
        gen_rows, ("batch",), {"first_token_ms": "ratio_first_token", "generate_ms": "ratio_generate"}
    )
    for e in rows_list:
        if e.compiled:
            for r in train_rows + gen_rows:
                if r["model"] == e.name:
                    r["graph_breaks"] = e.graph_breaks
    return train_rows, gen_rows


def _add_ratios(rows: list[dict], keys: tuple[str, ...], fields: dict[str, str]) -> None:
    """For every row with a ``vs`` partner at the same ``keys``: ``ratio = row time / partner time``
    for each ``fields`` time (``peer / mnemo``; for a compiled row ``compiled / eager``, so below 1
    means compilation helped). A peer also gets ``…_vs_compiled`` against its partner's compiled row."""
    index = {(r["model"], *(r[k] for k in keys)): r for r in rows}
    for r in rows:
        if not r.get("vs"):
            continue
        at = tuple(r[k] for k in keys)
        partner = index.get((r["vs"], *at))
        compiled = index.get((f"{r['vs']} [compiled]", *at)) if not r["compiled"] else None
        for f, name in fields.items():
            r[name] = _ratio(r[f], partner[f]) if partner else float("nan")
            if compiled is not None:
                r[f"{name}_vs_compiled"] = _ratio(r[f], compiled[f])


def _cell(x, width: int, prec: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>{width}}"
    if isinstance(x, int):
        return f"{x:>{width},}"
    return f"{x:>{width}.{prec}f}"


def _train_line(r: dict) -> str:
    return (
        f"{r['model']:<30}{r['library']:<16}{r['T']:>6}{r['batch']:>4}{_cell(r['params'], 12)}"
        f"{_cell(r['train_step_ms'], 11)}{_cell(r['train_tokens_per_s'], 11, 0)}{r['vs'] or '':>20}"
        f"{_cell(r.get('ratio_train'), 8, 2)}{_cell(r.get('graph_breaks'), 8)}"
    )


def _gen_line(r: dict) -> str:
    return (
        f"{r['model']:<30}{r['library']:<16}{r['batch']:>4}{_cell(r['first_token_ms'], 11)}"
        f"{_cell(r['generate_ms'], 10)}{_cell(r['gen_tokens_per_s'], 10)}"
        f"{_cell(r['decode_tokens_per_s'], 10)}{r['vs'] or '':>20}"
        f"{_cell(r.get('ratio_first_token'), 7, 2)}{_cell(r.get('ratio_generate'), 7, 2)}"
    )


def print_tables(result: dict, log: Callable[[str], None] = print) -> None:
    """The training and generation tables of a :func:`run` result."""
    if result["train"]:
        log(
            "\ntraining (forward + loss + backward + AdamW step); ratio = this row's step time / the "
            "'vs' row's (peer / mnemo: above 1 means mnemo is faster; compiled / eager: below 1 means "
            "compiling helped)"
        )
        head = f"{'model':<30}{'library':<16}{'T':>6}{'B':>4}{'params':>12}{'step ms':>11}{'tokens/s':>11}"
        head += f"{'vs':>20}{'ratio':>8}{'breaks':>8}"
        log(head)
        log("-" * len(head))
        for r in result["train"]:
            log(_train_line(r))
    if result["generate"]:
        g = result["generate"][0]
        log(
            f"\ngeneration (greedy, the library's generate(); prompt {g['prompt_len']} tokens, "
            f"{g['new_tokens']} new tokens): first token = prefill + 1 token; decode tokens/s from "
            "(generate − first token); ratios = this row's time / the 'vs' row's"
        )
        head = f"{'model':<30}{'library':<16}{'B':>4}{'1st tok ms':>11}{'gen ms':>10}{'gen tok/s':>10}"
        head += f"{'dec tok/s':>10}{'vs':>20}{'r 1st':>7}{'r gen':>7}"
        log(head)
        log("-" * len(head))
        for r in result["generate"]:
            log(_gen_line(r))
    for name, note in result["notes"].items():
        log(f"  {name}: {note}")
    for name, status in result["peers"].items():
        if status != "ok":
            log(f"  peer {name}: {status}")
    for name, why in result["errors"].items():
        log(f"  {name}: failed: {why}")


def main(args) -> int:
    from ..models import model_names

    models = args.models.split(",") if getattr(args, "models", None) else model_names()
    peers_arg = getattr(args, "peers", None)
    peers = [] if peers_arg == "none" else (peers_arg.split(",") if peers_arg else list(PEERS))
    size = Size(
        getattr(args, "d_model", None) or DEFAULT_D_MODEL, getattr(args, "n_layers", None) or DEFAULT_N_LAYERS
    )
    shapes = parse_shapes(getattr(args, "model_shapes", None) or DEFAULT_SHAPES)
    gen_batches = parse_gen_batches(getattr(args, "gen_batches", None) or DEFAULT_GEN_BATCHES)
    if not shapes and not gen_batches:
        raise ValueError(
            "--model-shapes none with --gen-batches none: nothing to time (keep training shapes, generation "
            "batches, or both)"
        )
    print(
        f"mnemo bench --suite models: d_model={size.d_model}, {size.n_layers} layers, vocab {size.vocab}; "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} interleaved rounds after one warm-up"
        f"{'; --compile' if getattr(args, 'compile', False) else ''}\n",
        flush=True,
    )
    result = run(
        models,
        peers,
        size,
        shapes,
        gen_batches,
        prompt_len=getattr(args, "prompt_len", 256),
        gen_tokens=getattr(args, "gen_tokens", 64),
        repeats=args.repeats,
        compile=getattr(args, "compile", False),
        device=getattr(args, "device", "cpu"),
        log=lambda s: print(s, flush=True),
    )
    print_tables(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"\nwrote {args.json}")
    if not result["train"] and not result["generate"]:
        print(
            "mnemo bench --suite models: nothing was timed (every selected model was skipped or failed; "
            "see above)",
            file=sys.stderr,
        )
        return 1
    if result["errors"]:
        n_failed = len(result["errors"])
        print(f"mnemo bench --suite models: {n_failed} row(s) failed (listed above)", file=sys.stderr)
        return 1
    return 0

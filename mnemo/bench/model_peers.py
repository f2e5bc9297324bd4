"""The peers of ``mnemo bench --suite models`` (:mod:`mnemo.bench.models` says what each one
builds): one builder per peer library, :data:`PEERS`, and the mnemo row each is timed beside. The
peers are imported inside their builders only, never by the library.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .model_entries import Entry, Size, mnemo_entry

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

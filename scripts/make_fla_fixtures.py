"""Make the fla-hub fixtures of ``tests/hf/test_fla_hub_48.py``: tiny random-weight models built and
saved by flash-linear-attention (fla) itself, and fla's own float32 logits for them.

fla is never a dependency of mnemo; run this in a scratch environment that has fla's model classes,
on a CPU with Triton's interpreter (fla's layers run their Triton kernels there, in float32)::

    python3.11 -m venv /tmp/flaenv && . /tmp/flaenv/bin/activate
    pip install torch==2.13.0 && pip install triton==3.9.0 einops packaging transformers==5.25.0 safetensors
    pip install --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0
    TRITON_INTERPRET=1 python scripts/make_fla_fixtures.py            # writes tests/data/fla_hub/

For each model (``gla``, ``retnet``, ``delta_net``, ``gated_deltanet``: vocab 32, hidden 32, MLP 16,
2 layers, several heads, non-default expand ratios / value heads, short convolutions, fused and
unfused norms, untied or tied heads) it writes
``tests/data/fla_hub/<model_type>/``: ``config.json`` and ``model.safetensors`` from fla's
``save_pretrained``, and ``reference.safetensors`` with ``input_ids`` ``[2, 40]`` (int64, a fixed
seed) and ``logits`` ``[2, 40, 32]`` (float32: fla's forward pass without gradients, the kernels fla
picks for 40 tokens) and, in its metadata, the versions of fla, torch and transformers. Every
weight is moved off its initial value (norm weights around 1, biases, A_log, dt_bias random), so
that a weight read into the wrong place shows in the logits. ``OUT`` (the first argument) writes
elsewhere.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

VOCAB, HIDDEN, LAYERS, T, ROWS = 32, 32, 2, 40, 2
COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=16,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, fuse_cross_entropy=False,
)  # fmt: skip


def models():
    """``model_type -> (config class, model class, options)``: the fixtures' settings."""
    from fla.models import (
        DeltaNetConfig,
        DeltaNetForCausalLM,
        GatedDeltaNetConfig,
        GatedDeltaNetForCausalLM,
        GLAConfig,
        GLAForCausalLM,
        RetNetConfig,
        RetNetForCausalLM,
    )

    return {
        # 2 heads, key size 8 (expand_k 0.5), value size 24 (expand_v 1.5), short convs, untied head
        "gla": (GLAConfig, GLAForCausalLM, dict(
            num_heads=2, expand_k=0.5, expand_v=1.5, use_short_conv=True, conv_size=4, norm_eps=1e-6,
        )),
        # 2 heads, K 8, V 16, unfused norms (nn.RMSNorm blocks, g_norm then the gate), untied head
        "retnet": (RetNetConfig, RetNetForCausalLM, dict(
            num_heads=2, expand_k=0.5, expand_v=1.0, fuse_norm=False, norm_eps=1e-6,
        )),
        # 2 heads, K 8, V 16, no output gate (fla's default), negative eigenvalues, conv of 3 taps, tied head
        "delta_net": (DeltaNetConfig, DeltaNetForCausalLM, dict(
            num_heads=2, expand_k=0.5, expand_v=1.0, use_gate=False, allow_neg_eigval=True, conv_size=3,
            tie_word_embeddings=True, norm_eps=1e-5,
        )),
        # 2 key heads of 8, 4 value heads of 12 (grouped; expand_v 1.5), output gate, unfused block norms
        "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM, dict(
            num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.5, use_gate=True, fuse_norm=False,
        )),
    }  # fmt: skip


@torch.no_grad()
def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter off its initial value: matrices ``N(0, 1/fan_in)``, norm weights ``1 +
    N(0, 0.3²)``, biases ``N(0, 0.3²)``, ``A_log = log U[1, 16]``, ``dt_bias ~ N(−1, 0.5²)``."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 1.0)
        elif p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def interpreter_shims() -> None:
    """mnemo's shims for fla's kernels under Triton's interpreter (``mnemo/ops/_triton_interpret.py``:
    no autotuning timings, which need a GPU driver; typed loop counters), loaded from its file so
    that this environment needs no mnemo install (the module imports only the standard library)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "mnemo" / "ops" / "_triton_interpret.py"
    spec = importlib.util.spec_from_file_location("_mnemo_triton_interpret", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


def main(out: Path) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("run with TRITON_INTERPRET=1 (fla's Triton kernels on the CPU)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_shims()
    import fla
    import transformers
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(48)
    ids = torch.randint(0, VOCAB, (ROWS, T), generator=gen)
    for seed, (name, (config_cls, model_cls, opts)) in enumerate(models().items()):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**COMMON, **opts)).float().eval()
        randomise(model, torch.Generator().manual_seed(seed))
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            logits = model(ids).logits.float()
        meta = {"fla": fla.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
        tensors = {"input_ids": ids.contiguous(), "logits": logits.contiguous()}
        save_file(tensors, folder / "reference.safetensors", meta)
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1024
        print(f"{name}: {size:.1f} KB, logits max |x| {logits.abs().max():.3f}, std {logits.std():.3f}")


if __name__ == "__main__":
    default = Path(__file__).resolve().parent.parent / "tests" / "data" / "fla_hub"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)

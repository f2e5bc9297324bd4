"""Text generation from a trained model: :func:`generate_text` (what ``Trainer.sample``, ``mnemo
generate`` and the end-of-run sample use)."""

from __future__ import annotations

import torch


def generate_text(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    device="cpu",
    compile: bool = False,
) -> str:
    """Decode ``max_new_tokens`` after ``prompt`` (an empty prompt starts from a newline), sampled
    at ``temperature`` (``0``: greedy) from a generator seeded with ``seed``; ``compile``: decode
    under ``torch.compile`` (:meth:`~mnemo.models.LanguageModel.generate`). Defaults:
    ``temperature=0.8``, ``seed=0``, ``compile=False``."""
    ids = tokenizer.encode(prompt or "\n")
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        ids[None].to(device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=gen,
        compile=compile,
    )
    text = tokenizer.decode(out[0].cpu())
    return text if prompt else text[1:]

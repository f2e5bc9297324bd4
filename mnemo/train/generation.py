"""Text generation from a trained model: :func:`generate_text` (what ``Trainer.sample``, ``mnemo
generate`` and the end-of-run sample use); :func:`sample_run` fills in a run's sampling settings
(``TrainConfig.sample_*``)."""

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
    made: list | None = None,
) -> str:
    """Decode ``max_new_tokens`` after ``prompt`` (an empty prompt starts from a newline), sampled
    at ``temperature`` (``0``: greedy) from a generator seeded with ``seed``; ``compile``: decode
    under ``torch.compile`` (:meth:`~mnemo.models.LanguageModel.generate`). ``made``: a list that
    receives each new token id (a 0-d tensor, on ``device``) as it is sampled (what an
    interruption leaves: :func:`decoded`).
    Defaults: ``temperature=0.8``, ``seed=0``, ``compile=False``, ``made=None``."""
    ids = tokenizer.encode(prompt or "\n")
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        ids[None].to(device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=gen,
        compile=compile,
        on_token=None if made is None else (lambda nxt: made.append(nxt[0])),  # no host sync per token
    )
    text = tokenizer.decode(out[0].cpu())
    return text if prompt else text[1:]


def decoded(tokenizer, prompt: str, made: list) -> str:
    """The text of ``prompt`` followed by the token ids ``made`` (as :func:`generate_text` returns
    it; for the part of a generation that finished before an interruption)."""
    new = torch.stack(made).cpu().long() if made else torch.zeros(0, dtype=torch.long)
    ids = torch.cat([tokenizer.encode(prompt or "\n"), new])
    text = tokenizer.decode(ids)
    return text if prompt else text[1:]


def sample_run(
    cfg,
    model,
    tokenizer,
    device,
    prompt: str | None = None,
    max_new_tokens: int | None = None,
    *,
    seed: int | None = None,
    temperature: float | None = None,
) -> str:
    """:func:`generate_text` with the run ``cfg``'s settings for what is ``None``: ``prompt``
    (``cfg.sample_prompt``), ``max_new_tokens`` (``cfg.sample_tokens``), ``temperature``
    (``cfg.sample_temperature``), ``seed`` (``cfg.seed``); what ``Trainer.sample`` runs.

    Raises:
        ValueError: ``tokenizer`` is ``None`` (a task run: there is no text to sample)."""
    if tokenizer is None:
        raise ValueError(f"no text to sample: this run trains on the task {cfg.task!r}")
    return generate_text(
        model,
        tokenizer,
        cfg.sample_prompt if prompt is None else prompt,
        cfg.sample_tokens if max_new_tokens is None else max_new_tokens,
        temperature=cfg.sample_temperature if temperature is None else temperature,
        seed=cfg.seed if seed is None else seed,
        device=device,
    )

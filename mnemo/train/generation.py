"""Text generation from a trained model: :func:`generate_text` (what ``Trainer.sample``, ``mnemo
generate`` and the end-of-run sample use); :func:`sample_run` fills in a run's sampling settings
(``TrainConfig.sample_*``) and ends the text at the tokenizer's end-of-text token (a BPE run's
``<|endoftext|>``, :attr:`~mnemo.data.tokenizer.HFTokenizer.eot_id`; char/byte tokenizers have none),
as ``mnemo generate`` (without ``--ignore-eos``), the harness and the HF export do."""

from __future__ import annotations

import torch

from .batches import bos_id


def generate_text(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    device="cpu",
    compile: bool = False,
    made: list | None = None,
    bos: int | None = None,
    eos: int | list[int] | None = None,
) -> str:
    """Decode ``max_new_tokens`` after ``prompt`` (an empty prompt starts from a newline), sampled
    at ``temperature`` (``0``: greedy) from a generator seeded with ``seed``, among the ``top_k``
    likeliest tokens and the ``top_p`` nucleus where given; ``compile``: decode
    under ``torch.compile`` (:meth:`~mnemo.models.LanguageModel.generate`). ``made``: a list that
    receives each new token id (a 0-d tensor, on ``device``) as it is sampled (what an
    interruption leaves: :func:`decoded`). ``bos``: a token id read before the prompt and not
    returned (a run trained with ``TrainConfig.bos``: its windows start with it; then an empty
    prompt starts from it alone). ``eos``: an end-of-text id (or several) that ends the text: the
    generation stops there, and the end token itself is not part of the text
    (:meth:`~mnemo.models.LanguageModel.generate`'s ``eos_token_id``).
    Defaults: ``temperature=0.8``, ``top_k=None``, ``top_p=None``, ``seed=0``, ``compile=False``,
    ``made=None``, ``bos=None``, ``eos=None``."""
    prompt_ids = _prompt_ids(tokenizer, prompt, bos)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        prompt_ids[None].to(device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=gen,
        compile=compile,
        on_token=None if made is None else (lambda nxt: made.append(nxt[0])),  # no host sync per token
        eos_token_id=eos,
    )
    ids = out[0].cpu()
    if eos is not None:  # the text ends before the first end id among the new tokens
        ends = set([eos] if isinstance(eos, int) else eos)
        new = ids[len(prompt_ids) :].tolist()
        cut = next((i for i, t in enumerate(new) if t in ends), None)
        if cut is not None:
            ids = ids[: len(ids) - len(new) + cut]
    return _text(tokenizer, prompt, bos, ids)


def _prompt_ids(tokenizer, prompt: str, bos: int | None) -> torch.Tensor:
    if bos is None:
        return tokenizer.encode(prompt or "\n")
    return torch.cat([torch.tensor([bos], dtype=torch.long), tokenizer.encode(prompt)])


def _text(tokenizer, prompt: str, bos: int | None, ids: torch.Tensor) -> str:
    """The text of ``ids`` (prompt, then new tokens), less what :func:`_prompt_ids` put first."""
    if bos is not None:
        return tokenizer.decode(ids[1:])
    text = tokenizer.decode(ids)
    return text if prompt else text[1:]


def decoded(tokenizer, prompt: str, made: list, bos: int | None = None) -> str:
    """The text of ``prompt`` followed by the token ids ``made`` (as :func:`generate_text` returns
    it, ``bos`` likewise; for the part of a generation that finished before an interruption)."""
    new = torch.stack(made).cpu().long() if made else torch.zeros(0, dtype=torch.long)
    return _text(tokenizer, prompt, bos, torch.cat([_prompt_ids(tokenizer, prompt, bos), new]))


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
    (``cfg.sample_temperature``), ``seed`` (``cfg.seed``); what ``Trainer.sample`` runs. The text
    ends before the tokenizer's end-of-text token (``tokenizer.eot_id``: a BPE run's
    ``<|endoftext|>``, the document separator it trained on; none for char/byte tokenizers), as
    ``mnemo generate`` ends it (:func:`end_ids`).

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
        bos=bos_id(tokenizer, cfg.bos),
        eos=end_ids(model, tokenizer),
    )


def end_ids(model, tokenizer) -> int | None:
    """The id that ends a text ``model`` generates with ``tokenizer``: the tokenizer's end-of-text
    token (``eot_id``; ``None`` for a tokenizer without one, or one outside ``model``'s vocabulary,
    which the model can never sample)."""
    eot = getattr(tokenizer, "eot_id", None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return eot if eot is not None and (vocab is None or eot < vocab) else None

"""lm-evaluation-harness adapter: mnemo checkpoints as the ``lm_eval`` model ``"mnemo"``.

Importing this module registers :class:`MnemoLM` with lm-eval's model registry, so::

    import mnemo.hf.harness, lm_eval
    lm_eval.simple_evaluate(model="mnemo", model_args="checkpoint=runs/x", tasks=["lambada_openai"])

works like ``mnemo harness --checkpoint runs/x --tasks lambada_openai``. Text is encoded with the
checkpoint's own tokenizer (:func:`mnemo.data.load_tokenizer`), scoring runs on mnemo's
:class:`~mnemo.models.LanguageModel` directly.

* ``loglikelihood``: requests sorted by length (longest first), batched ``batch_size`` at a time,
  right-padded (a causal model never sees right padding), the continuation's log-probabilities
  gathered from one ``log_softmax`` per batch; ``is_greedy`` when every continuation token is the
  argmax. ``context + continuation`` is encoded whole and split at the context's length (trailing
  spaces of the context move to the continuation), as lm-eval's Hugging Face model does.
* ``loglikelihood_rolling`` (perplexity tasks), ``rolling=``:

  - ``"state"`` (default unless the model has learned positions): the whole document in one
    left-to-right pass, fed in chunks of ``max_length`` tokens with the model's state carried
    between chunks, so every token is conditioned on everything before it — the recurrent state
    for linear/SSM mixers, the growing KV cache for softmax attention. This equals one forward
    pass over the document; chunking only bounds activation memory.
  - ``"window"`` (default with learned positions, capped at ``max_position``): lm-eval's disjoint
    rolling windows of ``max_length`` tokens, each scored from a fresh state (with ``add_bos_token``,
    each after ``prefix_token_id``: ``max_length - 1`` tokens of the document with learned
    positions, so that the input fits ``max_length`` and every window reads the prefix first).

* ``generate_until``: greedy decoding (temperature sampling when a task sets ``do_sample`` and a
  ``temperature > 0``, within its ``top_k`` / ``top_p`` where it sets them) with the state, one
  token per step, until a stop string appears in the decoded text (the output is cut before it),
  an end-of-text token (when the checkpoint or tokenizer declares one), or ``max_gen_toks``
  tokens. Requests with equal prompt length and options are batched.

**The first token.** The first token of a document (and of a continuation with an empty context)
is conditioned on ``prefix_token_id`` when one is known, as lm-eval's Hugging Face model does:
the model argument, else the checkpoint's BOS (:func:`mnemo.hf.special_ids.checkpoint_bos`: a
training run's ``TrainConfig.bos``, or the BOS a converted checkpoint's tokenizer puts before a
text), else its end-of-text id (:func:`~mnemo.hf.special_ids.checkpoint_eos`, else the
tokenizer's ``eot_id``; a model given in memory, whose training the adapter cannot read, has no
BOS unless told); with none (mnemo's char/byte tokenizers without ``--bos``) it is not scored (its
log-probability counts as 0). ``add_bos_token`` (default: on exactly when the
checkpoint has a BOS) puts ``prefix_token_id`` before every context too (each rolling window's;
the first window's context is that one id, read once) — a run trained with ``--bos`` saw it first
in every window, and lm-eval encodes with the tokenizer's own BOS by default. Generation stops at
any of the checkpoint's end-of-text ids and the tokenizer's.

Model arguments (``--model-args``-style ``key=value``): ``checkpoint`` (or ``pretrained``; a
checkpoint or run directory), ``device`` (``cpu``), ``batch_size`` (int; ``auto`` = 16),
``max_length``, ``rolling``, ``prefix_token_id``, ``add_bos_token`` (``true`` / ``false``),
``max_gen_toks`` (256), ``dtype`` (``float32`` / ``bfloat16`` / ``float16``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..data import load_tokenizer
from ..models import LanguageModel
from ..models.lm import check_device, sample_next

__all__ = ["MnemoLM"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _int_or_none(name: str, value) -> int | None:
    if value is None or value == "":
        return None
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected an int, got {value!r}") from None
    return v


def _bool_or_none(name: str, value) -> bool | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{name}: expected true or false, got {value!r}")


def _special_ids(ckpt: Path | None, tokenizer) -> tuple[int | None, list[int]]:
    """The checkpoint's BOS (``None``: none) and its end-of-text ids (the ones it declares, then the
    tokenizer's ``eot_id``). For a model given in memory (``ckpt`` ``None``) nothing says whether it
    was trained with a BOS: none is assumed (give ``prefix_token_id`` / ``add_bos_token``), and the
    end id is the tokenizer's."""
    from .special_ids import checkpoint_bos, checkpoint_eos

    bos = eos = None
    if ckpt is not None:
        bos = checkpoint_bos(ckpt, tokenizer, warn=log.warning)
        eos = checkpoint_eos(ckpt)
    stop = [] if eos is None else ([eos] if isinstance(eos, int) else [int(i) for i in eos])
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None and eot not in stop:
        stop.append(eot)
    return bos, stop


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in at least float32: 16-bit logits are upcast, float64 ones kept (``.float()``
    rounded a float64 model's scores to float32)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _changes(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device) -> bool:
    """Whether ``model.to(dtype)`` / ``.to(device)`` would change a parameter or buffer of ``model``."""
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        return True  # (buffers such as rotary frequencies may stay float32 by design)
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            return True
    return False


@register_model("mnemo")
class MnemoLM(LM):
    """A mnemo checkpoint as an lm-eval ``LM`` (see the module docstring for what each request
    type computes). ``model`` may be given instead of ``checkpoint`` (with ``tokenizer``) to wrap a
    model already in memory: it is used as it is (and put in eval mode), unless ``dtype`` or
    ``device`` differ from its own, in which case a copy is cast or moved and the caller's model is
    left unchanged."""

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        pretrained: str | Path | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        rolling: str | None = None,
        prefix_token_id: int | None = None,
        add_bos_token: bool | str | None = None,
        max_gen_toks: int = 256,
        dtype: str | None = None,
        model: LanguageModel | None = None,
        tokenizer: Any = None,
        **kwargs,
    ):
        super().__init__()
        if kwargs:
            log.warning("mnemo: ignoring model arguments %s", sorted(kwargs))
        device = str(device or "cpu")
        check_device(device)
        self._device = torch.device(device)
        path = checkpoint if checkpoint is not None else pretrained
        ckpt = None
        if model is None:
            if path is None:
                raise ValueError("checkpoint: required (model_args='checkpoint=DIR')")
            from ..train import resolve_checkpoint

            ckpt = resolve_checkpoint(str(path), warn=log.warning)  # (read below for its special ids)
            model = LanguageModel.from_pretrained(ckpt, map_location=device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ckpt)
        elif tokenizer is None:
            raise ValueError("tokenizer: required with model=")
        target = None
        if dtype not in (None, "", "auto"):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
            target = _DTYPES[dtype]
        if ckpt is None and _changes(model, target, self._device):
            # a model of the caller's: cast / moved as a copy (``nn.Module.to`` works in place)
            model = copy.deepcopy(model)
        if target is not None:
            model = model.to(target)
        self.model = model.to(self._device).eval()
        self.tokenizer = tokenizer
        cfg = model.config
        learned = cfg.pos_embedding == "learned"
        if batch_size in (None, "", "auto") or (
            isinstance(batch_size, str) and batch_size.startswith("auto")
        ):
            batch_size = 16
        self.batch_size = _int_or_none("batch_size", batch_size)
        if max_batch_size is not None:
            self.batch_size = min(self.batch_size, _int_or_none("max_batch_size", max_batch_size))
        if self.batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        ml = _int_or_none("max_length", max_length)
        self.max_length = ml if ml is not None else (cfg.max_position if learned else 2048)
        if learned:
            self.max_length = min(self.max_length, cfg.max_position)
        if self.max_length < 2:
            raise ValueError(f"max_length: expected an int >= 2, got {max_length!r}")
        self.rolling = rolling or ("window" if learned else "state")
        if self.rolling not in ("state", "window"):
            raise ValueError(f"rolling: expected 'state' or 'window', got {rolling!r}")
        if self.rolling == "state" and learned:
            raise ValueError("rolling: 'state' needs a model without learned positions (use 'window')")
        self.truncate = learned  # only learned positions bound the context
        bos, stop = _special_ids(ckpt, tokenizer)
        pid = _int_or_none("prefix_token_id", prefix_token_id)
        if pid is None:
            pid = bos if bos is not None else (stop[0] if stop else None)
        if pid is not None and not 0 <= pid < cfg.vocab_size:
            raise ValueError(
                f"prefix_token_id: expected an id in 0 … {cfg.vocab_size - 1} (the vocabulary), got {pid}"
            )
        self.prefix_token_id = pid
        self.add_bos_token = _bool_or_none("add_bos_token", add_bos_token)
        if self.add_bos_token is None:
            self.add_bos_token = bos is not None
        if self.add_bos_token and pid is None:
            raise ValueError(
                "add_bos_token: this checkpoint declares no BOS and its tokenizer no end-of-text id; give "
                "prefix_token_id=ID"
            )
        self.stop_token_ids = [i for i in stop if 0 <= i < cfg.vocab_size]
        self.eot_token_id = self.stop_token_ids[0] if self.stop_token_ids else None
        self.max_gen_toks = _int_or_none("max_gen_toks", max_gen_toks)
        if self.max_gen_toks is None or self.max_gen_toks < 1:
            raise ValueError(f"max_gen_toks: expected a positive int, got {max_gen_toks!r}")

    def get_model_info(self) -> dict:
        """What lm-eval adds to its results' ``config`` (it asks every model that has this method):
        the parameter count and dtype, and the special ids and lengths resolved from the checkpoint
        and the model arguments (``prefix_token_id``, ``add_bos_token``, ``stop_token_ids``,
        ``max_length``, ``rolling``), so a results file says how its texts were read."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype),
            "prefix_token_id": self.prefix_token_id,
            "add_bos_token": self.add_bos_token,
            "stop_token_ids": list(self.stop_token_ids),
            "max_length": self.max_length,
            "rolling": self.rolling,
        }

    # -------------------------------------------------------------------------------- helpers
    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"mnemo-{getattr(self.tokenizer, 'kind', type(self.tokenizer).__name__)}"

    def tok_encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def _with_prefix(self, ctx: list[int]) -> list[int]:
        """``ctx`` with ``prefix_token_id`` first when the context is empty or ``add_bos_token``."""
        if self.prefix_token_id is not None and (self.add_bos_token or not ctx):
            return [self.prefix_token_id] + ctx
        return ctx

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n = len(context) - len(context.rstrip())
        if n > 0:
            continuation = context[-n:] + continuation
            context = context[:-n]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and is_greedy for token-level ``(context,
        continuation)`` pairs, batched by length with right padding."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        items = []
        for i, (ctx, cont) in enumerate(pairs):
            ctx = self._with_prefix(ctx)
            whole = ctx + cont
            n_scored = len(cont) if ctx else len(cont) - 1  # no context: the first token is not scored
            if n_scored <= 0:
                results[i] = (0.0, True)
                continue
            inp = whole[:-1]
            if self.truncate and len(inp) > self.max_length:
                inp = inp[-self.max_length :]
                n_scored = min(n_scored, len(inp))
            items.append((i, inp, whole[-n_scored:]))
        items.sort(key=lambda t: -len(t[1]))
        for start in range(0, len(items), self.batch_size):
            batch = items[start : start + self.batch_size]
            T = len(batch[0][1])
            x = torch.zeros(len(batch), T, dtype=torch.long)
            for r, (_, inp, _) in enumerate(batch):
                x[r, : len(inp)] = torch.tensor(inp)
            logits, _ = self.model(x.to(self._device))
            logp = F.log_softmax(_wide(logits), dim=-1)
            for r, (i, inp, target) in enumerate(batch):
                n = len(target)
                lp = logp[r, len(inp) - n : len(inp)]
                tgt = torch.tensor(target, device=lp.device)
                total = lp.gather(-1, tgt[:, None]).sum().item()
                greedy = bool((lp.argmax(-1) == tgt).all())
                results[i] = (total, greedy)
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------------ requests
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args[:2]) for req in requests]
        return self._score(pairs)

    @torch.no_grad()
    def _rolling_state(self, tokens: list[int]) -> float:
        if self.prefix_token_id is not None:
            tokens = [self.prefix_token_id] + tokens
        if len(tokens) < 2:
            return 0.0
        ids = torch.tensor(tokens, device=self._device)[None]
        total, state = 0.0, None
        for s in range(0, ids.shape[1] - 1, self.max_length):
            inp = ids[:, s : min(s + self.max_length, ids.shape[1] - 1)]
            tgt = ids[:, s + 1 : s + 1 + inp.shape[1]]
            logits, state = self.model(inp, state)
            total += F.log_softmax(_wide(logits), -1).gather(-1, tgt[..., None]).sum().item()
        return total

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            tokens = self.tok_encode(req.args[0])
            if self.rolling == "state":
                out.append(self._rolling_state(tokens))
                continue
            prefix = self.prefix_token_id if self.prefix_token_id is not None else -1
            # with add_bos_token each window is read after the prefix; a learned-position model's
            # inputs are cut to max_length from the left, which would drop it from every window but
            # the first: its windows are max_length - 1 tokens of the document, so that it fits
            span = self.max_length - 1 if self.add_bos_token and self.truncate else self.max_length
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(tokens, prefix, span, context_len=1)
            ]
            if windows and self.prefix_token_id is None:  # first window: nothing before token 0
                ctx, cont = windows[0]
                windows[0] = ([], ctx[1:] + cont) if ctx[:1] == [-1] else (ctx, cont)
            elif windows and self.add_bos_token:  # the first context is the prefix: _score puts it once
                windows[0] = ([], windows[0][1])
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    @torch.no_grad()
    def _generate(
        self,
        prompts: list[list[int]],
        until: list[str],
        max_gen: int,
        temperature: float,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> list[str]:
        x = torch.tensor(prompts, device=self._device)
        logits, state = self.model(x)
        rows = len(prompts)
        gen: list[list[int]] = [[] for _ in range(rows)]
        done = [False] * rows
        for step in range(max_gen):
            nxt = sample_next(_wide(logits[:, -1]), temperature, top_k, None, top_p)
            for r in range(rows):
                if done[r]:
                    continue
                t = int(nxt[r])
                if t in self.stop_token_ids:
                    done[r] = True
                    continue
                gen[r].append(t)
                if until and any(u in self.tok_decode(gen[r]) for u in until):
                    done[r] = True
            if all(done) or step == max_gen - 1:
                break
            if self.truncate and state[0].offset + 1 > self.model.config.max_position:
                break
            logits, state = self.model(nxt[:, None], state)
        texts = []
        for r in range(rows):
            text = self.tok_decode(gen[r])
            for u in until:
                if u:
                    text = text.split(u)[0]
            texts.append(text)
        return texts

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[tuple[int, list[int]]]] = {}
        for i, req in enumerate(requests):
            context, kw = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kw.pop("until", None)
            until = [u for u in ([until] if isinstance(until, str) else list(until or [])) if u]
            max_gen = kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0) or 0.0) if do_sample else 0.0
            top_k, top_p = kw.pop("top_k", None), kw.pop("top_p", None)
            top_k = int(top_k) if do_sample and top_k else None  # (0 / None: every token)
            top_p = float(top_p) if do_sample and top_p is not None and 0 < float(top_p) < 1 else None
            if kw:
                log.warning("mnemo: generate_until ignores %s", sorted(kw))
            ctx = self._with_prefix(self.tok_encode(context))
            if not ctx:
                raise ValueError("generate_until: an empty context needs a prefix_token_id to start from")
            if self.truncate:
                ctx = ctx[-max(1, self.max_length - int(max_gen)) :]
            key = (len(ctx), tuple(until), int(max_gen), temperature, top_k, top_p)
            groups.setdefault(key, []).append((i, ctx))
        out: list[str | None] = [None] * len(requests)
        for (_, until, max_gen, temperature, top_k, top_p), members in sorted(
            groups.items(), key=lambda kv: -kv[0][0]
        ):
            for s in range(0, len(members), self.batch_size):
                chunk = members[s : s + self.batch_size]
                if max_gen <= 0:
                    texts = [""] * len(chunk)
                else:
                    texts = self._generate(
                        [c for _, c in chunk], list(until), max_gen, temperature, top_k, top_p
                    )
                for (i, _), text in zip(chunk, texts):
                    out[i] = text
        return out  # type: ignore[return-value]

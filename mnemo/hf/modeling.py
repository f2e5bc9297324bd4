"""mnemo checkpoints as ``transformers`` models: ``MnemoConfig`` and ``MnemoForCausalLM``.

Importing this module (``import mnemo.hf.modeling``, ``mnemo.hf.register()`` or touching
``mnemo.hf.MnemoForCausalLM``; a bare ``import mnemo.hf`` does not import ``transformers``)
registers ``model_type = "mnemo"`` with ``AutoConfig`` and ``AutoModelForCausalLM``, so a
checkpoint directory written by ``mnemo train`` (a ``ckpt-*`` directory, not the run directory) or
by ``LanguageModel.save_pretrained`` loads and generates with the usual calls::

    import mnemo.hf.modeling  # registers "mnemo" with the Auto classes
    from transformers import AutoModelForCausalLM
    from mnemo.data import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained("runs/x/ckpt-000500")
    tok = load_tokenizer("runs/x/ckpt-000500")        # mnemo's char/byte tokenizer
    ids = tok.encode("KING:")[None]                   # [1, T] long
    out = model.generate(ids, max_new_tokens=50, do_sample=False)
    print(tok.decode(out[0]))

**Tokenizer.** A mnemo char/byte tokenizer is not a ``transformers`` tokenizer: encode with
:func:`mnemo.data.load_tokenizer` and pass the ids (``AutoTokenizer`` does not load it).

**Cache.** The cache is mnemo's recurrent state: a :class:`MnemoCache` holding the list of per-layer
:class:`~mnemo.layers.state.BlockState` (``cache.states``) and the number of tokens consumed. The
forward pass takes it as ``cache=`` (``past_key_values=`` is accepted as the older name) and
returns the advanced one in ``output.cache``; :meth:`MnemoForCausalLM.prepare_inputs_for_generation`
feeds only the new tokens together with it, so decoding costs one token step per token, in
constant memory for recurrent mixers. Greedy ``generate`` equals
``LanguageModel.generate(..., temperature=0)`` (``transformers`` picks the token from the logits cast
to float32, so a float64 model's two logits closer than float32 can tell apart may pick differently).

**Padding.** A recurrent state takes in every token it is given, so pads must never reach it.
Right padding (zeros at the end of rows) is harmless for a causal model's logits, but the pads
enter the returned cache: continuing a cache whose rows took in right padding with a token for
those rows raises ``ValueError`` (``MnemoCache.padded_rows`` names them; more pads, mask 0, are
accepted: they stay at the row's end). Left padding (each row
``0 … 0 1 … 1``, what ``generate`` needs for prompts of different lengths) is handled at the
prefill: each group of equal-length prompts runs without its pads and the states join into one
batch (:meth:`mnemo.models.LanguageModel.prefill_left_padded`); this needs a model whose mixers
use no positions (Mamba, Mamba-2, (Gated) DeltaNet, GLA, linear attention — ``ValueError``
otherwise, naming the mixer). Each row then generates what its prompt alone generates. Tokens given
with a cache must not be left-padded (their pads would sit inside the rows): ``ValueError``.

Checkpoints written before ``config.json`` carried ``"model_type": "mnemo"`` load with
``MnemoForCausalLM.from_pretrained`` (not through ``AutoModelForCausalLM``, which dispatches on that
key); saving them again adds it.

**Weights.** ``from_pretrained`` loads through mnemo's own loader
(:meth:`mnemo.models.LanguageModel.from_pretrained`): the weight names are mnemo's
(``embed.weight``, ``blocks.0…``) and mixers' non-persistent buffers (rotary frequencies) are built
by their constructors. ``save_pretrained`` writes mnemo's format (``config.json`` with
``"model_type": "mnemo"`` + ``model.safetensors``), which both mnemo and ``transformers`` load.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..layers.state import BlockState, select_rows
from ..models.config import MODEL_TYPE, ModelConfig
from ..models.lm import CONFIG_NAME, LanguageModel

GENERATION_CONFIG_NAME = "generation_config.json"

__all__ = ["MnemoCache", "MnemoConfig", "MnemoForCausalLM", "register"]

_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
#: the new tokens ``transformers``' ``generate`` makes when neither ``max_new_tokens`` nor ``max_length``
#: is set anywhere (its default ``max_length``, counted after the prompt)
_DEFAULT_MAX_NEW_TOKENS = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})().get(
    "max_length", 20
)


class MnemoConfig(PretrainedConfig):
    """``transformers`` config of a mnemo model: the fields of :class:`mnemo.models.ModelConfig`
    (same names, same defaults) plus ``use_cache`` and the special token ids ``pad_token_id=None``,
    ``bos_token_id=None``, ``eos_token_id=None``. :meth:`to_model_config` gives the mnemo config;
    :meth:`from_model_config` builds one from it. ``save_pretrained`` writes mnemo's
    ``config.json`` (the model fields, ``"model_type": "mnemo"`` and the special token ids that are
    set, which ``AutoConfig`` reads; mnemo's own loaders skip them), as
    :meth:`MnemoForCausalLM.save_pretrained` does.

    ``max_position_embeddings`` (read-only, not saved): ``max_position`` with learned positions
    (``pos_embedding="learned"``), ``None`` where positions are unbounded; ``transformers``' ``generate``
    caps its default length at it, as for its own models. Setting it to another value raises
    ``ValueError`` (set ``max_position``)."""

    model_type = MODEL_TYPE

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    mixer: str = "attention"
    pattern: list | None = None
    layers: list | None = None
    mixer_options: dict = dataclasses.field(default_factory=dict)
    mlp: str = "swiglu"
    mlp_hidden: int | None = None
    mlp_options: dict = dataclasses.field(default_factory=dict)
    mlp_only_layers: list | None = None
    pos_embedding: str = "none"
    max_position: int = 4096
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def max_position_embeddings(self) -> int | None:
        return self.max_position if self.pos_embedding == "learned" else None

    @max_position_embeddings.setter
    def max_position_embeddings(self, value) -> None:
        # derived from pos_embedding and max_position; a config dict that carries it (written by
        # transformers' to_dict elsewhere) loads when it agrees
        if value != self.max_position_embeddings:
            raise ValueError(
                f"max_position_embeddings: derived from pos_embedding={self.pos_embedding!r} and "
                f"max_position={self.max_position} (expected {self.max_position_embeddings}), got {value!r}; "
                "set max_position (and pos_embedding) instead"
            )

    def to_model_config(self) -> ModelConfig:
        """The mnemo :class:`~mnemo.models.ModelConfig` (validated: ``ValueError`` names a bad field)."""
        return ModelConfig.from_dict({name: getattr(self, name) for name in _MODEL_FIELDS})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> MnemoConfig:
        return cls(**config.to_dict(), **kwargs)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        if push_to_hub:
            raise NotImplementedError("MnemoConfig.save_pretrained: push_to_hub is not supported")
        d = Path(save_directory)
        d.mkdir(parents=True, exist_ok=True)
        self.to_model_config().save(d / CONFIG_NAME)
        _write_token_ids(d, self)


def _write_token_ids(folder: Path, config) -> None:
    """Add ``config``'s special token ids that are set to ``folder``'s mnemo ``config.json`` (where
    ``transformers``' ``AutoConfig`` reads them; :meth:`ModelConfig.from_dict` skips them)."""
    from .convert import TOKEN_ID_FIELDS

    ids = {k: getattr(config, k, None) for k in TOKEN_ID_FIELDS}
    ids = {k: v for k, v in ids.items() if v is not None}
    if ids:
        f = Path(folder) / CONFIG_NAME
        f.write_text(json.dumps({**json.loads(f.read_text()), **ids}, indent=2))


class MnemoCache:
    """mnemo's recurrent state as a ``transformers`` generation cache.

    ``states``: the list of per-layer :class:`~mnemo.layers.state.BlockState` that
    :class:`~mnemo.models.LanguageModel` takes and returns; ``seen_tokens``: tokens consumed. It is
    a sequence of the per-layer states (``len``, indexing, iteration), and a plain list of them is
    accepted wherever a cache is."""

    is_compileable = False

    def __init__(self, states: list, seen_tokens: int, padded_rows: list[int] | None = None):
        self.states = list(states)
        self.seen_tokens = int(seen_tokens)
        #: rows whose state took in right padding (a forward with pads at the end of these rows): a
        #: state cannot leave them out later, so giving these rows a token (not a pad) is refused
        self.padded_rows = list(padded_rows or [])

    @classmethod
    def wrap(cls, cache) -> MnemoCache | None:
        """``cache`` as a :class:`MnemoCache`: ``None``, a cache, or a list of per-layer states."""
        if cache is None or isinstance(cache, MnemoCache):
            return cache
        if isinstance(cache, (list, tuple)):
            states = list(cache)
            # (an entry that is not a BlockState: LanguageModel.forward names it)
            return cls(states, states[0].offset if states and isinstance(states[0], BlockState) else 0)
        raise TypeError(
            f"cache: expected a MnemoCache or a list of mnemo per-layer states, got {type(cache).__name__}"
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    @property
    def is_linear(self) -> list[bool]:
        # ``transformers`` slices the prompt by get_seq_length() only when some layer is not
        # "linear"; mnemo's cache always knows how many tokens it consumed, so always slice.
        return [False] * len(self.states)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the batch rows ``beam_idx`` (beam search)."""
        self.states = select_rows(self.states, beam_idx)
        if self.padded_rows:
            kept = [i for i, r in enumerate(beam_idx.tolist()) if r in self.padded_rows]
            self.padded_rows = kept

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __repr__(self) -> str:
        return f"MnemoCache(layers={len(self.states)}, seen_tokens={self.seen_tokens})"


def _check_mask(mask: torch.Tensor | None, input_ids: torch.Tensor, cache: MnemoCache | None) -> None:
    """``attention_mask``: ``None`` or ``[B, T]`` for the ids ``[B, T]`` — with a cache, ``[B, S + T]``
    (``S`` the tokens it consumed, as ``generate`` passes it) or ``[B, T]``. A mask of another rank
    (1-D, or transformers' 4-D ``[B, 1, T, S]``) or shape cannot say which tokens are pads of which
    row: ``ValueError`` naming the expected and the received shape."""
    if mask is None:
        return
    B, T = input_ids.shape[:2]
    widths = (T,) if cache is None else (T, cache.seen_tokens + T)
    if mask.ndim != 2 or mask.shape[0] != B or mask.shape[1] not in widths:
        with_cache = f" (or [B, S + T] = [{B}, {widths[-1]}] with the cache)" if cache is not None else ""
        raise ValueError(
            f"attention_mask: expected [B, T] = [{B}, {T}]{with_cache}, 1 = token and 0 = padding, one row "
            f"per row of input_ids; got {list(mask.shape)}"
        )


def _padding(mask: torch.Tensor | None) -> str:
    """``"none"``, ``"right"`` (zeros only at the end of rows: a causal model never sees them) or
    ``"left"`` (each row ``0 … 0 1 … 1``); ``ValueError`` for anything else."""
    if mask is None or mask.ndim != 2:
        return "none"
    m = mask.bool()
    if bool(m.all()):
        return "none"
    after_pad = m.long().flip(-1).cummax(-1).values.flip(-1).bool()  # a 1 at or after each position
    if not bool((after_pad & ~m).any()):
        return "right"
    before = m.long().cummax(-1).values.bool()  # a 1 at or before each position
    if not bool((before & ~m).any()) and bool(m[:, -1].all()):
        return "left"
    raise ValueError(
        "attention_mask: padding must be at the left of every row (0 … 0 1 … 1) or at the right end; "
        "mnemo models carry a state through every token, so a pad inside a row would enter it"
    )


class MnemoForCausalLM(PreTrainedModel, GenerationMixin):
    """A mnemo :class:`~mnemo.models.LanguageModel` (``self.model``) as a ``transformers`` causal LM.

    ``forward(input_ids [B, T], attention_mask=None, cache=None, labels=None, use_cache=None,
    logits_to_keep=0)`` returns ``CausalLMOutputWithPast(loss, logits [B, T, vocab], cache)``
    (``logits_to_keep``: the positions whose logits come back, as ``transformers`` slices them — an int
    ``n`` the last ``n``, ``0`` all, a tensor positions (a 0-d one: one position, logits ``[B, V]``) or a
    bool mask ``[T]`` (the same positions of every row) or ``[B, T]`` (flattened); the loss still
    covers every labelled position); ``labels`` are shifted inside (the ``transformers`` convention,
    ``-100`` ignored; the loss is their mean, or their sum
    over ``num_items_in_batch`` when given, as ``transformers.Trainer`` does with gradient
    accumulation). See the module docstring for the cache, padding and loading rules.
    """

    config_class = MnemoConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False

    def __init__(self, config: MnemoConfig, model: LanguageModel | None = None):
        if model is not None:  # the config must describe the wrapped model (model.config carries it)
            want, got = model.config.to_dict(), config.to_model_config().to_dict()
            differ = [
                f"{k} (expected {want[k]!r}, got {got.get(k)!r})" for k in want if got.get(k) != want[k]
            ]
            if differ:
                raise ValueError(
                    "config: differs from the wrapped model's config (model.config) in "
                    + ", ".join(differ)
                    + "; pass MnemoConfig.from_model_config(model.config)"
                )
        super().__init__(config)
        self.model = model if model is not None else LanguageModel(config.to_model_config())
        self.post_init()
        # the generation config transformers derived from the config: save_pretrained writes one
        # only where it says more (a later change of the config, e.g. use_cache, is not one); special
        # token ids the config gave (MnemoConfig(pad_token_id=...)) count as more, as mnemo's config.json
        # does not hold them: generation_config.json keeps them
        from .convert import TOKEN_ID_FIELDS

        self._derived_generation = {
            k: v for k, v in _generation_fields(self.generation_config).items() if k not in TOKEN_ID_FIELDS
        }
        # the special ids from_pretrained took from hf_config_carried.json or a foreign config.json
        self._source_ids: dict[str, Any] = {}
        # the hf_config_carried.json of the converted folder from_pretrained read (save_pretrained
        # writes it again)
        self._carried_record: dict | None = None

    def _init_weights(self, module) -> None:
        """A no-op: :class:`~mnemo.models.LanguageModel` initialises its own parameters (mnemo's
        init, with each mixer's special gates), and pretrained weights are loaded over them."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is mnemo's state, returned by forward (no DynamicCache)

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        """Replace the embedding (``resize_token_embeddings``): the vocabulary size of ``config`` and of
        ``model.config`` becomes its row count, and a tied head (``tie_embeddings``) shares its weight."""
        self.model.embed = value
        n = value.weight.shape[0]
        if self.model.config.tie_embeddings:
            self.model.lm_head.weight = value.weight
            self.model.lm_head.out_features = n
        self._set_vocab_size(n)

    def set_output_embeddings(self, value: torch.nn.Linear) -> None:
        """Replace the output head (``resize_token_embeddings`` of an untied model)."""
        self.model.lm_head = value
        self._set_vocab_size(value.weight.shape[0])

    def _set_vocab_size(self, n: int) -> None:
        self.model.config = dataclasses.replace(self.model.config, vocab_size=n)
        self.config.vocab_size = n

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: MnemoCache | list | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: MnemoCache | list | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ):
        if kwargs.get("num_logits_to_keep") is not None:  # (the name before transformers 4.50)
            if not (logits_to_keep is None or isinstance(logits_to_keep, int) and logits_to_keep == 0):
                raise ValueError("pass logits_to_keep= or num_logits_to_keep=, not both")
            logits_to_keep = kwargs["num_logits_to_keep"]
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: not supported by mnemo models; pass input_ids")
        if input_ids is None:
            raise ValueError("input_ids: required")
        for k in ("output_hidden_states", "output_attentions"):  # would come back as None, silently
            # (not given: the config's, as transformers' models read it)
            v, src = (kwargs[k], "") if kwargs.get(k) is not None else (getattr(self.config, k, None), None)
            if v:
                got = f"{v!r}" if src is not None else f"config.{k} = {v!r}"
                raise ValueError(
                    f"{k}: not supported by MnemoForCausalLM (expected None or False, got {got}); "
                    "read the residual stream with LanguageModel.run_with_cache (model.model)"
                )
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the state as cache= or as past_key_values=, not both")
        cache = MnemoCache.wrap(cache if cache is not None else past_key_values)
        _check_mask(attention_mask, input_ids, cache)
        if cache is not None and cache.padded_rows:  # refused where a token would follow the pads
            # (a row that takes in only pads again, e.g. a finished one masked out, keeps them at its end)
            new_mask = attention_mask[:, -input_ids.shape[1] :] if attention_mask is not None else None
            rows = [
                r
                for r in cache.padded_rows
                if new_mask is None or r >= len(new_mask) or bool(new_mask[r].bool().any())
            ]
            if rows:
                raise ValueError(
                    f"cache: rows {rows} of this cache took in right padding (the attention_mask of the "
                    "call that made it had zeros at their end); a recurrent state cannot leave those "
                    "pads out, so they would sit inside the rows: left-pad the prompts instead"
                )
        padding = _padding(attention_mask)
        if (
            cache is not None
            and padding != "none"
            and _padding(attention_mask[:, -input_ids.shape[1] :]) == "left"
        ):
            raise ValueError(
                "attention_mask: with a cache, the new tokens must not be left-padded (0 … 0 1 … 1): the "
                "cache already holds tokens of every row, so these pads would sit inside the rows and "
                "enter the state; left-pad the prompts of the first call (without a cache) instead"
            )
        if padding == "left" and cache is None:  # prefill without the pads (they never enter a state)
            logits, state = self.model.prefill_left_padded(input_ids, attention_mask)
        else:  # with a cache, the pads were left out when it was built: new tokens only
            logits, state = self.model(input_ids, cache.states if cache is not None else None)
        loss = None
        if labels is not None:
            # transformers' causal-LM loss: the mean over the labelled tokens, or their sum over
            # ``num_items_in_batch`` when the Trainer passes it (with gradient accumulation it does
            # not divide the loss by the number of steps then: it counts on the model to)
            n_items = kwargs.get("num_items_in_batch")
            # (float32 for bf16/fp16 logits, float64 kept for a float64 model, as mnemo's own losses)
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                labels[:, 1:].flatten().to(logits.device),
                ignore_index=-100,
                reduction="mean" if n_items is None else "sum",
            )
            if n_items is not None:
                loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
        logits = _keep_logits(logits, logits_to_keep)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        seen = (cache.seen_tokens if cache is not None else 0) + input_ids.shape[1]
        padded = set(cache.padded_rows) if cache is not None else set()  # (those taking only pads)
        if padding == "right":  # the new tokens' pads
            padded |= set(
                (~attention_mask[:, -input_ids.shape[1] :].bool()).any(-1).nonzero().flatten().tolist()
            )
        padded = sorted(padded)
        out = CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=MnemoCache(state, seen, padded) if use_cache else None
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return out if return_dict else out.to_tuple()

    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """``transformers``' ``generate``. With learned positions (``pos_embedding="learned"``) the length
        follows ``transformers``' rules for its own models: without ``max_new_tokens`` or ``max_length``
        (the argument, else the given generation config's, else the model's) it makes its default 20 new
        tokens, capped so that prompt and new tokens fit ``config.max_position_embeddings``
        (``max_position``). A prompt longer than ``max_position``, a ``max_new_tokens`` or ``max_length``
        that runs past it, or a default length that leaves no new token (a prompt of ``max_position``
        tokens) raises ``ValueError`` before any work, naming the argument that was set and the lengths
        (the last new token is returned, not read: ``max_length`` may reach ``max_position + 1``)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if self.model.pos_embed is not None and torch.is_tensor(ids) and ids.ndim == 2:
            configs = (kwargs.get("generation_config"), self.generation_config)

            def setting(key):  # as transformers merges them: the argument, else the given generation
                # config's, else the model's (it fills a given config's unset fields from it)
                if key in kwargs:
                    return kwargs[key]
                return next((v for g in configs if (v := getattr(g, key, None)) is not None), None)

            L, P = ids.shape[1], self.model.config.max_position
            self.model._check_positions(L, 1)  # the prompt itself (named input_ids)
            new, length = setting("max_new_tokens"), setting("max_length")
            if new is not None:  # transformers: max_new_tokens takes precedence over max_length
                self.model._check_positions(L, new if isinstance(new, int) and new > 0 else 1)
            elif isinstance(length, int):
                if length - 1 > P:
                    raise ValueError(
                        f"max_length: {length} tokens (a prompt of {L} and {length - L} new ones) read "
                        f"{length - 1} positions, but the learned positions cover max_position = {P}: "
                        f"max_length at most {P + 1}, or set max_new_tokens (at most {P - L + 1})"
                    )
            elif min(L + _DEFAULT_MAX_NEW_TOKENS, P) <= L:  # transformers' default, capped (none left)
                raise ValueError(
                    f"input_ids: a prompt of {L} tokens fills the learned positions (max_position = {P}), "
                    f"so the default length (capped at max_position_embeddings = {P}, as transformers "
                    "does) leaves no new token; set max_new_tokens=1 (the last new token is not read)"
                )
        return super().generate(inputs, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: MnemoCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        past_key_values: MnemoCache | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """With a cache, only the tokens it has not consumed (one per decoding step) go in."""
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: not supported by mnemo models; pass input_ids")
        cache = MnemoCache.wrap(cache if cache is not None else past_key_values)
        if cache is not None:
            if next_sequence_length is not None:
                input_ids = input_ids[:, -next_sequence_length:]
            elif input_ids.shape[1] > cache.seen_tokens:
                input_ids = input_ids[:, cache.seen_tokens :]
        inputs = {"input_ids": input_ids.contiguous(), "cache": cache, "attention_mask": attention_mask}
        if kwargs.get("logits_to_keep") is not None:  # (generate sets 1: only the next token's logits)
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        if use_cache is not None:
            inputs["use_cache"] = use_cache
        for k in ("output_hidden_states", "output_attentions"):  # asked for: forward refuses by name
            if kwargs.get(k):
                inputs[k] = kwargs[k]
        return inputs

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        config: MnemoConfig | None = None,
        dtype=None,
        torch_dtype=None,
        device_map=None,
        **kwargs,
    ) -> MnemoForCausalLM:
        """Load a mnemo checkpoint directory (or a Hub repository holding one) with mnemo's loader.

        ``dtype`` (or ``torch_dtype``): a ``torch.dtype`` or its name to cast to; ``"auto"`` / ``None``
        (``transformers``' default) load in the dtype the weights are stored in (that of most of
        ``model.safetensors``' floating elements: float32 for a training run's checkpoint, float64 or bfloat16
        for a model saved in that dtype; float32 for another library's folder, converted in memory,
        or float64 when stored in float64: :meth:`mnemo.models.LanguageModel.from_pretrained`);
        ``device_map``: a device (``"cpu"``, ``"cuda:0"``) or ``"auto"`` (CUDA when available).
        Hub options (``revision``, ``cache_dir``, ``local_files_only``, ``token``, ``subfolder``)
        apply to a repository id; other ``transformers`` loading options are ignored; the special
        token ids ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` set the config's and
        ``generation_config``'s (as ``transformers`` does; :meth:`save_pretrained` keeps them in
        ``generation_config.json`` and ``config.json``); remaining keyword arguments set attributes of
        the config (``use_cache=False``; an unknown one: ``TypeError`` naming it; a given ``config`` is copied
        first, as ``transformers`` does: the caller's object is left as it is); a model field
        (``norm_eps``, ``tie_embeddings``…) given there or in ``config`` that differs from the checkpoint's
        raises ``ValueError`` naming it (the weights are loaded into the model the checkpoint describes).
        A ``generation_config.json`` in the folder (a converted checkpoint carries its source's)
        becomes ``generation_config`` (end-of-text ids, default lengths), as ``transformers``
        loads it for its own models; without one, the special token ids a converted checkpoint kept
        from its source's ``config.json`` (``hf_config_carried.json``) set them, as ``transformers``
        derives them from that config (a foreign folder loaded directly: its own ``config.json``'s;
        a folder of mnemo's own: those :meth:`save_pretrained` wrote to its ``config.json``);
        a folder of mnemo's own where none of them gives an eos gets the end-of-text token of its
        Hugging Face tokenizer (a BPE run's ``<|endoftext|>``) as ``eos_token_id``, the id
        :func:`~mnemo.hf.convert.export_hf` writes for it, so it generates as its export does.
        :meth:`save_pretrained` writes the ``hf_config_carried.json`` read here again.
        The config's special ids that it leaves ``None`` are the source ``config.json``'s (those
        ``hf_config_carried.json`` kept, or a foreign folder's own, or the ids mnemo's own
        ``config.json`` holds), else those of its ``generation_config.json``: ids given to
        ``from_pretrained`` survive :meth:`save_pretrained` and a reload, config included (an id set
        on ``config`` alone is saved in ``config.json``, which ``AutoConfig`` reads too).
        """
        if model_args:
            raise TypeError("MnemoForCausalLM.from_pretrained takes no positional model arguments")
        path = Path(pretrained_model_name_or_path)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            hub = {
                k: kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token") if k in kwargs
            }
            path = Path(snapshot_download(str(pretrained_model_name_or_path), **hub))
        if kwargs.get("subfolder"):
            path = path / kwargs["subfolder"]
        ignored = {
            "_from_auto", "trust_remote_code", "adapter_kwargs", "revision", "cache_dir", "force_download",
            "local_files_only", "proxies", "token", "subfolder", "code_revision", "_commit_hash",
            "low_cpu_mem_usage", "use_safetensors", "attn_implementation", "weights_only", "key_mapping",
        }  # fmt: skip
        dtype = dtype if dtype is not None else torch_dtype
        # None / "auto" (transformers' default): the dtype the weights are stored in, as transformers
        lm = LanguageModel.from_pretrained(path, map_location="cpu", dtype=dtype)
        if config is None:
            config = MnemoConfig.from_model_config(lm.config)
        else:  # (as transformers: the caller's object is not changed, e.g. reused for another folder)
            config = copy.deepcopy(config)
        from .convert import TOKEN_ID_FIELDS

        token_ids = {k: kwargs[k] for k in TOKEN_ID_FIELDS if k in kwargs}  # set after the model is built
        for k, v in token_ids.items():
            _check_token_id(k, v, lm.config.vocab_size)
        for k, v in kwargs.items():
            if k in ignored or k in token_ids:
                continue
            if not hasattr(config, k):
                raise TypeError(
                    f"MnemoForCausalLM.from_pretrained: unexpected argument {k!r} (expected a field of "
                    f"MnemoConfig, a special token id ({', '.join(TOKEN_ID_FIELDS)}) or a loading option)"
                )
            setattr(config, k, v)
        # the model is the one the checkpoint describes: a config (or an argument) that says another
        # model field would be carried by model.config while the weights compute the checkpoint's
        want, got = lm.config.to_dict(), config.to_model_config().to_dict()
        try:  # config.json as written (the loader may complete it, e.g. an old retnet width)
            written = ModelConfig.load(path / CONFIG_NAME).to_dict()
        except Exception:  # another library's config: converted in memory
            written = {}
        for k in (k for k in want if got.get(k) != want[k]):
            if k in written and got.get(k) == written[k]:  # what config.json says: the model it loads
                setattr(config, k, want[k])
                continue
            given = f"the argument {k}=" if k in kwargs else f"config.{k} = "
            raise ValueError(
                f"{k}: {given}{got.get(k)!r} differs from the checkpoint's config.json ({want[k]!r}); "
                "MnemoForCausalLM.from_pretrained loads the model its checkpoint describes: change "
                "config.json, or build LanguageModel(config) and load the weights into it"
            )
        config.name_or_path = str(pretrained_model_name_or_path)
        model = cls(config, model=lm)
        from .convert import CARRIED_CONFIG_NAME, MNEMO_MODEL_TYPE

        def read(name):
            f = path / name
            try:
                data = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
            except (OSError, ValueError) as e:  # (as mnemo generate and export_hf name it)
                raise ValueError(f"corrupt file {f}: not JSON ({e})") from None
            return data if isinstance(data, dict) else {}

        # the special ids of the source's config.json: those a converted checkpoint kept from it, or a
        # foreign folder's own config.json's
        if (path / CARRIED_CONFIG_NAME).is_file():
            carried = read(CARRIED_CONFIG_NAME)
            fields = carried.get("fields") or {}
            fields = fields if isinstance(fields, dict) else {}
            foreign, mine = True, False
            model._carried_record = carried  # (save_pretrained writes it again: export_hf reads it)
        else:
            own = read(CONFIG_NAME)
            mine = own.get("model_type", MNEMO_MODEL_TYPE) == MNEMO_MODEL_TYPE
            # (mnemo's config.json: the ids save_pretrained wrote there, if any)
            fields = {k: own[k] for k in TOKEN_ID_FIELDS if own.get(k) is not None} if mine else own
            if mine and "eos_token_id" not in fields and not (path / GENERATION_CONFIG_NAME).is_file():
                # a folder of mnemo's own that declares no eos: the end-of-text token of its Hugging
                # Face tokenizer (a BPE run's <|endoftext|>), the eos_token_id export_hf writes for it
                from .convert import _eos_token_id

                eot = _eos_token_id(path)
                if eot is not None and eot < lm.config.vocab_size:
                    fields = {**fields, "eos_token_id": eot}
            foreign = not mine or bool(fields)
        if (path / GENERATION_CONFIG_NAME).is_file():  # as transformers' own loader reads it
            model.generation_config = GenerationConfig.from_pretrained(path)
        else:  # none: the source's special ids (transformers derives its generation config from them
            # for the source class)
            for k in TOKEN_ID_FIELDS:
                if fields.get(k) is not None:
                    setattr(model.generation_config, k, fields[k])
                    model._source_ids[k] = fields[k]  # (mnemo's config.json does not hold them)
            # (derived too, but for special ids the config gave: generation_config.json keeps those, as
            # for MnemoForCausalLM(config))
            model._derived_generation = {
                k: v
                for k, v in _generation_fields(model.generation_config).items()
                if k not in TOKEN_ID_FIELDS or k in model._source_ids
            }
        # the config's special ids that it leaves None (AutoModelForCausalLM passes the config it read
        # from config.json), which a transformers config.json holds: the source's; for mnemo's own folder
        # (its config.json holds none, or some: the others) those save_pretrained kept in
        # generation_config.json
        for k in TOKEN_ID_FIELDS:
            v = fields.get(k) if foreign else None
            if v is None and mine:
                v = getattr(model.generation_config, k, None)
            if v is not None and getattr(config, k, None) is None:
                setattr(config, k, v)
        for k, v in token_ids.items():  # as transformers: the config's and the generation config's id
            # (after _derived_generation: save_pretrained writes them to generation_config.json, as
            # mnemo's config.json does not hold them)
            setattr(config, k, v)
            setattr(model.generation_config, k, v)
        if device_map is not None:
            if device_map == "auto":
                device_map = "cuda" if torch.cuda.is_available() else "cpu"
            if isinstance(device_map, dict):
                raise ValueError("device_map: mnemo models load onto one device; pass a device name")
            model = model.to(device_map)
        model.eval()
        return model

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Write mnemo's checkpoint format (``config.json`` + ``model.safetensors``), which
        :meth:`from_pretrained`, ``AutoModelForCausalLM`` and mnemo itself load, and
        ``generation_config.json`` where ``generation_config`` says more than the model config, or
        holds special ids that :meth:`from_pretrained` took from a converted folder's
        ``hf_config_carried.json`` (or a foreign ``config.json``) and ``save_directory`` would not
        give back. ``is_main_process=False`` writes nothing (as ``transformers``: ``Trainer``'s other
        ranks); ``state_dict`` must be the model's own (else ``NotImplementedError``); other
        ``transformers`` saving options are ignored."""
        if kwargs.get("push_to_hub"):
            raise NotImplementedError("MnemoForCausalLM.save_pretrained: push_to_hub is not supported")
        if kwargs.get("state_dict") is not None:
            self._check_state_dict(kwargs["state_dict"])
        if not kwargs.get("is_main_process", True):  # (transformers.Trainer's other ranks: as transformers,
            return  # only the main process writes)
        self.model.save_pretrained(save_directory)
        _write_token_ids(Path(save_directory), self.config)  # (for AutoConfig: mnemo's loaders skip them)
        if self._carried_record is not None:  # a converted folder's source fields, which export_hf
            # writes back (special ids, residual_in_fp32): kept through a save -> reload -> save, its
            # special ids the config's now (an id given to from_pretrained or set on the config since:
            # from_pretrained and export_hf read them from this record, AutoConfig from config.json)
            from .convert import CARRIED_CONFIG_NAME, TOKEN_ID_FIELDS

            record = dict(self._carried_record)
            fields = dict(record["fields"]) if isinstance(record.get("fields"), dict) else {}
            for k in TOKEN_ID_FIELDS:
                v = getattr(self.config, k, None)
                if v is not None or k in fields:  # (one the source left out stays out while unset)
                    fields[k] = list(v) if isinstance(v, (list, tuple)) else v
            record["fields"] = fields
            Path(save_directory, CARRIED_CONFIG_NAME).write_text(
                json.dumps(record, indent=2) + "\n", encoding="utf-8"
            )
        # written only where it says more than the config, or where the folder would not give back
        # the special ids taken from the source (saved elsewhere than the converted folder)
        if self._generation_config_is_set() or not self._source_ids_kept(save_directory):
            self.generation_config.save_pretrained(save_directory)

    def _check_state_dict(self, state_dict: dict) -> None:
        """``state_dict`` given to :meth:`save_pretrained` (``transformers.Trainer`` passes one): mnemo's
        format is written from the model itself, so it must hold the model's own weights (keys as
        :meth:`state_dict` names them, a ``torch.compile`` / DDP wrapper's ``_orig_mod.`` / ``module.``
        prefix allowed); ``NotImplementedError`` naming the keys otherwise (another state dict, e.g.
        FSDP's gathered one, would be silently replaced by the model's)."""
        own = self.state_dict()
        given = {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in state_dict.items()}

        def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # (a NaN weight equals itself: the model's own)
            a = a.to(b)
            return torch.equal(a, b) or (
                b.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())
            )

        differ = sorted(set(own) ^ set(given)) or [
            k for k in own if given[k].shape != own[k].shape or not same(given[k], own[k])
        ]
        if differ:
            raise NotImplementedError(
                "state_dict: MnemoForCausalLM.save_pretrained writes the model's own weights; expected None "
                f"or the model's state_dict(), got one that differs in {differ[:5]}"
                + (f" (and {len(differ) - 5} more)" if len(differ) > 5 else "")
            )

    def _source_ids_kept(self, folder) -> bool:
        """Whether ``folder``'s ``hf_config_carried.json`` gives back the special ids
        :meth:`from_pretrained` took from outside ``generation_config.json`` (true when it took none)."""
        if not self._source_ids:
            return True
        from .convert import CARRIED_CONFIG_NAME

        try:
            fields = json.loads((Path(folder) / CARRIED_CONFIG_NAME).read_text(encoding="utf-8")).get(
                "fields"
            )
        except (OSError, ValueError, AttributeError):
            return False
        return isinstance(fields, dict) and all(fields.get(k) == v for k, v in self._source_ids.items())

    def _generation_config_is_set(self) -> bool:
        """Whether ``generation_config`` differs from the one ``transformers`` derived from the
        model config when the model was built (a loaded ``generation_config.json``, or one the user
        changed)."""
        return _generation_fields(self.generation_config) != self._derived_generation


def _keep_logits(logits: torch.Tensor, keep) -> torch.Tensor:
    """The logits ``[B, T, V]`` that ``logits_to_keep`` asks for, as ``transformers``' causal LMs slice
    them (its ``slice_logits_to_keep``): an int ``n`` the last ``n`` positions (``0``, or ``None``, all);
    a 0-d integer tensor the index of one position (the positions axis goes: ``[B, V]``); a 1-D
    integer tensor those positions of every row; a 2-D integer tensor ``[B, N]`` positions per row;
    a 1-D bool tensor ``[T]`` a mask of the positions kept in every row (``[B, kept, V]``); a 2-D bool
    tensor ``[B, T]`` a mask of the positions kept, flattened to ``[kept, V]``. A float tensor, a 0-d
    bool one, a bool mask of another shape or a tensor of another rank raises ``ValueError``."""
    if torch.is_tensor(keep):
        if (
            keep.is_floating_point()
            or keep.is_complex()
            or keep.ndim > 2
            or (keep.ndim == 0 and keep.dtype == torch.bool)
        ):
            raise ValueError(
                "logits_to_keep: expected an int >= 0 or an integer tensor of positions (0-d, 1-D or "
                f"[B, N]) or a bool mask ([T] or [B, T]), got a {keep.ndim}-D {keep.dtype} tensor"
            )
        if keep.dtype == torch.bool and tuple(keep.shape) != tuple(logits.shape[2 - keep.ndim : 2]):
            want = "[T]" if keep.ndim == 1 else "[B, T]"
            raise ValueError(
                f"logits_to_keep: a bool mask must be {want} = {list(logits.shape[2 - keep.ndim : 2])} "
                f"(one entry per position of input_ids), got {list(keep.shape)}"
            )
        keep = keep.to(logits.device)
        if keep.ndim == 2 and keep.dtype == torch.bool:
            return logits[keep]
        if keep.ndim == 2:
            return torch.take_along_dim(logits, keep[..., None], dim=1)
        return logits[:, keep]
    if keep is None:  # (as 0: every position)
        return logits
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise ValueError(
            f"logits_to_keep: expected an int >= 0 (0 = all positions) or a tensor, got {keep!r}"
        )
    return logits if keep == 0 else logits[:, -keep:]


def _check_token_id(name: str, v, vocab_size: int) -> None:
    """A special token id given to :meth:`MnemoForCausalLM.from_pretrained`: ``None`` or an int in
    ``0 .. vocab_size - 1`` (``eos_token_id`` also a list of them); ``ValueError`` naming it otherwise."""
    many = name == "eos_token_id" and isinstance(v, (list, tuple)) and len(v) > 0
    for x in v if many else [v]:
        if x is None and not many:
            continue
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < vocab_size:
            kinds = "an int, a list of ints or None" if name == "eos_token_id" else "an int or None"
            raise ValueError(
                f"{name}: expected a token id ({kinds}) in 0 .. {vocab_size - 1} (the vocabulary), got {v!r}"
            )


def _generation_fields(g: GenerationConfig | None) -> dict:
    """``g``'s settings that differ from the defaults, without its bookkeeping fields."""
    skip = {"transformers_version", "_from_model_config"}
    return {} if g is None else {k: v for k, v in g.to_diff_dict().items() if k not in skip}


def register() -> None:
    """Register ``model_type = "mnemo"`` with ``AutoConfig`` and ``AutoModelForCausalLM`` (done on
    import; calling it again is harmless)."""
    AutoConfig.register(MODEL_TYPE, MnemoConfig, exist_ok=True)
    AutoModelForCausalLM.register(MnemoConfig, MnemoForCausalLM, exist_ok=True)


register()

"""Where a training step's rows come from and the forward they run through: a task's fixed
training set (:func:`fixed_train_set`, read in order by :func:`fixed_batch`), packed documents
(:func:`packed_logits`: one row with ``cu_seqlens``) and the training forward module the
parallelism strategies wrap (:class:`_Logits`). Shapes: ``[B, T]`` token ids, ``[B, T, vocab]``
logits. :class:`RunData` holds a run's data: the task or the text corpus with its tokenizer and
train/validation streams, and draws each step's global batch. :class:`CarriedStreams` reads a
text corpus as ``B`` parallel streams of consecutive windows (``TrainConfig.carry_state``:
truncated back-propagation through time).

Extension point: a new data source is a ``TrainConfig.task`` (a registered task generator,
:mod:`mnemo.data.tasks`) or a corpus format of :func:`mnemo.data.load_corpus`; the trainer only
calls :meth:`RunData.next_batch`."""

from __future__ import annotations

import hashlib
import warnings

import torch

from ..data import build_tokenizer, load_corpus
from ..data.tasks import IGNORE_INDEX, make_generator
from ..data.tokenizer import load_tokenizer
from ..models import LanguageModel
from .config import TrainConfig
from .memory_estimate import check_sequences_memory


class _Logits(torch.nn.Module):
    """The training forward: ``input_ids -> logits``. DDP wraps this rather than the model, since
    the per-layer states the model also returns depend on parameters the loss may not (e.g. CMS
    levels), and DDP would wait for their gradients."""

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        first: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """Logits, or with ``targets`` (not with ``first``) the summed cross-entropy (0-d float32;
        float64 for a float64 model) computed without them (:meth:`LanguageModel.forward`'s ``targets``)."""
        if targets is not None:
            if first is not None:
                raise ValueError("targets: not with first (packed documents return their logits)")
            return self.model(input_ids, targets=targets, ignore_index=ignore_index)[0]
        if first is None:
            return self.model(input_ids, logits_at=logits_at)[0]
        return packed_logits(self.model, input_ids, first)


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy (0-d; float32, float64 for float64 ``logits``) of ``logits``
    ``[..., vocab]`` against ``targets`` ``[...]``, skipping ``IGNORE_INDEX``: what :class:`_Logits`
    with ``targets`` computes without the logits."""
    logits = logits if logits.dtype == torch.float64 else logits.float()  # bf16 autocast's: float32
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def fixed_train_set(
    task, n: int, seq_len: int, seed: int, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` training sequences of ``task`` (``(input_ids, targets)``, ``[n, seq_len]`` int32),
    drawn in chunks of ``chunk`` rows (default ``chunk=4096``) from the train seed stream of ``seed``
    (the stream fresh batches come from; never the test stream): the fixed set of
    ``TrainConfig.train_examples``."""
    gen = make_generator(seed, "train")
    xs, ys = [], []
    for start in range(0, n, chunk):
        x, y = task.generate(min(chunk, n - start), seq_len, gen)
        xs.append(x.to(torch.int32))
        ys.append(y.to(torch.int32))
    return torch.cat(xs), torch.cat(ys)


def fixed_batch(train_set: tuple[torch.Tensor, torch.Tensor], step: int, batch_size: int):
    """The batch of optimizer step ``step`` (0-based) from a fixed training set: rows
    ``[i·B, (i+1)·B)`` with ``i = step mod (n // B)`` — the set read in order, epoch after epoch,
    without shuffling (a last partial batch is skipped). Returns long tensors ``[B, T]``."""
    x, y = train_set
    i = step % (x.shape[0] // batch_size)
    rows = slice(i * batch_size, (i + 1) * batch_size)
    return x[rows].long(), y[rows].long()


def packed_logits(model: LanguageModel, input_ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of windows whose documents are separate sequences: the rows are
    packed into one ``[1, B·T]`` row with ``cu_seqlens`` at every ``first`` (``[B, T]`` bool, true
    where a sequence begins; column 0 always true)."""
    B, T = input_ids.shape
    flat = first.reshape(-1).clone()
    flat[::T] = True
    cu = torch.cat([flat.nonzero()[:, 0], flat.new_tensor([B * T], dtype=torch.long)])
    logits, _ = model(input_ids.reshape(1, B * T), cu_seqlens=cu)
    return logits.reshape(B, T, -1)


class CarriedStreams:
    """A token stream ``ids`` (``[N]`` long) read as ``batch_size`` parallel streams of consecutive
    windows of ``seq_len`` tokens, for truncated back-propagation through time
    (``TrainConfig.carry_state``): the stream is cut into ``B`` contiguous shards of
    ``shard = (N − 1) // B`` tokens (row ``b`` starts at token ``b · shard``), and optimizer step
    ``k`` feeds every row the next window of its shard, window ``w = k mod windows`` with
    ``windows = shard // seq_len`` (a shard's last ``shard mod seq_len`` tokens are never read):
    inputs ``ids[b·shard + w·T : b·shard + (w+1)·T]``, targets one token later. All shards have the
    same length, so every stream reaches its end at the same step: the next step starts an *epoch*
    (``w = 0``) and every stream restarts at its shard's first token from a fresh state
    (:meth:`restarts`). The window of a step depends on the step alone (no random draws), so a
    resumed run continues where it stopped.

    Raises:
        ValueError: a shard is shorter than one window (``B · seq_len > N − 1``); the message names
            ``batch_size``, ``seq_len`` and the stream's length.
    """

    def __init__(self, ids: torch.Tensor, batch_size: int, seq_len: int):
        n = ids.numel()
        self.ids, self.batch_size, self.seq_len = ids.reshape(-1), batch_size, seq_len
        self.shard = (n - 1) // batch_size
        self.windows = self.shard // seq_len
        if self.windows < 1:
            raise ValueError(
                f"TrainConfig.carry_state: the training text ({n:,} tokens) cut into batch_size = "
                f"{batch_size} streams gives {self.shard:,} tokens per stream, fewer than one window of "
                f"seq_len = {seq_len}; expected batch_size x seq_len <= {n - 1:,} (use a longer text, a "
                "smaller --batch-size or a smaller --seq-len)"
            )
        self.starts = torch.arange(batch_size) * self.shard  # each stream's first token

    @property
    def stream_tokens(self) -> int:
        """Tokens each stream reads between two restarts (``windows · seq_len``)."""
        return self.windows * self.seq_len

    def window(self, step: int) -> int:
        """The window index (0-based, within the epoch) that optimizer step ``step`` feeds."""
        return step % self.windows

    def restarts(self, step: int) -> bool:
        """True when step ``step`` starts an epoch: every stream begins again from a fresh state."""
        return self.window(step) == 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, ``[B, seq_len]`` long: window :meth:`window` of every stream and its targets."""
        first = self.starts + self.window(step) * self.seq_len
        idx = first[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.ids[idx].long()
        return w[:, :-1], w[:, 1:]


def bos_id(tokenizer, bos: str | None) -> int | None:
    """The id of ``TrainConfig.bos`` under ``tokenizer`` (``None`` for ``None``). Raises
    ``ValueError`` naming ``bos`` when the text is not exactly one token."""
    if bos is None:
        return None
    ids = tokenizer.encode(bos)
    if ids.numel() != 1:
        raise ValueError(
            f"TrainConfig.bos (--bos): expected a text of exactly one token under this run's tokenizer, "
            f"got {bos!r} = {ids.numel()} tokens {ids.tolist()[:8]}"
        )
    return int(ids[0])


def with_bos(x: torch.Tensor, bos: int | None) -> torch.Tensor:
    """``x [B, T]`` with its first column replaced by ``bos`` (a copy; ``x`` itself when ``bos`` is
    ``None``): the windows then read ``[BOS, t_1 … t_{T−1}]`` (``TrainConfig.bos``)."""
    if bos is None:
        return x
    x = x.clone()
    x[:, 0] = bos
    return x


class RunData:
    """The data of the run ``cfg``: the task (``task``; with ``cfg.train_examples`` a fixed
    ``train_set``), or the text corpus with its ``tokenizer`` (the checkpoint ``ckpt``'s on resume,
    else built from the text) and the ``train_data`` / ``val_data`` streams (``val_chars``
    characters of validation text); with ``cfg.carry_state`` the training stream is read as
    ``streams`` (:class:`CarriedStreams`, else ``None``). ``vocab_size``: the model's vocabulary.
    ``is_main`` (default ``is_main=True``): this process alone warns."""

    def __init__(self, cfg: TrainConfig, ckpt=None, is_main: bool = True):
        self.cfg = cfg
        self.task = cfg.build_task()
        self.tokenizer = self.train_data = self.val_data = self.val_chars = None
        self.train_set = self.streams = self.bos_id = None
        if self.task is not None:
            if cfg.train_examples is not None:
                check_sequences_memory(cfg.train_examples, cfg.seq_len, "cpu", flag="--train-examples")
                self.train_set = fixed_train_set(self.task, cfg.train_examples, cfg.seq_len, cfg.seed)
            self.vocab_size = self.task.vocab_size
            return
        with warnings.catch_warnings():  # (a --data folder's unread entries: said by rank 0 alone)
            if not is_main:
                warnings.simplefilter("ignore")
            corpus = load_corpus(cfg.data, cfg.text_field)
        if ckpt is not None:
            self.tokenizer = load_tokenizer(ckpt)
        else:  # a char vocabulary is read from the text; byte and tokenizer files need none
            self.tokenizer = build_tokenizer(cfg.tokenizer, corpus.text if cfg.tokenizer == "char" else "")
        if cfg.pack_documents and len(corpus) < 2:
            # the flag promises that no state crosses a document boundary: on one document it
            # would do nothing while the run records it as on (e.g. a text file whose documents
            # are only blank-line separated): refused, as every option that nothing reads is. A
            # run saved with it before (resumed) keeps it, with a warning.
            what = (
                f"pack_documents (--pack-documents): data {cfg.data!r} is a single document (a plain text "
                "file is one document; JSONL/Parquet corpora give one document per record, a folder or "
                "glob one per file), so packing would change nothing"
            )
            if ckpt is None:
                raise ValueError(
                    f"{what}; drop --pack-documents, or give the documents as JSONL/Parquet records or "
                    "as separate files"
                )
            if is_main:
                warnings.warn(what, stacklevel=2)  # (Trainer.__init__)
        train_docs, val_docs = corpus.split()
        # documents joined by the end-of-text token (char/byte: "\n\n"); .doc_starts keeps them
        self.train_data = train_docs.stream(self.tokenizer, cfg.seq_len)
        self.val_data = val_docs.stream(self.tokenizer, cfg.seq_len)
        self.val_chars = self.val_data.num_chars
        if cfg.carry_state:
            self.streams = CarriedStreams(self.train_data.ids, cfg.batch_size, cfg.seq_len)
        self.vocab_size = self.tokenizer.vocab_size
        self.bos_id = bos_id(self.tokenizer, cfg.bos)

    def fingerprint(self) -> dict | None:
        """What a checkpoint records of a text run's tokens (``None`` for a task, whose batches follow
        from its saved settings): how many train and validation tokens, and the SHA-256 of both
        streams. A resumed run compares it with its own: the same path can hold other text by then,
        and the batches it draws would not be the uninterrupted run's."""
        if self.task is not None:
            return None
        h = hashlib.sha256()
        for stream in (self.train_data, self.val_data):
            h.update(stream.ids.contiguous().numpy())
        return {
            "train_tokens": self.train_data.ids.numel(),
            "val_tokens": self.val_data.ids.numel(),
            "sha256": h.hexdigest(),
        }

    def batch_generator(self) -> torch.Generator:
        """A fresh run's generator of the batches :meth:`next_batch` draws (its state is
        checkpointed, so resume stays exact): a task's train seed stream of ``cfg.seed`` (its test
        sets come from the disjoint test seed), else one seeded with ``cfg.seed + 1``."""
        if self.task is None:
            return torch.Generator().manual_seed(self.cfg.seed + 1)
        return make_generator(self.cfg.seed, "train")

    def next_batch(self, step: int, generator: torch.Generator):
        """The global batch of optimizer step ``step`` (0-based): ``(x, y, first)``, ``[B, T]`` long
        (``first``: where packed documents begin, else ``None``), drawn from ``generator`` (the
        run's checkpointed batch stream) unless a fixed training set is read in order or the
        corpus is read as carried streams (:class:`CarriedStreams`: the step's windows)."""
        cfg, first = self.cfg, None
        if self.streams is not None:
            x, y = self.streams.batch(step)
        elif self.task is None and cfg.pack_documents:
            x, y, first = self.train_data.sample(cfg.batch_size, generator, with_documents=True)
        elif self.task is None:
            x, y = self.train_data.sample(cfg.batch_size, generator)
            x = with_bos(x, self.bos_id)
        elif self.train_set is not None:
            x, y = fixed_batch(self.train_set, step, cfg.batch_size)
        else:
            x, y = self.task.generate(cfg.batch_size, cfg.seq_len, generator)
        return x, y, first

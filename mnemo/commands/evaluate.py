"""``mnemo eval`` and ``mnemo generate``: a checkpoint's validation loss (text), accuracy per length
(tasks), YaRN at evaluation time, and sampled text."""

from __future__ import annotations

import shlex
import sys
import warnings

from .. import argtypes as kinds
from .train import _parse_lengths, _same_data

#: ``mnemo generate --max-new-tokens``'s bound: ~an hour of one-token steps on a laptop CPU
MAX_NEW_TOKENS = 1_000_000


def refuse_task_checkpoint(ckpt, why: str) -> None:
    """``ValueError`` for a checkpoint trained on a synthetic task (its tokens are ids, no text
    tokenizer) given to a command that reads or writes text; ``why`` says what the command does."""
    from ..train.checkpoint import TRAIN_CONFIG_NAME, load_json

    task = load_json(ckpt / TRAIN_CONFIG_NAME).get("task") if (ckpt / TRAIN_CONFIG_NAME).is_file() else None
    if task:
        raise ValueError(
            f"--checkpoint: {ckpt} was trained on the task {task!r}, whose tokens are ids, not text: {why} "
            "(evaluate a task checkpoint with `mnemo eval --checkpoint ...`)"
        )


_SAID: set[str] = set()  # warnings already printed by this process (a checkpoint is resolved twice)


def _warn(msg: str) -> None:
    if msg not in _SAID:
        _SAID.add(msg)
        print(f"warning: {msg}", file=sys.stderr)


def _refuse_sharded(ckpt, given) -> None:
    """``ValueError`` for a sharded (FSDP) checkpoint: the single-process commands read one file."""
    from ..train.sharded import is_sharded

    if is_sharded(ckpt):
        raise ValueError(
            f"--checkpoint: {ckpt} is a sharded checkpoint of `mnemo train --fsdp`; write a single-file "
            f"copy first: mnemo convert --from-dcp {shlex.quote(str(given))} OUT"
        )


def _load(checkpoint: str, device: str):
    from ..data import load_tokenizer
    from ..data.tokenizer import check_tokenizer_fits
    from ..models import LanguageModel
    from ..train import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint, warn=_warn)
    _refuse_sharded(ckpt, checkpoint)
    refuse_task_checkpoint(ckpt, "generate writes text")  # (eval sends task checkpoints elsewhere first)
    # float32 whatever the stored dtype (a bf16 or float64 folder too): ``--precision`` (eval) and
    # the JSON line's ``precision`` say how it computes (bf16 = autocast over float32 weights)
    model = LanguageModel.from_pretrained(ckpt, map_location=device, dtype="float32")
    try:
        tok = load_tokenizer(ckpt)
    except FileNotFoundError as e:  # e.g. a converted checkpoint whose source had no tokenizer file
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: {e}; text in and out needs the model's tokenizer: copy the "
            f"tokenizer.json of the model's source into {ckpt} (mnemo convert names a missing one)"
        ) from None
    check_tokenizer_fits(tok, model.config.vocab_size, f"--checkpoint {checkpoint}")
    return ckpt, model, tok


def _cmd_eval_task(args, ckpt, tcfg: dict) -> int:
    from ..models import LanguageModel
    from ..train import TrainConfig
    from ..train.task_eval import eval_batch_size, evaluate_task

    cfg = TrainConfig.from_dict(tcfg)
    task = cfg.build_task()
    lengths = _parse_lengths(args.length, "--length") or [args.seq_len or cfg.seq_len]
    for L in lengths:
        task.check_length(L, "--length")
    model = LanguageModel.from_pretrained(ckpt, map_location=args.device, dtype="float32")  # as _load
    if model.config.pos_embedding == "learned" and max(lengths) > model.config.max_position:
        raise ValueError(
            f"--length: {max(lengths)} tokens exceed the model's learned positions "
            f"(max_position = {model.config.max_position})"
        )
    num = args.num_samples or cfg.eval_batches * cfg.batch_size
    from ..train.memory_estimate import check_forward_memory, check_sequences_memory

    batch = args.batch_size or cfg.batch_size
    for L in lengths:  # refused before anything is drawn or allocated
        check_sequences_memory(num, L, args.device, flag="--num-samples / --length", bytes_per_token=20)
        # longer than training: streamed in pieces of seq_len, with fewer rows (evaluate_task)
        rows, piece = (eval_batch_size(batch, cfg.seq_len, L), cfg.seq_len) if L > cfg.seq_len else (batch, L)
        check_forward_memory(model.config, min(rows, num), piece, args.device, flag="--batch-size / --length")
    res = evaluate_task(
        model,
        task,
        lengths,
        num_samples=num,
        batch_size=batch,
        train_len=cfg.seq_len,
        seed=cfg.seed,
        device=args.device,
    )
    from ..train.sinks import dumps_record  # strict JSON: a diverged model's NaN loss is null + "nonfinite"

    for L in lengths:
        r = res[L]
        print(
            dumps_record(
                {
                    "checkpoint": str(ckpt),
                    "task": cfg.task,
                    "length": L,
                    "sequences": num,
                    "answers": r["answers"],  # val_seq_acc's denominator (several per sequence in some tasks)
                    "val_loss": r["loss"],
                    "val_acc": r["acc"],
                    "val_seq_acc": r["seq_acc"],
                }
            )
        )
    return 0


def _cmd_eval(args) -> int:
    _SAID.clear()  # (once per command, not per process: tests call main() again)
    from ..train import resolve_checkpoint
    from ..train.checkpoint import TRAIN_CONFIG_NAME, load_json

    ckpt = resolve_checkpoint(args.checkpoint, warn=_warn)
    _refuse_sharded(ckpt, args.checkpoint)
    tcfg = load_json(ckpt / TRAIN_CONFIG_NAME) if (ckpt / TRAIN_CONFIG_NAME).is_file() else {}
    if args.length and args.seq_len:  # (a task run read --length alone: --seq-len went unused)
        raise ValueError("--length and --seq-len: give one of them (--length L1,L2 evaluates at each)")
    if tcfg.get("task"):
        text_only = {
            "--yarn": args.yarn is not None,
            "--yarn-beta-fast/--yarn-beta-slow": args.yarn_beta_fast is not None
            or args.yarn_beta_slow is not None,
            "--data": args.data is not None,
            "--text-field": args.text_field is not None,
            "--pack-documents": args.pack_documents is not None,
            "--full": args.full,
            "--max-batches": args.max_batches is not None,
            "--precision": args.precision is not None,
        }
        given = [flag for flag, on in text_only.items() if on]
        if given:
            raise ValueError(
                f"{', '.join(given)}: text checkpoints only; {ckpt} was trained on the task "
                f"{tcfg['task']!r} and is evaluated on fresh draws of it (options: --length, --num-samples, "
                "--batch-size, --seq-len)"
            )
        return _cmd_eval_task(args, ckpt, tcfg)
    if args.num_samples:
        raise ValueError("--num-samples applies to task checkpoints (trained with --task)")
    for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: expected a positive int, got {value}")
    lengths = _parse_lengths(args.length, "--length")
    ckpt, model, tok = _load(str(ckpt), args.device)
    longest = max(lengths or [args.seq_len or tcfg.get("seq_len", 128)])
    if model.config.pos_embedding == "learned" and longest > model.config.max_position:
        raise ValueError(
            f"{'--length' if lengths else '--seq-len'}: {longest} tokens exceed the model's learned "
            f"positions (max_position = {model.config.max_position})"
        )
    if args.yarn is None and (args.yarn_beta_fast is not None or args.yarn_beta_slow is not None):
        raise ValueError("--yarn-beta-fast/--yarn-beta-slow: they set YaRN's ramp; pass --yarn too")
    yarn = (
        _yarn_setting(args.yarn, tcfg, model, args.yarn_beta_fast, args.yarn_beta_slow)
        if args.yarn is not None
        else None
    )
    for L in lengths or [args.seq_len or tcfg.get("seq_len", 128)]:  # one JSON line per length
        if yarn is not None:
            yarn(L)
        extra = _yarn_extra(model) if yarn is not None else None
        code = _cmd_eval_text(
            args, tcfg, ckpt, model, tok, L, extra, flag="--length" if lengths else "--seq-len"
        )
        if code:
            return code
    return 0


def _yarn_setting(text: str, tcfg: dict, model, beta_fast=None, beta_slow=None):
    """``--yarn [FACTOR]``: a function ``L -> None`` that sets YaRN on every attention layer for
    evaluation at length ``L`` (factor ``FACTOR``, or ``L / training seq_len`` for ``auto``; plain
    RoPE where the factor is 1), its ramp bounds ``beta_fast``/``beta_slow`` (``--yarn-beta-fast``,
    ``--yarn-beta-slow``; ``None``: the paper's 32 and 1)."""
    train_len = tcfg.get("seq_len")
    if not train_len:
        raise ValueError("--yarn: the checkpoint has no training seq_len to extend (no train_config)")
    if text == "auto":
        factor = None
    else:
        try:
            factor = float(text)
        except ValueError:
            factor = 0.0
        if not factor >= 1:
            raise ValueError(f"--yarn: expected 'auto' or a factor >= 1, got {text!r}")
    layers = [m for m in model.modules() if hasattr(m, "set_rope_scaling") and getattr(m, "rotary", None)]
    if not layers:
        raise ValueError("--yarn: the model has no attention layer with rotary positions")
    fixed = [
        n for n, m in model.named_modules() if m in layers and getattr(m, "softmax_scale", None) is not None
    ]
    if fixed:  # (a converted Granite's attention_multiplier): YaRN's factor would also set the scale
        raise ValueError(
            f"--yarn: {fixed[0]} sets its logit scale (softmax_scale = "
            f"{model.get_submodule(fixed[0]).softmax_scale!r}, e.g. a converted Granite's "
            "attention_multiplier), and YaRN (rope_type 'yarn') multiplies the logits too; evaluate this "
            "model without --yarn"
        )

    said = set()  # each warning once per command, not once per --length

    def apply(L: int) -> None:
        s = factor if factor is not None else max(1.0, L / train_len)
        scaling = (
            None
            if s == 1
            else {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": train_len}
        )
        if scaling is not None:
            scaling |= {
                k: v for k, v in (("beta_fast", beta_fast), ("beta_slow", beta_slow)) if v is not None
            }
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                for m in layers:
                    m.set_rope_scaling(scaling)
            except ValueError as e:  # (beta_slow >= beta_fast): named by their flags
                raise ValueError(f"--yarn-beta-fast/--yarn-beta-slow: {e}") from None
        for w in seen:  # once each; the advice names the flag that sets beta_fast
            text = str(w.message)
            if text not in said:
                said.add(text)
                if "choose beta_fast" in text:
                    text = text.replace("choose beta_fast", "choose beta_fast (--yarn-beta-fast)")
                warnings.warn(text, w.category, stacklevel=2)

    return apply


def _yarn_extra(model) -> dict:
    """The ``rope_scaling`` in force on the first rotary attention layer (for the JSON line)."""
    for m in model.modules():
        if hasattr(m, "set_rope_scaling") and getattr(m, "rotary", None) is not None:
            return {"rope_scaling": m.rotary.scaling}
    return {}


def _cmd_eval_text(
    args, tcfg: dict, ckpt, model, tok, seq_len: int, extra: dict | None = None, flag: str = "--seq-len"
) -> int:
    """``mnemo eval`` on a text checkpoint with windows of ``seq_len`` tokens: one JSON line
    (``extra`` added to it)."""
    import math

    import torch
    from tqdm.auto import tqdm

    from ..data import load_corpus
    from ..data.corpus import inherited_text_field
    from ..data.text import VAL_FRACTION
    from ..hf.special_ids import checkpoint_bos
    from ..train.batches import with_bos
    from ..train.trainer import packed_logits

    data = args.data or tcfg.get("data", "tinyshakespeare")
    batch_size = args.batch_size or tcfg.get("batch_size", 32)
    text_field = args.text_field or inherited_text_field(data, tcfg.get("text_field"))
    pack = tcfg.get("pack_documents", False) if args.pack_documents is None else args.pack_documents == "on"
    if args.max_batches is None:  # what training logs: its first eval_batches validation batches
        max_batches = tcfg.get("eval_batches")
    elif args.max_batches == "all":
        max_batches = None
    else:
        try:
            max_batches = int(args.max_batches)
        except ValueError:
            max_batches = 0
        if max_batches < 1:
            raise ValueError(f"--max-batches: expected a positive int or 'all', got {args.max_batches!r}")
    bf16 = (args.precision or tcfg.get("precision", "fp32")) == "bf16"
    corpus = load_corpus(data, text_field)
    if args.pack_documents == "on" and len(corpus) < 2:  # asked for, and it would change nothing
        raise ValueError(
            f"--pack-documents on: data {data!r} is a single document (a plain text file is one; "
            "JSONL/Parquet records or separate files are several), so packing would change nothing"
        )
    if pack and args.pack_documents is None and len(corpus) < 2:
        # inherited from a run that packed its documents, on data of one document: packing would
        # read each window as it is, as without it (the rule by which `mnemo train` refuses the
        # flag there), so it is off, and the record says so (the numbers are the same)
        pack = False
    if pack and getattr(model, "task_segment", None) is not None:
        raise ValueError(
            "--pack-documents: not for this checkpoint's model, whose CMS levels learn from the "
            "next-token loss over the whole window (packing would split it per document)"
            + ("; evaluate it with --pack-documents off" if args.pack_documents == "on" else "")
        )
    val_docs = corpus.split()[1] if not args.full else corpus
    try:  # documents joined as in training (the tokenizer's separator)
        stream = val_docs.stream(tok, seq_len)
    except ValueError as e:  # too short for one window: name the flag the user gave
        where = (
            ""
            if args.full
            else (
                f"; this is the validation split, the last {VAL_FRACTION:.0%} of {data!r} (--full reads "
                "all of it)"
            )
        )
        raise ValueError(str(e).replace("--seq-len", flag) + where) from None
    unknown = getattr(tok, "unknown_share", None)
    share = unknown(val_docs.text) if unknown is not None else 0.0
    if share > 0:
        _warn(
            f"{share:.1%} of the characters of {data!r} are outside the tokenizer's vocabulary and are "
            "read as <unk>: the loss is not comparable to the training log's"
        )
    # a run's fixed first token, as training measured it; for a checkpoint no mnemo run made, the
    # BOS its tokenizer puts before a text (each window then reads like a text of its own)
    bos = checkpoint_bos(ckpt, tok)
    model.eval()
    total, count, sequences = 0.0, 0, 0
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=bf16)
    windows = (stream.ids.numel() - 1) // seq_len
    if max_batches is not None:
        windows = min(windows, max_batches * batch_size)
    # a bar on a terminal only (``disable=None``): ``--max-batches all`` or ``--full`` reads for minutes
    bar = tqdm(total=-(-windows // batch_size), desc="eval", unit="batch", disable=None, leave=False)
    with torch.no_grad(), bar:
        for batch in stream.eval_batches(batch_size, max_batches, with_documents=pack):
            x, y = with_bos(batch[0], bos), batch[1]
            with autocast:
                if pack:  # each document alone, as training measured it
                    logits = packed_logits(model, x.to(args.device), batch[2].to(args.device))
                else:
                    logits, _ = model(x.to(args.device))
            total += torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), y.to(args.device).flatten(), reduction="sum"
            ).item()
            count += y.numel()
            sequences += y.shape[0]
            bar.update(1)
    if count == 0:
        raise ValueError(
            f"--data: the {'file' if args.full else 'validation split'} of {data!r} is shorter than one "
            f"window of {flag} {seq_len} + 1 tokens"
        )
    val_loss = total / count
    tokens_per_char = stream.ids.numel() / stream.num_chars
    same = (
        not args.full
        and _same_data(data, tcfg.get("data", "tinyshakespeare"))
        and seq_len == tcfg.get("seq_len")
        and batch_size == tcfg.get("batch_size")
        and max_batches == tcfg.get("eval_batches")
        and bf16 == (tcfg.get("precision") == "bf16")
        # (a run on one document, saved before `mnemo train` refused that, packed nothing either)
        and pack == (tcfg.get("pack_documents", False) and len(corpus) >= 2)
        and text_field == tcfg.get("text_field", "text")
        and not (extra or {}).get("rope_scaling")  # --yarn changes the model's positions
    )
    result = {
        "checkpoint": str(ckpt),
        "data": data,
        "split": "all" if args.full else "val",
        "sequences": sequences,
        "seq_len": seq_len,
        "tokens": count,
        "precision": "bf16" if bf16 else "fp32",
        "pack_documents": pack,
        "val_loss": val_loss,
        "bpc": val_loss * tokens_per_char / math.log(2),
        # True: the measurement the training log's val_loss makes (same windows and precision)
        "as_in_training": same,
        "bos_id": bos,  # the id put first in each window (None: the windows are read as they are)
        **(extra or {}),
    }
    from ..train.sinks import dumps_record  # strict JSON: a diverged model's NaN loss is null + "nonfinite"

    print(dumps_record(result))
    return 0


def _check_generate_memory(model, length: int, device: str) -> None:
    """Refuse, before decoding, a generation whose decoding state (a KV cache grows with the
    length) and tokens cannot fit in the memory available on ``device``."""
    import torch

    from ..train.memory_estimate import GiB, available_memory

    need = model.state_size_bytes(1, length) + 16 * length
    have, source = available_memory(torch.device(device))
    if have is not None and need > have:
        raise ValueError(
            f"--max-new-tokens: {length:,} tokens need a decoding state of at least {need / GiB:,.1f} GiB, "
            f"but only {have / GiB:,.1f} GiB are available ({source}); lower --max-new-tokens"
        )


def _check_generate_positions(model, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse, before decoding, a generation that would run past a model's learned positions
    (``max_position``): the prompt's tokens and all but the last new token are read."""
    cfg = model.config
    if cfg.pos_embedding != "learned":
        return
    if prompt_len > cfg.max_position:
        raise ValueError(
            f"--prompt: {prompt_len} tokens exceed the model's learned positions (max_position = "
            f"{cfg.max_position})"
        )
    if prompt_len + max_new_tokens - 1 > cfg.max_position:
        raise ValueError(
            f"--max-new-tokens: a prompt of {prompt_len} tokens and {max_new_tokens:,} new ones pass the "
            f"model's learned positions (max_position = {cfg.max_position}); at most "
            f"{cfg.max_position - prompt_len + 1:,} new tokens fit"
        )


class _Counted(list):
    """A list of the new tokens that moves a progress bar by one at each append."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def append(self, item) -> None:
        super().append(item)
        self.bar.update(1)


def _cmd_generate(args) -> int:
    _SAID.clear()  # (once per command, not per process: tests call main() again)
    from ..hf.special_ids import checkpoint_bos, checkpoint_eos
    from ..train import generate_text
    from ..train.generation import _prompt_ids, end_ids

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens: expected an int >= 0, got {args.max_new_tokens}")
    ckpt, model, tok = _load(args.checkpoint, args.device)
    bos = checkpoint_bos(ckpt, tok)
    # the ids the checkpoint declares, then its tokenizer's end-of-text token (a BPE run's
    # <|endoftext|>, where the model can sample it: end_ids), as the harness, export_hf and
    # MnemoForCausalLM stop there
    eos = None if args.ignore_eos else checkpoint_eos(ckpt)
    eot = None if args.ignore_eos else end_ids(model, tok)
    if eot is not None:
        declared = [] if eos is None else ([eos] if isinstance(eos, int) else [int(i) for i in eos])
        eos = declared + [eot] if eot not in declared else eos
    prompt_len = len(_prompt_ids(tok, args.prompt, bos))
    _check_generate_positions(model, prompt_len, args.max_new_tokens)
    _check_generate_memory(model, prompt_len + args.max_new_tokens, args.device)
    unknown = sorted(set(args.prompt) - set(tok.chars)) if hasattr(tok, "chars") else []
    if unknown:
        print(
            f"warning: --prompt: {len(unknown)} character(s) are not in the checkpoint's vocabulary and "
            f"are read as <unk> (shown as \ufffd): {''.join(unknown)!r}",
            file=sys.stderr,
        )
    vocab = model.config.vocab_size
    if args.top_k is not None and args.top_k >= vocab:
        print(
            f"note: --top-k {args.top_k} >= the vocabulary ({vocab} tokens): sampling from every token",
            file=sys.stderr,
        )
    from tqdm.auto import tqdm

    # a bar of new tokens on a terminal only (``disable=None``): a long generation printed nothing
    # until its end; stdout still holds the text alone
    bar = tqdm(total=args.max_new_tokens, desc="generate", unit="tok", disable=None, leave=False)
    made = _Counted(bar)  # the new tokens so far: an interrupt prints them (a long run's work is kept)
    try:
        text = generate_text(
            model,
            tok,
            args.prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            device=args.device,
            compile=args.compile,
            made=made,
            bos=bos,
            eos=eos,
        )
    except KeyboardInterrupt as e:
        from ..train.generation import decoded

        bar.close()
        print(decoded(tok, args.prompt, made, bos))
        e.then = (
            f"; the text above holds the {len(made):,} of {args.max_new_tokens:,} new tokens made before it"
        )
        raise
    finally:
        bar.close()  # (cleared: leave=False)
    print(text)
    return 0


def add_commands(sub) -> None:
    """Add ``eval`` and ``generate`` to the ``mnemo`` sub-command parser."""
    e = sub.add_parser(
        "eval", help="validation loss and bits per character (task runs: accuracy) of a checkpoint"
    )
    e.add_argument(
        "--checkpoint",
        required=True,
        type=kinds.ExistingDir("a run or checkpoint folder"),
        help="run directory or checkpoint directory",
    )
    e.add_argument(
        "--data",
        type=kinds.Text("a corpus name, file, folder or glob"),
        help="corpus (default: the one it was trained on)",
    )
    e.add_argument(
        "--text-field",
        type=kinds.Text("a field name"),
        help="JSONL/Parquet: the field holding the text (default: as in training)",
    )
    e.add_argument(
        "--pack-documents",
        choices=["on", "off"],
        help="each document of a window is its own sequence (default: as in training)",
    )
    e.add_argument(
        "--full",
        action="store_true",
        help="draw the windows from the whole file, not only its validation split (with --max-batches "
        "all: every window of the file)",
    )
    e.add_argument("--seq-len", type=kinds.positive_int, help="window length (default: the training seq_len)")
    e.add_argument(
        "--batch-size", type=kinds.positive_int, help="windows per batch (default: the training batch_size)"
    )
    e.add_argument(
        "--max-batches",
        type=kinds.Int(1, words=("all",)),
        help="validation batches to read, or 'all' for the whole split (default: the training "
        "eval_batches, so val_loss is the training log's measurement)",
    )
    e.add_argument(
        "--precision", choices=["fp32", "bf16"], help="default: the training precision (bf16 = autocast)"
    )
    e.add_argument(
        "--length",
        type=kinds.IntList(1, unique=True),
        help="comma-separated test lengths, one JSON line each (default: the training length; text "
        "checkpoints: window lengths, as --seq-len)",
    )
    e.add_argument(
        "--yarn",
        nargs="?",
        type=kinds.Float(1, words=("auto",)),
        const="auto",
        metavar="FACTOR",
        help="text checkpoints: apply YaRN (Peng et al. 2023) to every rotary attention layer for the "
        "evaluation, original context = the training seq_len, factor FACTOR (>= 1) or (no FACTOR, or "
        "'auto') length / training seq_len per --length; plain RoPE where that is 1",
    )
    e.add_argument(
        "--yarn-beta-fast",
        type=kinds.Float(0, lo_open=True),
        metavar="B",
        help="with --yarn: rotations over the training context above which a dimension keeps its "
        "frequency (YaRN's beta; default 32, the paper's, which assumes a context of thousands of tokens)",
    )
    e.add_argument(
        "--yarn-beta-slow",
        type=kinds.Float(0, lo_open=True),
        metavar="B",
        help="with --yarn: rotations below which a dimension is fully interpolated (YaRN's alpha; "
        "default 1, the paper's); must be below --yarn-beta-fast",
    )
    e.add_argument(
        "--num-samples",
        type=kinds.positive_int,
        help="task checkpoints: test sequences (default: as in training)",
    )
    e.add_argument("--device", default="cpu", type=kinds.device, help="cpu or cuda[:N] (default cpu)")
    e.set_defaults(func=_cmd_eval)

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument(
        "--checkpoint",
        required=True,
        type=kinds.ExistingDir("a run or checkpoint folder"),
        help="run directory or checkpoint directory",
    )
    g.add_argument(
        "--prompt",
        default="",
        help='text to continue (default "": the text starts after the beginning-of-text token, or after a '
        "newline, not printed, for a model without one)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=kinds.Int(0, MAX_NEW_TOKENS),
        default=300,
        help=f"tokens to generate, at most {MAX_NEW_TOKENS:,} (the text is printed at the end) (default 300)",
    )
    g.add_argument(
        "--temperature",
        type=kinds.nonneg_float,
        default=0.8,
        help="sampling temperature, 0 = greedy (default 0.8)",
    )
    g.add_argument("--top-k", type=kinds.positive_int, help="sample among the K likeliest tokens")
    g.add_argument(
        "--top-p",
        type=kinds.Float(0, 1, lo_open=True),
        help="nucleus sampling: among the fewest likeliest tokens whose probability sums to P "
        "(after --top-k)",
    )
    g.add_argument("--seed", type=kinds.seed, default=0, help="seeds the sampling (default 0)")
    g.add_argument("--device", default="cpu", type=kinds.device, help="cpu or cuda[:N] (default cpu)")
    g.add_argument(
        "--compile",
        action="store_true",
        help="prefill and decode under torch.compile (the first call compiles for tens of seconds; pays off "
        "on long outputs)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="the text stops at the end-of-text id the checkpoint declares (generation_config.json / "
        "config.json's eos_token_id, as transformers does) and at its tokenizer's end-of-text token "
        "(a BPE run's <|endoftext|>; mnemo's char/byte tokenizers have none); with this flag it "
        "runs --max-new-tokens steps",
    )
    g.set_defaults(func=_cmd_generate)

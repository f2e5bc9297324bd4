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

import gc
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import write_json
from .model_entries import (  # noqa: F401  (the rows, also mnemo.bench.models' API)
    DEFAULT_D_MODEL,
    DEFAULT_GEN_BATCHES,
    DEFAULT_N_LAYERS,
    DEFAULT_SHAPES,
    VOCAB,
    Entry,
    Size,
    compile_available,
    compiled_entry,
    mnemo_entry,
)
from .model_peers import PEER_DEFINED, PEER_PARTNER, PEERS  # noqa: F401

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


def check_shapes_memory(
    shapes: list[tuple[int, int]], d_model: int, device="cpu", *, flag: str = "--model-shapes"
) -> None:
    """Refuse, before anything is allocated, a shape ``T x B`` (training, or a generation prompt:
    ``flag``, default ``"--model-shapes"``) that cannot fit in the memory available on ``device``:
    a lower bound, the int64 tokens (inputs and targets) and one fp32 ``[B·T, d_model]``
    activation (the models and roofline suites; the roofline's GEMM probe allocates that
    activation too).

    Raises:
        ValueError: naming ``flag``, the shape, both numbers and what to lower.
    """
    from ..train.memory_estimate import GiB, available_memory

    have, source = available_memory(torch.device(device))
    for T, B in shapes:
        need = B * T * (16 + 4 * d_model)
        if have is not None and need > have:
            raise ValueError(
                f"{flag}: {T}x{B} (tokens x rows) needs at least {need / GiB:,.1f} GiB for its tokens and "
                f"one activation of width {d_model}, but only {have / GiB:,.1f} GiB are available "
                f"({source}); lower them"
            )


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


def check_model_names(models: list[str], flag: str = "--models") -> None:
    """Refuse names in ``models`` that are not registered (:func:`mnemo.models.model_names`).

    Raises:
        ValueError: naming ``flag`` (default ``flag="--models"``), the unknown names and the
            registered ones.
    """
    from ..models import model_names

    known = model_names()
    unknown = [m for m in models if m not in known]
    if unknown:
        raise ValueError(f"{flag}: unknown model(s) {unknown}; registered: {', '.join(known)}")


def check_peer_names(peers: list[str]) -> None:
    """Refuse names in ``peers`` that are not keys of :data:`PEERS`.

    Raises:
        ValueError: naming ``--peers``, the unknown names and the choices.
    """
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"--peers: unknown peer(s) {bad}; choose from {', '.join(PEERS)} or 'none'")


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
    check_model_names(models)
    check_peer_names(peers)
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


def _names(text: str, flag: str) -> list[str]:
    """Comma-separated names, blanks around each dropped (as the CLI's duplicate check reads them)."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise ValueError(f"{flag}: expected at least one name, got {text!r}")
    return names


def main(args) -> int:
    from ..models import model_names

    models = _names(args.models, "--models") if getattr(args, "models", None) else model_names()
    peers_arg = getattr(args, "peers", None)
    peers = [] if peers_arg == "none" else (_names(peers_arg, "--peers") if peers_arg else list(PEERS))
    size = Size(
        getattr(args, "d_model", None) or DEFAULT_D_MODEL, getattr(args, "n_layers", None) or DEFAULT_N_LAYERS
    )
    shapes = parse_shapes(getattr(args, "model_shapes", None) or DEFAULT_SHAPES)
    device = getattr(args, "device", "cpu")
    check_shapes_memory(shapes, size.d_model, device)
    gen_batches = parse_gen_batches(getattr(args, "gen_batches", None) or DEFAULT_GEN_BATCHES)
    prompt = getattr(args, "prompt_len", 256) + getattr(args, "gen_tokens", 64)
    check_shapes_memory(
        [(prompt, b) for b in gen_batches],
        size.d_model,
        device,
        flag="--gen-batches x (--prompt-len + --gen-tokens)",
    )
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
        write_json(args.json, result)
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

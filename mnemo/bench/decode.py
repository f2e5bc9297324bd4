"""``mnemo bench --suite decode``: one-token decoding speed and memory against context length.

For every model and context length ``L`` a fresh subprocess builds the model, gives it a decoding
state that has seen ``L`` tokens — a KV cache of length ``L`` for attention layers, the (constant
size) recurrent state for the others; the state's *values* are random, its *size* is what ``L``
tokens leave behind — times ``--decode-steps`` one-token steps one by one and reports tokens/s
(from the median step; the mean is in the JSON as ``mean_tokens_per_s``) and the process's peak
RSS. Each row is the median of ``--decode-processes`` such processes (default 3). Recurrent models
should stay flat from 1k to 64k; a KV-cache transformer's time and memory grow with ``L``, except
with a window (``transformer_sinks``: a 512-token window + 4 attention sinks, StreamingLLM), whose
cache holds at most ``n_sink + window − 1`` keys at any ``L``.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from . import write_json

DEFAULT_MODELS = (
    "transformer",
    "transformer_sinks",
    "gla",
    "gated_deltanet",
    "mamba",
    "mamba2",
    "titans_lmm",
)


def _fill_state(model, state, L: int):
    """Give every attention cache the random entries ``L`` tokens leave behind: ``L``, or what
    the layer's ``state_spec`` keeps of them (a window, attention sinks); recurrent states keep
    their shape."""
    import dataclasses

    from ..ops.softmax_attention import KVCache

    out = []
    for block, s in zip(model.blocks, state):  # BlockState(mixer=..., mlp=...)
        m = s.mixer
        changes = {"offset": L} if hasattr(m, "offset") else {}
        kv = getattr(m, "kv", None)
        if isinstance(kv, KVCache):
            B, _, H, D = kv.k.shape
            spec = block.mixer.state_spec(B, L) if hasattr(block.mixer, "state_spec") else None
            kept = spec.kv.k.shape[1] if isinstance(getattr(spec, "kv", None), KVCache) else L
            changes["kv"] = KVCache(torch.randn(B, kept, H, D), torch.randn(B, kept, H, kv.v.shape[-1]))
        out.append(dataclasses.replace(s, mixer=dataclasses.replace(m, **changes)) if changes else s)
    return out


def peak_rss_mb() -> float:
    """This process's peak resident set in MiB: ``VmHWM`` from ``/proc/self/status`` (Linux; it
    belongs to the address space, so it starts fresh at ``exec``), else ``ru_maxrss`` (which on
    Linux survives ``fork`` + ``exec`` and would report the parent's peak)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(model_name: str, L: int, steps: int, d_model: int, n_layers: int) -> dict:
    """Run in the current process: decode ``steps`` tokens after a context of ``L``."""
    from ..models import LanguageModel, build_config

    torch.manual_seed(0)
    model = LanguageModel(build_config(model_name, vocab_size=256, d_model=d_model, n_layers=n_layers)).eval()
    with torch.no_grad():
        _, state = model(torch.randint(0, 256, (1, 8)))
        state = _fill_state(model, state, L)
        tok = torch.randint(0, 256, (1, 1))
        for _ in range(3):  # warm-up
            _, _ = model(tok, state)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits, state = model(tok, state)
            tok = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    rss_mb = peak_rss_mb()
    # the median step: one scheduler hiccup on a shared 2-core machine moves a mean of 64 steps by
    # 20-30%, which would read as context dependence
    median = statistics.median(times)
    return {
        "model": model_name,
        "context": L,
        "tokens_per_s": 1.0 / median,
        "mean_tokens_per_s": steps / sum(times),
        # (the keys say "mb"; both values are MiB, 2**20 bytes, as the printed table says)
        "peak_rss_mb": rss_mb,
        "state_mb": model.state_size_bytes(1, L) / 2**20,
    }


def main(args) -> int:
    from .models import check_model_names

    # --models names the models (as in the models suite); --ops is the older spelling, still read
    chosen = getattr(args, "models", None) or getattr(args, "ops", None)
    models = [m.strip() for m in chosen.split(",") if m.strip()] if chosen else list(DEFAULT_MODELS)
    flag = "--models" if getattr(args, "models", None) else "--ops"
    if not models:
        raise ValueError(f"{flag}: expected at least one model name, got {chosen!r}")
    check_model_names(models, flag)
    contexts = [int(x) for x in str(args.contexts).split(",")]
    procs = max(1, getattr(args, "decode_processes", 3))
    print(
        f"mnemo bench --suite decode: d_model={args.d_model}, {args.n_layers} layers, {args.decode_steps} "
        f"one-token steps after a context of L tokens; median of {procs} fresh processes per row\n"
    )
    print(f"{'model':<16}{'L':>8}{'tokens/s':>12}{'peak RSS MiB':>14}{'state MiB':>11}")
    rows, failed = [], []
    for name in models:
        for L in contexts:
            cmd = [
                sys.executable,
                "-c",
                "import json; from mnemo.runtime import tune_malloc; tune_malloc(); "
                "from mnemo.bench.decode import measure; "
                f"print(json.dumps(measure({name!r}, {L}, {args.decode_steps}, {args.d_model}, "
                f"{args.n_layers})))",
            ]
            # one process's speed varies by ~10% from the next (placement, allocator) whatever the
            # context, so a row is the median of several fresh processes
            runs, err = [], None
            for _ in range(procs):
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    err = out.stderr.strip().splitlines()[-1] if out.stderr else "?"
                    break
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            if err is not None:
                print(f"{name:<16}{L:>8}   failed: {err}")
                failed.append(f"{name} L={L}")
                continue
            r = dict(runs[0])
            for key in ("tokens_per_s", "mean_tokens_per_s", "peak_rss_mb"):
                r[key] = statistics.median(x[key] for x in runs)
            r["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs]
            rows.append(r)
            print(
                f"{name:<16}{L:>8}{r['tokens_per_s']:>12.1f}{r['peak_rss_mb']:>14.1f}{r['state_mb']:>11.2f}",
                flush=True,
            )
        own = [r for r in rows if r["model"] == name]
        if len(own) >= 2:
            a, b = own[0], own[-1]
            print(
                f"{'':<16}{'':>8}   {b['context'] / a['context']:g}x context: tokens/s "
                f"x{b['tokens_per_s'] / a['tokens_per_s']:.2f}, "
                f"peak RSS x{b['peak_rss_mb'] / a['peak_rss_mb']:.2f}"
            )
    if args.json:
        write_json(args.json, rows)
        print(f"\nwrote {args.json}")
    if failed:
        print(
            f"mnemo bench --suite decode: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0

"""Model-level GPU benchmark of ``scripts/gpu_check.sh`` (issue 36, item 6): mnemo's ``auto``
backends against its ``torch`` backend, fla's own Hugging Face model classes and mamba-ssm's
``MambaLMHeadModel`` (each where installed), writing one JSON.

Each case builds one model with random weights (float32 parameters) and times, under
``torch.autocast(device, torch.bfloat16)`` (what ``mnemo train --precision bf16`` runs):

* a **train step**: forward, cross-entropy on float32 logits, backward, AdamW step, on
  ``[tokens_per_step // T, T]`` random tokens; ``train_step_s`` is the median of the timed steps
  after one warm-up step (which includes the Triton kernels' compilation and autotuning:
  ``warmup_s``);
* **generate**: greedy decoding of ``gen_tokens`` new tokens after a ``gen_prompt``-token prompt,
  batch 1, after an untimed 2-token warm-up; ``decode_tokens_per_s`` = ``gen_tokens / generate_s``
  (prefill included).

Cases (defaults: d_model 1024, 24 layers, vocabulary 32000, T 2048 and 8192, 16384 tokens per
step): for each ``--models`` preset, mnemo with ``auto`` and with ``torch``; the peers paired with
a preset (``fla.models`` ``GatedDeltaNetForCausalLM`` / ``GLAForCausalLM`` /
``TransformerForCausalLM``, ``mamba_ssm`` ``MambaLMHeadModel`` with Mamba-2 layers), configured
with the same width, depth and vocabulary (their own head layout: compare ``params``). All cases of
the first length run before any of the second.

Time limits (the whole check must stay under 8 minutes on one GPU): ``--budget-s`` for all cases;
a case starts only with ``--min-case-s`` left; within a case the timed steps stop at
``--case-s``; a preset's longer lengths are skipped when its train step at the previous length
took more than ``--max-step-s``. A skipped case is recorded with ``status: "skipped"`` and the
reason, a failed one with ``status: "error"`` (a peer not installed: ``"unavailable"``).

    python scripts/gpu_bench.py [--out gpu_check.json] [--tiny] [--device cuda]

``--tiny`` (d_model 32, 2 layers, vocabulary 256, T 16 and 32, 64 tokens per step, an 8-token
prompt, 4 new tokens) runs anywhere, the CPU included: the test suite runs it to keep this script
working (tests/test_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMA = "mnemo.gpu_bench/1"
#: the fields of every case in the JSON (values may be null where not measured)
CASE_FIELDS = (
    "impl",
    "model",
    "backend",
    "T",
    "batch",
    "params",
    "status",
    "reason",
    "warmup_s",
    "train_step_s",
    "train_steps_timed",
    "train_tokens_per_s",
    "generate_s",
    "decode_tokens_per_s",
    "peak_mem_gb",
    "dispatch",
)
FULL = dict(d_model=1024, n_layers=24, vocab=32000, lengths=(2048, 8192), tokens=16384, prompt=512, new=128)
TINY = dict(d_model=32, n_layers=2, vocab=256, lengths=(16, 32), tokens=64, prompt=8, new=4)
DEFAULT_MODELS = ("gated_deltanet", "gla", "mamba2", "transformer")
#: the peer paired with each preset: (impl, description)
PEERS = {
    "gated_deltanet": ("fla", "fla.models.GatedDeltaNetForCausalLM"),
    "gla": ("fla", "fla.models.GLAForCausalLM"),
    "transformer": ("fla", "fla.models.TransformerForCausalLM"),
    "mamba2": ("mamba_ssm", "mamba_ssm MambaLMHeadModel (Mamba-2 layers)"),
}


def versions() -> dict:
    """Versions of python, torch (and its CUDA), triton, fla-core, mamba-ssm, transformers, and
    the GPU's name; ``None`` for what is not installed."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for mod in ("triton", "fla", "mamba_ssm", "causal_conv1d", "transformers"):
        out[mod] = None
        if importlib.util.find_spec(mod) is None:
            continue
        try:
            from importlib.metadata import PackageNotFoundError, version

            dist = {"fla": "fla-core", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}.get(
                mod, mod
            )
            try:
                out[mod] = version(dist)
            except PackageNotFoundError:
                out[mod] = version("flash-linear-attention") if mod == "fla" else "installed"
        except Exception as e:  # reported, never fatal
            out[mod] = f"error: {type(e).__name__}"
    out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return out


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


class _Logits(torch.nn.Module):
    """A peer model as ``ids -> logits`` (Hugging Face and mamba-ssm outputs have ``.logits``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def _mnemo_model(name: str, size: dict) -> torch.nn.Module:
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=size["vocab"], d_model=size["d_model"], n_layers=size["n_layers"])
    return LanguageModel(cfg)


def _peer_model(name: str, size: dict) -> torch.nn.Module:
    """The peer paired with ``name``; ``ImportError`` when it is not installed."""
    d, L, V = size["d_model"], size["n_layers"], size["vocab"]
    torch.manual_seed(0)
    if name == "mamba2":
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        cfg = MambaConfig(d_model=d, n_layer=L, vocab_size=V, ssm_cfg={"layer": "Mamba2"}, rms_norm=True)
        return MambaLMHeadModel(cfg)
    fla_models = importlib.import_module("fla.models")  # flash-linear-attention (fla-core has no models)
    heads = max(1, d // 256)
    if name == "gated_deltanet":
        cfg = fla_models.GatedDeltaNetConfig(
            hidden_size=d, num_hidden_layers=L, vocab_size=V, num_heads=heads, head_dim=min(256, d)
        )
        return fla_models.GatedDeltaNetForCausalLM(cfg)
    if name == "gla":
        cfg = fla_models.GLAConfig(hidden_size=d, num_hidden_layers=L, vocab_size=V, num_heads=heads)
        return fla_models.GLAForCausalLM(cfg)
    if name == "transformer":
        cfg = fla_models.TransformerConfig(
            hidden_size=d, num_hidden_layers=L, vocab_size=V, num_heads=max(1, d // 64)
        )
        return fla_models.TransformerForCausalLM(cfg)
    raise ValueError(f"no peer for {name!r}")


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _first(model):
    return lambda ids: model(ids)[0]


def _train_step(model, forward, opt, ids, device) -> float:
    t0 = time.perf_counter()
    with _autocast(device):
        logits = forward(ids)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0


def _generate(impl: str, model, prompt, n: int, device):
    with torch.no_grad(), _autocast(device):
        if impl == "mnemo":
            return model.generate(prompt, n, temperature=0.0)
        inner = model.model
        if impl == "mamba_ssm":
            return inner.generate(prompt, max_length=prompt.shape[1] + n)
        return inner.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def run_case(impl, name, backend, T, size, device, case_s, step_budget) -> dict:
    """Time one case (see the module docstring); never raises (errors are recorded)."""
    from mnemo.ops import dispatch, use_backend

    batch = max(1, size["tokens"] // T)
    rec = dict.fromkeys(CASE_FIELDS)
    rec.update(impl=impl, model=name, backend=backend, T=T, batch=batch, status="ok", reason="")
    model = opt = None
    try:
        model = _mnemo_model(name, size) if impl == "mnemo" else _Logits(_peer_model(name, size))
    except ImportError as e:
        rec.update(status="unavailable", reason=f"{type(e).__name__}: {e}")
        return rec
    except Exception as e:  # a peer's constructor refusing the configuration
        rec.update(status="error", reason=f"build: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return rec
    ctx = use_backend(backend) if impl == "mnemo" else contextlib.nullcontext()
    try:
        model = model.to(device)
        rec["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, size["vocab"], (batch, T), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dispatch.reset_dispatch_log()
        with ctx:
            model.train()
            forward = _first(model) if impl == "mnemo" else model  # mnemo returns (logits, state)
            rec["warmup_s"] = _train_step(model, forward, opt, ids, device)
            times, t_case = [], time.perf_counter()
            while len(times) < step_budget and time.perf_counter() - t_case < case_s:
                times.append(_train_step(model, forward, opt, ids, device))
            if not times:  # the warm-up alone used the case's time
                times = [rec["warmup_s"]]
            rec["train_step_s"] = statistics.median(times)
            rec["train_steps_timed"] = len(times)
            rec["train_tokens_per_s"] = batch * T / rec["train_step_s"]
            opt = None
            model.eval()
            prompt = torch.randint(0, size["vocab"], (1, size["prompt"]), generator=gen).to(device)
            _generate(impl, model, prompt, 2, device)  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            out = _generate(impl, model, prompt, size["new"], device)
            _sync(device)
            rec["generate_s"] = time.perf_counter() - t0
            new = out.shape[1] - prompt.shape[1]
            rec["decode_tokens_per_s"] = new / rec["generate_s"]
        if device.type == "cuda":
            rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        if impl == "mnemo":  # calls per (op, backend that ran), all reasons together
            rec["dispatch"] = {}
            for (op, b, _), n in sorted(dispatch.dispatch_log().items()):
                rec["dispatch"][f"{op}:{b}"] = rec["dispatch"].get(f"{op}:{b}", 0) + n
    except Exception as e:  # recorded: one case's failure must not end the check
        rec.update(
            status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        )
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


# ------------------------------------------------------------------------------------------------


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("gpu_check.json"), help="the JSON (default gpu_check.json)"
    )
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny size that runs anywhere (the test's)")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="mnemo presets, comma-separated")
    ap.add_argument("--no-peers", action="store_true", help="mnemo's cases only")
    ap.add_argument("--budget-s", type=float, default=300.0, help="seconds for all cases (default 300)")
    ap.add_argument("--case-s", type=float, default=8.0, help="seconds of timed steps per case (default 8)")
    ap.add_argument(
        "--min-case-s", type=float, default=20.0, help="start a case only with this left (default 20)"
    )
    ap.add_argument(
        "--max-step-s", type=float, default=3.0, help="skip longer T above this step time (default 3)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed train steps per case at most (default 3)")
    ap.add_argument("--tests-log", type=Path, help="a pytest log to summarise into the JSON (gpu_check.sh)")
    ap.add_argument("--tests-rc", type=int, help="that pytest run's exit status")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = dict(TINY if args.tiny else FULL)
    if args.tiny and args.min_case_s == ap.get_default("min_case_s"):
        args.min_case_s = 0.0
    models = [m for m in args.models.split(",") if m]
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    result = {
        "schema": SCHEMA,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "versions": versions(),
        "config": {
            "size": "tiny" if args.tiny else "full",
            "d_model": size["d_model"],
            "n_layers": size["n_layers"],
            "vocab_size": size["vocab"],
            "lengths": list(size["lengths"]),
            "tokens_per_step": size["tokens"],
            "gen_prompt": size["prompt"],
            "gen_tokens": size["new"],
            "precision": "bf16 autocast, float32 parameters",
            "budget_s": args.budget_s,
            "case_s": args.case_s,
            "max_step_s": args.max_step_s,
        },
        "tests": None,
        "complete": False,  # True once every case ran or was skipped
        "elapsed_s": None,
        "cases": [],
    }
    if args.tests_log is not None:
        text = args.tests_log.read_text(errors="replace") if args.tests_log.exists() else ""
        tail = [line for line in text.splitlines() if line.strip()][-1:] or [""]
        result["tests"] = {"rc": args.tests_rc, "summary": tail[0], "log": str(args.tests_log)}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    slow: dict[tuple[str, str, str], str] = {}  # (impl, model, backend) -> why its longer T are skipped
    for T in size["lengths"]:
        for name in models:
            variants = [("mnemo", name, "auto"), ("mnemo", name, "torch")]
            if not args.no_peers and name in PEERS:
                variants.append((PEERS[name][0], name, "-"))
            for impl, n, backend in variants:
                left = deadline - time.perf_counter()
                key = (impl, n, backend)
                if key in slow or left < args.min_case_s:
                    rec = dict.fromkeys(CASE_FIELDS)
                    why = (
                        slow.get(key)
                        or f"time budget: {left:.0f} s left < --min-case-s {args.min_case_s:.0f}"
                    )
                    rec.update(impl=impl, model=n, backend=backend, T=T, status="skipped", reason=why)
                else:
                    rec = run_case(impl, n, backend, T, size, device, min(args.case_s, left), args.steps)
                    step = rec["train_step_s"]
                    if rec["status"] != "ok":
                        slow[key] = f"failed at T={T}: {rec['status']}"
                    elif step is not None and step > args.max_step_s:
                        slow[key] = f"train step at T={T} took {step:.2f} s > --max-step-s {args.max_step_s}"
                result["cases"].append(rec)
                _write(args.out, result)  # after every case: a check stopped from outside leaves its cases
                msg = f"{impl:9s} {n:16s} {backend:6s} T={T:<6d} {rec['status']:11s}"
                if rec["status"] == "ok":
                    msg += (
                        f" step {rec['train_step_s']:.3f} s  {rec['train_tokens_per_s']:,.0f} tok/s"
                        f"  decode {rec['decode_tokens_per_s']:,.1f} tok/s"
                    )
                else:
                    msg += f" {rec['reason'][:100]}"
                print(msg, flush=True)
    result["elapsed_s"] = time.perf_counter() - t_start
    result["complete"] = True
    _write(args.out, result)
    print(f"wrote {args.out} ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
